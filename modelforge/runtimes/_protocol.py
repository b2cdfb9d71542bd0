from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from modelforge.domain import Deployment
from modelforge.failures import FailureClass, ModelForgeError


@dataclass
class LoadedModel:
    resident_key: str
    deployment: str
    device_index: int
    pid: int
    measured_bytes: int
    load_s: float
    # True when `pid` is a real process ModelForge started: it and all it forks are ModelForge's.
    owns_process: bool = False


Heartbeat = Callable[[str], None]


class Runtime(Protocol):
    """One model runtime. Each operation raises ModelForgeError with its failure class."""

    name: str

    def version(self) -> str:
        """What ran, for envelopes: the runtime library's version or the server's program."""
        ...

    async def load(
        self, key: str, deployment: Deployment, device_index: int, device_uuid: str, heartbeat: Heartbeat
    ) -> LoadedModel: ...

    async def health_check(self, model: LoadedModel) -> None: ...

    async def invoke(self, model: LoadedModel, payload: dict[str, Any], heartbeat: Heartbeat) -> dict[str, Any]: ...

    async def unload(self, model: LoadedModel) -> None: ...

    # Optional operations: a runtime that cannot do one raises CAPABILITY_UNAVAILABLE naming why.
    def supports(self, deployment: Deployment) -> list[str]:
        """Which of "sleep" (frees most device memory, far cheaper to undo than a load, as vLLM's
        sleep mode) and "checkpoint" (saves a job's progress) this deployment can do."""
        ...

    async def sleep(self, model: LoadedModel) -> int:
        """Free what can be freed; returns the bytes the model still holds asleep."""
        ...

    async def wake(self, model: LoadedModel, heartbeat: Heartbeat) -> int:
        """Undo sleep; returns the bytes the model holds awake again."""
        ...

    async def checkpoint(self, model: LoadedModel, payload: dict[str, Any]) -> str:
        """Save progress; returns the checkpoint's location for the resumed run."""
        ...

    async def run_job(
        self, deployment: Deployment, device_indices: list[int], payload: dict[str, Any], heartbeat: Heartbeat
    ) -> dict[str, Any]:
        """A batch job on several devices of this node (this node's part of a gang lease), run
        to its end: it holds its bytes on each device only while it runs. Its payload's
        `modelforge_resume_from`, when set, is this rank's checkpoint to start from."""
        ...

    async def checkpoint_job(self, lease_id: str, rank: int, destination: str) -> str:
        """Save the progress of this node's part (`rank`) of the running gang job of `lease_id`
        under `destination`; returns the checkpoint's location for the resumed rank."""
        ...


def unsupported(runtime: str, operation: str, why: str) -> ModelForgeError:
    return ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"{runtime} runtime cannot {operation}: {why}")


Sleep = Callable[[float], Awaitable[None]]
