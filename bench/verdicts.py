"""Admission verdicts, measured in one run, three ways:

1. ETA accuracy. A busy simulated pool (8 x 80 GiB cards, external processes on two, five
   deployments: two chat models at their concurrency, an embedder, single-card batch jobs and
   2-card gangs) driven by the production policy in the simulator (modelforge/simulate: real
   leases granted by the policy, loads in flight, waiting gangs, virtual time) for two hours of
   Poisson arrivals with lognormal service times. Each request's first verdict (the one the
   scheduler keeps as `eta_at`) is compared with when it actually started, on the requests that
   waited at least a second: median and p90 of |predicted - actual| / actual wait, per reason,
   side by side with a naive estimate, "position in its deployment's queue x mean measured
   service", made at the same moment from the same measurements.
2. Dry-run agreement. 1,000 mixed cases (every deployment, every class, tight deadlines, a model
   too big for any card, an unknown tenant) at moments sampled through the same run: the dry run
   (`admission_check`) on the pool's state, then the real admission of the same request on that
   state (validate, enqueue, one decision pass): now / later / never agree?
3. Upkeep. The full pool of bench/policy_decide.py (64 GPUs, every card at its concurrency with
   real leases, 1,000 waiting): CPU per decision pass after one new request, without and with
   `stamp_predictions` (what the scheduler adds to each pass to keep the first ETA), alternated
   in one loop; and the cost of the `verdicts` query over the whole queue and of one dry run.

    .venv/bin/python -m bench.verdicts [--quick]

--quick: one hour of arrivals and 300 dry-run cases instead of two hours and 1,000."""

from __future__ import annotations

import argparse
import copy
import gc
import math
import random
import statistics
import time

from bench.policy_decide import NOW as FULL_NOW
from bench.policy_decide import PRIORITIES, _pass, _request, full_pool
from modelforge.domain import (
    Accelerator,
    Catalog,
    Deployment,
    GiB,
    Priority,
    Residency,
    Tenant,
)
from modelforge.policy import (
    AdmissionRejected,
    AdmissionRequest,
    PoolState,
    admission_check,
    cancel_request,
    decide,
    enqueue,
    stamp_predictions,
    validate_request,
    verdicts,
)
from modelforge.policy._state import service_figures
from modelforge.simulate import CardView, ExternalUsage, ModelForgeScheduler, Scenario, SimRequest
from modelforge.simulate._engine import Simulation
from modelforge.simulate._protocol import Actions

# name -> (GiB, concurrency, residency, load_s, gpu_count, mean service s, share of arrivals, max_duration)
WORKLOAD: dict[str, tuple[float, int, Residency, float, int, float, float, float | None]] = {
    "chat.small@1": (14, 4, Residency.KEEP_WARM, 15.0, 1, 6.0, 0.50, None),
    "chat.large@1": (40, 2, Residency.KEEP_WARM, 45.0, 1, 20.0, 0.25, None),
    "embed@1": (4, 8, Residency.KEEP_WARM, 5.0, 1, 0.5, 0.15, None),
    "train.job@1": (30, 1, Residency.NONE, 10.0, 1, 300.0, 0.08, 900.0),
    "train.gang@1": (50, 1, Residency.NONE, 20.0, 2, 600.0, 0.02, 1200.0),
}
TENANTS = {"prod": Priority.PRODUCTION, "app": Priority.INTERACTIVE, "lab": Priority.BACKGROUND}


def catalog() -> Catalog:
    accelerators = [
        Accelerator(
            id=f"n{g // 4}/{g % 4}",
            node=f"n{g // 4}",
            total_bytes=80 * GiB,
            production_eligible=True,
            model="H100",
            nvlink_group=f"n{g // 4}",
            reserve_bytes=GiB,
            simulated=True,
        )
        for g in range(8)
    ]
    deployments = [
        Deployment(
            capability=name,
            envelope_bytes=int(gib * GiB),
            concurrency=concurrency,
            residency=residency,
            load_s=load_s,
            unload_s=2.0,
            gpu_count=gpus,
            ttl_s=600,
            queue_limit=100_000,
            measured_on=["H100"],
        )
        for name, (gib, concurrency, residency, load_s, gpus, _, _, _) in WORKLOAD.items()
    ]
    deployments.append(Deployment(capability="giant@1", envelope_bytes=120 * GiB, measured_on=["H100"]))
    tenants = [
        Tenant(name=name, default_priority=level.value, max_priority=level.value) for name, level in TENANTS.items()
    ]
    return Catalog(accelerators=accelerators, deployments=deployments, tenants=tenants)


