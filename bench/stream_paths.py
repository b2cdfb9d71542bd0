"""How a streamed answer should travel from the node to the gateway: measured, side by side.

Both paths run in one process on one Temporal dev server; an activity (standing for the node's
invoke) emits N tokens, one every --gap-ms, and a reader (standing for the gateway) takes them:

- workflow_streams: the SDK's `temporalio.contrib.workflow_streams`. The activity publishes each
  token with force_flush (its lowest-latency mode: a signal per token), the reader subscribes
  (long-poll updates). Everything travels through the request's workflow and its history.
- direct: the activity pushes the tokens over one chunked HTTP request to the reader's endpoint
  (as the node pushes to the gateway); the workflow only holds the lease.

Printed per path: how long the first token took from the activity emitting it to the reader
(p50 over --rounds), the same for the last token, and the history events the request workflow gained; then
the ratios. Run:  .venv/bin/python -m bench.stream_paths --tokens 100 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta

import httpx
import uvicorn
from fastapi import FastAPI, Request
from temporalio import activity, workflow
from temporalio.client import Client
from temporalio.contrib.workflow_streams import WorkflowStream, WorkflowStreamClient
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from modelforge.dev import temporal_binary

QUEUE = "stream-paths"


@dataclass
class Job:
    tokens: int
    gap_s: float
    push_url: str = ""  # direct path: where to push; "" publishes to the workflow stream


@workflow.defn(sandboxed=False)
class StreamedRequest:
    @workflow.init
    def __init__(self, job: Job) -> None:
        self.stream = WorkflowStream()

    @workflow.run
    async def run(self, job: Job) -> int:
        emitted: int = await workflow.execute_activity(emit_tokens, job, start_to_close_timeout=timedelta(minutes=5))
        return emitted


@activity.defn
async def emit_tokens(job: Job) -> int:
    if job.push_url:

        async def body() -> AsyncIterator[bytes]:
            for n in range(job.tokens):
                yield (json.dumps({"n": n, "at": time.time()}) + "\n").encode()
                await asyncio.sleep(job.gap_s)

        async with httpx.AsyncClient(timeout=None) as http:
            await http.post(job.push_url, content=body())
        return job.tokens
    stream = WorkflowStreamClient.from_within_activity(batch_interval=timedelta(milliseconds=20))
    tokens = stream.topic("tokens")
    async with stream:
        for n in range(job.tokens):
            tokens.publish({"n": n, "at": time.time()}, force_flush=True)
            await asyncio.sleep(job.gap_s)
    return job.tokens


@dataclass
class Sample:
    first_s: float
    last_delay_s: float
    history_events: int


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _via_workflow_streams(client: Client, tokens: int, gap_s: float) -> Sample:
    workflow_id = f"streams-{uuid.uuid4()}"
    handle = await client.start_workflow(StreamedRequest.run, Job(tokens, gap_s), id=workflow_id, task_queue=QUEUE)
    first = last_delay = 0.0
    seen = 0
    reader = WorkflowStreamClient.create(client, workflow_id)
    async for item in reader.subscribe(["tokens"], poll_cooldown=timedelta(milliseconds=5)):
        now = time.time()
        if seen == 0:
            first = now - float(item.data["at"])
        seen += 1
        if seen == tokens:
            last_delay = now - float(item.data["at"])
            break
    await handle.result()
    history = await handle.fetch_history()
    return Sample(first, last_delay, len(history.events))


async def _via_direct_push(
    client: Client, tokens: int, gap_s: float, port: int, inbox: dict[str, asyncio.Queue[dict]]
) -> Sample:
    stream_id = uuid.uuid4().hex
    queue: asyncio.Queue[dict] = asyncio.Queue()
    inbox[stream_id] = queue
    handle = await client.start_workflow(
        StreamedRequest.run,
        Job(tokens, gap_s, push_url=f"http://127.0.0.1:{port}/streams/{stream_id}"),
        id=f"direct-{stream_id}",
        task_queue=QUEUE,
    )
    first = last_delay = 0.0
    for seen in range(1, tokens + 1):
        item = await queue.get()
        now = time.time()
        if seen == 1:
            first = now - float(item["at"])
        if seen == tokens:
            last_delay = now - float(item["at"])
    await handle.result()
    history = await handle.fetch_history()
    del inbox[stream_id]
    return Sample(first, last_delay, len(history.events))


def _receiver(inbox: dict[str, asyncio.Queue[dict]]) -> FastAPI:
    app = FastAPI()

    @app.post("/streams/{stream_id}")
    async def receive(stream_id: str, request: Request) -> dict[str, int]:
        queue = inbox[stream_id]
        buffered = b""
        count = 0
        async for chunk in request.stream():
            buffered += chunk
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                queue.put_nowait(json.loads(line))
                count += 1
        return {"received": count}

    return app


async def main(tokens: int, gap_ms: float, rounds: int) -> None:
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    inbox: dict[str, asyncio.Queue[dict]] = {}
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_receiver(inbox), host="127.0.0.1", port=port, log_level="error"))
    serving = asyncio.create_task(server.serve())
    gap_s = gap_ms / 1000.0
    try:
        async with Worker(env.client, task_queue=QUEUE, workflows=[StreamedRequest], activities=[emit_tokens]):
            while not server.started:
                await asyncio.sleep(0.01)
            # one warm-up of each, then rounds interleaved
            await _via_workflow_streams(env.client, 3, gap_s)
            await _via_direct_push(env.client, 3, gap_s, port, inbox)
            streams: list[Sample] = []
            direct: list[Sample] = []
            for _ in range(rounds):
                streams.append(await _via_workflow_streams(env.client, tokens, gap_s))
                direct.append(await _via_direct_push(env.client, tokens, gap_s, port, inbox))
    finally:
        server.should_exit = True
        await serving
        await env.shutdown()

    def p50(samples: list[Sample], field: str) -> float:
        return statistics.median(getattr(s, field) for s in samples)

    print(f"{tokens} tokens, one every {gap_ms:g} ms, {rounds} rounds, p50:")
    print(f"{'path':18} {'first token delay':>18} {'last token delay':>17} {'history events':>15}")
    for name, samples in (("workflow_streams", streams), ("direct push", direct)):
        print(
            f"{name:18} {p50(samples, 'first_s') * 1000:16.1f}ms {p50(samples, 'last_delay_s') * 1000:15.1f}ms "
            f"{p50(samples, 'history_events'):15.0f}"
        )
    print(
        "ratios workflow_streams / direct: first-token delay "
        f"{p50(streams, 'first_s') / max(p50(direct, 'first_s'), 1e-6):.1f}x, last-token delay "
        f"{p50(streams, 'last_delay_s') / max(p50(direct, 'last_delay_s'), 1e-6):.1f}x, history "
        f"{p50(streams, 'history_events') / p50(direct, 'history_events'):.1f}x"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--gap-ms", type=float, default=10.0, help="time between tokens (10 ms: 100 tokens/s)")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.tokens, args.gap_ms, args.rounds))
