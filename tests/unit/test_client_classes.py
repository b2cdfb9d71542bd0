"""The client refuses a malformed class or queue before anything is sent (the scheduler checks
the names against the catalog's queues); no Temporal call is made for these."""

from __future__ import annotations

from typing import Any, cast

import pytest
from temporalio.client import Client

from modelforge.client import ModelForgeClient, Result


@pytest.mark.parametrize(
    ("priority", "queue", "message"),
    [
        (None, "merge", "a queue needs a level: --queue merge --priority critical"),
        ("merge.critical", "merge", "a queue needs a level"),
        ("critical", "Merge Queue", "queue 'Merge Queue' is not a queue name"),
        ("Critical!", None, "priority 'Critical!' is not a class name"),
        ("merge.critical.now", None, "is not a class name"),
    ],
)
async def test_malformed_classes_are_refused_before_anything_is_sent(
    priority: str | None, queue: str | None, message: str
) -> None:
    # Never used: every case returns before the first call to Temporal.
    client = ModelForgeClient(cast(Client, None))
    result = await client.request("merge.job@1", {}, priority=priority, queue=queue, tenant="merge-team")
    assert not result.ok and result.failure_class == "REQUEST_INVALID"
    assert message in result.message


def _nested(depth: int) -> dict[str, object]:
    value: object = []
    for _ in range(depth):
        value = [value]
    return {"texts": value}


def _shared(levels: int) -> dict[str, object]:
    """Small in memory, enormous when encoded: each level lists the one below 64 times."""
    value: object = ["x"]
    for _ in range(levels):
        value = [value] * 64
    return {"texts": value}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # Identifiers: the rules of modelforge/identifiers.py, whole-string (no `$` before "\n").
        ({"tenant": 123}, "tenant must be a string, not int"),
        ({"tenant": "t" * 3000}, "tenant is 3000 characters; at most 64"),
        ({"tenant": "rag\n"}, "tenant 'rag\\\\x0a' is not valid"),
        ({"tenant": ""}, "tenant '' is not valid"),
        ({"request_id": "r1\n"}, "request_id 'r1\\\\x0a' is not valid"),
        ({"request_id": "r" * 129}, "request_id is 129 characters"),
        ({"request_id": 7}, "request_id must be a string, not int"),
        ({"capability": "rag.embedding@1\n"}, "capability 'rag.embedding@1\\\\x0a' is not valid"),
        ({"capability": None}, "capability must be a string, not NoneType"),
        ({"capability": "名前@1"}, "capability"),
        # Input that would exhaust the encoder's recursion, or expand without end.
        ({"input": _nested(5000)}, "input nests deeper than 64 levels"),
        ({"input": _nested(65)}, "input nests deeper than 64 levels"),
        ({"input": _shared(6)}, "items"),
        ({"input": {"x": float("nan")}}, "input is not JSON"),
        # Other arguments of the wrong type.
        ({"priority": 5}, "priority must be a string, not int"),
        ({"priority": "interactive\n"}, "is not a class name"),
        ({"queue": "merge\n", "priority": "critical"}, "is not a queue name"),
        ({"deadline_s": "soon"}, "deadline_s must be between 0 and 604800 seconds"),
        ({"lease_timeout_s": True}, "lease_timeout_s must be between 0 and 604800 seconds"),
        ({"deadline_s": float("nan")}, "deadline_s must be between"),
    ],
)
async def test_bad_identifiers_and_inputs_are_request_invalid_without_a_call(
    kwargs: dict[str, Any], message: str
) -> None:
    client = ModelForgeClient(cast(Client, None))  # never used: each case returns before any call
    arguments: dict[str, Any] = {"capability": "rag.embedding@1", "input": {}, "tenant": "rag", **kwargs}
    capability = arguments.pop("capability")
    payload = arguments.pop("input")
    result = await client.request(capability, payload, **arguments)
    assert isinstance(result, Result) and not result.ok
    assert result.failure_class == "REQUEST_INVALID", result
    assert message in result.message, result.message
    assert isinstance(result.request_id, str) and isinstance(result.capability, str)


def test_a_valid_input_at_the_depth_limit_is_not_refused_for_its_shape() -> None:
    from modelforge.client import MAX_INPUT_DEPTH, input_shape_problem

    # _nested(n): the object, n lists around an empty list: n + 2 containers.
    assert input_shape_problem(_nested(MAX_INPUT_DEPTH - 2)) is None  # 64 levels
    assert input_shape_problem(_nested(MAX_INPUT_DEPTH - 1)) is not None  # 65


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"operation": 5}, "unknown operation '5'"),
        ({"operation": "reboot"}, "unknown operation 'reboot'"),
        ({"input": {"modelforge_operation": "profile"}}, "reserved for ModelForge"),
    ],
)
async def test_operations_come_from_the_argument_never_the_input(kwargs: dict[str, Any], message: str) -> None:
    client = ModelForgeClient(cast(Client, None))
    arguments: dict[str, Any] = {"input": {}, "tenant": "rag", **kwargs}
    result = await client.request("rag.embedding@1", **arguments)
    assert result.failure_class == "REQUEST_INVALID" and message in result.message, result
