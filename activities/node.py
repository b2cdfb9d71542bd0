"""Activities of a node worker: NVML sampling and the model runtimes of one GPU host."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError

from activities import _stream_push as stream_push
from activities._delegation import NodeSlots, PoolSlots
from activities._invoke_journal import InvokeJournal
from activities._invoke_outcomes import InvokeOutcomes
from activities._profile import run_profile
from modelforge.domain import Deployment, Observation, ProcessUsage
from modelforge.events import EventRecord
from modelforge.failures import FailureClass, ModelForgeError, is_retryable
from modelforge.gpu import CPU_DEVICE_INDEX, DeviceSample, GpuBackend
from modelforge.logging import get_logger
from modelforge.messages import (
    NO_INVOKE_RECORD,
    OPERATIONS,
    PROFILE_OPERATION,
    RESUME_KEY,
    CheckpointInput,
    CollectInvokeInput,
    GangCheckpointInput,
    GangJobInput,
    InvokeInput,
    InvokeResult,
    LeaseHeartbeat,
    LoadInput,
    LoadResult,
    NodeSample,
    ReclaimInput,
    ReclaimResult,
    ReleaseSignal,
    RuntimeOpResult,
    client_input_problem,
    device_index,
)
from modelforge.payloads import payload_store, put_output
from modelforge.runtimes import LoadedModel, Runtime, check_artifact, process_tree, rss_bytes
from modelforge.settings import CONTROL_TASK_QUEUE

log = get_logger("modelforge.node")


def as_application_error(error: ModelForgeError) -> ApplicationError:
    return ApplicationError(error.message, type=error.failure.value, non_retryable=not is_retryable(error.failure))


# A load heartbeats its activity this often while it waits for its (shared) load's task (the
# activity's heartbeat timeout is 30 s).
LOAD_WAIT_HEARTBEAT_S = 5.0
# How often a load's caller looks for its runtime's progress to pass on.
LOAD_PROGRESS_POLL_S = 0.2


def _heartbeat(detail: str) -> None:
    if activity.in_activity():
        activity.heartbeat(detail)


def _safe_name(text: str, default: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "_", text)[:200] or default


def _run_scope() -> str:
    """The request workflow run this activity serves (a server-made id no client chooses): the
    checkpoints of a request are kept, and resumed from, under it. "" outside an activity."""
    if not activity.in_activity():
        return ""
    return _safe_name(activity.info().workflow_run_id or "", "")


def _client_payload(payload: dict[str, Any], allowed: tuple[str, ...] = ()) -> dict[str, Any]:
    """A request's input as the node takes it: `modelforge_*` keys are the node's and the
    scheduler's own, so one in the input is refused (the client, gateway and request workflow
    refuse them first; this is the node's own check). `allowed`: keys older request workflow
    code still puts there (the resume location, checked on its own)."""
    taken = {key: value for key, value in payload.items() if key not in allowed}
    problem = client_input_problem(taken)
    if problem is not None:
        raise ModelForgeError(FailureClass.REQUEST_INVALID, problem)
    return taken


def _redacted_command(command: list[str]) -> list[str]:
    """A server's argument list for an envelope's record, without the value of an option that
    looks like a credential (`--api-key X`, `--hf-token=X`)."""
    secret = re.compile(r"^--?[A-Za-z0-9_-]*(token|key|secret|passw(or)?d|credential)[A-Za-z0-9_-]*", re.IGNORECASE)
    shown: list[str] = []
    hide_next = False
    for argument in command:
        if hide_next:
            shown.append("<redacted>")
            hide_next = False
        elif secret.match(argument):
            if "=" in argument:
                shown.append(argument.split("=", 1)[0] + "=<redacted>")
            else:
                shown.append(argument)
                hide_next = True
        else:
            shown.append(argument)
    return shown


class NodeActivities:
    """One per node worker. `runtimes` maps a catalog runtime name to its adapter."""

    def __init__(
        self,
        node: str,
        backend: GpuBackend,
        runtimes: dict[str, Runtime],
        clock: Callable[[], float] = time.time,
        client: Client | None = None,
        artifact_roots: list[Path] | None = None,
        labels: dict[str, str] | None = None,
        checkpoint_root: Path | None = None,
        request_queue: str = "",
        slots: NodeSlots | PoolSlots | None = None,
        journal: InvokeJournal | None = None,
    ) -> None:
        """`labels`: what this node advertises for all its accelerators (`rack_id`,
        `network_bandwidth_gbps`, from its configuration); `nvlink_group_id` comes from NVML.
        `request_queue`: this node's worker runs request workflows there too (invoke results name
        it, so clients route later requests for the capability to it). `journal`: the invokes
        running here, on disk, for a restarted worker to fail (activities/_invoke_journal.py)."""
        self._slots = slots  # lent by the scheduler for warm requests (activities/_delegation.py)
        self._labels = dict(labels or {})
        self._request_queue = request_queue
        self._checkpoint_root = checkpoint_root
        self._client = client
        self._artifact_roots = artifact_roots or []
        self._node = node
        self._backend = backend
        self._runtimes = runtimes
        self._loaded: dict[str, tuple[Runtime, LoadedModel]] = {}
        # Loads under way, by resident key, and each one's latest progress: one load of a key at
        # a time, shared by every caller (`load_model`).
        self._loading: dict[str, asyncio.Future[LoadResult]] = {}
        self._load_progress: dict[str, list[str]] = {}
        self._deployments: dict[str, Deployment] = {}
        # Processes of unloaded models, until their memory is seen gone (verify_reclaim).
        self._unloaded_pids: dict[str, set[int]] = {}
        # The runtime of each gang job part running here, by (lease id, rank): for its checkpoint.
        self._jobs: dict[tuple[str, int], Runtime] = {}
        self._outcomes = InvokeOutcomes()  # each invoke's, kept a while after it ends
        self._journal = journal or InvokeJournal(None)
        self._clock = clock

    def _runtime(self, name: str) -> Runtime:
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise ApplicationError(
                f"node {self._node} has no {name!r} runtime",
                type=FailureClass.CAPABILITY_UNAVAILABLE.value,
                non_retryable=True,
            )
        return runtime

    @activity.defn(name="sample_node")
    async def sample_node(self, node: str) -> NodeSample:
        try:
            devices = await asyncio.to_thread(self._backend.sample)
        except ModelForgeError as error:
            raise as_application_error(error) from None
        managed = self._managed_pids()
        observed_at = self._clock()
        observations = []
        for device in devices:
            accelerator = f"{self._node}/{'cpu' if device.index == CPU_DEVICE_INDEX else device.index}"
            observations.append(
                Observation(
                    accelerator=accelerator,
                    total_bytes=device.total_bytes,
                    used_bytes=device.used_bytes,
                    processes=[
                        ProcessUsage(p.pid, p.used_bytes, p.name, managed=p.pid in managed) for p in device.processes
                    ],
                    loaded=sorted(
                        key for key, (_, model) in self._loaded.items() if model.device_index == device.index
                    ),
                    healthy=device.healthy,
                    health_reason=device.health_reason,
                    utilization_pct=device.utilization_pct,
                    temperature_c=device.temperature_c,
                    labels=self._device_labels(device),
                    observed_at=observed_at,
                    # The host CPU device is read from the host itself, never simulated.
                    simulated=self._backend.label == "simulated" and device.index != CPU_DEVICE_INDEX,
                )
            )
        return NodeSample(node=self._node, observations=observations, backend=self._backend.label)

    def _device_labels(self, device: DeviceSample) -> dict[str, str]:
        labels = dict(self._labels)
        # Only a real card's topology is authoritative: a simulated one has none to tell.
        if self._backend.label == "nvml" and device.index != CPU_DEVICE_INDEX:
            labels["nvlink_group_id"] = device.nvlink_group
        return labels

    def _managed_pids(self) -> set[int]:
        """ModelForge's processes: each loaded model's process and what it forked (a server's
        workers hold GPU memory too). The worker's own pid when a model runs inside it."""
        pids: set[int] = set()
        for _, model in self._loaded.values():
            pids |= process_tree(model.pid) if model.owns_process else {model.pid}
        for runtime in self._runtimes.values():
            running = getattr(runtime, "running_pids", None)  # a job runtime's running jobs
            if running is not None:
                pids |= running()
        return pids

    @activity.defn(name="load_model")
    async def load_model(self, request: LoadInput) -> LoadResult:
        runtime = self._runtime(request.deployment.runtime)
        key = request.key
        if key in self._loaded:
            _, existing = self._loaded[key]
            return LoadResult(existing.measured_bytes, existing.load_s, existing.pid)
        # One load of a key at a time, shared by every caller (a scheduler reset past a load
        # decides it again under another residency): never a second copy on the card. The load
        # runs as a task of its own, so a caller cancelled (its heartbeat timed out) stops
        # waiting, not the load (a runtime's thread would go on loading beside a second one).
        # Each caller heartbeats its own activity with the load's latest progress.
        loading = self._loading.get(key)
        if loading is None:
            progress = self._load_progress[key] = [f"loading {key}"]
            loading = self._loading[key] = asyncio.ensure_future(
                self._load(runtime, request, lambda detail: progress.__setitem__(0, detail))
            )

            def done(task: asyncio.Future[LoadResult]) -> None:
                self._loading.pop(key, None)
                self._load_progress.pop(key, None)
                if not task.cancelled():
                    task.exception()  # retrieved: its callers raise it, if any still wait

            loading.add_done_callback(done)
        progress = self._load_progress.get(key, [f"loading {key}"])
        clock = asyncio.get_running_loop().time
        told, told_at = "", 0.0
        while not loading.done():
            # The runtime's progress as it comes (a request shows it while it waits), and at
            # least every LOAD_WAIT_HEARTBEAT_S.
            if progress[0] != told or clock() - told_at >= LOAD_WAIT_HEARTBEAT_S:
                told, told_at = progress[0], clock()
                _heartbeat(told)
            await asyncio.wait({loading}, timeout=LOAD_PROGRESS_POLL_S)
        return loading.result()

    async def _load(self, runtime: Runtime, request: LoadInput, heartbeat: Callable[[str], None]) -> LoadResult:
        try:
            deployment = request.deployment
            checked = None
            if deployment.artifact:
                # Before any runtime sees it: resolved once to its real path inside the roots,
                # hashed from open descriptors; the runtime is handed that real path (never the
                # catalog's relative one, which it would open against its own working directory).
                checked = await asyncio.to_thread(
                    check_artifact, deployment.artifact, self._artifact_roots, deployment.artifact_sha256
                )
                deployment = dataclasses.replace(deployment, artifact=str(checked.path))
            model = await runtime.load(request.key, deployment, request.device_index, request.device_uuid, heartbeat)
            if checked is not None:
                # What the runtime opened is what was checked: no file swapped or rewritten since.
                try:
                    await asyncio.to_thread(checked.verify_unchanged)
                except ModelForgeError:
                    await runtime.unload(model)
                    raise
        except ModelForgeError as error:
            log.warning("load_failed", key=request.key, failure=error.failure.value, message=error.message)
            raise as_application_error(error) from None
        self._loaded[request.key] = (runtime, model)
        self._deployments[request.key] = request.deployment
        log.info("model_loaded", key=request.key, bytes=model.measured_bytes, load_s=round(model.load_s, 3))
        return LoadResult(model.measured_bytes, model.load_s, model.pid)

    def serves(self, key: str) -> bool:
        """Whether the resident `key` is loaded in this worker (a lent slot on it may be claimed)."""
        return key in self._loaded

    def _model(self, key: str) -> tuple[Runtime, LoadedModel]:
        entry = self._loaded.get(key)
        if entry is None:
            # The worker restarted or the model died: the scheduler reconciles from NVML samples.
            raise ApplicationError(
                f"{key} is not loaded on node {self._node}", type=FailureClass.RUNTIME_CRASH.value, non_retryable=True
            )
        return entry

    @activity.defn(name="health_check")
    async def health_check(self, key: str) -> None:
        runtime, model = self._model(key)
        try:
            await runtime.health_check(model)
        except ModelForgeError as error:
            raise ApplicationError(
                error.message, type=FailureClass.HEALTHCHECK_FAILED.value, non_retryable=True
            ) from None

    @activity.defn(name="invoke")
    async def invoke(self, request: InvokeInput) -> InvokeResult:
        lease_id, request_id = request.lease_id, request.request_id
        self._outcomes.begin(lease_id, request_id)
        info = activity.info()
        running = self._journal.begin(lease_id, request_id, info.task_token, info.workflow_id or "")
        try:
            result = await (self._invoke_on_slot(request) if request.delegated else self._invoke(request))
        except ApplicationError as error:
            failure = (error.type or FailureClass.RUNTIME_CRASH.value, error.message, error.non_retryable)
            self._outcomes.end(lease_id, request_id, failure=failure)
            raise
        except asyncio.CancelledError:
            self._outcomes.end(lease_id, request_id, cancelled=True)
            raise
        except BaseException as error:
            crash = (FailureClass.RUNTIME_CRASH.value, f"{type(error).__name__}: {error}", True)
            self._outcomes.end(lease_id, request_id, failure=crash)
            raise
        finally:
            self._journal.end(running)
        self._outcomes.end(lease_id, request_id, result=result)
        return result

    @activity.defn(name="collect_invoke")
    async def collect_invoke(self, call: CollectInvokeInput) -> InvokeResult:
        """The outcome of an invoke this node ran whose end the request workflow never heard
        (activities/_invoke_outcomes.py): its result, or its failure again; waited for while it
        still runs. NO_INVOKE_RECORD when this node never ran it, or was restarted since."""
        outcome = self._outcomes.find(call.lease_id, call.request_id)
        if outcome is None:
            raise ApplicationError(
                f"node {self._node} has no record of the invoke of lease {call.lease_id}"
                " (it never ran here, the node restarted since, or it ended long ago)",
                type=NO_INVOKE_RECORD,
                non_retryable=True,
            )
        while not outcome.ended.is_set():
            _heartbeat("the invoke still runs")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(outcome.ended.wait(), timeout=5.0)
        if outcome.result is not None:
            return outcome.result
        if outcome.cancelled:
            # Stopped here once Temporal told its worker the invoke had timed out: it never
            # finished, as its TIMEOUT says.
            raise ApplicationError(
                f"the invoke of lease {call.lease_id} was stopped on node {self._node} after its heartbeat timed out",
                type=FailureClass.TIMEOUT.value,
                non_retryable=True,
            )
        cls, message, non_retryable = outcome.failure or (FailureClass.RUNTIME_CRASH.value, "no answer", True)
        raise ApplicationError(message, type=cls, non_retryable=non_retryable)

    async def _invoke_on_slot(self, request: InvokeInput) -> InvokeResult:
        # On a slot this node was lent: started only if the claim is still this request's, and
        # reported (not released) when done, the slot free for the next request.
        slots = self._slots
        if slots is None or not slots.started(request.lease_id, request.request_id):
            raise ApplicationError(
                f"the slot {request.lease_id} is no longer this request's (its claim expired)",
                type=FailureClass.LEASE_CONFLICT.value,
                non_retryable=True,
            )
        started = time.monotonic()
        outcome, message = "ok", ""
        try:
            return await self._invoke(request)
        except ApplicationError as error:
            outcome, message = error.type or FailureClass.RUNTIME_CRASH.value, error.message
            raise
        except asyncio.CancelledError:
            outcome, message = "cancelled", "the invoke was cancelled (preempted, or its request ended)"
            raise
        except Exception as error:
            outcome, message = FailureClass.RUNTIME_CRASH.value, str(error)
            raise
        finally:
            slots.finish(request.lease_id, request.request_id, outcome, time.monotonic() - started, message)

    async def _invoke(self, request: InvokeInput) -> InvokeResult:
        # At once: a heartbeat timeout with no heartbeat then means this node never ran it.
        _heartbeat("started")
        runtime, model = self._model(request.key)
        started = time.monotonic()
        try:
            if request.operation not in OPERATIONS:
                why = f"unknown node operation {request.operation[:60]!r}"
                raise ModelForgeError(FailureClass.REQUEST_INVALID, why)
            self._check_holder(request.release_to, request.heartbeat_s)
            # The operation and the resume location come from the activity's own fields, set by
            # the request workflow; a client's input never chooses either.
            legacy_resume = request.payload.get(RESUME_KEY)
            payload = _client_payload(request.payload, allowed=(RESUME_KEY,))
            if request.operation == PROFILE_OPERATION:
                output = await self._profile(runtime, model, payload)
            else:
                resume = self._check_resume(request.resume_from or legacy_resume, request.request_id)
                # The lease names the invocation for a checkpoint taken while it runs.
                payload["modelforge_lease_id"] = request.lease_id
                if getattr(runtime, "job_runtime", False):
                    payload.update(self._job_context(request.request_id))
                if resume:
                    payload[RESUME_KEY] = resume
                async with self._vouching(
                    request.lease_id, request.request_id, request.release_to, request.heartbeat_s
                ):
                    if request.stream is not None:
                        output = await stream_push.push(request.stream, _stream_of(runtime, model, payload))
                    else:
                        output = await runtime.invoke(model, payload, _heartbeat)
        except ModelForgeError as error:
            raise as_application_error(error) from None
        invoke_s = time.monotonic() - started
        store = payload_store(self._client)
        if store is not None and _may_be_large(output):
            # A large answer goes by reference (modelforge/payloads.py, put_output), encoded off
            # the event loop; a small one (most) costs no thread hop and no encoding here.
            output = await asyncio.to_thread(put_output, store, output)
        released = request.delegated  # its node reports it in the next sync
        if self._client is not None and not request.delegated:
            try:
                await self._client.get_workflow_handle(request.release_to).signal(
                    "release",
                    ReleaseSignal(
                        lease_id=request.lease_id,
                        request_id=request.request_id,
                        outcome="ok",
                        invoke_s=invoke_s,
                        ended_at=time.time(),
                    ),
                )
                released = True
            except RPCError as error:  # the workflow releases instead: nothing is lost, only slower
                log.warning("release_from_node_failed", lease_id=request.lease_id, error=str(error))
        return InvokeResult(output=output, invoke_s=invoke_s, released=released, route=self._request_queue)

    def _job_context(self, request_id: str, name: str = "job") -> dict[str, Any]:
        """What a job runtime's invoke is told besides the input: its request, the request
        workflow's run, its own checkpoint directory in the store
        (`<store>/<request id>/<name>/<run>`, `job` or a gang rank's `job-rank<r>`, where a resume
        location of this run may lie) and the seconds left before its max_duration."""
        context: dict[str, Any] = {"modelforge_request_id": request_id, "modelforge_run_id": _run_scope()}
        if self._checkpoint_root is not None:
            context["modelforge_checkpoint_dir"] = str(self._checkpoint_destination(request_id, name))
        if activity.in_activity():
            info = activity.info()
            if info.schedule_to_close_timeout:
                ends = info.scheduled_time + info.schedule_to_close_timeout
                context["modelforge_time_left_s"] = max(0.0, ends.timestamp() - time.time())
        return context

    def _check_holder(self, scheduler_id: str, heartbeat_s: float) -> None:
        """A request workflow's invoke or gang job names the scheduler its lease is released to
        and heartbeated at, and how often: one that does not is refused, not run unvouched.
        Outside Temporal (no client: scripts/gpu_check.py) there is no scheduler to name."""
        if self._client is not None and not (scheduler_id and heartbeat_s > 0):
            raise ModelForgeError(
                FailureClass.REQUEST_INVALID,
                "an invoke or gang job names its lease's scheduler (release_to) and heartbeat (heartbeat_s > 0)",
            )

    @contextlib.asynccontextmanager
    async def _vouching(
        self, lease_id: str, request_id: str, scheduler_id: str, heartbeat_s: float
    ) -> AsyncIterator[None]:
        """While the invoke (or this node's part of a gang job) runs, heartbeat its lease to the
        scheduler from here, where the memory is used: its holder's heartbeats stop while the
        holder's worker is away, this node's do not (and when this node dies, so does the work)."""
        if self._client is None:  # run outside Temporal (scripts/gpu_check.py): no scheduler to tell
            yield
            return
        scheduler = self._client.get_workflow_handle(scheduler_id)
        beat_of = LeaseHeartbeat(
            lease_id=lease_id,
            request_id=request_id,
            holder=(activity.info().workflow_id or "") if activity.in_activity() else "",
        )

        async def beat() -> None:
            while True:
                await asyncio.sleep(heartbeat_s)
                try:
                    await scheduler.signal("lease_heartbeat", beat_of)
                except RPCError as error:  # the holder's own heartbeats still count
                    log.warning("lease_heartbeat_failed", lease_id=lease_id, error=str(error))

        beating = asyncio.create_task(beat())
        try:
            yield
        finally:
            beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beating

    @activity.defn(name="run_gang_job")
    async def run_gang_job(self, job: GangJobInput) -> InvokeResult:
        """This node's part of a multi-GPU batch job: the deployment's runtime runs it on the
        leased cards of this node, holding the job's bytes on each while it runs."""
        runtime = self._runtimes.get(job.deployment.runtime)
        mine = job.accelerators  # the request workflow sends each node its own cards
        if runtime is None:
            raise ApplicationError(
                f"node {self._node} has no {job.deployment.runtime} runtime",
                type=FailureClass.CAPABILITY_UNAVAILABLE.value,
                non_retryable=True,
            )
        started = time.monotonic()
        self._jobs[(job.lease_id, job.rank)] = runtime
        try:
            self._check_holder(job.release_to, job.heartbeat_s)
            payload = _client_payload(job.payload, allowed=(RESUME_KEY,))
            resume = self._check_resume(job.resume_from or job.payload.get(RESUME_KEY), job.request_id)
            payload.update(modelforge_lease_id=job.lease_id, modelforge_rank=job.rank)
            if getattr(runtime, "job_runtime", False):
                payload.update(self._job_context(job.request_id, f"job-rank{job.rank}"))
                payload["modelforge_world_size"] = job.world_size
                if self._checkpoint_root is not None:
                    # Rank 0 publishes the gang's MASTER_ADDR/PORT here; the store is the nodes' shared one.
                    rendezvous = self._checkpoint_destination(job.request_id, "job-rendezvous")
                    payload["modelforge_rendezvous"] = str(rendezvous / f"{_safe_name(job.lease_id, 'lease')}.json")
            if resume:
                payload[RESUME_KEY] = resume
            async with self._vouching(job.lease_id, job.request_id, job.release_to, job.heartbeat_s):
                output = await runtime.run_job(job.deployment, [device_index(a) for a in mine], payload, _heartbeat)
        except ModelForgeError as error:
            raise as_application_error(error) from None
        finally:
            self._jobs.pop((job.lease_id, job.rank), None)
        return InvokeResult(output=output, invoke_s=time.monotonic() - started)

    @activity.defn(name="checkpoint_gang_job")
    async def checkpoint_gang_job(self, request: GangCheckpointInput) -> RuntimeOpResult:
        """Save this node's part of a running gang job into the checkpoint store; returns its
        location, which the rank resumes from when the job's lease comes back."""
        key = f"{request.lease_id} rank {request.rank}"
        runtime = self._jobs.get((request.lease_id, request.rank))
        try:
            if self._checkpoint_root is None:
                raise ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"node {self._node} has no checkpoint store")
            if runtime is None:
                raise ModelForgeError(FailureClass.REQUEST_INVALID, f"no gang job {key} runs on node {self._node}")
            destination = self._checkpoint_destination(request.request_id, f"{request.preemption}-rank{request.rank}")
            started = time.monotonic()
            try:
                location = await runtime.checkpoint_job(request.lease_id, request.rank, str(destination))
            finally:
                await self._record_job_preemption(
                    runtime, f"{request.lease_id}#rank{request.rank}", request.request_id, request.lease_id, "", ""
                )
        except ModelForgeError as error:
            raise as_application_error(error) from None
        seconds = time.monotonic() - started
        log.info("gang_job_checkpoint", key=key, seconds=round(seconds, 3))
        return RuntimeOpResult(key, "checkpoint", seconds, location=location)

    async def _profile(self, runtime: Runtime, model: LoadedModel, spec: dict[str, Any]) -> dict[str, Any]:
        deployment = self._deployments.get(model.resident_key)
        chat = deployment is not None and deployment.runtime_config.get("api") == "openai_chat"
        on_cpu = model.device_index == CPU_DEVICE_INDEX
        pids = process_tree(model.pid) if model.owns_process else {model.pid}
        rss_at_start = rss_bytes(pids) if on_cpu else 0

        def held_bytes() -> int:
            if on_cpu:
                rss = rss_bytes(pids)
                # A model inside the worker shares its pid: its bytes are what it measured at load
                # plus the worker's growth since; a process of its own is its resident memory.
                return rss if model.owns_process else model.measured_bytes + max(0, rss - rss_at_start)
            return sum(
                p.used_bytes
                for d in self._backend.sample()
                if d.index == model.device_index
                for p in d.processes
                if p.pid in pids
            )

        measured = await run_profile(
            spec, chat, lambda payload: runtime.invoke(model, payload, _heartbeat), held_bytes, _heartbeat
        )
        samples = await asyncio.to_thread(self._backend.sample)  # NVML blocks: never on the event loop
        device = next((d for d in samples if d.index == model.device_index), None)
        config = deployment.runtime_config if deployment else {}
        # What ran, for the envelope's record, never a credential: environment variables by name
        # only (their values may be secrets; referenced secrets are names anyway).
        env_names = sorted(
            {key.removeprefix("env.") for key in config if key.startswith("env.")}
            | set(deployment.env_from_secrets if deployment else {})
        )
        return {
            "profile": {
                **measured,
                "runtime": runtime.name,
                "runtime_version": runtime.version(),
                "device_name": device.name if device is not None else "",
                "simulated": self._backend.label == "simulated" and not on_cpu,
                "configuration": {
                    "runtime_config": {key: value for key, value in config.items() if not key.startswith("env.")},
                    "env": env_names,
                    "command": _redacted_command(list(deployment.command)) if deployment else [],
                    "concurrency": deployment.concurrency if deployment else 1,
                },
            }
        }

    async def _operate(self, key: str, operation: str, action: Callable[[Runtime, LoadedModel], Awaitable[Any]]) -> Any:
        runtime, model = self._model(key)
        started = time.monotonic()
        try:
            result = await action(runtime, model)
        except ModelForgeError as error:
            raise as_application_error(error) from None
        seconds = time.monotonic() - started
        log.info(f"model_{operation}", key=key, seconds=round(seconds, 3))
        return result, seconds

    @activity.defn(name="sleep_model")
    async def sleep_model(self, key: str) -> RuntimeOpResult:
        """Free most of a resident's device memory (where its runtime can), timed."""
        asleep, seconds = await self._operate(key, "sleep", lambda runtime, model: runtime.sleep(model))
        return RuntimeOpResult(key, "sleep", seconds, bytes_after=int(asleep))

    @activity.defn(name="wake_model")
    async def wake_model(self, key: str) -> RuntimeOpResult:
        awake, seconds = await self._operate(key, "wake", lambda runtime, model: runtime.wake(model, _heartbeat))
        return RuntimeOpResult(key, "wake", seconds, bytes_after=int(awake))

    def _checkpoint_destination(self, request_id: str, name: str) -> Path:
        """Where a checkpoint of this request is written: `<store>/<request id>/<name>/<run>`,
        `<run>` the request workflow's run id, so that only this very run can resume from it
        (another request reusing the id, another tenant's, finds nothing it may read)."""
        assert self._checkpoint_root is not None
        destination = self._checkpoint_root / _safe_name(request_id, "request") / name
        run = _run_scope()
        return destination / run if run else destination

    def _check_resume(self, location: object, request_id: str) -> str:
        """The real path a resumed run starts from, or "" for none. A location is a path or a
        `file://` URL, resolved (symlinks, `..`) after decoding, and must lie inside this
        request's own checkpoints in the store (`<store>/<request id>/<n>/<this run>/`):
        anything else (relative, another scheme, outside the store, another request's or
        another run's checkpoint) is REQUEST_INVALID, so a request's input never makes a runtime
        read a file the node did not write for it."""
        if location is None or location == "":
            return ""

        def refuse(why: str) -> ModelForgeError:
            return ModelForgeError(FailureClass.REQUEST_INVALID, f"{RESUME_KEY}: {str(location)[:200]!r} {why}")

        if not isinstance(location, str) or "\x00" in location or len(location) > 4096:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{RESUME_KEY} must be a path in the checkpoint store")
        path = location
        if "://" in location or location.startswith("file:"):
            parts = urllib.parse.urlsplit(location)
            if parts.scheme != "file" or parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
                raise refuse("is not a path or file:// URL in the checkpoint store")
            path = urllib.parse.unquote(parts.path)
            if "\x00" in path:
                raise refuse("is not a path in the checkpoint store")
        if not path.startswith("/"):
            raise refuse("is relative: a resume location is an absolute path in the checkpoint store")
        if self._checkpoint_root is None:
            raise refuse(f"is outside the checkpoint store (node {self._node} has none)")
        store = Path(os.path.realpath(self._checkpoint_root))
        real = Path(os.path.realpath(path))
        if not real.is_relative_to(store):
            raise refuse("is outside the checkpoint store")
        mine = Path(os.path.realpath(store / _safe_name(request_id, "request")))
        run = _run_scope()
        inside = real.relative_to(mine).parts if real.is_relative_to(mine) and mine != store else None
        if inside is None or (run and (len(inside) < 2 or inside[1] != run)):
            raise refuse("is not a checkpoint of this request in the checkpoint store")
        return str(real)

    @activity.defn(name="checkpoint_invocation")
    async def checkpoint_invocation(self, request: CheckpointInput) -> RuntimeOpResult:
        """Save the running invoke's progress into the checkpoint store; returns its location."""
        if self._checkpoint_root is None:
            raise as_application_error(
                ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"node {self._node} has no checkpoint store")
            )
        destination = self._checkpoint_destination(request.request_id, str(request.preemption))
        spec = {"lease_id": request.lease_id, "destination": str(destination)}
        try:
            location, seconds = await self._operate(
                request.key, "checkpoint", lambda runtime, model: runtime.checkpoint(model, spec)
            )
        finally:
            runtime, model = self._loaded.get(request.key, (None, None))
            if model is not None:
                index = model.device_index
                accelerator = f"{self._node}/{'cpu' if index == CPU_DEVICE_INDEX else index}"
                await self._record_job_preemption(
                    runtime, request.lease_id, request.request_id, request.lease_id, model.deployment, accelerator
                )
        return RuntimeOpResult(request.key, "checkpoint", seconds, location=str(location))

    async def _record_job_preemption(
        self, runtime: Runtime | None, job_key: str, request_id: str, lease_id: str, deployment: str, accelerator: str
    ) -> None:
        """A job runtime's preempted job (`job_key`: its lease, or a gang rank's `lease#rank<r>`):
        how it stopped (checkpointed on the signal, or killed after the grace) and whether it
        resumes from a checkpoint or starts over, as a `job_preempted` event (started as a
        RecordEventsWorkflow, never awaited)."""
        take = getattr(runtime, "take_preemption", None)
        note = take(job_key) if take is not None else None
        if not note or self._client is None:
            return
        event = EventRecord(
            event_id=str(uuid.uuid4()),
            at=self._clock(),
            kind="job_preempted",
            request_id=request_id,
            lease_id=lease_id,
            accelerator=accelerator,
            deployment=deployment,
            message=str(note.get("detail", ""))[:1000],
            payload={k: note.get(k) for k in ("outcome", "checkpoint", "exit_code")}
            | ({"rank": int(job_key.rsplit("#rank", 1)[1])} if "#rank" in job_key else {}),
        )
        try:
            await self._client.start_workflow(
                "RecordEventsWorkflow",
                [event],
                id=f"events:job-preempted:{request_id}:{job_key}"[:900],
                task_queue=CONTROL_TASK_QUEUE,
            )
        except Exception as error:  # the job's status file and log still say it
            log.warning("job_preempted_event_not_started", lease_id=lease_id, error=str(error))

    @activity.defn(name="unload_model")
    async def unload_model(self, key: str) -> float | None:
        """Stop the model; returns how long the runtime took (None when it was already gone)."""
        entry = self._loaded.pop(key, None)
        if entry is None:
            return None  # already gone: unloading is idempotent
        runtime, model = entry
        # An in-process model shares the worker's pid (and its CUDA context, which stays): only a
        # process ModelForge started is watched by pid; the rest by name.
        if model.owns_process:
            self._unloaded_pids[key] = process_tree(model.pid)
        started = time.monotonic()
        try:
            await runtime.unload(model)
        except ModelForgeError as error:
            raise as_application_error(error) from None
        seconds = time.monotonic() - started
        log.info("model_unloaded", key=key, unload_s=round(seconds, 3))
        return seconds

    @activity.defn(name="verify_reclaim")
    async def verify_reclaim(self, request: ReclaimInput) -> ReclaimResult:
        """Poll NVML until no process of this model holds memory on the device."""
        deadline = time.monotonic() + request.timeout_s
        tag = f"modelforge:{request.key}"
        index = device_index(request.accelerator_id)
        pids = self._unloaded_pids.get(request.key, set())
        while True:
            try:
                devices = await asyncio.to_thread(self._backend.sample)
            except ModelForgeError as error:
                raise as_application_error(error) from None
            lingering = [p for d in devices if d.index == index for p in d.processes if p.name == tag or p.pid in pids]
            if not lingering:
                self._unloaded_pids.pop(request.key, None)
                return ReclaimResult(reclaimed=True)
            if time.monotonic() >= deadline:
                held = sum(p.used_bytes for p in lingering)
                return ReclaimResult(
                    reclaimed=False, message=f"{held} B still held by {tag} after {request.timeout_s:.0f} s"
                )
            _heartbeat("waiting for memory to be reclaimed")
            await asyncio.sleep(0.5)


