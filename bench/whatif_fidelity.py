"""What-if fidelity: does replaying the record under the catalog that was in force reproduce what
happened? A real dev stack (the Temporal dev server, an embedded Postgres, the control worker and
a node worker with a simulated card, in this process, as bench/sustained.py runs them) serves a
trace for a few minutes; then `modelforge simulate --from-record`'s builder reads its record back
from the store and the simulator replays it through the production policy under the catalog in
force. Per-class wait percentiles and the count of loads, recorded beside replayed, for a quiet
run and an overloaded one.

    .venv/bin/python -m bench.whatif_fidelity                 # both runs, 3 minutes each
    .venv/bin/python -m bench.whatif_fidelity --minutes 1 --only quiet
    .venv/bin/python -m bench.whatif_fidelity --only quiet --keep /tmp/fidelity   # + every request

Tolerance (stated before measuring): a replayed wait percentile is within max(2 s, 25%) of the
recorded one, and the replay's loads within max(2, 20%) of the recorded loads. Where a figure is
outside, the report names the part of the model of the world that differs: load time (the
stack's loads take load_s plus a health check plus Temporal round trips; the replay uses the
median measured), service time (measured per request, so it should not), the admission round
trip (the stack grants a lease a few hundred ms after a slot frees; the replay at once), and the
external swing (telemetry samples it every few seconds; the record keeps it a snapshot per
`--snapshot-s`).

The catalog is bench/catalogs/whatif_fidelity.toml; every card is simulated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment

from modelforge.dev import temporal_binary
from modelforge.simulate import compare, record_from_store
from modelforge.simulate._engine import _percentile
from modelforge.store import Store
from modelforge.temporal import register_search_attributes
from workers.stack import Stack, running_stack

CATALOG = Path(__file__).parent / "catalogs" / "whatif_fidelity.toml"
CLASS_OF = {"app": "interactive", "rag": "interactive", "lab": "benchmark"}


@dataclass(frozen=True)
class Arrival:
    t: float
    capability: str
    tenant: str
    service_s: float


def trace(kind: str, minutes: float, seed: int = 11) -> list[Arrival]:
    """quiet: chat calls about one every 8 s (gaps past its 20 s TTL now and then), embeddings
    every 4 s, a lab turn every 40 s. overloaded: chat calls at 1.2/s of 2-4 s on 2 slots
    (0.67/s of capacity), the rest as quiet."""
    rng = random.Random(seed)
    end = minutes * 60.0
    arrivals: list[Arrival] = []
    chat_rate = 0.12 if kind == "quiet" else 1.2
    for capability, tenant, rate, low, high in (
        ("chat@1", "app", chat_rate, 1.0, 3.0 if kind == "quiet" else 4.0),
        ("embed@1", "rag", 0.25, 0.1, 0.3),
        ("lab@1", "lab", 1 / 40.0, 2.0, 5.0),
    ):
        t = rng.expovariate(rate)
        while t < end:
            arrivals.append(Arrival(round(t, 3), capability, tenant, round(rng.uniform(low, high), 2)))
            t += rng.expovariate(rate)
    return sorted(arrivals, key=lambda a: a.t)


async def _drive(stack: Stack, arrivals: list[Arrival], lease_timeout_s: float) -> dict[str, str]:
    started = time.monotonic()
    outcomes: dict[str, str] = {}

    async def one(arrival: Arrival, request_id: str) -> None:
        handle = await stack.start_request(
            arrival.capability,
            tenant=arrival.tenant,
            request_id=request_id,
            input={"text": "fidelity", "simulate_invoke_s": arrival.service_s},
            lease_timeout_s=lease_timeout_s,
        )
        try:
            await handle.result()
            outcomes[request_id] = "ok"
        except WorkflowFailureError as error:
            outcomes[request_id] = getattr(error.cause, "type", None) or "UNTYPED"

    tasks = []
    for arrival in arrivals:
        delay = started + arrival.t - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(arrival, f"fid-{uuid.uuid4().hex[:10]}")))
    await asyncio.gather(*tasks)
    return outcomes


async def _recorded(store: Store, since: float, until: float, requests: set[str]) -> dict[str, Any]:
    """What happened, from the record itself: each request's wait to its first lease (none: never
    served), and the loads that finished."""
    rows = await store.record_rows(since_s=since, until_s=until, pool="default")
    first_wait: dict[str, float] = {}
    tenants: dict[str, str] = {}
    loads = 0
    for event in rows["events"]:
        payload = event["payload"] or {}
        if event["kind"] == "lease_granted" and event["request_id"] in requests:
            if event["request_id"] not in first_wait and payload.get("waited_s") is not None:
                first_wait[event["request_id"]] = float(payload["waited_s"])
            tenants[event["request_id"]] = str(payload.get("tenant"))
        elif event["kind"] == "resident_ready":
            loads += 1
    return {"first_wait": first_wait, "loads": loads}


def _class_waits(waits: dict[str, list[float]], never: dict[str, int]) -> dict[str, dict[str, float | None]]:
    out = {}
    for klass in sorted(set(waits) | set(never)):
        values = sorted(waits.get(klass, []))
        out[klass] = {
            name: _percentile(values, q, never.get(klass, 0))
            for name, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99))
        }
    return out


def _within(recorded: float | None, replayed: float | None) -> bool:
    if recorded is None or replayed is None:
        return recorded is None and replayed is None
    return abs(recorded - replayed) <= max(2.0, 0.25 * recorded)


def _request_by_request(
    kind: str, record: Any, truth: dict[str, Any], replayed: dict[str, float | None], keep: Path | None
) -> None:
    """Each request's recorded wait beside its replayed one: the five furthest apart are printed
    (where a tail differs, these are the requests that make it); with `keep`, all of them go to
    `KEEP/KIND/requests-compared.jsonl` beside the scenario the replay ran."""
    rows = []
    for line in record.lines:
        recorded, replay_wait = truth["first_wait"].get(line["id"]), replayed.get(line["id"])
        gap = math.inf if (recorded is None) != (replay_wait is None) else abs((recorded or 0) - (replay_wait or 0))
        rows.append({**line, "recorded_wait_s": recorded, "replayed_wait_s": replay_wait, "gap_s": gap})
    rows.sort(key=lambda row: -row["gap_s"])
    print(f"[{kind}] furthest apart: t, capability, tenant, service, recorded wait, replayed wait")
    for row in rows[:5]:
        shown = [("never" if row[k] is None else f"{row[k]:.2f} s") for k in ("recorded_wait_s", "replayed_wait_s")]
        what = f"{row['t']:7.1f} s {row['capability']} {row['tenant']} {row['service_s']:.2f} s"
        print(f"[{kind}]   {what}: {shown[0]} vs {shown[1]}")
    if keep is not None:
        folder = keep / kind
        record.write(folder)
        with (folder / "requests-compared.jsonl").open("w", encoding="utf-8") as handle:
            for row in sorted(rows, key=lambda row: row["t"]):
                handle.write(json.dumps({**row, "gap_s": None if math.isinf(row["gap_s"]) else row["gap_s"]}) + "\n")
        print(f"[{kind}] the scenario and every request's two waits: {folder}")


async def run_one(kind: str, minutes: float, snapshot_s: float, keep: Path | None = None) -> bool:
    arrivals = trace(kind, minutes)
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=temporal_binary(), dev_server_log_level="error"
    )
    import pgserver

    folder = tempfile.mkdtemp(prefix="mf-fidelity-")
    server = pgserver.get_server(folder, cleanup_mode="stop")
    url = server.get_uri()
    try:
        await register_search_attributes(env.client)
        async with running_stack(
            env.client, url, catalog_path=CATALOG, telemetry_interval_s=2.0, snapshot_interval_s=snapshot_s
        ) as stack:
            since = time.time() - 1.0
            print(f"\n[{kind}] {len(arrivals)} requests over {minutes:g} min on the dev stack (simulated card)")
            outcomes = await _drive(stack, arrivals, lease_timeout_s=60.0)
            ended = {}
            for value in outcomes.values():
                ended[value] = ended.get(value, 0) + 1
            print(f"[{kind}] outcomes: {ended}")
            # The event log trails the workflows: wait until every request's end is written.
            for _ in range(60):
                rows = await stack.store.record_rows(since_s=since, until_s=time.time() + 1, pool="default")
                done = {
                    e["request_id"] for e in rows["events"] if e["kind"] in ("request_rejected", "admission_failed")
                }
                done |= {r["request_id"] for r in rows["ledger"] if r["ended_at"] is not None}
                if set(outcomes) <= done:
                    break
                await asyncio.sleep(1.0)
            until = time.time() + 1.0
            truth = await _recorded(stack.store, since, until, set(outcomes))
    finally:
        await env.shutdown()
    try:
        record = await record_from_store(url, window_s=until - since, until_s=until, pool="default")
    finally:
        server.cleanup()
    _, replay = compare(record, None)  # (what the record says, the replay under the catalog as it was)
    # Recorded waits per class, every request counted (one never served waits forever).
    waits: dict[str, list[float]] = {}
    never: dict[str, int] = {}
    tenant_of = {line["id"]: line["tenant"] for line in record.lines}
    for request_id in outcomes:
        klass = CLASS_OF[tenant_of.get(request_id, "app")]
        if request_id in truth["first_wait"]:
            waits.setdefault(klass, []).append(truth["first_wait"][request_id])
        else:
            never[klass] = never.get(klass, 0) + 1
    recorded = _class_waits(waits, never)
    replayed = replay.figures["by_class"]
    ok = True
    print(f"[{kind}] | class | percentile | recorded wait | replayed wait | within max(2 s, 25%) |")
    print(f"[{kind}] |---|---|---:|---:|---|")
    for klass, figures in recorded.items():
        for name, value in figures.items():
            other = replayed.get(klass, {}).get(f"wait_{name}_s")
            good = _within(value, other)
            ok &= good
            shown = "never" if value is None else f"{value:.2f} s"
            shown_other = "never" if other is None else f"{other:.2f} s"
            print(f"[{kind}] | {klass} | {name} | {shown} | {shown_other} | {'yes' if good else 'NO'} |")
    loads_ok = abs(truth["loads"] - replay.figures["cold_starts"]) <= max(2, math.ceil(0.2 * truth["loads"]))
    ok &= loads_ok
    print(
        f"[{kind}] loads: recorded {truth['loads']}, replayed {replay.figures['cold_starts']}"
        f" -> {'within' if loads_ok else 'OUTSIDE'} max(2, 20%)"
    )
    _request_by_request(kind, record, truth, replay.waits, keep)
    print(f"[{kind}] replay: invariant violations {replay.figures['invariant_violations']}, notes:")
    for note in record.notes:
        print(f"[{kind}]   {note}")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--only", choices=("quiet", "overloaded"))
    parser.add_argument("--snapshot-s", type=float, default=10.0, help="the capacity snapshot interval")
    parser.add_argument(
        "--keep", type=Path, help="write each run's scenario and every request's recorded and replayed wait here"
    )
    args = parser.parse_args()
    kinds = [args.only] if args.only else ["quiet", "overloaded"]
    results = [asyncio.run(run_one(kind, args.minutes, args.snapshot_s, args.keep)) for kind in kinds]
    for kind, ok in zip(kinds, results, strict=True):
        print(f"{kind}: {'within tolerance' if ok else 'OUTSIDE tolerance (see above)'}")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
