"""The payload store's integrity and retention: a stored payload
damaged on disk with its size unchanged is set aside on read and written anew by the next store
of the same content, clients never see the server's directory, and the sweep keeps a running
request's input for as long as the longest request may run."""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.workflowservice.v1 import DescribeNamespaceResponse
from temporalio.client import Client
from temporalio.converter import StorageDriverRetrieveContext, StorageDriverStoreContext

from modelforge.identifiers import MAX_DURATION_S, MAX_WAIT_S
from modelforge.payloads import (
    OUTPUT_REF,
    FilesystemPayloadStore,
    PayloadConverter,
    PayloadCorrupt,
    PayloadMissing,
    get_output,
    put_output,
    retention_s,
    sweep,
)

DAY = 86400.0


def _damage_in_place(path: Path) -> None:
    """One byte changed, the size kept (a bit flip, a torn write of the same length)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    os.chmod(path, 0o600)
    path.write_bytes(bytes(data))


def test_a_large_answer_damaged_in_place_is_set_aside_and_the_next_identical_answer_rewrites_it(
    tmp_path: Path,
) -> None:
    store = FilesystemPayloadStore(tmp_path / "payloads")
    answer: dict[str, Any] = {"text": "x" * 400_000}
    ref = put_output(store, answer)
    sha = ref[OUTPUT_REF]["sha256"]
    _damage_in_place(store.path_for(sha))
    with pytest.raises(PayloadCorrupt, match="does not match its sha256") as corrupt:
        get_output(store, ref)
    # The client (and the gateway's 503 body) gets the digest, never the server's directory.
    assert str(tmp_path) not in corrupt.value.message and sha in corrupt.value.message
    assert corrupt.value.type == "CAPABILITY_UNAVAILABLE"
    # The same answer again (another request, a retry): stored anew, read back whole. Before,
    # the same size counted as "already there" and every later read failed for good.
    assert put_output(store, answer) == ref
    assert get_output(store, ref) == answer
    # The damaged copy is kept aside for an operator until the sweep's retention passes.
    [aside] = [p for p in store.path_for(sha).parent.iterdir() if p.name.startswith(".corrupt-")]
    os.utime(aside, (time.time() - 7200, time.time() - 7200))
    assert sweep(store.root, older_than_s=3600) == 1 and not aside.exists()


async def test_a_workflow_payload_damaged_in_place_heals_on_the_next_store(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path / "payloads")
    payload = Payload(metadata={"encoding": b"json/plain"}, data=b'{"text": "' + b"y" * 50_000 + b'"}')
    claims = await store.store(StorageDriverStoreContext(), [payload])
    _damage_in_place(store.path_for(str(claims[0].claim_data["sha256"])))
    [bad] = await store.retrieve(StorageDriverRetrieveContext(), claims)
    with pytest.raises(PayloadMissing, match="does not match") as missing:
        PayloadConverter().from_payloads([bad])
    assert str(tmp_path) not in missing.value.message
    assert await store.store(StorageDriverStoreContext(), [payload]) == claims
    [back] = await store.retrieve(StorageDriverRetrieveContext(), claims)
    assert back == payload


async def test_a_missing_payload_names_no_server_path(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path / "payloads")
    ref = {OUTPUT_REF: {"sha256": "ab" * 32, "size": 10}}
    with pytest.raises(PayloadMissing, match="MODELFORGE_PAYLOAD_DIR") as missing:
        get_output(store, ref)
    assert str(tmp_path) not in missing.value.message


def _namespace_with_retention(days: float) -> Client:
    described = DescribeNamespaceResponse()
    described.config.workflow_execution_retention_ttl.FromTimedelta(timedelta(days=days))

    async def describe_namespace(request: object) -> DescribeNamespaceResponse:
        return described

    return cast(
        Client,
        SimpleNamespace(namespace="default", workflow_service=SimpleNamespace(describe_namespace=describe_namespace)),
    )


@pytest.mark.parametrize("configured_days", [None, 1.0])
async def test_retention_outlasts_the_longest_lease_so_a_long_jobs_input_survives_a_late_replay(
    tmp_path: Path, configured_days: float | None
) -> None:
    keep_s = await retention_s(_namespace_with_retention(1.0), configured_days)
    # The longest wait for admission and the longest lease (one limit for every entrance and the
    # scheduler) plus a margin.
    assert keep_s > MAX_WAIT_S + MAX_DURATION_S + DAY / 2
    # A job's input stored at its start, its lease of the scheduler's longest, then a replay:
    # the hourly sweeps in between never removed it.
    store = FilesystemPayloadStore(tmp_path / "payloads")
    ref = put_output(store, {"text": "z" * 400_000})
    started = time.time()
    path = store.path_for(ref[OUTPUT_REF]["sha256"])
    os.utime(path, (started, started))
    assert sweep(store.root, keep_s, now=started + MAX_DURATION_S) == 0 and path.exists()


async def test_a_longer_configured_retention_is_kept(tmp_path: Path) -> None:
    assert await retention_s(_namespace_with_retention(1.0), 400.0) == 400 * DAY
    assert await retention_s(_namespace_with_retention(90.0), None) > 90 * DAY + MAX_DURATION_S
