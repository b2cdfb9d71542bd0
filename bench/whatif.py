"""What-if speed: a 7-day record of a busy homelab, built from the shipped Azure and Alibaba
traces at their real rates, read back as a scenario and replayed under the catalog as it was and
under a proposed one (the chat model's TTL 600 s -> 3,600 s), timed.

    .venv/bin/python -m bench.whatif                 # in memory: the record's rows as the store returns them
    .venv/bin/python -m bench.whatif --store         # the record written to an embedded Postgres and read back
    .venv/bin/python -m bench.whatif --peak-hours 1  # a quieter week

The homelab (every card simulated): the Azure card of `modelforge trace azure` (a 24 GiB RTX
3090 shared with Plex, 1.2 GiB always, and Tdarr transcodes, 2.5 GiB for ten minutes every half
hour, all week) with its deployments and tenants, plus a second 24 GiB card. Each day the
Azure trace's hour of production code-completion calls (and an embedding call for every third)
plays at its real rate in each of `--peak-hours` peak hours (09:00, 20:00, 13:00, ...); a lab
session every 7 minutes and an evaluation job every 10 minutes all week, as the converter makes
them; and the Alibaba trace's busiest week of single-GPU pods (1,266 pods at their real
creation times and run lengths, `gpu_milli` of a card each, classes by qos) as batch jobs.

The record is what the production policy did with that week (`modelforge.simulate._recorder`:
its events as the scheduler records them, a capacity snapshot a minute per card). The figure
is the wall time of `simulate --from-record 7d --catalog NEW.toml`'s work after the rows are
read: building the scenario from the rows and both replays. Target: under 60 s.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import random
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from modelforge.domain import Catalog, GiB
from modelforge.simulate import build_record_scenario, compare, comparison_table, load_scenario, replay_processes
from modelforge.simulate._recorder import MadeRecord, make_record, record_rows
from modelforge.simulate._scenario import ExternalUsage, Scenario, parse_request_lines
from modelforge.traces import AzureOptions, convert_azure

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT / "data" / "traces"
DAY = 86400.0
WEEK = 7 * DAY
PEAKS = (9, 20, 13, 17, 11, 22, 7, 15)
QOS = {"Guaranteed": "production", "LS": "interactive", "Burstable": "background", "BE": "maintenance"}
QOS_TENANT = {"production": "ops", "interactive": "notebooks", "background": "research", "maintenance": "batch"}


def _azure_hour(tmp: Path) -> tuple[Catalog, list[dict[str, object]]]:
    """The converter's catalog and its hour of production and embedding calls."""
    path = convert_azure(TRACES / "azure_llm_code_2023.csv", tmp / "azure", AzureOptions())
    scenario = load_scenario(path)
    lines = [json.loads(line) for line in (tmp / "azure" / "requests.jsonl").read_text().splitlines()]
    calls = [line for line in lines if line["capability"] in ("llm.code@1", "rag.embedding@1")]
    return scenario.catalog, calls


