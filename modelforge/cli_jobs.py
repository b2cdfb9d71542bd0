"""Jobs (runtime `subprocess_job`) on the command line: `modelforge job submit` runs one under a
lease of its --max-duration, `modelforge logs` prints its output as its node keeps it, under
`$MODELFORGE_HOME/jobs/<node>/<request id>/<run>/job.log`. modelforge/cli.py imports this module,
which adds its commands to the app."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from modelforge.cli_common import (
    Group,
    JsonOption,
    _check_identifiers,
    _fail,
    _json,
    _run,
    _settings,
    app,
    err,
    out,
    parse_duration,
    render_output,
)
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import REQUEST_WORKFLOW_TYPE, is_request_workflow_id

# A job attempt that ended one of these ways is the request's last word (a preempted or stopped
# one comes back as the next attempt, in the same log).
FINAL_STATES = ("succeeded", "timeout")


def _state(directory: Path) -> str:
    try:
        status: Any = json.loads((directory / "status.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    return str(status.get("state", "")) if isinstance(status, dict) else ""


def _finished(directory: Path) -> bool:
    state = _state(directory)
    return state in FINAL_STATES or state.startswith("failed")


def latest_log(home: Path, request_id: str) -> Path | None:
    """The request's newest job directory on this host, or None."""
    from modelforge.runtimes import job_log_dirs

    found = job_log_dirs(home, request_id)
    return found[-1] if found else None


def follow_log(
    home: Path,
    request_id: str,
    write: Any,
    follow: bool,
    poll_s: float = 0.25,
    deadline_s: float | None = None,
) -> str:
    """Write the request's job log; with `follow`, keep writing what is appended (waiting for the
    job to start if need be) until its last attempt ends. Returns the job's state."""
    started = time.monotonic()
    directory = latest_log(home, request_id)
    while directory is None:
        if not follow:
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                f"no job log of request {request_id!r} under {home / 'jobs'} (logs are kept on the node that "
                "ran the job, under its MODELFORGE_HOME)",
            )
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            return ""
        time.sleep(poll_s)
        directory = latest_log(home, request_id)
    offset = 0
    while True:
        done = _finished(directory)  # before reading: what it wrote before it ended is read below
        with (directory / "job.log").open("rb") as stream:
            stream.seek(offset)
            chunk = stream.read()
        if chunk:
            offset += len(chunk)
            write(chunk)
        if not follow or done:
            return _state(directory)
        if deadline_s is not None and time.monotonic() - started > deadline_s:
            return _state(directory)
        time.sleep(poll_s)
        newer = latest_log(home, request_id)
        if newer is not None and newer != directory:  # the request ran again (a new run)
            directory, offset = newer, 0


# --- jobs across nodes, through Temporal --------------------------------------------------------
# A job's log and status files live on the node that ran it. What every host can read is
# Temporal: a running job's progress is its invoke activity's heartbeat detail ("job 40%: merged
# layer 3"), and a finished job's answer carries the end of its log (`log_tail`), or its failure
# quotes it.

SCAN_LIMIT = 2000  # request workflows looked through for an id, newest first


async def find_request_workflow(temporal: Any, request_id: str, scan: int = SCAN_LIMIT) -> str | None:
    """The id of the request workflow for `request_id` (`request:<capability>:<request id>`),
    among the newest `scan` request workflows, or None."""
    seen = 0
    async for execution in temporal.list_workflows(f"WorkflowType = '{REQUEST_WORKFLOW_TYPE}'"):
        if is_request_workflow_id(execution.id, request_id):
            return str(execution.id)
        seen += 1
        if seen >= scan:
            break
    return None


async def _invoke_heartbeat(temporal: Any, described: Any) -> tuple[str, str]:
    """The running invoke's latest heartbeat detail and the worker that runs it ("" when none)."""
    for pending in described.raw_description.pending_activities:
        if pending.activity_type.name != "invoke":
            continue
        details = pending.heartbeat_details.payloads
        decoded = await temporal.data_converter.decode(list(details)) if details else []
        return (str(decoded[-1]) if decoded else ""), str(pending.last_worker_identity)
    return "", ""


