"""Results side by side: one row per metric, one cell per policy, for the CLI's table and the
benchmark's markdown."""

from __future__ import annotations

from modelforge.simulate._engine import SimulationResult

COUNTS = ("loads", "evictions", "preemptions", "invariant_violations", "oom_events", "gang_starts", "gang_splits")
RATIOS = ("vram_utilization", "jain_fairness")


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def comparison_rows(results: list[SimulationResult]) -> list[tuple[str, list[str]]]:
    rows: list[tuple[str, list[str]]] = [
        ("requests", [str(r.requests) for r in results]),
        ("completed", [str(r.completed) for r in results]),
        ("rejected", [", ".join(f"{k} {v}" for k, v in r.rejected.items()) or "-" for r in results]),
    ]
    for klass in results[0].by_class:
        for key in ("wait_p50_s", "wait_p99_s", "deadline_met_ratio"):
            rows.append((f"{klass} {key}", [_cell(r.by_class.get(klass, {}).get(key)) for r in results]))
    for name in COUNTS:
        rows.append((name, [str(getattr(r, name)) for r in results]))
    for name in RATIOS:
        rows.append((name, [_cell(getattr(r, name)) for r in results]))
    rows.append(("replay", [f"{r.wall_s:.2f} s ({r.requests_per_s:,.0f} req/s)" for r in results]))
    return rows
