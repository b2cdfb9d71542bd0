"""PoolSchedulerWorkflow: the singleton `scheduler:<pool>` that serializes admission.

Handlers are short and synchronous: read, decide through the pure policy, act on the state and
queue the messages that carry decisions out. The main loop starts sending those messages
(grants, rejections, residency commands, event batches) without waiting for them, and
continues-as-new when Temporal suggests it, no handler is running and no delivery is under way
(new ones wait for the next run meanwhile, unless one under way is held up)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial

from temporalio import workflow
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError

with workflow.unsafe.imports_passed_through():
    from modelforge import policy
    from modelforge.domain import Catalog, Deployment, Observation
    from modelforge.events import EventRecord
    from modelforge.failures import FailureClass, parse_failure
    from modelforge.messages import (
        AddressedCommand,
        AddressedDecision,
        AddressedPreempt,
        AdmitBatch,
        AdmitBatchReply,
        AdmitReply,
        CancelSignal,
        CarriedOutbox,
        DeadlineDue,
        DelegationReply,
        DelegationSync,
        LeaseConfirmCall,
        LeaseDecision,
        LeaseHeartbeat,
        LedgerAudit,
        NodeSample,
        OpenLease,
        PreemptSignal,
        RebaseSignal,
        ReleaseSignal,
        ResidencyControl,
        ResidencyControlReply,
        ResidencyInput,
        ResidentCommand,
        ResidentIdle,
        ResidentReport,
        SchedulerInput,
        SnapshotBatch,
        UnloadReport,
        UsageQuery,
        VerdictQuery,
        device_index,
    )
    from modelforge.names import SCHEDULER_WORKFLOW_TYPE, is_request_workflow_id
    from modelforge.policy import RouteInfo, RouteQuery, route_info
    from modelforge.settings import CONTROL_TASK_QUEUE

from workflows._common import (
    SCHEDULER_TASK_TIMEOUT,
    STORE_RETRY,
    UPGRADE_ON_CONTINUE,
    request_workflow_id,
    resident_workflow_id,
)
from workflows.residency import ResidencyWorkflow

# Patches (`workflow.patched`) are written only for a change to code a released version runs, at
# release time (docs/RELEASING.md); name them PATCH_*. Every patch id a scheduler run of this
# release may record: the replay guard leaves alone a run whose history has another (a newer
# release wrote it; workers/replay_guard.py). None yet: 0.1.0 is the baseline.
SCHEDULER_PATCHES: frozenset[str] = frozenset(
    value for name, value in dict(globals()).items() if name.startswith("PATCH_")
)
# The reclaimed leases remembered per run, to stop an invoke whose heartbeats come back.
RECLAIMED_REMEMBERED = 1000
# The released leases remembered per run: a heartbeat or a release that crossed the lease's end
# is no news (a lease unknown to the run otherwise is one it forgot, or never recorded).
RELEASED_REMEMBERED = 10_000

# A lease whose holder was never heard from is reclaimed after this many stale_lease_s.
UNHEARD_LEASE_FACTOR = 5.0

EVENT_BATCH = 200
# One event write in flight at a time, at most this often (a backlog of a batch goes at once):
# the event log trails by up to this much, and a busy pool writes one batch a second, not one
# per request.
EVENT_WRITE_INTERVAL_S = 1.0
# Lazy writes: routine event records wait until the oldest has waited EVENT_WRITE_WAIT_S (a full
# batch, or an urgent record, goes at the next EVENT_WRITE_INTERVAL_S), and no wake-up timer is
# armed for events while a write is in flight (its completion wakes the loop: a write retried
# through a Postgres outage does not wake the scheduler twice a second).
EVENT_WRITE_WAIT_S = 5.0
# Urgent: what an operator acts on, written within about a second. Any event with an alert or a
# failure class, and these kinds. (Part of the commands: a change to a released version's needs
# a patch; docs/RELEASING.md.)
URGENT_EVENT_KINDS = frozenset(
    {
        "preemption_requested",
        "preempted",
        "lease_reclaimed",
        "resident_lost",
        "resident_unreachable",
        "gpu_unhealthy",
        "gpu_pressure_entered",
        "health_check_failed",
        "load_failed",
        "invoke_failed",
        "request_refused",
        "request_rejected",
        "admission_failed",
        "grant_withdrawn",
        "scheduler_rebased",
        "reclaim_failed",
        "capacity_alert_raised",
        "capacity_alert_cleared",
        "job_preempted",
        "reclaimed_invoke_stopped",
        "stale_grant_refused",
    }
)
MAX_ADMIT_BATCH = 500
# Deliveries (grants, preemptions, resident commands, residency starts) in flight at once: the
# rest wait in the outbox (carried at continue-as-new). Under Temporal's default limits of 2,000
# pending signals and 2,000 pending child starts per execution, which fail the workflow task.
MAX_SENDS_IN_FLIGHT = 1000
# Continue-as-new waits for the deliveries under way (what they report back, such as a requester
# found gone, would reach no run otherwise), and holds new ones for the next run meanwhile, so a
# busy pool's stream of grants cannot postpone it for ever. Unless one under way has taken this
# long (Temporal is working through a backlog): then the pool's deliveries go on meanwhile.
HELD_UP_DELIVERY_S = 10.0
# ... but only this long after continue-as-new fell due: then new deliveries are held whatever is
# under way, so deliveries held up one after another cannot postpone it for ever (seen: a run of
# 6,187 events against a limit of 40, nine minutes, in the chaos round).
CONTINUE_WAIT_LIMIT_S = 60.0
# After a reset (the replay guard's `audit_ledger`), no grant until the ledger audit has answered:
# a grant the lost part of the history made is unknown to the run, while its holder may use it,
# and its capacity given again meanwhile is held twice (seen in the chaos round). At most this
# long (Postgres down): then the heartbeat fence alone stops a forgotten holder that invokes.
AUDIT_BEFORE_GRANTS_LIMIT_S = 60.0
# A lease the audit reclaims (its run forgot it) may be in use: its holder is told to stop, and
# its room is given again only once the holder says it stopped (its release), or after this
# long (two heartbeat periods of an invoke, with the stop's delivery): before, the reset run
# granted it at once and the card ran the holder's invoke beside the next one's (a chaos round:
# five at once on a concurrency-4 model, for 0.3 s).
HOLDER_STOP_LIMIT_S = 10.0
# Loads whose residency has said nothing in time (`Deployment.load_report_limit_s`, minutes) are
# looked for this often at most: one walk of the residents, not one per loop iteration.
LOAD_CHECK_INTERVAL_S = 10.0
# How far a let-go or give-up time a holder tells (`ReleaseSignal.ended_at`, `CancelSignal.sent_at`)
# may carry the run's clock past its workflow task's time (`_now`): those times come from the same
# server's clock, so only a malformed one would be further ahead.
CLOCK_LEAD_LIMIT_S = 60.0
# Resident slots kept back from delegation for admissions through the scheduler (requests that
# did not start on the resident's node: a CLI's first request, another pool's client).
DELEGATION_SPARE_SLOTS = 1


@workflow.defn(name=SCHEDULER_WORKFLOW_TYPE, sandboxed=False)
class PoolSchedulerWorkflow:
    @workflow.init
    def __init__(self, start: SchedulerInput) -> None:
        self._state = start.state or policy.PoolState(pool=start.pool, config=start.config)
        self._reconcile_s = start.reconcile_interval_s
        self._catalog_stale = start.state is None or not self._state.catalog.accelerators
        self._usage_unseeded = start.state is None
        self._wake = False
        self._decisions_out: list[tuple[str, LeaseDecision]] = []
        self._commands_out: list[tuple[str, ResidentCommand]] = []
        self._loads_out: list[ResidencyInput] = []
        self._preempts_out: list[tuple[str, PreemptSignal]] = []
        # Deliveries under way (`_send_outbox`): the last one to each workflow, by its id (the
        # next to the same workflow goes after it).
        self._sending: dict[str, asyncio.Task[object]] = {}
        # When each delivery under way started, by serial number (the first is the oldest).
        self._sends_started: dict[int, float] = {}
        self._sends = 0
        self._holding = False  # new deliveries wait: continue-as-new is due (HELD_UP_DELIVERY_S)
        self._continue_due_at: float | None = None  # when continue-as-new fell due in this run
        self._events: list[EventRecord] = []
        self._event_serial = 0  # the events this run recorded (`_event_id`)
        self._event_writes: list[asyncio.Future[object]] = []
        self._timer: asyncio.Task[None] | None = None
        self._timer_at = 0.0
        self._timer_fired = False
        self._events_in_flight: asyncio.Future[object] | None = None
        self._events_written_at = 0.0
        self._snapshot_interval_s = start.snapshot_interval_s
        self._next_snapshot_at: float | None = None
        # Event batches whose write has not been confirmed, by write: carried at continue-as-new.
        self._unconfirmed: list[tuple[asyncio.Future[object], list[EventRecord]]] = []
        self._urgent_events = 0  # buffered events that are urgent (lazy writes)
        self._rebase: str | None = None  # why this run must continue as new now (RebaseSignal)
        # Leases reclaimed in this run (holder silent), by lease id: their holder's workflow id.
        self._reclaimed: dict[str, str] = {}
        # Leases this run ended (released, reclaimed, returned), oldest first (a dict as an
        # ordered set): RELEASED_REMEMBERED of them.
        self._released: dict[str, None] = {}
        # The ledger audit (`_audit_ledger`): when the next is due, the one in flight, and the
        # leases whose release the ledger may not show yet although this run knows it.
        self._audit_interval_s = start.ledger_audit_interval_s
        self._audit_at = start.ledger_audit_at
        self._audit: asyncio.Future[list[OpenLease]] | None = None
        self._audit_asked = False
        self._released_unwritten: set[str] = set()
        self._grants_wait_since = start.grants_wait_for_audit_since  # `_grants_wait_for_audit`
        if self._grants_wait_since is not None:
            self._audit_asked = True  # the previous run's audit, if any, answered nobody
        # Grants of a reset's discarded history, reclaimed with the next audit (`LedgerAudit`).
        self._lost_grants: dict[str, policy.Lease] = {lease.lease_id: lease for lease in start.lost_grants}
        self._repair_open = start.audit_repair_open  # grants wait for the guard's final ask too
        # Holders of reclaimed leases told to stop, not yet heard to (`_holders_stopping`).
        self._stopping: dict[str, float] = dict(start.holders_stopping)
        # Loads reported before a first run's catalog came (`_adopt_unknown`), and until when
        # no load is overdue (`_ask_overdue_loads`).
        self._reports_before_catalog: list[ResidentReport | ResidentIdle] = []
        self._loads_checked_until = 0.0
        # Loads whose residency was asked whether it is still there, and when (`_ask_overdue_loads`).
        self._loads_heard_since: dict[str, float] = {}
        # The latest let-go time a holder told this run (`_now`). Not carried at continue-as-new:
        # the next run's first task starts after this run's last one ended, so after every let-go.
        self._clock_floor = 0.0
        carried = start.carried
        if carried is not None:
            self._decisions_out = [(d.workflow_id, d.decision) for d in carried.decisions]
            self._commands_out = [(c.workflow_id, c.command) for c in carried.commands]
            self._preempts_out = [(p.workflow_id, p.preempt) for p in carried.preempts]
            self._loads_out = list(carried.loads)
            self._events = list(carried.events)
            self._urgent_events = sum(1 for event in self._events if _urgent(event))
            self._wake = True

    # --- messages ---------------------------------------------------------------------------

    @workflow.update
    def admit_batch(self, batch: AdmitBatch) -> AdmitBatchReply:
        """Many admissions in one update: the gateway coalesces concurrent requests, so a burst
        costs a few updates (Temporal allows 10 in flight per workflow) and one policy pass each."""
        return AdmitBatchReply(replies=self._admit_all(batch.requests))

    @admit_batch.validator
    def _validate_admit_batch(self, batch: AdmitBatch) -> None:
        if self._catalog_stale:
            raise ApplicationError(
                "the scheduler is still loading its catalog",
                type=FailureClass.SCHEDULER_STATE_STALE.value,
                non_retryable=False,
            )
        if not batch.requests or len(batch.requests) > MAX_ADMIT_BATCH:
            raise ApplicationError(
                f"an admission batch holds 1 to {MAX_ADMIT_BATCH} requests, not {len(batch.requests)}",
                type=FailureClass.REQUEST_INVALID.value,
                non_retryable=True,
            )

    def _admit_all(self, requests: list[policy.AdmissionRequest]) -> list[AdmitReply]:
        now = self._now()
        replies: dict[int, AdmitReply] = {}
        admitted: dict[str, tuple[int, str]] = {}  # request id -> (position, priority)
        for position, request in enumerate(requests):
            taken = self._take_in(request, now, late_at=request.admit_by)
            if isinstance(taken, policy.Lease):
                replies[position] = AdmitReply(status="granted", lease=taken, priority=taken.priority)
            elif isinstance(taken, policy.AdmissionRejected):
                replies[position] = AdmitReply(status="rejected", failure=taken.failure.value, message=taken.message)
            elif isinstance(taken, policy.QueuedRequest):
                replies[position] = AdmitReply(status="queued", priority=taken.priority)
            else:
                admitted[request.request_id] = (position, taken)
        if admitted:
            if not self._grants_held():  # else queued: granted once the audit answered, holders stopped
                self._run_policy(now)
            # Decisions about the requests just admitted go back in the reply, not as signals.
            kept: list[tuple[str, LeaseDecision]] = []
            for workflow_id, decision in self._decisions_out:
                found = admitted.get(decision.request_id)
                if found is None:
                    kept.append((workflow_id, decision))
                    continue
                position, priority_value = found
                if decision.lease is not None:
                    replies[position] = AdmitReply(status="granted", lease=decision.lease, priority=priority_value)
                else:
                    replies[position] = AdmitReply(
                        status="rejected", failure=decision.failure, message=decision.message, priority=priority_value
                    )
            self._decisions_out = kept
            for position, priority_value in admitted.values():
                replies.setdefault(position, AdmitReply(status="queued", priority=priority_value))
        return [replies[position] for position in range(len(requests))]

    def _take_in(
        self, request: policy.AdmissionRequest, now: float, late_at: float | None
    ) -> policy.Lease | policy.QueuedRequest | policy.AdmissionRejected | str:
        """One request into the queue, for `admit_batch` and `readmit` alike: the lease or the
        place it already has (its call was sent again), its refusal (recorded in the event log),
        or the priority it was queued at now. `late_at`: when its requester gives up on the
        call (`admit_by`); None where nobody gives up (a readmission)."""
        existing = policy.existing_admission(self._state, request)
        if existing is not None:
            return existing
        try:
            if late_at is not None and now > late_at:
                # The requester has given up on this call: granting it would hold a lease for
                # nobody. It asks again (a new call) or has failed and withdrawn.
                raise policy.AdmissionRejected(
                    FailureClass.TIMEOUT, f"admission reached the scheduler {now - late_at:.1f} s late"
                )
            _, priority = policy.validate_request(self._state, request, gangs=True)
        except policy.AdmissionRejected as rejected:
            self._record_refusal(request, rejected, now)
            return rejected
        policy.enqueue(self._state, request, priority, now)
        return priority

    def _record_refusal(self, request: policy.AdmissionRequest, rejected: policy.AdmissionRejected, now: float) -> None:
        """Bad input and full queues are in the event log too, never only in a reply."""
        self._record(
            policy.PolicyEvent(
                kind="request_refused",
                failure=rejected.failure,
                request_id=request.request_id,
                workflow_id=request.workflow_id,
                message=rejected.message,
                payload={
                    "capability": request.capability[:200],
                    "tenant": request.tenant[:200],
                    "input_bytes": request.input_bytes,
                },
            ),
            now,
        )

    @workflow.signal
    def release(self, signal: ReleaseSignal) -> None:
        self._heard_holder_time(signal.ended_at)
        now = self._now()
        self._stopping.pop(signal.lease_id, None)  # a reclaimed lease's holder has stopped
        lease = self._state.leases.get(signal.lease_id)
        if signal.lease_id in self._state.slots:
            # A request on a delegated slot failed or was preempted: its node reports it and keeps
            # the slot (closed if it was preempted). Only a crashed model changes anything here.
            if lease is not None and signal.outcome == FailureClass.RUNTIME_CRASH.value:
                self._record_all(policy.close_slot(self._state, signal.lease_id, signal.message), now)
                events = policy.resident_crashed(
                    self._state, lease.resident_key, lease.granted_at, signal.message, now, lease.incarnation
                )
                for event in events:
                    if event.workflow_id:
                        self._commands_out.append((event.workflow_id, ResidentCommand("lost", reason=event.message)))
                self._record_all(events, now)
            self._wake = True
            return
        if lease is not None:
            failure_class = parse_failure(signal.outcome)
            self._record(
                policy.PolicyEvent(
                    kind="invoke" if signal.outcome == "ok" else "invoke_failed" if failure_class else signal.outcome,
                    failure=failure_class,
                    request_id=signal.request_id,
                    lease_id=signal.lease_id,
                    accelerator=lease.accelerator,
                    deployment=lease.deployment,
                    workflow_id=lease.workflow_id,
                    message=signal.message + (" (retrying with a new lease)" if signal.retrying else ""),
                    payload={"invoke_s": round(signal.invoke_s, 4), "retrying": signal.retrying},
                ),
                now,
            )
        self._record_all(
            policy.release_lease(
                self._state, signal.lease_id, now, signal.outcome, signal.message, ended_at=signal.ended_at
            ),
            now,
        )
        if lease is None and signal.lease_id not in self._released and not policy.is_slot(signal.lease_id):
            # Its holder is done with a lease this run does not hold (reset past its grant): its
            # ledger row ends now, not when the next audit finds it open (up to a minute later,
            # when the room may have been granted again: the ledger would show both at once).
            # The store keeps a row's first end, so a lease that already ended keeps its own. (A
            # slot given back has no row of its own: its runs' rows come from its node's syncs.)
            self._record(
                policy.PolicyEvent(
                    kind="lease_released",
                    request_id=signal.request_id,
                    lease_id=signal.lease_id,
                    message=f"{signal.outcome} (released by its holder; not held by this run)",
                    payload={
                        "pool": self._state.pool,
                        "outcome": signal.outcome,
                        "unheld": True,
                        # When its holder let go: heard late here (this run was reset past its
                        # grant, and the release applied again), it did not end when heard.
                        "ended_at": now if signal.ended_at is None else min(now, signal.ended_at),
                    },
                ),
                now,
            )
        if lease is not None and signal.outcome == FailureClass.RUNTIME_CRASH.value:
            events = policy.resident_crashed(
                self._state, lease.resident_key, lease.granted_at, signal.message, now, lease.incarnation
            )
            for event in events:
                if event.workflow_id:
                    self._commands_out.append((event.workflow_id, ResidentCommand("lost", reason=event.message)))
            self._record_all(events, now)
        self._wake = True

    @workflow.signal
    def lease_heartbeat(self, heartbeat: LeaseHeartbeat) -> None:
        # A live holder pushes its lease's stale deadline out.
        held = policy.lease_heartbeat(self._state, heartbeat.lease_id, self._now())
        if held:
            return
        if heartbeat.lease_id in self._reclaimed:
            # The lease was reclaimed while neither its holder nor its node could be heard (a
            # node cut off from Temporal longer than stale_lease_s); its room may be granted
            # again by now, and the invoke is still running.
            holder = self._reclaimed.pop(heartbeat.lease_id)
            kind, why = "reclaimed_invoke_stopped", "its lease was reclaimed while its holder was silent"
        elif heartbeat.lease_id in self._released or not is_request_workflow_id(heartbeat.holder):
            return  # it crossed the lease's end here; or no holder named, nothing to stop
        else:
            # A lease this run never granted or forgot: its run was reset past the grant (the
            # replay guard, an operator), or the grant's record was lost with it; or one an
            # earlier run ended (the leases a run ended are not carried at continue-as-new), whose
            # holder is told again, which changes nothing for a holder already stopped. Its memory is
            # counted nowhere, so its room may be granted again while the invoke runs. The ledger
            # audit finds such a grant only if its row was written, and only at the next audit.
            # Its release, once stopped, ends its ledger row (`release`); the audit is not asked
            # now, as it would end the row before the invoke has stopped.
            holder = heartbeat.holder
            kind, why = (
                "unheld_invoke_stopped",
                "the scheduler does not hold it (ended before this run began, or its run was reset past the grant)",
            )
        # Stop it at once: the holder is preempted with no grace (it checkpoints where its
        # runtime can, and is admitted again).
        now = self._now()
        self._preempts_out.append(
            (
                holder,
                PreemptSignal(
                    lease_id=heartbeat.lease_id, reason=f"{why}; the invoke still running is stopped", grace_s=0.0
                ),
            )
        )
        self._record(
            policy.PolicyEvent(
                kind=kind,
                request_id=heartbeat.request_id,
                lease_id=heartbeat.lease_id,
                workflow_id=holder,
                message=f"a heartbeat came for a lease not held: {why}; its holder is preempted with no grace",
            ),
            now,
        )
        self._wake = True

    @workflow.update
    def confirm_lease(self, call: LeaseConfirmCall) -> bool:
        """Whether a lease is still held; its holder is heard from (its silence clock restarts).
        A holder whose grant reached it late asks this before using it: False, and it must not."""
        held = policy.lease_heartbeat(self._state, call.lease_id, self._now())
        if not held:
            self._record(
                policy.PolicyEvent(
                    kind="stale_grant_refused",
                    request_id=call.request_id,
                    lease_id=call.lease_id,
                    message="a holder asked about a lease no longer held; it must not use it",
                ),
                self._now(),
            )
        return held

    @workflow.update
    def delegation_sync(self, sync: DelegationSync) -> DelegationReply:
        """A node's sync about the slots it was lent for warm requests (policy/_delegation.py):
        the requests it served, the slots it still holds, the capabilities it wants slots for.
        The reply lists the slots it may keep."""
        now = self._now()
        reply, events = policy.sync_slots(self._state, sync.sync, now, spare=DELEGATION_SPARE_SLOTS)
        self._record_all(events, now)
        if any(event.kind == "slot_returned" for event in events) or sync.sync.runs:
            self._wake = True  # a slot given back may serve what waits
        return DelegationReply(reply)

    @delegation_sync.validator
    def _validate_delegation_sync(self, sync: DelegationSync) -> None:
        if self._catalog_stale:
            raise ApplicationError(
                "the scheduler is still loading its catalog",
                type=FailureClass.SCHEDULER_STATE_STALE.value,
                non_retryable=False,
            )
        node = sync.sync.node
        if not node or len(node) > 200 or not node.isprintable() or len(sync.sync.held) > 10_000:
            raise ApplicationError(
                "a delegation sync names its node (1 to 200 printable characters) and at most 10,000 slots",
                type=FailureClass.REQUEST_INVALID.value,
                non_retryable=True,
            )

    @workflow.update
    def residency_control(self, call: ResidencyControl) -> ResidencyControlReply:
        """load, unload, pin or unpin a resident on an operator's word (no patch needed: a
        history without this update runs exactly as before). Refusals are typed and change
        nothing; what is done is recorded as events."""
        now = self._now()
        if call.action == "load":
            return self._load_on_demand(call, now)
        outcome = policy.control_residents(
            self._state, call.action, call.deployment, call.accelerator, call.drain, call.actor or "an operator", now
        )
        if outcome.failure is not None:
            return ResidencyControlReply(False, outcome.message, failure=outcome.failure.value)
        self._record_all(outcome.events, now)
        for key, workflow_id in outcome.unload.items():
            self._commands_out.append((workflow_id, ResidentCommand("unload", reason=f"{call.action} of {key}")))
        self._wake = True
        done = {"pin": "pinned", "unpin": "unpinned", "unload": "unloading"}[call.action]
        draining = [key for key in outcome.residents if key in self._state.draining and key not in outcome.reclaiming]
        message = f"{done}: {', '.join(outcome.residents)}"
        if draining:
            message += f" (draining: {', '.join(draining)} unload when their leases end)"
        if outcome.reclaiming:
            # Idle but for slots lent to a node: unloaded once the node gives them back (its next sync).
            message += f" (taking back free lent slots of {', '.join(outcome.reclaiming)} first)"
        return ResidencyControlReply(True, message, residents=outcome.residents)

    @residency_control.validator
    def _validate_residency_control(self, call: ResidencyControl) -> None:
        if self._catalog_stale:
            raise ApplicationError(
                "the scheduler is still loading its catalog",
                type=FailureClass.SCHEDULER_STATE_STALE.value,
                non_retryable=False,
            )
        problem = None
        if call.action not in policy.RESIDENCY_ACTIONS:
            problem = f"action must be one of {', '.join(policy.RESIDENCY_ACTIONS)}, not {call.action[:40]!r}"
        elif not call.deployment or len(call.deployment) > 200 or not call.deployment.isprintable():
            problem = "deployment must be 1 to 200 printable characters"
        elif len(call.accelerator) > 200 or not call.accelerator.isprintable():
            problem = "accelerator must be at most 200 printable characters"
        if problem is not None:
            raise ApplicationError(problem, type=FailureClass.REQUEST_INVALID.value, non_retryable=True)

    def _load_on_demand(self, call: ResidencyControl, now: float) -> ResidencyControlReply:
        """A load is an admission of the scheduler's own (so it is placed, makes room and waits
        by the same rules as any request of its class) whose lease is released at once: the
        model stays by its residency."""
        spec = self._state.catalog.deployment(call.deployment) or next(
            (d for d in self._state.catalog.deployments if d.capability == call.deployment), None
        )
        if spec is None:
            return ResidencyControlReply(
                False, f"no deployment {call.deployment!r} in the catalog", FailureClass.REQUEST_INVALID.value
            )
        if call.accelerator:
            return self._load_on_accelerator(call, spec, now)
        present = (policy.ResidentPhase.READY, policy.ResidentPhase.LOADING)
        residents = self._state.residents.values()
        here = [r.key for r in residents if r.deployment == spec.deployment_id and r.phase in present]
        if here:
            return ResidencyControlReply(True, f"already resident: {', '.join(sorted(here))}", residents=sorted(here))
        request = policy.AdmissionRequest(
            request_id=f"load-{str(workflow.uuid4())[:18]}",
            workflow_id=workflow.info().workflow_id,
            capability=spec.capability,
            tenant=call.tenant or "default",
            priority=call.priority,
        )
        [reply] = self._admit_all([request])
        self._record(
            policy.PolicyEvent(
                kind="load_asked",
                request_id=request.request_id,
                deployment=spec.deployment_id,
                message=f"load asked by {call.actor or 'an operator'}: {reply.status}",
            ),
            now,
        )
        if reply.status == "rejected":
            return ResidencyControlReply(
                False, reply.message, reply.failure or FailureClass.CAPABILITY_UNAVAILABLE.value
            )
        if reply.lease is not None:
            self._record_all(policy.release_lease(self._state, reply.lease.lease_id, now, "ok", "operator load"), now)
            placed = reply.lease.resident_key
            return ResidencyControlReply(True, f"loaded on {reply.lease.accelerator}", residents=[placed])
        return ResidencyControlReply(True, "queued: it loads as soon as there is room", residents=[])

    def _load_on_accelerator(self, call: ResidencyControl, spec: Deployment, now: float) -> ResidencyControlReply:
        """Load on the named card now, or refuse typed and change nothing (`policy.load_on`)."""
        decided = policy.load_on(self._state, spec, call.accelerator, now)
        if isinstance(decided, policy.AlreadyResident):
            return ResidencyControlReply(
                True, f"already resident: {decided.resident_key}", residents=[decided.resident_key]
            )
        actor = call.actor or "an operator"
        if isinstance(decided, policy.LoadRefusal):
            self._record(
                policy.PolicyEvent(
                    kind="load_asked",
                    accelerator=call.accelerator,
                    deployment=spec.deployment_id,
                    failure=decided.failure,
                    message=f"load asked by {actor}: refused: {decided.message}",
                ),
                now,
            )
            return ResidencyControlReply(False, decided.message, decided.failure.value)
        self._record(
            policy.PolicyEvent(
                kind="load_asked",
                accelerator=decided.accelerator,
                deployment=spec.deployment_id,
                message=f"load asked by {actor}: loading on {decided.accelerator}",
            ),
            now,
        )
        self._start_loads([decided], now)
        return ResidencyControlReply(True, f"loading on {decided.accelerator}", residents=[decided.resident_key])

    def _own_grants(self, now: float) -> None:
        """Decisions addressed to this scheduler are its own loads: their leases go back at once."""
        own = workflow.info().workflow_id
        if not any(workflow_id == own for workflow_id, _ in self._decisions_out):
            return
        kept = []
        for workflow_id, decision in self._decisions_out:
            if workflow_id != own:
                kept.append((workflow_id, decision))
            elif decision.lease is not None:
                self._record_all(
                    policy.release_lease(self._state, decision.lease.lease_id, now, "ok", "operator load"), now
                )
        self._decisions_out = kept

    def _unload_drained(self, now: float) -> None:
        for key, workflow_id in policy.drained(self._state).items():
            resident = self._state.residents[key]
            self._record(
                policy.PolicyEvent(
                    kind="unload_requested",
                    accelerator=resident.accelerator,
                    deployment=resident.deployment,
                    workflow_id=workflow_id,
                    message="drained: its last lease ended",
                ),
                now,
            )
            self._commands_out.append((workflow_id, ResidentCommand("unload", reason=f"drained: {key}")))
            self._wake = True

    @workflow.signal
    def cancel(self, signal: CancelSignal) -> None:
        self._heard_holder_time(signal.sent_at)
        now = self._now()
        events = policy.cancel_request(self._state, signal.request_id, now, signal.reason, ended_at=signal.sent_at)
        self._record_all(events, now)
        self._wake = True

    @workflow.signal
    def deadline_due(self, signal: DeadlineDue) -> None:
        """A pass now: a requester's clock says `signal.request_id`'s deadline passed. Temporal's
        timers fire up to a second late on a busy server, and a refusal sent a second late
        reaches a client that stopped listening. The pass refuses it (or lets a class that runs
        late wait) by the usual rule; a pass a hair early leaves it to the deadline's timer."""
        self._wake = True

    @workflow.signal
    def audit_ledger(self, audit: LedgerAudit | None = None) -> None:
        """Compare the lease ledger with the leases held now, not at the next interval: sent by
        the replay guard with a reset of this run (a reset run forgets what the lost part of its
        history granted, while those grants' ledger rows are open and their holders may run).
        Grants wait until the audit has answered (`_grants_wait_for_audit`); the lost grants the
        guard names are reclaimed with it (`_reclaim_forgotten`)."""
        for lease in audit.lost_grants if audit is not None else []:
            self._never_reissue(lease.lease_id)
            if lease.lease_id not in self._state.leases:
                self._lost_grants[lease.lease_id] = lease
        self._repair_open = audit is not None and not audit.final
        self._audit_asked = True
        if self._grants_wait_since is None and self._audit_interval_s > 0:
            self._grants_wait_since = self._now()
        self._wake = True

    @workflow.signal
    def readmit(self, batch: AdmitBatch) -> None:
        """Admissions a reset discarded, sent again by the replay guard (the reset applies no
        update again: an `admit_batch` decided again would answer in a reply nobody reads, while
        its requester waits for the word of the run it was answered by). The requester had its
        answer (queued or granted) from the lost run, so every decision about it goes by signal:
        a lease this run already holds for it, a refusal, or the grant of the pass that admits it
        (after the ledger audit asked with the reset). Its call's time budget (`admit_by`) is
        not checked again: the requester has not given up, it waits for a word."""
        now = self._now()
        for request in batch.requests[:MAX_ADMIT_BATCH]:
            taken = self._take_in(request, now, late_at=None)
            if isinstance(taken, policy.Lease):
                decision = LeaseDecision(request_id=request.request_id, lease=taken)
            elif isinstance(taken, policy.AdmissionRejected):
                failure = taken.failure.value
                decision = LeaseDecision(request_id=request.request_id, failure=failure, message=taken.message)
            else:
                continue  # queued: the pass that grants it tells it
            self._decisions_out.append((request.workflow_id, decision))
        self._wake = True

    @workflow.signal
    def rebase(self, signal: RebaseSignal) -> None:
        """No patch needed: a history without this signal runs exactly as before."""
        if self._rebase is None:
            now = self._now()
            self._record(policy.PolicyEvent(kind="scheduler_rebased", message=signal.reason[:500]), now)
        self._rebase = signal.reason
        self._wake = True

    @workflow.signal
    def observe(self, sample: NodeSample) -> None:
        now = self._now()
        observations = list(sample.observations)
        if sample.error:
            observations = [
                Observation(
                    accelerator=acc.id,
                    total_bytes=acc.total_bytes,
                    used_bytes=-1,
                    healthy=False,
                    health_reason=sample.error,
                    received_at=now,
                )
                for acc in self._state.catalog.accelerators
                if acc.node == sample.node
            ]
        events = policy.apply_observations(self._state, observations, now)
        events.extend(policy.capacity_alerts(self._state, now))
        for event in events:
            if event.kind == "resident_lost" and event.workflow_id:
                self._commands_out.append((event.workflow_id, ResidentCommand("lost", reason=event.message)))
        self._record_all(events, now)
        self._wake = True

    @workflow.signal
    def resident_loaded(self, report: ResidentReport) -> None:
        now = self._now()
        resident = self._state.residents.get(report.key)
        if not self._current(report.key, report.workflow_id):
            if report.ok:
                # Another life holds the key (this one's load was decided again under another
                # residency, or taken as failed and loaded again): the node holds one model per
                # key, theirs to share, so this residency ends without unloading it.
                why = f"{report.key} is held by {resident.workflow_id if resident else 'another residency'}"
                self._commands_out.append((report.workflow_id, ResidentCommand("lost", reason=why)))
                self._wake = True
            return
        if report.ok and resident is None:
            self._adopt_unknown(report, now)
            return
        self._loads_heard_since.pop(report.key, None)
        if report.ok and resident is not None and resident.phase != policy.ResidentPhase.LOADING:
            return  # heard already: an adopted residency reports its load again
        accelerator = resident.accelerator if resident else ""
        deployment = resident.deployment if resident else ""
        workflow_id = resident.workflow_id if resident else ""
        if report.ok:
            if not report.again:  # an adopted residency's answer: no load happened now
                self._record(
                    policy.PolicyEvent(
                        kind="load",
                        accelerator=accelerator,
                        deployment=deployment,
                        workflow_id=workflow_id,
                        payload={"load_s": round(report.load_s, 3), "measured_bytes": report.measured_bytes},
                    ),
                    now,
                )
                self._record(
                    policy.PolicyEvent(
                        kind="health_check",
                        message="functional health check passed",
                        accelerator=accelerator,
                        deployment=deployment,
                        workflow_id=workflow_id,
                        payload={"health_s": round(report.health_s, 3)},
                    ),
                    now,
                )
            self._record_all(
                policy.resident_ready(self._state, report.key, report.measured_bytes, now, measure=not report.again),
                now,
            )
        else:
            self._resident_failed(report, now)
        self._wake = True

    def _adopt_unknown(self, report: ResidentReport, now: float) -> None:
        """A residency loaded that this run does not hold (a reset run hears the reports of its
        lost part again; or its resident was dropped meanwhile): its card holds the model, so it
        is adopted, ready, rather than left holding memory nobody counts. One that cannot be
        (its deployment or card gone from the catalog) is unloaded."""
        if not report.workflow_id or not report.deployment:
            return  # a report that does not say what it loaded where: nothing to adopt it by
        if self._before_first_catalog():
            self._reports_before_catalog.append(report)  # a first run: heard again once it has one
            return
        events = policy.adopt_resident(
            self._state,
            report.key,
            report.deployment,
            report.accelerator,
            report.workflow_id,
            report.measured_bytes,
            now,
        )
        if events is None:
            why = "loaded for history a reset discarded; its deployment or card is no longer in the catalog"
            self._commands_out.append((report.workflow_id, ResidentCommand("unload", reason=why)))
        else:
            self._record_all(events, now)
            # It answers with what it is now: loaded, or woken from a sleep. (The load counter,
            # rewound with the reset, is left as it is: a load the discarded part decided after
            # this one is decided again under the same id, and adopted when its start is refused.)
            self._commands_out.append(
                (report.workflow_id, ResidentCommand("adopt", reason="heard loaded by a run that did not hold it"))
            )
        self._wake = True

    def _before_first_catalog(self) -> bool:
        """Whether this is a first run whose catalog has not come yet: residency reports and
        timers heard now wait for it (`_reports_before_catalog`), as nothing can be adopted or
        kept without knowing the deployments."""
        return self._catalog_stale and not self._state.catalog.deployments

    def _ask_overdue_loads(self, now: float) -> None:
        """A load whose residency has said nothing within its deployment's report limit is asked
        whether it is still there (`adopt`: loaded, it reports so; loading, it will): one that
        is gone (terminated by hand, or adopted while it was closing) fails the load at once
        (`_residency_gone`), its waiters told; one that is there is given another limit (a
        worker down for long, a slow load: never failed while it lives). A load whose start is
        still on its way is not asked. Looked at every LOAD_CHECK_INTERVAL_S at most."""
        if now < self._loads_checked_until:
            return
        overdue, due = policy.overdue_loads(self._state, now, self._loads_heard_since)
        self._loads_checked_until = min(
            due if due is not None else now + LOAD_CHECK_INTERVAL_S, now + LOAD_CHECK_INTERVAL_S
        )
        starting = {load.key for load in self._loads_out}
        for key in overdue:
            resident = self._state.residents[key]
            if key in starting or resident.workflow_id in self._sending:
                continue  # its start (or an earlier word to it) is still on its way
            self._loads_heard_since[key] = now
            why = "no word from it within its load's limit: still there?"
            self._commands_out.append((resident.workflow_id, ResidentCommand("adopt", reason=why)))
            self._wake = True

    def _residency_gone(self, workflow_id: str, error: Exception) -> None:
        """An `adopt` could not reach its residency (closed, or never there): the load it was
        to report fails now, its waiters told, instead of holding its bytes and its waiters."""
        resident = next((r for r in self._state.residents.values() if r.workflow_id == workflow_id), None)
        if resident is None or resident.phase != policy.ResidentPhase.LOADING:
            return
        self._loads_heard_since.pop(resident.key, None)
        self._resident_failed(
            ResidentReport(
                key=resident.key,
                ok=False,
                failure=FailureClass.MODEL_LOAD_FAILED.value,
                message=f"its residency {workflow_id} is gone: {error}",
                workflow_id=workflow_id,
            ),
            self._now(),
        )
        self._wake = True

    @workflow.signal
    def resident_slept(self, report: ResidentReport) -> None:
        """A resident put to sleep to make room (measured_bytes: what it still holds), or not."""
        if not self._current(report.key, report.workflow_id):
            return
        now = self._now()
        self._record_all(
            policy.resident_slept(self._state, report.key, report.ok, report.measured_bytes, report.message, now), now
        )
        self._wake = True

    @workflow.signal
    def resident_woke(self, report: ResidentReport) -> None:
        """Awake again for the requests waiting on it, or the wake failed (the residency workflow
        has unloaded it): those requests are told why, as after a failed load."""
        if not self._current(report.key, report.workflow_id):
            return
        now = self._now()
        if report.ok:
            self._record_all(policy.resident_woke(self._state, report.key, report.measured_bytes, now), now)
        else:
            self._resident_failed(report, now)
        self._wake = True

    def _resident_failed(self, report: ResidentReport, now: float) -> None:
        """A load, its health check or a wake failed: the resident is gone and whoever waited on
        it hears the failure class."""
        cls = FailureClass(report.failure or FailureClass.MODEL_LOAD_FAILED.value)
        rejects, events = policy.resident_failed(self._state, report.key, cls, report.message, now)
        self._record_all(events, now)
        self._decisions_out.extend(
            (r.workflow_id, LeaseDecision(r.request_id, failure=r.failure.value, message=r.message)) for r in rejects
        )

    @workflow.signal
    def resident_idle(self, idle: ResidentIdle) -> None:
        if self._before_first_catalog():
            self._reports_before_catalog.append(idle)  # a first run: heard once it has a catalog
            return
        now = self._now()
        resident = self._state.residents.get(idle.key)
        if resident is None or not self._current(idle.key, idle.workflow_id):
            # Already dropped (lost with its node): the residency workflow has nothing to keep.
            self._commands_out.append((idle.workflow_id, ResidentCommand("lost", reason="not resident")))
            self._wake = True
            return
        until = policy.keep_warm_check(self._state, idle.key, now)
        if until is None:
            self._record(
                policy.PolicyEvent(
                    kind="unload_requested",
                    accelerator=resident.accelerator,
                    deployment=resident.deployment,
                    workflow_id=resident.workflow_id,
                    message=f"idle for its keep_warm TTL of {resident.ttl_s:.0f} s",
                ),
                now,
            )
            self._commands_out.append((resident.workflow_id, ResidentCommand("unload", reason="ttl expired")))
        else:
            self._commands_out.append((resident.workflow_id, ResidentCommand("extend", until=until)))
        self._wake = True

    @workflow.signal
    def resident_unloaded(self, report: UnloadReport) -> None:
        now = self._now()
        resident = self._state.residents.get(report.key)
        if not self._current(report.key, report.workflow_id):
            return
        if resident is not None:
            self._record(
                policy.PolicyEvent(
                    kind="unload",
                    accelerator=resident.accelerator,
                    deployment=resident.deployment,
                    workflow_id=resident.workflow_id,
                    payload={"unload_s": round(report.unload_s, 3)},
                ),
                now,
            )
        self._record_all(policy.resident_unloaded(self._state, report.key, report.reclaimed, report.message, now), now)
        self._wake = True

    def _current(self, key: str, workflow_id: str) -> bool:
        """Whether a residency report comes from the key's current life; a report from a previous
        one (lost, then loaded again) must not move the new one."""
        resident = self._state.residents.get(key)
        return resident is None or not workflow_id or resident.workflow_id == workflow_id

    @workflow.signal
    def catalog_changed(self) -> None:
        self._catalog_stale = True

    @workflow.query
    def status(self) -> policy.PoolStatus:
        return replace(policy.pool_status(self._state, self._now()), catalog_loading=self._catalog_stale)

    @workflow.query
    def state(self) -> policy.PoolState:
        return self._state

    @workflow.query
    def verdicts(self, query: VerdictQuery) -> list[policy.Verdict]:
        """Each queued request's verdict (position, typed reason, ETA), from the state as it is
        now: always current, computed when asked (policy/_verdicts.py; no history event)."""
        wanted = set(query.request_ids) if query.request_ids else None
        found = policy.verdicts(self._state, self._now(), wanted)
        return [v for v in found if v.tenant == query.tenant] if query.tenant else found

    @workflow.query
    def admission_check(self, request: policy.AdmissionRequest) -> policy.AdmissionCheck:
        """The dry run: what the policy would decide for `request` now, on a copy of the state;
        nothing is enqueued, started or held (a query: no history event)."""
        if self._catalog_stale:
            return policy.AdmissionCheck(
                answer="later",
                pool=self._state.pool,
                capability=request.capability,
                deployment="",
                priority=request.priority or "",
                action="wait",
                checked_at=self._now(),
                failure=FailureClass.SCHEDULER_STATE_STALE.value,
                message="the scheduler is still loading its catalog",
            )
        return policy.admission_check(self._state, request, self._now())

    @workflow.query
    def route(self, query: RouteQuery) -> RouteInfo:
        """How well this pool can serve a capability now: clients choose a pool by it
        (modelforge/routing.py). Ready once a catalog is loaded (a reload keeps the old one)."""
        return route_info(self._state, query, self._now(), ready=bool(self._state.catalog.accelerators))

    # --- loop -------------------------------------------------------------------------------

    @workflow.run
    async def run(self, start: SchedulerInput) -> None:
        # A patch of this workflow is asked here, first, before any handler can run the policy
        # (docs/RELEASING.md): one first asked inside an update handler records its marker where
        # a replay does not expect it.
        # Lease fencing: a lease never heard from is held for UNHEARD_LEASE_FACTOR x stale_lease_s.
        if self._state.config.unheard_lease_s is None:
            config = self._state.config
            self._state.config = replace(config, unheard_lease_s=UNHEARD_LEASE_FACTOR * config.stale_lease_s)
        while True:
            if self._catalog_stale:
                await self._reload_catalog()
                heard, self._reports_before_catalog = self._reports_before_catalog, []
                for report in heard:  # in the order they came
                    if isinstance(report, ResidentIdle):
                        self.resident_idle(report)
                    else:
                        self.resident_loaded(report)
            self._ask_overdue_loads(self._now())
            self._reclaim_forgotten(self._now())
            if self._grants_wait_since is not None and not self._grants_wait_for_audit():
                # The audit did not answer in time (Postgres down, Temporal restarting): grant
                # again, but not over the lost grants the guard named. Those are reclaimed now,
                # their holders stopped and their room held until they say so, as the audit
                # would have: before, their bytes could be granted again while their holders
                # ran. (Read from the code, not seen: the chaos round's ledger violation it was
                # first taken for was a clock artifact, docs/BENCHMARKS.md.)
                self._grants_wait_since = None
                lost, self._lost_grants = self._lost_grants, {}
                self._reclaim_named(lost, self._released_unwritten, self._now())
            if not self._grants_held():
                self._run_policy(self._now())
            self._own_grants(self._now())
            self._unload_drained(self._now())
            self._snapshot()
            self._audit_ledger()
            continue_due = self._should_continue_as_new(start)
            if not continue_due:
                self._continue_due_at = None
            elif self._continue_due_at is None:
                self._continue_due_at = self._now()
            self._holding = continue_due and (self._continue_overdue() or not self._delivery_held_up())
            if not self._holding:
                self._send_outbox()
            self._start_event_write()
            if continue_due and workflow.all_handlers_finished() and not self._sends_started:
                # Nothing waits on Postgres here: what is not yet delivered or written goes to
                # the next run in its input, and is sent or written (again) from there.
                # The next run starts on the deployment's current build (Worker Versioning): a
                # new release takes the pool over here, with the state and nothing lost.
                workflow.continue_as_new(
                    replace(
                        start,
                        state=self._state,
                        carried=self._outbox(),
                        ledger_audit_at=self._next_audit_at(),
                        grants_wait_for_audit_since=self._grants_wait_since,
                        lost_grants=list(self._lost_grants.values()),
                        audit_repair_open=self._repair_open,
                        holders_stopping=dict(self._stopping),
                    ),
                    task_timeout=SCHEDULER_TASK_TIMEOUT,
                    initial_versioning_behavior=UPGRADE_ON_CONTINUE,
                )
            # One wake-up timer in flight, not one started and cancelled per loop iteration.
            self._arm_timer(self._next_wake())
            await workflow.wait_condition(
                lambda: (
                    self._wake
                    or self._catalog_stale
                    or self._timer_fired
                    or self._events_writable()
                    or (self._audit is not None and self._audit.done())
                    or (self._outbox_waiting() and len(self._sends_started) < MAX_SENDS_IN_FLIGHT and not self._holding)
                    or (self._holding and not self._sends_started and workflow.all_handlers_finished())
                )
            )
            self._timer_fired = False
            self._wake = False

    def _outbox(self) -> CarriedOutbox:
        unconfirmed = [event for write, batch in self._unconfirmed if not _succeeded(write) for event in batch]
        return CarriedOutbox(
            decisions=[AddressedDecision(w, d) for w, d in self._decisions_out],
            commands=[AddressedCommand(w, c) for w, c in self._commands_out],
            preempts=[AddressedPreempt(w, p) for w, p in self._preempts_out],
            loads=list(self._loads_out),
            events=unconfirmed + self._events,
        )

    def _arm_timer(self, delay: float) -> None:
        """One wake-up timer in flight: replaced only when something is due earlier than it."""
        deadline = self._now() + delay
        if self._timer is not None and not self._timer.done():
            if deadline >= self._timer_at - 0.001:
                return
            self._timer.cancel()
        self._timer_at = deadline
        self._timer = asyncio.ensure_future(self._sleep_then_wake(delay))

    async def _sleep_then_wake(self, delay: float) -> None:
        try:
            await workflow.sleep(delay)
        except asyncio.CancelledError:
            return
        self._timer_fired = True

    def _events_writable(self) -> bool:
        """Events wait while one write is in flight, and for the write interval (they go in the
        next write, together), unless a batch is full."""
        if not self._events:
            return False
        if len(self._events) >= EVENT_BATCH:
            return True
        return not self._event_write_in_flight() and self._now() >= self._events_due_at()

    def _event_write_in_flight(self) -> bool:
        return self._events_in_flight is not None and not self._events_in_flight.done()

    def _events_due_at(self) -> float:
        """When the buffered events may go: EVENT_WRITE_INTERVAL_S after the last write, and not
        before the oldest has waited EVENT_WRITE_WAIT_S unless one is urgent (lazy writes)."""
        due = self._events_written_at + EVENT_WRITE_INTERVAL_S
        if self._events and not self._urgent_events:
            due = max(due, self._events[0].at + EVENT_WRITE_WAIT_S)
        return due

    def _should_continue_as_new(self, start: SchedulerInput) -> bool:
        info = workflow.info()
        if info.is_continue_as_new_suggested() or self._rebase is not None:
            return True
        return info.get_current_history_length() >= start.max_history_events

    async def _reload_catalog(self) -> None:
        catalog = await workflow.execute_activity(
            "load_catalog",
            result_type=Catalog,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=STORE_RETRY,
            summary="load catalog",
        )
        self._state.catalog = catalog
        self._state.view_epoch += 1  # nodes lent slots check requests by the new one
        # Admission waits for the usage too: the first decisions already see past consumption.
        if self._usage_unseeded:
            self._usage_unseeded = False
            now = self._now()
            usage = await workflow.execute_activity(
                "usage_from_ledger",
                UsageQuery(self._state.pool, self._state.config.fair_share_half_life_s, now),
                result_type=dict[str, float],
                task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=STORE_RETRY,
                summary="fair-share usage from the lease ledger",
            )
            # Keyed by fair-share entity: the tenant, or `queue/tenant` outside the default queue.
            for entity, gpu_seconds in sorted(usage.items()):
                if entity not in self._state.usage:
                    self._state.usage[entity] = policy.TenantUsage(gpu_seconds=gpu_seconds, updated_at=now)
        self._catalog_stale = False
        self._record(policy.catalog_loaded_event(catalog), self._now())
        # The nodes' advertised labels (NVLink groups from NVML) outlive a catalog change.
        self._record_all(policy.relabel(self._state), self._now())

    def _heard_holder_time(self, at: float | None) -> None:
        """A holder said when it let go (or gave up): the run's clock reads no earlier (`_now`),
        at most `CLOCK_LEAD_LIMIT_S` past the task's own time."""
        if at is not None:
            task_time = workflow.now().timestamp()
            self._clock_floor = max(self._clock_floor, min(at, task_time + CLOCK_LEAD_LIMIT_S))

    def _now(self) -> float:
        """The run's clock: its workflow task's time, never earlier than a let-go time a holder
        told it. A task retried after a Temporal restart reads its first attempt's start, which
        may precede the releases it applies (13 s in a chaos round): a lease granted in their room
        then was stamped before its room was let go, and once a reset applied those releases
        again at their own let-go times, the ledger showed both leases at once."""
        return max(workflow.now().timestamp(), self._clock_floor)

    def _next_wake(self) -> float:
        now = self._now()
        due = [now + self._reconcile_s]
        # Both a request's lease timeout and its deadline wake the loop (its expiry, the earlier,
        # is refused then; the later one is a timer a refusal cancels).
        for queued in self._state.queue:
            due.append(queued.lease_timeout_at)
            if queued.deadline_at is not None:
                due.append(queued.deadline_at)
        stale_at = policy.stale_leases_due(self._state)
        if stale_at is not None:
            due.append(stale_at)
        # A lease held unheard for longer must not delay the silent-node rule.
        silent_at = policy.silent_nodes_due(self._state)
        if silent_at is not None:
            due.append(silent_at)
        if self._next_snapshot_at is not None:
            due.append(self._next_snapshot_at)
        if self._audit_at is not None and self._audit is None:
            due.append(self._audit_at)
        if self._events and not self._event_write_in_flight():
            due.append(self._events_due_at())
        if self._holding and self._sends_started:
            due.append(next(iter(self._sends_started.values())) + HELD_UP_DELIVERY_S)
        if self._continue_due_at is not None and not self._holding:
            due.append(self._continue_due_at + CONTINUE_WAIT_LIMIT_S)
        if self._grants_wait_since is not None:
            due.append(self._grants_wait_since + AUDIT_BEFORE_GRANTS_LIMIT_S)
        if self._stopping:
            due.append(min(self._stopping.values()) + HOLDER_STOP_LIMIT_S)
        return max(0.5, min(due) - now)

    def _run_policy(self, now: float) -> None:
        self._record_all(policy.reclaim_stale_leases(self._state, now), now)
        decisions = policy.decide(self._state, now)
        if decisions.empty():
            policy.apply_decisions(self._state, decisions, now, {})
            policy.stamp_predictions(self._state, now, decisions)
            return
        self._record_all(policy.apply_decisions(self._state, decisions, now, self._load_ids(decisions.loads)), now)
        policy.stamp_predictions(self._state, now, decisions)
        for grant in decisions.grants:
            self._decisions_out.append((grant.workflow_id, LeaseDecision(grant.request_id, lease=grant.lease)))
        for preempt in decisions.preemptions:
            self._preempts_out.append(
                (preempt.workflow_id, PreemptSignal(preempt.lease_id, reason=preempt.reason, grace_s=preempt.grace_s))
            )
        for reject in decisions.rejects:
            self._decisions_out.append(
                (
                    reject.workflow_id,
                    LeaseDecision(reject.request_id, failure=reject.failure.value, message=reject.message),
                )
            )
        self._send_loads(decisions.loads)
        for unload in decisions.unloads:
            resident = self._state.residents.get(unload.resident_key)
            if resident is not None:
                self._commands_out.append((resident.workflow_id, ResidentCommand("unload", reason=unload.reason)))
        for sleep in decisions.sleeps:
            resident = self._state.residents.get(sleep.resident_key)
            if resident is not None:
                self._commands_out.append((resident.workflow_id, ResidentCommand("sleep", reason=sleep.reason)))
        for wake in decisions.wakes:
            resident = self._state.residents.get(wake.resident_key)
            if resident is not None:
                self._commands_out.append((resident.workflow_id, ResidentCommand("wake")))
        self._wake = True

    def _load_ids(self, loads: list[policy.StartLoad]) -> dict[str, str]:
        """The residency workflow id of each new load (resident key -> id)."""
        ids: dict[str, str] = {}
        for load in loads:
            self._state.load_counter += 1
            ids[load.resident_key] = resident_workflow_id(load.deployment, load.accelerator, self._state.load_counter)
        return ids

    def _send_loads(self, loads: list[policy.StartLoad]) -> None:
        """Each applied load's residency workflow, to start at the next flush."""
        for load in loads:
            deployment = next(d for d in self._state.catalog.deployments if d.deployment_id == load.deployment)
            accelerator = self._state.catalog.accelerator(load.accelerator)
            assert accelerator is not None
            self._loads_out.append(
                ResidencyInput(
                    pool=self._state.pool,
                    key=load.resident_key,
                    deployment=deployment,
                    accelerator=accelerator,
                    device_index=device_index(accelerator.id),
                )
            )

    def _start_loads(self, loads: list[policy.StartLoad], now: float) -> None:
        """Start loads decided outside a decision pass (an operator's load on a named card) the
        way a pass starts its own: ids, applied to the state, sent at the next flush."""
        decisions = policy.Decisions(loads=loads)
        self._record_all(policy.apply_decisions(self._state, decisions, now, self._load_ids(loads)), now)
        self._send_loads(loads)
        self._wake = True

    def _send_outbox(self) -> None:
        """Starts delivering what the loop decided (residency starts, grants and refusals,
        resident commands, preemptions) and goes on without waiting for any of it: one delivery
        that Temporal holds up (its server, restarted, works through a backlog: seen for minutes
        in the chaos round) must not stop the pool's decisions. Deliveries to one workflow keep
        their order; at most MAX_SENDS_IN_FLIGHT are under way, the rest wait here (and while
        continue-as-new is due, all new ones, unless one under way is held up: HELD_UP_DELIVERY_S).
        A delivery that fails says so in its own way (the requester is gone: its lease goes back)."""
        room = MAX_SENDS_IN_FLIGHT - len(self._sends_started)
        loads, self._loads_out = self._loads_out[:room], self._loads_out[room:]
        room -= len(loads)
        decisions, self._decisions_out = self._decisions_out[:room], self._decisions_out[room:]
        room -= len(decisions)
        commands, self._commands_out = self._commands_out[:room], self._commands_out[room:]
        room -= len(commands)
        preempts, self._preempts_out = self._preempts_out[:room], self._preempts_out[room:]
        for load in loads:
            workflow_id = self._resident_workflow_id(load)
            self._send(workflow_id, partial(self._start_residency, workflow_id, load))
        for workflow_id, decision in decisions:
            self._send(workflow_id, partial(self._tell_requester, workflow_id, decision))
        for workflow_id, command in commands:
            self._send(workflow_id, partial(self._command_resident, workflow_id, command))
        for workflow_id, preempt in preempts:
            self._send(workflow_id, partial(self._preempt_holder, workflow_id, preempt))

    def _send(self, workflow_id: str, delivery: Callable[[], Awaitable[object]]) -> None:
        """One delivery, after the one before it to the same workflow."""
        before = self._sending.get(workflow_id)
        self._sends += 1
        serial = self._sends
        self._sends_started[serial] = self._now()

        async def deliver() -> object:
            try:
                if before is not None:
                    await before  # never raises: each delivery handles its own failure
                return await delivery()
            finally:
                del self._sends_started[serial]
                if self._sending.get(workflow_id) is task:
                    del self._sending[workflow_id]

        task = asyncio.ensure_future(deliver())
        self._sending[workflow_id] = task

    def _grants_wait_for_audit(self) -> bool:
        """Whether grants wait for the ledger audit asked with a reset (AUDIT_BEFORE_GRANTS_LIMIT_S)."""
        since = self._grants_wait_since
        return since is not None and self._now() - since < AUDIT_BEFORE_GRANTS_LIMIT_S

    def _holders_stopping(self) -> bool:
        """Whether grants wait for the holders of reclaimed leases to stop (HOLDER_STOP_LIMIT_S);
        a holder not heard from in that long is let go."""
        now = self._now()
        for lease_id, told_at in list(self._stopping.items()):
            if now - told_at >= HOLDER_STOP_LIMIT_S:
                del self._stopping[lease_id]
        return bool(self._stopping)

    def _grants_held(self) -> bool:
        """Whether this pass grants nothing: the audit asked with a reset has not answered, or
        the holders of the leases it reclaimed have not stopped."""
        return self._grants_wait_for_audit() or self._holders_stopping()

    def _continue_overdue(self) -> bool:
        """Whether continue-as-new has been due for CONTINUE_WAIT_LIMIT_S or more."""
        return self._continue_due_at is not None and self._now() - self._continue_due_at >= CONTINUE_WAIT_LIMIT_S

    def _delivery_held_up(self) -> bool:
        """Whether the oldest delivery under way has taken HELD_UP_DELIVERY_S or more."""
        oldest = next(iter(self._sends_started.values()), None)
        return oldest is not None and self._now() - oldest >= HELD_UP_DELIVERY_S

    def _outbox_waiting(self) -> bool:
        return bool(self._loads_out or self._decisions_out or self._commands_out or self._preempts_out)

    def _resident_workflow_id(self, load: ResidencyInput) -> str:
        resident = self._state.residents.get(load.key)
        return resident.workflow_id if resident is not None else ""

    async def _start_residency(self, workflow_id: str, load: ResidencyInput) -> object:
        try:
            try:
                await workflow.start_child_workflow(
                    ResidencyWorkflow.run,
                    load,
                    id=workflow_id,
                    task_queue=CONTROL_TASK_QUEUE,
                    parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                    static_summary=f"{load.deployment.deployment_id} on {load.accelerator.id}",
                )
            except WorkflowAlreadyStartedError:
                # This very load runs already: the run was reset past its start and decided it
                # again (the load counter rewound with it, so the id is the same: same model, same
                # card). That residency is adopted, not taken for a failed load: it reports its
                # load to this run (it did to the lost one, or will), or wakes and reports.
                self._record(
                    policy.PolicyEvent(
                        kind="residency_adopted",
                        accelerator=load.accelerator.id,
                        deployment=load.deployment.deployment_id,
                        workflow_id=workflow_id,
                        message="its start was refused: it runs already, started by history a reset discarded",
                    ),
                    self._now(),
                )
                await workflow.get_external_workflow_handle(workflow_id).signal(
                    "command", ResidentCommand("adopt", reason="the scheduler was reset past its start")
                )
        except Exception as error:  # a start that failed is a failed load, never a silent gap
            self.resident_loaded(
                ResidentReport(
                    key=load.key,
                    ok=False,
                    failure=FailureClass.RESIDENCY_CONFLICT.value,
                    message=f"could not start {workflow_id}: {error}",
                    workflow_id=workflow_id,  # never a later life of the key decided meanwhile
                )
            )
        return None

    async def _tell_requester(self, workflow_id: str, decision: LeaseDecision) -> object:
        lease = decision.lease
        if lease is not None and lease.lease_id not in self._state.leases:
            # Reclaimed or cancelled before it went out: a grant is never delivered for a lease
            # that is no longer held (its holder would use memory promised to someone else).
            self._record(
                policy.PolicyEvent(
                    kind="grant_withdrawn",
                    request_id=decision.request_id,
                    lease_id=lease.lease_id,
                    workflow_id=workflow_id,
                    message="the lease ended before its grant was delivered",
                ),
                self._now(),
            )
            return None
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("lease_decision", decision)
        except Exception as error:
            # The requester is gone (terminated, timed out): its lease goes back to the pool.
            now = self._now()
            self._record_all(
                policy.cancel_request(self._state, decision.request_id, now, f"requester unreachable: {error}"), now
            )
            self._wake = True
        return None

    async def _preempt_holder(self, workflow_id: str, preempt: PreemptSignal) -> object:
        if preempt.lease_id in self._state.slots:
            # A delegated slot is taken back by closing it: its node gives it back once free. Its
            # request, if one holds it, is preempted too (below).
            self._record_all(policy.close_slot(self._state, preempt.lease_id, preempt.reason), self._now())
            if policy.is_delegation_holder(workflow_id):
                return None
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("preempt", preempt)
        except Exception as error:
            # The holder is gone: nobody will release, so the lease goes back now.
            now = self._now()
            if preempt.lease_id in self._state.slots:
                return None  # its node still holds the slot: it comes back with the node's next sync
            lease = self._state.leases.get(preempt.lease_id)
            if lease is not None:
                self._record_all(
                    policy.cancel_request(self._state, lease.request_id, now, f"holder unreachable: {error}"), now
                )
            self._wake = True
        return None

    async def _command_resident(self, workflow_id: str, command: ResidentCommand) -> object:
        try:
            await workflow.get_external_workflow_handle(workflow_id).signal("command", command)
        except Exception as error:
            self._record(
                policy.PolicyEvent(kind="resident_unreachable", workflow_id=workflow_id, message=str(error)),
                self._now(),
            )
            if command.action == "adopt":
                self._residency_gone(workflow_id, error)
        return None

    def _audit_ledger(self) -> None:
        """Every ledger_audit_interval_s (and at once when asked), read the pool's open ledger
        rows, off the admission path; `_reclaim_forgotten` compares them with the leases held
        when the answer comes."""
        if self._catalog_stale or self._audit is not None or self._audit_interval_s <= 0:
            return
        now = self._now()
        if self._audit_at is None:
            self._audit_at = now + self._audit_interval_s
        if now < self._audit_at and not self._audit_asked:
            return
        self._audit_asked = False
        self._audit_at = now + self._audit_interval_s
        # Releases this run decided whose write has not landed yet: their rows are still open.
        pending = [event for write, batch in self._unconfirmed if not _succeeded(write) for event in batch]
        self._released_unwritten = {e.lease_id for e in [*pending, *self._events] if e.kind == "lease_released"}
        self._audit = workflow.start_activity(
            "open_leases",
            self._state.pool,
            result_type=list[OpenLease],
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            # Bounded: the next audit asks again; an outage must not keep this one in flight.
            schedule_to_close_timeout=timedelta(seconds=max(30.0, self._audit_interval_s)),
            retry_policy=STORE_RETRY,
            summary="open rows of the lease ledger",
        )

    def _next_audit_at(self) -> float | None:
        """When the next run audits: at once if an audit was asked for or is in flight (its
        answer is lost with this run; a reset run continues as new at once when the guard's
        `rebase` is among the signals applied again), else when this run would have."""
        if self._audit_asked or self._audit is not None:
            return self._now()
        return self._audit_at

    def _reclaim_forgotten(self, now: float) -> None:
        """A ledger row open for a lease this run does not hold, nor has released: a grant this
        run forgot (its history was reset past the grant, by the replay guard or an operator),
        whose holder was told and may be using it. The same for a grant the guard read from the
        discarded part of the history (`LedgerAudit.lost_grants`), whose row may never have been
        written: its `lease_granted` is recorded now, so the event log and the ledger tell its
        story too. Such a lease is reclaimed: its row is closed (lease_released), its holder
        preempted with no grace (an invoke still running stops, and a heartbeat for it stops it
        too, as for any reclaimed lease), and a late grant it asks about is refused
        (`confirm_lease`). Its holder asks again if it still wants one."""
        audit = self._audit
        if audit is None or not audit.done():
            return
        self._audit = None
        released, self._released_unwritten = self._released_unwritten, set()
        if audit.cancelled() or audit.exception() is not None:
            # The next audit asks again: at once while grants wait for one.
            self._audit_asked = self._audit_asked or self._grants_wait_since is not None
            return
        if not self._repair_open:
            self._grants_wait_since = None
        lost, self._lost_grants = self._lost_grants, {}
        for row in audit.result():
            lost.pop(row.lease_id, None)
            if row.lease_id in self._state.leases or row.lease_id in released:
                continue
            self._never_reissue(row.lease_id)
            holder = request_workflow_id(row.capability, row.request_id) if row.request_id else ""
            accelerator = row.accelerators[0] if row.accelerators else ""
            forgotten = policy.Lease(
                lease_id=row.lease_id,
                request_id=row.request_id,
                workflow_id=holder,
                capability=row.capability,
                deployment=row.deployment,
                accelerator=accelerator,
                node="",
                resident_key="",
                bytes=row.bytes,
                granted_at=row.granted_at or now,
                priority=row.priority,
                tenant=row.tenant,
                gang=list(row.accelerators[1:]),
            )
            self._reclaim_lost(forgotten, now)
        self._reclaim_named(lost, released, now)

    def _reclaim_named(self, lost: dict[str, policy.Lease], released: set[str], now: float) -> None:
        """The lost grants the guard named that the ledger did not show open (or that no audit
        could read in time: the guard read them from the history itself, so they need no
        ledger to be stopped)."""
        for lease in lost.values():
            if lease.lease_id in self._state.leases:
                continue
            # No open row: never written, or closed already (the store keeps a row's first end).
            # Its grant is recorded again (`forgotten`: the lost run's own record may never have
            # been written, and a ledger row with an end and no grant tells no story).
            self._record(policy.lease_granted_event(self._state.pool, lease, None, forgotten=True), now)
            if lease.lease_id not in released and lease.lease_id not in self._released:
                self._reclaim_lost(lease, now)  # else its holder's release came: it has ended

    def _reclaim_lost(self, forgotten: policy.Lease, now: float) -> None:
        """Close a lease this run does not hold and stop its holder (`_reclaim_forgotten`)."""
        reason = "the scheduler no longer held it (its run was reset past the grant)"
        stopped = forgotten.lease_id in self._released  # its holder's release came already
        self._record(
            policy.PolicyEvent(
                kind="lease_reclaimed",
                request_id=forgotten.request_id,
                lease_id=forgotten.lease_id,
                accelerator=forgotten.accelerator,
                deployment=forgotten.deployment,
                workflow_id=forgotten.workflow_id,
                message=reason,
                payload={"bytes": forgotten.bytes, "forgotten": True},
            ),
            now,
        )
        self._record(
            policy.lease_released_event(self._state.pool, forgotten, f"reclaimed: {reason}", now, forgotten=True),
            now,
        )
        if forgotten.workflow_id:
            stop = PreemptSignal(lease_id=forgotten.lease_id, reason=f"its lease was reclaimed: {reason}", grace_s=0.0)
            self._preempts_out.append((forgotten.workflow_id, stop))
            if not stopped:
                # Its room is not given again until it says it stopped (HOLDER_STOP_LIMIT_S). An
                # admission of its request this run still has queued is the one from before the
                # forgotten grant: gone, as the holder asks again once stopped (a fresh wait; the
                # old one would expire while grants wait, and refuse the asking again).
                self._stopping.setdefault(forgotten.lease_id, now)
                stale = [q for q in self._state.queue if q.request_id == forgotten.request_id]
                if stale and all(q.workflow_id == forgotten.workflow_id for q in stale):
                    why = "its grant was forgotten; it asks again once stopped"
                    self._record_all(policy.cancel_request(self._state, forgotten.request_id, now, why), now)
        self._wake = True

    def _never_reissue(self, lease_id: str) -> None:
        """A reset rewound the lease counter: an id the lost run gave out is never given again
        (its holder asking again would get the same id, and one ledger row)."""
        counter = lease_id.rsplit(".", 1)[-1]
        if counter.isdigit():
            self._state.lease_counter = max(self._state.lease_counter, int(counter))

    def _snapshot(self) -> None:
        """Once per interval, what `status` shows per accelerator goes to the capacity history;
        written like events, off the admission path and retried until it lands."""
        if self._snapshot_interval_s <= 0:
            return
        now = self._now()
        if self._next_snapshot_at is not None and now < self._next_snapshot_at:
            return
        self._next_snapshot_at = now + self._snapshot_interval_s
        status = policy.pool_status(self._state, now)
        if not status.accelerators:
            return
        self._event_writes.append(
            workflow.start_activity(
                "record_snapshots",
                SnapshotBatch(pool=self._state.pool, at=now, accelerators=status.accelerators),
                task_queue=CONTROL_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=30),
                retry_policy=STORE_RETRY,
                summary=f"capacity snapshot of {len(status.accelerators)} accelerators",
            )
        )

    def _start_event_write(self) -> None:
        self._event_writes = [w for w in self._event_writes if not w.done()]
        # One write in flight, at most one a second; a full batch (a burst, or a backlog through
        # a database outage) is never held.
        if not self._events_writable():
            return
        self._events_written_at = self._now()
        self._events_in_flight = self._write_next_batch()

    def _write_next_batch(self) -> asyncio.Future[object]:
        """Not awaited: the event log never sits on the admission path. Retried until it lands."""
        batch, self._events = self._events[:EVENT_BATCH], self._events[EVENT_BATCH:]
        self._urgent_events = sum(1 for event in self._events if _urgent(event))
        write = workflow.start_activity(
            "record_events",
            batch,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=STORE_RETRY,
            summary=f"record {len(batch)} events",
        )
        self._event_writes.append(write)
        self._unconfirmed = [(w, b) for w, b in self._unconfirmed if not _succeeded(w)]
        self._unconfirmed.append((write, batch))
        return write

    # --- events -----------------------------------------------------------------------------

    def _record(self, event: policy.PolicyEvent, now: float) -> None:
        if event.kind == "lease_reclaimed" and event.lease_id and event.workflow_id:
            self._reclaimed[event.lease_id] = event.workflow_id
            if len(self._reclaimed) > RECLAIMED_REMEMBERED:
                del self._reclaimed[next(iter(self._reclaimed))]
        if event.kind == "lease_released" and event.lease_id:
            self._released[event.lease_id] = None
            if len(self._released) > RELEASED_REMEMBERED:
                del self._released[next(iter(self._released))]
            if self._audit is not None:
                # Released while the audit reads the ledger: its row may show open there.
                self._released_unwritten.add(event.lease_id)
        urgent = _urgent_kind(event.kind, event.failure is not None, event.alert is not None)
        if not self._events or (urgent and not self._urgent_events):
            # The first buffered record, or the first urgent one: the write is due sooner than
            # the loop's timer was armed for (if at all), so the loop sets it again. An update or
            # a signal that records without waking the loop would otherwise leave the write to
            # that timer, up to EVENT_WRITE_WAIT_S or reconcile_interval_s later.
            self._wake = True
        if urgent:
            self._urgent_events += 1
        self._event_serial += 1
        self._events.append(
            EventRecord(
                event_id=_event_id(self._event_serial, now, event),
                at=now,
                kind=event.kind,
                failure_class=event.failure.value if event.failure else None,
                request_id=event.request_id,
                lease_id=event.lease_id,
                accelerator=event.accelerator,
                deployment=event.deployment,
                workflow_id=event.workflow_id,
                message=event.message,
                payload=dict(event.payload),
                alert=event.alert.value if event.alert else None,
            )
        )

    def _record_all(self, events: list[policy.PolicyEvent], now: float) -> None:
        for event in events:
            self._record(event, now)


