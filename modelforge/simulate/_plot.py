"""`modelforge simulate --plot out.png`: the policies side by side over the replay (VRAM held,
requests waiting, waits of the requests started each minute) and their goodput per class.

matplotlib is an optional extra (`pip install 'modelforge[plot]'`): the simulator itself needs
nothing to plot, and a missing extra is a one-line error before any replay starts."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

from modelforge.simulate._engine import SimulationResult

FORMATS = (".png", ".svg", ".pdf")


def plotting_available() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _numbers(values: object) -> list[float]:
    assert isinstance(values, list)
    return [math.nan if v is None else float(v) for v in values]


def write_plot(results: list[SimulationResult], path: Path, title: str) -> Path:
    """Write the comparison to `path` (.png, .svg or .pdf, from its suffix)."""
    from matplotlib.figure import Figure

    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"--plot {path}: the file must end {', '.join(FORMATS)}")
    figure = Figure(figsize=(13, 8.5), layout="constrained")
    figure.suptitle(title)
    held_ax, queue_ax, wait_ax, goodput_ax = figure.subplots(2, 2).flatten()
    span = max((r.virtual_s for r in results), default=0.0)
    hours = span > 3 * 3600
    scale, unit = (3600.0, "hours") if hours else (60.0, "minutes")
    step = float(results[0].series.get("step_s", 60.0)) if results[0].series else 60.0  # type: ignore[arg-type]
    per = "per minute" if step == 60.0 else f"per {step / 60:g} minutes"
    for result in results:
        series: dict[str, Any] = result.series
        if not series:
            continue
        x = [(t - result.span_start_s) / scale for t in _numbers(series["t_s"])]
        held_ax.plot(x, _numbers(series["vram_utilization"]), label=result.policy, linewidth=0.9)
        queue_ax.plot(x, _numbers(series["queue_depth"]), label=result.policy, linewidth=0.9)
        # Minutes in which nothing started have no wait: dots keep lone minutes visible.
        wait_ax.plot(x, _numbers(series["wait_p99_s"]), label=result.policy, linewidth=0.7, marker=".", markersize=3)
    # The end of the common span, over which utilization is measured (the same for every policy).
    for ax in (held_ax, queue_ax, wait_ax):
        ax.axvline(results[0].span_s / scale, color="grey", linestyle=":", linewidth=0.8)
    held_ax.set_title(f"VRAM held / capacity, {per} (common span: {results[0].span_s:,.0f} s, dotted)")
    held_ax.set_ylim(0, 1.05)
    queue_ax.set_title(f"requests waiting (time average, {per})")
    wait_ax.set_title(f"wait p99 of the requests started, {per} (s)")
    if any(not math.isnan(v) and v > 0 for r in results if r.series for v in _numbers(r.series["wait_p99_s"])):
        wait_ax.set_yscale("symlog", linthresh=1.0)
    wait_ax.set_ylim(bottom=0)
    queue_ax.set_ylim(bottom=0)
    for ax in (held_ax, queue_ax, wait_ax):
        ax.set_xlim(0, max(span, results[0].span_s) / scale)
        ax.set_xlabel(f"virtual time ({unit})")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    classes: list[str] = []
    for result in results:
        classes += [k for k in result.by_class if k not in classes]
    width = 0.8 / max(1, len(results))
    for n, result in enumerate(results):
        values = [float(result.by_class.get(k, {}).get("goodput", 0.0) or 0.0) for k in classes]
        positions = [i + (n - (len(results) - 1) / 2) * width for i in range(len(classes))]
        goodput_ax.bar(positions, values, width=width, label=result.policy)
    goodput_ax.set_xticks(range(len(classes)), classes)
    goodput_ax.set_ylim(0, 1.05)
    goodput_ax.set_title("goodput per class (deadline met / offered)")
    goodput_ax.grid(alpha=0.3, axis="y")
    goodput_ax.legend(loc="upper right", fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    return path
