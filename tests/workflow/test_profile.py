"""`modelforge profile`: a deployment nobody measured is refused for production; profiling it
(under an ordinary lease) stores its envelope, and production requests are then admitted on that
accelerator model. Also the real MiniLM profiled on the CPU device."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.store import Store
from tests.cli_process import run_cli
from workers.stack import running_stack

TEMPLATE = Path(__file__).resolve().parents[1] / "catalogs" / "profile.toml"
GiB = 1024**3


def cli_env(environment: WorkflowEnvironment, database_url: str, home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(
        MODELFORGE_TEMPORAL_ADDRESS=environment.client.service_client.config.target_host,
        MODELFORGE_DATABASE_URL=database_url,
        MODELFORGE_HOME=str(home),
        COLUMNS="160",
    )
    return env


@pytest.mark.workflow
async def test_profile_stores_the_envelope_and_opens_production(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    catalog = tmp_path / "profile.toml"
    catalog.write_text(TEMPLATE.read_text().replace('["python",', f"[{json.dumps(sys.executable)},"))
    env = cli_env(dev_server_env, database_url, tmp_path)
    request = [sys.executable, "-m", "modelforge", "request", "toy.embedding@1", "--json", "--tenant", "rag"]
    async with running_stack(dev_server_env.client, database_url, catalog, telemetry_interval_s=1.0) as stack:
        code, out, _ = await run_cli([*request, "--input", '{"text": "hello"}'], env, 60)
        refused = json.loads(out)
        assert code == 1 and refused["failure_class"] == "CAPABILITY_UNAVAILABLE"
        assert "box/0" in refused["message"] and "measured" in refused["message"]

        profile = [sys.executable, "-m", "modelforge", "profile", "toy.embedding@1"]
        code, out, errors = await run_cli(
            [*profile, "--batch-sizes", "1,4", "--context-words", "8", "--json"], env, 120
        )
        assert code == 0, errors
        envelope = json.loads(out)
        assert (envelope["deployment"], envelope["accelerator"], envelope["accelerator_model"]) == (
            "toy.embedding@1",
            "box/0",
            "Simulated L4 24GB",
        )
        # On a simulated card the server's bytes are the catalog's idle bytes, recorded for its pid.
        assert envelope["simulated"] and envelope["idle_bytes"] == envelope["peak_bytes"] == GiB
        assert [(c["batch_size"], c["concurrency"]) for c in envelope["cases"]] == [(1, 1), (4, 1), (1, 2), (4, 2)]
        assert envelope["configuration"]["runtime_config"]["api"] == "openai_embeddings"

        stored = await stack.store.envelopes(deployment="toy.embedding@1")
        assert [(r["accelerator_model"], r["peak_bytes"], r["simulated"]) for r in stored] == [
            ("Simulated L4 24GB", GiB, True)
        ]
        # The profile's lease went through admission like any other and is in the ledger.
        # (The event log trails the scheduler by up to a second.)
        granted = await stack.events("lease_granted", at_least=1)
        assert any(e["payload"]["priority"] == "benchmark" for e in granted)
        ledger = await stack.store.ledger()
        assert any(row["priority"] == "benchmark" and row["capability"] == "toy.embedding@1" for row in ledger)

        # The scheduler reloaded its catalog with the envelope: production is admitted now.
        code, out, errors = await run_cli([*request, "--input", '{"text": "hello"}'], env, 60)
        served = json.loads(out)
        assert code == 0 and served["ok"], (out, errors)
        assert served["output"]["dimensions"] == 64

        code, out, _ = await run_cli([sys.executable, "-m", "modelforge", "envelopes"], env, 60)
        assert code == 0 and "Simulated L4 24GB (simulated)" in out and "toy.embedding@1" in out

        code, _, errors = await run_cli([*profile[:-1], "nope@1"], env, 60)
        assert code == 2 and "REQUEST_INVALID: no deployment 'nope@1'" in errors

        # The real embedding model on the CPU device: its working set grows with the batch.
        code, out, errors = await run_cli(
            [*profile[:-1], "rag.embedding.cpu@1", "--batch-sizes", "1,64", "--context-words", "128", "--json"],
            env,
            180,
        )
        assert code == 0, errors
        cpu = json.loads(out)
        assert cpu["accelerator"] == "box/cpu" and not cpu["simulated"]
        assert "sentence-transformers" in cpu["runtime_version"] and "torch 2.13.0" in cpu["runtime_version"]
        assert 0 < cpu["idle_bytes"] <= cpu["peak_bytes"]
        assert len(cpu["cases"]) == 4


async def test_measured_envelopes_widen_the_catalog(database_url: str) -> None:
    from modelforge.domain import Catalog, Deployment
    from modelforge.store._store import with_measured_envelopes

    declared = Deployment(capability="e@1", envelope_bytes=2 * GiB, measured_on=["A"])
    catalog = Catalog(deployments=[declared, Deployment(capability="other@1", envelope_bytes=GiB)])
    # Measured on B: idle 1.5 GiB, peak 3 GiB (above the declared 2 GiB); on A: peak 1 GiB.
    widened = with_measured_envelopes(catalog, [("e@1", "B", 3 * GiB // 2, 3 * GiB), ("e@1", "A", GiB // 2, GiB)])
    e = widened.deployment("e@1")
    assert e is not None
    assert (e.envelope_bytes, e.idle_bytes, e.measured_on) == (3 * GiB, 3 * GiB // 2, ["A", "B"])
    assert widened.deployment("other@1") == catalog.deployment("other@1")
    store = await Store.open(database_url)
    try:
        await store.migrate()
        assert await store.envelopes() == []
    finally:
        await store.close()
