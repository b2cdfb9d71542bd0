"""What the simulator reports, on scenarios small enough to work out by hand:
waits over every request (one never served waits forever), goodput per class, utilization over
one common span for every policy, the per-minute series of --json, the progress bar and --plot."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from modelforge.domain import Accelerator, Catalog, Deployment, GiB, Priority, Residency, Tenant
from modelforge.simulate import (
    ReplayProgress,
    Scenario,
    SimulationConfig,
    common_span,
    comparison_rows,
    parse_request_lines,
    simulate,
)


def card(gib: float = 24) -> Accelerator:
    return Accelerator(
        id="gpu/0", node="gpu", total_bytes=int(gib * GiB), production_eligible=True, model="M", reserve_bytes=GiB
    )


def model(capability: str, gib: float, **kw: object) -> Deployment:
    kw.setdefault("measured_on", ["M"])
    kw.setdefault("queue_limit", 1000)
    return Deployment(capability=capability, envelope_bytes=int(gib * GiB), **kw)  # type: ignore[arg-type]


def scenario(cards: list[Accelerator], deployments: list[Deployment], requests: list[dict[str, object]]) -> Scenario:
    catalog = Catalog(
        accelerators=cards,
        deployments=deployments,
        tenants=[Tenant("t", 1.0, Priority.INTERACTIVE, Priority.PRODUCTION)],
    )
    lines = [json.dumps({"tenant": "t", "priority": "interactive", **r}) for r in requests]
    parsed, catalog = parse_request_lines(lines, catalog)
    return Scenario(catalog, parsed, [], SimulationConfig())


def test_a_refused_request_counts_in_the_wait_percentiles_and_is_shown_apart() -> None:
    # Two interactive requests. r0 needs m@1 (loads in 4 s): it waits 4 s. r1 needs slow@1,
    # whose 10 s load cannot meet its 5 s deadline: ModelForge refuses it at once. Over served
    # requests only, p99 would be 4 s, as if nobody waited longer; over every request, r1
    # never starts, so the 99th percentile (rank 2 of 2) is "never", and p50 (rank 1) is 4 s.
    s = scenario(
        [card()],
        [model("m@1", 2, load_s=4.0), model("slow@1", 2, load_s=10.0)],
        [
            {"t": 0, "capability": "m@1", "service_s": 1.0},
            {"t": 0, "capability": "slow@1", "service_s": 1.0, "deadline_s": 5.0},
        ],
    )
    result = simulate(s, "modelforge")
    row = result.by_class["interactive"]
    assert result.rejected == {"DEADLINE_CANNOT_BE_MET": 1}
    assert (row["requests"], row["served"], row["refused"]) == (2, 1, 1)
    assert row["refused_by"] == {"DEADLINE_CANNOT_BE_MET": 1}
    assert (row["served_wait_p50_s"], row["served_wait_p99_s"]) == (4.0, 4.0)
    assert (row["wait_p50_s"], row["wait_p99_s"]) == (4.0, None)
    table = dict(comparison_rows([result]))
    assert table["interactive wait_p99_s"] == ["never"]
    assert table["interactive served wait_p99_s"] == ["4.000"]
    assert table["interactive offered/served/never"] == ["2/1/1"]


@pytest.mark.parametrize("policy", ["fifo", "ollama"])
def test_goodput_per_class_is_deadlines_met_over_requests_offered(policy: str) -> None:
    # One 4 GiB model, 4 s to load, one request at a time, served in arrival order.
    # interactive: r0 at 0 (deadline 6) runs 4-5: met; r1 at 1 (deadline 4) runs 5-6, due at
    #   5: missed; r2 at 2 (no deadline) runs 6-7: met. Goodput 2/3.
    # background: r3 at 3 (deadline 10) runs 7-8: met; r4 at 3 needs 5 s but may run 2 s: cut
    #   at 10, TIMEOUT: missed. Goodput 1/2.
    # Overall 3 of 5 offered: 0.6.
    s = scenario(
        [card()],
        [model("m@1", 4, load_s=4.0)],
        [
            {"t": 0, "capability": "m@1", "service_s": 1.0, "deadline_s": 6.0},
            {"t": 1, "capability": "m@1", "service_s": 1.0, "deadline_s": 4.0},
            {"t": 2, "capability": "m@1", "service_s": 1.0},
            {"t": 3, "capability": "m@1", "service_s": 1.0, "deadline_s": 10.0, "priority": "background"},
            {"t": 3, "capability": "m@1", "service_s": 5.0, "max_duration_s": 2.0, "priority": "background"},
        ],
    )
    result = simulate(s, policy)
    interactive, background = result.by_class["interactive"], result.by_class["background"]
    assert (interactive["deadline_met"], interactive["goodput"]) == (2, pytest.approx(2 / 3, abs=1e-6))
    assert (background["deadline_met"], background["goodput"]) == (1, 0.5)
    assert result.goodput == pytest.approx(0.6)
    assert result.rejected == {"TIMEOUT": 1}
    assert result.virtual_s == 10.0


def test_utilization_is_measured_over_one_span_for_every_policy() -> None:
    # A 16 GiB card (1 GiB reserve). A preemptible background job (6 GiB, batch) runs 1,000 s
    # from 0; a production call needs a 10 GiB model at 100 s for 10 s. The scenario's span is
    # 0 .. 1,000 s (the job's end if served on arrival), whoever finishes when: ModelForge
    # preempts the job and ends at 1,072 s, ollama makes production wait for the job (1,012 s).
    # ollama inside the span: the job's 6 GiB for all 1,000 s = 6 / 16 of the card. Over its
    # own span it would have read (6 * 1,000 + 10 * 10) / (16 * 1,012) = 0.377.
    s = scenario(
        [card(16)],
        [
            model("job@1", 6, residency=Residency.NONE, preemptible=True),
            model("llm@1", 10, load_s=2.0, ttl_s=60.0),
        ],
        [
            {"t": 0, "capability": "job@1", "service_s": 1000.0, "priority": "background"},
            {"t": 100, "capability": "llm@1", "service_s": 10.0, "priority": "production"},
        ],
    )
    assert common_span(s) == (0.0, 1000.0)
    results = {p: simulate(s, p) for p in ("modelforge", "fifo", "ollama")}
    assert {r.span_s for r in results.values()} == {1000.0}
    assert results["modelforge"].virtual_s == pytest.approx(1072.0)
    assert results["ollama"].virtual_s == pytest.approx(1012.0)
    assert results["ollama"].vram_utilization == pytest.approx(6 / 16)
    assert all(0.0 < r.vram_utilization <= 1.0 for r in results.values())


def test_the_series_has_a_row_per_minute_with_utilization_queue_and_waits() -> None:
    # One 4 GiB model on a 24 GiB card, 4 s to load; three 1 s requests at 0, 1, 2 wait 4 s
    # each (as in test_simulator), and a fourth at 130 s starts at once on the warm model.
    # Minute 0 (0-60 s): waiting 0-4, 1-5, 2-6 s: 12 request-seconds over 60 s = 0.2; the
    # model's 4 GiB held all minute: 4 / 24. Minute 1: nothing. Minute 2 (120-131): one
    # arrival, started at once.
    s = scenario(
        [card()],
        [model("m@1", 4, load_s=4.0, ttl_s=3600.0)],
        [{"t": t, "capability": "m@1", "service_s": 1.0} for t in (0, 1, 2, 130)],
    )
    series = simulate(s, "fifo").series
    assert series["step_s"] == 60.0
    assert series["t_s"] == [0.0, 60.0, 120.0]
    assert series["arrivals"] == [3, 0, 1]
    assert series["started"] == [3, 0, 1]
    assert series["refused"] == [0, 0, 0]
    assert series["queue_depth"] == [0.2, 0.0, 0.0]
    assert series["queue_depth_max"] == [3, 0, 0]
    assert series["wait_p50_s"] == [4.0, None, 0.0]
    assert series["vram_utilization"][0] == pytest.approx(4 / 24, abs=1e-4)
    assert series["vram_utilization"][1] == pytest.approx(4 / 24, abs=1e-4)


def test_a_long_trace_gets_rows_of_whole_minutes_at_most_ten_thousand() -> None:
    # Two requests 30 days apart: 43,200 minutes would be 43,200 rows; rows of 5 minutes
    # (ceil(43,200 / 10,000)) keep it to 8,640, and every arrival is still counted.
    s = scenario(
        [card()],
        [model("m@1", 4, ttl_s=60.0)],
        [{"t": t, "capability": "m@1", "service_s": 1.0} for t in (0.0, 30 * 86_400.0)],
    )
    series = simulate(s, "fifo").series
    assert series["step_s"] == 300.0
    assert 8_640 <= len(series["t_s"]) <= 8_641
    assert sum(series["arrivals"]) == 2 and series["arrivals"][0] == series["arrivals"][-1] == 1


def test_the_progress_callback_reports_requests_ended() -> None:
    s = scenario([card()], [model("m@1", 2)], [{"t": t, "capability": "m@1", "service_s": 1.0} for t in range(50)])
    seen: list[tuple[int, int, float]] = []
    simulate(s, "modelforge", lambda ended, total, t: seen.append((ended, total, t)))
    assert seen[-1] == (50, 50, 50.0)
    assert [e for e, _, _ in seen] == sorted(e for e, _, _ in seen)


def test_the_progress_bar_draws_on_a_terminal_only_for_long_replays() -> None:
    s = scenario([card()], [model("m@1", 2)], [{"t": t, "capability": "m@1", "service_s": 1.0} for t in range(50)])
    terminal = io.StringIO()
    with ReplayProgress(Console(file=terminal, force_terminal=True, width=100), after_s=0.0) as bars:
        simulate(s, "modelforge", bars.policy("modelforge", len(s.requests)))
    assert bars.shown and "50/50" in terminal.getvalue() and "modelforge" in terminal.getvalue()
    quiet = io.StringIO()
    with ReplayProgress(Console(file=quiet, force_terminal=True), after_s=60.0) as bars:
        simulate(s, "modelforge", bars.policy("modelforge", len(s.requests)))
    assert not bars.shown and quiet.getvalue() == ""


# --- the command, as a user runs it -----------------------------------------------------------

SCENARIO = """
[[accelerators]]
id = "gpu-node/0"
node = "gpu-node"
total_bytes = 25769803776
[[deployments]]
capability = "emb@1"
envelope_bytes = 4294967296
load_s = 4
[[deployments]]
capability = "slow@1"
envelope_bytes = 4294967296
load_s = 100
[[tenants]]
name = "rag"
max_priority = "production"
[requests]
path = "requests.jsonl"
"""


def write_scenario(tmp_path: Path) -> Path:
    common = {"service_s": 1.0, "tenant": "rag", "priority": "interactive"}
    lines = [{"t": float(t), "capability": "emb@1", **common} for t in range(0, 200, 2)]
    lines.insert(1, {"t": 0.0, "capability": "slow@1", "deadline_s": 5.0, **common})
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (tmp_path / "s.toml").write_text(SCENARIO)
    return tmp_path / "s.toml"


def modelforge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelforge", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_json_carries_the_per_minute_series_and_no_progress_bar(tmp_path: Path) -> None:
    done = modelforge("simulate", str(write_scenario(tmp_path)), "--policy", "all", "--json")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    results = json.loads(done.stdout)
    assert len({r["span_s"] for r in results}) == 1
    for result in results:
        series = result["series"]
        columns = ("t_s", "vram_utilization", "queue_depth", "wait_p50_s", "wait_p99_s", "arrivals", "started")
        assert len({len(series[c]) for c in columns}) == 1 and len(series["t_s"]) >= 4  # 200 s: four minutes
        assert sum(series["arrivals"]) == result["requests"] == 101
        assert sum(series["started"]) + sum(series["refused"]) <= 101
        assert all(0.0 <= u <= 1.0 for u in series["vram_utilization"])
    mine = results[0]
    assert mine["policy"] == "modelforge" and mine["by_class"]["interactive"]["refused"] == 1
    assert mine["by_class"]["interactive"]["goodput"] == pytest.approx(100 / 101, abs=1e-6)


def test_plot_writes_an_image_comparing_the_policies(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    path = tmp_path / "out" / "policies.png"
    done = modelforge("simulate", str(write_scenario(tmp_path)), "--policy", "all", "--plot", str(path))
    assert done.returncode == 0, done.stderr
    assert f"wrote {path}" in done.stdout
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert width > 600 and height > 400
    pixels = imread(path)
    assert pixels.shape[:2] == (height, width)
    assert pixels.std() > 0.05  # not a blank canvas
    svg = tmp_path / "policies.svg"
    assert modelforge("simulate", str(write_scenario(tmp_path)), "--plot", str(svg)).returncode == 0
    assert "<svg" in svg.read_text()[:1000]


def test_plot_refuses_a_format_it_cannot_write_before_replaying(tmp_path: Path) -> None:
    done = modelforge("simulate", str(write_scenario(tmp_path)), "--plot", str(tmp_path / "out.gif"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error REQUEST_INVALID: --plot {tmp_path / 'out.gif'}: the file must end .png, .svg or .pdf"
    ]
    assert not (tmp_path / "out.gif").exists()
