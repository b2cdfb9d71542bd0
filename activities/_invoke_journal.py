"""The invokes running on this node, on disk while they run, so that a node worker started again
after its process died (killed, out of memory, crashed) fails them at once.

Without it the request workflows of those invokes hear nothing until their invoke's heartbeat
timeout (60 s, `workflows/request.py` INVOKE_HEARTBEAT), holding their leases, and so their
slots, all that time: a node agent that dies mid-invoke made its model look busy for a minute
(the chaos rounds, docs/BENCHMARKS.md). The heartbeat timeout stays the bound for a node that does not come
back; a node that does says at once that the invokes it was running are gone.

One small file per running invoke (`<hash of lease and request>.json`, 0600 in a 0700
directory: it holds the activity's task token), written when the invoke starts and removed when
it ends, whatever the end. Not fsynced: it must survive its process, not the host (a host that
reboots loses its model servers with its memory, and the heartbeat timeout covers it). The
files a worker finds when it starts are the previous process's invokes: each is failed through
its task token (RUNTIME_CRASH, not retried: the model server it ran on died with the node
worker) and removed; an invoke Temporal already ended (timed out, or completed before the
process died) is simply removed."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from modelforge.failures import FailureClass
from modelforge.logging import get_logger
from modelforge.runtimes._subprocess_job import job_directory_name

log = get_logger("modelforge.node.invokes")


def invoke_journal_dir(home: Path, node: str) -> Path:
    """Where a node's running invokes are noted: `MODELFORGE_HOME/invokes/<node>`."""
    return home / "invokes" / job_directory_name(node)


@dataclass(frozen=True)
class LeftInvoke:
    """An invoke the previous process of this node worker was running when it ended."""

    path: Path
    task_token: bytes
    lease_id: str
    request_id: str
    workflow_id: str
    started_at: float


class InvokeJournal:
    """`directory` None: nothing is written (a node without a home of its own)."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._left: list[Path] = []
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            # What the previous process left, read before this one writes anything.
            self._left = sorted(directory.glob("*.json"))

    def begin(self, lease_id: str, request_id: str, task_token: bytes, workflow_id: str) -> Path | None:
        """Note a running invoke; the path to give `end`. A failed write is logged and costs
        only the early failure after a restart (the heartbeat timeout still bounds it)."""
        if self._directory is None or not task_token:
            return None
        name = hashlib.sha256(f"{lease_id}\0{request_id}".encode()).hexdigest()[:32]
        path = self._directory / f"{name}.json"
        entry = {
            "task_token": base64.b64encode(task_token).decode(),
            "lease_id": lease_id,
            "request_id": request_id,
            "workflow_id": workflow_id,
            "started_at": time.time(),
        }
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "w", encoding="utf-8") as out:
                json.dump(entry, out)
        except OSError as error:
            log.warning("invoke_journal_write_failed", path=str(path), error=str(error))
            return None
        return path

    def end(self, path: Path | None) -> None:
        if path is not None:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def left(self) -> list[LeftInvoke]:
        """The invokes the previous process was running (unreadable files are removed, logged)."""
        found: list[LeftInvoke] = []
        for path in self._left:
            try:
                entry = json.loads(path.read_text(encoding="utf-8"))
                found.append(
                    LeftInvoke(
                        path=path,
                        task_token=base64.b64decode(entry["task_token"]),
                        lease_id=str(entry["lease_id"]),
                        request_id=str(entry["request_id"]),
                        workflow_id=str(entry["workflow_id"]),
                        started_at=float(entry["started_at"]),
                    )
                )
            except FileNotFoundError:
                continue
            except (OSError, ValueError, KeyError, TypeError) as error:
                log.warning("invoke_journal_entry_unreadable", path=str(path), error=str(error))
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
        return found


async def fail_left_invokes(client: Client, journal: InvokeJournal, node: str) -> int:
    """Fail, through their task tokens, the invokes the previous process of this node worker was
    running; each entry removed once Temporal has it (or has ended that invoke already). Raises
    on any other RPC failure, so a caller that retries (`retrying`) tries the rest again.
    Returns how many were failed."""
    failed = 0
    for left in journal.left():
        error = ApplicationError(
            f"node {node} was restarted while this invoke ran on it (its worker process ended: killed or crashed);"
            " the model server it ran on went with it",
            type=FailureClass.RUNTIME_CRASH.value,
            non_retryable=True,
        )
        try:
            await client.get_async_activity_handle(task_token=left.task_token).fail(error)
        except RPCError as rpc:
            if rpc.status != RPCStatusCode.NOT_FOUND:
                raise
            log.info("left_invoke_already_ended", node=node, lease_id=left.lease_id, request_id=left.request_id)
        else:
            failed += 1
            log.warning(
                "left_invoke_failed",
                node=node,
                lease_id=left.lease_id,
                request_id=left.request_id,
                workflow_id=left.workflow_id,
                ran_s=round(max(0.0, time.time() - left.started_at), 1),
            )
        journal.end(left.path)
    return failed
