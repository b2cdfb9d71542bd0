"""The Temporal UI as an operator uses it: headless Chromium (Debian's `chromium`) opens the dev
server's UI, lists request workflows filtered by the ModelForgeCapability search attribute, finds
the request, and saves the screenshot the README shows (docs/img/temporal-ui.png)."""

from __future__ import annotations

import asyncio
import os
import sys
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.temporal import register_search_attributes
from tests.browser.chromium import render_page
from tests.worker_process import free_port
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

ROOT = Path(__file__).resolve().parents[2]
SCREENSHOT = ROOT / "docs" / "img" / "temporal-ui.png"


@pytest.fixture
async def ui_env() -> AsyncIterator[tuple[WorkflowEnvironment, int]]:
    ui_port = free_port()
    binary = str(Path(sys.executable).parent / "temporal")
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=binary, ui=True, ui_port=ui_port, dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        yield env, ui_port
    finally:
        await env.shutdown()


async def test_an_operator_finds_a_request_by_capability_in_the_ui(
    ui_env: tuple[WorkflowEnvironment, int], database_url: str, tmp_path: Path
) -> None:
    env, ui_port = ui_env
    async with running_stack(env.client, database_url) as stack:
        client = ModelForgeClient(stack.client)
        found = await client.request("rag.embedding@1", input={"text": "hello"}, tenant="rag", request_id="ui-demo")
        other = await client.request("chat.small@1", input={"prompt": "hi"}, request_id="ui-other")
        assert found.ok and other.ok
        query = urllib.parse.quote('ModelForgeCapability="rag.embedding@1"')
        url = f"http://127.0.0.1:{ui_port}/namespaces/default/workflows?query={query}"
        dom = ""
        for _ in range(10):  # visibility trails the workflow by a moment
            dom = await asyncio.to_thread(render_page, url)
            if "request:rag.embedding@1:ui-demo" in dom:
                break
            await asyncio.sleep(1.0)
        assert "request:rag.embedding@1:ui-demo" in dom
        assert "request:chat.small@1:ui-other" not in dom  # the filter is the search attribute
        assert "CapabilityRequestWorkflow" in dom
        # A test run leaves the checkout clean: the README's screenshot is rewritten only when asked
        # (MODELFORGE_UPDATE_SCREENSHOT=1); otherwise it goes to the test's own folder.
        shot = SCREENSHOT if os.environ.get("MODELFORGE_UPDATE_SCREENSHOT") == "1" else tmp_path / "temporal-ui.png"
        shot.parent.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(render_page, url, screenshot=shot)
        assert shot.stat().st_size > 10_000
