"""Reservations for waiting gangs, with backfill (EASY backfilling, as batch schedulers do it),
and for requests waiting past their class's starvation bound.

A gang that cannot start now reserves the accelerators where it can start soonest, counting on
the work there ending by its `max_duration` (`Lease.ends_by`). Until then, later work may still
use them, but only work that ends before the reservation starts, or bytes the gang will not need
(the reservation's spare). Without end times nothing can be promised, so nothing is reserved and
the gang waits as before (draining a node for days starved 1,577 other jobs in simulation).

A single-card request that has waited longer than its level's `starvation_bound_s` reserves the
one card where it falls short least (`_placement._reserve_starved`), by the same rule: later work
in the pass (its own class's and lower classes'; higher classes were placed before it) may take
bytes there only within the spare or if it ends before the reservation starts, which without end
times is never. Joining a resident it needs gone counts that resident's bytes (`keeps_residents`):
joiners would otherwise keep the resident busy, and it never unloads.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from modelforge.domain import Accelerator, Residency
from modelforge.policy._state import Lease, ResidentState
from modelforge.policy._topology import GangShape, choose_gang


@dataclass
class Reservation:
    holder: str  # the waiting request's id (a gang's, or a starving request's)
    starts_at: float  # when every reserved accelerator will have its bytes (inf: unknown)
    spare: int  # bytes on this accelerator beyond its own, at starts_at: free to take now
    # Held for a request past its class's starvation bound (not a gang).
    starving: bool = False
    # It needs residents on the card unloaded (its bytes cannot come from leases ending alone):
    # joining a resident it may unload keeps that resident, so counts its bytes. For a
    # production holder any such resident, else one that did not last serve production.
    keeps_residents: bool = False
    production: bool = False


def release_timeline(
    leases: Iterable[Lease], residents: dict[str, ResidentState], now: float, promised: list[tuple[float, int]]
) -> list[tuple[float, int]]:
    """(when, bytes) this accelerator gets back as its leases end by their max_duration: a lease's
    own bytes, and its batch resident's (residency none: unloaded with its only lease); plus
    `promised`, the lease bytes held for requests waiting on a load, by when those will end.
    Leases without an end time free nothing that can be counted on."""
    timeline: list[tuple[float, int]] = list(promised)
    for lease in leases:
        if lease.ends_by is None:
            continue
        freed = lease.bytes
        holder = residents.get(lease.resident_key)
        if holder is not None and holder.incarnation != lease.incarnation:
            holder = None  # it outlived its resident: its end unloads nothing
        if holder is not None and holder.residency == Residency.NONE and holder.active_leases <= 1:
            freed += holder.bytes
        timeline.append((max(now, lease.ends_by), freed))
    timeline.sort()
    return timeline


def free_at(free_now: int, timeline: list[tuple[float, int]], need: int, now: float) -> float:
    """The earliest time `need` bytes are free, or infinity."""
    if need <= free_now:
        return now
    free = free_now
    for when, freed in timeline:
        free += freed
        if free >= need:
            return when
    return math.inf


def freed_by(timeline: list[tuple[float, int]], when: float) -> int:
    return sum(freed for at, freed in timeline if at <= when)


def choose_reserved(
    ready_at: dict[str, float],
    count: int,
    shape: GangShape,
    topology: dict[str, Accelerator],
    nvlink_groups: dict[str, list[str]] | None,
) -> tuple[float, list[str]] | None:
    """The accelerators where the gang starts soonest (ties: the topology's choice), and when.
    `nvlink_groups`: the gang must fit inside one of them."""
    if nvlink_groups is not None:
        best: tuple[float, str, list[str]] | None = None
        for key in sorted(nvlink_groups):
            times = sorted((ready_at[a], a) for a in nvlink_groups[key] if a in ready_at)
            if len(times) < count or math.isinf(times[count - 1][0]):
                continue
            chosen = (times[count - 1][0], key, [a for _, a in times[:count]])
            if best is None or chosen[:2] < best[:2]:
                best = chosen
        return None if best is None else (best[0], best[2])
    finite = sorted((t, a) for a, t in ready_at.items() if not math.isinf(t))
    if len(finite) < count:
        return None
    # The first moment enough of them are ready in a shape the topology allows.
    thresholds = sorted({t: True for t, _ in finite})
    for threshold in thresholds:
        room = [(0, a) for t, a in finite if t <= threshold]
        if len(room) < count:
            continue
        picked = choose_gang(room, shape, topology)
        if picked is not None:
            return threshold, picked
    return None
