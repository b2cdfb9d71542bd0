"""The gateway as the gateway, app and browser tests serve it: in process, on a free loopback
port, over a running test stack (workers/stack.py), with the catalogs they add to it. A helper
module, not a test module: the test modules import it, never each other."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from modelforge.client import ModelForgeClient
from modelforge.gateway import GatewayConfig, create_app, gateway_server
from modelforge.runtimes import SubprocessHttpRuntime
from workers.stack import _SERVERS, Stack

# The gateway tests' catalog: simulated models (small-chat, all-MiniLM-L6-v2, a slow job).
CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "gateway.toml"
TEAM_KEY = "sk-team-0123456789abcdef"

# Added to CATALOG by the Ollama and app tests: a chat model that is unloaded once its last
# request ends, and a chat model served by the project's toy server (an OpenAI-compatible
# server: it takes options, and fills in the middle: `insert`).
ON_DEMAND_AND_TOY_CHAT = f"""
[[deployments]]
capability = "chat.ondemand@1"
envelope_bytes = 2147483648
residency = "load_on_demand"
concurrency = 1
measured_on = ["Simulated RTX 3090 24GB"]
openai_models = ["ondemand-chat"]

[[deployments]]
capability = "chat.toy@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 2
runtime = "subprocess_http"
command = [{json.dumps(sys.executable)}, "-m", "modelforge.runtimes.toy_server", "--port", "{{port}}"]
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["toy-chat"]
context_length = 32768
features = ["tools", "thinking", "insert"]
"""


class Served:
    def __init__(self, stack: Stack, base_url: str) -> None:
        self.stack = stack
        self.base_url = base_url


async def serve(stack: Stack, config: GatewayConfig) -> AsyncIterator[Served]:
    app = create_app(ModelForgeClient(stack.client), stack.store.load_catalog, config)
    server = gateway_server(app, "127.0.0.1", 0)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield Served(stack, f"http://127.0.0.1:{port}")
    finally:
        server.should_exit = True
        await task


def toy_deployment(capability: str, model: str, api: str, *extra: str) -> str:
    """A catalog entry for a model served by the project's toy server (`extra`: its flags)."""
    command = json.dumps([sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}", *extra])
    return f"""
[[deployments]]
capability = "{capability}"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 4
runtime = "subprocess_http"
command = {command}
runtime_config = {{ api = "{api}", ready_timeout_s = "30" }}
openai_models = ["{model}"]
"""


async def toy_requests(capability: str) -> list[dict[str, Any]]:
    """The request bodies the toy server serving `capability` received."""
    runtimes: list[SubprocessHttpRuntime] = [r for rs in _SERVERS.values() for r in rs]
    [server] = [s for r in runtimes for key, s in r._servers.items() if key.startswith(capability)]
    requests: list[dict[str, Any]] = (await server.client.get("/received")).json()["requests"]
    return requests
