"""A request id is the request's idempotency key: the client attaches to the
workflow `request:<capability>:<request_id>` instead of starting new work, and rides out a
Temporal outage (its start, or its wait for the result) to report what the request really did.
During a restart the client used to answer `CAPABILITY_UNAVAILABLE: Temporal refused the request`
for requests that then completed on the server, so a caller that retried did the work twice."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import (
    Client,
    Interceptor,
    OutboundInterceptor,
    StartWorkflowInput,
    WorkflowHandle,
)
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient, Result, SyncModelForgeClient
from modelforge.policy import PoolStatus
from modelforge.settings import Settings
from modelforge.temporal import WORKER_RETRY, register_search_attributes
from tests.worker_process import free_port
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "burst.toml"
CAPABILITY = "bench.embed@1"


async def _runs(client: Client, request_id: str, expected: int) -> int:
    """How many runs the request's workflow id has (visibility trails by a moment)."""
    query = f'WorkflowId = "request:{CAPABILITY}:{request_id}"'
    count = 0
    for _ in range(20):
        count = len([run async for run in client.list_workflows(query)])
        if count >= expected:
            await asyncio.sleep(0.5)  # and no more appear
            return len([run async for run in client.list_workflows(query)])
        await asyncio.sleep(0.25)
    return count


def _lease_id(result: Result) -> str:
    assert result.ok and result.lease is not None, result
    return result.lease.lease_id