# An answer with at most this many values and characters is surely under put_output's threshold
# (LARGE_OUTPUT_BYTES, 256 KiB): a number or a character takes at most ~25 or 6 bytes of JSON.
_SMALL_VALUES = 4096
_SMALL_CHARS = 32 * 1024


def _may_be_large(output: object) -> bool:
    """Whether `output` might reach the size put_output stores by reference: a bounded walk."""
    values = chars = 0
    stack = [output]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
            chars += sum(len(str(key)) for key in item)
            values += len(item)
        elif isinstance(item, list | tuple):
            stack.extend(item)
            values += len(item)
        elif isinstance(item, str):
            chars += len(item)
        else:
            values += 1
        if values > _SMALL_VALUES or chars > _SMALL_CHARS:
            return True
    return False


def _stream_of(runtime: Runtime, model: LoadedModel, payload: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The runtime's own streaming call where it has one; otherwise its whole answer as one
    chunk, once it has it."""
    streaming = getattr(runtime, "invoke_stream", None)
    if streaming is not None:
        chunks: AsyncIterator[dict[str, Any]] = streaming(model, payload, _heartbeat)
        return chunks

    async def whole() -> AsyncIterator[dict[str, Any]]:
        output = await runtime.invoke(model, payload, _heartbeat)
        async for chunk in stream_push.single_chunk(output):
            yield chunk

    return whole()
