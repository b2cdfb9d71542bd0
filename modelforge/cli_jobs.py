"""Jobs (runtime `subprocess_job`) on the command line: `modelforge job submit` runs one under a
lease of its --max-duration, `modelforge logs` prints its output as its node keeps it, under
`$MODELFORGE_HOME/jobs/<node>/<request id>/<run>/job.log`. modelforge/cli.py imports this module,
which adds its commands to the app."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from modelforge.cli import (
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


@app.command()
def logs(
    request_id: Annotated[str, typer.Argument(help="The job's request id.")],
    follow: Annotated[
        bool, typer.Option("--follow", "-f", help="Keep printing what the job writes until it ends.")
    ] = False,
) -> None:
    """Print a job's log (stdout and stderr of every attempt), kept on the node that ran it."""
    settings = _settings()

    def write(chunk: bytes) -> None:
        sys.stdout.buffer.write(chunk)
        sys.stdout.buffer.flush()

    try:
        state = follow_log(settings.home, request_id, write, follow)
    except ModelForgeError as error:
        _fail(error, 1)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    raise typer.Exit(1 if state.startswith("failed") or state == "timeout" else 0)


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
    as_json: JsonOption = False,
) -> None:
    """List the jobs this host's node workers ran, with their state, progress and attempts."""
    from modelforge.cli import _compact_table, _table_console

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
    from modelforge.cli import _compact_table, _table_console
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
