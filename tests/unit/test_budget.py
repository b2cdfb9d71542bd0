"""The admission invariant, row by row: schedulable = total - external - resident - leased - reserve."""

from __future__ import annotations

import pytest

from modelforge.domain import GiB, Priority
from modelforge.policy import Lease, PolicyConfig, ResidentPhase, compute_budget
from tests.builders import NOW, gpu, observe, resident, state

ENVELOPE = 1_216_348_160


def lease(accelerator: str, nbytes: int) -> Lease:
    return Lease(
        lease_id="l",
        request_id="r",
        workflow_id="w",
        capability="c",
        deployment="c",
        accelerator=accelerator,
        node="n",
        resident_key="c@n/0",
        bytes=nbytes,
        granted_at=NOW,
        priority=Priority.INTERACTIVE,
        tenant="t",
    )


@pytest.mark.parametrize(
    ("total_gib", "external_gib", "managed_gib", "residents", "leased", "reserve_gib", "expected"),
    [
        # 24 GiB - 0 external - 0 resident - 0 leased - 1 GiB reserve = 23 GiB
        (24, 0, 0, [], 0, 1, 23 * GiB),
        # The worked keep-warm example: 24 - 6 (Ollama) - 1,216,348,160 (rag.embedding) - 0 - 1 = 17,037,262,848 B
        (24, 6, 0, [ENVELOPE], 0, 1, 24 * GiB - 6 * GiB - ENVELOPE - GiB),
        # Once loaded, NVML sees the model (managed): it is resident, not external.
        # 24 - (7.133 used - 1.133 managed = 6) - 1.133 - 0 - 1
        (24, 6, ENVELOPE / GiB, [ENVELOPE], 0, 1, 24 * GiB - 6 * GiB - ENVELOPE - GiB),
        # A lease adds its peak-over-idle bytes: 24 - 0 - 4 - 2 - 1 = 17 GiB
        (24, 0, 4, [4 * GiB], 2 * GiB, 1, 17 * GiB),
        # Over-committed by external growth: 8 - 7 - 1 - 0 - 1 = -1 GiB (negative, not clamped)
        (8, 7, 0, [GiB], 0, 1, -1 * GiB),
        # A larger static floor: 80 - 10 - 0 - 0 - 8 = 62 GiB
        (80, 10, 0, [], 0, 8, 62 * GiB),
    ],
)
def test_schedulable_bytes(
    total_gib: float,
    external_gib: float,
    managed_gib: float,
    residents: list[int],
    leased: int,
    reserve_gib: float,
    expected: int,
) -> None:
    s = state([gpu("n/0", total=total_gib, reserve=reserve_gib)], [])
    observe(s, "n/0", external_gib=external_gib, managed_gib=managed_gib)
    for i, nbytes in enumerate(residents):
        resident(s, f"m{i}", "n/0", nbytes / GiB)
    budget = compute_budget(
        s.catalog.accelerators[0],
        s.accelerators["n/0"],
        list(s.residents.values()),
        [lease("n/0", leased)] if leased else [],
        s.config,
        NOW,
    )
    assert budget.schedulable_bytes == expected
    assert budget.fresh


def test_unloading_and_unreclaimed_bytes_stay_counted() -> None:
    s = state([gpu("n/0", total=24)], [])
    observe(s, "n/0")
    resident(s, "a", "n/0", 2, phase=ResidentPhase.UNLOADING)
    resident(s, "b", "n/0", 3, phase=ResidentPhase.UNRECLAIMED)
    budget = compute_budget(
        s.catalog.accelerators[0], s.accelerators["n/0"], list(s.residents.values()), [], s.config, NOW
    )
    # 24 - 0 - (2 + 3) - 0 - 1 = 18 GiB
    assert budget.schedulable_bytes == 18 * GiB


def test_dynamic_reserve_follows_external_volatility() -> None:
    s = state([gpu("n/0", total=24, reserve=1)], [], config=PolicyConfig(volatility_window_s=300))
    observe(s, "n/0", external_gib=2, at=NOW - 100)
    observe(s, "n/0", external_gib=6, at=NOW)  # a Tdarr transcode starts: external swings by 4 GiB
    budget = compute_budget(s.catalog.accelerators[0], s.accelerators["n/0"], [], [], s.config, NOW)
    # reserve = max(1 GiB floor, (6 - 2) GiB spread * 1.0) = 4 GiB; 24 - 6 - 0 - 0 - 4 = 14 GiB
    assert budget.reserve_bytes == 4 * GiB
    assert budget.schedulable_bytes == 14 * GiB
    # Past the window the swing is forgotten and the floor returns.
    observe(s, "n/0", external_gib=6, at=NOW + 400)
    later = compute_budget(s.catalog.accelerators[0], s.accelerators["n/0"], [], [], s.config, NOW + 400)
    assert later.reserve_bytes == 1 * GiB


def test_freshness_bound() -> None:
    s = state([gpu("n/0")], [], config=PolicyConfig(freshness_s=30))
    observe(s, "n/0", at=NOW)
    acc, runtime = s.catalog.accelerators[0], s.accelerators["n/0"]
    assert compute_budget(acc, runtime, [], [], s.config, NOW + 30).fresh
    assert not compute_budget(acc, runtime, [], [], s.config, NOW + 31).fresh
