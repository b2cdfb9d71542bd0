"""Virtual time: the simulated cards, the event loop, and the measurements.

The engine owns what is physically on each card (external usage from the scenario's timeline,
models loading, loaded and unloading, the extra bytes of running work) and advances time from
event to event. At every step it lets the scheduler decide, checks each decision against the
invariant on the state the decision saw, and watches every card for out-of-memory moments.

What it reports is meant to be hard to flatter: wait percentiles count every request (one never
served waits forever), goodput is deadlines met per offered request, utilization is taken over
the scenario's own span (the same window for every policy), and a per-minute series shows how
each figure moved.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from modelforge.domain import Accelerator, Catalog, Deployment, Observation, ProcessUsage
from modelforge.failures import FailureClass
from modelforge.simulate._history import HEARTBEAT_S, HistoryCounts, HistoryModel, scheduler_history
from modelforge.simulate._protocol import Actions, SimScheduler
from modelforge.simulate._scenario import Scenario, SimRequest

# Event kinds, in the order they apply when several fall on the same instant (a catalog applied
# at the moment a request arrives already judges it, as the record's builder does).
_CATALOG, _EXTERNAL, _LOADED, _UNLOADED, _DONE, _CHECKPOINTED, _ARRIVE, _WAKE, _SLEPT, _WOKE = range(10)


@dataclass
class _Run:
    request: SimRequest
    accelerators: tuple[str, ...]
    resident_key: str
    bytes: int
    started: float
    preempting: bool = False
    lease_id: str = ""


@dataclass
class _Outcome:
    arrived: float
    first_start: float | None = None
    ended: float | None = None
    outcome: str = ""
    remaining_s: float = 0.0
    served_s: float = 0.0
    gpu_s: float = 0.0
    # Admitted and not running: in a queue (arrived, or requeued after a preemption).
    waiting: bool = False


@dataclass
class SimulationResult:
    policy: str
    requests: int
    completed: int
    rejected: dict[str, int]
    by_class: dict[str, dict[str, Any]]
    loads: int
    evictions: int
    unloads: int
    preemptions: int
    invariant_violations: int
    oom_events: int
    vram_utilization: float
    vram_busy_utilization: float
    jain_fairness: float
    wall_s: float
    requests_per_s: float
    virtual_s: float
    gang_starts: int = 0
    gang_splits: int = 0
    sleeps: int = 0
    wakes: int = 0
    by_tenant_gpu_s: dict[str, float] = field(default_factory=dict)
    violation_examples: list[str] = field(default_factory=list)
    # Requests whose deadline was met (completed, by their deadline if they had one), over all.
    goodput: float = 0.0
    # The common span utilization is measured over (see `common_span`): the same for every policy.
    span_start_s: float = 0.0
    span_s: float = 0.0
    # Columns of per-step figures (see `Simulation._series`), for --json and --plot.
    series: dict[str, object] = field(default_factory=dict)
    # The scheduler workflow's Temporal history for this schedule (modelforge only; see
    # `modelforge.simulate._history`): events per second per pool, with and without delegation.
    scheduler_history: dict[str, Any] | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "policy": self.policy,
            "requests": self.requests,
            "completed": self.completed,
            "goodput": self.goodput,
            "rejected": self.rejected,
            "by_class": self.by_class,
            "loads": self.loads,
            "evictions": self.evictions,
            "unloads": self.unloads,
            "preemptions": self.preemptions,
            "invariant_violations": self.invariant_violations,
            "oom_events": self.oom_events,
            "vram_utilization": self.vram_utilization,
            "vram_busy_utilization": self.vram_busy_utilization,
            "jain_fairness": self.jain_fairness,
            "gang_starts": self.gang_starts,
            "gang_splits": self.gang_splits,
            "sleeps": self.sleeps,
            "wakes": self.wakes,
            "by_tenant_gpu_s": self.by_tenant_gpu_s,
            "violation_examples": self.violation_examples,
            "virtual_s": self.virtual_s,
            "span_start_s": self.span_start_s,
            "span_s": self.span_s,
            "wall_s": self.wall_s,
            "requests_per_s": self.requests_per_s,
            "series": self.series,
            "scheduler_history": self.scheduler_history,
        }


def common_span(scenario: Scenario) -> tuple[float, float]:
    """The window every policy's utilization is measured over: from the scenario's first event
    (an arrival or external usage starting) until its last request would end if it were served
    the moment it arrived. It depends on the scenario only, so a policy that pushes work past
    it is not rewarded with a longer denominator of its own, nor one that refuses work with a
    shorter one."""
    starts = [r.t for r in scenario.requests[:1]] + [u.start_s for u in scenario.external]
    start = min(starts) if starts else 0.0
    end = start
    for request in scenario.requests:
        service = request.service_s
        if request.max_duration_s is not None and request.max_duration_s < service:
            service = request.max_duration_s
        end = max(end, request.t + service)
    return start, end


def _percentile(sorted_values: list[float], fraction: float, never: int = 0) -> float | None:
    """Nearest rank: the smallest value with at least `fraction` of the values at or below it,
    where `never` more values are infinite (requests never served). None when the rank falls on
    one of those, or there are no values at all."""
    count = len(sorted_values) + never
    if not count:
        return None
    rank = max(1, math.ceil(fraction * count))
    return sorted_values[rank - 1] if rank <= len(sorted_values) else None


def _rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


class _Cards:
    """The physical state of every card, with out-of-memory watch and utilization integrals."""

    def __init__(self, scenario: Scenario) -> None:
        self.total = {a.id: a.total_bytes for a in scenario.catalog.accelerators}
        self.reserve = {a.id: a.reserve_bytes for a in scenario.catalog.accelerators}
        self.external = dict.fromkeys(self.total, 0)
        self.held = dict.fromkeys(self.total, 0)
        self.resident_bytes: dict[str, int] = {}
        self.resident_on: dict[str, str] = {}
        self.ready: dict[str, bool] = {}
        self.ready_on: dict[str, dict[str, bool]] = {a: {} for a in self.total}
        self.active_runs: dict[str, int] = {}
        self.in_oom: dict[str, bool] = {}
        self.oom_events = 0
        self.held_sum = 0
        self.busy_sum = 0
        self.capacity = sum(self.total.values())  # the cards' memory at the start
        # (moment, the cards' memory from then on): each catalog change of the cards.
        self.capacity_changes: list[tuple[float, int]] = []
        # External bytes reported for a card before a catalog brought it in.
        self.pending_external: dict[str, int] = {}

    def adopt(self, accelerators: list[Accelerator], now: float) -> list[str]:
        """The cards as a catalog applied at `now` has them; returns those it brings in. A new
        card joins holding nothing of ours (external bytes already reported for it included), a
        card of a new size takes it, and a card the catalog no longer has keeps what it holds
        until its work there ends (the policy places nothing new on it) but leaves the
        capacity utilization is measured against."""
        added = []
        for accelerator in accelerators:
            card = accelerator.id
            if card not in self.total:
                added.append(card)
                self.external[card] = self.pending_external.pop(card, 0)
                self.held[card] = 0
                self.ready_on[card] = {}
            self.total[card] = accelerator.total_bytes
            self.reserve[card] = accelerator.reserve_bytes
            self.change(card)  # over its size now (external bytes it joins with, a smaller size)?
        capacity = sum(a.total_bytes for a in accelerators)
        current = self.capacity_changes[-1][1] if self.capacity_changes else self.capacity
        if capacity != current:
            self.capacity_changes.append((now, capacity))
        return added

    def capacity_area(self, lo: float, hi: float) -> float:
        """The cards' memory integrated over [lo, hi] (byte-seconds), through each change."""
        area, at, capacity = 0.0, lo, self.capacity
        for when, after in self.capacity_changes:
            if when > at:
                if when >= hi:
                    break
                area += capacity * (when - at)
                at = when
            capacity = after
        return area + capacity * (hi - at) if hi > at else area

    # CardView
    def free_bytes(self, accelerator: str) -> int:
        return self.total[accelerator] - self.external[accelerator] - self.held[accelerator]

    def sample(self, accelerator: str, now: float) -> Observation:
        external = self.external[accelerator]
        held = self.held[accelerator]
        return Observation(
            accelerator=accelerator,
            total_bytes=self.total[accelerator],
            used_bytes=external + held,
            processes=[
                ProcessUsage(pid=1, used_bytes=external, name="external (simulated)"),
                ProcessUsage(pid=2, used_bytes=held, name="modelforge (simulated)", managed=True),
            ],
            loaded=list(self.ready_on[accelerator]),
            observed_at=now,
            received_at=now,
            simulated=True,
        )

    def change(self, accelerator: str, delta_held: int = 0, delta_external: int = 0) -> None:
        self.held[accelerator] += delta_held
        self.held_sum += delta_held
        self.external[accelerator] += delta_external
        over = self.held[accelerator] + self.external[accelerator] > self.total[accelerator]
        if over and accelerator not in self.in_oom:
            self.in_oom[accelerator] = True
            self.oom_events += 1
        elif not over and accelerator in self.in_oom:
            del self.in_oom[accelerator]


