"""What a client's request input can make a node do: `modelforge_*` keys are the node's and the
scheduler's own (refused in the input, by `client_input_problem` and again by the node), the
profile operation is asked for only through the activity's own field (set by trusted code) and
never answers a deployment's secrets nor blocks the worker's event loop, and a resume location
is only ever a checkpoint of this very request run inside the checkpoint store."""

from __future__ import annotations

import asyncio
import os
import time
import urllib.parse
from pathlib import Path
from typing import Any

import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass
from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.messages import (
    PROFILE_OPERATION,
    RESUME_KEY,
    CheckpointInput,
    GangJobInput,
    InvokeInput,
    LoadInput,
    RequestInput,
    client_input_problem,
)
from modelforge.runtimes import SimulatedRuntime

TOKEN = "hf_sEcReT0123456789abcdef"
RUN = "test-run"  # ActivityEnvironment's workflow run id
KEY = "emb@1@n/0"
DEPLOYMENT = Deployment(
    capability="emb@1",
    envelope_bytes=GiB,
    runtime_config={"env.HF_TOKEN": TOKEN, "api": "openai_embeddings"},
    command=["vllm", "serve", "/models/x", "--api-key", TOKEN, f"--hf-token={TOKEN}", "--port", "{port}"],
)


@pytest.mark.parametrize(
    "payload",
    [
        {"modelforge_operation": "profile"},
        {"text": "x", RESUME_KEY: "/tmp/x"},
        {"modelforge_lease_id": "L"},
        {"modelforge_": 1},
    ],
)
def test_reserved_input_keys_are_refused_for_clients(payload: dict[str, Any]) -> None:
    problem = client_input_problem(payload)
    assert problem is not None and "reserved" in problem and "modelforge_" in problem


def test_ordinary_inputs_pass() -> None:
    assert client_input_problem({}) is None
    assert client_input_problem({"text": "x", "texts": ["a"], "nested": {"modelforge_operation": "profile"}}) is None
    assert client_input_problem(["not", "a", "dict"]) == "input must be a JSON object"
    # The operation travels beside the input, where only trusted code sets it (RequestInput, InvokeInput).
    assert RequestInput(request_id="r", capability="c", operation=PROFILE_OPERATION).input == {}


@pytest.fixture
def node(tmp_path: Path) -> NodeActivities:
    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-0", "Simulated L4", 24 * GiB)]), None)
    return NodeActivities("n", devices, {"simulated": SimulatedRuntime(devices)}, checkpoint_root=tmp_path / "store")


async def _loaded(node: NodeActivities, env: ActivityEnvironment) -> None:
    await env.run(node.load_model, LoadInput(KEY, DEPLOYMENT, "n/0", 0, "GPU-0"))


async def _refused(env: ActivityEnvironment, call: Any, argument: Any) -> ApplicationError:
    with pytest.raises(ApplicationError) as refused:
        await env.run(call, argument)
    assert refused.value.type == FailureClass.REQUEST_INVALID.value and refused.value.non_retryable
    return refused.value


async def test_a_client_cannot_ask_the_node_to_profile(node: NodeActivities) -> None:
    env = ActivityEnvironment()
    await _loaded(node, env)
    spec = {"modelforge_operation": "profile", "batch_sizes": [1], "context_words": [4], "concurrency": [1]}
    refused = await _refused(env, node.invoke, InvokeInput(key=KEY, lease_id="L", payload=spec, request_id="r"))
    assert "reserved" in refused.message and TOKEN not in str(refused)
    # Nor any other reserved key, in an invoke or in a gang job's input.
    for payload in ({"text": "x", "modelforge_lease_id": "other"}, {"modelforge_rank": 3}):
        await _refused(env, node.invoke, InvokeInput(key=KEY, lease_id="L", payload=payload, request_id="r"))
    job = GangJobInput(
        lease_id="J", request_id="r", deployment=DEPLOYMENT, accelerators=["n/0"], payload={"modelforge_rank": 7}
    )
    await _refused(env, node.run_gang_job, job)
    # An unknown operation in the trusted field is refused too.
    await _refused(env, node.invoke, InvokeInput(key=KEY, lease_id="L", payload={}, operation="shell"))


async def test_the_profile_operation_never_answers_secrets_and_keeps_the_event_loop_free(
    node: NodeActivities,
) -> None:
    env = ActivityEnvironment()
    await _loaded(node, env)
    # The largest case a profile may run: batch 1024 x 256 words (the bound on words in flight).
    spec = {"batch_sizes": [1024], "context_words": [256], "concurrency": [1]}
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    ticking = asyncio.create_task(ticker())
    try:
        result = await env.run(
            node.invoke, InvokeInput(key=KEY, lease_id="L", payload=spec, request_id="r", operation=PROFILE_OPERATION)
        )
    finally:
        done.set()
        await ticking
    profile = result.output["profile"]
    assert [c["batch_size"] for c in profile["cases"]] == [1024]
    configuration = profile["configuration"]
    assert TOKEN not in repr(result)
    assert configuration["runtime_config"] == {"api": "openai_embeddings"}
    assert configuration["env"] == ["HF_TOKEN"]  # by name only
    assert configuration["command"] == [
        "vllm", "serve", "/models/x", "--api-key", "<redacted>", "--hf-token=<redacted>", "--port", "{port}",
    ]  # fmt: skip
    # Texts are built and sampled off the loop: it never stalls for long.
    assert max(gaps) < 0.5, max(gaps)


