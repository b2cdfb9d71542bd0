"""The client refuses a malformed class or queue before anything is sent (the scheduler checks
the names against the catalog's queues); no Temporal call is made for these."""

from __future__ import annotations

from typing import cast

import pytest
from temporalio.client import Client

from modelforge.client import ModelForgeClient


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