async def remote_job(temporal: Any, request_id: str) -> dict[str, Any] | None:
    """What Temporal knows of a job, from any host: {"request_id", "workflow_id", "state"
    (running, completed, failed...), "line" (the invoke's latest heartbeat: its progress line),
    "worker" (the node worker running it), and once it ended "ok", "log" (the path on its node),
    "log_tail", "progress", "message", or "failure"}. None when no request workflow has the id."""
    from temporalio.client import WorkflowExecutionStatus, WorkflowFailureError

    from modelforge.messages import RequestResult

    workflow_id = await find_request_workflow(temporal, request_id)
    if workflow_id is None:
        return None
    handle = temporal.get_workflow_handle(workflow_id)
    described = await handle.describe()
    status = described.status
    line, worker = await _invoke_heartbeat(temporal, described)
    row: dict[str, Any] = {
        "request_id": request_id,
        "workflow_id": workflow_id,
        "state": status.name.lower() if status is not None else "",
        "line": line,
        "worker": worker,
    }
    if status == WorkflowExecutionStatus.COMPLETED:
        result = await temporal.get_workflow_handle(workflow_id, result_type=RequestResult).result()
        output: Any = result.output
        if isinstance(output, dict) and "modelforge_output_ref" in output:
            from modelforge.payloads import get_output, payload_store

            output = await asyncio.to_thread(get_output, payload_store(temporal), output)
        if not isinstance(output, dict):
            output = {}
        row.update(
            ok="exit_code" in output,
            log=str(output.get("log", "")),
            log_tail=str(output.get("log_tail", "")),
            progress=output.get("progress"),
            message=str(output.get("message", "")),
        )
    elif status is not None and status != WorkflowExecutionStatus.RUNNING:
        try:
            await handle.result()
        except WorkflowFailureError as error:  # a job's failure quotes the end of its log
            cause = error.cause
            kind = getattr(cause, "type", None) or type(cause or error).__name__
            row.update(ok=False, failure=f"{kind}: {getattr(cause, 'message', None) or cause or error}")
        except Exception as error:
            row.update(ok=False, failure=f"{type(error).__name__}: {error}")
    return row


async def running_jobs(temporal: Any, limit: int = 50) -> list[dict[str, Any]]:
    """The jobs running on any node: running request workflows whose invoke heartbeats a job's
    progress line ("job 40%: ..."), newest first, each as `remote_job` describes it."""
    rows: list[dict[str, Any]] = []
    query = f"WorkflowType = '{REQUEST_WORKFLOW_TYPE}' AND ExecutionStatus = 'Running'"
    async for execution in temporal.list_workflows(query):
        described = await temporal.get_workflow_handle(execution.id).describe()
        line, worker = await _invoke_heartbeat(temporal, described)
        if line.startswith("job "):
            rows.append(
                {
                    "request_id": execution.id.rsplit(":", 1)[-1],
                    "workflow_id": execution.id,
                    "state": "running",
                    "line": line,
                    "worker": worker,
                    "started_at": execution.start_time.timestamp() if execution.start_time else None,
                }
            )
            if len(rows) >= limit:
                break
    return rows


def _print_remote(row: dict[str, Any], write: Any) -> None:
    if row.get("log_tail"):
        write(row["log_tail"].encode())
    if row.get("failure"):
        write(f"[modelforge] {row['failure']}\n".encode())
    where = f"; the whole log is on its node: {row['log']}" if row.get("log") else ""
    write(f"[modelforge] {row['workflow_id']}: {row['state']}{where} (read through Temporal)\n".encode())


