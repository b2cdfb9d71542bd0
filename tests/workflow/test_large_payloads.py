"""Large payloads out of the event history (modelforge/payloads.py): a request's input and
answer of any size up to MODELFORGE_MAX_PAYLOAD_BYTES go through the payload store, the request
workflow's history stays small, and an input past the maximum is refused before any workflow."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
from temporalio.api.common.v1 import Payload
from temporalio.api.history.v1 import History
from temporalio.client import Client
from temporalio.converter import (
    DataConverter,
    StorageDriverClaim,
    StorageDriverRetrieveContext,
    StorageDriverSelectContext,
    StorageDriverStoreContext,
    StorageDriverWorkflowInfo,
)
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import WorkflowEnvironment

from modelforge import payloads
from modelforge.client import ModelForgeClient
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import MAX_INPUT_BYTES, RequestInput
from modelforge.payloads import (
    DRIVER_NAME,
    LARGE_PAYLOAD_BYTES,
    MISSING_ENCODING,
    OUTPUT_REF,
    FilesystemPayloadStore,
    PayloadConverter,
    PayloadMissing,
    PayloadStoreError,
    data_converter,
    external_storage,
    input_limit,
    sweep,
    with_payload_store,
)
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES, Settings
from modelforge.temporal import converter
from tests.cli_process import run_cli
from workers.stack import running_stack

pytestmark = pytest.mark.workflow

CPU_CATALOG = Path(__file__).resolve().parents[1] / "catalogs" / "cpu_embedding.toml"

HISTORY_LIMIT = 16 * 1024


def _client(env: WorkflowEnvironment, root: Path) -> Client:
    return with_payload_store(env.client, root, DEFAULT_PAYLOAD_THRESHOLD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES)


async def _history_bytes(client: Client, workflow_id: str) -> int:
    """The serialized size of the workflow's event history, as the server stores it."""
    history = await client.get_workflow_handle(workflow_id).fetch_history()
    return History(events=history.events).ByteSize()


@dataclasses.dataclass(frozen=True)
class _Inner:
    when: datetime
    kind: FailureClass
    values: tuple[float, ...]


@dataclasses.dataclass(frozen=True)
class _Outer:
    name: str
    inner: _Inner
    by_key: dict[str, _Inner]
    items: list[_Inner | None]
    tags: frozenset[str]


def test_the_converter_writes_the_sdk_defaults_bytes() -> None:
    """Inline payloads are exactly as before (recorded histories replay; older workers read them)."""
    inner = _Inner(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), FailureClass.GPU_OOM, (1.5, 2.0, float("1e-300")))
    values: list[object] = [
        _Outer("o", inner, {"b": inner, "a": inner}, [inner, None], frozenset({"x"})),
        RequestInput(request_id="r", capability="c@1", input={"texts": ["a", "é", "\u0000"], "n": 1}),
        {"plain": [1, 2.5, None, True]},
        b"bytes",
        None,
    ]
    ours = data_converter(Path("/nonexistent"), 2048, 1).payload_converter.to_payloads(values)
    assert ours == DataConverter.default.payload_converter.to_payloads(values)


async def test_the_store_is_content_addressed_and_checked(tmp_path: Path) -> None:
    store = FilesystemPayloadStore(tmp_path)
    payload = Payload(metadata={"encoding": b"json/plain"}, data=b'{"text": "' + b"x" * 100_000 + b'"}')
    first = await store.store(StorageDriverStoreContext(), [payload])
    again = await store.store(StorageDriverStoreContext(), [payload])  # a retry: nothing new
    assert first == again
    claim = first[0].claim_data
    data = payload.SerializeToString(deterministic=True)
    assert claim["sha256"] == hashlib.sha256(data).hexdigest()
    assert claim["size"] == str(len(data)) and claim["encoding"] == "json/plain"
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [claim["sha256"]]
    [back] = await store.retrieve(StorageDriverRetrieveContext(), first)
    assert back == payload
    # A changed file is an error, never a wrong answer; a forged claim names no path outside.
    store.path_for(claim["sha256"]).write_bytes(data + b"!")
    [changed] = await store.retrieve(StorageDriverRetrieveContext(), first)
    assert changed.metadata["encoding"] == MISSING_ENCODING
    with pytest.raises(PayloadMissing, match="does not match") as missing:
        PayloadConverter().from_payloads([changed])
    assert missing.value.type == "CAPABILITY_UNAVAILABLE" and missing.value.non_retryable
    with pytest.raises(PayloadStoreError, match="not a payload reference"):
        await store.retrieve(StorageDriverRetrieveContext(), [StorageDriverClaim({"sha256": "../../etc/passwd"})])
    # The changed file was set aside: storing the same payload again writes it anew.
    assert await store.store(StorageDriverStoreContext(), [payload]) == first
    assert await store.retrieve(StorageDriverRetrieveContext(), first) == [payload]
    for aside in store.path_for(claim["sha256"]).parent.glob(".corrupt-*"):
        aside.unlink()
    # Retention: what was not stored (or stored again) within the period is removed.
    path = store.path_for(claim["sha256"])
    os.utime(path, (time.time() - 7200, time.time() - 7200))
    assert sweep(tmp_path, older_than_s=3600) == 1 and not path.exists()
    [gone] = await store.retrieve(StorageDriverRetrieveContext(), first)
    with pytest.raises(PayloadMissing, match="MODELFORGE_PAYLOAD_DIR"):
        PayloadConverter().from_payloads([gone])