def scenario(hours: float, rate: float, seed: int) -> Scenario:
    rng = random.Random(seed)
    names = list(WORKLOAD)
    shares = [WORKLOAD[n][6] for n in names]
    requests: list[SimRequest] = []
    t = 0.0
    while t < hours * 3600:
        t += rng.expovariate(rate)
        name = rng.choices(names, shares)[0]
        mean = WORKLOAD[name][5]
        sigma = 0.5
        service = rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)
        tenant = rng.choices(list(TENANTS), [0.2, 0.5, 0.3])[0]
        if name.startswith("train"):
            tenant = "lab"
        requests.append(
            SimRequest(
                index=len(requests),
                request_id=f"r{len(requests)}",
                t=t,
                capability=name,
                priority=None,
                tenant=tenant,
                service_s=service,
                max_duration_s=WORKLOAD[name][7],
                base_capability=name,
            )
        )
    external = [
        ExternalUsage("n0/0", 10 * GiB, 0.0, math.inf, "jupyter"),
        ExternalUsage("n1/3", 20 * GiB, 1800.0, 3600.0, "training-script"),
    ]
    return Scenario(catalog=catalog(), requests=requests, external=external, name="verdicts-bench")


class Observed(ModelForgeScheduler):
    """The production policy in the simulator, watched: each request's first verdict (as the
    scheduler stamps it), the naive estimate at the same moment, when it actually started, and
    snapshots of the state for the dry-run cases."""

    def __init__(self, scene: Scenario, snapshot_every_s: float) -> None:
        super().__init__(scene)
        self.rid_of = {r.index: r.request_id for r in scene.requests}
        self.submitted = {r.request_id: r.t for r in scene.requests}
        # request id -> (reason, predicted start, naive start, basis, quality)
        self.predicted: dict[str, tuple[str, float | None, float | None, str, str]] = {}
        # request id -> (at least, at most): the bound a verdict gave instead of an ETA
        self.bounds: dict[str, tuple[float | None, float | None]] = {}
        self.expires: dict[str, float] = {}  # request id -> when it stops waiting
        self.started: dict[str, float] = {}
        self.snapshots: list[tuple[float, PoolState]] = []
        self.snapshot_every_s = snapshot_every_s
        self._next_snapshot = 0.0

    def step(self, now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        actions = super().step(now, cards, touched)
        for start in actions.starts:
            self.started.setdefault(self.rid_of[start.request_index], now)
        fresh = {
            q.request_id
            for q in self.state.queue
            if q.request_id not in self.predicted and (q.waiting_reason or q.assigned_to)
        }
        if fresh:
            for verdict in verdicts(self.state, now, fresh):
                mean, _ = service_figures(self.state, verdict.deployment)
                naive = now + verdict.position_in_deployment * mean if mean else None
                self.predicted[verdict.request_id] = (
                    verdict.reason,
                    verdict.eta_at,
                    naive,
                    verdict.eta_basis,
                    verdict.eta_quality,
                )
                self.expires[verdict.request_id] = verdict.expires_at
                if verdict.eta_at_least_s is not None or verdict.eta_at_most_s is not None:
                    self.bounds[verdict.request_id] = (
                        None if verdict.eta_at_least_s is None else now + verdict.eta_at_least_s,
                        None if verdict.eta_at_most_s is None else now + verdict.eta_at_most_s,
                    )
        if now >= self._next_snapshot and self.state.queue:
            self.snapshots.append((now, copy.deepcopy(self.state, {id(self.state.catalog): self.state.catalog})))
            self._next_snapshot = now + self.snapshot_every_s
        return actions


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def _median_p90(values: list[float], width: int) -> str:
    if not values:
        return f"{'-':>{width}} {'-':>6}"
    return f"{statistics.median(values):>{width}.0%} {_quantile(values, 0.9):>6.0%}"


def eta_accuracy(hours: float) -> tuple[Observed, list[str]]:
    scene = scenario(hours, rate=0.55, seed=7)
    observed = Observed(scene, snapshot_every_s=10.0)
    started = time.perf_counter()
    Simulation(scene, observed).run()
    lines = [
        f"   ({len(scene.requests):,} requests over {hours:g} h simulated in {time.perf_counter() - started:.0f} s; "
        f"{len(observed.predicted):,} waited and got a verdict)"
    ]
    # reason -> [(actual start, actual wait, predicted start, naive start)]
    by_reason: dict[str, list[tuple[float, float, float | None, float | None]]] = {}
    unknown: dict[str, int] = {}
    for rid, (reason, eta_at, naive_at, _, quality) in observed.predicted.items():
        start = observed.started.get(rid)
        if start is None:
            continue
        waited = start - observed.submitted[rid]
        if waited < 1.0:
            continue
        if eta_at is None:
            unknown[reason] = unknown.get(reason, 0) + 1
        # Per reason, all together, and all by the ETA's quality (what it says it is based on).
        for key in (reason, "all", f"all, {quality}"):
            by_reason.setdefault(key, []).append((start, waited, eta_at, naive_at))
    lines.append(
        f"   {'reason':<22} {'waited':>6} {'ETA':>5}  {'verdict med':>11} {'p90':>6}   {'naive':>5}  "
        f"{'naive med':>9} {'p90':>6}   (|predicted - actual start| / actual wait)"
    )
    for reason in sorted(by_reason, key=lambda r: (r.startswith("all"), r != "all", r)):
        rows = by_reason[reason]
        # Each over the requests it gave a figure for (the naive one needs a measured mean
        # service; a verdict with nothing to base it on claims none).
        ours = [abs(e - start) / waited for start, waited, e, _ in rows if e is not None]
        naive = [abs(n - start) / waited for start, waited, _, n in rows if n is not None]
        lines.append(
            f"   {reason:<22} {len(rows):>6} {len(ours):>5}  {_median_p90(ours, 11)}   {len(naive):>5}  "
            f"{_median_p90(naive, 9)}"
        )
    if unknown:
        lines.append(f"   no ETA claimed (nothing measured to estimate it), by reason: {unknown}")
    # A verdict that claims no ETA gives what bound it can: did the start keep to it?
    held: dict[str, list[bool]] = {"at most": [], "at least": []}
    for rid, (at_least, at_most) in observed.bounds.items():
        start = observed.started.get(rid)
        if start is None or start - observed.submitted[rid] < 1.0:
            continue
        if at_most is not None:
            held["at most"].append(start <= at_most + 1e-6)
        if at_least is not None:
            held["at least"].append(start >= at_least - 1e-6)
    lines.append(
        "   bounds given instead (no ETA), the start within them: "
        + ", ".join(f"{kind} {sum(flags)}/{len(flags)}" for kind, flags in held.items())
    )
    # The ones that never started (refused when they expired): was an ETA before then promised?
    never = [rid for rid in observed.predicted if rid not in observed.started]
    promised = [rid for rid in never if (eta := observed.predicted[rid][1]) is not None and eta < observed.expires[rid]]
    by_reason: dict[str, int] = {}
    for rid in never:
        by_reason[observed.predicted[rid][0]] = by_reason.get(observed.predicted[rid][0], 0) + 1
    lines.append(
        f"   never started (expired waiting): {len(never)} {by_reason}; told an ETA before their expiry: "
        f"{len(promised)}"
    )
    # Those promised an ETA and never served are out of the table above (it needs a start):
    # counted here with their start taken as their expiry, the least their error can be.
    started_errors = [
        abs(eta - start) / (start - observed.submitted[rid])
        for rid, (_, eta, _, _, _) in observed.predicted.items()
        if eta is not None
        and (start := observed.started.get(rid)) is not None
        and start - observed.submitted[rid] >= 1.0
    ]
    expired_errors = [
        (observed.expires[rid] - eta) / (observed.expires[rid] - observed.submitted[rid])
        for rid in promised
        if (eta := observed.predicted[rid][1]) is not None
    ]
    lines.append(
        f"   all ETAs with those {len(expired_errors)} counted at their expiry: "
        f"median and p90 {_median_p90(started_errors + expired_errors, 0)} over "
        f"{len(started_errors) + len(expired_errors)} ETAs"
    )
    return observed, lines


def dry_run_agreement(observed: Observed, cases: int) -> list[str]:
    rng = random.Random(11)
    names = [*WORKLOAD, "giant@1"]
    agree = 0
    total = 0
    answers: dict[str, int] = {}
    mismatches: list[str] = []
    snapshots = observed.snapshots
    for case in range(cases):
        now, snapshot = snapshots[rng.randrange(len(snapshots))]
        name = rng.choice(names)
        tenant = (
            "lab" if name.startswith("train") else rng.choice([*TENANTS, "nobody"] if case % 20 == 0 else list(TENANTS))
        )
        deadline = rng.choice([None, None, None, 5.0, 60.0])
        request = AdmissionRequest(
            request_id=f"case{case}",
            workflow_id=f"case{case}",
            capability=name,
            tenant=tenant,
            deadline_s=deadline,
            max_duration_s=WORKLOAD[name][7] if name in WORKLOAD else None,
        )
        check = admission_check(snapshot, request, now)
        trial = copy.deepcopy(snapshot, {id(snapshot.catalog): snapshot.catalog})
        try:
            _, priority = validate_request(trial, request, gangs=True)
        except AdmissionRejected:
            real = "never"
        else:
            enqueue(trial, request, priority, now)
            decisions = decide(trial, now)
            if any(g.request_id == request.request_id for g in decisions.grants):
                real = "now"
            elif any(r.request_id == request.request_id for r in decisions.rejects):
                real = "never"
            else:
                real = "later"
        total += 1
        answers[real] = answers.get(real, 0) + 1
        if check.answer == real:
            agree += 1
        elif len(mismatches) < 5:
            mismatches.append(f"{name} {tenant} deadline {deadline}: dry run {check.answer}, real {real}")
    lines = [
        f"   {agree}/{total} agree ({agree / total:.1%}); real answers: "
        + ", ".join(f"{k} {v}" for k, v in sorted(answers.items()))
    ]
    lines += [f"   mismatch: {m}" for m in mismatches]
    return lines


def upkeep(repeats: int) -> list[str]:
    state = full_pool(64, 1_000)
    capabilities = sorted({q.capability for q in state.queue})
    plain: list[float] = []
    kept: list[float] = []
    now = FULL_NOW + 1.0
    for k in range(repeats):
        for into, stamp in ((plain, False), (kept, True)) if k % 2 == 0 else ((kept, True), (plain, False)):
            now += 0.001
            rid = 70_000_000 + k * 2 + int(stamp)
            enqueue(state, _request(rid, capabilities[rid % len(capabilities)]), PRIORITIES[rid % 4], now)
            gc.collect()
            gc.disable()
            try:
                started = time.process_time()
                decisions = _pass(state, now)
                if stamp:
                    stamp_predictions(state, now, decisions)
                into.append(time.process_time() - started)
            finally:
                gc.enable()
            cancel_request(state, f"r{rid}", now, "bench")
    query: list[float] = []
    dry: list[float] = []
    for k in range(max(5, repeats // 4)):
        started = time.process_time()
        verdicts(state, now)
        query.append(time.process_time() - started)
        started = time.process_time()
        admission_check(state, _request(80_000_000 + k, capabilities[k % len(capabilities)]), now)
        dry.append(time.process_time() - started)
    base, with_stamp = statistics.median(plain) * 1000, statistics.median(kept) * 1000
    return [
        f"   decision pass after one new request: {base:.2f} ms without, {with_stamp:.2f} ms with stamp_predictions "
        f"(+{(with_stamp / base - 1):.1%}; median of {repeats} each, alternated)",
        f"   the verdicts query over all {len(state.queue):,} waiting: {statistics.median(query) * 1000:.1f} ms; "
        f"one dry run (copy of the state + one pass): {statistics.median(dry) * 1000:.1f} ms",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="one hour, 300 dry-run cases")
    args = parser.parse_args()
    hours, cases = (1.0, 300) if args.quick else (2.0, 1_000)
    print("1. ETA accuracy on a busy simulated pool (production policy, virtual time)", flush=True)
    observed, lines = eta_accuracy(hours)
    print("\n".join(lines), flush=True)
    print(f"\n2. dry run vs the real admission right after, {cases:,} mixed cases", flush=True)
    print("\n".join(dry_run_agreement(observed, cases)), flush=True)
    # The simulated run's snapshots (thousands of copied states) are not the scheduler's: gone
    # before the upkeep is timed, so the collector does not walk them inside its timings.
    del observed
    gc.collect()
    print("\n3. upkeep at 64 GPUs x 1,000 waiting (bench/policy_decide.py's full pool)", flush=True)
    print("\n".join(upkeep(201)), flush=True)


if __name__ == "__main__":
    main()
