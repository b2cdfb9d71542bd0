"""The admission invariant (docs/ARCHITECTURE.md, "2. The invariant"), per accelerator:

schedulable = total - external - resident - leased - reserve
"""

from __future__ import annotations

from dataclasses import dataclass

from modelforge.domain import Accelerator
from modelforge.policy._state import (
    AcceleratorRuntime,
    Lease,
    PolicyConfig,
    ResidentState,
)


@dataclass(slots=True)
class Budget:
    accelerator: str
    total_bytes: int
    observed_used_bytes: int | None
    external_bytes: int
    resident_bytes: int
    leased_bytes: int
    reserve_bytes: int
    schedulable_bytes: int
    fresh: bool
    age_s: float | None


def in_window(history: list[list[float]], now: float, window_s: float) -> list[list[float]]:
    """The [time, external bytes] entries inside the window, plus the last one before it: the
    value in effect when the window opened (entries are recorded on change only)."""
    start = now - window_s
    first_inside = 0
    while first_inside < len(history) and history[first_inside][0] < start:
        first_inside += 1
    return history[max(0, first_inside - 1) :]


def dynamic_reserve_bytes(runtime: AcceleratorRuntime, config: PolicyConfig, now: float) -> int:
    """Spread of external usage over the recent window: a card whose unmanaged users swing by
    4 GiB keeps 4 GiB (times the factor) free for their next swing."""
    history = runtime.external_history
    if len(history) < 2:
        return 0
    recent = [b for _, b in in_window(history, now, config.volatility_window_s)]
    if len(recent) < 2:
        return 0
    return int((max(recent) - min(recent)) * config.volatility_factor)


def telemetry_age(runtime: AcceleratorRuntime | None, now: float) -> float | None:
    """Seconds since the card's last sample reached the scheduler; None: it never reported."""
    observation = runtime.observation if runtime is not None else None
    return None if observation is None else max(0.0, now - observation.received_at)


def is_fresh(runtime: AcceleratorRuntime | None, config: PolicyConfig, now: float) -> bool:
    """The one freshness rule (placement, control, delegation and the route view): the card's
    node reported within `freshness_s`. A stale card may be gone: nothing new lands on it."""
    observation = runtime.observation if runtime is not None else None
    return reported_within(observation.received_at if observation is not None else None, config.freshness_s, now)


def reported_within(received_at: float | None, freshness_s: float, now: float) -> bool:
    """`is_fresh` from the time the card's last sample reached the scheduler (None: never)."""
    return received_at is not None and max(0.0, now - received_at) <= freshness_s


def compute_budget(
    accelerator: Accelerator,
    runtime: AcceleratorRuntime,
    residents: list[ResidentState],
    leases: list[Lease],
    config: PolicyConfig,
    now: float,
) -> Budget:
    # Residents of every phase count, unloading and unreclaimed included, until NVML confirms.
    resident = sum(r.bytes for r in residents if r.accelerator == accelerator.id)
    leased = sum(lease.bytes for lease in leases if accelerator.id in lease.accelerators)
    return budget_from_sums(accelerator, runtime, resident, leased, config, now)


def budget_from_sums(
    accelerator: Accelerator,
    runtime: AcceleratorRuntime,
    resident_bytes: int,
    leased_bytes: int,
    config: PolicyConfig,
    now: float,
) -> Budget:
    """The invariant from bytes already summed per accelerator (the decision pass groups them
    in one walk over residents and leases)."""
    observation = runtime.observation
    reserve = max(accelerator.reserve_bytes, dynamic_reserve_bytes(runtime, config, now))
    external = observation.external_bytes if observation is not None else 0
    age = telemetry_age(runtime, now)
    fresh = is_fresh(runtime, config, now)
    return Budget(
        accelerator=accelerator.id,
        total_bytes=accelerator.total_bytes,
        observed_used_bytes=None if observation is None else observation.used_bytes,
        external_bytes=external,
        resident_bytes=resident_bytes,
        leased_bytes=leased_bytes,
        reserve_bytes=reserve,
        schedulable_bytes=accelerator.total_bytes - external - resident_bytes - leased_bytes - reserve,
        fresh=fresh,
        age_s=age,
    )
