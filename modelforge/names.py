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


def node_task_queue(node: str) -> str:
    """A node's own queue: its activities (NVML, the runtimes) and the request workflows routed to it."""
    return f"{NODE_TASK_QUEUE_PREFIX}{node}"


def scheduler_id(pool: str) -> str:
    """The pool's singleton scheduler (PoolSchedulerWorkflow)."""
    return f"scheduler:{pool}"


def resident_workflow_id(deployment: str, accelerator: str, generation: int) -> str:
    """One ResidencyWorkflow per load: a reload never collides with the previous one closing."""
    return f"resident:{deployment}:{accelerator}:{generation}"


def telemetry_id(node: str) -> str:
    return f"telemetry:{node}"


def request_workflow_id(capability: str, request_id: str) -> str:
    """A request's workflow: its request id is the idempotency key (a retried start attaches)."""
    return f"request:{capability}:{request_id}"
