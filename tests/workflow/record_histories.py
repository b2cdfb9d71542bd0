"""Record the histories that tests/workflow/test_replay.py replays.

    .venv/bin/python -m tests.workflow.record_histories

Runs the M5 story (cold request, warm request, keep-warm eviction, an unknown capability) on the
time-skipping server with real Postgres, and writes one history per workflow type. Re-record when a
workflow change is deliberately incompatible (and guard the change with `workflow.patched`)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from modelforge.temporal import register_search_attributes
from tests.harness import running_stack

HERE = Path(__file__).resolve().parents[1] / "histories"


async def main() -> None:
    import pgserver  # type: ignore[import-untyped]

    server = pgserver.get_server(str(Path("/tmp") / "modelforge-record-pg"), cleanup_mode="stop")
    binary = str(Path(sys.executable).parent / "temporal-test-server")
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=binary)
    try:
        await register_search_attributes(env.client)
        async with running_stack(env.client, server.get_uri()) as stack:
            cold = await stack.start_request("rag.embedding@1", tenant="rag", request_id="cold")
            await cold.result()
            warm = await stack.start_request("rag.embedding@1", tenant="rag", request_id="warm")
            await warm.result()
            unknown = await stack.start_request("vision.ocr@9", request_id="unknown")
            with contextlib.suppress(WorkflowFailureError):
                await unknown.result()
            await env.sleep(1000)
            handles = {
                "request_cold": cold,
                "request_warm": warm,
                "request_unknown_capability": unknown,
                "scheduler": stack.scheduler,
                "residency": env.client.get_workflow_handle("resident:rag.embedding@1:gpu-node/0"),
                "telemetry": env.client.get_workflow_handle("telemetry:gpu-node"),
            }
            HERE.mkdir(exist_ok=True)
            for name, handle in handles.items():
                history = await handle.fetch_history()
                (HERE / f"{name}.json").write_text(history.to_json())
                print(f"{name}: {len(history.events)} events")
    finally:
        await env.shutdown()
        server.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
