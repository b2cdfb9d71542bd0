"""What-if on the record: the recorded requests replayed through the production policy under
the catalog that was in force and under a proposed one, side by side (`modelforge simulate
--from-record W --catalog NEW.toml`, `modelforge catalog apply NEW.toml --what-if W`)."""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from modelforge.domain import Catalog
from modelforge.simulate._engine import Simulation, SimulationResult, _Cards, _percentile
from modelforge.simulate._modelforge import ModelForgeScheduler
from modelforge.simulate._protocol import Actions
from modelforge.simulate._record import RecordScenario, with_measured_load_times
from modelforge.simulate._scenario import Scenario

GIB = 1024**3
PERCENTILES = (("p50", 0.50), ("p95", 0.95), ("p99", 0.99))


class _WatchedCards(_Cards):
    """The cards, also watching the external processes' headroom: a moment the card's free
    memory (what an external process could still grow into) falls below its reserve."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.short: dict[str, bool] = {}
        self.short_moments = 0

    def change(self, accelerator: str, delta_held: int = 0, delta_external: int = 0) -> None:
        super().change(accelerator, delta_held, delta_external)
        free = self.total[accelerator] - self.held[accelerator] - self.external[accelerator]
        if free < self.reserve[accelerator]:
            if accelerator not in self.short:
                self.short[accelerator] = True
                self.short_moments += 1
        elif accelerator in self.short:
            del self.short[accelerator]


class _Replay(Simulation):
    """The engine as it is, counting the seconds spent loading as well."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario, ModelForgeScheduler(scenario))
        self.cards = _WatchedCards(scenario)
        self.load_seconds = 0.0

    def _carry_out(self, actions: Actions, now: float) -> None:
        for load in actions.loads:
            deployment = self.by_deployment_id.get(load.deployment)
            self.load_seconds += deployment.load_s if deployment else 0.0
        super()._carry_out(actions, now)


def group_figures(waits: list[float], never: int, offered: int, met: int) -> dict[str, Any]:
    waits = sorted(waits)
    figures: dict[str, Any] = {"requests": offered, "served": len(waits), "never_served": never}
    for name, fraction in PERCENTILES:
        value = _percentile(waits, fraction, never)
        figures[f"wait_{name}_s"] = None if value is None else round(value, 3)
    figures["goodput"] = round(met / offered, 6) if offered else 0.0
    return figures


@dataclass
class Replayed:
    """One catalog's replay: the engine's result and the what-if figures."""

    label: str
    # None for the record's own figures (what really happened), shown beside the replays.
    result: SimulationResult | None
    figures: dict[str, Any] = field(default_factory=dict)
    # Each replayed request's wait to its first start (None: never started), by request id:
    # what a fidelity check compares request by request with the record.
    waits: dict[str, float | None] = field(default_factory=dict)


def replay(record: RecordScenario, catalog: Catalog | None, label: str) -> Replayed:
    """The record replayed as it was (no `catalog`: the catalogs in force in the window, each
    from its moment) or under `catalog` throughout."""
    scenario, refused_at_once = record.scenario(catalog)
    sim = _Replay(scenario)
    result = sim.run()
    result.policy = label
    per_class: dict[str, tuple[list[float], int, int, int]] = {}
    per_tenant: dict[str, tuple[list[float], int, int, int]] = {}
    each_wait: dict[str, float | None] = {}
    for request, outcome in zip(scenario.requests, sim.outcomes, strict=True):
        each_wait[request.request_id] = None if outcome.first_start is None else outcome.first_start - outcome.arrived
        met = outcome.outcome == "ok" and (
            request.deadline_s is None
            or (outcome.ended is not None and outcome.ended <= outcome.arrived + request.deadline_s)
        )
        tenant = scenario.catalog_at(request.t).tenant(request.tenant)
        klass = request.priority or (tenant.default_priority if tenant is not None else "default")
        for groups, key in ((per_class, klass), (per_tenant, record.shown_tenant(request.tenant))):
            waits, never, offered, good = groups.get(key, ([], 0, 0, 0))
            if outcome.first_start is not None:
                waits.append(outcome.first_start - outcome.arrived)
            else:
                never += 1
            groups[key] = (waits, never, offered + 1, good + (1 if met else 0))
    refusals = dict(result.rejected)
    for failure, count in refused_at_once.items():
        refusals[failure] = refusals.get(failure, 0) + count
    offered = len(scenario.requests) + sum(refused_at_once.values())
    met_all = round(result.goodput * len(scenario.requests))
    figures: dict[str, Any] = {
        "requests": offered,
        "goodput": round(met_all / offered, 6) if offered else 0.0,
        "by_class": {k: group_figures(*v) for k, v in per_class.items()},
        "by_tenant": {k: group_figures(*v) for k, v in sorted(per_tenant.items())},
        "cold_starts": result.loads,
        "load_s": round(sim.load_seconds, 3),
        "evictions": result.evictions,
        "preemptions": result.preemptions,
        "refusals": dict(sorted(refusals.items())),
        "vram_gib_hours_in_use": round(sim.busy_area / GIB / 3600, 3),
        "vram_gib_hours_idle_resident": round((sim.held_area - sim.busy_area) / GIB / 3600, 3),
        "external_headroom_below_reserve": sim.cards.short_moments,  # type: ignore[attr-defined]
        "oom_events": result.oom_events,
        "invariant_violations": result.invariant_violations,
        "replay_wall_s": result.wall_s,
    }
    return Replayed(label, result, figures, each_wait)