def _event_id(serial: int, now: float, event: policy.PolicyEvent) -> str:
    """An event's id, from what it says and its place in the run, not from the run's random
    stream: a run reset to an earlier point draws that stream again (seen in the chaos bench: a
    reset run's release took the id of another lease's release the lost run had written, and the
    store, which keeps the first event of an id, dropped it). The same event recorded again
    (the reset run replaying to its point, then writing what was not yet written) keeps its id,
    so it is written once; a different one never shares it."""
    said = [
        serial,
        now,
        event.kind,
        event.failure.value if event.failure else None,
        event.request_id,
        event.lease_id,
        event.accelerator,
        event.deployment,
        event.workflow_id,
        event.message,
        event.payload,
        event.alert.value if event.alert else None,
    ]
    d = hashlib.sha256(json.dumps(said, sort_keys=True, default=str).encode()).hexdigest()
    return f"{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:32]}"  # shaped as the uuid4 ids were


def _urgent_kind(kind: str, failed: bool, alert: bool) -> bool:
    return failed or alert or kind in URGENT_EVENT_KINDS


def _urgent(event: EventRecord) -> bool:
    return _urgent_kind(event.kind, event.failure_class is not None, event.alert is not None)


def _succeeded(write: asyncio.Future[object]) -> bool:
    return write.done() and not write.cancelled() and write.exception() is None
