"""What-if on the record, against a real Postgres: the production policy makes the record (its
events, written by the store, the ledger following from them; a capacity snapshot a minute),
`modelforge simulate --from-record` reads it back as a scenario, and the comparison replays it
under the catalog as it was and under a proposed one. Cards are simulated."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from modelforge.catalog import parse_catalog
from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.messages import SnapshotBatch
from modelforge.policy import AcceleratorStatus
from modelforge.simulate import (
    RecordError,
    build_record_scenario,
    compare,
    comparison_json,
    load_scenario,
    record_from_store,
    replay_processes,
)
from modelforge.simulate._recorder import MadeRecord, make_record, record_rows
from modelforge.simulate._scenario import ExternalUsage, Scenario, parse_request_lines
from modelforge.store import Store

GIB = 1 << 30


def _catalog(ttl_s: float, *, pool: str = "default") -> Catalog:
    return parse_catalog(
        {
            "accelerators": [
                {
                    "id": "box/0",
                    "node": "box",
                    "pool": pool,
                    "model": "sim 24GB",
                    "total_bytes": 24 * GIB,
                    "reserve_bytes": GIB,
                    "production_eligible": True,
                    "simulated": True,
                }
            ],
            "deployments": [
                {
                    "capability": "chat@1",
                    "envelope_bytes": 4 * GIB,
                    "residency": "keep_warm",
                    "ttl_s": ttl_s,
                    "load_s": 10.0,
                    "concurrency": 1,
                    "measured_on": ["sim 24GB"],
                }
            ],
            "tenants": [
                {"name": "alice-private", "default_priority": "interactive"},
                {"name": "bob-private", "default_priority": "interactive"},
            ],
        }
    )[0]


def _production_day(catalog: Catalog) -> Scenario:
    """Ten calls two minutes apart (1 s each), alternating tenants, on a card a media server
    uses 2 GiB of for its first ten minutes; then, two minutes after the last, one call with a
    5 s deadline that a cold 10 s load cannot meet (refused under a 60 s TTL,
    DEADLINE_CANNOT_BE_MET)."""
    lines = [
        json.dumps(
            {
                "id": f"call-{i}",
                "t": 120.0 * i,
                "capability": "chat@1",
                "tenant": "alice-private" if i % 2 else "bob-private",
                "service_s": 1.0,
            }
        )
        for i in range(10)
    ]
    lines.append(
        json.dumps(
            {
                "id": "urgent",
                "t": 1200.0,
                "capability": "chat@1",
                "tenant": "alice-private",
                "service_s": 1.0,
                "deadline_s": 5.0,
            }
        )
    )
    requests, with_variants = parse_request_lines(lines, catalog)
    return Scenario(with_variants, requests, [ExternalUsage("box/0", 2 * GIB, 0.0, 600.0, "plex")])


async def _write(store: Store, record: MadeRecord) -> None:
    await store.record_events(record.events)
    for at, card, pool, node, total, external, reserve in record.snapshots:
        status = AcceleratorStatus(
            id=card, node=node, kind="gpu", model="sim 24GB", production_eligible=True, simulated=True,
            total_bytes=total, observed_used_bytes=external, external_bytes=external, resident_bytes=0,
            leased_bytes=0, reserve_bytes=reserve, schedulable_bytes=total - external - reserve, pressure=False,
            healthy=True, fresh=True, observation_age_s=0.0, observed_at=at,
        )  # fmt: skip
        await store.record_snapshots(SnapshotBatch(pool=pool, at=at, accelerators=[status]), retention_s=30 * 86400)


async def test_the_record_replays_as_it_happened_and_a_longer_ttl_saves_the_loads(database_url: str) -> None:
    as_was = _catalog(60.0)
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.apply_catalog(_catalog(30.0))  # an older catalog: the later one is in force
        await store.apply_catalog(as_was)
        start = time.time() + 5.0  # the record's first minute, after both catalogs were applied
        record = make_record(_production_day(as_was), start)
        await _write(store, record)
        ledger = await store.ledger()
    finally:
        await store.close()
    assert len(ledger) == 10 and all(row["outcome"] == "ok" for row in ledger)

    replay = await record_from_store(database_url, window_s=3600.0, until_s=start + 3600.0 - 1.0)
    # The builder read the production policy's record: each request once, at its arrival, with
    # its class, tenant and measured service time; the refused one with what it asked for.
    assert [line["t"] for line in replay.lines] == [pytest.approx(1.0 + 120.0 * i, abs=0.01) for i in range(10)] + [
        pytest.approx(1201.0, abs=0.01)
    ]
    assert {line["tenant"] for line in replay.lines} == {"alice-private", "bob-private"}
    # In their tenants' default class: replayed without one, so the replayed catalog's default decides.
    assert all("priority" not in line and line["service_s"] == 1.0 for line in replay.lines)
    urgent = replay.lines[-1]
    assert urgent["id"] == "urgent" and urgent["deadline_s"] == 5.0
    assert replay.catalog.deployments[0].ttl_s == 60.0  # the catalog in force, not the older one
    # The media server's ten minutes, and the second of the window before the first snapshot
    # (what the card held before its first snapshot is taken as that snapshot's).
    assert [(e.bytes, e.start_s, e.end_s) for e in replay.external] == [(2 * GIB, 0.0, 601.0)]

    recorded, as_it_was, proposed = compare(replay, _catalog(300.0))
    before, after = as_it_was.figures, proposed.figures
    # What happened, from the record alone, beside its replay under the same catalog.
    assert recorded.figures["cold_starts"] == 10 and recorded.figures["load_s"] == pytest.approx(100.0)
    assert recorded.figures["by_class"]["interactive"] == before["by_class"]["interactive"]
    assert recorded.figures["refusals"] == {"DEADLINE_CANNOT_BE_MET": 1}
    # Under the catalog in force the replay reproduces the record: ten cold loads of 10 s,
    # every call waits its load, and the urgent call is refused again.
    assert before["cold_starts"] == 10 and before["load_s"] == 100.0
    assert before["by_class"]["interactive"]["wait_p50_s"] == 10.0
    assert before["refusals"] == {"DEADLINE_CANNOT_BE_MET": 1}
    # A 300 s TTL keeps the model between calls two minutes apart: one load, the other calls
    # start at once, the urgent call (the model still warm) is served; paid in idle VRAM-hours.
    assert after["cold_starts"] == 1 and after["load_s"] == 10.0
    assert after["by_class"]["interactive"]["wait_p50_s"] == 0.0
    assert after["by_class"]["interactive"]["wait_p95_s"] == 10.0  # the first call's load
    assert after["refusals"] == {} and after["goodput"] == 1.0
    assert after["vram_gib_hours_idle_resident"] > before["vram_gib_hours_idle_resident"]
    assert before["invariant_violations"] == after["invariant_violations"] == 0
    shown = comparison_json(replay, [recorded, as_it_was, proposed])
    assert set(shown["replays"]) == {"as it was", "proposed"} and shown["recorded"]["cold_starts"] == 10
    # A long record's two replays run side by side, each in a process of its own (started by
    # `compare`, or ahead by the caller while it reads the record): the same figures (but their
    # wall times).
    with replay_processes() as processes:
        started_ahead = compare(replay, _catalog(300.0), parallel=True, processes=processes)
    for side_by_side in (compare(replay, _catalog(300.0), parallel=True), started_ahead):
        assert [r.label for r in side_by_side] == ["recorded", "as it was", "proposed"]
        for serial, parallel in zip((as_it_was, proposed), side_by_side[1:], strict=True):
            assert {k: v for k, v in parallel.figures.items() if k != "replay_wall_s"} == {
                k: v for k, v in serial.figures.items() if k != "replay_wall_s"
            }


async def test_anonymised_scenario_hides_tenants_and_request_ids(database_url: str, tmp_path: Path) -> None:
    as_was = _catalog(60.0)
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.apply_catalog(as_was)
        start = time.time() + 5.0
        await _write(store, make_record(_production_day(as_was), start))
    finally:
        await store.close()
    replay = await record_from_store(database_url, window_s=3600.0, until_s=start + 3599.0, anonymise=True)
    written = replay.write(tmp_path / "shared")
    text = written.read_text() + (tmp_path / "shared" / "requests.jsonl").read_text()
    for secret in ("alice-private", "bob-private", "call-", "urgent"):
        assert secret not in text
    # The shared scenario is one `modelforge simulate` reads, with the same requests.
    loaded = load_scenario(written)
    assert len(loaded.requests) == 11
    assert {r.tenant for r in loaded.requests} == {"tenant-1", "tenant-2"}
    figures = compare(replay, None)[1].figures
    assert set(figures["by_tenant"]) == {"tenant-1", "tenant-2"}


async def test_a_store_without_history_or_with_an_unknown_pool_says_so(database_url: str) -> None:
    store = await Store.open(database_url)
    try:
        await store.migrate()
    finally:
        await store.close()
    now = time.time()
    with pytest.raises(ModelForgeError) as empty:
        await record_from_store(database_url, window_s=3600.0, until_s=now)
    assert empty.value.failure == FailureClass.REQUEST_INVALID and "no catalog" in empty.value.message
    rows = record_rows(make_record(_production_day(_catalog(60.0)), now))
    with pytest.raises(RecordError) as unknown:
        build_record_scenario(rows, [(now - 10, _catalog(60.0))], since_s=now, until_s=now + 3600, pool="gpu-farm")
    assert unknown.value.failure == FailureClass.REQUEST_INVALID and "unknown pool 'gpu-farm'" in unknown.value.message
    with pytest.raises(RecordError):
        build_record_scenario(rows, [(now - 10, _catalog(60.0))], since_s=now, until_s=now - 1)


def test_external_memory_before_the_first_snapshot_is_the_first_snapshots_not_nothing() -> None:
    # A media server uses 2 GiB of the card all along; the window starts 50 s before the first
    # snapshot in it. Read as nothing before that snapshot, its 2 GiB would arrive as a swing,
    # raise the dynamic reserve for an hour and keep the card under GPU_PRESSURE: the replay
    # made requests wait a minute that waited nothing (the what-if fidelity bench found it).
    now = 1_000_000.0
    rows = record_rows(make_record(_production_day(_catalog(60.0)), now))
    rows["snapshots"] = [row for row in rows["snapshots"] if row["at"] >= now + 50]
    assert rows["snapshots"] and all(row["external_bytes"] == 2 * GIB for row in rows["snapshots"][:5])
    record = build_record_scenario(rows, [(now - 10, _catalog(60.0))], since_s=now, until_s=now + 1500)
    first = record.external[0]
    assert (first.start_s, first.bytes) == (0.0, 2 * GIB)


def test_only_the_windows_snapshots_make_the_external_memory_and_its_last_value_holds_on() -> None:
    # A record read without the store's window (rows in memory): snapshots before the window
    # and after it. The one before says what the card held when the window opened; those after
    # it are not the window's (each made a step of its own: a replay pass a minute for nothing).
    # Past the window's end the last value holds, where the replay serves the work left then.
    now = 1_000_000.0
    rows = record_rows(make_record(_production_day(_catalog(60.0)), now - 600))
    card = rows["snapshots"][0]["accelerator"]
    rows["snapshots"] = [
        {**rows["snapshots"][0], "at": at, "external_bytes": nbytes}
        for at, nbytes in [(now - 300, 3 * GIB), (now + 100, 3 * GIB), (now + 400, 1 * GIB), (now + 700, 1 * GIB)]
        + [(now + 960 + 60 * k, 2 * GIB * (k % 2)) for k in range(20)]  # after the window's end
    ]
    record = build_record_scenario(rows, [(now - 900, _catalog(60.0))], since_s=now, until_s=now + 900)
    assert [(e.accelerator, e.bytes, e.start_s, e.end_s) for e in record.external] == [
        (card, 3 * GIB, 0.0, 400.0),
        (card, 1 * GIB, 400.0, math.inf),
    ]


async def test_a_snapshot_of_a_card_not_yet_observed_is_not_read_as_an_empty_card(database_url: str) -> None:
    # The stack's first snapshot can come before the card's first telemetry sample: its
    # external memory reads 0 there. Replayed, that 0 then the media server's 2 GiB was a swing.
    store = await Store.open(database_url)
    try:
        await store.migrate()
        now = time.time()

        def status(at: float, external: int, observed: bool) -> AcceleratorStatus:
            return AcceleratorStatus(
                id="box/0", node="box", kind="gpu", model="sim 24GB", production_eligible=True, simulated=True,
                total_bytes=24 * GIB, observed_used_bytes=external, external_bytes=external, resident_bytes=0,
                leased_bytes=0, reserve_bytes=GIB, schedulable_bytes=23 * GIB - external, pressure=False,
                healthy=True, fresh=observed, observation_age_s=0.0 if observed else None,
                observed_at=at if observed else None,
            )  # fmt: skip

        for at, external, observed in ((now, 0, False), (now + 10, 2 * GIB, True)):
            batch = SnapshotBatch(pool="default", at=at, accelerators=[status(at, external, observed)])
            await store.record_snapshots(batch, retention_s=86400)
        rows = await store.record_rows(since_s=now - 1, until_s=now + 60, pool="default")
        assert [(round(r["at"] - now), r["external_bytes"]) for r in rows["snapshots"]] == [(10, 2 * GIB)]
    finally:
        await store.close()


def test_a_request_that_timed_out_waiting_times_out_again_in_the_replay() -> None:
    # Production's request waited for a lease 30 s (its own lease timeout, not the simulator's
    # default 300 s) behind a 100 s call on a model of concurrency 1, and timed out. The record
    # says so, and the replay under the same catalog refuses it at the same wait, where with
    # the default it would have been served after 99 s (the fidelity bench's overloaded tails).
    catalog = _catalog(600.0)
    lines = [
        json.dumps({"id": "long", "t": 0.0, "capability": "chat@1", "tenant": "bob-private", "service_s": 100.0}),
        json.dumps(
            {
                "id": "impatient",
                "t": 20.0,
                "capability": "chat@1",
                "tenant": "alice-private",
                "service_s": 1.0,
                "lease_timeout_s": 30.0,
            }
        ),
    ]
    requests, with_variants = parse_request_lines(lines, catalog)
    now = 1_000_000.0
    rows = record_rows(make_record(Scenario(with_variants, requests, []), now))
    record = build_record_scenario(rows, [(now - 10, catalog)], since_s=now, until_s=now + 600)
    line = next(line for line in record.lines if line["id"] == "impatient")
    assert line["lease_timeout_s"] == 30.0
    recorded, as_it_was = compare(record, None)
    assert recorded.figures["refusals"] == as_it_was.figures["refusals"] == {"LEASE_TIMEOUT": 1}
    assert as_it_was.waits["impatient"] is None


def test_the_record_keeps_each_requests_input_size_served_or_refused(tmp_path: Path) -> None:
    # A served call and one that timed out waiting, each with the size of the input it sent:
    # the record's events carry it, the scenario built from them has it on both lines, and the
    # scenario written for a bug report (anonymised) keeps it and reads back with it.
    catalog = _catalog(600.0)
    lines = [
        json.dumps(
            {"id": "long", "t": 0.0, "capability": "chat@1", "tenant": "bob-private", "service_s": 100.0,
             "input_bytes": 123456}
        ),
        json.dumps(
            {"id": "impatient", "t": 20.0, "capability": "chat@1", "tenant": "alice-private", "service_s": 1.0,
             "lease_timeout_s": 30.0, "input_bytes": 17}
        ),
    ]  # fmt: skip
    requests, with_variants = parse_request_lines(lines, catalog)
    assert [r.input_bytes for r in requests] == [123456, 17]
    now = 1_000_000.0
    rows = record_rows(make_record(Scenario(with_variants, requests, []), now))
    record = build_record_scenario(rows, [(now - 10, catalog)], since_s=now, until_s=now + 600, anonymise=True)
    assert [(line["id"], line.get("input_bytes")) for line in record.lines] == [("r1", 123456), ("r2", 17)]
    assert not any("without an input size" in note for note in record.notes), record.notes
    loaded = load_scenario(record.write(tmp_path / "shared"))
    assert [r.input_bytes for r in loaded.requests] == [123456, 17]
    # A line with a size that is not a size is refused by name.
    bad = json.dumps({"t": 0.0, "capability": "chat@1", "tenant": "bob-private", "service_s": 1.0, "input_bytes": -1})
    with pytest.raises(ModelForgeError, match="input_bytes must be at least 0"):
        parse_request_lines([bad], catalog)


def _cli(*args: str, url: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_DATABASE_URL"] = url
    return subprocess.run(
        [sys.executable, "-m", "modelforge", *args], capture_output=True, text=True, timeout=120, env=env, check=False
    )


async def test_cli_what_if_prints_both_and_applies_nothing(database_url: str, tmp_path: Path) -> None:
    as_was = _catalog(60.0)
    store = await Store.open(database_url)
    try:
        await store.migrate()
        await store.apply_catalog(as_was)
        await _write(store, make_record(_production_day(as_was), time.time() - 3000.0))
    finally:
        await store.close()
    proposed = tmp_path / "longer-ttl.toml"
    proposed.write_text(
        '[[accelerators]]\nid = "box/0"\nnode = "box"\nmodel = "sim 24GB"\ntotal_bytes = 25769803776\n'
        "reserve_bytes = 1073741824\nproduction_eligible = true\nsimulated = true\n\n"
        '[[deployments]]\ncapability = "chat@1"\nenvelope_bytes = 4294967296\nresidency = "keep_warm"\n'
        'ttl_s = 300\nload_s = 10.0\nmeasured_on = ["sim 24GB"]\n\n'
        '[[tenants]]\nname = "alice-private"\ndefault_priority = "interactive"\n\n'
        '[[tenants]]\nname = "bob-private"\ndefault_priority = "interactive"\n'
    )
    done = _cli("catalog", "apply", str(proposed), "--what-if", "1h", "--json", url=database_url)
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    replays = shown["replays"]
    assert shown["recorded"]["cold_starts"] == replays["as it was"]["cold_starts"] == 10
    assert replays["proposed"]["cold_starts"] == 1
    store = await Store.open(database_url)
    try:
        assert (await store.load_catalog()).deployments[0].ttl_s == 60.0  # nothing applied
    finally:
        await store.close()
    picture = tmp_path / "both.png"
    args = ("simulate", "--from-record", "1h", "--catalog", str(proposed), "--plot", str(picture))
    table = _cli(*args, url=database_url)
    assert table.returncode == 0, table.stderr
    assert "cold_starts" in table.stdout and "simulated cards" in table.stdout
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # both replays' series, drawn

    # Bad input: one line naming REQUEST_INVALID, never a traceback.
    broken = tmp_path / "broken.toml"
    broken.write_text('[[deployments]]\ncapability = "chat@1"\n')
    (tmp_path / "plots.png").mkdir()  # a folder with a picture's name
    for args, fragment in (
        (["simulate", "--from-record", "7 weeks"], "a duration is a positive number"),
        (["simulate", "--from-record", "1h", "--pool", "gpu-farm"], "unknown pool 'gpu-farm'"),
        (["catalog", "apply", str(broken), "--what-if", "1h"], "invalid catalog"),
        (["simulate"], "give either SCENARIO or --from-record WINDOW"),
        # Where the results would go is checked before the replays run, not after.
        (["simulate", "--from-record", "1h", "--plot", str(picture / "x.png")], "both.png is a file, not a folder"),
        (["simulate", "--from-record", "1h", "--plot", str(tmp_path / "plots.png")], "is a folder, not a file"),
        (["simulate", "--from-record", "1h", "--out", str(picture)], "both.png is a file, not a folder"),
        (["simulate", str(broken), "--plot", str(picture / "x.png")], "both.png is a file, not a folder"),
    ):
        refused = _cli(*args, url=database_url)
        assert refused.returncode == 2, (args, refused.stdout, refused.stderr)
        lines = refused.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error REQUEST_INVALID") and fragment in lines[0], lines


def test_a_catalog_applied_inside_the_window_is_replayed_from_its_moment() -> None:
    # Production ran chat@1 with a 60 s TTL for an hour, then the operator applied a 600 s TTL.
    # Calls two minutes apart: each call of the first hour paid a 10 s load, the second hour
    # one. Replayed as it was, the change applies from its moment, as production applied it;
    # a proposed catalog (the 60 s one) replaces both.
    short, longer = _catalog(60.0), _catalog(600.0)
    lines = [
        json.dumps(
            {"id": f"call-{i}", "t": 1.0 + 120.0 * i, "capability": "chat@1", "tenant": "bob-private", "service_s": 1.0}
        )
        for i in range(60)
    ]
    requests, with_variants = parse_request_lines(lines, short)
    now = 1_000_000.0
    made = make_record(Scenario(with_variants, requests, [], catalog_changes=[(3600.0, longer)]), now)
    rows = record_rows(made)
    history = [(now - 10, short), (now + 3600.0, longer)]
    record = build_record_scenario(rows, history, since_s=now, until_s=now + 7300)
    assert [at for at, _ in record.changes] == [3600.0]
    assert record.catalog.deployments[0].ttl_s == 60.0 and record.changes[0][1].deployments[0].ttl_s == 600.0
    assert any("changed 1 time(s) inside the window" in note for note in record.notes)
    recorded, as_it_was, proposed = compare(record, short)
    assert recorded.figures["cold_starts"] == 31  # 30 in the first hour, 1 in the second
    assert as_it_was.figures["cold_starts"] == 31
    assert as_it_was.figures["by_class"]["interactive"] == recorded.figures["by_class"]["interactive"]
    assert proposed.figures["cold_starts"] == 60  # the 60 s TTL all along: every call loads
    assert as_it_was.figures["invariant_violations"] == proposed.figures["invariant_violations"] == 0


def _cards_catalog(cards: int) -> Catalog:
    """`cards` 24 GiB cards of one box, and a batch job that takes most of a card."""
    return parse_catalog(
        {
            "accelerators": [
                {
                    "id": f"box/{n}",
                    "node": "box",
                    "model": "sim 24GB",
                    "total_bytes": 24 * GIB,
                    "reserve_bytes": GIB,
                    "production_eligible": True,
                    "simulated": True,
                }
                for n in range(cards)
            ],
            "deployments": [
                {
                    "capability": "train@1",
                    "envelope_bytes": 20 * GIB,
                    "idle_bytes": 0,
                    "residency": "none",
                    "load_s": 5.0,
                    "concurrency": 1,
                    "queue_limit": 1000,
                    "measured_on": ["sim 24GB"],
                }
            ],
            "tenants": [{"name": "bob-private", "default_priority": "background"}],
        }
    )[0]


def test_a_card_added_inside_the_window_is_replayed_from_its_moment() -> None:
    # One card for the first hour, then the operator added a second. A 300 s job every 200 s:
    # the first hour's queue grows, the second card drains it. Replayed as it was, the second
    # card comes in at its moment (on the first card alone every later job would wait longer);
    # the one-card catalog proposed keeps the queue growing all along.
    one, two = _cards_catalog(1), _cards_catalog(2)
    lines = [
        json.dumps(
            {
                "id": f"job-{i}",
                "t": 1.0 + 200.0 * i,
                "capability": "train@1",
                "tenant": "bob-private",
                "service_s": 300.0,
                "lease_timeout_s": 7200.0,
            }
        )
        for i in range(36)
    ]
    requests, with_variants = parse_request_lines(lines, one)
    now = 1_000_000.0
    # A media server on the new card from +4000 s: in the record's snapshots of that card only.
    plex = [ExternalUsage("box/1", 2 * GIB, 4000.0, math.inf, "plex")]
    made = make_record(Scenario(with_variants, requests, plex, catalog_changes=[(3600.0, two)]), now)
    rows = record_rows(made)
    history = [(now - 10, one), (now + 3600.0, two)]
    record = build_record_scenario(rows, history, since_s=now, until_s=now + 3 * 3600)
    assert [len(catalog.accelerators) for _, catalog in record.changes] == [2]
    assert {usage.accelerator for usage in record.external if usage.bytes} == {"box/1"}
    assert any("+box/1" in note and "replayed with them" in note for note in record.notes)
    recorded, as_it_was, proposed = compare(record, one)
    background = recorded.figures["by_class"]["background"]
    assert background["served"] == 36
    assert as_it_was.figures["by_class"]["background"] == background
    # Three loads: the first card's job, the second card's when it came in, the first card's
    # again after it had emptied; the record counts the second card's too.
    assert recorded.figures["cold_starts"] == as_it_was.figures["cold_starts"] == 3
    # On the first card alone the same jobs wait far longer: the change is what the record shows.
    assert proposed.figures["by_class"]["background"]["wait_p95_s"] > 2 * background["wait_p95_s"]
    assert as_it_was.result is not None and proposed.result is not None
    # Utilization counts the second card's memory from its moment: two jobs at once never
    # read as more than the cards hold.
    assert max(as_it_was.result.series["vram_busy_utilization"]) <= 1.0
    assert 0 < as_it_was.result.vram_busy_utilization <= 1.0
    assert as_it_was.figures["invariant_violations"] == proposed.figures["invariant_violations"] == 0
