"""A ModelForge stack on loopback for the scripts that drive real applications against it
(open_webui_check.py, agent_cli_check.py): `modelforge dev` with a catalog of the caller's, then
`modelforge gateway`. Each process runs in a session of its own and is stopped with its children.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent

# The toy model server (a real HTTP server streaming tokens, tools, reasoning: no GPU) behind a
# simulated 24 GiB card; `{model}` is the name clients call it by.
TOY_CATALOG = """
[[accelerators]]
id = "gpu-node/0"
node = "gpu-node"
model = "Simulated RTX 3090 24GB"
total_bytes = 25769803776
production_eligible = true
simulated = true

[[deployments]]
capability = "toy.chat@1"
envelope_bytes = 1073741824
residency = "keep_warm"
concurrency = 4
runtime = "subprocess_http"
command = {command}
runtime_config = {{ api = "openai_chat", ready_timeout_s = "60" }}
openai_models = ["{model}"]

[[tenants]]
name = "default"
default_priority = "interactive"
max_priority = "interactive"
"""


def toy_catalog(model: str) -> str:
    command = [sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}", "--token-delay-ms", "20"]
    return TOY_CATALOG.format(command=json.dumps(command), model=model)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def wait_http(url: str, seconds: float, what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"{what} exited ({process.returncode}) before answering {url}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=5) as answer:
            if answer.status < 500:
                return
        time.sleep(1)
    raise SystemExit(f"{what} did not answer {url} in {seconds:.0f} s")


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        process = subprocess.Popen(  # noqa: S603 (an argument list of our own)
            argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@contextlib.contextmanager
def modelforge_stack(catalog_text: str, scratch: Path) -> Iterator[int]:
    """`modelforge dev` on `catalog_text` and the gateway, logs under `scratch`; yields the
    gateway's port once it answers."""
    catalog = scratch / "catalog.toml"
    catalog.write_text(catalog_text)
    env = {
        **os.environ,
        "MODELFORGE_HOME": str(scratch / "home"),
        "MODELFORGE_TEMPORAL_ADDRESS": f"localhost:{free_port()}",
        "MODELFORGE_METRICS_PORT": str(free_port()),
    }
    modelforge = str(BIN / "modelforge")
    with started(
        [modelforge, "dev", "--catalog", str(catalog), "--ui-port", str(free_port())], env, scratch / "dev.log"
    ) as dev:
        deadline = time.monotonic() + 300
        while subprocess.run([modelforge, "status"], env=env, capture_output=True).returncode:  # noqa: S603
            if dev.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"modelforge dev did not come up: {scratch / 'dev.log'}")
            time.sleep(2)
        port = free_port()
        with started(
            [modelforge, "gateway", "--host", "127.0.0.1", "--port", str(port)],
            {**env, "MODELFORGE_METRICS_PORT": str(free_port())},
            scratch / "gateway.log",
        ) as gateway:
            wait_http(f"http://127.0.0.1:{port}/api/version", 120, "modelforge gateway", gateway)
            yield port


def gateway_requests(scratch: Path) -> list[dict[str, Any]]:
    """The gateway's access log lines (`gateway_request`) from the stack's log."""
    lines = (scratch / "gateway.log").read_text().splitlines()
    seen = [json.loads(line) for line in lines if line.startswith("{")]
    return [r for r in seen if r.get("event") == "gateway_request"]
