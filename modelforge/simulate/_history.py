"""What a pool's scheduler workflow would write to its Temporal history for a simulated schedule:
history events per second per pool (mean and peak step), per request, and continue-as-new runs,
with and without warm-path delegation.

The simulator runs the policy, not Temporal, so this is a model: the engine counts, per series
step, what reaches the scheduler (admissions, grants after a wait, releases, preemptions, lease
heartbeats, loads and unloads, telemetry samples, delegation syncs), and the constants below turn
each into the history events `PoolSchedulerWorkflow` (workflows/scheduler.py) records for it.
Every constant says where its number comes from. A figure is per pool: with `pools` shards the
scenario's traffic and nodes are split evenly among them (the router spreads requests by route
key, modelforge/routing.py; an even split is the assumption).

Upper bounds where the workflow may do better: one `admit_batch` update per admission (the
admission call coalesces concurrent requests of one worker process into one update, which this
model does not credit), and no keep-warm TTL checks (one `resident_idle` signal per resident per
TTL: rare next to requests). The delegation sync is modelled at the node's working pace, one per
sync interval; a node whose syncs have nothing new to say backs off (activities/_delegation.py:
doubling up to IDLE_SYNC_FACTOR = 4 intervals, and an idle node gives its slots back and stops
syncing after IDLE_GIVE_BACK_S = 10 s), which this model does not credit: `sync_when_idle=True`
(every node every interval) is an upper bound for idle nodes, and `sync_when_idle=False` (only
intervals with a delegated admission or release) a lower bound that misses the few backed-off
syncs after a node's last request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from modelforge.messages import LEASE_HEARTBEAT_S, SchedulerInput, TelemetryInput

# --- Temporal's event model: the events one message or command writes ------------------------------
# A workflow task: WorkflowTaskScheduled, WorkflowTaskStarted, WorkflowTaskCompleted.
WORKFLOW_TASK_EVENTS = 3
# An accepted update (`admit_batch`, `delegation_sync`): WorkflowExecutionUpdateAccepted and
# WorkflowExecutionUpdateCompleted (a refusal by the validator writes nothing).
UPDATE_EVENTS = 2
# A signal in (`release`, `lease_heartbeat`, `observe`, `resident_loaded`, ...): WorkflowExecutionSignaled.
SIGNAL_EVENTS = 1
# A signal out (`lease_decision` after a wait, `preempt`, a resident's `command`):
# SignalExternalWorkflowExecutionInitiated and ExternalWorkflowExecutionSignaled.
SIGNAL_OUT_EVENTS = 2
# An activity (`record_events`, `record_snapshots`): ActivityTaskScheduled, Started, Completed.
ACTIVITY_EVENTS = 3
# A residency child workflow: StartChildWorkflowExecutionInitiated, ChildWorkflowExecutionStarted,
# ChildWorkflowExecutionCompleted (ParentClosePolicy.ABANDON still reports the close to a live parent).
CHILD_EVENTS = 3
# A run's own bookends: WorkflowExecutionStarted, its first workflow task, WorkflowExecutionContinuedAsNew.
CONTINUE_AS_NEW_EVENTS = 1 + WORKFLOW_TASK_EVENTS + 1

# --- the scheduler's cadence, from the code -------------------------------------------------------
# workflows/scheduler.py, lazy event writes (a test checks the constants agree): events go to
# Postgres in one `record_events` activity, one in flight, at most once every
# EVENT_WRITE_INTERVAL_S; a routine event waits until the oldest has waited EVENT_WRITE_WAIT_S or a
# batch of EVENT_BATCH is full; an urgent one (an alert, a failure class, URGENT_EVENT_KINDS: here
# refusals, preemptions and failed runs) goes at the next interval, taking the routine ones along.
EVENT_WRITE_INTERVAL_S = 1.0
EVENT_WRITE_WAIT_S = 5.0
EVENT_BATCH = 200
# Timer events per write (started, fired, cancelled: the quiet loop's one wake-up timer, armed for
# the next due write or whatever else is due first), measured with lazy writes on the dev server
# (docs/SCALING.md, `bench/simulate.py --measure-history 4 160` and `8 240`): 56 timer events
# (16 + 9 + 7 and 12 + 8 + 4) over 16 activities, less about 1.2 capacity snapshots (one a minute
# over the 73 s of the two load windows): 56 / 14.8 writes. (Before lazy writes: 3.1.)
TIMER_EVENTS_PER_WRITE = 3.8
# ...of which fired (each wakes the workflow): 9 + 8 = 17 over the same 14.8 writes.
TIMERS_FIRED_PER_WRITE = 1.15
# SchedulerInput defaults: a capacity snapshot activity a minute; continue-as-new at 5,000 events.
SNAPSHOT_INTERVAL_S = SchedulerInput.snapshot_interval_s
MAX_HISTORY_EVENTS = SchedulerInput.max_history_events
# TelemetryInput.interval_s: each node signals one `observe` to its pool's scheduler this often.
TELEMETRY_INTERVAL_S = TelemetryInput.interval_s
# A running lease is heartbeated every LEASE_HEARTBEAT_S (stale_lease_s / 3) twice: by its
# holder workflow (workflows/request.py) and by the node running it (activities/node.py).
HEARTBEAT_S = LEASE_HEARTBEAT_S
HEARTBEATS_PER_PERIOD = 2
# Messages that arrive while a workflow task runs are handled by one next task: workflow tasks
# per second = wakes / (1 + wakes x WORKFLOW_TASK_S) (dead-time batching). Fitted to the dev
# server runs in docs/SCALING.md (lazy writes): 342 wakes -> 340 tasks in 41.4 s at 4/s
# (0.0007 s), 498 -> 393 in 31.6 s at 8/s (0.0170 s); their mean. (Before: 0.0064.)
WORKFLOW_TASK_S = 0.0088

# --- warm-path delegation ------------------------------------------------------------------------
# A warm request on a ready resident with a free delegated slot is admitted on its node; the node
# reports admissions and releases in one `delegation_sync` update per sync interval.
DELEGATION_SYNC_INTERVAL_S = 1.0


@dataclass(frozen=True)
class HistoryModel:
    """How to read a simulated schedule as scheduler histories."""

    # Pools (shards) the scenario's traffic and nodes are split among, evenly.
    pools: int = 1
    sync_interval_s: float = DELEGATION_SYNC_INTERVAL_S
    # True: every node syncs every interval, as the protocol is described; False: only nodes
    # that admitted or released a delegated request in that interval.
    sync_when_idle: bool = True
    telemetry_interval_s: float = TELEMETRY_INTERVAL_S
    snapshot_interval_s: float = SNAPSHOT_INTERVAL_S
    max_history_events: int = MAX_HISTORY_EVENTS

    def problems(self) -> list[str]:
        found = []
        if self.pools < 1:
            found.append(f"pools must be at least 1, not {self.pools}")
        for name in ("sync_interval_s", "telemetry_interval_s"):
            if not getattr(self, name) > 0:
                found.append(f"{name} must be positive")
        if self.max_history_events < 100:
            found.append("max_history_events must be at least 100")
        return found


@dataclass
class HistoryCounts:
    """Per series step, what reaches one scheduler (the engine fills these; see `Simulation`)."""

    # Counts (floats once `scaled`).
    admissions: list[float] = field(default_factory=list)  # accepted admissions (one update each)
    warm: list[float] = field(default_factory=list)  # of those, started on arrival on a ready resident
    waited_grants: list[float] = field(default_factory=list)  # first starts after a wait: `lease_decision`
    queued_refusals: list[float] = field(default_factory=list)  # refused while queued: `lease_decision`
    failed_releases: list[float] = field(default_factory=list)  # runs that ended with a failure class
    releases: list[float] = field(default_factory=list)  # runs that ended (release signal)
    warm_releases: list[float] = field(default_factory=list)  # of those, runs of warm admissions
    preemptions: list[float] = field(default_factory=list)  # preempt out, then a release in
    heartbeats: list[float] = field(default_factory=list)  # heartbeat periods of running leases
    warm_heartbeats: list[float] = field(default_factory=list)  # of those, of warm admissions' runs
    resident_changes: list[float] = field(default_factory=list)  # loads, unloads, sleeps, wakes
    loads: list[float] = field(default_factory=list)
    active_seconds: list[float] = field(default_factory=list)  # whole seconds with anything to record
    node_syncs: list[float] = field(default_factory=list)  # (node, sync interval) pairs with warm work

    def scaled(self, factor: float, step_s: float) -> HistoryCounts:
        """The same schedule at `factor` times the traffic: every count times it, and the seconds
        with something to record left to the Poisson bound of `_per_step` (for sizing a cluster
        from a smaller replay)."""
        out = HistoryCounts(**{name: [x * factor for x in column] for name, column in self.__dict__.items()})
        out.active_seconds = [step_s] * len(self.active_seconds)
        return out

    def grow(self, steps: int) -> None:
        for column in self.__dict__.values():
            while len(column) < steps:
                column.append(0)


def _wft(wakes_per_s: float) -> float:
    return wakes_per_s / (1.0 + wakes_per_s * WORKFLOW_TASK_S)


def event_writes_per_s(routine_per_s: float, urgent_per_s: float) -> float:
    """`record_events` activities a second for Poisson streams of routine and urgent records.

    After a write, the next cycle waits for the first record (rate r + u). An urgent one is
    written at once (the EVENT_WRITE_INTERVAL_S gap aside); a routine one waits EVENT_WRITE_WAIT_S,
    or until an urgent record comes (expected min(W, Exp(u)) = (1 - e^-uW) / u), or until the
    batch is full. Writes a second = 1 / the expected cycle: exact for the lazy rule alone (r / (1 +
    rW): one write per W-second window opened by a record, never more than one per W), capped at
    one per interval, and never fewer than full batches."""
    r, u = max(0.0, routine_per_s), max(0.0, urgent_per_s)
    total = r + u
    if total <= 0:
        return 0.0
    hold = (1.0 - math.exp(-u * EVENT_WRITE_WAIT_S)) / u if u > 0 else EVENT_WRITE_WAIT_S
    hold = min(hold, (EVENT_BATCH - 1) / total)
    cycle = 1.0 / total + (r / total) * hold
    return max(min(1.0 / EVENT_WRITE_INTERVAL_S, 1.0 / cycle), total / EVENT_BATCH)


def _per_step(counts: HistoryCounts, i: int, step_s: float, nodes: int, model: HistoryModel, delegated: bool) -> float:
    """History events per second on one pool's scheduler in step i: the step's counts split
    evenly among the pools, then turned into events."""
    share = 1.0 / model.pools
    warm = counts.warm[i] if delegated else 0
    warm_releases = counts.warm_releases[i] if delegated else 0
    warm_beats = counts.warm_heartbeats[i] if delegated else 0
    updates = (counts.admissions[i] - warm) * share
    if delegated:
        syncs = nodes * step_s / model.sync_interval_s if model.sync_when_idle else counts.node_syncs[i]
        updates += syncs * share
    signals_in = share * (
        counts.releases[i]
        - warm_releases
        + HEARTBEATS_PER_PERIOD * (counts.heartbeats[i] - warm_beats)
        + counts.resident_changes[i]
        + nodes * step_s / model.telemetry_interval_s
    )
    signals_out = share * (
        counts.waited_grants[i] + counts.queued_refusals[i] + counts.preemptions[i] + counts.resident_changes[i]
    )
    children = share * counts.loads[i]
    # Event writes (`record_events`): at most the seconds the replay saw records in, and what
    # `event_writes_per_s` makes of the pool's records as Poisson streams. A delegated request
    # is recorded too, from its sync.
    routine = share * (
        counts.admissions[i] + counts.releases[i] - counts.failed_releases[i] + counts.resident_changes[i]
    )
    urgent = share * (counts.queued_refusals[i] + counts.preemptions[i] + counts.failed_releases[i])
    rate = event_writes_per_s(routine / step_s, urgent / step_s) if step_s > 0 else 0.0
    writes = min(float(counts.active_seconds[i]), rate * step_s)
    activities = writes + step_s / model.snapshot_interval_s
    timers = TIMER_EVENTS_PER_WRITE * writes
    # Every update, signal in, signal out completed, child started and closed, activity completed
    # and timer fired wakes the workflow; wakes close together share a workflow task.
    wakes = updates + signals_in + signals_out + 2 * children + activities + TIMERS_FIRED_PER_WRITE * writes
    tasks = _wft(wakes / step_s) * step_s
    events = (
        UPDATE_EVENTS * updates
        + SIGNAL_EVENTS * signals_in
        + SIGNAL_OUT_EVENTS * signals_out
        + CHILD_EVENTS * children
        + ACTIVITY_EVENTS * activities
        + timers
        + WORKFLOW_TASK_EVENTS * tasks
    )
    # Each run of the scheduler adds its bookends.
    events *= 1.0 + CONTINUE_AS_NEW_EVENTS / model.max_history_events
    return events / step_s


def scheduler_history(
    counts: HistoryCounts, step_s: float, span_steps: int, nodes: int, model: HistoryModel
) -> dict[str, Any]:
    """Both readings of the schedule (every request through the scheduler, and warm ones
    delegated), over the first `span_steps` steps (the scenario's own span)."""
    steps = max(1, span_steps)
    counts.grow(steps)
    admitted = sum(counts.admissions[:steps])
    span_s = steps * step_s
    out: dict[str, Any] = {
        "pools": model.pools,
        "nodes_per_pool": round(nodes / model.pools, 3),
        "step_s": step_s,
        "admissions_per_s_per_pool": round(admitted / span_s / model.pools, 4),
        "warm_share": round(sum(counts.warm[:steps]) / admitted, 4) if admitted else 0.0,
        "sync_interval_s": model.sync_interval_s,
        "sync_when_idle": model.sync_when_idle,
    }
    for key, delegated in (("without_delegation", False), ("with_delegation", True)):
        series = [_per_step(counts, i, step_s, nodes, model, delegated) for i in range(steps)]
        mean = sum(series) / steps
        per_pool_rate = admitted / span_s / model.pools
        out[key] = {
            "events_per_s_mean": round(mean, 3),
            "events_per_s_peak": round(max(series), 3),
            "events_per_request": round(mean / per_pool_rate, 3) if per_pool_rate else None,
            "continue_as_new_per_hour": round(mean * 3600 / model.max_history_events, 2),
            "series": [round(x, 3) for x in series],
        }
    return out
