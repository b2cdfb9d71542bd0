"""Decision cost of the pure policy: one `decide` pass over G accelerators and N queued requests,
with residents and leases in proportion. Prints the median per size and the growth exponent in N.

    .venv/bin/python bench/policy_decide.py [--quick]
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time

from modelforge.domain import Accelerator, Catalog, Deployment, GiB, Observation, Priority, Tenant
from modelforge.policy import (
    AdmissionRequest,
    PoolState,
    ResidentPhase,
    ResidentState,
    apply_decisions,
    apply_observations,
    decide,
    enqueue,
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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="skip the 1,024 x 10,000 size")
    args = parser.parse_args()
    sizes = [(8, 100, 101), (64, 1_000, 51)] + ([] if args.quick else [(1_024, 10_000, 11)])
    targets = {(64, 1_000): 1.0, (1_024, 10_000): 50.0}
    for gpus, queued, repeats in sizes:
        decide_s, sort_s = measure(gpus, queued, repeats)
        target = targets.get((gpus, queued))
        verdict = (
            "" if target is None else f"  target {target:g} ms: {'met' if decide_s * 1000 <= target else 'MISSED'}"
        )
        print(
            f"{gpus:>5} GPUs x {queued:>6} queued: median {decide_s * 1000:8.2f} ms"
            f"  ({decide_s / sort_s:5.1f}x one sorted() of the queue){verdict}",
            flush=True,
        )
    # Growth in queue length at a fixed pool, measured side by side in this run.
    small, _ = measure(64, 1_000, 31)
    large, _ = measure(64, 8_000, 11)
    exponent = math.log(large / small) / math.log(8)
    print(
        f"growth in N at 64 GPUs (1,000 -> 8,000 queued): x{large / small:.2f}, exponent {exponent:.2f}"
        " (n log n would be ~1.1)"
    )


if __name__ == "__main__":
    main()