async def test_the_same_request_id_is_one_workflow_and_one_outcome(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        client = ModelForgeClient(stack.client)
        ask: dict[str, Any] = {"tenant": "bench", "request_id": "same-1"}
        # Twice at once: the second start attaches to the running workflow (USE_EXISTING).
        first, second = await asyncio.gather(
            client.request(CAPABILITY, {"simulate_invoke_s": 1}, **ask),
            client.request(CAPABILITY, {"simulate_invoke_s": 1}, **ask),
        )
        assert _lease_id(first) == _lease_id(second)
        assert first.output == second.output and first.workflow_id == second.workflow_id
        # Again once it succeeded: its recorded result, no new work.
        third = await client.request(CAPABILITY, {"simulate_invoke_s": 1}, **ask)
        assert _lease_id(third) == _lease_id(first)
        assert await _runs(stack.client, "same-1", 1) == 1
        # Another tenant naming the same request id attaches to nothing and learns nothing.
        other = await client.request(CAPABILITY, {"simulate_invoke_s": 1}, tenant="default", request_id="same-1")
        assert (other.ok, other.failure_class, other.output) == (False, "REQUEST_INVALID", None)
        assert "another tenant" in other.message and "bench" not in other.message
        # Grants reach the event log within about 5 s (lazy event writes): a second one would by then.
        grants = [e for e in await stack.events("lease_granted", 2, within_s=8) if e["request_id"] == "same-1"]
        assert len(grants) == 1, grants


async def test_a_failed_request_is_run_again_when_asked_again(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        client = ModelForgeClient(stack.client)
        # Above the tenant's ceiling (interactive): the scheduler refuses it, the workflow fails.
        ask: dict[str, Any] = {"tenant": "bench", "request_id": "refused-1", "priority": "production"}
        first = await client.request(CAPABILITY, {}, **ask)
        second = await client.request(CAPABILITY, {}, **ask)
        assert first.failure_class == second.failure_class == "REQUEST_INVALID", (first, second)
        assert await _runs(stack.client, "refused-1", 2) == 2  # only a failure is run again


class _LoseStartAnswers(Interceptor):
    """The start reaches the server and the workflow runs, but the answer is lost on the way
    back (as when Temporal restarts between the two): the client sees UNAVAILABLE."""

    def __init__(self, times: int, delay_s: float = 0.0) -> None:
        self.left = times
        self.delay_s = delay_s

    def intercept_client(self, next: OutboundInterceptor) -> OutboundInterceptor:
        return _LosingOutbound(next, self)


class _LosingOutbound(OutboundInterceptor):
    def __init__(self, next: OutboundInterceptor, root: _LoseStartAnswers) -> None:
        super().__init__(next)
        self.root = root

    async def start_workflow(self, input: StartWorkflowInput) -> WorkflowHandle[Any, Any]:
        handle = await super().start_workflow(input)
        if self.root.left > 0:
            self.root.left -= 1
            await asyncio.sleep(self.root.delay_s)
            raise RPCError("connection reset (test: the start's answer is lost)", RPCStatusCode.UNAVAILABLE, b"")
        return handle


def _losing_client(client: Client, interceptor: _LoseStartAnswers) -> Client:
    config = client.config()
    config["interceptors"] = [interceptor]
    return Client(**config)


async def test_a_lost_start_answer_attaches_to_the_started_workflow(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        lossy = _LoseStartAnswers(times=2)
        client = ModelForgeClient(_losing_client(stack.client, lossy))
        result = await client.request(CAPABILITY, {"simulate_invoke_s": 1}, tenant="bench", request_id="lost-1")
        assert result.ok, result
        assert lossy.left == 0
        assert await _runs(stack.client, "lost-1", 1) == 1

        # The run failed before the retried start arrived: its failure is the answer, not a
        # second run (the caller did not ask again; only its connection failed).
        lossy = _LoseStartAnswers(times=1, delay_s=3.0)
        client = ModelForgeClient(_losing_client(stack.client, lossy))
        refused = await client.request(
            CAPABILITY, {}, tenant="bench", priority="production", request_id="lost-and-failed"
        )
        assert refused.failure_class == "REQUEST_INVALID", refused
        assert await _runs(stack.client, "lost-and-failed", 1) == 1


async def _server(port: int, db_file: Path) -> WorkflowEnvironment:
    return await WorkflowEnvironment.start_local(
        dev_server_existing_path=str(Path(sys.executable).parent / "temporal"),
        port=port,
        dev_server_log_level="error",
        dev_server_extra_args=["--db-filename", str(db_file)],
    )


async def test_the_real_outcome_is_reported_through_a_temporal_restart(database_url: str, tmp_path: Path) -> None:
    port = free_port()
    db_file = tmp_path / "temporal.db"
    first = await _server(port, db_file)
    second: WorkflowEnvironment | None = None
    try:
        await register_search_attributes(first.client)
        target = first.client.service_client.config.target_host
        workers = await Client.connect(target, retry_config=WORKER_RETRY)
        async with running_stack(workers, database_url, catalog_path=CATALOG) as stack:
            await (await stack.start_request(CAPABILITY, tenant="bench")).result()  # loads the model
            # The caller's own connection as the CLI makes it: the SDK's default retries (10 s).
            caller = ModelForgeClient(await Client.connect(target))
            in_flight = asyncio.create_task(
                caller.request(CAPABILITY, {"simulate_invoke_s": 3}, tenant="bench", request_id="in-flight")
            )
            handle = workers.get_workflow_handle(f"request:{CAPABILITY}:in-flight")
            for _ in range(50):  # started, and waiting on its result
                try:
                    await handle.describe()
                    break
                except RPCError:
                    await asyncio.sleep(0.1)
            await asyncio.sleep(0.5)
            await first.shutdown()  # the server goes away mid-wait; its state is in the file
            # Started while the server is away: the start itself is retried.
            during = asyncio.create_task(
                caller.request(CAPABILITY, {"simulate_invoke_s": 1}, tenant="bench", request_id="during-outage")
            )
            await asyncio.sleep(12.0)  # longer than the SDK's own retries
            assert not in_flight.done() and not during.done()
            second = await _server(port, db_file)
            results = await asyncio.wait_for(asyncio.gather(in_flight, during), timeout=180)
            for result in results:
                assert result.ok, result
            assert results[0].output and results[0].output.get("simulated")
            for request_id in ("in-flight", "during-outage"):
                assert await _runs(workers, request_id, 1) == 1
    finally:
        if second is not None:
            await second.shutdown()


async def test_a_script_without_asyncio_uses_the_blocking_client(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    """`SyncModelForgeClient` (README: "for scripts"), called from plain functions: a request, its
    repeat by request id attaching to the same outcome, the pool's status; `with` closes it."""
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        address = stack.client.service_client.config.target_host
        settings = Settings.from_env({"MODELFORGE_TEMPORAL_ADDRESS": address})

        def script() -> tuple[Result, Result, PoolStatus]:
            with SyncModelForgeClient(settings, "default") as client:
                ask: dict[str, Any] = {"tenant": "bench", "request_id": "script-1"}
                first = client.request(CAPABILITY, {"text": "from a script"}, **ask)
                again = client.request(CAPABILITY, {"text": "from a script"}, **ask)
                return first, again, client.status()

        first, again, status = await asyncio.to_thread(script)
        assert first.output and _lease_id(first) == _lease_id(again), (first, again)
        assert status.pool == "default" and CAPABILITY in [r.capability for r in status.residents]
