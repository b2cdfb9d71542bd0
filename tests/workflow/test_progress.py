"""What a user waiting on a request sees: the model load's progress (from its activity's
heartbeats), then the invoke, as `modelforge request` shows them on a terminal."""

from __future__ import annotations

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from workers.stack import running_stack

pytestmark = pytest.mark.workflow


async def test_progress_shows_the_load_then_the_invoke(dev_server_env: WorkflowEnvironment, database_url: str) -> None:
    async with running_stack(dev_server_env.client, database_url) as stack:
        lines: list[str] = []
        # rag.embedding@1 takes 4 s to load (the example catalog) and this invoke 3 s more.
        result = await ModelForgeClient(stack.client).request(
            "rag.embedding@1", {"simulate_invoke_s": 3}, tenant="rag", on_progress=lines.append
        )
        assert result.ok
        loading = [line for line in lines if "loading rag.embedding@1:" in line]
        assert loading and "on gpu-node/0" in loading[-1], lines
        assert any("/4 s" in line for line in loading), lines  # the heartbeat's own counter
        invoking = [line for line in lines if line.startswith("invoking")]
        assert invoking and any("invoking: " in line and "/3 s" in line for line in invoking), lines
        assert lines.index(loading[0]) < lines.index(invoking[0])  # in the order they happened
        # The request reads well in the Temporal UI: its memo says who asked for what.
        memo = await stack.client.get_workflow_handle(result.workflow_id).describe()
        assert (await memo.memo()) == {"capability": "rag.embedding@1", "tenant": "rag", "input_bytes": 24}
