"""Baselines a user would otherwise pick, from their published behaviour, behind the same
`SimScheduler` seam as ModelForge's policy.

All three dispatch one queue in arrival order, know no classes, deadlines or tenants, never preempt,
and allocate a model's whole envelope at load (as llama.cpp-style runners do for their context),
so a running request holds no bytes beyond its model's. A model is a runner with `concurrency`
slots and a FIFO backlog; a request for a model that is loaded or loading joins that backlog,
and the queue blocks only on a request whose model must load and cannot yet (head of line).
A batch deployment (`residency = "none"`) is a process: it exits when its work is done.

- `fifo`: loads wherever the card shows enough free memory (nvidia-smi free, no reserve) and
  makes room by evicting the least recently used idle models, only when needed.
- `ollama` (server/sched.go): a model loads only if its predicted size is at most 80% of the
  free memory left after one global overhead reserve (OLLAMA_GPU_OVERHEAD); at most 3 loaded
  models per GPU (OLLAMA_MAX_LOADED_MODELS); keep-alive per model (5 min by default; the
  deployment's TTL for keep_warm, forever for always_warm, 0 for load_on_demand and batch);
  when nothing fits it unloads the idle runner with the shortest keep-alive first and waits,
  or waits for a runner to go idle; at most 512 queued requests (OLLAMA_MAX_QUEUE).
- `fifo-gang`: `fifo`, and a multi-GPU job placed whole on cards of one node, as Kubernetes'
  default scheduler places a pod asking for several GPUs: the node whose cards leave the most
  room, each card holding the job's envelope while it runs. When no node has room it evicts the
  least recently used idle models on the first node where that makes room, and the queue blocks
  on the job (head of line) until it starts. The other two refuse such jobs at submission.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from modelforge.domain import Catalog, Deployment, Residency
from modelforge.failures import FailureClass
from modelforge.simulate._protocol import Actions, CardView, Load, Refuse, Start
from modelforge.simulate._scenario import Scenario, SimRequest

OLLAMA_DEFAULT_KEEP_ALIVE_S = 300.0
OLLAMA_FIT_FRACTION = 0.8
OLLAMA_MAX_LOADED_PER_GPU = 3
OLLAMA_MAX_QUEUE = 512


class _Free:
    """Free bytes per card as nvidia-smi shows them, less what this step already loaded."""

    def __init__(self, cards: CardView) -> None:
        self.cards = cards
        self.committed: dict[str, int] = {}

    def __getitem__(self, accelerator: str) -> int:
        return self.cards.free_bytes(accelerator) - self.committed.get(accelerator, 0)

    def __setitem__(self, accelerator: str, value: int) -> None:
        self.committed[accelerator] = self.cards.free_bytes(accelerator) - value


@dataclass
class _Runner:
    key: str
    deployment: Deployment
    accelerator: str
    bytes: int
    keep_alive_s: float
    ready: bool = False
    unloading: bool = False
    active: int = 0
    backlog: deque[int] = field(default_factory=deque)
    last_used: float = 0.0
    idle_since: float = 0.0

    @property
    def idle(self) -> bool:
        return self.ready and not self.unloading and self.active == 0 and not self.backlog


class _Baseline:
    name = "baseline"

    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.catalog = scenario.catalog
        self.accelerators = [a.id for a in scenario.catalog.accelerators if a.kind == "gpu"]
        self.largest = max((a.total_bytes for a in scenario.catalog.accelerators), default=0)
        self.pending: deque[SimRequest] = deque()
        self.runners: dict[str, _Runner] = {}
        self.by_deployment: dict[str, list[_Runner]] = {}
        self.lease_of: dict[str, tuple[str, int]] = {}
        self.counter = 0
        self.unloading = 0
        # Kept as the runners change, so a step costs what changed, not the size of the cluster.
        self.idle: dict[str, _Runner] = {}
        self.with_backlog: dict[str, _Runner] = {}
        self.loaded_on: dict[str, int] = {}

    def _touch(self, runner: _Runner) -> None:
        if runner.idle:
            self.idle[runner.key] = runner
        else:
            self.idle.pop(runner.key, None)
        if runner.backlog and not runner.unloading:
            self.with_backlog[runner.key] = runner
        else:
            self.with_backlog.pop(runner.key, None)

    # --- the seam ----------------------------------------------------------------------------
    def submit(self, request: SimRequest, now: float) -> Refuse | None:
        deployment = self.catalog.deployment_for(request.capability)
        if deployment is None:
            return Refuse(request.index, FailureClass.CAPABILITY_UNAVAILABLE, f"no deployment for {request.capability}")
        if deployment.gpu_count > 1:
            return Refuse(
                request.index,
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"{self.name} places single-GPU work only (gpu_count={deployment.gpu_count})",
            )
        if deployment.envelope_bytes > self.largest:
            return Refuse(
                request.index,
                FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
                f"{deployment.envelope_bytes} B exceeds every card",
            )
        refusal = self._queue_full(request)
        if refusal is not None:
            return refusal
        self.pending.append(request)
        return None

    def step(self, now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        actions = Actions()
        self._expire(now, actions)
        free = _Free(cards)
        while self.pending:
            request = self.pending[0]
            deployment = self.catalog.deployment_for(request.capability)
            assert deployment is not None
            if deployment.gpu_count > 1:
                # A multi-GPU job starts whole or blocks the queue (only `fifo-gang` takes one).
                if not self._start_gang(request, deployment, free, actions):
                    break
                self.pending.popleft()
                continue
            runner = self._runner_for(deployment)
            if runner is not None:
                runner.backlog.append(request.index)
                self._touch(runner)
                self.pending.popleft()
                continue
            accelerator = self._where_to_load(deployment, free)
            if accelerator is None:
                self._make_room(deployment, free, actions, now)
                break
            self.pending.popleft()
            runner = self._load(deployment, accelerator, actions)
            free[accelerator] -= runner.bytes
            runner.backlog.append(request.index)
            self._touch(runner)
        for runner in list(self.with_backlog.values()):
            while runner.ready and runner.backlog and runner.active < runner.deployment.concurrency:
                index = runner.backlog.popleft()
                self.counter += 1
                lease_id = f"{self.name}-{self.counter}"
                self.lease_of[lease_id] = (runner.key, index)
                runner.active += 1
                runner.last_used = now
                actions.starts.append(Start(index, lease_id, runner.accelerator, runner.key, 0))
            self._touch(runner)
        return actions

    def loaded(self, key: str, now: float) -> None:
        runner = self.runners.get(key)
        if runner is not None:
            runner.ready = True
            runner.last_used = runner.idle_since = now
            self._touch(runner)

    def unloaded(self, key: str, now: float) -> None:
        runner = self.runners.pop(key, None)
        if runner is not None:
            self.unloading -= 1
            self.by_deployment[runner.deployment.deployment_id].remove(runner)
            self.idle.pop(key, None)
            self.with_backlog.pop(key, None)

    def slept(self, key: str, kept_bytes: int, now: float) -> None:
        raise AssertionError(f"{self.name} never puts a model to sleep ({key})")

    def woke(self, key: str, now: float) -> None:
        raise AssertionError(f"{self.name} never wakes a model ({key})")

    def finished(self, lease_id: str, now: float, outcome: str) -> None:
        key, _ = self.lease_of.pop(lease_id)
        runner = self.runners[key]
        runner.active -= 1
        runner.last_used = now
        if runner.active == 0 and not runner.backlog:
            runner.idle_since = now
        self._touch(runner)

    def checkpointed(self, lease_id: str, request: SimRequest, now: float) -> None:
        raise AssertionError(f"{self.name} never preempts")

    def catalog_changed(self, catalog: Catalog, now: float) -> None:
        # Requests are judged by the deployments in force; runners already loaded keep running.
        self.catalog = catalog

    def next_wakeup(self, now: float) -> float | None:
        wake = math.inf
        for runner in self.idle.values():
            if math.isfinite(runner.keep_alive_s) and runner.keep_alive_s > 0:
                wake = min(wake, runner.idle_since + runner.keep_alive_s)
        return None if math.isinf(wake) else wake

    # --- shared mechanics --------------------------------------------------------------------
    def _queue_full(self, request: SimRequest) -> Refuse | None:
        return None

    def _keep_alive(self, deployment: Deployment) -> float:
        return 0.0 if deployment.residency == Residency.NONE else math.inf

    def _runner_for(self, deployment: Deployment) -> _Runner | None:
        if deployment.residency == Residency.NONE:
            return None  # a batch job is its own process
        for runner in self.by_deployment.get(deployment.deployment_id, []):
            if not runner.unloading:
                return runner
        return None

    def _load(self, deployment: Deployment, accelerator: str, actions: Actions) -> _Runner:
        self.counter += 1
        key = f"{deployment.deployment_id}@{accelerator}#{self.counter}"
        runner = _Runner(key, deployment, accelerator, deployment.envelope_bytes, self._keep_alive(deployment))
        self.runners[key] = runner
        self.by_deployment.setdefault(deployment.deployment_id, []).append(runner)
        self.loaded_on[accelerator] = self.loaded_on.get(accelerator, 0) + 1
        actions.loads.append(Load(key, deployment.deployment_id, accelerator, runner.bytes))
        return runner

    def _unload(self, runner: _Runner, actions: Actions, eviction: bool) -> None:
        runner.unloading = True
        self.unloading += 1
        self.loaded_on[runner.accelerator] -= 1
        self._touch(runner)
        actions.unloads.append((runner.key, eviction))

    def _expire(self, now: float, actions: Actions) -> None:
        for runner in list(self.idle.values()):
            if now >= runner.idle_since + runner.keep_alive_s:
                self._unload(runner, actions, eviction=False)

    def _where_to_load(self, deployment: Deployment, free: _Free) -> str | None:
        raise NotImplementedError

    def _start_gang(self, request: SimRequest, deployment: Deployment, free: _Free, actions: Actions) -> bool:
        raise AssertionError(f"{self.name} refuses multi-GPU work at submission ({request.request_id})")

    def _make_room(self, deployment: Deployment, free: _Free, actions: Actions, now: float) -> None:
        raise NotImplementedError


class FifoScheduler(_Baseline):
    name = "fifo"

    def _where_to_load(self, deployment: Deployment, free: _Free) -> str | None:
        best: tuple[int, str] | None = None
        for accelerator in self.accelerators:
            room = free[accelerator]
            if deployment.envelope_bytes <= room and (best is None or room > best[0]):
                best = (room, accelerator)
        return None if best is None else best[1]

    def _make_room(self, deployment: Deployment, free: _Free, actions: Actions, now: float) -> None:
        if self.unloading:
            return  # room is on its way; decide again when it is back
        idle_on: dict[str, list[_Runner]] = {}
        for runner in self.idle.values():
            idle_on.setdefault(runner.accelerator, []).append(runner)
        for accelerator in self.accelerators:
            idle = sorted(idle_on.get(accelerator, []), key=lambda r: (r.last_used, r.key))
            room = free[accelerator]
            chosen = []
            for runner in idle:
                if room >= deployment.envelope_bytes:
                    break
                chosen.append(runner)
                room += runner.bytes
            if room >= deployment.envelope_bytes and chosen:
                for runner in chosen:
                    self._unload(runner, actions, eviction=True)
                return


class OllamaScheduler(_Baseline):
    name = "ollama"

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.overhead = scenario.config.ollama_overhead_bytes

    def _queue_full(self, request: SimRequest) -> Refuse | None:
        if len(self.pending) >= OLLAMA_MAX_QUEUE:
            return Refuse(request.index, FailureClass.QUEUE_FULL, f"{OLLAMA_MAX_QUEUE} requests already queued")
        return None

    def _keep_alive(self, deployment: Deployment) -> float:
        if deployment.residency == Residency.ALWAYS_WARM:
            return math.inf
        if deployment.residency == Residency.KEEP_WARM:
            return deployment.ttl_s
        if deployment.residency == Residency.LOAD_ON_DEMAND or deployment.residency == Residency.NONE:
            return 0.0
        return OLLAMA_DEFAULT_KEEP_ALIVE_S

    def _loaded_on(self, accelerator: str) -> int:
        return self.loaded_on.get(accelerator, 0)

    def _where_to_load(self, deployment: Deployment, free: _Free) -> str | None:
        best: tuple[int, str] | None = None
        for accelerator in self.accelerators:
            if self._loaded_on(accelerator) >= OLLAMA_MAX_LOADED_PER_GPU:
                continue
            available = free[accelerator] - self.overhead
            if deployment.envelope_bytes <= OLLAMA_FIT_FRACTION * available and (best is None or available > best[0]):
                best = (available, accelerator)
        if best is None:
            # A model too big for the 80% rule still loads on a GPU with nothing else loaded
            # (Ollama offloads what does not fit; the simulator keeps it on the card).
            for accelerator in self.accelerators:
                available = free[accelerator] - self.overhead
                if self._loaded_on(accelerator) == 0 and deployment.envelope_bytes <= available:
                    return accelerator
        return None if best is None else best[1]

    def _make_room(self, deployment: Deployment, free: _Free, actions: Actions, now: float) -> None:
        if self.unloading:
            return
        # findRunnerToUnload: runners by keep-alive, shortest first; the first idle one goes.
        for runner in sorted(self.idle.values(), key=lambda r: (r.keep_alive_s, r.key)):
            self._unload(runner, actions, eviction=True)
            return


class GangFifoScheduler(FifoScheduler):
    """`fifo` that also runs multi-GPU jobs (the module's docstring says how)."""

    name = "fifo-gang"

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        # Each node's GPU cards in catalog order, and each card's memory in all.
        self.node_cards: dict[str, list[str]] = {}
        self.total: dict[str, int] = {}
        for accelerator in scenario.catalog.accelerators:
            if accelerator.kind == "gpu":
                self.node_cards.setdefault(accelerator.node, []).append(accelerator.id)
                self.total[accelerator.id] = accelerator.total_bytes
        self.node_of = {card: node for node, cards in self.node_cards.items() for card in cards}
        self.position = {node: n for n, node in enumerate(self.node_cards)}
        self.gang_leases: dict[str, bool] = {}
        # The job at the head of the queue that found no node with room (its index), and the
        # cards whose memory changed since: only their nodes can have room for it now, since
        # every other card's memory only went (a whole cluster is not searched on every step).
        self.no_room: int | None = None
        self.changed: dict[str, bool] = {}

    def step(self, now: float, cards: CardView, touched: dict[str, bool]) -> Actions:
        if self.no_room is not None:
            self.changed.update(touched)
        return super().step(now, cards, touched)

    def submit(self, request: SimRequest, now: float) -> Refuse | None:
        deployment = self.catalog.deployment_for(request.capability)
        if deployment is None or deployment.gpu_count <= 1:
            return super().submit(request, now)
        need, count = deployment.envelope_bytes, deployment.gpu_count
        if not any(sum(self.total[c] >= need for c in cards) >= count for cards in self.node_cards.values()):
            return Refuse(
                request.index,
                FailureClass.INSUFFICIENT_SCHEDULABLE_VRAM,
                f"no node has {count} cards of {need} B or more",
            )
        self.pending.append(request)
        return None

    def _start_gang(self, request: SimRequest, deployment: Deployment, free: _Free, actions: Actions) -> bool:
        chosen = self._gang_cards(request, deployment, free)
        if chosen is None:
            self._make_gang_room(deployment, free, actions)
            return False
        need = deployment.envelope_bytes
        for card in chosen:
            free[card] -= need
        self.counter += 1
        lease_id = f"{self.name}-{self.counter}"
        self.gang_leases[lease_id] = True
        actions.starts.append(Start(request.index, lease_id, chosen[0], "", need, tuple(chosen[1:])))
        return True

    def _gang_cards(self, request: SimRequest, deployment: Deployment, free: _Free) -> list[str] | None:
        """The cards of the node whose `gpu_count`-th roomiest card has the most room (the first
        listed among equals), or None."""
        need, count = deployment.envelope_bytes, deployment.gpu_count
        nodes: Iterable[str] = self.node_cards
        if self.no_room == request.index:
            nodes = sorted({self.node_of[c] for c in self.changed if c in self.node_of}, key=self.position.__getitem__)
        self.changed = {}
        best: tuple[int, list[str]] | None = None
        for node in nodes:
            node_cards = self.node_cards[node]
            roomy = sorted((c for c in node_cards if free[c] >= need), key=lambda c: (-free[c], c))[:count]
            if len(roomy) == count and (best is None or free[roomy[-1]] > best[0]):
                best = (free[roomy[-1]], roomy)
        self.no_room = request.index if best is None else None
        return None if best is None else best[1]

    def _make_gang_room(self, deployment: Deployment, free: _Free, actions: Actions) -> None:
        if self.unloading or not self.idle:
            return  # room is on its way (decide again when it is back), or nothing may go
        need, count = deployment.envelope_bytes, deployment.gpu_count
        idle_on: dict[str, list[_Runner]] = {}
        for runner in self.idle.values():
            idle_on.setdefault(runner.accelerator, []).append(runner)
        for node_cards in self.node_cards.values():
            # Per card, the least recently used idle models whose going makes room for the job.
            plans: list[tuple[int, str, list[_Runner]]] = []
            for card in node_cards:
                room, chosen = free[card], []
                for runner in sorted(idle_on.get(card, []), key=lambda r: (r.last_used, r.key)):
                    if room >= need:
                        break
                    chosen.append(runner)
                    room += runner.bytes
                if room >= need:
                    plans.append((len(chosen), card, chosen))
            if len(plans) >= count:
                for _, _, chosen in sorted(plans, key=lambda plan: (plan[0], plan[1]))[:count]:
                    for runner in chosen:
                        self._unload(runner, actions, eviction=True)
                return

    def finished(self, lease_id: str, now: float, outcome: str) -> None:
        if self.gang_leases.pop(lease_id, None) is None:
            super().finished(lease_id, now, outcome)