@pytest.mark.parametrize(
    "spec",
    [
        {"batch_sizes": [1024], "context_words": [32768], "concurrency": [64]},
        {"batch_sizes": [1024], "context_words": [512], "concurrency": [1]},
        {"batch_sizes": list(range(1, 9)), "context_words": [4096, 8192], "concurrency": [1, 2, 3, 4]},
    ],
)
async def test_a_profile_too_large_for_the_worker_is_refused_before_it_runs(
    node: NodeActivities, spec: dict[str, Any]
) -> None:
    env = ActivityEnvironment()
    await _loaded(node, env)
    started = time.monotonic()
    request = InvokeInput(key=KEY, lease_id="L", payload=spec, request_id="r", operation=PROFILE_OPERATION)
    refused = await _refused(env, node.invoke, request)
    assert "words" in refused.message and time.monotonic() - started < 1.0


def _own_checkpoint(store: Path, request_id: str = "r", run: str = RUN) -> Path:
    location = store / request_id / "0" / run / "checkpoint.json"
    location.parent.mkdir(parents=True, exist_ok=True)
    location.write_text('{"simulated": true, "done_s": 1.0, "lease_id": "L"}')
    return location


@pytest.mark.parametrize(
    "location",
    [
        "fake_ckpt.json",  # relative: was read from the worker's working directory
        "file://fake_ckpt.json",
        "file://../x",
        "../../etc/hostname",
        "file:///etc/hostname",
        "/etc/hostname",
        "s3://bucket/r/0/test-run/checkpoint.json",
        "file://otherhost/store/r/0/test-run/checkpoint.json",
        "STORE/../fake_ckpt.json",
        "STORE/other-request/0/test-run/checkpoint.json",  # another request's (another tenant's)
        "STORE/r/0/other-run/checkpoint.json",  # an earlier request that used the same id
        "file://STORE/other-request/0/test-run/checkpoint.json",
        "STORE/r/0/test-run/escape",  # a symlink inside the request's directory, pointing out
        "STORE/r",  # the request's directory itself, not a checkpoint of this run
    ],
)
async def test_resume_locations_outside_this_requests_checkpoints_are_refused(
    node: NodeActivities, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, location: str
) -> None:
    store = tmp_path / "store"
    _own_checkpoint(store)
    _own_checkpoint(store, request_id="other-request")
    _own_checkpoint(store, run="other-run")
    (tmp_path / "fake_ckpt.json").write_text('{"done_s": 3600}')
    (store / "r" / "0" / RUN / "escape").symlink_to(tmp_path / "fake_ckpt.json")
    monkeypatch.chdir(tmp_path)
    location = location.replace("STORE", str(store))
    env = ActivityEnvironment()
    await _loaded(node, env)
    payload = {"simulate_invoke_s": 1, RESUME_KEY: location}
    # As older request workflow code passes it (in the payload), and as the trusted field.
    refused = await _refused(env, node.invoke, InvokeInput(key=KEY, lease_id="L", payload=payload, request_id="r"))
    assert RESUME_KEY in refused.message
    await _refused(
        env,
        node.invoke,
        InvokeInput(key=KEY, lease_id="L", payload={"simulate_invoke_s": 1}, request_id="r", resume_from=location),
    )
    job = GangJobInput(
        lease_id="J",
        request_id="r",
        deployment=DEPLOYMENT,
        accelerators=["n/0"],
        payload={"simulate_invoke_s": 1},
        resume_from=location,
    )
    await _refused(env, node.run_gang_job, job)


async def test_a_request_resumes_from_its_own_checkpoint(node: NodeActivities, tmp_path: Path) -> None:
    env = ActivityEnvironment()
    await _loaded(node, env)
    running = asyncio.ensure_future(
        env.run(node.invoke, InvokeInput(key=KEY, lease_id="L", payload={"simulate_invoke_s": 3}, request_id="r/1"))
    )
    await asyncio.sleep(1.3)
    saved = await env.run(node.checkpoint_invocation, CheckpointInput(KEY, "L", "r/1", 0))
    running.cancel()
    with pytest.raises(asyncio.CancelledError):
        await running
    # Under the request's id and this workflow run.
    assert Path(saved.location).parent == tmp_path / "store" / "r_1" / "0" / RUN
    resumed = await env.run(
        node.invoke,
        InvokeInput(
            key=KEY, lease_id="L2", payload={"simulate_invoke_s": 2}, request_id="r/1", resume_from=saved.location
        ),
    )
    assert resumed.output["resumed_from"] == os.path.realpath(saved.location)
    # A file:// URL (percent-encoded) names the same checkpoint.
    url = "file://" + urllib.parse.quote(saved.location)
    again = await env.run(
        node.invoke,
        InvokeInput(key=KEY, lease_id="L3", payload={"simulate_invoke_s": 2, RESUME_KEY: url}, request_id="r/1"),
    )
    assert again.output["resumed_from"] == os.path.realpath(saved.location)
