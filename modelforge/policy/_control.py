"""Residency on demand: an operator (or an Ollama client's keep_alive) pins, unpins or unloads a
resident model; loading one is an admission the scheduler makes for itself (workflows/scheduler.py).

Each operation finds the residents it names (a deployment, optionally on one accelerator) and
either acts or refuses with a class and a reason; it never half-acts. The rules:
- pin: the resident is kept like an `always_warm` one (never evicted, no TTL) until unpinned;
- unpin: back to its catalog residency (refused for an `always_warm` deployment: the catalog
  says so);
- unload: an idle resident is unloaded now; one with active leases is EVICTION_NOT_ALLOWED,
  unless `drain`: it then takes no new lease (it counts as unloading) and is unloaded when its
  last lease ends (`drained`). Slots lent to a node that serve nobody are not active leases: a
  resident holding only those is idle, and its unload takes them back (they close at the node's
  next sync, which gives them back at once) and unloads it then, as a drain does; a lent slot is
  never taken back before its node gives it up (the node may have just started a request on it).
- load on a named accelerator (`load_on`): loaded there now, or refused with its class and the
  numbers (REQUEST_INVALID: not a card of the pool, or one the deployment's placement rules
  exclude; CAPABILITY_UNAVAILABLE: too little room; RESIDENCY_CONFLICT: a stale, unhealthy or
  pressured card, or the resident there is in another phase); never makes room for itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from modelforge.domain import Deployment, Residency, resident_key
from modelforge.failures import FailureClass
from modelforge.policy._budget import compute_budget
from modelforge.policy._decisions import PolicyEvent, StartLoad, resident_event
from modelforge.policy._pass import static_reason
from modelforge.policy._state import (
    AcceleratorRuntime,
    PoolState,
    ResidentPhase,
    ResidentState,
    holder_of,
    serves_nobody,
)

ACTIONS = ("load", "unload", "pin", "unpin")


@dataclass
class ControlOutcome:
    """What an operation did: `unload` lists the residents to tell to unload now (key ->
    workflow id); a refusal has its class and message and changes nothing."""

    failure: FailureClass | None = None
    message: str = ""
    events: list[PolicyEvent] = field(default_factory=list)
    unload: dict[str, str] = field(default_factory=dict)
    residents: list[str] = field(default_factory=list)
    # Residents unloaded once their free lent slots are back (key -> how many slots).
    reclaiming: dict[str, int] = field(default_factory=dict)


def free_lent_slots(state: PoolState) -> dict[str, int]:
    """Resident key -> slots lent to a node that serve nobody (`serves_nobody`)."""
    lent: dict[str, int] = {}
    for lease in state.leases.values():
        resident = holder_of(state, lease) if serves_nobody(state, lease) else None
        if resident is not None:
            lent[resident.key] = lent.get(resident.key, 0) + 1
    return lent


def _named(state: PoolState, deployment: str, accelerator: str) -> list[ResidentState]:
    return sorted(
        (
            r
            for r in state.residents.values()
            if deployment in (r.deployment, r.capability) and (not accelerator or r.accelerator == accelerator)
        ),
        key=lambda r: r.key,
    )


def _unknown(state: PoolState, deployment: str, accelerator: str) -> str | None:
    if state.catalog.deployment(deployment) is None and not any(
        d.capability == deployment for d in state.catalog.deployments
    ):
        return f"no deployment {deployment!r} in the catalog"
    if accelerator and accelerator not in state.pool_accelerators():
        return f"no accelerator {accelerator!r} in pool {state.pool!r}"
    return None


def control_residents(
    state: PoolState, action: str, deployment: str, accelerator: str, drain: bool, actor: str, now: float
) -> ControlOutcome:
    """pin, unpin or unload (`load` is an admission: the scheduler's own)."""
    unknown = _unknown(state, deployment, accelerator)
    if unknown is not None:
        return ControlOutcome(FailureClass.REQUEST_INVALID, unknown)
    residents = _named(state, deployment, accelerator)
    where = f" on {accelerator}" if accelerator else ""
    if not residents:
        return ControlOutcome(FailureClass.REQUEST_INVALID, f"{deployment}{where} is not resident")
    outcome = ControlOutcome(residents=[r.key for r in residents])
    if action == "pin":
        for resident in residents:
            resident.residency = Residency.ALWAYS_WARM
            outcome.events.append(resident_event(resident, "resident_pinned", f"pinned by {actor}"))
        return outcome
    if action == "unpin":
        for resident in residents:
            spec = state.catalog.deployment(resident.deployment)
            if spec is not None and spec.residency == Residency.ALWAYS_WARM:
                return ControlOutcome(
                    FailureClass.EVICTION_NOT_ALLOWED,
                    f"{resident.deployment} is always_warm in the catalog: change the catalog to let it go",
                )
        for resident in residents:
            spec = state.catalog.deployment(resident.deployment)
            resident.residency = spec.residency if spec is not None else Residency.KEEP_WARM
            resident.last_used = now  # its TTL counts from now
            outcome.events.append(resident_event(resident, "resident_unpinned", f"unpinned by {actor}"))
        return outcome
    if action != "unload":
        return ControlOutcome(FailureClass.REQUEST_INVALID, f"unknown action {action!r}: one of {', '.join(ACTIONS)}")
    lent = free_lent_slots(state)
    serving = {r.key: max(0, r.active_leases - lent.get(r.key, 0)) for r in residents}
    busy = [r for r in residents if serving[r.key] > 0]
    if busy and not drain:
        leases = sum(serving[r.key] for r in busy)
        return ControlOutcome(
            FailureClass.EVICTION_NOT_ALLOWED,
            f"{deployment}{where} holds {leases} active lease(s): unload with drain to let them finish first",
        )
    moving = [r for r in residents if r.phase not in (ResidentPhase.READY, ResidentPhase.ASLEEP)]
    if moving:
        return ControlOutcome(
            FailureClass.RESIDENCY_CONFLICT,
            f"{moving[0].key} is {moving[0].phase.value}: ask again once it is ready",
        )
    for resident in residents:
        resident.phase = ResidentPhase.UNLOADING
        resident.requested_at = now
        if resident.active_leases > 0 and serving[resident.key] == 0:
            # Only free lent slots: they close at their node's next sync (the resident is
            # unloading), come back, and it is unloaded then (`drained`).
            state.draining[resident.key] = now
            outcome.reclaiming[resident.key] = resident.active_leases
            outcome.events.append(
                resident_event(
                    resident,
                    "resident_draining",
                    f"unload asked by {actor}: its {resident.active_leases} free lent slot(s) taken back; "
                    "unloaded once its node gives them back",
                )
            )
        elif resident.active_leases > 0:
            state.draining[resident.key] = now
            outcome.events.append(
                resident_event(
                    resident,
                    "resident_draining",
                    f"drain asked by {actor}: no new lease; unloaded when its {resident.active_leases} end",
                )
            )
        else:
            outcome.unload[resident.key] = resident.workflow_id
            outcome.events.append(resident_event(resident, "unload_requested", f"unload asked by {actor}"))
    return outcome


@dataclass(frozen=True)
class LoadRefusal:
    failure: FailureClass
    message: str


@dataclass(frozen=True)
class AlreadyResident:
    resident_key: str


def load_on(
    state: PoolState, deployment: Deployment, accelerator_id: str, now: float
) -> StartLoad | AlreadyResident | LoadRefusal:
    """An operator's load of `deployment` on one named accelerator: the load to start there now
    (the `StartLoad` a placement makes), the resident already there (ready or loading), or why
    not. Pure: changes nothing; it never evicts or waits to make room."""
    accelerator = state.catalog.accelerator(accelerator_id)
    if accelerator is None or accelerator.pool != state.pool:
        return LoadRefusal(FailureClass.REQUEST_INVALID, f"no accelerator {accelerator_id!r} in pool {state.pool!r}")
    excluded = static_reason(accelerator, deployment, False)
    if excluded:
        return LoadRefusal(FailureClass.REQUEST_INVALID, f"{deployment.deployment_id} may not load on {excluded}")
    key = resident_key(deployment.deployment_id, accelerator.id)
    there = state.residents.get(key)
    if there is not None:
        if there.phase in (ResidentPhase.READY, ResidentPhase.LOADING):
            return AlreadyResident(key)
        return LoadRefusal(
            FailureClass.RESIDENCY_CONFLICT, f"{key} is {there.phase.value}: ask again once it is ready or gone"
        )
    runtime = state.accelerators.get(accelerator.id)
    if runtime is not None and not runtime.healthy:
        return LoadRefusal(FailureClass.RESIDENCY_CONFLICT, f"{accelerator.id}: UNHEALTHY")
    budget = compute_budget(
        accelerator,
        runtime if runtime is not None else AcceleratorRuntime(),
        list(state.residents.values()),
        list(state.leases.values()),
        state.config,
        now,
    )
    if not budget.fresh:
        age = "never reported" if budget.age_s is None else f"last report {budget.age_s:.1f} s ago"
        return LoadRefusal(
            FailureClass.RESIDENCY_CONFLICT,
            f"{accelerator.id}: observation stale ({age}, freshness {state.config.freshness_s} s)",
        )
    if runtime is not None and runtime.pressure:
        return LoadRefusal(FailureClass.RESIDENCY_CONFLICT, f"{accelerator.id}: under GPU_PRESSURE")
    need = deployment.resident_bytes
    if need > budget.schedulable_bytes:
        return LoadRefusal(
            FailureClass.CAPABILITY_UNAVAILABLE,
            f"{accelerator.id}: {deployment.deployment_id} needs {need} B, {budget.schedulable_bytes} B schedulable "
            f"(total {budget.total_bytes}, external {budget.external_bytes}, resident {budget.resident_bytes}, "
            f"leased {budget.leased_bytes}, reserve {budget.reserve_bytes})",
        )
    return StartLoad(key, deployment.deployment_id, accelerator.id, accelerator.node, need)


def drained(state: PoolState) -> dict[str, str]:
    """Draining residents whose last lease has ended: to unload now (key -> workflow id)."""
    done: dict[str, str] = {}
    for key in list(state.draining):
        resident = state.residents.get(key)
        if resident is None:
            del state.draining[key]
        elif resident.active_leases == 0:
            del state.draining[key]
            done[key] = resident.workflow_id
    return done
