"""Model runtimes behind one Protocol."""

from modelforge.runtimes._protocol import Heartbeat, LoadedModel, Runtime
from modelforge.runtimes._simulated import SimulatedRuntime

__all__ = ["Heartbeat", "LoadedModel", "Runtime", "SimulatedRuntime"]
