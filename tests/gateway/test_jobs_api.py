"""POST /v1/jobs against the dev stack: a real job (examples/jobs/merge_slerp.py, runtime
subprocess_job) submitted over HTTP runs under its max_duration and its output comes back; a
deployment that is not a job, a bad duration, a job past its max_duration and a card count the
deployment does not have are refused with their class in the gateway's error shape. And, with a
recording stand-in for Temporal (no stack), `nvlink`: put in the job's input for a deployment
that requires an NVLink group, refused (400, param nvlink) for any other before anything is sent."""

from __future__ import annotations

import dataclasses
import os
import shutil
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.catalog import parse_catalog
from modelforge.client import Result
from modelforge.domain import Catalog
from modelforge.failures import FailureClass
from modelforge.gateway import GatewayConfig, create_app
from modelforge.runtimes import job_log_dirs
from tests.gateway.serving import serve
from tests.workflow.job_catalogs import catalog_for_test
from workers.stack import running_stack

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "jobs" / "merge.toml"


def _error(answer: httpx.Response, status: int, failure: str, param: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = answer.json()
    assert answer.status_code == status, body
    assert body["failure_class"] == failure and body["error"]["modelforge_class"] == failure
    if param is not None:
        assert body["error"]["param"] == param
    return body


@pytest.mark.workflow
async def test_a_job_over_http_runs_and_answers_its_output_and_refusals_are_typed(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    pytest.importorskip("numpy")  # the merge example's only dependency
    home = tmp_path / "node-home"  # the stack's node workers' home
    ids = [f"http-job-{os.urandom(4).hex()}" for _ in range(3)]
    try:
        async with running_stack(
            dev_server_env.client, database_url, catalog_path=catalog_for_test(tmp_path), home=home
        ) as stack:
            async for gateway in serve(stack, GatewayConfig()):
                await _jobs(gateway.base_url, ids)
    finally:
        for request_id in ids:
            for directory in job_log_dirs(home, request_id):
                shutil.rmtree(directory.parent, ignore_errors=True)
            shutil.rmtree(home / "checkpoints" / request_id, ignore_errors=True)


async def _jobs(base_url: str, ids: list[str]) -> None:
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers={"X-ModelForge-Tenant": "lab"}) as http:
        done = await http.post(
            "/v1/jobs",
            json={
                "capability": "merge.slerp.cpu@1",
                "args": ["--layers", "3", "--t", "0.25"],
                "max_duration_s": 120,
                "request_id": ids[0],
            },
        )
        assert done.status_code == 200, done.text
        answer = done.json()
        assert answer["request_id"] == ids[0] and answer["capability"] == "merge.slerp.cpu@1"
        output = answer["output"]
        assert output["exit_code"] == 0 and output["result"] == {"layers": 3, "t": 0.25}
        assert {"merged.npy", "manifest.json"} <= {Path(o["path"]).name for o in output["outputs"]}
        assert all(o["artifact"].startswith("artifact:sha256:") for o in output["outputs"])
        assert answer["timings"] and answer["lease"]["tenant"] == "lab"
        assert Path(output["log"]).is_file()

        # Not a job: the chat model runs on the simulated runtime. Refused before any workflow.
        chat = await http.post("/v1/jobs", json={"capability": "chat.llm@1", "max_duration_s": 60})
        body = _error(chat, 400, FailureClass.REQUEST_INVALID.value, "capability")
        assert "runtime 'simulated', not subprocess_job" in body["error"]["message"]
        unknown = await http.post("/v1/jobs", json={"capability": "nope@1", "max_duration_s": 60})
        _error(unknown, 404, FailureClass.CAPABILITY_UNAVAILABLE.value, "capability")
        for duration in (0, 0.5, 7 * 86400 + 1):
            bad = await http.post("/v1/jobs", json={"capability": "merge.slerp.cpu@1", "max_duration_s": duration})
            _error(bad, 400, FailureClass.REQUEST_INVALID.value, "max_duration_s")
        missing = await http.post("/v1/jobs", json={"capability": "merge.slerp.cpu@1"})
        assert _error(missing, 400, FailureClass.REQUEST_INVALID.value)["error"]["code"] == (
            "missing_required_parameter"
        )
        extra = await http.post("/v1/jobs", json={"capability": "merge.slerp.cpu@1", "max_duration_s": 60, "input": {}})
        _error(extra, 400, FailureClass.REQUEST_INVALID.value, "input")

        # The node refuses a card count the deployment does not have, typed.
        cards = await http.post(
            "/v1/jobs",
            json={"capability": "merge.slerp.cpu@1", "max_duration_s": 60, "gpu_count": 2, "request_id": ids[2]},
        )
        body = _error(cards, 400, FailureClass.REQUEST_INVALID.value)
        assert "the job asks for 2 cards; merge.slerp.cpu@1 runs on 1" in body["error"]["message"]

        # Past its max_duration the job is stopped: TIMEOUT, 504, with its request id.
        slow = await http.post(
            "/v1/jobs",
            json={
                "capability": "merge.slerp.cpu@1",
                "args": ["--layers", "12", "--layer-delay-s", "30"],
                "max_duration_s": 3,
                "request_id": ids[1],
            },
        )
        body = _error(slow, 504, FailureClass.TIMEOUT.value)
        assert body["request_id"] == ids[1] and "max_duration" in body["error"]["message"]


class _Recording:
    """Stands in for ModelForgeClient: keeps what would be sent and answers ok."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def request(self, capability: str, input: dict[str, Any] | None = None, **options: Any) -> Result:
        self.calls.append({"capability": capability, "input": input, **options})
        return Result(ok=True, request_id=options["request_id"], capability=capability, output={"exit_code": 0})

    async def status(self) -> Any:
        raise NotImplementedError

    async def residency(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


async def _example_catalog() -> Catalog:
    """The example jobs catalog, its card merge marked as requiring an NVLink group."""
    catalog, _ = parse_catalog(tomllib.loads(EXAMPLE.read_text()))
    deployments = [
        dataclasses.replace(d, nvlink_required=True) if d.capability == "merge.slerp@1" else d
        for d in catalog.deployments
    ]
    return dataclasses.replace(catalog, deployments=deployments)


async def test_nvlink_over_http_reaches_the_jobs_input_or_is_refused_before_anything_is_sent() -> None:
    requester = _Recording()
    app = create_app(requester, _example_catalog, GatewayConfig())
    transport = httpx.ASGITransport(app=app)
    headers = {"X-ModelForge-Tenant": "lab"}
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway", headers=headers) as http:
        job = {"capability": "merge.slerp@1", "args": ["--t", "0.5"], "max_duration_s": 60}
        honoured = await http.post("/v1/jobs", json={**job, "nvlink": True, "request_id": "nv-1"})
        assert honoured.status_code == 200, honoured.text
        plain = await http.post("/v1/jobs", json={**job, "nvlink": False, "request_id": "nv-2"})
        assert plain.status_code == 200, plain.text
        assert [(c["capability"], c["input"], c["max_duration_s"]) for c in requester.calls] == [
            ("merge.slerp@1", {"args": ["--t", "0.5"], "nvlink": True}, 60),
            ("merge.slerp@1", {"args": ["--t", "0.5"]}, 60),  # nvlink false: nothing asked, as before
        ]

        # A deployment that does not require an NVLink group: refused as the node would, unsent.
        requester.calls.clear()
        refused = await http.post("/v1/jobs", json={**job, "capability": "merge.slerp.cpu@1", "nvlink": True})
        body = _error(refused, 400, FailureClass.REQUEST_INVALID.value, "nvlink")
        assert "merge.slerp.cpu@1 does not require an NVLink group" in body["error"]["message"]
        for bad in ("true", 1, None):  # a JSON boolean only
            wrong = await http.post("/v1/jobs", json={**job, "nvlink": bad})
            _error(wrong, 400, FailureClass.REQUEST_INVALID.value, "nvlink")
        assert requester.calls == []
