"""The gateway's status page as an operator opens it: headless Chromium (Debian's `chromium`)
loads /ui with an operator's key (HTTP Basic, as a browser sends it), the page's script polls its
JSON and draws each card's memory (the external Ollama process named), the residents and the
queue with each waiting request's verdict; the screenshot the README shows is saved
(docs/img/status-page.png, with MODELFORGE_UPDATE_SCREENSHOT=1). Tenants' keys and no key are refused."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import httpx
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.gateway import GatewayConfig
from tests.browser.chromium import render_page
from tests.gateway.serving import CATALOG, serve
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

SCREENSHOT = Path(__file__).resolve().parents[2] / "docs" / "img" / "status-page.png"
OPERATOR_KEY = "sk-operator-0123456789abcdef"
TENANT_KEY = "sk-tenant-0123456789abcdef"


def _basic(key: str) -> str:
    return "Basic " + base64.b64encode(f"ops:{key}".encode()).decode()


async def test_an_operator_sees_cards_residents_and_the_queue_with_verdicts(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    config = GatewayConfig(api_keys={OPERATOR_KEY: "ops", TENANT_KEY: "default"}, operator_tenants=frozenset({"ops"}))
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        async for served in serve(stack, config):
            tenant = {"Authorization": f"Bearer {TENANT_KEY}"}
            async with httpx.AsyncClient(base_url=served.base_url, timeout=60) as http:
                refused = await http.get("/ui")
                assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")
                assert (await http.get("/ui/status.json", headers=tenant)).status_code == 403
                assert (await http.get("/ui", headers={"Authorization": _basic(TENANT_KEY)})).status_code == 403

                # A resident model, a job running and one waiting behind it.
                warm = await http.post(
                    "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "x"}, headers=tenant
                )
                assert warm.status_code == 200, warm.text
                slow = {"capability": "slow.job@1", "input": {"simulate_invoke_s": 30}}
                running = asyncio.create_task(
                    http.post("/v1/requests", json={**slow, "request_id": "busy-1"}, headers=tenant)
                )
                for _ in range(300):
                    if (await http.get("/v1/status", headers=tenant)).json()["active_leases"] >= 1:
                        break
                    await asyncio.sleep(0.1)
                waiting = asyncio.create_task(
                    http.post("/v1/requests", json={**slow, "request_id": "behind-1"}, headers=tenant)
                )
                operator = {"Authorization": _basic(OPERATOR_KEY)}
                for _ in range(100):
                    picture = (await http.get("/ui/status.json", headers=operator)).json()
                    if picture["pools"][0]["queue"]:
                        break
                    await asyncio.sleep(0.2)
                [pool] = picture["pools"]
                [card] = pool["cards"]
                assert [p["name"] for p in card["external"]] == ["ollama"]
                assert card["external"][0]["bytes"] == 6 * 1024**3 and card["resident_bytes"] > 0
                assert {r["deployment"] for r in pool["residents"]} >= {"rag.embedding@1", "slow.job@1"}
                [queued] = pool["queue"]
                assert queued["request_id"] == "behind-1" and queued["position"]["in_class"] == 1, queued

                url = served.base_url.replace("http://", f"http://ops:{OPERATOR_KEY}@") + "/ui"
                dom = await asyncio.to_thread(render_page, url)
                assert 'data-card="gpu-node/0"' in dom, dom[-2000:]
                assert "ollama (pid" in dom and "behind-1" in dom and "rag.embedding@1" in dom
                assert (queued["message"] or queued["reason"]) in dom
                # A test run leaves the checkout clean: the README's screenshot is rewritten only
                # when asked (MODELFORGE_UPDATE_SCREENSHOT=1, as tests/browser/test_temporal_ui.py
                # does); otherwise it goes to the test's own folder.
                shot = (
                    SCREENSHOT
                    if os.environ.get("MODELFORGE_UPDATE_SCREENSHOT") == "1"
                    else tmp_path / "status-page.png"
                )
                await asyncio.to_thread(render_page, url, screenshot=shot)
                assert shot.stat().st_size > 10_000
                for task in (running, waiting):
                    task.cancel()
