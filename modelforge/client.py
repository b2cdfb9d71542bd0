"""The Python client: the same calls the CLI makes.

client = await ModelForgeClient.connect()
result = await client.request("rag.embedding@1", input={"text": "hi"}, tenant="rag")
result.ok, result.output, result.failure_class, result.message, result.lease, result.timings

A request id is the request's idempotency key: its workflow is `request:<capability>:<request_id>`,
and asking again with the same id attaches to that workflow while it runs and returns its recorded
result once it has succeeded (only a failed one is run again). Through a Temporal outage (a server
restart) the client retries its start and its wait for the result, with backoff, for `reattach_s`
(five minutes by default), so it reports what the request really did instead of an error that
tempts the caller to do the work twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowFailureError,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import (
    SearchAttributePair,
    TypedSearchAttributes,
    WorkflowIDConflictPolicy,
    WorkflowIDReusePolicy,
)
from temporalio.exceptions import ApplicationError, TerminatedError, TimeoutError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from modelforge import temporal as sa
from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.identifiers import (
    CLASS_PART,
    MAX_DURATION_S,
    MAX_WAIT_S,
    MIN_DURATION_S,
    PRIORITY_CLASS,
    identifier_problem,
    shown,
)
from modelforge.messages import (
    MAX_INPUT_BYTES,
    OPERATIONS,
    DeadlineDue,
    RequestInput,
    RequestResult,
    ResidencyControl,
    ResidencyControlReply,
    StreamTarget,
    client_input_problem,
)
from modelforge.names import REQUEST_WORKFLOW_TYPE, request_workflow_id, scheduler_id
from modelforge.payloads import OUTPUT_REF, PayloadMissing, get_output, payload_store
from modelforge.policy import Lease, PoolStatus, ResidentStatus, merge_statuses
from modelforge.routing import PoolRouter, pools_from_env
from modelforge.settings import CONTROL_TASK_QUEUE, NODE_TASK_QUEUE_PREFIX, Settings, node_task_queue
from modelforge.verdicts import request_verdict

# Deeper input is refused before it is encoded (json.dumps would recurse, and the store cuts
# what it keeps at 64 levels anyway).
MAX_INPUT_DEPTH = 64
# How long a request rides out a Temporal outage (its start, or the wait for its result).
DEFAULT_REATTACH_S = 300.0
# How long after a waiting request's deadline (by this process's clock) its scheduler is nudged
# to refuse it: past the moment, so the scheduler's clock has passed it too on the same host.
DEADLINE_NUDGE_AFTER_S = 0.05
# Cards a job may ask for (`submit_job(gpu_count=...)`); the node checks the deployment has them.
MAX_GPU_COUNT = 1024
# What a server restart or a dropped connection looks like; anything else is an answer.
_TRANSIENT = frozenset(
    {
        RPCStatusCode.UNAVAILABLE,
        RPCStatusCode.DEADLINE_EXCEEDED,
        RPCStatusCode.RESOURCE_EXHAUSTED,
        RPCStatusCode.ABORTED,
        RPCStatusCode.CANCELLED,
        RPCStatusCode.UNKNOWN,
        RPCStatusCode.INTERNAL,
    }
)
# A failed run that closed this long before the call began is an earlier call's (clock skew
# between client and server is allowed for), never this call's own lost start.
_SKEW = timedelta(seconds=30)


@dataclass(frozen=True)
class Result:
    ok: bool
    request_id: str
    capability: str
    output: dict[str, Any] | None = None
    failure_class: str | None = None
    message: str = ""
    lease: Lease | None = None
    timings: dict[str, float] = field(default_factory=dict)
    workflow_id: str = ""


_NOT_YOURS = (
    "request id {request_id} belongs to another tenant's request: a request id is the idempotency key, choose another"
)


def _invalid(request_id: object, capability: object, message: str) -> Result:
    return Result(
        ok=False,
        request_id=request_id if isinstance(request_id, str) else str(request_id)[:200],
        capability=capability if isinstance(capability, str) else str(capability)[:200],
        failure_class=FailureClass.REQUEST_INVALID.value,
        message=message,
    )


def job_input(args: Sequence[str], gpu_count: int | None = None, nvlink: bool = False) -> dict[str, Any]:
    """A job's request input: its `args` (appended to the deployment's command), the cards it
    asks for, and whether they must be joined by NVLink (`"nvlink": true`, only when asked).
    REQUEST_INVALID (ModelForgeError) for args that are not a list of strings, a gpu_count out
    of range or an nvlink that is not True or False."""
    if not isinstance(args, list | tuple) or not all(isinstance(a, str) for a in args):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "args must be a list of strings")
    if gpu_count is not None and (
        isinstance(gpu_count, bool) or not isinstance(gpu_count, int) or not 1 <= gpu_count <= MAX_GPU_COUNT
    ):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"gpu_count must be from 1 to {MAX_GPU_COUNT}")
    if not isinstance(nvlink, bool):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "nvlink must be true or false")
    payload: dict[str, Any] = {"args": list(args)} if args else {}
    if gpu_count is not None:
        payload["gpu_count"] = gpu_count
    if nvlink:
        payload["nvlink"] = True
    return payload


def input_shape_problem(value: object) -> str | None:
    """Why a JSON-like value cannot be sent, judged by its shape alone: nesting deeper than
    MAX_INPUT_DEPTH, or more items than MAX_INPUT_BYTES could hold (a structure that shares its
    parts would otherwise be expanded without end by the encoder). Iterative, so any depth is
    measured without recursion."""
    stack: list[tuple[object, int]] = [(value, 0)]
    items = 0
    while stack:
        item, depth = stack.pop()
        items += 1
        if items > MAX_INPUT_BYTES:
            return f"input has more than {MAX_INPUT_BYTES} items; the limit is {MAX_INPUT_BYTES} bytes"
        if isinstance(item, dict):
            children: Any = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        if depth >= MAX_INPUT_DEPTH:
            return f"input nests deeper than {MAX_INPUT_DEPTH} levels"
        stack.extend((child, depth + 1) for child in children)
    return None


class ModelForgeClient:
    def __init__(
        self,
        client: Client,
        pool: str | None = None,
        *,
        reattach_s: float = DEFAULT_REATTACH_S,
        pools: Sequence[str] | None = None,
        catalog: Callable[[], Awaitable[Catalog]] | None = None,
    ) -> None:
        """`pool`: the pool whose scheduler admits every request; None (the default) routes each
        capability to a pool that serves it (modelforge/routing.py), among `pools` (else
        MODELFORGE_POOLS, else the running schedulers). `reattach_s`: how long a request keeps
        retrying through a Temporal outage before it gives up with CAPABILITY_UNAVAILABLE
        (asking again with its request_id then attaches). `catalog`: where routing reads the
        catalog when no scheduler's answer places a capability (one slow or still reloading)."""
        self.temporal = client
        self.pool = pool
        self.reattach_s = reattach_s
        self.router = PoolRouter(client, pools_from_env() if pools is None else pools, catalog=catalog)
        # (pool, capability) -> the task queue of the node that served its last request. A request
        # started there runs its workflow on that node's worker, which hands itself the invoke
        # (eager dispatch) when the lease lands on that node; anywhere else it runs as from the
        # control queue. Only a hint: admission decides, and a node gone silent has its queue
        # served by the control worker (workers/control.py, NodeQueueAdopter). With none known
        # yet, the pool's scheduler names the node where the capability is warm (the `route`
        # query's `node`, asked with the pool's choice; `_task_queue`). After a failure the
        # control queue, until a request succeeds again.
        self._routes: dict[tuple[str, str], str] = {}
        # Request workflows this client started, and how many of them eagerly: the server handed
        # the first workflow task back in the start's reply, to a worker on this same client
        # polling that task queue (a gateway in a node worker's process, `modelforge worker node
        # --gateway-port`), sparing the task's dispatch through the server's matching.
        self.workflow_starts = 0
        self.eager_starts = 0

    @classmethod
    async def connect(
        cls,
        settings: Settings | None = None,
        pool: str | None = None,
        *,
        reattach_s: float = DEFAULT_REATTACH_S,
        pools: Sequence[str] | None = None,
        catalog: Callable[[], Awaitable[Catalog]] | None = None,
    ) -> ModelForgeClient:
        return cls(
            await sa.connect(settings or Settings.from_env()), pool, reattach_s=reattach_s, pools=pools, catalog=catalog
        )

    async def request(
        self,
        capability: str,
        input: dict[str, Any] | None = None,
        *,
        priority: str | None = None,
        queue: str | None = None,
        tenant: str = "default",
        deadline_s: float | None = None,
        lease_timeout_s: float | None = None,
        request_id: str | None = None,
        on_progress: Callable[[str], None] | None = None,
        operation: str = "",
        stream: StreamTarget | None = None,
        max_duration_s: float | None = None,
        end_user: str = "",
    ) -> Result:
        """One request, start to end. `on_progress` hears, about twice a second, what the request
        waits on: admission, the queue, a model loading (from its load activity's heartbeats),
        the invoke. `operation`: what the node does with the lease ("" invokes; "profile" is
        `modelforge profile`'s), never a key of `input` (`modelforge_*` keys are refused).
        `stream`: where the node pushes the answer as it is generated (the gateway's streams).
        `max_duration_s`: the longest its lease is held once granted, 1 s to 7 days (the
        invoke or job is stopped, TIMEOUT, past it); None: RequestInput's default, 600 s.
        `end_user`: who the application says asked, within the tenant (recorded on the lease's
        events; never the tenant)."""
        chose_id = request_id is not None  # an id of our own making names nobody else's request
        request_id = uuid.uuid4().hex[:16] if request_id is None else request_id
        payload = {} if input is None else input
        # Identifiers by the one set of rules (modelforge/identifiers.py), before anything is sent.
        names = [("capability", capability), ("tenant", tenant), ("request_id", request_id)]
        for kind, name in names + ([("end_user", end_user)] if end_user else []):
            problem = identifier_problem(kind, name)
            if problem is not None:
                return _invalid(request_id, capability, problem)
        if not isinstance(payload, dict):
            return _invalid(request_id, capability, "input must be a JSON object")
        problem = input_shape_problem(payload) or client_input_problem(payload)
        if problem is not None:
            return _invalid(request_id, capability, problem)
        if operation not in OPERATIONS:
            return _invalid(request_id, capability, f"unknown operation {shown(str(operation))}")
        try:
            size = len(json.dumps(payload, allow_nan=False).encode())
        except (TypeError, ValueError, RecursionError) as error:
            return _invalid(request_id, capability, f"input is not JSON: {error}")
        limit = sa.input_limit(self.temporal)  # MODELFORGE_MAX_PAYLOAD_BYTES with the payload store
        if size > limit:
            return _invalid(request_id, capability, f"input is {size} bytes; the limit is {limit}")
        for name, text in (("queue", queue), ("priority", priority)):
            if text is not None and not isinstance(text, str):
                return _invalid(request_id, capability, f"{name} must be a string, not {type(text).__name__}")
        if queue is not None:
            if not CLASS_PART.fullmatch(queue):
                return _invalid(request_id, capability, f"queue {shown(queue)} is not a queue name")
            if priority is None or "." in priority:
                return _invalid(request_id, capability, "a queue needs a level: --queue merge --priority critical")
            priority = f"{queue}.{priority}"
        if priority is not None and not PRIORITY_CLASS.fullmatch(priority):
            return _invalid(
                request_id,
                capability,
                f"priority {shown(priority)} is not a class name (a level such as 'interactive', or 'queue.level')",
            )
        for name, value in (("deadline_s", deadline_s), ("lease_timeout_s", lease_timeout_s)):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float) or not (0 < value <= MAX_WAIT_S):
                return _invalid(request_id, capability, f"{name} must be between 0 and 604800 seconds")
        if max_duration_s is not None and (
            isinstance(max_duration_s, bool)
            or not isinstance(max_duration_s, int | float)
            or not (MIN_DURATION_S <= max_duration_s <= MAX_DURATION_S)
        ):
            return _invalid(
                request_id,
                capability,
                f"max_duration_s must be from {MIN_DURATION_S:.0f} to {MAX_DURATION_S:.0f} seconds (7 days), "
                f"not {shown(str(max_duration_s))}",
            )
        try:
            pool = self.pool if self.pool is not None else await self.router.choose(capability, tenant, priority)
        except ModelForgeError as error:
            return Result(
                ok=False,
                request_id=request_id,
                capability=capability,
                failure_class=error.failure.value,
                message=error.message,
            )
        request = RequestInput(
            request_id=request_id,
            capability=capability,
            input=payload,
            priority=priority,
            tenant=tenant,
            deadline_s=deadline_s,
            lease_timeout_s=lease_timeout_s,
            pool=pool,
            operation=operation,
            stream=stream,
            end_user=end_user,
            input_bytes=size,
            **({"max_duration_s": float(max_duration_s)} if max_duration_s is not None else {}),
        )
        workflow_id = request_workflow_id(capability, request_id)
        attributes = [SearchAttributePair(sa.CAPABILITY, capability), SearchAttributePair(sa.TENANT, tenant)]
        if priority:
            attributes.append(SearchAttributePair(sa.PRIORITY, priority))
        try:
            result: RequestResult = await self._start_and_wait(
                request,
                workflow_id,
                task_queue=await self._task_queue(pool, capability, tenant, priority),
                search_attributes=TypedSearchAttributes(attributes),
                summary=f"{capability} for {tenant}",
                memo={"capability": capability, "tenant": tenant, "input_bytes": size},
                on_progress=on_progress,
            )
        except WorkflowFailureError as error:
            self._routes[(pool, capability)] = CONTROL_TASK_QUEUE  # the next one starts from there
            self.router.forget(capability)  # and is routed afresh
            if chose_id and await self._owner(workflow_id) not in (None, tenant):
                return _invalid(request_id, capability, _NOT_YOURS.format(request_id=request_id))
            cause = error.cause
            if isinstance(cause, ApplicationError) and cause.type:
                return Result(
                    ok=False,
                    request_id=request_id,
                    capability=capability,
                    failure_class=cause.type,
                    message=cause.message,
                    workflow_id=workflow_id,
                )
            if isinstance(cause, TimeoutError | TerminatedError):
                return Result(
                    ok=False,
                    request_id=request_id,
                    capability=capability,
                    failure_class=FailureClass.TIMEOUT.value,
                    message=str(cause),
                    workflow_id=workflow_id,
                )
            raise
        except RPCError as error:
            if error.status == RPCStatusCode.INVALID_ARGUMENT:
                return _invalid(request_id, capability, f"Temporal refused the request as invalid: {error.message}")
            if error.status in _TRANSIENT:
                raise ModelForgeError(
                    FailureClass.CAPABILITY_UNAVAILABLE,
                    f"Temporal did not answer for {self.reattach_s:.0f} s ({error.status.name}: {error.message}); "
                    f"request {request_id} may still run: ask again with the same request_id for its outcome",
                ) from None
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"Temporal refused the request: {error}"
            ) from None
        if result.lease is not None and result.lease.tenant and result.lease.tenant != tenant:
            # The request id is another tenant's request (attached by id): its answer is not ours.
            return _invalid(request_id, capability, _NOT_YOURS.format(request_id=request_id))
        if result.route.startswith(NODE_TASK_QUEUE_PREFIX):
            self._routes[(pool, capability)] = result.route
        else:
            self._routes.pop((pool, capability), None)
        try:  # a large answer was kept in the payload store by the node: read it back
            output = result.output
            if isinstance(output, dict) and OUTPUT_REF in output:  # a thread only for a file to read
                output = await asyncio.to_thread(get_output, payload_store(self.temporal), output)
        except PayloadMissing as error:
            return Result(
                ok=False,
                request_id=request_id,
                capability=capability,
                failure_class=FailureClass.CAPABILITY_UNAVAILABLE.value,
                message=error.message,
                workflow_id=workflow_id,
            )
        return Result(
            ok=True,
            request_id=request_id,
            capability=capability,
            output=output,
            lease=result.lease,
            timings=result.timings,
            workflow_id=workflow_id,
        )

    async def _task_queue(self, pool: str, capability: str, tenant: str, priority: str | None) -> str:
        """Where the request's workflow starts: the node queue its capability's last result named;
        the control queue after a failure; with neither, the node the pool's scheduler names as
        warm for it (`PoolRouter.warm_node`), whose worker admits it on a lent slot, else the
        control queue. A node queue is only a hint, guarded as a remembered one is: the node is
        one with fresh telemetry, and the control worker serves the queue of a node gone silent."""
        remembered = self._routes.get((pool, capability))
        if remembered is not None:
            return remembered
        node = await self.router.warm_node(pool, capability, tenant, priority)
        return node_task_queue(node) if node else CONTROL_TASK_QUEUE

    async def submit_job(
        self,
        capability: str,
        args: Sequence[str] = (),
        *,
        max_duration_s: float,
        gpu_count: int | None = None,
        nvlink: bool = False,
        tenant: str = "default",
        queue: str | None = None,
        priority: str | None = None,
        request_id: str | None = None,
        on_progress: Callable[[str], None] | None = None,
    ) -> Result:
        """A job (runtime `subprocess_job`): the deployment's command with `args` appended (it
        needs `input_args = "true"`), run to its end under a lease of at most `max_duration_s`
        (1 s to 7 days; TIMEOUT past it). The job's Result when it ends: `output` holds its exit
        code, outputs (with their artifacts), log, progress and attempts. `gpu_count`, when
        given, must be the deployment's card count (the node refuses the job otherwise).
        `nvlink=True` asks for cards joined by NVLink: honoured by the placement of a deployment
        with `nvlink_required = true`, refused by the node (REQUEST_INVALID, before the job
        starts) for any other. Every check and error of `request` applies; a bad `args`,
        `gpu_count` or `nvlink` is REQUEST_INVALID."""
        try:
            payload = job_input(args, gpu_count, nvlink)
        except ModelForgeError as error:
            return _invalid(request_id or "", capability, error.message)
        return await self.request(
            capability,
            payload,
            tenant=tenant,
            queue=queue,
            priority=priority,
            request_id=request_id,
            on_progress=on_progress,
            max_duration_s=max_duration_s,
        )

    async def _owner(self, workflow_id: str) -> str | None:
        """The tenant a request workflow was started for (its memo), or None when unknown."""
        try:
            described = await self.temporal.get_workflow_handle(workflow_id).describe(rpc_timeout=timedelta(seconds=5))
            owner = (await described.memo()).get("tenant")
        except Exception:  # unknown: the caller's own failure stands
            return None
        return owner if isinstance(owner, str) else None

    async def _start_and_wait(
        self,
        request: RequestInput,
        workflow_id: str,
        *,
        task_queue: str,
        search_attributes: TypedSearchAttributes,
        summary: str,
        memo: dict[str, Any],
        on_progress: Callable[[str], None] | None,
    ) -> RequestResult:
        """Start the request's workflow, or attach to it, and wait for its result, retrying both
        through transient Temporal errors with backoff for `reattach_s`.

        The first start may start a new run only if no run of this id succeeded
        (ALLOW_DUPLICATE_FAILED_ONLY) and attaches to a running one (USE_EXISTING). A start
        retried after a transient error may have reached the server before the answer was lost,
        so it attaches to whatever run there is (REJECT_DUPLICATE), even a failed one, unless
        that run closed before this call began (an earlier call's)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.reattach_s
        began = datetime.now(UTC)
        delay = 0.5
        handle: WorkflowHandle[Any, RequestResult] | None = None
        retrying_start = False
        watcher: asyncio.Task[None] | None = None
        nudge: asyncio.Task[None] | None = None
        try:
            while True:
                try:
                    if handle is None:
                        handle = await self._start(
                            request,
                            workflow_id,
                            task_queue=task_queue,
                            search_attributes=search_attributes,
                            summary=summary,
                            memo=memo,
                            retrying=retrying_start,
                            began=began,
                        )
                        if on_progress is not None:
                            watcher = asyncio.create_task(
                                self._watch(handle, request.capability, request.pool, on_progress, request.request_id)
                            )
                        if request.deadline_s is not None and nudge is None:
                            nudge = asyncio.create_task(self._nudge_at_deadline(request, loop.time()))
                    result: RequestResult = await handle.result()
                    return result
                except RPCError as error:
                    left = give_up - loop.time()
                    if error.status not in _TRANSIENT or left <= 0:
                        raise
                    retrying_start = handle is None
                    if on_progress is not None:
                        on_progress(f"Temporal unavailable ({error.status.name}); retrying for {left:.0f} s more")
                    await asyncio.sleep(min(delay, left))
                    delay = min(delay * 2, 5.0)
        finally:
            for task in (watcher, nudge):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task

    async def _nudge_at_deadline(self, request: RequestInput, started: float) -> None:
        """Tell the pool's scheduler when the request's deadline passed by this process's clock,
        if it still waits then: its refusal (DEADLINE_CANNOT_BE_MET) then reaches the caller
        at the deadline, not when Temporal's timer fires (up to a second late on a busy
        server). The workflow started before `started`, so its deadline has passed by then."""
        assert request.deadline_s is not None
        await asyncio.sleep(
            max(0.0, started + request.deadline_s + DEADLINE_NUDGE_AFTER_S - asyncio.get_running_loop().time())
        )
        with contextlib.suppress(RPCError):  # only a nudge: the scheduler's timer refuses it anyway
            await self.temporal.get_workflow_handle(scheduler_id(request.pool)).signal(
                "deadline_due", DeadlineDue(request_id=request.request_id), rpc_timeout=timedelta(seconds=5)
            )

    async def _start(
        self,
        request: RequestInput,
        workflow_id: str,
        *,
        task_queue: str,
        search_attributes: TypedSearchAttributes,
        summary: str,
        memo: dict[str, Any],
        retrying: bool,
        began: datetime,
    ) -> WorkflowHandle[Any, RequestResult]:
        try:
            handle = await self.temporal.start_workflow(
                REQUEST_WORKFLOW_TYPE,
                request,
                id=workflow_id,
                task_queue=task_queue,
                search_attributes=search_attributes,
                result_type=RequestResult,
                static_summary=summary,
                memo=memo,
                id_reuse_policy=(
                    WorkflowIDReusePolicy.REJECT_DUPLICATE
                    if retrying
                    else WorkflowIDReusePolicy.ALLOW_DUPLICATE_FAILED_ONLY
                ),
                id_conflict_policy=WorkflowIDConflictPolicy.USE_EXISTING,
                # Asked always: the SDK asks the server only when a worker on this client polls
                # `task_queue` with a free slot; otherwise the start is as without it.
                request_eager_start=True,
            )
            self.workflow_starts += 1
            # The SDK marks a handle whose start came back with its first task (its own attribute,
            # not a documented one: a version without it counts no eager start, nothing else).
            self.eager_starts += bool(getattr(handle, "__temporal_eagerly_started", False))
            return handle
        except WorkflowAlreadyStartedError:
            # A closed run of this id: one that succeeded (its result is the answer), or, on a
            # retried start, possibly this call's own run whose start answer was lost.
            handle = self.temporal.get_workflow_handle(workflow_id, result_type=RequestResult)
            if retrying:
                described = await handle.describe()
                if (
                    described.status != WorkflowExecutionStatus.COMPLETED
                    and described.close_time is not None
                    and described.close_time < began - _SKEW
                ):
                    # An earlier call's failed run: this call's start never reached the server.
                    return await self._start(
                        request,
                        workflow_id,
                        task_queue=task_queue,
                        search_attributes=search_attributes,
                        summary=summary,
                        memo=memo,
                        retrying=False,
                        began=began,
                    )
            return handle

    async def _watch(
        self,
        handle: WorkflowHandle[Any, Any],
        capability: str,
        pool: str,
        report: Callable[[str], None],
        request_id: str = "",
    ) -> None:
        last = ""
        while True:
            try:
                line = await self._progress(handle, capability, pool, request_id)
            except (RPCError, WorkflowQueryFailedError, ModelForgeError):
                line = ""  # not started yet, or already done: nothing to say this time
            if line and line != last:
                report(line)
                last = line
            await asyncio.sleep(0.5)

    async def _progress(
        self, handle: WorkflowHandle[Any, Any], capability: str, pool: str, request_id: str = ""
    ) -> str:
        phase = str(await handle.query("phase", result_type=str, rpc_timeout=timedelta(seconds=5)))
        if phase in ("admitting", "queued"):
            # The scheduler's verdict (modelforge/verdicts.py), the one every surface shows; a
            # load in flight adds its own progress from the load activity's heartbeats.
            verdict = await request_verdict(self, request_id, pool=pool) if request_id else None
            if verdict is not None and verdict.load is None:
                return f"{phase}: {verdict.line()}"
            eta = f"; {verdict.eta_text()}" if verdict is not None else ""
            status = await self._pool_status(pool)
            for resident in status.residents:
                if resident.capability == capability and resident.state == "loading" and resident.workflow_id:
                    detail = await self._heartbeat(
                        self.temporal.get_workflow_handle(resident.workflow_id), "load_model"
                    )
                    return f"{phase}: {detail or f'loading {resident.deployment}'} on {resident.accelerator}{eta}"
            return f"{phase}: {verdict.line()}" if verdict is not None else f"{phase}: waiting for a lease"
        if phase in ("invoking", "preempting"):
            detail = await self._heartbeat(handle, "invoke")
            return f"{phase}" + (f": {detail}" if detail else "")
        return phase

    async def _heartbeat(self, handle: WorkflowHandle[Any, Any], activity_type: str) -> str:
        """The latest heartbeat detail of a running activity of the workflow, or ''."""
        described = await handle.describe(rpc_timeout=timedelta(seconds=5))
        for pending in described.raw_description.pending_activities:
            if pending.activity_type.name == activity_type and pending.heartbeat_details.payloads:
                values = await self.temporal.data_converter.decode(pending.heartbeat_details.payloads)
                return str(values[0]) if values else ""
        return ""

    async def residency(
        self,
        action: str,
        deployment: str,
        *,
        accelerator: str = "",
        drain: bool = False,
        tenant: str = "default",
        priority: str | None = None,
        actor: str = "",
    ) -> ResidencyControlReply:
        """load, unload, pin or unpin a deployment's resident through its pool's scheduler (the
        bound pool, else each routed pool in turn until one acts). A refusal raises
        ModelForgeError with its class (EVICTION_NOT_ALLOWED while leases are active, unless
        `drain`; REQUEST_INVALID for an unknown deployment or one not resident)."""
        call = ResidencyControl(
            action=action,
            deployment=deployment,
            accelerator=accelerator,
            drain=drain,
            actor=actor,
            tenant=tenant,
            priority=priority,
        )
        pools = [self.pool] if self.pool is not None else await self.router.pools()
        refusals: list[ModelForgeError] = []
        for pool in pools:
            try:
                reply: ResidencyControlReply = await self.temporal.get_workflow_handle(
                    scheduler_id(pool)
                ).execute_update("residency_control", call, result_type=ResidencyControlReply)
            except WorkflowUpdateFailedError as error:
                cause = error.cause
                failure = cause.type if isinstance(cause, ApplicationError) and cause.type else None
                refusals.append(
                    ModelForgeError(
                        FailureClass(failure)
                        if failure in {f.value for f in FailureClass}
                        else FailureClass.REQUEST_INVALID,
                        cause.message if isinstance(cause, ApplicationError) else str(error),
                    )
                )
                continue
            except RPCError as error:
                refusals.append(
                    ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"the scheduler of pool {pool!r}: {error}")
                )
                continue
            if reply.ok:
                return reply
            refusals.append(ModelForgeError(FailureClass(reply.failure or "REQUEST_INVALID"), reply.message))
        if not refusals:
            raise ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, "no pool's scheduler is running")
        # The most telling refusal: one about the resident itself before "not here".
        refusals.sort(key=lambda e: e.failure == FailureClass.REQUEST_INVALID)
        raise refusals[0]

    async def status(self) -> PoolStatus:
        """The bound pool's status; unbound, every pool's as one (`policy.merge_statuses`):
        CAPABILITY_UNAVAILABLE only when no pool's scheduler answers."""
        if self.pool is not None:
            return await self._pool_status(self.pool)
        statuses = await self.statuses()
        answered = [status for status in statuses.values() if isinstance(status, PoolStatus)]
        if not answered:
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                "; ".join(str(error.message) for error in statuses.values() if isinstance(error, ModelForgeError)),
            )
        return merge_statuses(answered)

    async def statuses(self) -> dict[str, PoolStatus | ModelForgeError]:
        """Each pool's status by name (the bound pool, else every pool routed among), or why its
        scheduler did not answer."""
        pools = [self.pool] if self.pool is not None else await self.router.pools()

        async def one(pool: str) -> PoolStatus | ModelForgeError:
            try:
                return await self._pool_status(pool)
            except ModelForgeError as error:
                return error

        return dict(zip(pools, await asyncio.gather(*(one(pool) for pool in pools)), strict=True))

    async def _pool_status(self, pool: str) -> PoolStatus:
        try:
            status: PoolStatus = await self.temporal.get_workflow_handle(scheduler_id(pool)).query(
                "status", result_type=PoolStatus, rpc_timeout=timedelta(seconds=10)
            )
        except (RPCError, WorkflowQueryFailedError) as error:
            raise ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"the scheduler of pool {pool!r} does not answer: {error}"
            ) from None
        return status

    async def ps(self) -> list[ResidentStatus]:
        return list((await self.status()).residents)


class SyncModelForgeClient:
    """A small blocking wrapper for scripts: the same calls, each run to its end on a loop of
    its own (so not from inside a running event loop: use `ModelForgeClient` there).
    `with SyncModelForgeClient() as client:` closes it after."""

    def __init__(
        self, settings: Settings | None = None, pool: str | None = None, *, reattach_s: float = DEFAULT_REATTACH_S
    ) -> None:
        self._loop = asyncio.new_event_loop()
        self._client = self._loop.run_until_complete(ModelForgeClient.connect(settings, pool, reattach_s=reattach_s))

    def request(self, capability: str, input: dict[str, Any] | None = None, **kwargs: Any) -> Result:
        return self._loop.run_until_complete(self._client.request(capability, input, **kwargs))

    def submit_job(self, capability: str, args: Sequence[str] = (), **kwargs: Any) -> Result:
        return self._loop.run_until_complete(self._client.submit_job(capability, args, **kwargs))

    def status(self) -> PoolStatus:
        return self._loop.run_until_complete(self._client.status())

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> SyncModelForgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
