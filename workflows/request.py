"""CapabilityRequestWorkflow: one per request. Lease -> (load, by the residency workflow) ->
invoke -> release. Failures end the workflow as an ApplicationError whose type is the class."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from functools import partial
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError
from temporalio.workflow import ActivityCancellationType

with workflow.unsafe.imports_passed_through():
    from modelforge import temporal as sa
    from modelforge.domain import DEFAULT_LEASE_TIMEOUT_S, Catalog
    from modelforge.events import EventRecord
    from modelforge.failures import FailureClass
    from modelforge.messages import (
        LEASE_HEARTBEAT_S,
        RESUME_KEY,
        AdmitCall,
        AdmitReply,
        CancelSignal,
        CheckpointInput,
        CollectInvokeInput,
        GangCheckpointInput,
        GangJobInput,
        InvokeInput,
        InvokeResult,
        LeaseConfirmCall,
        LeaseDecision,
        LeaseHeartbeat,
        PreemptSignal,
        ReleaseSignal,
        RequestInput,
        RequestResult,
        RuntimeOpResult,
        SlotClaim,
        client_input_problem,
    )
    from modelforge.names import REQUEST_WORKFLOW_TYPE
    from modelforge.policy import AdmissionRequest, Lease
    from modelforge.settings import CONTROL_TASK_QUEUE, node_task_queue

from workflows._common import (
    ALL_FAILURES,
    SCHEDULER_TASK_TIMEOUT,
    STORE_RETRY,
    classify,
    failure,
    heartbeat_timed_out,
    never_started,
    request_workflow_id,
    scheduler_id,
)
from workflows.records import RecordEventsWorkflow

INVOKE_HEARTBEAT = timedelta(seconds=60)
COLLECT_START_TIMEOUT = timedelta(seconds=30)
MAX_ATTEMPTS = 2  # bounded: one retry, and only for RUNTIME_CRASH
MAX_PREEMPTIONS = 10  # then the request fails rather than cycle forever
# The admission call's budget (schedule-to-close of the admit local activity); the scheduler
# refuses an admission that reaches it after ADMIT_BUDGET - ADMIT_MARGIN. It outlasts one timed-out
# scheduler task: when the control worker running one dies, the scheduler stands still until the
# task times out, and an admission asked meanwhile must still be answered (it was 60 s, equal to
# the task timeout then, and such admissions failed with TIMEOUT).
ADMIT_BUDGET = SCHEDULER_TASK_TIMEOUT + timedelta(seconds=30)
ADMIT_MARGIN_S = 5.0
# A first admission whose deadline passed on its way to the scheduler still asks with a deadline
# (the smallest the scheduler takes), for the scheduler's refusal or a late-running class's grant.
MIN_DEADLINE_S = 0.001
CHECKPOINT_TIMEOUT = timedelta(seconds=60)


@workflow.defn(name=REQUEST_WORKFLOW_TYPE, sandboxed=False)
class CapabilityRequestWorkflow:
    @workflow.init
    def __init__(self, request: RequestInput) -> None:
        self._decision: LeaseDecision | None = None
        self._phase = "admitting"
        self._lease: Lease | None = None
        self._preempt: PreemptSignal | None = None

    @workflow.signal
    def lease_decision(self, decision: LeaseDecision) -> None:
        self._decision = decision

    @workflow.signal
    def preempt(self, signal: PreemptSignal) -> None:
        # Only the lease it names: a late signal about an earlier lease changes nothing.
        if self._lease is not None and signal.lease_id == self._lease.lease_id:
            self._preempt = signal

    @workflow.query
    def phase(self) -> str:
        return self._phase

    @workflow.run
    async def run(self, request: RequestInput) -> RequestResult:
        started = workflow.now()
        # The last entrance: a client that skipped its own checks (or an old one) cannot choose
        # a node operation or a checkpoint through its input.
        problem = client_input_problem(request.input)
        if problem is not None:
            self._end(FailureClass.REQUEST_INVALID.value)
            raise failure(FailureClass.REQUEST_INVALID, problem)
        timings: dict[str, float] = {}
        crashes = preemptions = 0
        resume_from = ""  # the checkpoint the next run starts from, once one was taken
        gang_resume: dict[int, str] = {}  # a gang job's: each rank's checkpoint, all or none
        refused = 0  # grants found reclaimed on arrival (bounded like crashes)
        while True:
            self._decision = None
            self._preempt = None
            acquisition = crashes + preemptions + refused
            slot = await self._claim_slot(request) if acquisition == 0 and _may_claim(request) else None
            if slot is not None:
                lease = slot  # admitted on its node, from a slot the scheduler lent it
                timings["delegated"] = 1.0
            else:
                lease = await self._acquire(
                    request, preempted=preemptions > 0, submitted_at=started.timestamp(), acquisition=acquisition
                )
                if not await self._still_held(request, lease, acquisition):
                    refused += 1
                    if refused > MAX_PREEMPTIONS:
                        self._end(FailureClass.LEASE_CONFLICT.value)
                        raise failure(
                            FailureClass.LEASE_CONFLICT, f"{refused} grants were reclaimed before they arrived"
                        )
                    continue
            self._lease = lease
            timings["lease_s"] = (workflow.now() - started).total_seconds()
            workflow.upsert_search_attributes([sa.ACCELERATOR.value_set(lease.accelerator)])
            self._phase = "invoking"
            invoke_started = workflow.now()
            outcome, message = "ok", ""
            result: InvokeResult | None = None
            invoke: asyncio.Future[InvokeResult | None]
            if lease.gang:
                invoke = asyncio.ensure_future(self._run_gang(request, lease, request.input, gang_resume))
            else:
                invoke = self._invoke_resident(request, lease, resume_from, slot is not None)
            if slot is not None:
                # Its node vouches for a lent slot (its syncs, and the invoke's own heartbeats
                # from the node): no heartbeat timer here.
                await workflow.wait_condition(partial(self._ended_or_preempted, invoke))
            else:
                await self._heartbeat_until_done(request, lease, invoke)
            if self._preempt is not None and not invoke.done():
                # The grace time: finishing now is better than being requeued.
                self._phase = "preempting"
                try:
                    await workflow.wait_condition(invoke.done, timeout=self._preempt.grace_s)
                except TimeoutError:
                    if lease.gang:
                        gang_resume = await self._checkpoint_gang(request, lease, preemptions) or gang_resume
                    else:
                        resume_from = await self._checkpoint(request, lease, preemptions) or resume_from
                    invoke.cancel()
            lost = False
            ended_with: BaseException | None = None
            try:
                result = await invoke
            except (ActivityError, ApplicationError) as error:
                ended_with = error
            # As it was when the invoke ended: a preemption heard while asking the node below
            # does not turn the invoke's own outcome into a requeue.
            preempt = self._preempt
            if ended_with is not None:
                outcome, message = classify(ended_with)
                if heartbeat_timed_out(ended_with) and not lease.gang:
                    # Its end was never heard: it may have run there, its completion lost while
                    # Temporal was away, or never reached the node. The node says which.
                    collected, kept, why = await self._collect(request, lease, invoke_started)
                    if collected is not None:
                        result, outcome, message = collected, "ok", ""
                    elif kept:  # the invoke's own failure, which its node kept
                        outcome, message = kept, why
                    elif never_started(ended_with):
                        # No heartbeat and no record: it never ran there, so running it on a
                        # fresh lease cannot run it twice.
                        lost = True
                        message = "the node never started the invoke (its task was lost in flight)"
                    else:
                        message = f"{message}; {why}"
            if result is not None:
                preempt = None
            preempted = preempt is not None
            if preempt is not None:
                outcome, message = "preempted", preempt.reason
                if resume_from:
                    message += f"; resumes from checkpoint {resume_from}"
                elif gang_resume and lease.gang:
                    message += f"; resumes from the checkpoints of its {len(gang_resume)} ranks"
            # A runtime found gone (crashed, or its node restarted since the last sample) is the one
            # failure a fresh lease can cure: the scheduler drops the resident and loads it again.
            # An invoke lost before it started is tried once more too. Preempted work goes back to
            # the queue at its class and place. All are bounded.
            retrying = ((outcome == FailureClass.RUNTIME_CRASH.value or lost) and crashes + 1 < MAX_ATTEMPTS) or (
                preempted and preemptions < MAX_PREEMPTIONS
            )
            if request.stream is not None and not lost:
                # Part of a streamed answer may have reached the client: it ends here, with its
                # class, and is never generated again from the start.
                retrying = False
                if preempted:
                    outcome = FailureClass.LEASE_CONFLICT.value
                    message = f"preempted while streaming: {message}"
            if result is None or not result.released:
                await workflow.get_external_workflow_handle(scheduler_id(request.pool)).signal(
                    "release",
                    ReleaseSignal(
                        lease_id=lease.lease_id,
                        request_id=request.request_id,
                        outcome=outcome,
                        invoke_s=result.invoke_s if result else 0.0,
                        message=message,
                        retrying=retrying,
                        ended_at=workflow.now().timestamp(),
                    ),
                )
            if not retrying:
                break
            if preempted:
                preemptions += 1
            else:
                crashes += 1
        workflow.upsert_search_attributes([sa.OUTCOME.value_set(outcome)])
        if result is None:
            self._phase = "failed"
            if preempted and request.stream is None:
                raise failure(FailureClass.LEASE_TIMEOUT, f"preempted {preemptions + 1} times: {message}")
            raise failure(outcome, message)
        self._phase = "done"
        timings["invoke_s"] = result.invoke_s
        timings["total_s"] = (workflow.now() - started).total_seconds()
        timings["attempts"] = crashes + preemptions + 1
        timings["preemptions"] = preemptions
        return RequestResult(
            request_id=request.request_id,
            capability=request.capability,
            output=result.output,
            lease=lease,
            timings=timings,
            route=result.route,
        )

    def _invoke_resident(
        self, request: RequestInput, lease: Lease, resume_from: str, delegated: bool
    ) -> asyncio.Future[InvokeResult | None]:
        return workflow.start_activity(
            "invoke",
            InvokeInput(
                key=lease.resident_key,
                lease_id=lease.lease_id,
                payload=request.input,
                release_to=scheduler_id(request.pool),
                delegated=delegated,
                request_id=request.request_id,
                heartbeat_s=lease.heartbeat_s,
                # Set here only, never from the client's input (its modelforge_* keys are refused).
                operation=request.operation,
                resume_from=resume_from,
                stream=request.stream,
            ),
            result_type=InvokeResult,
            task_queue=node_task_queue(lease.node),
            schedule_to_close_timeout=timedelta(seconds=request.max_duration_s),
            heartbeat_timeout=INVOKE_HEARTBEAT,
            retry_policy=RetryPolicy(maximum_attempts=1),
            # A preempted invoke is over only when the node says so: until then its memory is in use.
            cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
            summary=f"invoke {lease.deployment} on {lease.accelerator}",
        )

    async def _collect(
        self, request: RequestInput, lease: Lease, invoke_started: datetime
    ) -> tuple[InvokeResult | None, str, str]:
        """Ask the node for the outcome of an invoke whose end was never heard (it keeps each a
        while: activities/_invoke_outcomes.py): (its result, "", ""), or (None, the failure
        class it kept, why), or (None, "", why) when it has no record or cannot be asked (gone:
        bounded from scheduling; an older node build without the activity). Within what is left
        of the invoke's own max_duration, so a request never outlives its limit by asking."""
        self._phase = "collecting"
        left_s = request.max_duration_s - (workflow.now() - invoke_started).total_seconds()
        try:
            collected: InvokeResult = await workflow.execute_activity(
                "collect_invoke",
                CollectInvokeInput(lease_id=lease.lease_id, request_id=request.request_id),
                result_type=InvokeResult,
                task_queue=node_task_queue(lease.node),
                schedule_to_start_timeout=COLLECT_START_TIMEOUT,
                schedule_to_close_timeout=max(COLLECT_START_TIMEOUT, timedelta(seconds=left_s)),
                heartbeat_timeout=INVOKE_HEARTBEAT,
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"collect the unheard invoke of {lease.lease_id}",
            )
        except (ActivityError, ApplicationError) as error:
            cause = error.cause if isinstance(error, ActivityError) else error
            cls, why = classify(error)
            if isinstance(cause, ApplicationError) and cause.type in ALL_FAILURES:
                return None, cls, why
            return None, "", why
        return collected, "", ""

    async def _run_gang(
        self, request: RequestInput, lease: Lease, payload: dict[str, Any], resume: dict[int, str]
    ) -> InvokeResult | None:
        """A gang lease's job: one `run_gang_job` per node on that node's cards, all at once,
        rank 0 first. A member that fails stops the others (all or nothing). Cancelled (the
        lease preempted): every member is stopped and awaited, and None comes back; each rank
        then resumes from its checkpoint (`resume`, when every rank has one) or starts over."""
        catalog = await workflow.execute_activity(
            "load_catalog",
            result_type=Catalog,
            task_queue=CONTROL_TASK_QUEUE,
            start_to_close_timeout=timedelta(seconds=30),
            retry_policy=STORE_RETRY,
            summary="the gang job's deployment",
        )
        deployment = catalog.deployment(lease.deployment)
        if deployment is None:
            raise failure(FailureClass.CAPABILITY_UNAVAILABLE, f"{lease.deployment} was removed from the catalog")
        by_node = _gang_nodes(lease)
        whole = len(resume) == len(by_node)  # a checkpoint of every rank, or none is used
        members = [
            workflow.start_activity(
                "run_gang_job",
                GangJobInput(
                    lease_id=lease.lease_id,
                    request_id=request.request_id,
                    deployment=deployment,
                    accelerators=cards,
                    payload={**payload, RESUME_KEY: resume[rank]} if whole else payload,
                    rank=rank,
                    world_size=len(by_node),
                    release_to=scheduler_id(request.pool),
                    heartbeat_s=lease.heartbeat_s or LEASE_HEARTBEAT_S,
                ),
                result_type=InvokeResult,
                task_queue=node_task_queue(node),
                schedule_to_close_timeout=timedelta(seconds=request.max_duration_s),
                heartbeat_timeout=INVOKE_HEARTBEAT,
                retry_policy=RetryPolicy(maximum_attempts=1),
                cancellation_type=ActivityCancellationType.WAIT_CANCELLATION_COMPLETED,
                summary=f"{lease.deployment}: rank {rank} on {', '.join(cards)}",
            )
            for rank, (node, cards) in enumerate(by_node.items())
        ]
        try:
            results = await asyncio.gather(*members)
        except asyncio.CancelledError:
            for member in members:
                member.cancel()
            await asyncio.gather(*members, return_exceptions=True)
            return None
        except ActivityError:
            for member in members:
                member.cancel()
            await asyncio.gather(*members, return_exceptions=True)
            raise
        output = {**results[0].output, "nodes": list(by_node), "accelerators": lease.accelerators}
        return InvokeResult(output=output, invoke_s=max(r.invoke_s for r in results))

    async def _checkpoint_gang(self, request: RequestInput, lease: Lease, preemption: int) -> dict[int, str]:
        """Ask every node to save its part of the preempted gang job, all at once; {} unless
        every rank saved one (the job then starts over, as before gang checkpoints)."""
        self._phase = "checkpointing"
        saves = [
            workflow.start_activity(
                "checkpoint_gang_job",
                GangCheckpointInput(
                    lease_id=lease.lease_id, request_id=request.request_id, rank=rank, preemption=preemption
                ),
                result_type=RuntimeOpResult,
                task_queue=node_task_queue(node),
                schedule_to_close_timeout=CHECKPOINT_TIMEOUT,
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"checkpoint {lease.deployment} rank {rank} before preemption",
            )
            for rank, node in enumerate(_gang_nodes(lease))
        ]
        saved = await asyncio.gather(*saves, return_exceptions=True)
        failed = [result for result in saved if isinstance(result, BaseException)]
        if failed:
            error = failed[0]
            why = classify(error)[1] if isinstance(error, ActivityError | ApplicationError) else str(error)
            workflow.logger.info("no checkpoint of gang %s: %s", lease.lease_id, why)
            return {}
        return {rank: result.location for rank, result in enumerate(saved) if isinstance(result, RuntimeOpResult)}

    async def _checkpoint(self, request: RequestInput, lease: Lease, preemption: int) -> str:
        """Ask the node to save the preempted invoke's progress; "" when its runtime cannot (the
        run then starts over, as before checkpoints)."""
        self._phase = "checkpointing"
        try:
            saved = await workflow.execute_activity(
                "checkpoint_invocation",
                CheckpointInput(
                    key=lease.resident_key,
                    lease_id=lease.lease_id,
                    request_id=request.request_id,
                    preemption=preemption,
                ),
                result_type=RuntimeOpResult,
                task_queue=node_task_queue(lease.node),
                # A node that is gone never picks it up: bounded from scheduling, not from start.
                schedule_to_close_timeout=CHECKPOINT_TIMEOUT,
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"checkpoint {lease.deployment} before preemption",
            )
        except ActivityError as error:
            workflow.logger.info("no checkpoint of %s: %s", lease.lease_id, classify(error)[1])
            return ""
        location: str = saved.location
        return location

    async def _heartbeat_until_done(self, request: RequestInput, lease: Lease, invoke: asyncio.Future[Any]) -> None:
        """Tell the scheduler this lease's holder is alive while the invoke runs: a holder that
        goes silent (terminated, lost) has its lease reclaimed after stale_lease_s."""
        scheduler = workflow.get_external_workflow_handle(scheduler_id(request.pool))
        while True:
            try:
                await workflow.wait_condition(
                    lambda: invoke.done() or self._preempt is not None, timeout=lease.heartbeat_s or LEASE_HEARTBEAT_S
                )
                return
            except TimeoutError:
                await scheduler.signal(
                    "lease_heartbeat",
                    LeaseHeartbeat(
                        lease_id=lease.lease_id, request_id=request.request_id, holder=workflow.info().workflow_id
                    ),
                )

    def _ended_or_preempted(self, invoke: asyncio.Future[Any]) -> bool:
        return invoke.done() or self._preempt is not None

    async def _claim_slot(self, request: RequestInput) -> Lease | None:
        """A warm request on its node's worker asks that node for a slot the scheduler lent it
        (a local activity, no round trip: activities/_delegation.py). None (no free slot, or
        anything going wrong): the scheduler admits it as always."""
        try:
            slot: Lease | None = await workflow.execute_local_activity(
                "claim_slot",
                SlotClaim(
                    pool=request.pool,
                    request_id=request.request_id,
                    workflow_id=workflow.info().workflow_id,
                    capability=request.capability,
                    tenant=request.tenant,
                    priority=request.priority or None,
                    end_user=request.end_user,
                ),
                result_type=Lease | None,  # type: ignore[arg-type]
                start_to_close_timeout=timedelta(seconds=5),
                retry_policy=RetryPolicy(maximum_attempts=1),
                summary=f"claim a delegated slot for {request.capability}",
            )
        except (ActivityError, ApplicationError) as error:
            workflow.logger.info("no delegated slot for %s: %s", request.request_id, error)
            return None
        return slot

    async def _still_held(self, request: RequestInput, lease: Lease, acquisition: int) -> bool:
        """A grant that reaches its holder later than a heartbeat period after it was made (the
        holder's worker, or Temporal, was away) may have been reclaimed meanwhile and its room
        granted to another: the holder asks the scheduler before using it. A prompt grant cannot
        have been (a lease is held at least stale_lease_s), so the warm path pays nothing."""
        late_s = workflow.now().timestamp() - lease.granted_at
        if late_s <= (lease.heartbeat_s or LEASE_HEARTBEAT_S):
            return True
        try:
            held: bool = await workflow.execute_local_activity(
                "confirm_lease",
                LeaseConfirmCall(pool=request.pool, lease_id=lease.lease_id, request_id=request.request_id),
                result_type=bool,
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=ADMIT_BUDGET,
                retry_policy=RetryPolicy(
                    non_retryable_error_types=[f for f in ALL_FAILURES if f != FailureClass.SCHEDULER_STATE_STALE.value]
                ),
                summary=f"confirm lease {lease.lease_id} ({late_s:.0f} s after its grant)",
            )
        except (ActivityError, ApplicationError) as error:
            cls, message = classify(error)
            self._end(cls)
            await self._withdraw(request, f"{cls}: could not confirm a late grant: {message}")
            raise failure(cls, f"could not confirm a grant that arrived {late_s:.0f} s late: {message}") from None
        return held

    async def _withdraw(self, request: RequestInput, reason: str) -> None:
        """Tell the scheduler this request no longer waits: a queued admission is dropped and a
        lease granted to it goes back (an admission the caller gave up on may still land)."""
        try:
            await workflow.get_external_workflow_handle(scheduler_id(request.pool)).signal(
                "cancel",
                CancelSignal(request_id=request.request_id, reason=reason, sent_at=workflow.now().timestamp()),
            )
        except Exception as error:  # no scheduler to tell: nothing of this request is there
            workflow.logger.info("withdrawal of %s not delivered: %s", request.request_id, error)

    async def _acquire(self, request: RequestInput, preempted: bool, submitted_at: float, acquisition: int) -> Lease:
        deadline_s = request.deadline_s
        if deadline_s is not None:
            # The deadline is the caller's, counted from its request's start (the client is
            # waiting since then), not from when the admission reaches the scheduler: only the
            # time left is asked for, first and again. The scheduler decides about a first ask
            # whose time is gone (a class that runs late is never refused for its deadline).
            left = workflow.info().workflow_start_time.timestamp() + deadline_s - workflow.now().timestamp()
            if left <= 0 and acquisition > 0:
                self._end(FailureClass.DEADLINE_CANNOT_BE_MET.value)
                raise failure(
                    FailureClass.DEADLINE_CANNOT_BE_MET,
                    f"its deadline of {deadline_s:g} s passed before it could be admitted again",
                )
            deadline_s = max(left, MIN_DEADLINE_S)
        admission = AdmissionRequest(
            request_id=request.request_id,
            workflow_id=workflow.info().workflow_id,
            capability=request.capability,
            tenant=request.tenant,
            priority=request.priority or None,
            deadline_s=deadline_s,
            lease_timeout_s=request.lease_timeout_s,
            preempted=preempted,
            submitted_at=submitted_at if preempted else None,
            max_duration_s=request.max_duration_s,
            admit_by=workflow.now().timestamp() + ADMIT_BUDGET.total_seconds() - ADMIT_MARGIN_S,
            end_user=request.end_user,
            input_bytes=request.input_bytes,
        )
        try:
            reply = await workflow.execute_local_activity(
                "admit",
                AdmitCall(
                    pool=request.pool,
                    request=admission,
                    update_id=f"admit:{workflow.info().workflow_id}:{request.request_id}:{acquisition}",
                ),
                result_type=AdmitReply,
                start_to_close_timeout=timedelta(seconds=10),
                schedule_to_close_timeout=ADMIT_BUDGET,
                # Only a scheduler that is still starting is worth asking again.
                retry_policy=RetryPolicy(
                    non_retryable_error_types=[f for f in ALL_FAILURES if f != FailureClass.SCHEDULER_STATE_STALE.value]
                ),
                summary=f"admit {request.capability}",
            )
        except (ActivityError, ApplicationError) as error:
            # A failed local activity arrives as its ApplicationError itself (SDK 1.35), not
            # wrapped in an ActivityError as a regular activity's failure is.
            cls, message = classify(error)
            self._end(cls)
            await self._withdraw(request, f"{cls}: the admission call failed: {message}")
            await self._record_unseen_failure(request, cls, message, acquisition)
            raise failure(cls, message) from None
        if reply.status == "granted" and reply.lease is not None:
            granted: Lease = reply.lease
            return granted
        if reply.status == "rejected":
            self._end(reply.failure or FailureClass.CAPABILITY_UNAVAILABLE.value)
            raise failure(reply.failure or FailureClass.CAPABILITY_UNAVAILABLE, reply.message)
        self._phase = "queued"
        # Not the deadline: the scheduler refuses at the deadline (or, for a run_late class, runs
        # it late); the requester waits for its word until the lease timeout.
        limit, cls = request.lease_timeout_s or DEFAULT_LEASE_TIMEOUT_S, FailureClass.LEASE_TIMEOUT
        try:
            # The scheduler answers at its own timeout; this is the requester's promise to itself.
            await workflow.wait_condition(lambda: self._decision is not None, timeout=limit + 5.0)
        except TimeoutError:
            await workflow.get_external_workflow_handle(scheduler_id(request.pool)).signal(
                "cancel",
                CancelSignal(
                    request_id=request.request_id,
                    reason=f"{cls.value}: gave up after {limit} s",
                    sent_at=workflow.now().timestamp(),
                ),
            )
            self._end(cls.value)
            raise failure(cls, f"no lease within {limit:.0f} s") from None
        decision = self._decision
        assert decision is not None
        if decision.lease is None:
            self._end(decision.failure or FailureClass.LEASE_TIMEOUT.value)
            raise failure(decision.failure or FailureClass.LEASE_TIMEOUT, decision.message)
        return decision.lease

    async def _record_unseen_failure(self, request: RequestInput, cls: str, message: str, acquisition: int) -> None:
        """The scheduler never took this admission (not running, still starting, or the call
        failed), so no scheduler event tells it: record it durably without waiting for the write."""
        info = workflow.info()
        event = EventRecord(
            event_id=str(workflow.uuid4()),
            at=workflow.now().timestamp(),
            kind="admission_failed",
            failure_class=cls,
            request_id=request.request_id,
            workflow_id=info.workflow_id,
            message=message,
            payload={
                "capability": request.capability[:200],
                "tenant": request.tenant[:200],
                "pool": request.pool,
                "input_bytes": request.input_bytes,
            },
        )
        try:
            await workflow.start_child_workflow(
                RecordEventsWorkflow.run,
                [event],
                # From the input, not the run: the same id whatever the workflow id (replays too).
                id=f"events:{request_workflow_id(request.capability, request.request_id)}:{acquisition}",
                task_queue=CONTROL_TASK_QUEUE,
                parent_close_policy=workflow.ParentClosePolicy.ABANDON,
                static_summary=f"record {cls} of {request.request_id}",
            )
        except Exception as error:  # already started by an earlier attempt of this workflow task
            workflow.logger.warning("event write not started: %s", error)

    def _end(self, outcome: str) -> None:
        self._phase = "failed"
        workflow.upsert_search_attributes([sa.OUTCOME.value_set(outcome)])


def _may_claim(request: RequestInput) -> bool:
    """A plain invoke may run on a slot of the node whose worker runs its workflow (its client
    routed it there); a worker with no slots (the control worker) answers None at once. Asked
    of every such request, not only of those on a node's queue: a replay runs on a queue of its
    own, and must take the same path."""
    return request.operation == ""


def _gang_nodes(lease: Lease) -> dict[str, list[str]]:
    """A gang lease's cards by node, in the lease's order: the position of a node is its rank."""
    by_node: dict[str, list[str]] = {}
    for accelerator, node in zip(lease.accelerators, lease.nodes, strict=True):
        by_node.setdefault(node, []).append(accelerator)
    return by_node


__all__ = ["ApplicationError", "CapabilityRequestWorkflow"]
