"""The Temporal contract's names in one place: task queues and workflow ids (the signals,
updates, queries and activities a workflow calls are checked against their handlers by
tests/unit/test_temporal_names.py). Workflow code, workers, the client, the CLI and the gateway
all build ids and queues here, never by hand."""

from __future__ import annotations

# Request workflows, the store and catalog activities, the admission call.
CONTROL_TASK_QUEUE = "modelforge-control"
# The pool schedulers' own task queue (served by the control worker process): a backlog of
# request workflows on the control queue never delays an admission.
SCHEDULER_TASK_QUEUE = "modelforge-scheduler"
NODE_TASK_QUEUE_PREFIX = "modelforge-node-"
DEFAULT_POOL = "default"

# The workflow types, as each workflow registers itself (`@workflow.defn(name=...)`) and as
# visibility queries name them.
REQUEST_WORKFLOW_TYPE = "CapabilityRequestWorkflow"
SCHEDULER_WORKFLOW_TYPE = "PoolSchedulerWorkflow"
RESIDENCY_WORKFLOW_TYPE = "ResidencyWorkflow"
TELEMETRY_WORKFLOW_TYPE = "TelemetryWorkflow"
RECORD_EVENTS_WORKFLOW_TYPE = "RecordEventsWorkflow"
# The running pool schedulers, from Temporal visibility.
RUNNING_SCHEDULERS = f"WorkflowType='{SCHEDULER_WORKFLOW_TYPE}' AND ExecutionStatus='Running'"

# Workflow id prefixes: the ids below are built from them, and read back with the parsers.
SCHEDULER_ID_PREFIX = "scheduler:"
REQUEST_ID_PREFIX = "request:"
RESIDENT_ID_PREFIX = "resident:"
TELEMETRY_ID_PREFIX = "telemetry:"


def node_task_queue(node: str) -> str:
    """A node's own queue: its activities (NVML, the runtimes) and the request workflows routed to it."""
    return f"{NODE_TASK_QUEUE_PREFIX}{node}"


def scheduler_id(pool: str) -> str:
    """The pool's singleton scheduler (PoolSchedulerWorkflow)."""
    return f"{SCHEDULER_ID_PREFIX}{pool}"


def pool_of_scheduler(workflow_id: str) -> str | None:
    """The pool a scheduler's workflow id names; None for any other workflow."""
    return workflow_id.removeprefix(SCHEDULER_ID_PREFIX) if workflow_id.startswith(SCHEDULER_ID_PREFIX) else None


def resident_workflow_id(deployment: str, accelerator: str, generation: int) -> str:
    """One ResidencyWorkflow per load: a reload never collides with the previous one closing."""
    return f"{RESIDENT_ID_PREFIX}{deployment}:{accelerator}:{generation}"


def telemetry_id(node: str) -> str:
    return f"{TELEMETRY_ID_PREFIX}{node}"


def request_workflow_id(capability: str, request_id: str) -> str:
    """A request's workflow: its request id is the idempotency key (a retried start attaches)."""
    return f"{REQUEST_ID_PREFIX}{capability}:{request_id}"


def is_request_workflow_id(workflow_id: str, request_id: str | None = None) -> bool:
    """Whether `workflow_id` is a request's workflow (of `request_id`, when given)."""
    if not workflow_id.startswith(REQUEST_ID_PREFIX):
        return False
    return request_id is None or workflow_id.endswith(f":{request_id}")
