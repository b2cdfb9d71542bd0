"""The subprocess_http runtime against ModelForge's own toy model server, a real child process on
loopback: each dialect, each failure class a real server shows (never ready, exits at start,
crashes mid-request, answers garbage or NaN, hangs, will not stop, leaves memory behind)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from activities.node import NodeActivities
from modelforge.catalog import CatalogError, parse_catalog
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.gpu import (
    CPU_DEVICE_INDEX,
    DeviceSample,
    GpuProcess,
    NodeDevices,
)
from modelforge.messages import CheckpointInput, InvokeInput, LoadInput, ReclaimInput
from modelforge.runtimes import SubprocessHttpRuntime, process_tree
from modelforge.runtimes._process import alive
from tests.runtimes.toy_servers import UUID, devices, info, loaded, quiet, toy

MiB = 1024**2


@pytest.mark.parametrize("api", ["openai_embeddings", "tei_embed"])
async def test_an_embedding_server_is_loaded_checked_invoked_and_stopped(tmp_path: Path, api: str) -> None:
    node = devices()
    runtime = SubprocessHttpRuntime(node, tmp_path)
    model = await loaded(runtime, toy("--hold-mib", "1", "--note", "; $(touch pwned)", api=api))
    try:
        started = await info(runtime, model)
        # An argument list reaches the server verbatim: no shell ever read it.
        assert started["argv"][-1] == "; $(touch pwned)" and not Path("pwned").exists()
        assert started["cuda_visible_devices"] == UUID  # the leased card, by UUID
        # On a simulated card the catalog's idle bytes are recorded for the server's pid.
        [sample] = node.sample()
        assert [(p.pid, p.used_bytes) for p in sample.processes] == [(model.pid, 1 * GiB)]
        assert model.measured_bytes == 1 * GiB and model.owns_process
        await runtime.health_check(model)
        output = await runtime.invoke(model, {"texts": ["a cat on a mat", "stock prices"]}, quiet)
        assert len(output["embeddings"]) == 2 and output["dimensions"] == 64
        assert output["embedding"] == output["embeddings"][0]
    finally:
        await runtime.unload(model)
    assert not alive(model.pid)
    assert node.sample()[0].processes == []


async def test_a_chat_server_answers_in_modelforge_shape(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy(api="openai_chat"))
    try:
        await runtime.health_check(model)
        output = await runtime.invoke(model, {"messages": [{"role": "user", "content": "hello"}]}, quiet)
        # The server's own token counts come back as `usage` (its tokens: words and punctuation).
        assert output == {
            "text": "[toy server] ready. You said: hello",
            "finish_reason": "stop",
            "usage": {"prompt_tokens": 1, "completion_tokens": 10, "total_tokens": 11},
        }
        with pytest.raises(ModelForgeError) as refused:
            await runtime.invoke(model, {"text": "no messages"}, quiet)
        assert refused.value.failure == FailureClass.REQUEST_INVALID
    finally:
        await runtime.unload(model)


async def test_request_parameters_reach_the_model_server_as_given(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    chat = await loaded(runtime, toy(api="openai_chat"))
    try:
        tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
        parameters = {
            "temperature": 0.2, "top_p": 0.9, "seed": 7, "n": 2, "stop": ["You"], "presence_penalty": 0.5,
            "frequency_penalty": 0.1, "logprobs": True, "user": "end-user-1", "top_k": 5,
        }  # fmt: skip
        messages = [{"role": "user", "content": "hello"}]
        output = await runtime.invoke(chat, {"messages": messages, "parameters": parameters}, quiet)
        received = (await runtime._servers[chat.resident_key].client.get("/received")).json()["requests"]
        body = received[-1]["body"]
        assert received[-1]["path"] == "/v1/chat/completions"
        assert {k: body[k] for k in parameters} == parameters  # every one, unknown ones (top_k) too
        assert body["messages"] == messages and body["model"] == "toy.embedding@1"
        # They acted: two choices, cut at the stop string, with logprobs.
        assert [c["message"]["content"] for c in output["choices"]] == ["[toy server] ready. "] * 2
        assert output["text"] == "[toy server] ready. " and output["choices"][1]["logprobs"]["content"]
        called = await runtime.invoke(
            chat, {"messages": messages, "parameters": {"tools": tools, "tool_choice": "required"}}, quiet
        )
        [call] = called["choices"][0]["message"]["tool_calls"]
        assert call["function"]["name"] == "lookup" and called["finish_reason"] == "tool_calls"
        assert called["text"] == ""
        # What ModelForge fills itself cannot be overridden by a parameter; streaming is refused.
        overrides: list[dict[str, Any]] = [{"model": "other"}, {"messages": []}, {"stream": True}]
        for taken in overrides:
            with pytest.raises(ModelForgeError) as refused:
                await runtime.invoke(chat, {"messages": messages, "parameters": taken}, quiet)
            assert refused.value.failure == FailureClass.REQUEST_INVALID and next(iter(taken)) in refused.value.message
    finally:
        await runtime.unload(chat)


@pytest.mark.parametrize("api", ["openai_embeddings", "tei_embed"])
async def test_embedding_parameters_pass_or_are_refused_by_name(tmp_path: Path, api: str) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy(api=api))
    try:
        payload = {"texts": ["a cat on a mat"], "parameters": {"dimensions": 16, "user": "u-1"}}
        if api == "tei_embed":  # TEI's /embed takes none: refused, named, never dropped
            with pytest.raises(ModelForgeError) as refused:
                await runtime.invoke(model, payload, quiet)
            assert refused.value.failure == FailureClass.REQUEST_INVALID
            assert "dimensions" in refused.value.message and "user" in refused.value.message
            return
        output = await runtime.invoke(model, payload, quiet)
        assert output["dimensions"] == 16 and output["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
        received = (await runtime._servers[model.resident_key].client.get("/received")).json()["requests"]
        assert received[-1]["body"]["dimensions"] == 16 and received[-1]["body"]["user"] == "u-1"
    finally:
        await runtime.unload(model)


async def test_on_the_cpu_device_its_bytes_are_the_process_resident_memory(tmp_path: Path) -> None:
    node = devices(host=True)
    runtime = SubprocessHttpRuntime(node, tmp_path)
    model = await loaded(runtime, toy("--hold-mib", "96"), device=CPU_DEVICE_INDEX)
    try:
        assert (await info(runtime, model))["cuda_visible_devices"] == ""  # it sees no GPU
        # 96 MiB of touched pages plus the interpreter: at least the 96 MiB.
        assert 96 * MiB <= model.measured_bytes < 400 * MiB
        host = node.sample()[-1]
        assert host.index == CPU_DEVICE_INDEX
        assert [p.pid for p in host.processes if p.name.startswith("modelforge:")] == [model.pid]
    finally:
        await runtime.unload(model)
    assert not [p for p in node.sample()[-1].processes if p.name.startswith("modelforge:")]


@pytest.mark.parametrize(
    ("extra", "config", "message"),
    [
        (("--fault", "never-ready"), {"ready_timeout_s": "1.5"}, "not ready on http://127.0.0.1:"),
        (("--fault", "exit-at-start"), {}, "exited with code 2 before it was ready"),
    ],
)
async def test_a_server_that_never_becomes_ready_is_a_load_failure_and_is_stopped(
    tmp_path: Path, extra: tuple[str, ...], config: dict[str, str], message: str
) -> None:
    node = devices()
    runtime = SubprocessHttpRuntime(node, tmp_path)
    before = process_tree(os.getpid())
    with pytest.raises(ModelForgeError) as failed:
        await loaded(runtime, toy(*extra, **config))
    assert failed.value.failure == FailureClass.MODEL_LOAD_FAILED
    assert message in failed.value.message
    assert "server log" in failed.value.message  # the log's tail, for the operator
    if "exit-at-start" in extra:
        assert "model file not found" in failed.value.message
    await asyncio.sleep(0.2)
    assert process_tree(os.getpid()) <= before  # nothing left running
    assert node.sample()[0].processes == []


async def test_a_missing_program_is_a_load_failure_naming_it(tmp_path: Path) -> None:
    deployment = toy()
    deployment = Deployment(**{**deployment.__dict__, "command": ["/nonexistent/vllm", "serve"]})
    with pytest.raises(ModelForgeError, match="cannot start '/nonexistent/vllm'") as failed:
        await loaded(SubprocessHttpRuntime(devices(), tmp_path), deployment)
    assert failed.value.failure == FailureClass.MODEL_LOAD_FAILED


@pytest.mark.parametrize(
    ("fault", "failure", "message"),
    [
        ("crash-on-invoke", FailureClass.RUNTIME_CRASH, "crashing on purpose"),
        ("garbage", FailureClass.INVALID_OUTPUT, "non-JSON"),
        ("nan", FailureClass.INVALID_OUTPUT, "not a finite number"),
        ("hang", FailureClass.TIMEOUT, "no answer from"),
    ],
)
async def test_invoke_failures_are_classified(tmp_path: Path, fault: str, failure: FailureClass, message: str) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--fault", fault, request_timeout_s="1", stop_grace_s="0.5"))
    try:
        with pytest.raises(ModelForgeError) as failed:
            await runtime.invoke(model, {"text": "hello"}, quiet)
        assert failed.value.failure == failure
        assert message in failed.value.message
        # The functional health check fails the same server, as HEALTHCHECK_FAILED.
        if fault != "crash-on-invoke":
            with pytest.raises(ModelForgeError) as unhealthy:
                await runtime.health_check(model)
            assert unhealthy.value.failure == FailureClass.HEALTHCHECK_FAILED
    finally:
        await runtime.unload(model)
    assert not alive(model.pid)


async def test_a_server_that_ignores_sigterm_is_killed_after_the_grace_time(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy("--ignore-term", stop_grace_s="0.5"))
    started = asyncio.get_running_loop().time()
    await runtime.unload(model)
    assert not alive(model.pid)
    assert 0.5 <= asyncio.get_running_loop().time() - started < 5


class PidGpu:
    """A card as NVML would show it: 3 GiB for each live process it was told holds memory."""

    label = "nvml"

    def __init__(self) -> None:
        self.holders: set[int] = set()

    def sample(self) -> list[DeviceSample]:
        processes = [GpuProcess(pid, 3 * GiB) for pid in sorted(self.holders) if alive(pid)]
        used = sum(p.used_bytes for p in processes)
        return [DeviceSample(0, UUID, "NVIDIA L4", 24 * GiB, used, processes)]


async def test_a_worker_that_outlives_its_server_is_memory_not_reclaimed(tmp_path: Path) -> None:
    gpu = PidGpu()
    node = NodeDevices(gpu)
    runtime = SubprocessHttpRuntime(node, tmp_path)
    activities = NodeActivities("n", node, {"subprocess_http": runtime})
    environment = ActivityEnvironment()
    deployment = toy("--orphan-worker", stop_grace_s="1")
    key = "toy.embedding@1@n/0"
    await environment.run(activities.load_model, LoadInput(key, deployment, "n/0", 0, UUID))
    server_pid = runtime._servers[key].process.pid
    [worker_pid] = (await info(runtime, activities._loaded[key][1]))["children"]
    gpu.holders = {server_pid, worker_pid}  # the server and its forked worker each hold a context
    try:
        [observation] = (await environment.run(activities.sample_node, "n")).observations
        # Both are ModelForge's: nothing external on the card.
        assert observation.external_bytes == 0 and observation.managed_bytes == 6 * GiB
        await environment.run(activities.unload_model, key)
        result = await environment.run(activities.verify_reclaim, ReclaimInput(key, "n/0", timeout_s=1.0))
        assert not result.reclaimed
        assert f"{3 * GiB} B still held" in result.message
    finally:
        os.kill(worker_pid, signal.SIGKILL)
    await asyncio.sleep(0.2)
    result = await environment.run(activities.verify_reclaim, ReclaimInput(key, "n/0", timeout_s=2.0))
    assert result.reclaimed


async def test_an_invoke_on_a_dead_server_is_a_runtime_crash_through_the_activity(tmp_path: Path) -> None:
    node = devices()
    runtime = SubprocessHttpRuntime(node, tmp_path)
    activities = NodeActivities("n", node, {"subprocess_http": runtime})
    environment = ActivityEnvironment()
    key = "toy.embedding@1@n/0"
    await environment.run(activities.load_model, LoadInput(key, toy(), "n/0", 0, UUID))
    os.kill(runtime._servers[key].process.pid, signal.SIGKILL)
    await asyncio.sleep(0.3)
    with pytest.raises(ApplicationError) as failed:
        await environment.run(activities.invoke, InvokeInput(key=key, lease_id="L1", payload={"text": "x"}))
    assert failed.value.type == FailureClass.RUNTIME_CRASH.value
    await environment.run(activities.unload_model, key)


def _catalog(**deployment: Any) -> dict[str, Any]:
    return {
        "accelerators": [{"id": "n/0", "node": "n", "total_bytes": 24 * GiB}],
        "deployments": [{"capability": "c@1", "envelope_bytes": GiB, "runtime": "subprocess_http", **deployment}],
    }


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "deployments[0].subprocess_http needs `command`"),
        ({"command": ["vllm"], "runtime_config": {"api": "grpc"}}, "runtime_config.api: 'grpc' is not one of"),
        ({"command": ["vllm"], "runtime_config": {"host": "0.0.0.0"}}, "is not loopback"),
        ({"command": ["vllm"], "runtime_config": {"ready_timeout_s": "soon"}}, "is not a number"),
        ({"command": ["vllm"], "runtime_config": {"shell": "true"}}, "runtime_config.shell: unknown"),
        ({"command": "vllm serve model"}, "command: Input should be a valid list"),
    ],
)
def test_bad_runtime_configuration_is_refused_when_the_catalog_is_applied(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(CatalogError, match="invalid catalog") as refused:
        parse_catalog(_catalog(**fields))
    assert message in refused.value.message


def test_vllm_llama_cpp_and_tei_are_configuration_alone() -> None:
    catalog, _ = parse_catalog(
        {
            "accelerators": [{"id": "n/0", "node": "n", "total_bytes": 24 * GiB}],
            "deployments": [
                {
                    "capability": "chat@1",
                    "envelope_bytes": 20 * GiB,
                    "runtime": "subprocess_http",
                    "artifact": "/models/qwen",
                    "command": ["vllm", "serve", "{artifact}", "--port", "{port}", "--enable-sleep-mode"],
                    "runtime_config": {"api": "openai_chat", "served_model": "{artifact}"},
                },
                {
                    "capability": "chat.gguf@1",
                    "envelope_bytes": 6 * GiB,
                    "runtime": "subprocess_http",
                    "command": ["llama-server", "-m", "{artifact}", "--port", "{port}", "-ngl", "99"],
                    "runtime_config": {"api": "openai_chat"},
                },
                {
                    "capability": "emb@1",
                    "envelope_bytes": 2 * GiB,
                    "runtime": "subprocess_http",
                    "command": ["text-embeddings-router", "--model-id", "{artifact}", "--port", "{port}"],
                    "runtime_config": {"api": "tei_embed", "dimensions": "384"},
                },
            ],
        }
    )
    assert [d.command[0] for d in catalog.deployments] == ["vllm", "llama-server", "text-embeddings-router"]


async def test_httpx_is_not_asked_to_use_a_proxy(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # A host's HTTP_PROXY must not send loopback traffic to a proxy.
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(runtime, toy())
    try:
        assert (await runtime.invoke(model, {"text": "x"}, quiet))["dimensions"] == 64
        assert isinstance(runtime._servers[model.resident_key].client, httpx.AsyncClient)
    finally:
        await runtime.unload(model)


async def test_sleep_wake_and_checkpoint_through_the_node_are_timed_and_measured(tmp_path: Path) -> None:
    # On the CPU device the bytes are real: the server's 256 MiB of weights leave and come back.
    node = devices(host=True)
    runtime = SubprocessHttpRuntime(node, tmp_path)
    store = tmp_path / "checkpoints"
    activities = NodeActivities("n", node, {"subprocess_http": runtime}, checkpoint_root=store)
    environment = ActivityEnvironment()
    deployment = toy(
        "--hold-mib", "256", sleep_path="/sleep?level=1", wake_path="/wake_up", checkpoint_path="/checkpoint"
    )
    assert runtime.supports(deployment) == ["sleep", "checkpoint"]
    key = "toy.embedding@1@n/cpu"
    await environment.run(activities.load_model, LoadInput(key, deployment, "n/cpu", CPU_DEVICE_INDEX, ""))
    loaded_bytes = activities._loaded[key][1].measured_bytes
    assert loaded_bytes >= 256 * MiB
    asleep = await environment.run(activities.sleep_model, key)
    assert asleep.operation == "sleep" and asleep.seconds >= 0
    assert asleep.bytes_after < loaded_bytes - 200 * MiB  # most of it given back
    with pytest.raises(ApplicationError) as refused:  # asleep: it answers 503, a crash to the runtime
        await environment.run(activities.invoke, InvokeInput(key=key, lease_id="L", payload={"text": "x"}))
    assert refused.value.type == FailureClass.RUNTIME_CRASH.value
    awake = await environment.run(activities.wake_model, key)
    assert awake.bytes_after >= 256 * MiB
    # The server writes its state into the node's checkpoint store, under the request's id and
    # the request workflow's run (ActivityEnvironment's is "test-run").
    checkpoint = await environment.run(activities.checkpoint_invocation, CheckpointInput(key, "L", "../r/1", 0))
    assert checkpoint.location == str(store / ".._r_1" / "0" / "test-run" / "toy-state.json")
    assert json.loads(Path(checkpoint.location).read_text()) == {"checkpoints": 1, "lease_id": "L"}
    # A resume location outside the store is refused before any runtime sees it.
    outside = InvokeInput(key=key, lease_id="L2", payload={"text": "x", "modelforge_resume_from": "/etc/passwd"})
    with pytest.raises(ApplicationError, match="outside the checkpoint store") as refused:
        await environment.run(activities.invoke, outside)
    assert refused.value.type == FailureClass.REQUEST_INVALID.value
    unload_s = await environment.run(activities.unload_model, key)
    assert unload_s is not None and 0 <= unload_s < 5
    assert await environment.run(activities.unload_model, key) is None  # idempotent


async def test_operations_a_runtime_cannot_do_say_why(tmp_path: Path) -> None:
    runtime = SubprocessHttpRuntime(devices(), tmp_path)
    activities = NodeActivities("n", runtime._devices, {"subprocess_http": runtime}, checkpoint_root=tmp_path)
    environment = ActivityEnvironment()
    key = "toy.embedding@1@n/0"
    await environment.run(activities.load_model, LoadInput(key, toy(), "n/0", 0, UUID))
    try:
        for operation, argument in (
            (activities.sleep_model, key),
            (activities.checkpoint_invocation, CheckpointInput(key, "L", "r", 0)),
        ):
            with pytest.raises(ApplicationError) as refused:
                await environment.run(operation, argument)  # type: ignore[arg-type]
            assert refused.value.type == FailureClass.CAPABILITY_UNAVAILABLE.value
            assert "_path is not set" in str(refused.value)
    finally:
        await environment.run(activities.unload_model, key)
    with pytest.raises(CatalogError, match="sleep_path and wake_path come together"):
        parse_catalog(_catalog(command=["vllm"], runtime_config={"sleep_path": "/sleep"}))


async def test_the_simulated_runtime_sleeps_to_a_tenth_on_its_card() -> None:
    from modelforge.runtimes import SimulatedRuntime

    node = devices()
    runtime = SimulatedRuntime(node)
    deployment = Deployment(capability="llm@1", envelope_bytes=10 * GiB)
    model = await runtime.load("llm@1@n/0", deployment, 0, UUID, quiet)
    assert node.sample()[0].used_bytes == 10 * GiB
    assert await runtime.sleep(model) == GiB and node.sample()[0].used_bytes == GiB
    assert await runtime.wake(model, quiet) == 10 * GiB and node.sample()[0].used_bytes == 10 * GiB
    with pytest.raises(ModelForgeError, match="no invoke of lease 'L' is running"):
        await runtime.checkpoint(model, {"lease_id": "L", "destination": "/nonexistent"})
    await runtime.unload(model)
    assert node.sample()[0].used_bytes == 0


async def test_servers_left_by_a_killed_node_worker_are_stopped_at_the_next_start(tmp_path: Path) -> None:
    first = SubprocessHttpRuntime(devices(), tmp_path)
    model = await loaded(first, toy())
    # The worker dies without stopping anything: its server lives on, in a session of its own.
    assert alive(model.pid)
    # A pid file whose pid is alive but is not the recorded command (a reused pid) is left alone.
    (tmp_path / "stranger.pid").write_text(json.dumps({"pid": os.getpid(), "argv": ["vllm", "serve"]}))
    second = SubprocessHttpRuntime(devices(), tmp_path)
    assert second.reap_orphans() == [model.pid]
    await asyncio.sleep(0.3)
    assert not alive(model.pid) and alive(os.getpid())
    assert list(tmp_path.glob("*.pid")) == []
    assert second.reap_orphans() == []
    await first.close()  # nothing left to stop; closing twice is harmless


async def test_a_server_gets_the_secrets_its_deployment_references_and_nothing_else_of_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from structlog.testing import capture_logs

    from modelforge.runtimes._secrets import NodeSecrets

    token = "hf_sEcReT_fRoM_tHe_NoDe_0123"
    monkeypatch.setenv("MODELFORGE_SECRET_HF_TOKEN", token)
    monkeypatch.setenv("MODELFORGE_DATABASE_URL", "postgresql://mf:db-password@db/mf")
    runtime = SubprocessHttpRuntime(devices(), tmp_path)  # reads the node's secrets now, at its start
    monkeypatch.setenv("MODELFORGE_SECRET_HF_TOKEN", "changed-later")  # not re-read
    deployment = dataclasses.replace(toy(), env_from_secrets={"HF_TOKEN": "hf_token"})
    node = NodeActivities("n", runtime._devices, {"subprocess_http": runtime})
    key = "toy.embedding@1@n/0"
    with capture_logs() as logs:
        await ActivityEnvironment().run(node.load_model, LoadInput(key, deployment, "n/0", 0, UUID))
    try:
        pid = node._loaded[key][1].pid
        environ = dict(
            item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item
        )
        assert environ["HF_TOKEN"] == token
        assert not [name for name in environ if name.startswith("MODELFORGE_")]
        assert all(token not in repr(entry) for entry in logs)
        assert token not in repr(deployment) and token not in repr(runtime._servers[key].config)
    finally:
        await runtime.close()
    # A reference the node cannot resolve fails the load naming the secret, not any value.
    empty = SubprocessHttpRuntime(devices(), tmp_path, secrets=NodeSecrets({}))
    with pytest.raises(ModelForgeError) as missing:
        await loaded(empty, deployment)
    assert missing.value.failure == FailureClass.MODEL_LOAD_FAILED
    assert "MODELFORGE_SECRET_HF_TOKEN" in missing.value.message and token not in missing.value.message
