"""CAPABILITY_CAPACITY: an alert when a production deployment's measured envelope no longer fits
the headroom known on any accelerator it may run on, and its clearing when it fits again.

Alerts inform operators; they never control anything, least of all an external process."""

from __future__ import annotations

from modelforge.domain import Deployment
from modelforge.failures import Alert
from modelforge.policy._budget import compute_budget
from modelforge.policy._decisions import PolicyEvent
from modelforge.policy._pass import static_reason
from modelforge.policy._standing import is_evictable
from modelforge.policy._state import PoolState

_GiB = 1024**3


def production_headroom(state: PoolState, deployment: Deployment, now: float) -> tuple[int, str] | None:
    """The most bytes one production request of the deployment could have right now without
    preempting anything, and where: schedulable bytes, plus the deployment's own resident (its
    idle bytes are part of the envelope), plus idle residents that production may evict.
    None when no eligible accelerator is fresh and healthy: unknown is not short, and stale data
    has its own signal (SCHEDULER_STATE_STALE)."""
    residents = list(state.residents.values())
    leases = list(state.leases.values())
    best: tuple[int, str] | None = None
    for accelerator in state.catalog.accelerators:
        if accelerator.pool != state.pool or static_reason(accelerator, deployment, True):
            continue
        runtime = state.accelerators.get(accelerator.id)
        if runtime is None or not runtime.healthy:
            continue
        budget = compute_budget(accelerator, runtime, residents, leases, state.config, now)
        if not budget.fresh:
            continue
        reclaimable = sum(
            r.bytes
            for r in residents
            if r.accelerator == accelerator.id and (r.deployment == deployment.deployment_id or is_evictable(r))
        )
        headroom = budget.schedulable_bytes + reclaimable
        if best is None or headroom > best[0]:
            best = (headroom, accelerator.id)
    return best


def capacity_alerts(state: PoolState, now: float) -> list[PolicyEvent]:
    """Raise or clear CAPABILITY_CAPACITY per production deployment, on transitions only."""
    events: list[PolicyEvent] = []
    for deployment in state.catalog.deployments:
        if not (deployment.production_eligible and deployment.measured_on):
            continue
        found = production_headroom(state, deployment, now)
        if found is None:
            continue
        headroom, accelerator = found
        need = deployment.envelope_bytes
        raised = deployment.deployment_id in state.capacity_short
        payload: dict[str, str | int | float | bool | None] = {
            "envelope_bytes": need,
            "headroom_bytes": headroom,
            "best_accelerator": accelerator,
        }
        if headroom < need and not raised:
            state.capacity_short.append(deployment.deployment_id)
            events.append(
                PolicyEvent(
                    kind="capacity_alert_raised",
                    alert=Alert.CAPABILITY_CAPACITY,
                    deployment=deployment.deployment_id,
                    accelerator=accelerator,
                    payload=payload,
                    message=(
                        f"{deployment.capability}: envelope {need / _GiB:.1f} GiB no longer fits; "
                        f"best headroom {headroom / _GiB:.1f} GiB on {accelerator}"
                    ),
                )
            )
        elif headroom >= need and raised:
            state.capacity_short.remove(deployment.deployment_id)
            events.append(
                PolicyEvent(
                    kind="capacity_alert_cleared",
                    alert=Alert.CAPABILITY_CAPACITY,
                    deployment=deployment.deployment_id,
                    accelerator=accelerator,
                    payload=payload,
                    message=f"{deployment.capability}: envelope {need / _GiB:.1f} GiB fits again on {accelerator}",
                )
            )
    return events
