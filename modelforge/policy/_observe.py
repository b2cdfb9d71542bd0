"""Turning NVML samples into scheduler state: health with consecutive-check hysteresis,
GPU_PRESSURE with watermark hysteresis, external volatility and resident reconciliation."""

from __future__ import annotations

from dataclasses import replace

from modelforge.domain import Accelerator, Observation
from modelforge.failures import Alert, FailureClass
from modelforge.policy._budget import Budget, budget_from_sums, in_window
from modelforge.policy._decisions import PolicyEvent
from modelforge.policy._fit_index import mark_observed
from modelforge.policy._standing import lease_groups, resident_groups
from modelforge.policy._state import AcceleratorRuntime, PoolState, ResidentPhase, ResidentState

# Labels a node advertises for its accelerators, and the catalog field each one sets.
ADVERTISED_LABELS = {
    "nvlink_group_id": "nvlink_group",
    "rack_id": "rack",
    "network_bandwidth_gbps": "network_bandwidth_gbps",
}


def with_advertised_labels(accelerator: Accelerator, labels: dict[str, str]) -> Accelerator:
    """The accelerator as its node describes it: what NVML measured (the NVLink group) and what
    the node was configured with (rack, bandwidth) win over the catalog's declaration."""
    changes: dict[str, str | float] = {}
    for key in sorted(labels):
        field = ADVERTISED_LABELS.get(key)
        if field is None:
            continue
        value: str | float = labels[key]
        if field == "network_bandwidth_gbps":
            try:
                value = float(labels[key])
            except ValueError:
                continue
            if not 0 <= value < float("inf"):
                continue
        if getattr(accelerator, field) != value:
            changes[field] = value
    return replace(accelerator, **changes) if changes else accelerator  # type: ignore[arg-type]


def relabel(state: PoolState) -> list[PolicyEvent]:
    """Apply every accelerator's advertised labels to the catalog (after each change of labels
    and each catalog reload), one event per accelerator whose description changed."""
    events: list[PolicyEvent] = []
    accelerators = []
    for accelerator in state.catalog.accelerators:
        runtime = state.accelerators.get(accelerator.id)
        labels = runtime.observation.labels if runtime is not None and runtime.observation is not None else {}
        updated = with_advertised_labels(accelerator, labels)
        if updated is not accelerator:
            events.append(
                PolicyEvent(
                    kind="accelerator_labels",
                    accelerator=accelerator.id,
                    message=(
                        f"advertised by {accelerator.node}: nvlink_group={updated.nvlink_group!r} "
                        f"rack={updated.rack!r} network_bandwidth_gbps={updated.network_bandwidth_gbps:g}"
                        f" (catalog: {accelerator.nvlink_group!r}, {accelerator.rack!r}, "
                        f"{accelerator.network_bandwidth_gbps:g})"
                    ),
                )
            )
        accelerators.append(updated)
    if events:
        state.catalog = replace(state.catalog, accelerators=accelerators)
    return events


def apply_observations(state: PoolState, observations: list[Observation], now: float) -> list[PolicyEvent]:
    events: list[PolicyEvent] = []
    labels_changed = False
    held: _Held | None = None  # the bytes residents and leases hold per card, once per call
    on_cards: dict[str, list[ResidentState]] | None = None  # the observed cards' residents, once per call
    for observation in observations:
        accelerator = state.catalog.accelerator(observation.accelerator)
        if accelerator is None or accelerator.pool != state.pool:
            continue  # unknown, or another pool's card (a node whose cards are in several pools)
        if observation.labels and with_advertised_labels(accelerator, observation.labels) is not accelerator:
            labels_changed = True
        runtime = state.accelerators.setdefault(accelerator.id, AcceleratorRuntime())
        mark_observed(state, accelerator.id)
        events.extend(_apply_health(state, runtime, observation))
        if not observation.healthy and observation.used_bytes < 0:
            continue
        runtime.observation = observation
        runtime.external_history = in_window(runtime.external_history, now, state.config.volatility_window_s)
        # Only changes are kept: a steady card keeps one entry however long the window, so an
        # hour of memory costs nothing on the hot path.
        if not runtime.external_history or runtime.external_history[-1][1] != float(observation.external_bytes):
            runtime.external_history.append([observation.received_at, float(observation.external_bytes)])
        if on_cards is None:
            on_cards = _residents_on(state, observations)
        lost = _reconcile_residents(state, observation, on_cards.get(observation.accelerator, []))
        events.extend(lost)
        if held is None:
            held = _Held(state)
        elif lost:
            held.recount_residents(state, accelerator.id)
        events.extend(_apply_pressure(state, accelerator, runtime, held, now))
    if labels_changed:
        events.extend(relabel(state))
    return events


