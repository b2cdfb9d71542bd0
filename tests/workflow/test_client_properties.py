"""Hypothesis against the client on a running stack: whatever identifiers and
input a caller passes, `ModelForgeClient.request` returns a Result (success, or a typed refusal:
REQUEST_INVALID, or CAPABILITY_UNAVAILABLE for a well-formed capability the catalog lacks) and
never raises; and the next ordinary request still succeeds."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient, Result
from modelforge.identifiers import identifier_problem
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CATALOG = Path(__file__).parent.parent / "catalogs" / "burst.toml"
CAPABILITY = "bench.embed@1"

NASTY = st.sampled_from(
    [
        "",
        " ",
        "\n",
        "bench\n",
        "bench.embed@1\n",
        "r1\n",
        "'; DROP TABLE events; --",
        "$(rm -rf /)",
        "bench\x00",
        "\u202eevil",
        "名前@1",
        "\ud800",
        "t" * 3000,
        "a" * 65,
        "x@1@2",
    ]
)


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20)
    | NASTY
)
JSON = st.recursive(
    JSON_LEAVES,
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=6,
)
IDENTIFIERS = {
    "capability": st.one_of(st.just(CAPABILITY), NASTY, st.text(max_size=30), st.integers(), st.none()),
    "tenant": st.one_of(st.just("bench"), NASTY, st.text(max_size=30), st.integers(), st.just(["bench"])),
    "request_id": st.one_of(st.none(), st.uuids().map(lambda u: u.hex), NASTY, st.text(max_size=30), st.integers()),
}
INPUTS = st.one_of(
    st.none(),
    st.dictionaries(st.text(max_size=8), JSON, max_size=3),
    st.integers(1, 3000).map(lambda depth: {"texts": _nested(depth)}),
    JSON,
)
OTHER = {
    "priority": st.one_of(st.none(), st.just("interactive"), st.just("background"), NASTY, st.integers()),
    # Sound deadlines are long (a short one may rightly end DEADLINE_CANNOT_BE_MET); the rest are not.
    "deadline_s": st.one_of(
        st.none(),
        st.just(60.0),
        st.floats(max_value=0.0),
        st.floats(min_value=604_800.5),
        st.sampled_from([float("nan"), float("inf"), "soon", True, [60]]),
    ),
}


async def test_the_client_never_raises_and_the_next_request_succeeds(
    dev_server_env: WorkflowEnvironment, database_url: str
) -> None:
    async with running_stack(dev_server_env.client, database_url, catalog_path=CATALOG) as stack:
        client = ModelForgeClient(stack.client)
        client.reattach_s = 10.0  # a test stack that stops answering fails fast
        loop = asyncio.get_running_loop()
        assert (await client.request(CAPABILITY, {}, tenant="bench")).ok  # the model is loaded

        def call(**kwargs: Any) -> Result:
            # The workers run on the test's event loop; hypothesis drives from a thread.
            return asyncio.run_coroutine_threadsafe(client.request(**kwargs), loop).result(timeout=60)

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(
            capability=IDENTIFIERS["capability"],
            tenant=IDENTIFIERS["tenant"],
            request_id=IDENTIFIERS["request_id"],
            payload=INPUTS,
            priority=OTHER["priority"],
            deadline_s=OTHER["deadline_s"],
        )
        def prop(capability: Any, tenant: Any, request_id: Any, payload: Any, priority: Any, deadline_s: Any) -> None:
            result = call(
                capability=capability,
                input=payload,
                tenant=tenant,
                request_id=request_id,
                priority=priority,
                deadline_s=deadline_s,
            )
            assert isinstance(result, Result)
            well_formed = all(
                identifier_problem(kind, value) is None
                for kind, value in (("capability", capability), ("tenant", tenant))
            ) and (request_id is None or identifier_problem("request_id", request_id) is None)
            if result.ok:
                assert well_formed and capability == CAPABILITY and tenant == "bench", result
            elif result.failure_class == "CAPABILITY_UNAVAILABLE":
                assert well_formed and capability != CAPABILITY, result  # not in the catalog
            else:
                assert result.failure_class == "REQUEST_INVALID", result
                assert result.message
            # The next ordinary request still succeeds.
            assert call(capability=CAPABILITY, input={}, tenant="bench").ok

        await asyncio.to_thread(prop)
