"""A bounded round of bench/chaos.py in CI (about 3 minutes): a stream of requests against two
models whose leases carry bytes, while kill -9 of the control worker, kill -9 of the node
worker, Temporal restarts and Postgres stops hit at random moments (seeded), the scheduler
continuing as new every 200 events, and its run reset a few workflow tasks back every 20 s or
so (the replay guard's reset, as after a nondeterminism error: the grants and admissions it
discards must be recovered). The invariant checker then reads the ledger, the events and
the snapshots: never more leases than concurrency nor more bytes than the card, every request
typed, no ledger row open, every grant and release with its event. Long runs: bench/chaos.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.chaos import FAULTS, run_chaos

pytestmark = pytest.mark.workflow


# Alone (./scripts/test): it loads the machine itself (a burst of requests with faults at
# random moments), and the other tests would slow it and be slowed by it.
@pytest.mark.serial
@pytest.mark.timeout(600)
async def test_chaos_round_keeps_every_invariant(tmp_path: Path) -> None:
    # Seed 14's first four faults are one of each kind, in this order: kill_control, kill_node,
    # restart_temporal, stop_postgres (the fault sequence has its own generator).
    report = await run_chaos(seconds=75, rate=2.0, seed=14, fault_every_s=10.0, workdir=tmp_path, reset_every_s=20.0)
    print("\n".join(report.lines()))
    assert report.violations == [], "\n".join(report.lines())
    assert set(report.faults) == {*FAULTS, "reset_scheduler"}, report.faults
    assert report.continued_as_new >= 2, "the round never reached continue-as-new"
    assert report.outcomes["ok"] >= 0.8 * report.requests, report.outcomes