async def follow_remote(
    temporal: Any, request_id: str, write: Any, follow: bool, home: Path, poll_s: float = 1.0
) -> str | None:
    """A job this host has no log of, read through Temporal (`remote_job`): its progress line
    while it runs (with `follow`, each new one until it ends), then the end of its log, or its
    failure. "" when a local log appears meanwhile (the job was only queued: the caller follows
    that), None when Temporal knows no such request; else its state."""
    row = await remote_job(temporal, request_id)
    if row is None:
        return None
    last = ""
    while row["state"] == "running":
        if row["line"] and row["line"] != last:
            last = row["line"]
            worker = f" on {row['worker']}" if row["worker"] else ""
            write(f"[modelforge] {row['workflow_id']}{worker}: {last}\n".encode())
        if not follow:
            return "running"
        if latest_log(home, request_id) is not None:
            return ""
        await asyncio.sleep(poll_s)
        row = await remote_job(temporal, request_id) or row
    _print_remote(row, write)
    return "succeeded" if row.get("ok") else "failed"


@app.command()
def logs(
    request_id: Annotated[str, typer.Argument(help="The job's request id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing what the job writes until it ends.")
    ] = False,
) -> None:
    """Print a job's log (stdout and stderr of every attempt), kept on the node that ran it.

    On another host (no log of the request here) it asks Temporal: a running job's progress
    line (with --follow, each new one until it ends), then the end of its log (the last 4 KiB)
    or its failure, and where the whole log lies on its node."""
    settings = _settings()

    def write(chunk: bytes) -> None:
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    if latest_log(settings.home, request_id) is None:
        remote = _remote_logs(settings, request_id, write, follow)
        if remote:
            raise typer.Exit(0 if remote in ("succeeded", "running") else 1)
    try:
        state = follow_log(settings.home, request_id, write, follow)
    except ModelForgeError as error:
        _fail(error, 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(1 if state.startswith("failed") or state == "timeout" else 0)


def _remote_logs(settings: Any, request_id: str, write: Any, follow: bool) -> str | None:
    """`follow_remote` on a Temporal connection of its own; None when Temporal cannot be reached
    or knows no such request (the local log is then waited for or refused, as before)."""
    from modelforge.temporal import connect

    async def go() -> str | None:
        try:
            temporal = await asyncio.wait_for(connect(settings), 10)
        except Exception:
            return None
        try:
            return await follow_remote(temporal, request_id, write, follow, settings.home) or None
        except Exception as error:
            err.print(f"[yellow]note[/yellow]: Temporal: {escape(type(error).__name__)}: {escape(str(error))}")
            return None

    def runner() -> str | None:
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # the usual case: a command line, no loop running
            return asyncio.run(go())
        # Called from a running loop (a program embedding the CLI, a test): a thread of its own.
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            return pool.submit(lambda: asyncio.run(go())).result()

    try:
        return runner()
    except KeyboardInterrupt:
        raise typer.Exit(130) from None


# A job TOML (`modelforge job submit --file job.toml`): these keys, each optional but `capability`
# (given here or on the command line); what the command line gives wins.
JOB_FILE_KEYS = {
    "capability": "a capability, name@version",
    "args": "a list of strings",
    "gpu_count": "an integer from 1 to 1024",
    "nvlink": "true or false",
    "max_duration": "a duration (90s, 30m, 4h, 2d) or a number of seconds",
    "queue": "a queue name",
    "priority": "a class or queue level",
    "tenant": "a tenant name",
    "request_id": "a request id",
}


def load_job_file(path: Path) -> dict[str, Any]:
    """A job TOML's settings, checked: REQUEST_INVALID naming the file (and the key, or the line
    of a syntax error) for a file that cannot be read, is not TOML, has an unknown key or a
    value of the wrong kind. `max_duration` comes back as seconds (`max_duration_s`)."""
    import tomllib

    def invalid(why: str) -> ModelForgeError:
        return ModelForgeError(FailureClass.REQUEST_INVALID, f"job file {path}: {why}")

    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except OSError as error:
        raise invalid(f"cannot read it ({error.strerror or error})") from None
    except UnicodeDecodeError:
        raise invalid("not UTF-8 text") from None
    except tomllib.TOMLDecodeError as error:
        raise invalid(f"not valid TOML ({error})") from None
    job: dict[str, Any] = {}
    for key, value in data.items():
        if key not in JOB_FILE_KEYS:
            raise invalid(f"unknown key {key!r} (known: {', '.join(JOB_FILE_KEYS)})")
        kind = JOB_FILE_KEYS[key]
        if key == "args":
            if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
                raise invalid(f"args must be {kind}")
            job["args"] = list(value)
        elif key == "gpu_count":
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1024:
                raise invalid(f"gpu_count must be {kind}, not {value!r}")
            job["gpu_count"] = value
        elif key == "nvlink":
            if not isinstance(value, bool):
                raise invalid(f"nvlink must be {kind}, not {value!r}")
            job["nvlink"] = value
        elif key == "max_duration":
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise invalid(f"max_duration must be {kind}, not {value!r}")
            try:
                job["max_duration_s"] = parse_duration(str(value))
            except ModelForgeError as error:
                raise invalid(f"max_duration: {error.message}") from None
        else:
            if not isinstance(value, str) or not value:
                raise invalid(f"{key} must be {kind} (a string), not {value!r}")
            job[key] = value
    return job


class JobClient:
    """Submits jobs (runtime `subprocess_job`): `ModelForgeClient.submit_job` on a client bound
    to `pool` (the default pool unless given), kept for the command line and older callers."""

    def __init__(self, temporal: Any, pool: str | None = None) -> None:
        from modelforge.client import ModelForgeClient
        from modelforge.settings import DEFAULT_POOL

        self.client = ModelForgeClient(temporal, pool or DEFAULT_POOL)

    async def submit_job(
        self,
        capability: str,
        args: list[str],
        *,
        max_duration_s: float,
        gpu_count: int | None = None,
        nvlink: bool = False,
        tenant: str = "default",
        queue: str | None = None,
        priority: str | None = None,
        request_id: str | None = None,
        on_progress: Any = None,
    ) -> Any:
        """See `ModelForgeClient.submit_job`. `nvlink=True` asks for cards joined by NVLink: the
        node refuses it (REQUEST_INVALID, naming why) unless the deployment requires an NVLink
        group (`nvlink_required`), which is what makes its placement give one."""
        return await self.client.submit_job(
            capability,
            args,
            max_duration_s=max_duration_s,
            gpu_count=gpu_count,
            nvlink=nvlink,
            tenant=tenant,
            queue=queue,
            priority=priority,
            request_id=request_id,
            on_progress=on_progress,
        )


job_app = typer.Typer(cls=Group, no_args_is_help=True, help="Batch jobs (runtime subprocess_job) on leased cards.")
app.add_typer(job_app, name="job")


def _not_a_capability(text: str) -> bool:
    from modelforge.identifiers import identifier_problem

    return "@" not in text or text.startswith("-") or identifier_problem("capability", text) is not None


@job_app.command("submit")
def job_submit(
    capability: Annotated[
        str | None,
        typer.Argument(
            help="The job's capability, as name@version (merge.slerp@1); or the --file's.", show_default=False
        ),
    ] = None,
    args: Annotated[
        list[str] | None,
        typer.Argument(
            help="Arguments for the job's command, after --; they replace the --file's.", show_default=False
        ),
    ] = None,
    file: Annotated[
        Path | None,
        typer.Option(
            "--file",
            "-f",
            help="A job TOML: capability, args, gpu_count, nvlink, max_duration, queue, priority, tenant, "
            "request_id (examples/jobs/merge-job.toml). The command line's options win over it.",
            show_default=False,
        ),
    ] = None,
    max_duration: Annotated[
        str | None,
        typer.Option(
            "--max-duration", help="Longest the job may run (90s, 30m, 4h, 2d); then it is TIMEOUT. Default: 10m."
        ),
    ] = None,
    gpu_count: Annotated[
        int | None,
        typer.Option("--gpu-count", help="Cards the job needs; refused unless the deployment has that many."),
    ] = None,
    nvlink: Annotated[
        bool | None,
        typer.Option(
            "--nvlink/--no-nvlink",
            help="The cards must be joined by NVLink: refused (REQUEST_INVALID) unless the deployment requires "
            "an NVLink group (nvlink_required), which its placement then honours.",
            show_default=False,
        ),
    ] = None,
    queue: Annotated[str | None, typer.Option(help="Queue whose --priority level is meant.")] = None,
    priority: Annotated[str | None, typer.Option(help="Class or queue level. Default: the tenant's.")] = None,
    tenant: Annotated[str | None, typer.Option(help="Tenant (user or project). Default: default.")] = None,
    request_id: Annotated[
        str | None, typer.Option(help="Idempotency key; also what `modelforge logs` takes. Default: a new one.")
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Run a job to its end under a lease and print its outcome (exit 1 with the failure class).

    The command is the deployment's (the catalog decides what runs on a node); the arguments
    after -- are appended to it when its runtime_config has input_args = "true". Its log:
    modelforge logs REQUEST_ID --follow, on the node."""
    import uuid

    try:
        spec = load_job_file(file) if file is not None else {}
        if max_duration is not None:
            spec["max_duration_s"] = parse_duration(max_duration)
    except ModelForgeError as error:
        _fail(error, 1)
    given = {
        "capability": capability,
        "gpu_count": gpu_count,
        "nvlink": nvlink,
        "queue": queue,
        "priority": priority,
        "tenant": tenant,
        "request_id": request_id,
    }
    if spec.get("capability") and capability is not None and _not_a_capability(capability):
        # `job submit --file job.toml -- --layers 3`: what follows -- are arguments, not a capability.
        args, given["capability"] = [capability, *(args or [])], None
    spec.update({key: value for key, value in given.items() if value is not None})
    if args:
        spec["args"] = list(args)
    if not spec.get("capability"):
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, "name the job's capability (or give --file)"), 1)
    capability = str(spec["capability"])
    tenant = str(spec.get("tenant", "default"))
    _check_identifiers(capability=capability, tenant=tenant, request_id=spec.get("request_id"))
    gpu_count = spec.get("gpu_count")
    if gpu_count is not None and not 1 <= gpu_count <= 1024:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, "--gpu-count is from 1 to 1024"), 1)
    seconds = float(spec.get("max_duration_s", 600.0))
    chosen_id = str(spec.get("request_id") or uuid.uuid4().hex[:16])
    settings = _settings()
    if not as_json:
        err.print(f"job {escape(chosen_id)}: modelforge logs {escape(chosen_id)} --follow", highlight=False)

    async def go() -> Any:
        from modelforge.temporal import connect

        jobs = JobClient(await connect(settings))
        live = err.status(f"{capability}: submitting") if not as_json and err.is_terminal else None
        with live or contextlib.nullcontext():
            return await jobs.submit_job(
                capability,
                list(spec.get("args", [])),
                max_duration_s=seconds,
                gpu_count=gpu_count,
                nvlink=bool(spec.get("nvlink", False)),
                tenant=tenant,
                queue=spec.get("queue"),
                priority=spec.get("priority"),
                request_id=chosen_id,
                on_progress=(lambda line: live.update(f"{capability}: {line}")) if live is not None else None,
            )

    result = _run(go)
    if as_json:
        _json(result)
    elif result.ok:
        out.print(f"[green]ok[/green] {escape(capability)} job {escape(chosen_id)}", highlight=False)
        render_output(result.output, out)
    else:
        err.print(f"[red]{result.failure_class}[/red]: {escape(result.message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(0 if result.ok else 1)


def job_rows(home: Path) -> list[dict[str, Any]]:
    """Every job this host's node workers ran (the latest run of each request), newest first."""
    rows: list[dict[str, Any]] = []
    for status_path in (home / "jobs").glob("*/*/*/status.json"):
        try:
            status = json.loads(status_path.read_text(encoding="utf-8"))
            attempts = status["attempts"]
            first, last = attempts[0], attempts[-1]
        except (OSError, ValueError, KeyError, IndexError, TypeError):
            continue
        rows.append(
            {
                "request_id": str(status.get("request_id", status_path.parent.parent.name)),
                "node": last.get("node", status_path.parent.parent.parent.name),
                "state": str(status.get("state", "")),
                "progress": status.get("progress"),
                "message": str(status.get("message") or ""),
                "attempts": len(attempts),
                "started_at": first.get("started_at"),
                "ended_at": last.get("ended_at"),
                "log": str(status_path.parent / "job.log"),
            }
        )
    rows.sort(key=lambda row: float(row["started_at"] or 0), reverse=True)
    latest: dict[str, dict[str, Any]] = {}
    for row in rows:
        latest.setdefault(row["request_id"], row)
    return list(latest.values())


@app.command()
def jobs(
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.")] = 50,
    cluster: Annotated[
        bool,
        typer.Option(
            "--cluster",
            help="The jobs running on any node, through Temporal (their progress lines), not this host's files.",
        ),
    ] = False,
    as_json: JsonOption = False,
) -> None:
    """List the jobs this host's node workers ran, with their state, progress and attempts
    (--cluster: the jobs running on every node, read through Temporal)."""
    from modelforge.cli_common import _compact_table, _table_console

    if cluster:
        _cluster_jobs(max(0, limit), as_json)
        return
    rows = job_rows(_settings().home)[: max(0, limit)]
    if as_json:
        _json(rows)
        return
    if not rows:
        out.print("no jobs ran on this host", highlight=False)
        return
    table = _compact_table()
    for column in ("request", "node", "state", "progress", "attempts", "started", "message"):
        table.add_column(column)
    for row in rows:
        progress = row["progress"]
        started = row["started_at"]
        table.add_row(
            escape(row["request_id"]),
            escape(str(row["node"])),
            escape(row["state"]),
            f"{progress:.0%}" if isinstance(progress, int | float) else "",
            str(row["attempts"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "",
            escape(row["message"][:60]),
        )
    _table_console().print(table)


def _cluster_jobs(limit: int, as_json: bool) -> None:
    from modelforge.cli_common import _compact_table, _table_console

    settings = _settings()

    async def go() -> list[dict[str, Any]]:
        from modelforge.temporal import connect

        return await running_jobs(await connect(settings), limit)

    rows = _run(go)
    if as_json:
        _json(rows)
        return
    if not rows:
        out.print("no jobs running on any node", highlight=False)
        return
    table = _compact_table()
    for column in ("request", "worker", "started", "progress"):
        table.add_column(column)
    for row in rows:
        started = row["started_at"]
        table.add_row(
            escape(row["request_id"]),
            escape(row["worker"]),
            time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(started)) if isinstance(started, int | float) else "",
            escape(row["line"][:80]),
        )
    _table_console().print(table)


artifacts_app = typer.Typer(
    cls=Group,
    invoke_without_command=True,
    help="The artifacts jobs made (by sha256): list them, get one back.",
)
app.add_typer(artifacts_app, name="artifacts")


def _artifact_store() -> Path:
    return _settings().resolved_artifact_store()


@artifacts_app.callback()
def artifacts(
    ctx: typer.Context,
    limit: Annotated[int, typer.Option(help="Show at most this many, newest first.")] = 50,
    as_json: JsonOption = False,
) -> None:
    """List the artifacts jobs made on this host: digest, kind (a file, or a job's whole output
    directory), size, the outputs and requests behind each."""
    if ctx.invoked_subcommand is not None:
        return
    from modelforge.cli_common import _compact_table, _table_console
    from modelforge.runtimes._subprocess_job import artifact_rows

    rows = artifact_rows(_artifact_store())[: max(0, limit)]
    if as_json:
        _json(rows)
        return
    if not rows:
        out.print("no artifacts on this host", highlight=False)
        return
    table = _compact_table()
    for column in ("artifact", "kind", "bytes", "outputs", "requests"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            escape(row["artifact"] + ("" if row["present"] else " (missing)")),
            row["kind"] + (f" ({row['files']} files)" if row["kind"] == "directory" else ""),
            str(row["bytes"]),
            escape(", ".join(str(p) for p in row["paths"])[:60]),
            escape(", ".join(str(r) for r in row["requests"])[:60]),
        )
    _table_console().print(table)


@artifacts_app.command("get")
def artifacts_get(
    artifact: Annotated[str, typer.Argument(help="artifact:sha256:<digest>, or the bare digest.")],
    destination: Annotated[
        Path | None,
        typer.Argument(help="Copy it here (a file, or a directory for a directory artifact). Default: print its path."),
    ] = None,
) -> None:
    """Check an artifact against its digest (ARTIFACT_CORRUPT when its bytes changed) and copy it
    to DESTINATION, or print the path of the store's read-only file or directory."""
    import shutil

    from modelforge.runtimes._subprocess_job import verified_artifact

    name = artifact if artifact.startswith("artifact:") else f"artifact:sha256:{artifact}"
    try:
        path = verified_artifact(_artifact_store(), name)
        if destination is None:
            out.print(str(path), highlight=False, soft_wrap=True)
            return
        if destination.exists() or destination.is_symlink():
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{destination} exists: give a new path")
        if path.is_dir():
            shutil.copytree(path, destination, copy_function=shutil.copyfile)
            for copied in [destination, *destination.rglob("*")]:
                copied.chmod(0o755 if copied.is_dir() else 0o644)
        else:
            shutil.copyfile(path, destination)
    except OSError as error:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"cannot copy to {destination}: {error}"), 1)
    except ModelForgeError as error:
        _fail(error, 1)
    out.print(f"wrote {destination}", highlight=False, soft_wrap=True)


@artifacts_app.command("gc")
def artifacts_gc(
    older_than: Annotated[
        str,
        typer.Option("--older-than", help="Delete artifacts last made longer ago than this (30d, 12h, 90m)."),
    ],
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Say what would go; delete nothing.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Delete old artifacts from the store (MODELFORGE_ARTIFACT_STORE), never one a job takes as
    input while it runs or may run again (preempted, retried) on any node writing to the store."""
    from modelforge.runtimes._subprocess_job import collect_garbage

    try:
        seconds = parse_duration(older_than)
    except ModelForgeError as error:
        _fail(error, 1)
    store = _artifact_store()
    if not (store / "index.jsonl").exists():
        report: dict[str, Any] = {"deleted": [], "kept_in_use": [], "bytes_freed": 0, "dry_run": dry_run}
    else:
        report = collect_garbage(store, seconds, dry_run=dry_run)
    if as_json:
        _json(report)
        return
    verb = "would delete" if dry_run else "deleted"
    for row in report["deleted"]:
        out.print(f"{verb} {row['artifact']} ({row['kind']}, {row['bytes']} bytes)", highlight=False, soft_wrap=True)
    for row in report["kept_in_use"]:
        out.print(
            f"kept {row['artifact']}: input of {', '.join(row['in_use_by'])[:120]}", highlight=False, soft_wrap=True
        )
    out.print(
        f"{verb} {len(report['deleted'])} artifacts ({report['bytes_freed']} bytes) from {store}; "
        f"{len(report['kept_in_use'])} kept in use",
        highlight=False,
        soft_wrap=True,
    )
