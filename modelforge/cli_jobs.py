"""`modelforge logs`: the output of a job (runtime `subprocess_job`) as its node keeps it, under
`$MODELFORGE_HOME/jobs/<node>/<request id>/<run>/job.log`. modelforge/cli.py imports this module,
which adds its commands to the app."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer

from modelforge.cli import _fail, _settings, app
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
