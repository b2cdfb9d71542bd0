"""Where the busy cluster's replay spends its decision time, by what each placement decided.

    .venv/bin/python -m bench.busy_breakdown [--limit-s SECONDS]

Replays the trace `bench/simulate.py --busy` replays (`bench/busy_cluster.py`, the defaults)
through ModelForge's policy and times every placement (`_placement._place_one` for a single-card
request, `_gang.place_gang` for a gang) by the kind of decision it made (a grant, a load, a
preemption, making room, or a wait with its typed reasons), with the count of passes and the
spread of a pass's cost. The counts are the policy's own (the same on every run and every
machine); a change that leaves them all equal has left the decisions alone, and the times show
what it saved. Timing each placement adds a little to the replay's own wall time.
"""

from __future__ import annotations

import argparse
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import modelforge.policy._placement as placement
import modelforge.simulate._modelforge as simulated
from bench.busy_cluster import busy_scenario
from modelforge.policy import Decisions, PoolState
from modelforge.simulate import POLICIES, load_scenario
from modelforge.simulate._engine import Simulation


class _Stop(Exception):
    pass


def _kind(decision: object) -> str:
    if isinstance(decision, list):
        return "making room (unload or sleep)"
    name = type(decision).__name__
    codes = getattr(decision, "codes", None)
    if name == "Wait" and codes:
        return "Wait: " + ", ".join(code.value for code in codes)
    return name


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--limit-s", type=float, default=0.0, help="stop after this much wall time (0: the whole replay)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = busy_scenario(Path(tmp) / "busy")
        scenario = load_scenario(path)
    count: Counter[tuple[str, str]] = Counter()
    spent: dict[tuple[str, str], float] = {}

    def timed(what: str, place: Callable[..., object]) -> Callable[..., object]:
        def run(attempt: object) -> object:
            started = time.perf_counter()
            decision = place(attempt)
            key = (what, _kind(decision))
            spent[key] = spent.get(key, 0.0) + time.perf_counter() - started
            count[key] += 1
            return decision

        return run

    # Each module's own name is replaced, where the pass looks it up.
    setattr(placement, "place_gang", timed("gang", getattr(placement, "place_gang")))  # noqa: B009, B010
    setattr(placement, "_place_one", timed("single", placement._place_one))  # noqa: B010
    passes: list[float] = []
    decide: Callable[[PoolState, float], Decisions] = getattr(simulated, "decide")  # noqa: B009

    def timed_decide(state: PoolState, now: float) -> Decisions:
        started = time.perf_counter()
        decisions = decide(state, now)
        passes.append(time.perf_counter() - started)
        return decisions

    setattr(simulated, "decide", timed_decide)  # noqa: B010
    sim = Simulation(scenario, POLICIES["modelforge"](scenario))

    def stop(signum: int, frame: FrameType | None) -> None:
        raise _Stop

    if args.limit_s:
        signal.signal(signal.SIGALRM, stop)
        signal.setitimer(signal.ITIMER_REAL, args.limit_s)
    started = time.perf_counter()
    try:
        sim.run()
        finished = "the whole replay"
    except _Stop:
        finished = f"stopped after {args.limit_s:.0f} s"
    wall = time.perf_counter() - started
    print(f"{finished}: {wall:.1f} s wall, {len(passes):,} passes, {sum(passes):.1f} s deciding")
    print("| placement | decided | count | seconds | ms each |")
    print("|---|---|---:|---:|---:|")
    for key, seconds in sorted(spent.items(), key=lambda item: -item[1]):
        print(f"| {key[0]} | {key[1]} | {count[key]:,} | {seconds:.2f} | {1000 * seconds / count[key]:.2f} |")
    if passes:
        ordered = sorted(passes)
        at = [ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000 for q in (0.5, 0.9, 0.99)]
        print(f"a pass: p50 {at[0]:.1f} ms, p90 {at[1]:.1f} ms, p99 {at[2]:.1f} ms, max {ordered[-1] * 1000:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
