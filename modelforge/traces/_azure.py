"""Azure LLM inference trace 2023 (TIMESTAMP, ContextTokens, GeneratedTokens) -> a mixed
single-GPU scenario: the trace's requests are production calls to an LLM capability, mixed
with RAG embedding traffic, a lab's experimental model and background evaluation jobs, on one
24 GiB card that also carries a media server and bursty transcodes (external usage).

Service time of an LLM request is prefill plus decode:
    service_s = ContextTokens / prefill_tokens_per_s + GeneratedTokens / decode_tokens_per_s
with defaults 4,000 prefill and 40 decode tokens per second per sequence (a 7-8B model on an
RTX 3090-class card; each of the deployment's 8 concurrent slots is one sequence, as a
continuous-batching server runs them).

Everything not in the trace is derived deterministically from it and `seed`, so the same file
and options always give the same scenario.
"""

from __future__ import annotations

import csv
import random
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from modelforge.domain import GiB
from modelforge.traces._common import TraceError, write_scenario

CARD_BYTES = 24 * GiB  # RTX 3090: 24,576 MiB in data/nvidia-smi/rtx-3090-v12.xml


@dataclass(frozen=True)
class AzureOptions:
    prefill_tokens_per_s: float = 4000.0
    decode_tokens_per_s: float = 40.0
    # Tile the trace this many times back to back (for load and speed tests).
    repeat: int = 1
    seed: int = 7
    # One RAG embedding call for every this many LLM requests.
    embedding_every: int = 3
    # A background evaluation job every this many seconds, running this long.
    eval_every_s: float = 600.0
    eval_service_s: float = 900.0
    # A lab session (experimental model) every this many seconds.
    lab_every_s: float = 420.0
    production_deadline_s: float = 60.0


def _parse_timestamp(text: str, line: int) -> float:
    # "2023-11-16 18:17:03.9799600": seven fractional digits, more than datetime parses.
    whole, _, fraction = text.strip().partition(".")
    try:
        base = datetime.fromisoformat(whole)
        return base.timestamp() + (float("0." + fraction) if fraction else 0.0)
    except ValueError:
        raise TraceError(f"line {line}: TIMESTAMP {text!r} is not 'YYYY-MM-DD HH:MM:SS[.fff]'") from None


def read_azure(path: Path) -> list[tuple[float, int, int]]:
    """(seconds since the first request, context tokens, generated tokens), in time order."""
    rows: list[tuple[float, int, int]] = []
    try:
        with path.open(newline="", encoding="utf-8") as handle:
            reader = csv.DictReader(handle)
            missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or [])
            if missing:
                raise TraceError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
            for line, row in enumerate(reader, start=2):
                try:
                    context, generated = int(row["ContextTokens"]), int(row["GeneratedTokens"])
                except (TypeError, ValueError):
                    raise TraceError(f"{path} line {line}: token counts must be integers") from None
                if context < 0 or generated < 0:
                    raise TraceError(f"{path} line {line}: token counts must not be negative")
                rows.append((_parse_timestamp(row["TIMESTAMP"], line), context, generated))
    except FileNotFoundError:
        raise TraceError(f"trace file not found: {path}") from None
    if not rows:
        raise TraceError(f"{path}: no requests")
    rows.sort(key=lambda r: r[0])
    first = rows[0][0]
    return [(t - first, c, g) for t, c, g in rows]


