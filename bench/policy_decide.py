"""Decision cost of the pure policy, three ways, with the targets side by side in one run:

1. The steady state of a busy pool: G accelerators, one busy resident each (its
   leases only counted, and the cards' memory reported as external), N queued requests; the
   median `decide` pass per size, the growth exponent in N.
2. A full pool: 64 GPUs, every card holding a resident at its concurrency with real
   leases granted by the policy itself, the cards' memory reported as ModelForge's own, nothing
   new fits anywhere, 1,000 requests waiting. CPU per pass (decide and apply) after a telemetry
   update of one node, and after one new request. Target 1 ms. Then the same with an unmanaged
   process filling what ModelForge leaves of every card (smaller leases, 33 GiB unmanaged).
3. A cluster: 6,000 GPUs (750 nodes of 8, one NVLink group each, 32 nodes a rack),
   2,000 active leases on 2,000 full cards spread over every node, 50 waiting 8-GPU NVLink gangs
   (no node has 8 free cards), 10,000 queued requests for models at their concurrency and
   pinned to their cards. CPU per pass, after one new request and after a telemetry update.
   Target 50 ms. Then the same with an unmanaged process filling every card (1 GiB beside a
   lease, 79 GiB on a card without one).
4. Admission with 2,000 leases: a full pool of 500 GPUs (2,000 leases), 1,000
   waiting; what the scheduler does per submission (`existing_admission`, `validate_request`,
   `enqueue`), CPU per submission, each request withdrawn again afterwards (untimed).

    .venv/bin/python -m bench.policy_decide [--quick] [--processes N]

Each part runs in N fresh processes one after the other (default 3) and each case is judged by
its floor: one process's figures sit on one of two levels about 2x apart, the level chosen by the
process, not the code (docs/BENCHMARKS.md); `--processes 1` runs once, in this process.

--quick skips the 1,024 x 10,000 size and the growth measure of part 1 (about a minute in all
on two busy cores instead of two or three). Figures are CPU time of this process
(`time.process_time`), garbage collector off while timing, as `timeit` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from modelforge.domain import (
    Accelerator,
    Catalog,
    Deployment,
    GiB,
    Observation,
    Priority,
    ProcessUsage,
    Residency,
    Tenant,
)
from modelforge.policy import (
    AdmissionRequest,
    Decisions,
    PoolState,
    ResidentPhase,
    ResidentState,
    apply_decisions,
    apply_observations,
    cancel_request,
    decide,
    enqueue,
    existing_admission,
    validate_request,
)

NOW = 1_000_000.0
PRIORITIES = list(Priority)


def build(gpus: int, queued: int) -> PoolState:
    accelerators = [
        Accelerator(
            id=f"n{g // 8}/{g % 8}", node=f"n{g // 8}", total_bytes=80 * GiB, production_eligible=True, model="H100"
        )
        for g in range(gpus)
    ]
    deployments = [
        Deployment(
            capability=f"cap{d}@1",
            envelope_bytes=(4 + d % 8) * GiB,
            measured_on=["H100"],
            queue_limit=1_000_000,
            concurrency=4,
        )
        for d in range(max(4, gpus // 4))
    ]
    tenants = [Tenant(name=f"t{t}", weight=1.0 + t % 3, max_priority=Priority.PRODUCTION) for t in range(8)]
    state = PoolState(pool="default", catalog=Catalog(accelerators, deployments, tenants))
    apply_observations(state, [Observation(a.id, a.total_bytes, 70 * GiB, received_at=NOW) for a in accelerators], NOW)
    # Residents in proportion: one per GPU, busy, so the queue cannot simply drain.
    for g, acc in enumerate(accelerators):
        dep = deployments[g % len(deployments)]
        key = f"{dep.deployment_id}@{acc.id}"
        state.residents[key] = ResidentState(
            key=key,
            deployment=dep.deployment_id,
            capability=dep.capability,
            accelerator=acc.id,
            node=acc.node,
            bytes=dep.envelope_bytes,
            phase=ResidentPhase.READY,
            residency=dep.residency,
            ttl_s=900,
            workflow_id="w",
            active_leases=dep.concurrency,
            last_used=NOW,
        )
    for n in range(queued):
        dep = deployments[n % len(deployments)]
        request = AdmissionRequest(
            request_id=f"r{n}", workflow_id=f"w{n}", capability=dep.capability, tenant=f"t{n % 8}"
        )
        enqueue(state, request, PRIORITIES[n % 4], NOW + n * 0.001)
    return state


def measure(gpus: int, queued: int, repeats: int) -> tuple[float, float]:
    """The steady state of a busy pool: the queue has been decided once (loads started, waits
    recorded), then a signal arrives and the scheduler decides again on fresh observations.

    Returns the median decide time and, measured interleaved with it, the median time of one
    plain `sorted()` of the same queue: the ratio between them is what to compare across
    machines and runs, since a shared machine's speed drifts. The garbage collector is off while
    timing, as `timeit` does."""
    state = build(gpus, queued)
    apply_decisions(state, decide(state, NOW + 1), NOW + 1, {})
    decide_times: list[float] = []
    sort_times: list[float] = []
    gc.collect()
    gc.disable()
    ranks = {class_id: klass.rank for class_id, klass in state.catalog.classes.items()}
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            decide(state, NOW + 2)
            decide_times.append(time.perf_counter() - started)
            started = time.perf_counter()
            sorted(state.queue, key=lambda q: (ranks[q.priority], q.submitted_at, q.request_id))
            sort_times.append(time.perf_counter() - started)
    finally:
        gc.enable()
    return statistics.median(decide_times), statistics.median(sort_times)


# --- parts 2 to 4: a full pool and a cluster, with real leases ---------------------------------


def _observations(
    state: PoolState, accelerators: list[Accelerator], now: float, unmanaged: dict[str, int] | None = None
) -> list[Observation]:
    """What NVML would show: ModelForge's own residents and leases as one managed process, and
    an unmanaged process where `unmanaged` gives a card its bytes."""
    held: dict[str, int] = {}
    loaded: dict[str, list[str]] = {}
    for resident in state.residents.values():
        held[resident.accelerator] = held.get(resident.accelerator, 0) + resident.bytes
        loaded.setdefault(resident.accelerator, []).append(resident.key)
    for lease in state.leases.values():
        for accelerator_id in lease.accelerators:
            held[accelerator_id] = held.get(accelerator_id, 0) + lease.bytes
    unmanaged = unmanaged or {}
    samples = []
    for accelerator in accelerators:
        used = held.get(accelerator.id, 0)
        processes = [ProcessUsage(pid=2, used_bytes=used, name="modelforge", managed=True)] if used else []
        other = unmanaged.get(accelerator.id, 0)
        if other:
            processes.append(ProcessUsage(pid=3, used_bytes=other, name="unmanaged", managed=False))
        samples.append(
            Observation(
                accelerator.id,
                accelerator.total_bytes,
                used + other,
                processes=processes,
                loaded=loaded.get(accelerator.id, []),
                received_at=now,
                observed_at=now,
            )
        )
    return samples


def _observe_all(state: PoolState, now: float, unmanaged: dict[str, int] | None = None) -> None:
    apply_observations(state, _observations(state, state.catalog.accelerators, now, unmanaged), now)


def _ready_resident(state: PoolState, deployment: Deployment, accelerator: Accelerator, now: float) -> None:
    key = f"{deployment.deployment_id}@{accelerator.id}"
    state.residents[key] = ResidentState(
        key=key,
        deployment=deployment.deployment_id,
        capability=deployment.capability,
        accelerator=accelerator.id,
        node=accelerator.node,
        bytes=deployment.resident_bytes,
        phase=ResidentPhase.READY,
        residency=deployment.residency,
        ttl_s=deployment.ttl_s,
        workflow_id=f"resident-{key}",
        last_used=now,
        loaded_at=now,
    )


def _pass(state: PoolState, now: float) -> Decisions:
    decisions = decide(state, now)
    apply_decisions(state, decisions, now, {})
    return decisions


def _request(n: int, capability: str, tenants: int = 8) -> AdmissionRequest:
    return AdmissionRequest(request_id=f"r{n}", workflow_id=f"w{n}", capability=capability, tenant=f"t{n % tenants}")


def _grant_every_slot(state: PoolState, demand: list[str], now: float) -> None:
    """Fill every resident's slots through the policy itself: one request per slot, decided."""
    for n, capability in enumerate(demand):
        enqueue(state, _request(10_000_000 + n, capability), PRIORITIES[n % 4], now)
    decisions = _pass(state, now)
    if decisions.loads or len(state.leases) != len(demand) or state.queue:
        raise SystemExit(
            f"setup: expected {len(demand)} grants on ready residents, got {len(state.leases)} leases, "
            f"{len(decisions.loads)} loads, {len(state.queue)} still queued"
        )


