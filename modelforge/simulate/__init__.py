"""`modelforge simulate`: replay a scenario in virtual time through ModelForge's own policy (the
code the scheduler workflow runs) or a baseline, and measure both on the same world."""

from __future__ import annotations

from collections.abc import Callable

from modelforge.simulate._baselines import FifoScheduler, GangFifoScheduler, OllamaScheduler
from modelforge.simulate._engine import Progress, Simulation, SimulationResult, common_span
from modelforge.simulate._history import HistoryModel
from modelforge.simulate._modelforge import ModelForgeScheduler
from modelforge.simulate._plot import plotting_available, write_plot
from modelforge.simulate._progress import ReplayProgress
from modelforge.simulate._protocol import Actions, CardView, Load, Refuse, SimScheduler, Start
from modelforge.simulate._record import RecordError, RecordScenario, build_record_scenario, record_from_store
from modelforge.simulate._report import comparison_rows
from modelforge.simulate._scenario import (
    ExternalUsage,
    Scenario,
    ScenarioError,
    SimRequest,
    SimulationConfig,
    load_scenario,
    parse_request_lines,
)
from modelforge.simulate._whatif import Replayed, compare, comparison_json, comparison_table, replay_processes

POLICIES: dict[str, Callable[[Scenario], SimScheduler]] = {
    "modelforge": ModelForgeScheduler,
    "fifo": FifoScheduler,
    "ollama": OllamaScheduler,
    "fifo-gang": GangFifoScheduler,
}


def simulate(
    scenario: Scenario,
    policy: str = "modelforge",
    progress: Progress | None = None,
    history: HistoryModel | None = None,
) -> SimulationResult:
    """`history`: how to read the schedule as the scheduler workflow's Temporal history (pools,
    delegation sync interval); the result's `scheduler_history`, for ModelForge's policy."""
    factory = POLICIES.get(policy)
    if factory is None:
        raise ScenarioError(f"unknown policy {policy!r}; choose one of {', '.join(POLICIES)}")
    return Simulation(scenario, factory(scenario), progress, history=history).run()


__all__ = [
    "POLICIES",
    "Actions",
    "CardView",
    "ExternalUsage",
    "FifoScheduler",
    "GangFifoScheduler",
    "HistoryModel",
    "Load",
    "ModelForgeScheduler",
    "OllamaScheduler",
    "Progress",
    "RecordError",
    "RecordScenario",
    "Refuse",
    "ReplayProgress",
    "Replayed",
    "Scenario",
    "ScenarioError",
    "SimRequest",
    "SimScheduler",
    "SimulationConfig",
    "SimulationResult",
    "Start",
    "build_record_scenario",
    "common_span",
    "compare",
    "comparison_json",
    "comparison_rows",
    "comparison_table",
    "load_scenario",
    "parse_request_lines",
    "plotting_available",
    "record_from_store",
    "replay_processes",
    "simulate",
    "write_plot",
]