def convert_azure(trace: Path, out_dir: Path, options: AzureOptions | None = None) -> Path:
    options = options or AzureOptions()
    if options.repeat < 1:
        raise TraceError("repeat must be at least 1")
    rows = read_azure(trace)
    span = rows[-1][0] + 1.0
    rng = random.Random(options.seed)
    requests: list[dict[str, object]] = []
    for copy in range(options.repeat):
        offset = copy * span
        for index, (t, context, generated) in enumerate(rows):
            at = offset + t
            service = context / options.prefill_tokens_per_s + generated / options.decode_tokens_per_s
            requests.append(
                {
                    "t": round(at, 6),
                    "capability": "llm.code@1",
                    "priority": "production",
                    "tenant": "app",
                    "service_s": round(service, 6),
                    "deadline_s": options.production_deadline_s,
                }
            )
            if index % options.embedding_every == 0:
                requests.append(
                    {
                        "t": round(at + 0.01, 6),
                        "capability": "rag.embedding@1",
                        "priority": "interactive",
                        "tenant": "rag",
                        "service_s": round(0.02 + 0.00002 * context, 6),
                        "deadline_s": 10.0,
                    }
                )
    end = options.repeat * span
    at = 120.0
    while at < end:
        # A lab session: a burst of chat turns against an experimental model.
        turn = at
        for _ in range(rng.randint(5, 15)):
            requests.append(
                {
                    "t": round(turn, 6),
                    "capability": "llm.experimental@1",
                    "priority": "benchmark",
                    "tenant": "lab",
                    "service_s": round(rng.uniform(2.0, 6.0), 6),
                }
            )
            turn += rng.uniform(5.0, 20.0)
        at += options.lab_every_s
    at = 60.0
    while at < end:
        requests.append(
            {
                "t": round(at, 6),
                "capability": "eval.harness@1",
                "priority": "background",
                "tenant": "research",
                "service_s": round(options.eval_service_s * rng.uniform(0.7, 1.3), 6),
            }
        )
        at += options.eval_every_s
    requests.sort(key=lambda r: float(r["t"]))  # type: ignore[arg-type]
    for number, request in enumerate(requests):
        request["id"] = f"r{number}"

    external = [{"accelerator": "gpu-node/0", "bytes": int(1.2 * GiB), "name": "plex", "start_s": 0.0}]
    # Tdarr transcodes: 2.5 GiB for ten minutes, every half hour.
    burst = 300.0
    while burst < end:
        external.append(
            {
                "accelerator": "gpu-node/0",
                "bytes": int(2.5 * GiB),
                "name": "tdarr",
                "start_s": burst,
                "end_s": burst + 600.0,
            }
        )
        burst += 1800.0
    scenario: dict[str, object] = {
        "simulation": {"lease_timeout_s": 3600.0, "checkpoint_s": 2.0},
        "accelerators": [
            {
                "id": "gpu-node/0",
                "node": "gpu-node",
                "total_bytes": CARD_BYTES,
                "production_eligible": True,
                "model": "NVIDIA GeForce RTX 3090",
                "reserve_bytes": GiB,
            }
        ],
        "external": external,
        "deployments": [
            {
                "capability": "llm.code@1",
                "envelope_bytes": 9 * GiB,
                "residency": "keep_warm",
                "ttl_s": 600.0,
                "concurrency": 8,
                "queue_limit": 512,
                "load_s": 12.0,
                "unload_s": 2.0,
                "measured_on": ["NVIDIA GeForce RTX 3090"],
            },
            {
                "capability": "rag.embedding@1",
                "envelope_bytes": 1216348160,
                "residency": "keep_warm",
                "ttl_s": 901.0,
                "concurrency": 1,
                "queue_limit": 512,
                "load_s": 4.0,
                "unload_s": 1.0,
                "measured_on": ["NVIDIA GeForce RTX 3090"],
            },
            {
                "capability": "llm.experimental@1",
                "envelope_bytes": 8 * GiB,
                "residency": "load_on_demand",
                "ttl_s": 60.0,
                "concurrency": 2,
                "queue_limit": 512,
                "load_s": 10.0,
                "unload_s": 2.0,
                "production_eligible": False,
            },
            {
                "capability": "eval.harness@1",
                "envelope_bytes": 6 * GiB,
                # A batch job holds nothing before it runs: its lease carries its bytes, and
                # two jobs may share the card when both fit.
                "idle_bytes": 0,
                "residency": "none",
                "concurrency": 2,
                "queue_limit": 512,
                "load_s": 5.0,
                "unload_s": 1.0,
                "preemptible": True,
                "production_eligible": False,
            },
        ],
        "tenants": [
            {"name": "app", "weight": 3.0, "default_priority": "production", "max_priority": "production"},
            {"name": "rag", "weight": 2.0, "default_priority": "interactive", "max_priority": "interactive"},
            {"name": "lab", "weight": 1.0, "default_priority": "benchmark", "max_priority": "interactive"},
            {"name": "research", "weight": 1.0, "default_priority": "background", "max_priority": "background"},
        ],
    }
    header = (
        f"Converted from {trace.name} by `modelforge trace azure` (repeat={options.repeat}, seed={options.seed}, "
        f"prefill {options.prefill_tokens_per_s:g} tok/s, decode {options.decode_tokens_per_s:g} tok/s)."
    )
    return write_scenario(out_dir, scenario, requests, header)
