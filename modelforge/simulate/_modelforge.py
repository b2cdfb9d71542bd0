"""ModelForge's own policy in the simulator: the very functions the scheduler workflow calls
(validate, enqueue, observe, decide, apply, ready, release, keep-warm check), driven by virtual
time instead of Temporal timers and signals."""

from __future__ import annotations

import heapq
import math
from dataclasses import replace

from modelforge.domain import Catalog, Residency
from modelforge.policy import (
    AdmissionRejected,
    AdmissionRequest,
    PolicyConfig,
    PolicyEvent,
    PoolState,
    QueuedRequest,
    ResidentPhase,
    apply_decisions,
    apply_observations,
    catalog_loaded_event,
    decide,
    enqueue,
    keep_warm_check,
    relabel,
    release_lease,
    resident_ready,
    resident_slept,
    resident_unloaded,
    resident_woke,
    validate_request,
)
from modelforge.simulate._protocol import Actions, CardView, Load, Refuse, Start
from modelforge.simulate._scenario import Scenario, SimRequest, SimulationConfig

_EVICTION_PREFIX = "making room"
# A keep_warm TTL runs while a model is awake or asleep (and is asked again after a transition).
_TTL_PHASES = (ResidentPhase.READY, ResidentPhase.ASLEEP, ResidentPhase.SLEEPING, ResidentPhase.WAKING)