def _nothing_fits(state: PoolState, decisions: Decisions, waiting: int) -> None:
    moved = len(decisions.grants) + len(decisions.loads) + len(decisions.preemptions) + len(decisions.rejects)
    if moved or len(state.queue) != waiting:
        raise SystemExit(
            f"setup: expected every request to wait, got {len(decisions.grants)} grants, {len(decisions.loads)} "
            f"loads, {len(decisions.preemptions)} preemptions, {len(decisions.rejects)} refusals, "
            f"{len(state.queue)} queued of {waiting}"
        )


def full_pool(gpus: int, waiting: int, unmanaged: dict[str, int] | None = None) -> PoolState:
    """Every card: a resident of 14 GiB with 4 leases of 16 GiB each = 78 of 80 GiB (1 GiB
    reserve): nothing new fits, nothing idle to evict, nothing preemptible. With `unmanaged`
    (filled in here, per card): leases of 8 GiB (46 GiB of ModelForge's) and an unmanaged
    process holding the other 33 GiB, as on a card shared with other users."""
    accelerators = [
        Accelerator(
            id=f"n{g // 8}/{g % 8}",
            node=f"n{g // 8}",
            total_bytes=80 * GiB,
            production_eligible=True,
            model="H100",
            nvlink_group=f"n{g // 8}",
        )
        for g in range(gpus)
    ]
    deployments = [
        Deployment(
            capability=f"cap{d}@1",
            envelope_bytes=(22 if unmanaged is not None else 30) * GiB,
            idle_bytes=14 * GiB,
            measured_on=["H100"],
            queue_limit=1_000_000,
            concurrency=4,
            ttl_s=900,
        )
        for d in range(max(4, gpus // 4))
    ]
    if unmanaged is not None:
        unmanaged.update((a.id, 33 * GiB) for a in accelerators)
    tenants = [Tenant(name=f"t{t}", weight=1.0 + t % 3, max_priority=Priority.PRODUCTION) for t in range(8)]
    state = PoolState(pool="default", catalog=Catalog(accelerators, deployments, tenants))
    for g, accelerator in enumerate(accelerators):
        _ready_resident(state, deployments[g % len(deployments)], accelerator, NOW)
    _observe_all(state, NOW, unmanaged)
    _grant_every_slot(state, [deployments[g % len(deployments)].capability for g in range(gpus) for _ in range(4)], NOW)
    _observe_all(state, NOW, unmanaged)
    for n in range(waiting):
        enqueue(state, _request(n, deployments[n % len(deployments)].capability), PRIORITIES[n % 4], NOW)
    _nothing_fits(state, _pass(state, NOW), waiting)
    return state


def cluster(nodes: int, leases: int, gangs: int, queued: int, unmanaged: dict[str, int] | None = None) -> PoolState:
    """Cards of 80 GiB, 8 a node. `leases` cards hold a model (30 GiB) serving one lease (48 GiB
    more, its concurrency), card j on node j % nodes, so every node has at least two full cards
    and no node has 8 free ones for a gang. Models are pinned to their cards (20 each), so the
    queued requests wait for a slot; the gangs (8 GPUs, NVLink, 40 GiB each) wait for a node.
    With `unmanaged` (filled in here, per card): an unmanaged process fills the rest of every
    card, 1 GiB beside a lease and 79 GiB on a card without one, so nothing fits anywhere."""
    accelerators = [
        Accelerator(
            id=f"n{n}/{i}",
            node=f"n{n}",
            total_bytes=80 * GiB,
            production_eligible=True,
            model="H100",
            nvlink_group=f"n{n}",
            rack=f"rack{n // 32}",
        )
        for n in range(nodes)
        for i in range(8)
    ]
    by_id = {a.id: a for a in accelerators}
    homes = [f"n{j % nodes}/{j // nodes}" for j in range(leases)]
    models = max(1, leases // 20)
    served = [
        Deployment(
            capability=f"svc{d}@1",
            envelope_bytes=78 * GiB,
            idle_bytes=30 * GiB,
            measured_on=["H100"],
            queue_limit=1_000_000,
            concurrency=1,
            ttl_s=900,
            accelerators=[homes[j] for j in range(d, leases, models)],
        )
        for d in range(models)
    ]
    trainers = [
        Deployment(
            capability=f"train{g}@1",
            envelope_bytes=40 * GiB,
            residency=Residency.NONE,
            measured_on=["H100"],
            queue_limit=1_000_000,
            gpu_count=8,
            nvlink_required=True,
        )
        for g in range(5)
    ]
    tenants = [Tenant(name=f"t{t}", weight=1.0 + t % 3, max_priority=Priority.PRODUCTION) for t in range(8)]
    state = PoolState(pool="default", catalog=Catalog(accelerators, [*served, *trainers], tenants))
    if unmanaged is not None:
        served_on = dict.fromkeys(homes, True)
        unmanaged.update((a.id, (1 if a.id in served_on else 79) * GiB) for a in accelerators)
    for j, home in enumerate(homes):
        _ready_resident(state, served[j % models], by_id[home], NOW)
    _observe_all(state, NOW, unmanaged)
    _grant_every_slot(state, [served[j % models].capability for j in range(leases)], NOW)
    _observe_all(state, NOW, unmanaged)
    for n in range(gangs):
        enqueue(state, _request(n, trainers[n % len(trainers)].capability), PRIORITIES[1 + n % 3], NOW)
    for n in range(gangs, gangs + queued):
        enqueue(state, _request(n, served[n % models].capability), PRIORITIES[n % 4], NOW)
    _nothing_fits(state, _pass(state, NOW), gangs + queued)
    return state


@dataclass
class Costs:
    telemetry_ms: float
    request_ms: float
    sort_ms: float


def event_costs(state: PoolState, repeats: int, unmanaged: dict[str, int] | None = None) -> Costs:
    """Median CPU per pass (decide + apply) right after each kind of event, the event itself
    untimed: one node's telemetry sample (its cards, unchanged), or one new request (withdrawn
    again afterwards, untimed, so the queue keeps its length). Time moves on a millisecond per
    pass, so nothing expires and no lease goes stale."""
    accelerators = state.catalog.accelerators
    nodes: dict[str, list[Accelerator]] = {}
    for accelerator in accelerators:
        nodes.setdefault(accelerator.node, []).append(accelerator)
    node_cards = list(nodes.values())
    capabilities = sorted({q.capability for q in state.queue if not q.capability.startswith("train")})
    ranks = {class_id: klass.rank for class_id, klass in state.catalog.classes.items()}
    telemetry: list[float] = []
    request: list[float] = []
    sort: list[float] = []
    now = NOW + 1.0

    def timed(before: Callable[[float], None], into: list[float]) -> None:
        nonlocal now
        now += 0.001
        before(now)
        gc.collect()
        gc.disable()
        try:
            started = time.process_time()
            decisions = _pass(state, now)
            into.append(time.process_time() - started)
        finally:
            gc.enable()
        if decisions.grants or decisions.loads:
            raise SystemExit(f"the pool was expected to stay full; a pass granted or loaded at {now}")

    for k in range(repeats):
        cards = node_cards[k % len(node_cards)]
        timed(
            lambda at, cards=cards: apply_observations(state, _observations(state, cards, at, unmanaged), at),
            telemetry,
        )
        rid = 50_000_000 + k
        timed(
            lambda at, rid=rid: enqueue(
                state, _request(rid, capabilities[rid % len(capabilities)]), PRIORITIES[rid % 4], at
            ),
            request,
        )
        cancel_request(state, f"r{rid}", now, "bench")
        started = time.process_time()
        sorted(state.queue, key=lambda q: (ranks[q.priority], q.submitted_at, q.request_id))
        sort.append(time.process_time() - started)
    return Costs(
        telemetry_ms=statistics.median(telemetry) * 1000,
        request_ms=statistics.median(request) * 1000,
        sort_ms=statistics.median(sort) * 1000,
    )


def admission_cost(state: PoolState, repeats: int) -> float:
    """Median CPU of one submission as the scheduler admits it (is it already admitted, is it
    valid, enqueue), in microseconds; each request is withdrawn again afterwards, untimed. The
    garbage collector is off for the whole loop (a collection before each submission would cost
    far more than the submission and leave the caches cold)."""
    capabilities = sorted({q.capability for q in state.queue})
    times: list[float] = []
    now = NOW + 1.0
    gc.collect()
    gc.disable()
    try:
        for k in range(repeats):
            now += 0.001
            request = _request(60_000_000 + k, capabilities[k % len(capabilities)])
            started = time.process_time()
            if existing_admission(state, request) is None:
                _, priority = validate_request(state, request, gangs=True)
                enqueue(state, request, priority, now)
            times.append(time.process_time() - started)
            cancel_request(state, request.request_id, now, "bench")
    finally:
        gc.enable()
    return statistics.median(times) * 1e6


def report(label: str, costs: Costs, target_ms: float) -> list[tuple[str, float, float]]:
    print(
        f"{label}: after a telemetry update {costs.telemetry_ms:8.2f} ms, after one new request "
        f"{costs.request_ms:8.2f} ms CPU per pass  (one sorted() of the queue: {costs.sort_ms:.2f} ms)",
        flush=True,
    )
    return [
        (f"{label}, after a telemetry update", costs.telemetry_ms, target_ms),
        (f"{label}, after one new request", costs.request_ms, target_ms),
    ]


def measure_all(quick: bool) -> list[tuple[str, float, float]]:
    """Every part once in this process, its report printed; the rows (label, ms, target ms)."""
    rows: list[tuple[str, float, float]] = []
    print("1. steady state of a busy pool, median wall time of one decide pass:")
    sizes = [(8, 100, 101), (64, 1_000, 51)] + ([] if quick else [(1_024, 10_000, 11)])
    targets = {(64, 1_000): 1.0, (1_024, 10_000): 50.0}
    for gpus, queued, repeats in sizes:
        decide_s, sort_s = measure(gpus, queued, repeats)
        target = targets.get((gpus, queued))
        if target is not None:
            rows.append((f"busy pool {gpus} GPUs x {queued:,} queued", decide_s * 1000, target))
        print(
            f"{gpus:>5} GPUs x {queued:>6} queued: median {decide_s * 1000:8.2f} ms"
            f"  ({decide_s / sort_s:5.1f}x one sorted() of the queue)",
            flush=True,
        )
    if not quick:
        # Growth in queue length at a fixed pool, measured side by side in this run.
        small, _ = measure(64, 1_000, 31)
        large, _ = measure(64, 8_000, 11)
        exponent = math.log(large / small) / math.log(8)
        print(
            f"growth in N at 64 GPUs (1,000 -> 8,000 queued): x{large / small:.2f}, exponent {exponent:.2f}"
            " (n log n would be ~1.1)"
        )
    print("\n2. a full pool: every card at its concurrency with real leases, nothing fits, all waiting")
    started = time.perf_counter()
    state = full_pool(64, 1_000)
    print(
        f"   (built in {time.perf_counter() - started:.1f} s: {len(state.leases)} leases, {len(state.queue)} waiting)"
    )
    rows += report("full pool 64 GPUs x 1,000 waiting", event_costs(state, 41), 1.0)
    unmanaged: dict[str, int] = {}
    state = full_pool(64, 1_000, unmanaged)
    rows += report("full pool 64 GPUs x 1,000 waiting, unmanaged process", event_costs(state, 41, unmanaged), 1.0)
    print("\n3. a cluster: 6,000 GPUs, 2,000 leases, 50 waiting gangs, 10,000 queued")
    started = time.perf_counter()
    state = cluster(750, 2_000, 50, 10_000)
    print(
        f"   (built in {time.perf_counter() - started:.1f} s: {len(state.leases)} leases, {len(state.queue)} waiting)"
    )
    rows += report("cluster 6,000 GPUs, 2,000 leases, 50 gangs, 10,000 queued", event_costs(state, 7), 50.0)
    unmanaged = {}
    state = cluster(750, 2_000, 50, 10_000, unmanaged)
    rows += report(
        "cluster 6,000 GPUs, 2,000 leases, 50 gangs, 10,000 queued, unmanaged process",
        event_costs(state, 7, unmanaged),
        50.0,
    )
    print("\n4. admission with 2,000 leases: a full pool of 500 GPUs, 1,000 waiting")
    started = time.perf_counter()
    state = full_pool(500, 1_000)
    print(
        f"   (built in {time.perf_counter() - started:.1f} s: {len(state.leases)} leases, {len(state.queue)} waiting)"
    )
    admit_us = admission_cost(state, 2_001)
    print(f"admission with {len(state.leases):,} leases: {admit_us:.1f} us CPU per submission (median of 2,001)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip part 1's 1,024 x 10,000 size and growth measure")
    parser.add_argument(
        "--processes",
        type=int,
        default=3,
        help="run every part in this many fresh processes, one after the other, and judge each case by its floor",
    )
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child: its rows as JSON, last
    args = parser.parse_args()
    if args.one or args.processes <= 1:
        rows = measure_all(args.quick)
        if args.one:
            print(json.dumps(rows))
            return
        print("\n| case | measured | target | measured / target | |")
        print("|---|---:|---:|---:|---|")
        for label, measured, target in rows:
            verdict = "met" if measured <= target else "MISSED"
            print(f"| {label} | {measured:.2f} ms | {target:g} ms | {measured / target:.2f}x | {verdict} |")
        return
    # One process's figures sit on one of two levels about 2x apart, which one by the process
    # (the same code read 0.6 and 1.6 ms: docs/BENCHMARKS.md): a single process cannot tell code
    # apart, the floor of a few can.
    runs: list[list[tuple[str, float, float]]] = []
    for number in range(1, args.processes + 1):
        print(f"== process {number} of {args.processes}", flush=True)
        child = subprocess.run(  # noqa: S603 (this script, with an argument list of our own)
            [sys.executable, __file__, *(["--quick"] if args.quick else []), "--one"],
            capture_output=True,
            text=True,
            check=True,
        )
        *report_lines, last = child.stdout.rstrip().splitlines()
        print("\n".join(report_lines), flush=True)
        runs.append([(label, float(ms), float(target)) for label, ms, target in json.loads(last)])
    print(f"\n| case | floor of {args.processes} processes | each process | target | floor / target | |")
    print("|---|---:|---|---:|---:|---|")
    for i, (label, _, target) in enumerate(runs[0]):
        each = [run[i][1] for run in runs]
        floor = min(each)
        verdict = "met" if floor <= target else "MISSED"
        shown = ", ".join(f"{value:.2f}" for value in each)
        print(f"| {label} | {floor:.2f} ms | {shown} | {target:g} ms | {floor / target:.2f}x | {verdict} |")


if __name__ == "__main__":
    main()