def _alibaba_week() -> list[dict[str, str]]:
    with (TRACES / "alibaba_gpu_2023_pods_default.csv").open(newline="") as handle:
        pods = [
            row
            for row in csv.DictReader(handle)
            if row["num_gpu"] == "1" and row["scheduled_time"] and row["deletion_time"]
        ]
    weeks: dict[int, list[dict[str, str]]] = {}
    for row in pods:
        weeks.setdefault(int(row["creation_time"]) // int(WEEK), []).append(row)
    busiest = max(weeks.values(), key=len)
    return sorted(busiest, key=lambda r: int(r["creation_time"]))


def homelab_week(peak_hours: int, seed: int = 7) -> Scenario:
    with tempfile.TemporaryDirectory() as folder:
        azure_catalog, hour = _azure_hour(Path(folder))
    card = azure_catalog.accelerators[0]
    second = replace(card, id="gpu-node/1", uuid="", model=card.model)
    job = replace(
        next(d for d in azure_catalog.deployments if d.capability == "eval.harness@1"),
        capability="job.gpu@1",
        envelope_bytes=int(23 * GiB),
    )
    tenants = list(azure_catalog.tenants)
    for klass, name in QOS_TENANT.items():
        tenants.append(replace(tenants[0], name=name, weight=1.0, default_priority=klass, max_priority=klass))
    catalog = replace(
        azure_catalog,
        accelerators=[card, second],
        deployments=[*azure_catalog.deployments, job],
        tenants=tenants,
    )
    rng = random.Random(seed)
    lines: list[dict[str, object]] = []
    for day in range(7):
        for peak in PEAKS[:peak_hours]:
            offset = day * DAY + peak * 3600.0
            for call in hour:
                lines.append({**call, "t": round(offset + float(call["t"]), 6)})  # type: ignore[arg-type]
    at = 120.0
    while at < WEEK:  # lab sessions, as the Azure converter makes them
        turn = at
        for _ in range(rng.randint(5, 15)):
            lines.append(
                {
                    "t": round(turn, 6),
                    "capability": "llm.experimental@1",
                    "priority": "benchmark",
                    "tenant": "lab",
                    "service_s": round(rng.uniform(2.0, 6.0), 6),
                }
            )
            turn += rng.uniform(5.0, 20.0)
        at += 420.0
    at = 60.0
    while at < WEEK:  # evaluation jobs
        lines.append(
            {
                "t": round(at, 6),
                "capability": "eval.harness@1",
                "priority": "background",
                "tenant": "research",
                "service_s": round(900.0 * rng.uniform(0.7, 1.3), 6),
            }
        )
        at += 600.0
    pods = _alibaba_week()
    first = int(pods[0]["creation_time"])
    usable = card.total_bytes - card.reserve_bytes
    for pod in pods:
        klass = QOS[pod["qos"]]
        lines.append(
            {
                "t": float(int(pod["creation_time"]) - first),
                "capability": "job.gpu@1",
                "priority": klass,
                "tenant": QOS_TENANT[klass],
                "service_s": float(int(pod["deletion_time"]) - int(pod["scheduled_time"])),
                "bytes_per_gpu": max(1, usable * int(pod["gpu_milli"]) // 1000),
                "preemptible": pod["qos"] == "BE",
            }
        )
    lines.sort(key=lambda line: float(line["t"]))  # type: ignore[arg-type]
    for number, line in enumerate(lines):
        line["id"] = f"r{number}"
    requests, with_variants = parse_request_lines([json.dumps(line) for line in lines], catalog)
    external = [ExternalUsage(card.id, int(1.2 * GiB), 0.0, float("inf"), "plex")]
    burst = 300.0
    while burst < WEEK:
        external.append(ExternalUsage(card.id, int(2.5 * GiB), burst, burst + 600.0, "tdarr"))
        burst += 1800.0
    return Scenario(with_variants, requests, external, name="homelab week")


# The record's first moment (2026-01-01 00:00 UTC), and the window `simulate --from-record 7d`
# reads it back through: the week and a day after, for what was still running.
START_EPOCH = 1_767_225_600.0


def record_window() -> tuple[float, float]:
    return START_EPOCH, START_EPOCH + WEEK + DAY


def longer_ttl(catalog: Catalog, ttl_s: float) -> Catalog:
    return replace(
        catalog,
        deployments=[replace(d, ttl_s=ttl_s) if d.capability == "llm.code@1" else d for d in catalog.deployments],
    )


async def _through_store(record: MadeRecord, since: float, until: float) -> tuple[dict[str, list], float, float]:
    """Write the record to an embedded Postgres as the scheduler and telemetry workflows do, and
    read it back; (rows, write seconds, read seconds)."""
    import pgserver

    from modelforge.messages import SnapshotBatch
    from modelforge.policy import AcceleratorStatus
    from modelforge.store import Store

    with tempfile.TemporaryDirectory() as folder:
        server = pgserver.get_server(folder, cleanup_mode="stop")
        try:
            store = await Store.open(server.get_uri())
            try:
                await store.migrate()
                started = time.perf_counter()
                for chunk in range(0, len(record.events), 5000):
                    await store.record_events(record.events[chunk : chunk + 5000])
                for at, card, pool, node, total, external, reserve in record.snapshots:
                    status = AcceleratorStatus(
                        id=card, node=node, kind="gpu", model="simulated", production_eligible=True,
                        simulated=True, total_bytes=total, observed_used_bytes=external, external_bytes=external,
                        resident_bytes=0, leased_bytes=0, reserve_bytes=reserve,
                        schedulable_bytes=total - external - reserve, pressure=False, healthy=True, fresh=True,
                        observation_age_s=0.0, observed_at=at,
                    )  # fmt: skip
                    batch = SnapshotBatch(pool=pool, at=at, accelerators=[status])
                    await store.record_snapshots(batch, retention_s=30 * DAY)
                wrote = time.perf_counter() - started
                started = time.perf_counter()
                rows = await store.record_rows(since_s=since, until_s=until, pool=None)
                read = time.perf_counter() - started
            finally:
                await store.close()
        finally:
            server.cleanup()
    return rows, wrote, read


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-hours", type=int, default=2, help="Azure hours a day at the trace's rate (1-8)")
    parser.add_argument("--store", action="store_true", help="write the record to Postgres and read it back")
    parser.add_argument("--ttl", type=float, default=3600.0, help="the proposed TTL of llm.code@1")
    args = parser.parse_args()
    if not 1 <= args.peak_hours <= len(PEAKS):
        parser.error(f"--peak-hours must be 1 to {len(PEAKS)}")
    started = time.perf_counter()
    scenario = homelab_week(args.peak_hours)
    built = time.perf_counter() - started
    print(f"homelab week: {len(scenario.requests):,} requests, 2 simulated cards ({built:.1f} s to build)")
    started = time.perf_counter()
    record = make_record(scenario, START_EPOCH)
    made_s = time.perf_counter() - started
    print(f"the week as the production policy ran it: {len(record.events):,} events ({made_s:.1f} s)")
    since, until = record_window()
    if args.store:
        rows, wrote, read = asyncio.run(_through_store(record, since, until))
        print(f"Postgres: wrote the record in {wrote:.1f} s, read the window back in {read:.1f} s")
    else:
        rows = record_rows(record)
    as_was = scenario.catalog
    del record, scenario  # what the caller of `simulate --from-record` would not hold either
    started = time.perf_counter()
    with replay_processes() as processes:  # as `simulate --from-record` starts them, before the scenario
        replay = build_record_scenario(rows, [(START_EPOCH - 1.0, as_was)], since_s=since, until_s=until)
        scenario_s = time.perf_counter() - started
        runs = compare(replay, longer_ttl(as_was, args.ttl), processes=processes)
    total = time.perf_counter() - started
    print(f"\n| metric | recorded | as it was (TTL 600 s) | proposed (TTL {args.ttl:g} s) |\n|---|---:|---:|---:|")
    for label, cells in comparison_table(runs):
        print(f"| {label} | {' | '.join(cells)} |")
    print(
        f"\nscenario from the record: {scenario_s:.1f} s; both replays: {total - scenario_s:.1f} s;"
        f" what-if in all: {total:.1f} s (target: under 60 s) -> {'met' if total < 60 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