class ModelForgeScheduler:
    name = "modelforge"

    def __init__(self, scenario: Scenario, config: PolicyConfig | None = None) -> None:
        pools = {a.pool for a in scenario.catalog.accelerators}
        pool = sorted(pools)[0] if pools else "default"
        # Simulated telemetry samples a card whenever its memory changes, so observations are
        # never older than the last change: neither the freshness bound nor the silent-node bound
        # can lapse in simulation (telemetry outages are the fault tests' business).
        base = config or PolicyConfig()
        self.state = PoolState(
            pool=pool,
            catalog=scenario.catalog,
            config=replace(base, freshness_s=math.inf, node_silent_s=math.inf),
        )
        self.sim: SimulationConfig = scenario.config
        # Request id -> its index in the scenario, while queued (or requeued after preemption).
        self.index_of: dict[str, int] = {}
        self.submitted_at: dict[str, float] = {}
        self.ttl_timers: list[tuple[float, str]] = []
        # Cards under GPU_PRESSURE -> when to sample them again though nothing on them changed:
        # when the hold time of a clearing card is up, or when the oldest external swing leaves
        # the volatility window (the dynamic reserve shrinks). Pressure changes only on samples.
        self.pressured: dict[str, float] = {}
        # Lazily pruned heaps: (when a queued request expires, its id) and (when a lease
        # reaches its minimum runtime and may be preempted, lease id).
        self.expiries: list[tuple[float, str]] = []
        self.preemptible_at: list[tuple[float, str]] = []
        # When set, every event the policy emits, with its moment, as the scheduler workflow
        # would record it (`modelforge.simulate._recorder`: a record made in virtual time).
        self.events: list[tuple[float, PolicyEvent]] | None = None

    def _note(self, now: float, events: list[PolicyEvent]) -> None:
        if self.events is not None:
            self.events.extend((now, event) for event in events)

    def submit(self, request: SimRequest, now: float) -> Refuse | None:
        admission = AdmissionRequest(
            request_id=request.request_id,
            workflow_id=request.request_id,
            capability=request.capability,
            tenant=request.tenant,
            priority=request.priority,
            deadline_s=request.deadline_s,
            lease_timeout_s=request.lease_timeout_s or self.sim.lease_timeout_s,
            max_duration_s=request.max_duration_s,
            input_bytes=request.input_bytes,
        )
        try:
            _, priority = validate_request(self.state, admission, gangs=True)
        except AdmissionRejected as rejected:
            self._note(
                now,
                [
                    PolicyEvent(
                        kind="request_refused",
                        failure=rejected.failure,
                        request_id=request.request_id,
                        workflow_id=request.request_id,
                        message=rejected.message,
                        payload={
                            "capability": request.capability,
                            "tenant": request.tenant,
                            "input_bytes": request.input_bytes,
                        },
                    )
                ],
            )
            return Refuse(request.index, rejected.failure, rejected.message)
        self.index_of[request.request_id] = request.index
        self.submitted_at[request.request_id] = now
        self._queued(enqueue(self.state, admission, priority, now))
        return None

    def _queued(self, queued: QueuedRequest) -> None:
        expires = queued.lease_timeout_at
        if queued.deadline_at is not None:
            expires = min(expires, queued.deadline_at)
        heapq.heappush(self.expiries, (expires, queued.request_id))

    def step(self, now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        state = self.state
        # (cards under pressure are sampled again when their hold or volatility window ends: on a
        # busy cluster, hundreds of them each step)
        due = list(touched)
        due += [card for card, again in self.pressured.items() if again <= now and card not in touched]
        if due:
            apply_observations(state, [cards.sample(a, now) for a in due], now)
            for accelerator in due:
                self._watch_pressure(accelerator, now)
        actions = Actions()
        while self.ttl_timers and self.ttl_timers[0][0] <= now:
            _, key = heapq.heappop(self.ttl_timers)
            resident = state.residents.get(key)
            if resident is None or resident.phase not in _TTL_PHASES:
                continue
            check_at = keep_warm_check(state, key, now)
            if check_at is None:
                actions.unloads.append((key, False))
            else:
                heapq.heappush(self.ttl_timers, (check_at, key))
        decisions = decide(state, now)
        self._note(now, apply_decisions(state, decisions, now, {}))
        for load in decisions.loads:
            actions.loads.append(Load(load.resident_key, load.deployment, load.accelerator, load.bytes))
        min_runtime = state.config.preempt_min_runtime_s
        for grant in decisions.grants:
            lease = grant.lease
            heapq.heappush(self.preemptible_at, (lease.granted_at + min_runtime, lease.lease_id))
            index = self.index_of.pop(grant.request_id)
            start = Start(index, lease.lease_id, lease.accelerator, lease.resident_key, lease.bytes, tuple(lease.gang))
            actions.starts.append(start)
        for unload in decisions.unloads:
            actions.unloads.append((unload.resident_key, unload.reason.startswith(_EVICTION_PREFIX)))
        for sleep in decisions.sleeps:
            resident = state.residents[sleep.resident_key]
            sleeper = state.catalog.deployment(resident.deployment)
            kept = sleeper.sleep_bytes if sleeper is not None and sleeper.sleep_bytes is not None else resident.bytes
            actions.sleeps.append((sleep.resident_key, min(kept, resident.bytes)))
        actions.wakes.extend((wake.resident_key, wake.bytes) for wake in decisions.wakes)
        actions.preempts.extend(p.lease_id for p in decisions.preemptions)
        for reject in decisions.rejects:
            actions.refusals.append(Refuse(self.index_of.pop(reject.request_id), reject.failure, reject.message))
        return actions

    def _watch_pressure(self, accelerator: str, now: float) -> None:
        runtime = self.state.accelerators.get(accelerator)
        config = self.state.config
        if runtime is None or not runtime.pressure or self.state.catalog.accelerator(accelerator) is None:
            # (a card no catalog of the pool has now is observed no more: nothing to watch)
            self.pressured.pop(accelerator, None)
            return
        again = math.inf
        if runtime.pressure_clear_since is not None:
            again = runtime.pressure_clear_since + config.pressure_hold_s
        history = runtime.external_history
        if len(history) >= 2:
            again = min(again, history[1][0] + config.volatility_window_s)
        # Never more often than telemetry would deliver samples.
        self.pressured[accelerator] = max(again, now + self.sim.telemetry_s)

    def loaded(self, key: str, now: float) -> None:
        resident = self.state.residents.get(key)
        if resident is None:
            return
        self._note(now, resident_ready(self.state, key, resident.bytes, now))
        if resident.residency == Residency.KEEP_WARM:
            heapq.heappush(self.ttl_timers, (now + resident.ttl_s, key))

    def unloaded(self, key: str, now: float) -> None:
        resident_unloaded(self.state, key, True, "", now)

    def slept(self, key: str, kept_bytes: int, now: float) -> None:
        resident_slept(self.state, key, True, kept_bytes, "", now)

    def woke(self, key: str, now: float) -> None:
        resident = self.state.residents.get(key)
        resident_woke(self.state, key, resident.bytes if resident is not None else 0, now)

    def finished(self, lease_id: str, now: float, outcome: str) -> None:
        lease = self.state.leases.get(lease_id)
        if self.events is not None and lease is not None:
            # What the request workflow's release signal tells the scheduler, recorded as it does.
            self._note(
                now,
                [
                    PolicyEvent(
                        kind="invoke" if outcome == "ok" else "invoke_failed",
                        request_id=lease.request_id,
                        lease_id=lease_id,
                        accelerator=lease.accelerator,
                        deployment=lease.deployment,
                        payload={"invoke_s": round(now - lease.granted_at, 4), "retrying": False},
                    )
                ],
            )
        self._note(now, release_lease(self.state, lease_id, now, outcome))

    def checkpointed(self, lease_id: str, request: SimRequest, now: float) -> None:
        lease = self.state.leases.get(lease_id)
        self._note(now, release_lease(self.state, lease_id, now, "preempted"))
        if lease is None:
            return
        self.index_of[request.request_id] = request.index
        # Requeued at its original class and place, as the request workflow does.
        again = AdmissionRequest(
            request_id=request.request_id,
            workflow_id=request.request_id,
            capability=request.capability,
            tenant=request.tenant,
            priority=lease.priority,
            deadline_s=None if request.deadline_s is None else max(1e-6, request.t + request.deadline_s - now),
            lease_timeout_s=request.lease_timeout_s or self.sim.lease_timeout_s,
            preempted=True,
            submitted_at=self.submitted_at.get(request.request_id, now),
            max_duration_s=request.max_duration_s,
            input_bytes=request.input_bytes,
        )
        self._queued(enqueue(self.state, again, lease.priority, now))

    def catalog_changed(self, catalog: Catalog, now: float) -> None:
        """As the scheduler workflow takes a catalog `catalog apply` sent it (`_reload_catalog`):
        the state's catalog, a new view epoch for the nodes' lent slots, the nodes' advertised
        labels kept over the catalog's. Its TTL timers stand: a resident's expiry was set when it
        loaded or was extended, and the next check reads the new TTL, as in production."""
        state = self.state
        state.catalog = catalog
        state.view_epoch += 1
        self._note(now, [catalog_loaded_event(catalog), *relabel(state)])

    def next_wakeup(self, now: float) -> float | None:
        wake = math.inf
        if self.ttl_timers:
            wake = self.ttl_timers[0][0]
        if not self.state.queue:
            self.expiries.clear()
        else:
            queued_ids = self.index_of
            expiries = self.expiries
            # Entries of requests no longer queued, or already past, are dropped as they surface.
            while expiries and (expiries[0][0] <= now or expiries[0][1] not in queued_ids):
                heapq.heappop(expiries)
            if expiries:
                wake = min(wake, expiries[0][0])
            # Work that becomes preemptible (its minimum runtime reached) may unblock the queue.
            ripening = self.preemptible_at
            while ripening and (ripening[0][0] <= now or ripening[0][1] not in self.state.leases):
                heapq.heappop(ripening)
            if ripening:
                wake = min(wake, ripening[0][0])
        if self.pressured:
            wake = min(wake, min(self.pressured.values()))
        return None if math.isinf(wake) else wake