async def test_a_request_whose_input_the_workers_cannot_read_fails_typed_and_at_once(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    # The client writes its large input to a payload directory the workers do not share (a
    # client on another host without the shared filesystem): the request fails with its class,
    # rather than its workflow task retrying forever on a file that will not appear.
    workers = _client(dev_server_env, tmp_path / "workers")
    elsewhere = _client(dev_server_env, tmp_path / "elsewhere")
    async with running_stack(workers, database_url) as stack:
        caller = ModelForgeClient(elsewhere)
        started = time.monotonic()
        result = await caller.request("rag.embedding@1", {"text": "x" * 50_000}, tenant="rag")
        assert not result.ok and result.failure_class == "CAPABILITY_UNAVAILABLE", result
        assert "MODELFORGE_PAYLOAD_DIR" in result.message
        assert time.monotonic() - started < 30
        # The pool serves on: the same input from a client that shares the directory succeeds.
        ok = await ModelForgeClient(stack.client).request("rag.embedding@1", {"text": "x" * 50_000}, tenant="rag")
        assert ok.ok, ok


async def test_a_2048_input_batch_and_inputs_of_any_size_keep_the_history_small(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "payloads"
    client = _client(dev_server_env, root)
    sizes: dict[str, int] = {}
    async with running_stack(client, database_url) as stack:
        caller = ModelForgeClient(stack.client)
        # OpenAI's embeddings API takes up to 2,048 inputs per call.
        texts = [f"passage {i}: a short text to index for retrieval" for i in range(2048)]
        result = await caller.request("rag.embedding@1", {"texts": texts}, tenant="rag", deadline_s=120)
        assert result.ok, (result.failure_class, result.message)
        assert result.output is not None and len(result.output["embeddings"]) == 2048
        sizes["2048 texts"] = await _history_bytes(stack.client, result.workflow_id)
        # An answer past LARGE_OUTPUT_BYTES (the simulated vectors are short: the limit is
        # lowered to reach it) is kept in the store by the node; the workflow only carries its
        # name (never decoded in a workflow task) and the client reads it back.
        monkeypatch.setattr(payloads, "LARGE_OUTPUT_BYTES", 64 * 1024)
        large = await caller.request("rag.embedding@1", {"texts": texts}, tenant="rag", deadline_s=120)
        assert large.ok and large.output == result.output, (large.failure_class, large.message)
        raw = await stack.client.get_workflow_handle(large.workflow_id).result()
        assert set(raw["output"]) == {OUTPUT_REF} and raw["output"][OUTPUT_REF]["size"] > 64 * 1024
        monkeypatch.undo()
        # 1.8 KB: the largest input that stays inline (its payload just under the threshold).
        for label, n in (("1 KB", 1_000), ("1.8 KB", 1_800), ("1 MB", 1_000_000), ("20 MB", 20_000_000)):
            result = await caller.request("rag.embedding@1", {"text": "x" * n}, tenant="rag", deadline_s=120)
            assert result.ok, (label, result.failure_class, result.message)
            sizes[label] = await _history_bytes(stack.client, result.workflow_id)
        # The reference in the history says what it is (the Temporal UI shows it as JSON).
        history = await stack.client.get_workflow_handle(result.workflow_id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes.input.payloads[0]
        assert started.metadata["encoding"] == b"json/protobuf"
        assert DRIVER_NAME.encode() in started.data and b"sha256" in started.data and b"size" in started.data
    print("request workflow history bytes:", sizes)
    assert all(size < HISTORY_LIMIT for size in sizes.values()), sizes
    assert any(root.rglob("*")), "nothing went to the payload store"


async def test_an_input_past_the_maximum_is_refused_before_any_workflow(
    dev_server_env: WorkflowEnvironment, tmp_path: Path
) -> None:
    client = _client(dev_server_env, tmp_path / "payloads")
    assert input_limit(client) == DEFAULT_MAX_PAYLOAD_BYTES
    assert input_limit(dev_server_env.client) == MAX_INPUT_BYTES  # no store: what fits inline
    caller = ModelForgeClient(client)
    result = await caller.request(
        "rag.embedding@1", {"text": "x" * DEFAULT_MAX_PAYLOAD_BYTES}, tenant="rag", request_id="too-large"
    )
    assert not result.ok and result.failure_class == "REQUEST_INVALID", result
    assert f"the limit is {DEFAULT_MAX_PAYLOAD_BYTES}" in result.message
    with pytest.raises(RPCError) as raised:
        await client.get_workflow_handle(result.workflow_id or "request:rag.embedding@1:too-large").describe()
    assert raised.value.status == RPCStatusCode.NOT_FOUND
    assert not any((tmp_path / "payloads").rglob("*"))


async def test_the_cli_embeds_2048_texts_with_the_real_minilm_on_the_cpu_device(
    dev_server_env: WorkflowEnvironment, database_url: str, tmp_path: Path
) -> None:
    """The report that started this: `modelforge request rag.embedding.cpu@1` with 600 texts
    failed with PayloadsTooLarge as RUNTIME_CRASH (a 600 x 384 answer is over 2 MB). The CLI and
    the workers share the payload store by MODELFORGE_HOME, as on one machine."""
    pytest.importorskip("sentence_transformers")
    home = tmp_path / "home"
    client = _client(dev_server_env, home / "payloads")
    async with running_stack(client, database_url, CPU_CATALOG, telemetry_interval_s=1.0) as stack:
        env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
        env.update(MODELFORGE_TEMPORAL_ADDRESS=client.service_client.config.target_host, MODELFORGE_HOME=str(home))
        texts = [f"text number {i} about cats" if i % 2 else f"passage {i} on taxes" for i in range(2048)]
        command = [sys.executable, "-m", "modelforge", "request", "rag.embedding.cpu@1", "--json"]
        began = time.monotonic()
        code, out, errors = await run_cli([*command, "--input", json.dumps({"texts": texts})], env, 420)
        wall = time.monotonic() - began
        assert code == 0, (out[-2000:], errors[-2000:])
        result = json.loads(out)
        assert result["ok"] and result["lease"]["accelerator"] == "laptop/cpu"
        vectors = result["output"]["embeddings"]
        assert len(vectors) == 2048 and all(len(v) == 384 for v in vectors)
        assert len(out) > 2 * 1024 * 1024  # an answer the history could never have held
        size = await _history_bytes(stack.client, result["workflow_id"])
        print(f"2048 texts on MiniLM through the CLI: {wall:.1f} s, request history {size} bytes")
        assert size < HISTORY_LIMIT


def test_the_payload_settings_come_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELFORGE_HOME", str(tmp_path))
    defaults = Settings.from_env()
    assert defaults.resolved_payload_dir() == tmp_path / "payloads"
    assert (defaults.payload_threshold_bytes, defaults.max_payload_bytes) == (2048, 64 * 1024 * 1024)
    assert defaults.payload_retention_days is None
    monkeypatch.setenv("MODELFORGE_PAYLOAD_DIR", str(tmp_path / "shared"))
    monkeypatch.setenv("MODELFORGE_MAX_PAYLOAD_BYTES", "1000")
    monkeypatch.setenv("MODELFORGE_PAYLOAD_RETENTION_DAYS", "2.5")
    configured = Settings.from_env()
    assert configured.resolved_payload_dir() == tmp_path / "shared"
    assert (configured.max_payload_bytes, configured.payload_retention_days) == (1000, 2.5)
    storage = converter(configured).external_storage  # what `connect` builds every client with
    assert storage is not None and storage.payload_size_threshold == 2048
    [store] = storage.drivers
    assert isinstance(store, FilesystemPayloadStore)
    assert store.root == tmp_path / "shared" and store.max_bytes == 1000
    for name, value in (("MODELFORGE_MAX_PAYLOAD_BYTES", "0"), ("MODELFORGE_PAYLOAD_RETENTION_DAYS", "soon")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ModelForgeError, match=name):
            Settings.from_env()
        monkeypatch.delenv(name)


def test_only_the_request_path_stores_small_payloads(tmp_path: Path) -> None:
    """Other workflows (schedulers, residencies, telemetry) keep theirs inline below 256 KiB."""
    store = FilesystemPayloadStore(tmp_path)
    select = external_storage(store, 2048).driver_selector
    assert select is not None

    def target(type_: str | None, id_: str) -> StorageDriverSelectContext:
        return StorageDriverSelectContext(target=StorageDriverWorkflowInfo(namespace="default", id=id_, type=type_))

    small, large = Payload(data=b"x" * 10_000), Payload(data=b"x" * LARGE_PAYLOAD_BYTES)
    assert select(target("CapabilityRequestWorkflow", "request:c@1:r"), small) is store
    assert select(target(None, "request:c@1:r"), small) is store  # a signal to a request workflow
    assert select(target("PoolSchedulerWorkflow", "scheduler:default"), small) is None
    assert select(StorageDriverSelectContext(), small) is None
    assert select(target("PoolSchedulerWorkflow", "scheduler:default"), large) is store
    assert select(target("CapabilityRequestWorkflow", "request:c@1:r"), Payload(data=b"x" * 100)) is None
