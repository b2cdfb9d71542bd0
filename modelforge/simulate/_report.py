"""Results side by side: one row per metric, one cell per policy, for the CLI's table and the
benchmark's markdown."""

from __future__ import annotations

from modelforge.simulate._engine import SimulationResult

COUNTS = ("loads", "evictions", "preemptions", "invariant_violations", "oom_events", "gang_starts", "gang_splits")
RATIOS = ("vram_utilization", "vram_busy_utilization", "jain_fairness")
# Per class: waits over every request (`never`: the rank falls on requests never served), then
# over served ones only, then goodput.
CLASS_ROWS = (
    ("wait_p50_s", "wait_p50_s", "never"),
    ("wait_p99_s", "wait_p99_s", "never"),
    ("served wait_p50_s", "served_wait_p50_s", "-"),
    ("served wait_p99_s", "served_wait_p99_s", "-"),
    ("goodput", "goodput", "-"),
)


def _cell(value: object, missing: str = "-") -> str:
    if value is None:
        return missing
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def _refused(row: dict[str, object] | None) -> str:
    if row is None:
        return "-"
    refused = row.get("refused", 0)
    return f"{row.get('requests', 0)}/{row.get('served', 0)}/{refused}"


def comparison_rows(results: list[SimulationResult]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(r.requests) for r in results]),
        ("completed", [str(r.completed) for r in results]),
        ("rejected", [", ".join(f"{k} {v}" for k, v in r.rejected.items()) or "-" for r in results]),
        ("goodput (deadline met / offered)", [_cell(r.goodput) for r in results]),
    ]
    classes = list(results[0].by_class)
    for result in results[1:]:
        classes += [k for k in result.by_class if k not in classes]
    for klass in classes:
        rows.append((f"{klass} offered/served/never", [_refused(r.by_class.get(klass)) for r in results]))
        for label, key, missing in CLASS_ROWS:
            cells = []
            for r in results:
                row = r.by_class.get(klass)
                # A request never served waits forever: the rank fell on one of those.
                cells.append("-" if row is None else _cell(row.get(key), missing))
            rows.append((f"{klass} {label}", cells))
    for name in COUNTS:
        rows.append((name, [str(getattr(r, name)) for r in results]))
    for name in RATIOS:
        rows.append((name, [_cell(getattr(r, name)) for r in results]))
    rows.extend(history_rows(results))
    rows.append(("common span (utilization window)", [f"{r.span_s:,.0f} s" for r in results]))
    rows.append(("replay's own span", [f"{r.virtual_s:,.0f} s" for r in results]))
    rows.append(("replay", [f"{r.wall_s:.2f} s ({r.requests_per_s:,.0f} req/s)" for r in results]))
    return rows


def history_rows(results: list[SimulationResult]) -> list[tuple[str, list[str]]]:
    """The scheduler workflow's Temporal history events per second per pool (mean over the
    replay / peak step), and per request, without and with warm-path delegation; `-` for the
    baselines, which are no workflow."""
    histories = [r.scheduler_history for r in results]
    first = next((h for h in histories if h), None)
    if first is None:
        return []
    peak = "peak minute" if first["step_s"] == 60 else f"peak {first['step_s']:g} s"
    rows = []
    for key, label in (("without_delegation", "no delegation"), ("with_delegation", "delegation")):
        cells, per_request = [], []
        for history in histories:
            if not history:
                cells.append("-")
                per_request.append("-")
                continue
            figures = history[key]
            cells.append(f"{figures['events_per_s_mean']:.1f} / {figures['events_per_s_peak']:.1f}")
            per_request.append(_cell(figures["events_per_request"]))
        pools = first["pools"]
        where = "per pool" if pools == 1 else f"per pool of {pools}"
        rows.append((f"scheduler events/s {where}, mean / {peak} ({label})", cells))
        rows.append((f"scheduler events per request ({label})", per_request))
    return rows