# progress(requests ended, requests in all, virtual time now): called about every tenth of a
# second of wall time while a replay runs, and once at its end.
Progress = Callable[[int, int, float], None]

# The series has a row a minute, unless the common span would need more than this many rows:
# then a row covers as many whole minutes as keep it within this (a 149-day trace, 60 minutes).
SERIES_MAX_STEPS = 10_000


def series_step_s(span_s: float) -> float:
    minutes = span_s / 60.0
    return 60.0 * max(1, math.ceil(minutes / SERIES_MAX_STEPS))


class Simulation:
    def __init__(
        self,
        scenario: Scenario,
        scheduler: SimScheduler,
        progress: Progress | None = None,
        step_s: float | None = None,
        history: HistoryModel | None = None,
    ) -> None:
        self.scenario = scenario
        self.scheduler = scheduler
        self.progress = progress
        self.span_start, self.span_end = common_span(scenario)
        self.step_s = step_s if step_s is not None else series_step_s(self.span_end - self.span_start)
        # Requests admitted and not running, and per series step: the integrals of held bytes,
        # busy bytes and waiting requests over time, and the most requests waiting at once.
        self.waiting = 0
        self.origin = self.span_start
        self.step_held: list[float] = []
        self.step_busy: list[float] = []
        self.step_queue: list[float] = []
        self.step_queue_max: list[int] = []
        # The step the clock is in, and where it ends (the fast path of `_integrate`).
        self.step_index = 0
        self.step_end = -math.inf
        self.cards = _Cards(scenario)
        self.deployments = {d.capability: d for d in scenario.catalog.deployments}
        self.by_deployment_id = {d.deployment_id: d for d in scenario.catalog.deployments}
        self.events: list[tuple[float, int, int, object]] = []
        self.seq = 0
        self.runs: dict[str, _Run] = {}
        self.outcomes: list[_Outcome] = [_Outcome(arrived=r.t, remaining_s=r.service_s) for r in scenario.requests]
        self.loads = 0
        self.evictions = 0
        self.sleeps = 0
        self.wakes = 0
        self.unloads = 0
        self.preemptions = 0
        self.violations = 0
        self.violation_examples: list[str] = []
        self.wake_at = math.inf
        self.touched: dict[str, bool] = {}
        self.busy_area = 0.0
        self.held_area = 0.0
        self.last_t = 0.0
        self.unloading: dict[str, bool] = {}
        self.ended = 0
        self.nvlink_group = {a.id: a.nvlink_group for a in scenario.catalog.accelerators}
        self.gang_starts = 0
        # Gang runs that needed one NVLink group and were spread over several (or none).
        self.gang_splits = 0
        # What reaches the scheduler workflow, per series step (`_history.HistoryCounts`).
        self.history_model = history or HistoryModel()
        problems = self.history_model.problems()
        if problems:
            raise ValueError("; ".join(problems))
        self.history = HistoryCounts()
        self.node_of = {a.id: a.node for a in scenario.catalog.accelerators}
        # Leases of warm admissions (started on arrival on a ready resident): delegable.
        self.warm_leases: dict[str, bool] = {}
        self.active_second = -1
        self.last_sync: dict[str, int] = {}

    def _push(self, at: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, kind, self.seq, payload))

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        for request in self.scenario.requests:
            self._push(request.t, _ARRIVE, request)
        for at, catalog in self.scenario.catalog_changes:
            self._push(at, _CATALOG, catalog)
        for usage in self.scenario.external:
            self._push(usage.start_s, _EXTERNAL, (usage.accelerator, usage.bytes))
            if math.isfinite(usage.end_s):
                self._push(usage.end_s, _EXTERNAL, (usage.accelerator, -usage.bytes))
        self.touched = dict.fromkeys(self.cards.total, True)
        first = self.events[0][0] if self.events else 0.0
        self.origin = first
        self.last_t = first
        end = first
        progress = self.progress
        total = len(self.outcomes)
        steps = 0
        shown = started
        while self.events:
            now = self.events[0][0]
            self._integrate(now)
            while self.events and self.events[0][0] == now:
                _, kind, _, payload = heapq.heappop(self.events)
                self._apply(kind, payload, now)
            actions = self.scheduler.step(now, self.cards, self.touched)
            self.touched = {}
            self._carry_out(actions, now)
            wake = self.scheduler.next_wakeup(now)
            if wake is not None and now < wake < self.wake_at:
                self.wake_at = wake
                self._push(wake, _WAKE, None)
            end = now
            if not self._work_left():
                break
            if progress is not None:
                steps += 1
                if steps & 255 == 0:
                    clock = time.perf_counter()
                    if clock - shown >= 0.1:
                        shown = clock
                        progress(self.ended, total, now)
        self._integrate(end)
        if progress is not None:
            progress(self.ended, total, end)
        return self._result(time.perf_counter() - started, end - first)

    def _work_left(self) -> bool:
        # Only timers (TTLs, unloads) remain once every request has ended: the run is over.
        return self.ended < len(self.outcomes) or bool(self.runs)

    def _integrate(self, now: float) -> None:
        t = self.last_t
        if now <= t:
            return
        held = self.cards.held_sum
        busy = self.cards.busy_sum
        # Utilization counts only what falls inside the common span.
        lo = t if t > self.span_start else self.span_start
        hi = now if now < self.span_end else self.span_end
        if hi > lo:
            self.held_area += held * (hi - lo)
            self.busy_area += busy * (hi - lo)
        waiting = self.waiting
        i = self.step_index
        if now <= self.step_end:
            # Most events fall inside the current step.
            dt = now - t
            self.step_held[i] += held * dt
            self.step_busy[i] += busy * dt
            self.step_queue[i] += waiting * dt
            if waiting > self.step_queue_max[i]:
                self.step_queue_max[i] = waiting
            self.last_t = now
            return
        step = self.step_s
        origin = self.origin
        while t < now:
            i = max(0, int((t - origin) // step))
            boundary = origin + (i + 1) * step
            if boundary <= t:  # floating point at a step's edge
                i += 1
                boundary = origin + (i + 1) * step
            while len(self.step_held) <= i:
                self.step_held.append(0.0)
                self.step_busy.append(0.0)
                self.step_queue.append(0.0)
                self.step_queue_max.append(0)
            segment_end = min(now, boundary)
            dt = segment_end - t
            self.step_held[i] += held * dt
            self.step_busy[i] += busy * dt
            self.step_queue[i] += waiting * dt
            if waiting > self.step_queue_max[i]:
                self.step_queue_max[i] = waiting
            self.step_index, self.step_end = i, boundary
            t = segment_end
        self.last_t = now

    def _apply(self, kind: int, payload: object, now: float) -> None:
        cards = self.cards
        if kind == _ARRIVE:
            assert isinstance(payload, SimRequest)
            refusal = self.scheduler.submit(payload, now)
            if refusal is not None:
                # Refused by the update's validator: nothing in the history.
                self._end(payload.index, refusal.failure.value, now)
            else:
                self._wait(payload.index)
                self._count(self.history.admissions, now)
        elif kind == _CATALOG:
            assert isinstance(payload, Catalog)
            # A deployment the new catalog adds or changes loads, unloads and wakes as it says;
            # one it removes keeps its last shape for the residents it leaves behind.
            self.deployments.update((d.capability, d) for d in payload.deployments)
            self.by_deployment_id.update((d.deployment_id, d) for d in payload.deployments)
            # Its cards as they are from now (a card added, resized, or taken out of the pool).
            for card in cards.adopt(payload.accelerators, now):
                self.touched[card] = True
            self.nvlink_group.update((a.id, a.nvlink_group) for a in payload.accelerators)
            self.node_of.update((a.id, a.node) for a in payload.accelerators)
            self.scheduler.catalog_changed(payload, now)
        elif kind == _EXTERNAL:
            assert isinstance(payload, tuple)
            external_on: str = payload[0]
            if external_on in cards.total:
                cards.change(external_on, delta_external=payload[1])
                self.touched[external_on] = True
            else:  # a card no catalog of the run has brought in yet (or any: a proposed catalog's)
                cards.pending_external[external_on] = cards.pending_external.get(external_on, 0) + payload[1]
        elif kind == _LOADED:
            assert isinstance(payload, str)
            if self._ready(payload):
                self.scheduler.loaded(payload, now)
        elif kind == _UNLOADED:
            key = payload
            assert isinstance(key, str)
            self._drop_resident(key)
            self.scheduler.unloaded(key, now)
        elif kind == _SLEPT:
            assert isinstance(payload, tuple)
            key, kept = payload
            if key in cards.resident_bytes and key not in self.unloading:
                # The card gets back all but what the sleeping model keeps.
                accelerator = cards.resident_on[key]
                cards.change(accelerator, delta_held=kept - cards.resident_bytes[key])
                cards.resident_bytes[key] = kept
                self.touched[accelerator] = True
                self.scheduler.slept(key, kept, now)
        elif kind == _WOKE:
            assert isinstance(payload, str)
            if self._ready(payload):
                self.scheduler.woke(payload, now)
        elif kind == _DONE:
            assert isinstance(payload, str)
            run = self._take_run(payload, now)
            if run is None:
                return
            outcome = self.outcomes[run.request.index]
            outcome.remaining_s = 0.0
            result = "ok"
            limit = run.request.max_duration_s
            if limit is not None and run.request.service_s > limit:
                result = FailureClass.TIMEOUT.value
            self._end(run.request.index, result, now)
            self.scheduler.finished(payload, now, result)
            self._count(self.history.releases, now)
            if result != "ok":
                self._count(self.history.failed_releases, now)
            if self.warm_leases.pop(payload, False):
                self._count(self.history.warm_releases, now)
                self._synced(run.accelerators[0], now)
        elif kind == _CHECKPOINTED:
            assert isinstance(payload, str)
            run = self._take_run(payload, now)
            if run is None:
                return
            outcome = self.outcomes[run.request.index]
            outcome.remaining_s = max(0.0, outcome.remaining_s - (now - run.started))
            self.preemptions += 1
            self.warm_leases.pop(payload, None)
            self._count(self.history.preemptions, now)
            self._count(self.history.releases, now)
            self._wait(run.request.index)
            self.scheduler.checkpointed(payload, run.request, now)
        elif kind == _WAKE:
            if self.wake_at <= now:
                self.wake_at = math.inf

    def _take_run(self, lease_id: str, now: float) -> _Run | None:
        """The run of a lease, stopped (its bytes back); None when it already ended."""
        run = self.runs.pop(lease_id, None)
        if run is not None:
            self._stop_run(run, now)
        return run

    def _ready(self, key: str) -> bool:
        """A resident loaded or woken: runnable, unless it went (or is going) meanwhile."""
        cards = self.cards
        if key not in cards.resident_bytes or key in self.unloading:
            return False
        cards.ready[key] = True
        cards.ready_on[cards.resident_on[key]][key] = True
        self.touched[cards.resident_on[key]] = True
        return True

    def _deployment_of(self, key: str) -> Deployment | None:
        """A resident key is `deployment@accelerator`, and deployment ids hold `@` themselves
        (`rag.embedding@1`): cut at the accelerator the key is on. (Cutting at the first `@` found
        no deployment, so every unload once took no time.)"""
        accelerator = self.cards.resident_on.get(key)
        base = key.split("#", 1)[0]  # the baselines number their runners: `deployment@accelerator#n`
        if accelerator is None or not base.endswith("@" + accelerator):
            return None
        return self.by_deployment_id.get(base[: -len(accelerator) - 1])

    def _drop_resident(self, key: str) -> None:
        cards = self.cards
        nbytes = cards.resident_bytes.pop(key, None)
        if nbytes is None:
            return
        accelerator = cards.resident_on.pop(key)
        cards.ready.pop(key, None)
        cards.ready_on[accelerator].pop(key, None)
        self.unloading.pop(key, None)
        cards.change(accelerator, delta_held=-nbytes)
        self.touched[accelerator] = True

    def _stop_run(self, run: _Run, now: float) -> None:
        cards = self.cards
        self._heartbeats(run, now)
        for accelerator in run.accelerators:
            cards.change(accelerator, delta_held=-run.bytes)
            self.touched[accelerator] = True
        outcome = self.outcomes[run.request.index]
        outcome.served_s += now - run.started
        outcome.gpu_s += (now - run.started) * len(run.accelerators)
        cards.busy_sum -= run.bytes * len(run.accelerators)
        if not run.resident_key:
            return
        left = cards.active_runs.get(run.resident_key, 0) - 1
        if left <= 0:
            cards.active_runs.pop(run.resident_key, None)
            cards.busy_sum -= cards.resident_bytes.get(run.resident_key, 0)
        else:
            cards.active_runs[run.resident_key] = left

    def _hstep(self, t: float) -> int:
        return max(0, int((t - self.origin) // self.step_s))

    def _count(self, column: list[float], now: float, n: int = 1) -> None:
        """One more of something the scheduler hears of or records at `now`."""
        i = self._hstep(now)
        if len(column) <= i:
            self.history.grow(i + 1)
        column[i] += n
        second = int(now // 1.0)
        if second != self.active_second:
            self.active_second = second
            self.history.active_seconds[i] += 1

    def _synced(self, accelerator: str, now: float) -> None:
        """A delegated admission or release on a node: its node syncs in this interval."""
        node = self.node_of.get(accelerator, accelerator)
        slot = int(now // self.history_model.sync_interval_s)
        if self.last_sync.get(node) != slot:
            self.last_sync[node] = slot
            i = self._hstep(now)
            if len(self.history.node_syncs) <= i:
                self.history.grow(i + 1)
            self.history.node_syncs[i] += 1

    def _heartbeats(self, run: _Run, now: float) -> None:
        """The heartbeat periods a run's lease went through, in the steps they fell in."""
        if now - run.started < HEARTBEAT_S:
            return
        warm = self.warm_leases.get(run.lease_id, False)
        step = self.step_s
        first, last = self._hstep(run.started), self._hstep(now)
        self.history.grow(last + 1)
        done = 0
        for i in range(first, last + 1):
            upto = min(now, self.origin + (i + 1) * step)
            beats = int((upto - run.started) // HEARTBEAT_S) - done
            if beats > 0:
                done += beats
                self.history.heartbeats[i] += beats
                if warm:
                    self.history.warm_heartbeats[i] += beats

    def _wait(self, index: int) -> None:
        outcome = self.outcomes[index]
        if not outcome.waiting and not outcome.outcome:
            outcome.waiting = True
            self.waiting += 1

    def _unwait(self, outcome: _Outcome) -> None:
        if outcome.waiting:
            outcome.waiting = False
            self.waiting -= 1

    def _end(self, index: int, result: str, now: float) -> None:
        outcome = self.outcomes[index]
        if outcome.outcome:
            return
        self._unwait(outcome)
        outcome.outcome = result
        outcome.ended = now
        self.ended += 1

    def _check_invariant(self, actions: Actions, now: float) -> None:
        """Every load and every start must fit, on the card as the decision saw it, within
        total - external - resident - leased - reserve (the accelerator's static reserve)."""
        cards = self.cards
        adding: dict[str, int] = {}
        for load in actions.loads:
            adding[load.accelerator] = adding.get(load.accelerator, 0) + load.bytes
        for start in actions.starts:
            if start.bytes:
                for accelerator in start.accelerators:
                    adding[accelerator] = adding.get(accelerator, 0) + start.bytes
        for accelerator, nbytes in adding.items():
            used = cards.external[accelerator] + cards.held[accelerator]
            limit = cards.total[accelerator] - used - cards.reserve[accelerator]
            if nbytes > limit:
                self.violations += 1
                if len(self.violation_examples) < 5:
                    self.violation_examples.append(
                        f"t={now:.1f} {accelerator}: placed {nbytes} B with {limit} B schedulable "
                        f"(external {cards.external[accelerator]} B, held {cards.held[accelerator]} B, "
                        f"reserve {cards.reserve[accelerator]} B)"
                    )

    def _carry_out(self, actions: Actions, now: float) -> None:
        cards = self.cards
        self._check_invariant(actions, now)
        for refusal in actions.refusals:
            if not self.outcomes[refusal.request_index].outcome:
                self._count(self.history.queued_refusals, now)
            self._end(refusal.request_index, refusal.failure.value, now)
        for key, eviction in actions.unloads:
            if key not in cards.resident_bytes or key in self.unloading:
                continue
            self.unloading[key] = True
            cards.ready.pop(key, None)
            cards.ready_on[cards.resident_on[key]].pop(key, None)
            self.unloads += 1
            self.evictions += 1 if eviction else 0
            self._count(self.history.resident_changes, now)
            deployment = self._deployment_of(key)
            self._push(now + (deployment.unload_s if deployment else 0.0), _UNLOADED, key)
        for key, kept in actions.sleeps:
            if key not in cards.resident_bytes or key in self.unloading:
                continue
            # Still held by the node (listed in its samples), just not runnable until woken.
            cards.ready.pop(key, None)
            self.sleeps += 1
            self._count(self.history.resident_changes, now)
            sleeper = self._deployment_of(key)
            self._push(now + (sleeper.sleep_s if sleeper else 0.0), _SLEPT, (key, kept))
        for key, awake in actions.wakes:
            if key not in cards.resident_bytes or key in self.unloading:
                continue
            # The waking model takes its memory back as it wakes: held from the start.
            accelerator = cards.resident_on[key]
            cards.change(accelerator, delta_held=awake - cards.resident_bytes[key])
            cards.resident_bytes[key] = awake
            self.touched[accelerator] = True
            self.wakes += 1
            self._count(self.history.resident_changes, now)
            waker = self._deployment_of(key)
            self._push(now + (waker.wake_s if waker else 0.0), _WOKE, key)
        for load in actions.loads:
            deployment = self.by_deployment_id[load.deployment]
            cards.resident_bytes[load.key] = load.bytes
            cards.resident_on[load.key] = load.accelerator
            cards.change(load.accelerator, delta_held=load.bytes)
            self.touched[load.accelerator] = True
            self.loads += 1
            self._count(self.history.resident_changes, now)
            self._count(self.history.loads, now)
            self._push(now + deployment.load_s, _LOADED, load.key)
        for start in actions.starts:
            request = self.scenario.requests[start.request_index]
            outcome = self.outcomes[start.request_index]
            first = outcome.first_start is None
            if first:
                outcome.first_start = now
            self._unwait(outcome)
            run = _Run(request, start.accelerators, start.resident_key, start.bytes, now, lease_id=start.lease_id)
            self.runs[start.lease_id] = run
            if first and now == outcome.arrived and start.resident_key and not start.gang:
                # Admitted on arrival on a ready resident: the grant went back in the admit
                # update's reply, and with delegation the node would have admitted it itself.
                self.warm_leases[start.lease_id] = True
                self._count(self.history.warm, now)
                self._synced(start.accelerator, now)
            elif now > outcome.arrived or not first:
                self._count(self.history.waited_grants, now)
            for accelerator in start.accelerators:
                cards.change(accelerator, delta_held=start.bytes)
                self.touched[accelerator] = True
            if start.gang:
                self.gang_starts += 1
                groups = {self.nvlink_group.get(a, "") for a in start.accelerators}
                # By the deployment as the catalog in force has it (`deployments`, kept by changes).
                deployment = self.deployments.get(request.capability)
                nvlink = deployment is not None and deployment.nvlink_required
                if nvlink and (len(groups) > 1 or "" in groups):
                    self.gang_splits += 1
            if start.resident_key:
                if start.resident_key not in cards.active_runs:
                    cards.active_runs[start.resident_key] = 0
                    cards.busy_sum += cards.resident_bytes.get(start.resident_key, 0)
                cards.active_runs[start.resident_key] += 1
            cards.busy_sum += start.bytes * len(start.accelerators)
            limit = request.max_duration_s
            duration = outcome.remaining_s if limit is None else min(outcome.remaining_s, limit - outcome.served_s)
            self._push(now + max(0.0, duration), _DONE, start.lease_id)
        for lease_id in actions.preempts:
            held = self.runs.get(lease_id)
            if held is None or held.preempting:
                continue
            held.preempting = True
            self._push(now + self.scenario.config.checkpoint_s, _CHECKPOINTED, lease_id)

    def _result(self, wall_s: float, virtual_s: float) -> SimulationResult:
        requests = self.scenario.requests
        rejected: dict[str, int] = {}
        # Per class: waits of requests that started, requests never started (by how they
        # ended), completed ones, and those that met their deadline.
        waits: dict[str, list[float]] = {}
        never: dict[str, dict[str, int]] = {}
        offered: dict[str, int] = {}
        completed: dict[str, int] = {}
        deadline_met: dict[str, int] = {}
        tenant_s: dict[str, float] = {}
        total_completed = 0
        for request, outcome in zip(requests, self.outcomes, strict=True):
            klass = request.priority or "default"
            offered[klass] = offered.get(klass, 0) + 1
            tenant_s[request.tenant] = tenant_s.get(request.tenant, 0.0) + outcome.gpu_s
            ending = outcome.outcome or "UNFINISHED"
            if outcome.first_start is not None:
                waits.setdefault(klass, []).append(outcome.first_start - outcome.arrived)
            else:
                unserved = never.setdefault(klass, {})
                unserved[ending] = unserved.get(ending, 0) + 1
            if ending == "ok":
                total_completed += 1
                completed[klass] = completed.get(klass, 0) + 1
                assert outcome.ended is not None
                if request.deadline_s is None or outcome.ended <= outcome.arrived + request.deadline_s:
                    deadline_met[klass] = deadline_met.get(klass, 0) + 1
            else:
                rejected[ending] = rejected.get(ending, 0) + 1
        by_class: dict[str, dict[str, Any]] = {}
        catalogs = [self.scenario.catalog, *(catalog for _, catalog in self.scenario.catalog_changes)]
        # Every class any catalog of the run defined (one a change added too), in first-seen order.
        order = [*dict.fromkeys(k for catalog in catalogs for k in catalog.classes), "default"]
        for klass in order:
            if klass not in offered:
                continue
            served = sorted(waits.get(klass, []))
            refused_by = dict(sorted(never.get(klass, {}).items()))
            refused = sum(refused_by.values())
            goodput = round(deadline_met.get(klass, 0) / offered[klass], 6)
            by_class[klass] = {
                "requests": offered[klass],
                "completed": completed.get(klass, 0),
                "served": len(served),
                "refused": refused,
                "refused_by": refused_by,
                "wait_p50_s": _rounded(_percentile(served, 0.50, refused)),
                "wait_p99_s": _rounded(_percentile(served, 0.99, refused)),
                "served_wait_p50_s": _rounded(_percentile(served, 0.50)),
                "served_wait_p99_s": _rounded(_percentile(served, 0.99)),
                "deadline_met": deadline_met.get(klass, 0),
                "goodput": goodput,
                "deadline_met_ratio": goodput,
            }
        weights = {t.name: t.weight for catalog in catalogs for t in catalog.tenants}  # the last catalog's weight
        shares = [tenant_s[t] / weights.get(t, 1.0) for t in tenant_s if tenant_s[t] > 0]
        jain = (sum(shares) ** 2 / (len(shares) * sum(x * x for x in shares))) if shares else 1.0
        span = self.span_end - self.span_start
        capacity = self.cards.capacity or 1
        if self.cards.capacity_changes:
            capacity_area = self.cards.capacity_area(self.span_start, self.span_end) or 1.0
        else:
            capacity_area = capacity * span
        held = self.held_area / capacity_area if span > 0 else 0.0
        busy = self.busy_area / capacity_area if span > 0 else 0.0
        return SimulationResult(
            policy=self.scheduler.name,
            requests=len(requests),
            completed=total_completed,
            rejected=dict(sorted(rejected.items())),
            by_class=by_class,
            loads=self.loads,
            evictions=self.evictions,
            sleeps=self.sleeps,
            wakes=self.wakes,
            unloads=self.unloads,
            preemptions=self.preemptions,
            invariant_violations=self.violations,
            oom_events=self.cards.oom_events,
            vram_utilization=round(held, 6),
            vram_busy_utilization=round(busy, 6),
            jain_fairness=round(jain, 6),
            wall_s=round(wall_s, 3),
            requests_per_s=round(len(requests) / wall_s, 1) if wall_s > 0 else 0.0,
            virtual_s=round(virtual_s, 3),
            gang_starts=self.gang_starts,
            gang_splits=self.gang_splits,
            by_tenant_gpu_s={t: round(s, 3) for t, s in sorted(tenant_s.items())},
            violation_examples=self.violation_examples,
            goodput=round(sum(deadline_met.values()) / len(requests), 6) if requests else 0.0,
            span_start_s=round(self.span_start, 3),
            span_s=round(span, 3),
            series=self._series(),
            scheduler_history=self._scheduler_history(),
        )

    def _scheduler_history(self) -> dict[str, Any] | None:
        """The scheduler workflow's history for this schedule: ModelForge's policy only (the
        baselines are no Temporal workflow)."""
        if self.scheduler.name != "modelforge":
            return None
        nodes = len(set(self.node_of.values())) or 1
        steps = max(1, len(self.step_held))
        return scheduler_history(self.history, self.step_s, steps, nodes, self.history_model)

    def _series(self) -> dict[str, object]:
        """Per step of `step_s` (a minute, or whole minutes on long spans: `series_step_s`) from
        the first event to the end of the replay: VRAM held and busy over capacity, requests
        waiting (time average and most at once), arrivals,
        first starts and their waits (nearest-rank p50 and p99; None where none started), and
        requests that ended without ever starting. Columns, one list per figure."""
        step = self.step_s
        origin = self.origin
        end = self.last_t
        steps = max(1, len(self.step_held))
        capacity = self.cards.capacity or 1
        arrivals = [0] * steps
        started = [0] * steps
        refused = [0] * steps
        step_waits: list[list[float]] = [[] for _ in range(steps)]

        def at(t: float) -> int:
            return min(steps - 1, max(0, int((t - origin) // step)))

        for outcome in self.outcomes:
            arrivals[at(outcome.arrived)] += 1
            if outcome.first_start is not None:
                i = at(outcome.first_start)
                started[i] += 1
                step_waits[i].append(outcome.first_start - outcome.arrived)
            elif outcome.ended is not None:
                refused[at(outcome.ended)] += 1
        t_s: list[float] = []
        held: list[float] = []
        busy: list[float] = []
        queue: list[float] = []
        queue_max: list[int] = []
        p50: list[float | None] = []
        p99: list[float | None] = []
        for i in range(steps):
            begin = origin + i * step
            covered = min(step, end - begin)
            if covered <= 0 or i >= len(self.step_held):
                covered, area_held, area_busy, area_queue, most = step, 0.0, 0.0, 0.0, 0
            else:
                area_held, area_busy = self.step_held[i], self.step_busy[i]
                area_queue, most = self.step_queue[i], self.step_queue_max[i]
            t_s.append(round(begin, 3))
            if self.cards.capacity_changes:
                capacity_area = self.cards.capacity_area(begin, begin + covered) or 1.0
            else:
                capacity_area = capacity * covered
            held.append(round(area_held / capacity_area, 4))
            busy.append(round(area_busy / capacity_area, 4))
            queue.append(round(area_queue / covered, 3))
            queue_max.append(most)
            values = sorted(step_waits[i])
            p50.append(_rounded(_percentile(values, 0.50), 3))
            p99.append(_rounded(_percentile(values, 0.99), 3))
        return {
            "step_s": step,
            "t_s": t_s,
            "vram_utilization": held,
            "vram_busy_utilization": busy,
            "queue_depth": queue,
            "queue_depth_max": queue_max,
            "arrivals": arrivals,
            "started": started,
            "refused": refused,
            "wait_p50_s": p50,
            "wait_p99_s": p99,
        }
