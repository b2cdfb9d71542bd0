"""The seam between the simulator's virtual cards and a scheduling policy: ModelForge's own and
the baselines sit behind the same `SimScheduler` protocol, so they are measured side by side on
the very same world."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from modelforge.domain import Catalog, Observation
from modelforge.failures import FailureClass
from modelforge.simulate._scenario import SimRequest


@dataclass(frozen=True)
class Load:
    key: str
    deployment: str
    accelerator: str
    bytes: int


@dataclass(frozen=True)
class Start:
    """Run a request on a ready resident, holding `bytes` more on its card while it runs."""

    request_index: int
    lease_id: str
    accelerator: str
    resident_key: str
    bytes: int
    # A gang job's other accelerators, each also holding `bytes`.
    gang: tuple[str, ...] = ()

    @property
    def accelerators(self) -> tuple[str, ...]:
        return (self.accelerator, *self.gang)


@dataclass(frozen=True)
class Refuse:
    request_index: int
    failure: FailureClass
    message: str


@dataclass
class Actions:
    loads: list[Load] = field(default_factory=list)
    starts: list[Start] = field(default_factory=list)
    # (resident key, why): idle ones evicted to make room count as evictions; the rest (TTL,
    # last lease of a load_on_demand model, a batch job's end) do not.
    unloads: list[tuple[str, bool]] = field(default_factory=list)
    preempts: list[str] = field(default_factory=list)
    refusals: list[Refuse] = field(default_factory=list)
    # Idle residents put to sleep (to keep `bytes`), and asleep ones woken (back to `bytes`).
    sleeps: list[tuple[str, int]] = field(default_factory=list)
    wakes: list[tuple[str, int]] = field(default_factory=list)


class CardView(Protocol):
    """What a scheduler may read of the simulated cards, as nvidia-smi would show it."""

    def free_bytes(self, accelerator: str) -> int: ...

    def sample(self, accelerator: str, now: float) -> Observation: ...


class SimScheduler(Protocol):
    name: str

    def submit(self, request: SimRequest, now: float) -> Refuse | None:
        """Admit or refuse at once (the admission update's validator)."""
        ...

    def step(self, now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        """Decide on the world as it is at `now`; `touched` names cards whose memory changed."""
        ...

    def loaded(self, key: str, now: float) -> None: ...

    def unloaded(self, key: str, now: float) -> None: ...

    def slept(self, key: str, kept_bytes: int, now: float) -> None:
        """A resident it put to sleep is asleep, holding `kept_bytes`."""
        ...

    def woke(self, key: str, now: float) -> None:
        """A resident it woke is ready again."""
        ...

    def finished(self, lease_id: str, now: float, outcome: str) -> None: ...

    def checkpointed(self, lease_id: str, request: SimRequest, now: float) -> None:
        """A preempted run released its lease; the request goes back to the queue."""
        ...

    def catalog_changed(self, catalog: Catalog, now: float) -> None:
        """A catalog applied at `now` (its deployments, tenants and classes; the same cards)."""
        ...

    def next_wakeup(self, now: float) -> float | None:
        """The next time the scheduler wants to decide without any event (TTL, deadlines)."""
        ...
