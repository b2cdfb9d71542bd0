"""A node's side of warm-path delegation (modelforge/policy/_delegation.py): the slots its
scheduler lent it, claimed by the request workflows that run on this node's worker (a local
activity: no round trip), and the sync loop that reports what ran and renews the slots.

Safety, on the node's side:
- a slot serves one request at a time, and only while it is open and the last answer of the
  scheduler is younger than its `valid_s` (half the scheduler's stale_lease_s: the scheduler
  reclaims a silent node's slots only after all of it);
- a claim refused here for any reason (no slot, a class that may not run here, a tenant the view
  does not know) is not a refusal: the request goes to the scheduler, which decides as always;
- a claim whose invoke does not start within `CLAIM_START_S` is voided, and that invoke, should it
  come later, is refused (the slot may be another's by then)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace

from temporalio.client import Client

from modelforge.domain import Catalog
from modelforge.identifiers import identifier_problem
from modelforge.logging import get_logger
from modelforge.messages import DelegationReply, DelegationSync, SlotClaim
from modelforge.names import scheduler_id
from modelforge.policy import (
    AdmissionRejected,
    AdmissionRequest,
    Lease,
    PoolState,
    SlotReply,
    SlotRun,
    SlotSync,
    is_production,
    resolve_priority,
)

log = get_logger("modelforge.delegation")

DEFAULT_SYNC_S = 1.0
# An open slot nobody claimed for this long goes back to the scheduler (and the node stops
# syncing once it holds nothing): an idle node costs its scheduler no history.
IDLE_GIVE_BACK_S = 10.0
CLAIM_START_S = 30.0
# A sync asked for by a claim that found no slot waits at least this long after the last one,
# and the claim waits at most CLAIM_WAIT_S for its answer before the scheduler admits the request.
MIN_SYNC_GAP_S = 0.1
CLAIM_WAIT_S = 0.5
# A capability a sync asked for and was not lent is not waited for again for this long (it still
# asks: the scheduler lends once it can).
UNLENT_S = 10.0
MAX_RUNS_KEPT = 20_000  # reports kept through a scheduler outage, the oldest dropped past it
SYNC_TIMEOUT_S = 10.0
# A sync that had nothing new to say (no requests served, no slot given back, taken back or lent,
# no slot in use by another request, nothing wanted) doubles the wait before the next one, from
# `sync_s` up to this many `sync_s` (4 s by default), and never past a third of the reply's
# `valid_s` (so the slots stay valid; the scheduler reclaims a silent node's slots only after
# twice `valid_s`): each sync costs the scheduler's history about five events. Anything to say
# brings back `sync_s`; a request wanting a slot, or a closed slot to give back, still syncs at
# once. The cost: a request waiting at the scheduler for a slot lent to an idle node waits for
# that node's next sync, up to IDLE_SYNC_FACTOR sync intervals instead of one.
IDLE_SYNC_FACTOR = 4.0
# A busy node whose syncs only report requests served without a failure class (and the slots
# they took and freed) syncs every ROUTINE_SYNC_FACTOR sync intervals, not every one: each sync
# costs the scheduler's history about five events, and these reports are not urgent (fair share,
# health counts, the event log, which trails by up to 5 s anyway). A failed request, a slot
# wanted, given back, taken back or newly lent still bring back `sync_s` (or sync at once). The
# cost: a request waiting at the scheduler for a slot lent to a busy node waits for that node's
# next sync, up to ROUTINE_SYNC_FACTOR sync intervals instead of one.
ROUTINE_SYNC_FACTOR = 2.0


@dataclass
class _Slot:
    lease: Lease
    open: bool = True
    request_id: str = ""  # the request on it ("" free)
    workflow_id: str = ""
    tenant: str = ""
    priority: str = ""
    end_user: str = ""
    claimed_at: float = 0.0
    asked_at: float = 0.0  # when its request first asked this node for a slot
    started: bool = False
    last_used: float = 0.0


class NodeSlots:
    """One per node worker process."""

    def __init__(
        self,
        client: Client | None,
        node: str,
        pool: str,
        *,
        sync_s: float = DEFAULT_SYNC_S,
        clock: Callable[[], float] = time.monotonic,
        send: Callable[[SlotSync], Awaitable[SlotReply]] | None = None,
    ) -> None:
        """`send`: how a sync reaches the scheduler and its reply comes back (injected I/O: tests
        give the pure policy directly); by default the `delegation_sync` update through `client`."""
        self._client = client
        self._send = send or self._update
        self.node = node
        self.pool = pool
        self.sync_s = sync_s
        self._clock = clock
        self.boot = uuid.uuid4().hex[:16]
        self._slots: dict[str, _Slot] = {}
        self._production_ok: set[str] = set()
        self._valid_until = 0.0
        self._view: Catalog | None = None
        self._view_epoch = -1
        self._runs: list[SlotRun] = []
        self._run_ends: list[float] = []  # when each of `_runs` ended, by `clock`
        self._wanted: dict[str, None] = {}
        self._wake = asyncio.Event()
        # Set when the next sync's reply has been applied (a new event per sync): what a claim
        # that asked for a slot waits on.
        self._answered = asyncio.Event()
        # Capabilities a sync asked for and was not lent (a deployment never lent, or none free):
        # until when a claim of them does not wait for the next sync's answer.
        self._unlent: dict[str, float] = {}
        self._last_sync = 0.0
        # The scheduler counts slots as this node's (the last reply lent some): a node that gave
        # them all back syncs once more, to say so.
        self._lent = False
        # Between syncs now: `sync_s`, longer while the syncs have had nothing new to say
        # (IDLE_SYNC_FACTOR); what the last sync said, to tell.
        self.interval = sync_s
        self._valid_ceiling = sync_s  # a third of the last reply's valid_s (none yet: sync_s)
        self._said: tuple[frozenset[str], frozenset[tuple[str, str]]] = (frozenset(), frozenset())
        # The capabilities the scheduler last heard in use here: a claim of any other one is
        # reported within `sync_s` (`due_in`), not after the idle back-off, so `status` and
        # `ps` do not show a model serving a request as idle for up to IDLE_SYNC_FACTOR syncs.
        self._said_in_use: frozenset[str] = frozenset()
        self._last_turn = clock()
        self.syncs = 0  # sent, for tests and the benchmark
        # Whether a resident is loaded on this node (its worker's runtimes): slots on others are
        # not claimed. Everything, until the worker says (`serve_only`).
        self._serves: Callable[[str], bool] = lambda key: True

    def serve_only(self, serves: Callable[[str], bool]) -> None:
        self._serves = serves

    # --- claims (local activity) -------------------------------------------------------------

    async def claim_or_ask(self, claim: SlotClaim, wait_s: float = CLAIM_WAIT_S) -> Lease | None:
        """`claim`, and where it found no slot it could take, the same again once the sync it asked
        for has been answered (at most `wait_s`): a warm request that arrives just before its
        scheduler lends the node a slot (the first after a quiet spell, or the next of a
        concurrency-1 model whose one slot was just taken back for an admission) takes that slot
        instead of queueing at the scheduler, which would then have to take the slot back from
        this node a sync later before it could grant it."""
        asked_at = self._clock()
        lease, asked = self._claim(claim)
        if lease is not None or not asked or self._unlent.get(claim.capability, -1.0) > self._clock():
            return lease  # (a capability whose last asking sync brought nothing: not worth waiting)
        answered = self._answered
        try:
            await asyncio.wait_for(answered.wait(), timeout=wait_s)
        except TimeoutError:
            return None
        return self._claim(claim, ask=False, asked_at=asked_at)[0]

    def claim(self, claim: SlotClaim) -> Lease | None:
        """The request's lease on a free open slot of its capability here, or None."""
        return self._claim(claim)[0]

    def _claim(self, claim: SlotClaim, ask: bool = True, asked_at: float | None = None) -> tuple[Lease | None, bool]:
        """(the lease, or None; whether a sync was asked for a slot of its capability).
        `asked_at`: when the request first asked (now, unless it waited for a sync)."""
        now = self._clock()
        if claim.pool != self.pool:
            return None, False
        if now >= self._valid_until or self._view is None:
            if ask:
                self._want(claim.capability)
            return None, ask
        priority = self._class_of(claim)
        if priority is None:
            return None, False
        production = is_production(self._view, priority)
        passed_over = False  # a free slot of it this request may not take: another sync will not help
        for slot in self._slots.values():
            lease = slot.lease
            if lease.capability != claim.capability or not slot.open or slot.request_id:
                continue
            if not self._serves(lease.resident_key) or (production and lease.resident_key not in self._production_ok):
                passed_over = True
                continue
            slot.request_id, slot.workflow_id = claim.request_id, claim.workflow_id
            slot.tenant, slot.priority, slot.end_user = claim.tenant, priority, claim.end_user
            slot.claimed_at = slot.last_used = now
            slot.asked_at = now if asked_at is None else asked_at
            slot.started = False
            return replace(
                lease,
                request_id=claim.request_id,
                workflow_id=claim.workflow_id,
                tenant=claim.tenant,
                priority=priority,
                end_user=claim.end_user,
            ), False
        if ask:
            self._want(claim.capability)
        return None, ask and not passed_over

    def _class_of(self, claim: SlotClaim) -> str | None:
        """The request's class by the scheduler's own rules (its tenant's default, ceiling and
        queues), or None where they refuse it: the scheduler then refuses it, typed."""
        for kind, name in (
            ("request_id", claim.request_id),
            ("capability", claim.capability),
            ("tenant", claim.tenant),
        ):
            if identifier_problem(kind, name) is not None:
                return None
        assert self._view is not None
        request = AdmissionRequest(
            request_id=claim.request_id,
            workflow_id=claim.workflow_id,
            capability=claim.capability,
            tenant=claim.tenant,
            priority=claim.priority,
        )
        try:
            return resolve_priority(PoolState(pool=self.pool, catalog=self._view), request)
        except AdmissionRejected:
            return None

    def _want(self, capability: str) -> None:
        if len(self._wanted) < 64:
            self._wanted[capability] = None
        self._wake.set()

    def started(self, lease_id: str, request_id: str) -> bool:
        """The invoke of a claim begins: False when the claim is no longer its own (voided)."""
        slot = self._slots.get(lease_id)
        if slot is None or slot.request_id != request_id:
            return False
        slot.started = True
        return True

    def finish(self, lease_id: str, request_id: str, outcome: str, invoke_s: float, message: str = "") -> None:
        """The request on the slot is over: reported in the next sync, the slot free again."""
        slot = self._slots.get(lease_id)
        if slot is None or slot.request_id != request_id:
            return
        self._runs.append(
            SlotRun(
                lease_id=lease_id,
                request_id=request_id,
                workflow_id=slot.workflow_id,
                tenant=slot.tenant,
                priority=slot.priority,
                capability=slot.lease.capability,
                outcome=outcome,
                invoke_s=invoke_s,
                message=message[:500],
                waited_s=max(0.0, slot.claimed_at - slot.asked_at),
                end_user=slot.end_user,
            )
        )
        self._run_ends.append(self._clock())
        if len(self._runs) > MAX_RUNS_KEPT:
            del self._runs[: len(self._runs) - MAX_RUNS_KEPT]
            del self._run_ends[: len(self._run_ends) - MAX_RUNS_KEPT]
        slot.request_id = slot.workflow_id = ""
        slot.last_used = self._clock()
        if not slot.open:
            self._wake.set()  # taken back while in use: given back by a sync now

    def free_slots(self, capability: str) -> int:
        return sum(1 for s in self._slots.values() if s.lease.capability == capability and s.open and not s.request_id)

    def in_use(self) -> int:
        return sum(1 for s in self._slots.values() if s.request_id)

    # --- sync -------------------------------------------------------------------------------

    async def run(self) -> None:
        """Sync while there is anything to say: slots held, requests to report, slots wanted."""
        while True:
            await self._wait_turn()
            self._wake.clear()
            self._last_turn = self._clock()
            try:
                await self.sync_once()
            except Exception as error:  # never the end of the loop: the next sync tries again
                self.interval = self.sync_s
                log.warning("delegation_sync_failed", node=self.node, error=str(error))

    def due_in(self) -> float:
        """Seconds until the next periodic sync: `sync_s` after the last turn while a failed
        request waits to be reported or a model the scheduler last heard idle here is serving,
        at most ROUTINE_SYNC_FACTOR `sync_s` while served requests wait to be reported, else the
        current interval (longer while idle)."""
        interval = self.interval
        if _any_failed(self._runs) or self._serving_unheard():
            interval = self.sync_s
        elif self._runs:
            interval = min(interval, self._routine_interval)
        return self._last_turn + interval - self._clock()

    def _serving_unheard(self) -> bool:
        """A slot is in use for a capability no slot of which was in use at the last sync: the
        scheduler shows that model idle on this node until the next one. (A busy model's
        further claims do not hurry the sync: it already shows in use.)"""
        return any(slot.request_id and slot.lease.capability not in self._said_in_use for slot in self._slots.values())

    async def _wait_turn(self) -> None:
        """Until the next sync: when woken (at most every MIN_SYNC_GAP_S after the last), or when
        `due_in` runs out, looked at at least every `sync_s` (a request that ends while the node
        is idle is reported within about `sync_s`, as before)."""
        while not self._wake.is_set():
            left = self.due_in()
            if left <= 0:
                return
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=min(left, self.sync_s))
            except TimeoutError:
                pass
        gap = self._last_sync + MIN_SYNC_GAP_S - self._clock()
        if gap > 0:
            await asyncio.sleep(gap)

    def _prepare(self, now: float) -> SlotSync | None:
        for lease_id, slot in list(self._slots.items()):
            if slot.request_id and not slot.started and now - slot.claimed_at > CLAIM_START_S:
                slot.request_id = slot.workflow_id = ""  # its invoke never came
            if not slot.request_id and (not slot.open or now - slot.last_used > IDLE_GIVE_BACK_S):
                del self._slots[lease_id]  # given back: not in `held`
        if not self._slots and not self._runs and not self._wanted and not self._lent:
            return None
        return SlotSync(
            node=self.node,
            boot=self.boot,
            held=list(self._slots),
            in_use={lease_id: slot.workflow_id for lease_id, slot in self._slots.items() if slot.request_id},
            in_use_tenants={lease_id: slot.tenant for lease_id, slot in self._slots.items() if slot.request_id},
            runs=[
                replace(run, ended_ago_s=round(max(0.0, now - ended), 3))
                for run, ended in zip(self._runs, self._run_ends, strict=True)
            ],
            wanted=list(self._wanted),
            view_epoch=self._view_epoch,
            within_s=self._longest_interval,
        )

    async def sync_once(self) -> SlotReply | None:
        """One sync now, if there is anything to say; its reply applied (None: nothing said)."""
        sent_at = self._clock()
        sync = self._prepare(sent_at)
        if sync is None:
            return None
        runs = len(sync.runs)
        in_use = frozenset(self._slots[lease_id].lease.capability for lease_id in sync.in_use)
        self._wanted.clear()
        self._last_sync = sent_at
        self.syncs += 1
        answered, self._answered = self._answered, asyncio.Event()  # later claims wait on the next
        try:
            reply = await self._send(sync)
            del self._runs[:runs]  # reported: the scheduler has them
            del self._run_ends[:runs]
            self._said_in_use = in_use
            self._apply(reply, sent_at)
            self._lent = bool(self._slots)
            self._back_off(sync, reply)
            free = {slot.lease.capability for slot in self._slots.values() if slot.open and not slot.request_id}
            for capability in sync.wanted:  # asked for, and no free slot of it after (never lent, or all in use)
                if capability in free:
                    self._unlent.pop(capability, None)
                else:
                    self._unlent[capability] = sent_at + UNLENT_S
        finally:
            answered.set()  # answered or failed: the claims that waited on it look again, once
        return reply

    def _back_off(self, sync: SlotSync, reply: SlotReply) -> None:
        """The next interval: `sync_s` after a sync that said or brought anything new about the
        slots (wanted, lent, given or taken back) or a failed request; ROUTINE_SYNC_FACTOR
        `sync_s` after one that only reported requests served (and who is on which slot); else
        twice the last one, at most IDLE_SYNC_FACTOR `sync_s`. Never past a third of `valid_s`,
        never below `sync_s`."""
        said_held, said_in_use = frozenset(sync.held), frozenset(sync.in_use.items())
        news = sync.wanted or reply.lent or said_held != self._said[0]
        news = news or len(reply.kept) != len(sync.held)  # something taken back
        news = news or _any_failed(sync.runs)
        routine = sync.runs or said_in_use != self._said[1]
        # What the scheduler knows now: the slots kept and lent, and who is on them.
        in_use = {(lease_id, slot.workflow_id) for lease_id, slot in self._slots.items() if slot.request_id}
        self._said = (frozenset(self._slots), frozenset(in_use))
        self._valid_ceiling = max(self.sync_s, reply.valid_s / 3)
        if news:
            self.interval = self.sync_s
        elif routine:
            self.interval = self._routine_interval
        else:
            self.interval = min(self._longest_interval, max(self.sync_s, self.interval * 2))

    @property
    def _longest_interval(self) -> float:
        """The longest `_back_off` may wait before the next sync (the idle ceiling), as each
        sync says it (`SlotSync.within_s`)."""
        return max(self.sync_s, min(IDLE_SYNC_FACTOR * self.sync_s, self._valid_ceiling))

    @property
    def _routine_interval(self) -> float:
        return max(self.sync_s, min(ROUTINE_SYNC_FACTOR * self.sync_s, self._valid_ceiling))

    async def _update(self, sync: SlotSync) -> SlotReply:
        if self._client is None:
            raise RuntimeError("no Temporal client to sync with")
        handle = self._client.get_workflow_handle(scheduler_id(self.pool))
        reply: DelegationReply = await asyncio.wait_for(
            handle.execute_update("delegation_sync", DelegationSync(sync), result_type=DelegationReply),
            timeout=SYNC_TIMEOUT_S,
        )
        return reply.reply

    def _apply(self, reply: SlotReply, sent_at: float) -> None:
        kept = set(reply.kept)
        for lease_id, slot in list(self._slots.items()):
            if lease_id not in kept:
                if slot.request_id:
                    slot.open = False  # taken back while in use: dropped when its request ends
                else:
                    del self._slots[lease_id]
            elif lease_id in reply.closing:
                slot.open = False
                if not slot.request_id:
                    # Idle: given back by a sync now, not a period later; a request is waiting
                    # at the scheduler for it (or its card, or its model's memory).
                    self._wake.set()
        for lease in reply.lent:
            if lease.lease_id not in self._slots:
                self._slots[lease.lease_id] = _Slot(
                    lease=lease, open=lease.lease_id not in reply.closing, last_used=sent_at
                )
        self._production_ok = set(reply.production_ok)
        if reply.view is not None:
            self._view, self._view_epoch = reply.view, reply.view_epoch
        # Counted from when the sync was sent: never later than the scheduler's own clock.
        self._valid_until = sent_at + reply.valid_s


