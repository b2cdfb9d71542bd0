"""Model runtimes behind one Protocol."""

from modelforge.runtimes._artifacts import artifact_digest, resolve_artifact, verify_artifact
from modelforge.runtimes._protocol import Heartbeat, LoadedModel, Runtime
from modelforge.runtimes._simulated import SimulatedRuntime

__all__ = [
    "Heartbeat",
    "LoadedModel",
    "Runtime",
    "SimulatedRuntime",
    "artifact_digest",
    "resolve_artifact",
    "verify_artifact",
]