def _apply_health(state: PoolState, runtime: AcceleratorRuntime, observation: Observation) -> list[PolicyEvent]:
    config = state.config
    if observation.healthy:
        runtime.consecutive_failures = 0
        runtime.consecutive_successes += 1
        if not runtime.healthy and runtime.consecutive_successes >= config.healthy_after_successes:
            runtime.healthy = True
            return [
                PolicyEvent(
                    kind="gpu_healthy",
                    accelerator=observation.accelerator,
                    message=f"{runtime.consecutive_successes} consecutive good checks",
                )
            ]
        return []
    runtime.consecutive_successes = 0
    runtime.consecutive_failures += 1
    events = [
        PolicyEvent(
            kind="health_check_failed",
            failure=FailureClass.DRIVER_ERROR,
            accelerator=observation.accelerator,
            message=observation.health_reason,
        )
    ]
    if runtime.healthy and runtime.consecutive_failures >= config.unhealthy_after_failures:
        runtime.healthy = False
        events.append(
            PolicyEvent(
                kind="gpu_unhealthy",
                accelerator=observation.accelerator,
                message=f"{runtime.consecutive_failures} consecutive failed checks: {observation.health_reason}",
            )
        )
    return events


def _residents_on(state: PoolState, observations: list[Observation]) -> dict[str, list[ResidentState]]:
    """The residents of each observed card, in the residents' order: one walk for all the
    observations of a call, not one per observation (a pool holding thousands of residents)."""
    observed = {observation.accelerator for observation in observations}
    on_cards: dict[str, list[ResidentState]] = {}
    for resident in state.residents.values():
        if resident.accelerator in observed:
            on_cards.setdefault(resident.accelerator, []).append(resident)
    return on_cards


def _reconcile_residents(state: PoolState, observation: Observation, on_card: list[ResidentState]) -> list[PolicyEvent]:
    """A resident the scheduler believes ready but the node no longer holds (its worker
    restarted, the runtime died) is lost: its bytes are gone from the card, so drop it.
    `on_card`: the card's residents when the observations began to land (one dropped by an
    earlier observation of the same card is passed over)."""
    events: list[PolicyEvent] = []
    for resident in on_card:
        key = resident.key
        if state.residents.get(key) is not resident or resident.phase not in (
            ResidentPhase.READY,
            ResidentPhase.ASLEEP,
        ):
            continue
        if resident.loaded_at is not None and observation.observed_at and observation.observed_at < resident.loaded_at:
            continue
        if key in observation.loaded or resident.active_leases > 0:
            continue
        del state.residents[key]
        state.draining.pop(key, None)
        events.append(
            PolicyEvent(
                kind="resident_lost",
                accelerator=resident.accelerator,
                deployment=resident.deployment,
                workflow_id=resident.workflow_id,
                message="the node no longer holds this model; dropped from residency",
            )
        )
    return events


class _Held:
    """Resident and leased bytes per card, from the groupings a pass starts from (`_standing`,
    kept across passes and rebuilt only when residents or leases changed, so the pass after
    these observations reuses them), not from a walk per observed card: a node reporting many
    cards to a pool holding thousands of leases made that walk most of an observation's cost.
    A card whose residents were dropped as lost is counted again (`recount_residents`); leases
    do not change while observations land."""

    __slots__ = ("leased", "recounted", "resident")

    def __init__(self, state: PoolState) -> None:
        self.resident = resident_groups(state).resident_sum  # read only: the groupings' own
        self.leased = lease_groups(state).leased_sum
        self.recounted: dict[str, int] = {}

    def recount_residents(self, state: PoolState, accelerator: str) -> None:
        self.recounted[accelerator] = sum(r.bytes for r in state.residents.values() if r.accelerator == accelerator)

    def resident_bytes(self, accelerator: str) -> int:
        recounted = self.recounted.get(accelerator)
        return self.resident.get(accelerator, 0) if recounted is None else recounted


def _pressure_payload(budget: Budget, fraction: float) -> dict[str, str | int | float | bool | None]:
    return {
        "schedulable_bytes": budget.schedulable_bytes,
        "external_bytes": budget.external_bytes,
        "fraction": round(fraction, 4),
    }


def _apply_pressure(
    state: PoolState, accelerator: Accelerator, runtime: AcceleratorRuntime, held: _Held, now: float
) -> list[PolicyEvent]:
    accelerator_id = accelerator.id
    if accelerator.total_bytes <= 0:
        return []
    budget = budget_from_sums(
        accelerator,
        runtime,
        held.resident_bytes(accelerator_id),
        held.leased.get(accelerator_id, 0),
        state.config,
        now,
    )
    fraction = budget.schedulable_bytes / accelerator.total_bytes
    config = state.config
    if not runtime.pressure:
        if fraction < config.pressure_enter_fraction:
            runtime.pressure = True
            runtime.pressure_clear_since = None
            return [
                PolicyEvent(
                    kind="gpu_pressure_entered",
                    alert=Alert.GPU_PRESSURE,
                    accelerator=accelerator_id,
                    payload=_pressure_payload(budget, fraction),
                    message=f"schedulable {fraction:.1%} of total < {config.pressure_enter_fraction:.0%}",
                )
            ]
        return []
    if fraction <= config.pressure_exit_fraction:
        runtime.pressure_clear_since = None
        return []
    if runtime.pressure_clear_since is None:
        runtime.pressure_clear_since = now
    if now - runtime.pressure_clear_since >= config.pressure_hold_s:
        runtime.pressure = False
        runtime.pressure_clear_since = None
        return [
            PolicyEvent(
                kind="gpu_pressure_left",
                alert=Alert.GPU_PRESSURE,
                accelerator=accelerator_id,
                payload=_pressure_payload(budget, fraction),
                message=f"schedulable above {config.pressure_exit_fraction:.0%} for {config.pressure_hold_s:.0f} s",
            )
        ]
    return []
