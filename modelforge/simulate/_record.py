"""A scenario from the record: the requests a pool really served (the lease ledger and the
event log), the external processes' memory over time (the per-minute capacity snapshots) and
the catalog in force then (the catalog history), as the simulator replays them.

Pure: `build_record_scenario` takes the rows the store returns (`Store.record_rows`,
`Store.catalog_history`) and the window, so it is tested on rows the real code paths write and
replayed without a database."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from modelforge.domain import Catalog
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.simulate._scenario import (
    ExternalUsage,
    Scenario,
    ShapeVariants,
    SimRequest,
    SimulationConfig,
    in_force_at,
    parse_requests,
)

# Events that end a request that never ran, with the failure class they carry.
_NEVER_RAN = ("request_rejected", "request_refused", "admission_failed")


class RecordError(ModelForgeError):
    """A window, pool or record that cannot be replayed: REQUEST_INVALID, naming what."""

    def __init__(self, message: str) -> None:
        super().__init__(FailureClass.REQUEST_INVALID, message)


@dataclass
class RecordScenario:
    """Request lines (times from the window's start), the cards' external usage, the catalog
    in force at the window's start, and what the builder had to assume (`notes`)."""

    pool: str
    since_s: float
    until_s: float
    catalog: Catalog
    lines: list[dict[str, Any]]
    external: list[ExternalUsage]
    notes: list[str] = field(default_factory=list)
    # Refused requests whose events do not say what they asked for: counted, not replayed.
    left_out: dict[str, int] = field(default_factory=dict)
    # Real name -> shown name, when anonymised (`tenant-1`, ...).
    tenant_alias: dict[str, str] = field(default_factory=dict)
    config: SimulationConfig = field(default_factory=SimulationConfig)
    # What really happened in the window, the replay's figures where the record has them
    # (`recorded_figures`): the column beside the replays.
    recorded: dict[str, Any] = field(default_factory=dict)
    # The catalogs applied inside the window, each from its moment (seconds from the window's
    # start, on the lines' clock), restricted to the pool and on its cards as `catalog` is.
    changes: list[tuple[float, Catalog]] = field(default_factory=list)

    def scenario(self, catalog: Catalog | None = None) -> tuple[Scenario, dict[str, int]]:
        """The scenario as it was (no `catalog`: the one in force at the window's start, then
        each change from its moment), or under `catalog` throughout (a proposed one replaces
        them all); and the lines it cannot take (a capability with no deployment, a tenant or
        class it does not know, under the catalog in force when the line arrived) by the
        failure class production answers them with."""
        spans = [(0.0, self.catalog), *self.changes] if catalog is None else [(0.0, catalog)]
        refused: dict[str, int] = dict(self.left_out)
        kept: list[list[tuple[int, object]]] = [[] for _ in spans]
        span, number = 0, 0
        for line in self.lines:
            while span + 1 < len(spans) and spans[span + 1][0] <= line["t"]:
                span += 1
            failure = _refusal(spans[span][1], line)
            if failure is not None:
                refused[failure] = refused.get(failure, 0) + 1
                continue
            number += 1
            kept[span].append((number, line))
        requests: list[SimRequest] = []
        catalogs: list[Catalog] = []
        variants = ShapeVariants()
        for (_, in_force), lines in zip(spans, kept, strict=True):
            parsed, with_variants = parse_requests(lines, in_force, index_from=len(requests), variants=variants)
            requests.extend(parsed)
            catalogs.append(with_variants)
        changes = [(at, in_force) for (at, _), in_force in zip(spans[1:], catalogs[1:], strict=True)]
        name = f"record {self.pool}"
        scenario = Scenario(catalogs[0], requests, list(self.external), self.config, name, catalog_changes=changes)
        return scenario, refused

    def shown_tenant(self, tenant: str) -> str:
        return self.tenant_alias.get(tenant, tenant)

    def write(self, out_dir: Path) -> Path:
        """`scenario.toml` and `requests.jsonl` in `out_dir`: a scenario `modelforge simulate`
        reads, anonymised if this record is (tenants renamed, request ids numbered)."""
        from modelforge.store._store import catalog_document

        document = catalog_document(self.catalog)
        document["tenants"] = [{**t, "name": self.shown_tenant(t["name"])} for t in document["tenants"]]
        document["external"] = [
            {
                "accelerator": e.accelerator,
                "bytes": e.bytes,
                "start_s": e.start_s,
                **({"end_s": e.end_s} if math.isfinite(e.end_s) else {}),
                "name": e.name,
            }
            for e in self.external
        ]
        out_dir.mkdir(parents=True, exist_ok=True)
        requests_path = out_dir / "requests.jsonl"
        with requests_path.open("w", encoding="utf-8") as handle:
            for line in self.lines:
                shown = {**line, "tenant": self.shown_tenant(line["tenant"])}
                handle.write(json.dumps(shown, separators=(",", ":")) + "\n")
        text = [
            f"# modelforge simulate --from-record: pool {self.pool}, {len(self.lines)} requests,"
            f" a window of {self.until_s - self.since_s:.0f} s",
            *(f"# {note}" for note in self.notes),
            *(
                [f"# this file carries the catalog in force at the window's start, not the {len(self.changes)} after"]
                if self.changes
                else []
            ),
            "",
            f"[requests]\npath = {json.dumps(requests_path.name)}",
            "",
        ]
        for table, rows in document.items():
            for row in rows:
                text.append(f"[[{table}]]")
                text.extend(f"{key} = {_toml(value)}" for key, value in row.items() if value is not None)
                text.append("")
        path = out_dir / "scenario.toml"
        path.write_text("\n".join(text), encoding="utf-8")
        return path


def _toml(value: Any) -> str:
    """One TOML value: scalars, arrays and inline tables (a queue's levels), enums by value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if hasattr(value, "value") and not isinstance(value, int | float | str):
        value = value.value
    if isinstance(value, int | float):
        if isinstance(value, float) and not math.isfinite(value):
            raise RecordError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items() if v is not None) + "}"
    raise RecordError(f"cannot write {type(value).__name__} to TOML")


def _refusal(catalog: Catalog, line: dict[str, Any]) -> str | None:
    if catalog.deployment_for(line["capability"]) is None:
        return FailureClass.CAPABILITY_UNAVAILABLE.value
    if catalog.tenant(line["tenant"]) is None:
        return FailureClass.REQUEST_INVALID.value
    priority = line.get("priority")
    if priority is not None and catalog.priority_class(priority) is None:
        return FailureClass.REQUEST_INVALID.value
    return None


def catalog_in_force(
    history: list[tuple[float, Catalog]], since_s: float, until_s: float, current: Catalog | None
) -> tuple[Catalog, list[tuple[float, Catalog]], list[str]]:
    """The catalog in force at the window's start (the one applied last before it), the
    catalogs applied inside the window with their moments, and notes on what the history could
    not say (no history yet, or none before the window)."""
    notes: list[str] = []
    before = [(at, c) for at, c in history if at <= since_s]
    inside = [(at, c) for at, c in history if since_s < at < until_s]
    if before:
        catalog = before[-1][1]
    elif history:
        catalog = history[0][1]
        inside = inside[1:] if inside and inside[0][1] is catalog else inside
        notes.append(
            f"the catalog history starts {history[0][0] - since_s:.0f} s into the window: its first catalog is"
            " replayed over the time before it"
        )
    elif current is not None:
        catalog = current
        notes.append("the store keeps no catalog history for this window: the catalog in force now is replayed")
    else:
        raise RecordError("the store has no catalog: apply one with `modelforge catalog apply`")
    return catalog, inside, notes


def _pool_catalog(catalog: Catalog, pool: str | None) -> tuple[Catalog, str]:
    pools = sorted({a.pool for a in catalog.accelerators})
    if not pools:
        raise RecordError("the catalog of the window has no accelerators")
    if pool is None:
        if len(pools) > 1:
            raise RecordError(f"the record spans pools {', '.join(pools)}: choose one with --pool")
        pool = pools[0]
    elif pool not in pools:
        raise RecordError(f"unknown pool {pool!r}: the catalog of the window has {', '.join(pools)}")
    accelerators = [a for a in catalog.accelerators if a.pool == pool]
    return replace(catalog, accelerators=accelerators), pool


def _changes_in_window(
    inside: list[tuple[float, Catalog]],
    first: Catalog,
    pool: str,
    since_s: float,
    loads: dict[str, list[float]],
    notes: list[str],
) -> list[tuple[float, Catalog]]:
    """The catalogs applied inside the window as the replay applies them: from their moment
    (on the lines' clock), the pool's part with its cards (a card added, resized or taken out
    of the pool is replayed so from that moment), with the record's measured load times."""
    changes: list[tuple[float, Catalog]] = []
    cards = [(a.id, a.total_bytes) for a in first.accelerators]
    for at, applied in inside:
        moment = round(at - since_s, 3)
        if not any(a.pool == pool for a in applied.accelerators):
            notes.append(f"the catalog applied at +{moment:.0f} s has no card in pool {pool!r}: not replayed")
            continue
        applied, _ = _pool_catalog(applied, pool)
        now_cards = [(a.id, a.total_bytes) for a in applied.accelerators]
        if now_cards != cards:
            was, now = dict(cards), dict(now_cards)
            what = [f"+{card}" for card in now if card not in was]
            what += [f"-{card}" for card in was if card not in now]
            what += [f"{card} resized" for card in now if card in was and now[card] != was[card]]
            notes.append(
                f"the catalog applied at +{moment:.0f} s changed the pool's cards ({', '.join(what) or 'their order'}):"
                " replayed with them from that moment"
            )
            cards = now_cards
        changes.append((moment, with_measured_load_times(applied, loads)))
    if changes:
        notes.append(
            f"the catalog changed {len(changes)} time(s) inside the window (at "
            + ", ".join(f"+{at:.0f} s" for at, _ in changes)
            + "): replayed 'as it was' from each moment; a proposed catalog replaces them all"
        )
    return changes


def with_measured_load_times(catalog: Catalog, load_s: dict[str, list[float]]) -> Catalog:
    """Each deployment's `load_s` as the record measured it (the median of its loads), where it
    has any: the world's load time, whatever the catalog declared."""
    deployments = []
    for dep in catalog.deployments:
        measured = load_s.get(dep.deployment_id) or load_s.get(dep.capability)
        deployments.append(replace(dep, load_s=round(statistics.median(measured), 3)) if measured else dep)
    return replace(catalog, deployments=deployments)


def _external(
    snapshots: list[dict[str, Any]], accelerators: set[str], since_s: float, until_s: float
) -> list[ExternalUsage]:
    """The external processes' memory of each card as steps: a value holds from its snapshot
    until the next one that differs, and the first from the window's start: before its first
    snapshot the card's usage is not known, and reading it as nothing would make the first
    snapshot a swing of that size (a media server there all along would raise the dynamic
    reserve for an hour and put the card under GPU_PRESSURE). Only the window's snapshots count
    (and the last one before it: what the card held when it opened); the last value holds on
    past the window's end, where the replay serves the work still running or waiting then."""
    usage: list[ExternalUsage] = []
    by_card: dict[str, list[tuple[float, int]]] = {}
    for row in snapshots:
        if row["accelerator"] in accelerators and float(row["at"]) <= until_s:
            by_card.setdefault(row["accelerator"], []).append((float(row["at"]), int(row["external_bytes"])))
    for card, points in sorted(by_card.items()):
        points.sort()
        before = [point for point in points if point[0] < since_s]
        points = [*([(since_s, before[-1][1])] if before else []), *points[len(before) :]]
        start, value = min(points[0][0], since_s), points[0][1]
        for at, nbytes in [*points[1:], (math.inf, -1)]:
            if nbytes == value:
                continue
            if value > 0 and at > start:
                end = at if math.isinf(at) else round(at - since_s, 3)
                usage.append(ExternalUsage(card, value, round(start - since_s, 3), end, "external (recorded)"))
            start, value = at, nbytes
    return usage


def build_record_scenario(
    rows: dict[str, list[dict[str, Any]]],
    history: list[tuple[float, Catalog]],
    *,
    since_s: float,
    until_s: float,
    pool: str | None = None,
    anonymise: bool = False,
    current: Catalog | None = None,
) -> RecordScenario:
    if not (math.isfinite(since_s) and math.isfinite(until_s) and since_s < until_s):
        raise RecordError(f"the window must end after it starts ({since_s} .. {until_s})")
    catalog, inside, notes = catalog_in_force(history, since_s, until_s, current)
    catalog, pool = _pool_catalog(catalog, pool)
    events = rows.get("events", [])
    grants: dict[str, dict[str, Any]] = {}
    invoke_s: dict[str, float] = {}
    loads: dict[str, list[float]] = {}
    never: dict[str, dict[str, Any]] = {}
    for event in events:
        payload = event.get("payload") or {}
        kind = event["kind"]
        if kind == "lease_granted" and event["lease_id"]:
            grants[event["lease_id"]] = payload
        elif kind in ("invoke", "invoke_failed") and event["lease_id"] and "invoke_s" in payload:
            invoke_s[event["lease_id"]] = float(payload["invoke_s"])
        elif kind == "resident_ready" and payload.get("load_s") is not None:
            loads.setdefault(event["deployment"], []).append(float(payload["load_s"]))
        elif kind in _NEVER_RAN and event["request_id"]:
            if payload.get("pool", pool) != pool:
                continue
            never.setdefault(event["request_id"], {**payload, "at": event["at"], "failure": event["failure_class"]})
    catalog = with_measured_load_times(catalog, loads)
    changes = _changes_in_window(inside, catalog, pool, since_s, loads, notes)
    if loads:
        notes.append(
            "load times are the medians measured in the record: "
            + ", ".join(f"{d} {statistics.median(v):.1f} s ({len(v)} loads)" for d, v in sorted(loads.items()))
        )

    # Requests that ran: one line per request, from its leases (a preempted or retried request
    # has several: its service time is what they ran, its arrival the earliest).
    ran: dict[str, dict[str, Any]] = {}
    service_by_capability: dict[str, list[float]] = {}
    for lease in rows.get("ledger", []):
        if lease.get("pool") not in (None, pool) or not lease.get("capability"):
            continue
        granted = lease.get("granted_at")
        if granted is None:
            continue  # an end without its grant: the grant's row is what places it in time
        grant = grants.get(lease["lease_id"], {})
        arrived = float(grant["submitted_at"]) if grant.get("submitted_at") is not None else float(granted)
        if grant.get("submitted_at") is None and grant.get("waited_s") is not None:
            arrived = float(granted) - float(grant["waited_s"])
        ran_s = invoke_s.get(lease["lease_id"])
        if ran_s is None:
            ended = lease.get("ended_at")
            ran_s = (
                float(lease["held_s"]) if lease.get("held_s") is not None else max(0.0, (ended or until_s) - granted)
            )
        line = ran.get(lease["request_id"])
        if line is None:
            line = ran[lease["request_id"]] = {
                "arrived": arrived,
                "capability": lease["capability"],
                "tenant": lease.get("tenant") or "default",
                "priority": lease.get("priority"),
                "service_s": 0.0,
                "deadline_s": grant.get("deadline_s"),
                "lease_timeout_s": grant.get("lease_timeout_s"),
                "max_duration_s": grant.get("max_duration_s"),
                "input_bytes": grant.get("input_bytes"),
            }
        line["arrived"] = min(line["arrived"], arrived)
        line["service_s"] += ran_s
        line["first_granted"] = min(line.get("first_granted", math.inf), float(granted))
        ended_at = lease.get("ended_at")
        if ended_at is not None and ended_at >= line.get("ended", -math.inf):
            line["ended"], line["outcome"] = float(ended_at), lease.get("outcome") or ""
        if lease.get("outcome") == "preempted":
            line["preemptions"] = line.get("preemptions", 0) + 1
        if lease.get("outcome") == "ok":
            service_by_capability.setdefault(lease["capability"], []).append(ran_s)
    median_service = {c: statistics.median(v) for c, v in service_by_capability.items()}
    unknown_service = 0
    unknown_ask = 0
    left_out: dict[str, int] = {}
    for request_id, ended in never.items():
        if request_id in ran:
            # It ran: refused once and granted on a retry, or preempted and then timed out in
            # the queue (how it ended, then, is this event's failure).
            if ran[request_id].get("outcome") == "preempted" and ended.get("at", 0) >= ran[request_id]["ended"]:
                ran[request_id]["outcome"] = ended.get("failure") or "preempted"
            continue
        capability = ended.get("capability")
        if not capability:
            unknown_ask += 1
            continue
        service = median_service.get(capability)
        if service is None:
            unknown_service += 1
            service = 0.0
        arrived = float(ended["submitted_at"]) if ended.get("submitted_at") is not None else float(ended["at"])
        ran[request_id] = {
            "arrived": arrived,
            "capability": capability,
            "tenant": ended.get("tenant") or "default",
            "priority": ended.get("priority"),
            "service_s": service,
            "deadline_s": ended.get("deadline_s"),
            "lease_timeout_s": ended.get("lease_timeout_s"),
            "max_duration_s": ended.get("max_duration_s"),
            "input_bytes": ended.get("input_bytes"),
            "refused_as": ended.get("failure"),
        }
    if unknown_ask:
        left_out["UNRECORDED"] = unknown_ask
        notes.append(f"{unknown_ask} refused request(s) left out: their events do not say what they asked for")
    if unknown_service:
        notes.append(
            f"{unknown_service} never-run request(s) of a capability with no completed run in the record"
            " replay with no service time"
        )
    never_ran = sum(1 for line in ran.values() if "refused_as" in line)
    if never_ran:
        notes.append(
            f"{never_ran} request(s) never ran in production (refused or timed out): replayed with what they asked"
            " for and their capability's median measured service time"
        )

    ordered = sorted(ran.items(), key=lambda item: (item[1]["arrived"], item[0]))
    # The pool's cards over the window: the first catalog's and any a change brought in.
    accelerators = {a.id for in_force in [catalog, *(c for _, c in changes)] for a in in_force.accelerators}
    recorded = recorded_figures(
        [line for _, line in ordered],
        [e for e in events if e["kind"] == "resident_ready" and e.get("accelerator") in accelerators],
        [row for row in rows.get("snapshots", []) if row["accelerator"] in accelerators],
        catalog,
    )
    alias: dict[str, str] = {}
    if anonymise:
        for _, line in ordered:
            alias.setdefault(line["tenant"], f"tenant-{len(alias) + 1}")
        for in_force in [catalog, *(changed for _, changed in changes)]:
            for tenant in in_force.tenants:
                alias.setdefault(tenant.name, f"tenant-{len(alias) + 1}")
    lines: list[dict[str, Any]] = []
    for number, (request_id, line) in enumerate(ordered, start=1):
        out: dict[str, Any] = {
            "id": f"r{number}" if anonymise else request_id,
            "t": round(max(0.0, line["arrived"] - since_s), 3),
            "capability": line["capability"],
            "tenant": line["tenant"],
            "service_s": round(max(0.0, line["service_s"]), 4),
        }
        for key in ("priority", "deadline_s", "max_duration_s", "lease_timeout_s", "input_bytes"):
            if line.get(key) is not None:
                out[key] = line[key]
        # The record keeps the class a request got, not whether it asked for one: a request in
        # its tenant's default class replays without one, so a catalog that gives the tenant
        # another default (a new class for a team) moves it there.
        owner = in_force_at(catalog, changes, out["t"]).tenant(line["tenant"])
        if owner is not None and out.get("priority") == owner.default_priority:
            del out["priority"]
        lines.append(out)
    snapshots = rows.get("snapshots", [])
    external = _external(snapshots, accelerators, since_s, until_s)
    if not snapshots:
        notes.append("no capacity snapshots in the window: external processes replay as using no memory")
    sized = sum(1 for line in lines if "input_bytes" in line)
    if sized < len(lines):
        notes.append(f"{len(lines) - sized} request(s) without an input size (recorded before it was kept)")
    if anonymise:
        notes.append(
            "anonymised: tenants renamed tenant-N, request ids numbered; the record keeps inputs' sizes, not their"
            " content"
        )
    else:
        notes.append(
            "inputs replay by their measured service time; the record keeps their size (input_bytes), not their content"
        )
    record = RecordScenario(
        pool=pool,
        since_s=since_s,
        until_s=until_s,
        catalog=catalog,
        lines=lines,
        external=external,
        notes=notes,
        left_out=left_out,
        tenant_alias=alias,
        recorded={**recorded, "by_tenant": {alias.get(k, k): v for k, v in recorded["by_tenant"].items()}},
        changes=changes,
    )
    refused_at_once: dict[str, int] = {}
    for line in lines:
        failure = _refusal(in_force_at(catalog, changes, line["t"]), line)
        if failure is not None:
            refused_at_once[failure] = refused_at_once.get(failure, 0) + 1
    if refused_at_once:
        notes.append(
            "refused at once under the catalog of the window (a capability, tenant or class it did not have),"
            " counted as refusals and not replayed: "
            + ", ".join(f"{k} {v}" for k, v in sorted(refused_at_once.items()))
        )
    return record


def recorded_figures(
    lines: list[dict[str, Any]], loads: list[dict[str, Any]], snapshots: list[dict[str, Any]], catalog: Catalog
) -> dict[str, Any]:
    """The figures of a replay (`modelforge.simulate._whatif`) as the record has them: waits
    (arrival to first lease; never, for a request that never ran), goodput, loads finished and
    their measured seconds, preemptions, how requests that did not end ok ended, and the
    snapshots whose headroom was under the reserve. VRAM-hours and invariant checks are the
    replay's alone (None)."""
    from modelforge.simulate._whatif import group_figures

    groups: dict[str, dict[str, tuple[list[float], int, int, int]]] = {"by_class": {}, "by_tenant": {}}
    refusals: dict[str, int] = {}
    met_all = 0
    for line in lines:
        served = "first_granted" in line
        outcome = line.get("outcome", "") if served else (line.get("refused_as") or "UNRECORDED")
        deadline = line.get("deadline_s")
        met = served and outcome == "ok" and (deadline is None or line["ended"] <= line["arrived"] + deadline)
        met_all += 1 if met else 0
        if outcome != "ok":
            refusals[outcome or "UNFINISHED"] = refusals.get(outcome or "UNFINISHED", 0) + 1
        tenant = catalog.tenant(line["tenant"])
        klass = line.get("priority") or (tenant.default_priority if tenant is not None else "default")
        for group, key in (("by_class", klass), ("by_tenant", line["tenant"])):
            waits, never, offered, good = groups[group].get(key, ([], 0, 0, 0))
            if served:
                waits.append(max(0.0, line["first_granted"] - line["arrived"]))
            else:
                never += 1
            groups[group][key] = (waits, never, offered + 1, good + (1 if met else 0))
    short = 0
    below: dict[str, bool] = {}
    for row in sorted(snapshots, key=lambda r: r["at"]):
        free = row["total_bytes"] - row["external_bytes"] - row.get("resident_bytes", 0) - row.get("leased_bytes", 0)
        if free < row["reserve_bytes"]:
            short += 0 if below.get(row["accelerator"]) else 1
            below[row["accelerator"]] = True
        else:
            below.pop(row["accelerator"], None)
    return {
        "requests": len(lines),
        "goodput": round(met_all / len(lines), 6) if lines else 0.0,
        "by_class": {k: group_figures(*v) for k, v in groups["by_class"].items()},
        "by_tenant": {k: group_figures(*v) for k, v in sorted(groups["by_tenant"].items())},
        "cold_starts": len(loads),
        "load_s": round(sum(float((e.get("payload") or {}).get("load_s") or 0.0) for e in loads), 3),
        "evictions": None,
        "preemptions": sum(line.get("preemptions", 0) for line in lines),
        "refusals": dict(sorted(refusals.items())),
        "vram_gib_hours_in_use": None,
        "vram_gib_hours_idle_resident": None,
        "external_headroom_below_reserve": short if snapshots else None,
        "oom_events": None,
        "invariant_violations": None,
        "replay_wall_s": None,
    }


async def record_from_store(
    url: str, *, window_s: float, until_s: float, pool: str | None = None, anonymise: bool = False
) -> RecordScenario:
    """Read the window ending at `until_s` (epoch seconds) from the store at `url` and build
    its scenario."""
    from modelforge.store import Store

    store = await Store.open(url)
    try:
        await store.migrate()
        since_s = until_s - window_s
        rows = await store.record_rows(since_s=since_s, until_s=until_s, pool=pool)
        history = await store.catalog_history(until_s=until_s)
        current = None if history else await store.load_catalog()
    finally:
        await store.close()
    if current is not None and not current.accelerators:
        current = None
    return build_record_scenario(
        rows, history, since_s=since_s, until_s=until_s, pool=pool, anonymise=anonymise, current=current
    )
