"""The replay guard: a pool scheduler whose history no worker can replay is moved out of it
before it wedges the pool.

Why this exists. When Temporal goes away in the middle of a scheduler workflow task, the worker
may have applied that task to its cached run and lost the completion; when the server comes
back it hands the same task out again, now with the updates and signals that arrived meanwhile,
and the worker (SDK 1.35, core) answers from its cached run: the commands of the lost task
first, then the new ones. Replayed from scratch, the SDK applies those updates before the timer
that fired in the same task, so the commands come in the other order and every replay fails
with a nondeterminism error ("Update machine does not handle this event: TimerStarted", kept in
bench/evidence/). Nothing breaks while the run stays cached; the first eviction (a worker
restart, a full cache) wedges the pool: no admission, no grant, every retry failing the same way.
Java's and Go's SDKs fixed the same class by evicting on a failed completion; the Python SDK
gives no handle for that, so the guard checks instead.

What it does, per guarded workflow (each pool's scheduler):
1. Replays the running run's history with the worker's own workflow code, every `interval_s`
   and a few times right after a Temporal outage ends (the moment the fault is written).
2. A history that replays: nothing to do.
3. One that does not, while a worker still holds the run cached: the guard signals `rebase`;
   the cached run, whose state is sound, continues as new at once and carries its state,
   undelivered decisions and unwritten events into a fresh run whose history is clean. Nothing is
   lost; the event `scheduler_rebased` records it.
4. One that does not and whose run did not move within `rebase_wait_s` (no worker has it cached:
   it is wedged): the guard resets the run to the end of the workflow task before the one that
   wrote the bad commands. Decisions the lost run made after that point are gone: its grants'
   holders are unknown to the reset run while they may be using them, and some of those grants'
   ledger rows were never written (events are written lazily). So the guard first asks the run to
   audit its lease ledger (`audit_ledger`), naming the grants it reads in the discarded part
   (`LedgerAudit.lost_grants`); it sends the ask before the reset, so the reset run receives it
   with the signals applied again, before anything it could grant. The run grants nothing until
   that audit has answered, and reclaims every lease the ledger shows open or the guard named
   that it does not hold: its row closed (written first if it never was), its holder stopped
   (workflows/scheduler.py), so its room is never given twice. Updates are not applied again by
   the reset: an admission decided again would answer in a reply nobody reads, while its
   requester waits for a signal. The guard sends each admission again as `readmit` (decided by
   signal, after the audit) and any other update as the same update. A run still live (an
   operator's reset, the chaos bench's) is asked to audit first, so it grants nothing more while
   its history is read, and is not reset if it continued as new meanwhile. That is why step 3 runs
   first and why checks follow every outage. Both steps are logged with the workflow id, the
   run id and the event id.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType, ResetReapplyExcludeType, UpdateWorkflowExecutionLifecycleStage
from temporalio.api.history.v1 import HistoryEvent
from temporalio.api.update.v1 import Input, Meta, Request, WaitPolicy
from temporalio.api.workflowservice.v1 import (
    ResetWorkflowExecutionRequest,
    SignalWorkflowExecutionRequest,
    UpdateWorkflowExecutionRequest,
)
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle, WorkflowHistory
from temporalio.converter import DataConverter
from temporalio.worker import Replayer, WorkflowRunner
from temporalio.workflow import NondeterminismError

from modelforge.logging import get_logger
from modelforge.messages import AdmitBatchReply, LeaseDecision, LedgerAudit, RebaseSignal
from modelforge.policy import Lease

log = get_logger("modelforge.worker.replay_guard")

# core's message names the history event it could not match: "HistoryEvent(id: 40, TimerStarted)"
_BAD_EVENT = re.compile(r"HistoryEvent\(id: (\d+)")
# The scheduler's messages the guard reads in, or sends again from, a reset's discarded part.
ADMIT_UPDATE, READMIT_SIGNAL, GRANT_SIGNAL = "admit_batch", "readmit", "lease_decision"
# At most this many lost grants named in one audit (a signal's payload stays far under its
# limit); any beyond are left to the ledger's rows and the heartbeat fence.
MAX_LOST_GRANTS = 2000

ReplayCheck = Callable[[WorkflowHistory], Awaitable[Exception | None]]


def replayer_check(
    workflows: Sequence[type],
    runner: WorkflowRunner,
    converter: DataConverter,
    known_patches: frozenset[str] | None = None,
) -> ReplayCheck:
    """Replays a history with this worker's workflow code and data converter (stored payloads
    are read back as the worker reads them); the nondeterminism error, if any.
    `known_patches`: the patch ids this worker's code knows. A history that fails and holds a
    patch marker outside them was written by a newer release (a rolling upgrade: a run started
    by a newer worker, with a patch written for that release; docs/RELEASING.md), which this
    code was never meant to replay: inconclusive, not a fault to rebase or reset."""

    async def check(history: WorkflowHistory) -> Exception | None:
        replayer = Replayer(workflows=list(workflows), workflow_runner=runner, data_converter=converter)
        result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
        failure = result.replay_failure
        if failure is None:
            return None
        newer = sorted(patch_ids(history) - known_patches) if known_patches is not None else []
        if newer:
            log.warning(
                "replay_check_newer_release",
                workflow_id=history.workflow_id,
                unknown_patches=newer[:5],
                error=_short(failure),
            )
            return None
        if isinstance(failure, NondeterminismError):
            return failure
        # Anything else (a payload that cannot be read, say) is not this guard's to repair.
        log.warning("replay_check_inconclusive", workflow_id=history.workflow_id, error=_short(failure))
        return None

    return check


def patch_ids(history: WorkflowHistory) -> set[str]:
    """The ids of the patch markers in a history (`workflow.patched`: core's `core_patch`
    marker, its `patch-data` a JSON object with the id)."""
    ids: set[str] = set()
    for event in history.events:
        if event.event_type != EventType.EVENT_TYPE_MARKER_RECORDED:
            continue
        marker = event.marker_recorded_event_attributes
        if marker.marker_name != "core_patch" or "patch-data" not in marker.details:
            continue
        for payload in marker.details["patch-data"].payloads:
            try:
                patch = json.loads(payload.data)
            except ValueError:
                continue
            if isinstance(patch, dict) and isinstance(patch.get("id"), str):
                ids.add(patch["id"])
    return ids


def reset_point(history: WorkflowHistory, failure: Exception) -> int | None:
    """The event to reset to: the completion of the workflow task that wrote the event the
    replay could not match (the run restarts just before that task's commands, with the task's
    inputs and everything received after it applied again)."""
    match = _BAD_EVENT.search(str(failure))
    if match is None:
        return None
    bad = int(match.group(1))
    completed = [
        event.event_id
        for event in history.events
        if event.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and event.event_id < bad
    ]
    return completed[-1] if completed else None


@dataclass(frozen=True)
class DiscardedTail:
    """What a reset to `point` discards that the guard must carry over by hand: the leases the
    run granted after it (a grant signalled to its requester, or answered in an admission's
    reply), and the updates it accepted after it, in order (each its name, id and input). The
    reset applies no update again: one decided again would answer in a reply nobody reads."""

    lost_grants: list[Lease]
    updates: list[tuple[str, str, Input]]


async def discarded_tail(events: Sequence[HistoryEvent], point: int, converter: DataConverter) -> DiscardedTail:
    grants: dict[str, Lease] = {}
    updates: dict[str, tuple[str, str, Input]] = {}  # by update id, in the order accepted
    for event in events:
        if event.event_id <= point:
            continue
        kind = event.event_type
        if kind == EventType.EVENT_TYPE_SIGNAL_EXTERNAL_WORKFLOW_EXECUTION_INITIATED:
            signal = event.signal_external_workflow_execution_initiated_event_attributes
            if signal.signal_name == GRANT_SIGNAL:
                for decision in await _decoded(converter, signal.input.payloads, LeaseDecision):
                    if decision.lease is not None:
                        grants[decision.lease.lease_id] = decision.lease
        elif kind in (
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED,
            EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ADMITTED,
        ):
            # An update applied again by an earlier reset is admitted with its request, then
            # accepted without it.
            request = (
                event.workflow_execution_update_accepted_event_attributes.accepted_request
                if kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED
                else event.workflow_execution_update_admitted_event_attributes.request
            )
            update_id = request.meta.update_id
            if update_id and update_id not in updates:
                updates[update_id] = (request.input.name, update_id, request.input)
        elif kind == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_COMPLETED:
            completed = event.workflow_execution_update_completed_event_attributes
            name = updates.get(completed.meta.update_id, ("", "", None))[0]
            if name == ADMIT_UPDATE and completed.outcome.HasField("success"):
                for reply in await _decoded(converter, completed.outcome.success.payloads, AdmitBatchReply):
                    for answer in reply.replies:
                        if answer.status == "granted" and answer.lease is not None:
                            grants[answer.lease.lease_id] = answer.lease
    return DiscardedTail(lost_grants=list(grants.values())[-MAX_LOST_GRANTS:], updates=list(updates.values()))


async def _decoded(converter: DataConverter, payloads: Sequence[Any], kind: type[Any]) -> list[Any]:
    """One payload read back as `kind`; none if it cannot be (the reset goes on without it)."""
    try:
        [value] = await converter.decode(list(payloads), [kind])
    except Exception as error:
        log.warning("discarded_payload_unreadable", kind=kind.__name__, error=_short(error))
        return []
    return [value]


@dataclass(frozen=True)
class GuardOutcome:
    workflow_id: str
    outcome: str  # replays | rebased | reset | not_running | needs_operator
    run_id: str = ""
    detail: str = ""


class ReplayGuard:
    def __init__(
        self,
        client: Client,
        workflow_ids: Sequence[str],
        check: ReplayCheck,
        *,
        interval_s: float = 60.0,
        health_interval_s: float = 2.0,
        after_outage_s: Sequence[float] = (3.0, 10.0, 30.0),
        rebase_wait_s: float = 15.0,
        audit_signal: str = "audit_ledger",
    ) -> None:
        """`audit_signal`: the signal a reset run is sent to find the grants it forgot ("" for a
        guarded workflow that has none)."""
        self._client = client
        self._workflow_ids = list(workflow_ids)
        self._check = check
        self._interval_s = interval_s
        self._health_interval_s = health_interval_s
        self._after_outage_s = list(after_outage_s)
        self._rebase_wait_s = rebase_wait_s
        self._audit_signal = audit_signal
        self.outcomes: list[GuardOutcome] = []  # the last round's, for tests and logs

    def watch(self, workflow_id: str) -> None:
        """Check this scheduler too from the next round on (a pool the control worker took on)."""
        if workflow_id not in self._workflow_ids:
            self._workflow_ids.append(workflow_id)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_round = loop.time() + min(self._interval_s, 5.0)
        soon: list[float] = []  # the checks that follow an outage
        reachable = True
        while True:
            healthy = await self._reachable()
            now = loop.time()
            if healthy and not reachable:
                # The window in which the fault is written has just closed: look soon, and again.
                soon = sorted(now + delay for delay in self._after_outage_s)
                log.info("replay_guard_after_outage", checks_in_s=list(self._after_outage_s))
            reachable = healthy
            if healthy and (now >= next_round or (soon and now >= soon[0])):
                soon = [at for at in soon if at > now]
                next_round = now + self._interval_s
                try:
                    await self.check_all()
                except Exception as error:  # the next round tries again; the worker keeps serving
                    log.warning("replay_guard_round_failed", error=_short(error))
            await asyncio.sleep(self._health_interval_s)

    async def _reachable(self) -> bool:
        try:
            return await self._client.service_client.check_health(timeout=timedelta(seconds=2.0))
        except Exception:
            return False

    async def check_all(self) -> list[GuardOutcome]:
        self.outcomes = [await self.check(workflow_id) for workflow_id in self._workflow_ids]
        return self.outcomes

    async def check(self, workflow_id: str) -> GuardOutcome:
        handle = self._client.get_workflow_handle(workflow_id)
        description = await handle.describe()
        if description.status != WorkflowExecutionStatus.RUNNING:
            return GuardOutcome(workflow_id, "not_running", description.run_id or "")
        run_id = description.run_id or ""
        history = await self._client.get_workflow_handle(workflow_id, run_id=run_id).fetch_history()
        failure = await self._check(history)
        if failure is None:
            return GuardOutcome(workflow_id, "replays", run_id)
        detail = _short(failure)
        log.error("workflow_history_unreplayable", workflow_id=workflow_id, run_id=run_id, error=detail)
        try:
            await handle.signal("rebase", RebaseSignal(reason=f"history of run {run_id} cannot be replayed: {detail}"))
        except Exception as error:  # closed meanwhile: the next round looks at the new run
            log.warning("rebase_signal_failed", workflow_id=workflow_id, error=_short(error))
        if await self._moved_on(workflow_id, run_id):
            log.warning("workflow_rebased", workflow_id=workflow_id, old_run_id=run_id)
            return GuardOutcome(workflow_id, "rebased", run_id, detail)
        point = reset_point(history, failure)
        if point is None:
            log.error(
                "workflow_wedged_needs_operator",
                workflow_id=workflow_id,
                run_id=run_id,
                hint=f"temporal workflow reset --workflow-id {workflow_id} --run-id {run_id} --type LastWorkflowTask",
            )
            return GuardOutcome(workflow_id, "needs_operator", run_id, detail)
        if not await self.reset(workflow_id, run_id, point, detail):
            return GuardOutcome(workflow_id, "rebased", run_id, f"moved on before its reset: {detail}")
        return GuardOutcome(workflow_id, "reset", run_id, f"reset to event {point}: {detail}")

    async def reset(self, workflow_id: str, run_id: str, point: int, detail: str) -> bool:
        """Reset the run to the end of the workflow task `point`, every signal it received after
        that applied again. First the run is asked to audit its ledger (`audit_ledger`, sent
        before the reset so that the reset run receives it with the signals applied again, before
        anything it could grant), naming the grants the discarded part made; then the updates it
        had accepted there are sent again, after the ask: an admission as `readmit` (its
        requester waits for a signal, not a reply), any other as the same update."""
        old = self._client.get_workflow_handle(workflow_id, run_id=run_id)
        converter = self._client.data_converter
        # A run still live (an operator's reset of a cached run, the chaos bench's) would go on
        # granting while the guard reads its history: asked to audit, it grants nothing more.
        # Not final: the repair goes on, grants wait until the last ask below has been audited.
        await self._ask_audit(old, workflow_id, LedgerAudit(final=False))
        before = await self._once_heard(old)
        lost = (await discarded_tail(before.events, point, converter)).lost_grants
        await self._ask_audit(old, workflow_id, LedgerAudit(lost_grants=lost, final=False))
        current = self._client.get_workflow_handle(workflow_id)
        if (await current.describe()).run_id != run_id:
            # It continued as new meanwhile (it was live): resetting the run it left would throw
            # its successor away, decisions and all. Its successor's history is a fresh one; it
            # carried the hold, which the final ask ends.
            log.warning("workflow_reset_skipped", workflow_id=workflow_id, run_id=run_id, why="it moved on")
            await self._ask_audit(current, workflow_id)
            return False
        await self._client.workflow_service.reset_workflow_execution(
            ResetWorkflowExecutionRequest(
                namespace=self._client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=workflow_id, run_id=run_id),
                reason=f"modelforge replay guard: history cannot be replayed ({detail})"[:1000],
                workflow_task_finish_event_id=point,
                request_id=str(uuid.uuid4()),
                # Signals received after the reset point are applied again; updates are sent again below.
                reset_reapply_exclude_types=[ResetReapplyExcludeType.RESET_REAPPLY_EXCLUDE_TYPE_UPDATE],
            )
        )
        log.error("workflow_reset", workflow_id=workflow_id, run_id=run_id, reset_to_event=point, lost_grants=len(lost))
        # The old run is closed now: its history holds every update it accepted, and every
        # grant (one made after the history above was read is named now, in a second ask).
        tail = await discarded_tail((await old.fetch_history()).events, point, converter)
        named = {lease.lease_id for lease in lost}
        late = [lease for lease in tail.lost_grants if lease.lease_id not in named]
        if late:
            log.warning("lost_grants_named_late", workflow_id=workflow_id, run_id=run_id, leases=len(late))
        for name, update_id, given in tail.updates:
            await self._send_again(workflow_id, name, update_id, given)
        # The last ask: its audit reclaims what was named late, and only then grants resume.
        await self._ask_audit(current, workflow_id, LedgerAudit(lost_grants=late, final=True))
        return True

    async def _once_heard(self, old: WorkflowHandle[Any, Any], within_s: float = 5.0) -> WorkflowHistory:
        """The run's history once a workflow task has completed after the last ledger-audit ask
        (a live run has applied it: it grants nothing more), or as it is after `within_s` (a
        wedged run completes none)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        while True:
            history = await old.fetch_history()
            asked = [
                e.event_id
                for e in history.events
                if e.event_type == EventType.EVENT_TYPE_WORKFLOW_EXECUTION_SIGNALED
                and e.workflow_execution_signaled_event_attributes.signal_name == self._audit_signal
            ]
            heard = asked and any(
                e.event_type == EventType.EVENT_TYPE_WORKFLOW_TASK_COMPLETED and e.event_id > asked[-1]
                for e in history.events
            )
            if heard or not self._audit_signal or loop.time() >= deadline:
                return history
            await asyncio.sleep(0.2)

    async def _send_again(self, workflow_id: str, name: str, update_id: str, given: Input) -> None:
        """One update the reset discarded, to the reset run, from its recorded payloads (read
        back by the scheduler as the first time, whatever codec or storage wrote them). Best
        effort, logged: a requester not told waits to its lease timeout, as before the guard."""
        execution = WorkflowExecution(workflow_id=workflow_id)
        try:
            if name == ADMIT_UPDATE:
                await self._client.workflow_service.signal_workflow_execution(
                    SignalWorkflowExecutionRequest(
                        namespace=self._client.namespace,
                        workflow_execution=execution,
                        signal_name=READMIT_SIGNAL,
                        input=given.args,
                        header=given.header,
                        identity=self._client.identity,
                        request_id=f"readmit:{update_id}"[:255],
                    ),
                    retry=True,
                    timeout=timedelta(seconds=10),
                )
                return
            await self._client.workflow_service.update_workflow_execution(
                UpdateWorkflowExecutionRequest(
                    namespace=self._client.namespace,
                    workflow_execution=execution,
                    request=Request(meta=Meta(update_id=update_id, identity=self._client.identity), input=given),
                    wait_policy=WaitPolicy(
                        lifecycle_stage=UpdateWorkflowExecutionLifecycleStage.UPDATE_WORKFLOW_EXECUTION_LIFECYCLE_STAGE_ACCEPTED
                    ),
                ),
                retry=True,
                timeout=timedelta(seconds=10),
            )
        except Exception as error:
            log.warning("update_not_sent_again", workflow_id=workflow_id, update=name, error=_short(error))

    async def _ask_audit(
        self, handle: WorkflowHandle[Any, Any], workflow_id: str, audit: LedgerAudit | None = None
    ) -> None:
        """Best effort: the scheduler audits its ledger every minute anyway."""
        if not self._audit_signal:
            return
        try:
            if audit is None:
                await handle.signal(self._audit_signal)
            else:
                await handle.signal(self._audit_signal, audit)
        except Exception as error:
            log.warning("ledger_audit_signal_failed", workflow_id=workflow_id, error=_short(error))

    async def _moved_on(self, workflow_id: str, run_id: str) -> bool:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._rebase_wait_s
        handle = self._client.get_workflow_handle(workflow_id)
        while loop.time() < deadline:
            await asyncio.sleep(0.5)
            try:
                description = await handle.describe()
            except Exception:
                continue
            if description.run_id != run_id:
                return True
        return False


def _short(error: BaseException) -> str:
    text = str(error)
    match = re.search(r"\[TMPRL1100\][^\"]*", text)
    return (match.group(0) if match else f"{type(error).__name__}: {text}")[:300]