# A record at least this long has its two replays run side by side, each in a process of its own
# (they share nothing; a process costs a second or two to start and to receive the record, hidden
# where the processes were started ahead: `replay_processes`). Not one of them in the caller's
# process: its heap (the record's rows, a database pool) slowed that replay by a few per cent.
PARALLEL_FROM_REQUESTS = 20_000
REPLAY_PROCESSES = 2


@contextmanager
def replay_processes() -> Iterator[ProcessPoolExecutor | None]:
    """The processes for the two replays of a `compare`, started now: they spawn and import the
    simulator while the caller reads the record from the store or builds it. None where this
    machine has one core. Spawned, not forked: the caller may hold threads (a database pool, a
    Temporal client), and a fork copies the pages of the caller's heap its collector touches."""
    if (os.cpu_count() or 1) < 2:
        yield None
        return
    pool = ProcessPoolExecutor(max_workers=REPLAY_PROCESSES, mp_context=multiprocessing.get_context("spawn"))
    try:
        for _ in range(REPLAY_PROCESSES):
            pool.submit(_started)
        yield pool
    finally:
        # Waited for: a process left starting would hold the caller's output open after it ended
        # (a short record replays in the caller's process, and these are not used).
        pool.shutdown(wait=True, cancel_futures=True)


def _started() -> None:
    """Nothing: the first task of a `replay_processes` process (its import is the work)."""


def _replay_pickled(record: bytes, catalog: Catalog | None, label: str) -> Replayed:
    """`replay` of a record pickled once by the caller (the executor passes the bytes as they are)."""
    return replay(pickle.loads(record), catalog, label)


def compare(
    record: RecordScenario,
    proposed: Catalog | None,
    *,
    parallel: bool | None = None,
    processes: ProcessPoolExecutor | None = None,
) -> list[Replayed]:
    """What the record says happened, the record replayed under the catalog as it was and, when
    given, under `proposed` (its cards in the record's pool, the record's measured load times for
    deployments it shares). The two replays run side by side where more than one core is there
    and the record is long (`parallel`: force either way; `processes`: those of
    `replay_processes`, else they are started now); the figures are the same."""
    jobs: list[tuple[Catalog | None, str]] = [(None, "as it was")]
    if proposed is not None:
        jobs.append((proposed_for(record, proposed), "proposed"))
    recorded = Replayed("recorded", None, record.recorded)
    if parallel is None:
        parallel = (os.cpu_count() or 1) > 1 and len(record.lines) >= PARALLEL_FROM_REQUESTS
    if parallel and len(jobs) > 1:
        with nullcontext(processes) if processes is not None else replay_processes() as pool:
            if pool is not None:  # (None: one core, one after the other below)
                pickled = pickle.dumps(record, pickle.HIGHEST_PROTOCOL)  # once, not once per process
                replays = [pool.submit(_replay_pickled, pickled, catalog, label) for catalog, label in jobs]
                return [recorded, *(replayed.result() for replayed in replays)]
    return [recorded, *(replay(record, catalog, label) for catalog, label in jobs)]


def proposed_for(record: RecordScenario, proposed: Catalog) -> Catalog:
    from dataclasses import replace

    from modelforge.simulate._record import RecordError

    accelerators = [a for a in proposed.accelerators if a.pool == record.pool]
    if not accelerators:
        pools = sorted({a.pool for a in proposed.accelerators})
        raise RecordError(
            f"the proposed catalog has no accelerator in pool {record.pool!r} (it has {', '.join(pools)})"
        )
    measured = {
        d.deployment_id: [d.load_s]
        for d in record.catalog.deployments
        if any(p.deployment_id == d.deployment_id for p in proposed.deployments)
    }
    return with_measured_load_times(replace(proposed, accelerators=accelerators), measured)


def _cell(value: Any, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float):
        return f"{value:,.3f}" if abs(value) < 1000 else f"{value:,.0f}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {v}" for k, v in value.items()) or "-"
    return str(value)


def comparison_table(runs: list[Replayed]) -> list[tuple[str, list[str]]]:
    """Rows of the side-by-side table: one cell per catalog."""
    rows: list[tuple[str, list[str]]] = []
    for key in ("requests", "goodput"):
        rows.append((key, [_cell(r.figures[key]) for r in runs]))
    for group, title in (("by_class", "class"), ("by_tenant", "tenant")):
        names: list[str] = []
        for run in runs:
            names += [n for n in run.figures[group] if n not in names]
        for name in names:
            for metric in ("wait_p50_s", "wait_p95_s", "wait_p99_s", "goodput"):
                cells = []
                for run in runs:
                    row = run.figures[group].get(name)
                    cells.append("-" if row is None else _cell(row[metric], "never"))
                rows.append((f"{title} {name} {metric}", cells))
    for key in (
        "cold_starts",
        "load_s",
        "evictions",
        "preemptions",
        "refusals",
        "vram_gib_hours_in_use",
        "vram_gib_hours_idle_resident",
        "external_headroom_below_reserve",
        "oom_events",
        "invariant_violations",
        "replay_wall_s",
    ):
        rows.append((key, [_cell(r.figures[key]) for r in runs]))
    return rows


def comparison_json(record: RecordScenario, runs: list[Replayed]) -> dict[str, Any]:
    return {
        "pool": record.pool,
        "window_s": round(record.until_s - record.since_s, 3),
        "requests_recorded": len(record.lines) + sum(record.left_out.values()),
        "notes": record.notes,
        "recorded": next((r.figures for r in runs if r.result is None), {}),
        "replays": {r.label: {**r.figures, "series": r.result.series} for r in runs if r.result is not None},
    }
