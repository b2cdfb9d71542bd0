"""The control worker's /metrics, scraped over HTTP and parsed as Prometheus parses it."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from modelforge.metrics import Metrics
from workers.stack import running_stack

pytestmark = pytest.mark.workflow


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    found = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return found


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


async def test_metrics_scrape_shows_bytes_queues_latency_and_failures(
    time_skipping_env: WorkflowEnvironment, database_url: str
) -> None:
    metrics = Metrics()
    port = metrics.serve(0, addr="127.0.0.1")
    async with running_stack(time_skipping_env.client, database_url, metrics=metrics) as stack:
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()
        await (await stack.start_request("rag.embedding@1", tenant="rag")).result()
        refused = await stack.start_request("rag.embedding@1", tenant="mallory")
        with pytest.raises(WorkflowFailureError):
            await refused.result()
        await stack.events("request_refused", at_least=1)
        await stack.events("lease_granted", at_least=2)
        stop = asyncio.Event()
        stop.set()  # one sample, then return
        await metrics.poll("default", stack.status, stop=stop)
        status = await stack.status()

        async with httpx.AsyncClient() as http:
            scraped = await http.get(f"http://127.0.0.1:{port}/metrics")
        assert scraped.status_code == 200
        samples = _samples(scraped.text)

    gpu = next(a for a in status.accelerators if a.id == "gpu-node/0")
    for kind in ("total", "external", "resident", "leased", "reserve", "schedulable"):
        labels = {"pool": "default", "accelerator": "gpu-node/0", "kind": kind, "simulated": "true"}
        assert _value(samples, "modelforge_accelerator_bytes", **labels) == getattr(gpu, f"{kind}_bytes"), kind
    assert _value(samples, "modelforge_queue_depth", pool="default", priority="production") == 0
    assert _value(samples, "modelforge_scheduler_up", pool="default") == 1
    assert _value(samples, "modelforge_resident_models", pool="default", state="ready") == 1
    # Two grants, both production: one after a cold load, one warm.
    assert _value(samples, "modelforge_admission_seconds_count", priority="production") == 2
    assert _value(samples, "modelforge_loads_total", deployment="rag.embedding@1") == 1
    assert _value(samples, "modelforge_failures_total", failure_class="REQUEST_INVALID", kind="request_refused") == 1


async def test_a_scheduler_that_does_not_answer_shows_as_down() -> None:
    metrics = Metrics()

    async def silent() -> object:
        raise TimeoutError("no answer")

    stop = asyncio.Event()
    stop.set()
    await metrics.poll("default", silent, stop=stop)  # type: ignore[arg-type]
    samples = _samples(metrics_text(metrics))
    assert _value(samples, "modelforge_scheduler_up", pool="default") == 0


def metrics_text(metrics: Metrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(metrics.registry).decode()