def _any_failed(runs: list[SlotRun]) -> bool:
    """A served request that ended with a failure class: reported at the usual pace."""
    return any(run.outcome != "ok" for run in runs)


class PoolSlots:
    """The slots of a node whose cards are in several pools: one `NodeSlots` per pool (each
    syncs with its own scheduler), a claim answered by the one of its request's pool."""

    def __init__(self, pools: list[NodeSlots]) -> None:
        self.by_pool = {slots.pool: slots for slots in pools}

    def claim(self, claim: SlotClaim) -> Lease | None:
        slots = self.by_pool.get(claim.pool)
        return None if slots is None else slots.claim(claim)

    async def claim_or_ask(self, claim: SlotClaim) -> Lease | None:
        slots = self.by_pool.get(claim.pool)
        return None if slots is None else await slots.claim_or_ask(claim)

    def serve_only(self, serves: Callable[[str], bool]) -> None:
        for slots in self.by_pool.values():
            slots.serve_only(serves)

    def started(self, lease_id: str, request_id: str) -> bool:
        # A slot's id is its pool's; with the request's id it names one slot of one pool.
        return any(slots.started(lease_id, request_id) for slots in self.by_pool.values())

    def finish(self, lease_id: str, request_id: str, outcome: str, invoke_s: float, message: str = "") -> None:
        for slots in self.by_pool.values():
            slots.finish(lease_id, request_id, outcome, invoke_s, message)

    async def run(self) -> None:
        await asyncio.gather(*(slots.run() for slots in self.by_pool.values()))
