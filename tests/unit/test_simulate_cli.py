"""`modelforge trace` and `modelforge simulate` as a user runs them: a subprocess each, exit
codes and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def modelforge(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelforge", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_convert_then_simulate_every_policy_as_json(tmp_path: Path) -> None:
    csv = tmp_path / "azure.csv"
    rows = (TRACES / "azure_llm_code_2023.csv").read_text().splitlines()[:301]
    csv.write_text("\n".join(rows) + "\n")
    converted = modelforge("trace", "azure", str(csv), "--out", str(tmp_path / "s"))
    assert converted.returncode == 0, converted.stderr
    done = modelforge("simulate", str(tmp_path / "s" / "scenario.toml"), "--policy", "all", "--json")
    assert done.returncode == 0, done.stderr
    results = json.loads(done.stdout)
    assert [r["policy"] for r in results] == ["modelforge", "fifo", "ollama", "fifo-gang"]
    assert all(r["requests"] == results[0]["requests"] > 300 for r in results)
    table = modelforge("simulate", str(tmp_path / "s" / "scenario.toml"))
    assert table.returncode == 0 and "simulated" in table.stdout and "modelforge" in table.stdout


def test_errors_are_one_line_with_the_failure_class(tmp_path: Path) -> None:
    missing = modelforge("simulate", str(tmp_path / "nope.toml"))
    assert missing.returncode == 2
    assert missing.stderr.strip().splitlines() == [
        f"error REQUEST_INVALID: scenario file not found: {tmp_path / 'nope.toml'}"
    ]
    (tmp_path / "s.toml").write_text('[requests]\npath = "r.jsonl"\n')
    (tmp_path / "r.jsonl").write_text("")
    bad_policy = modelforge("simulate", str(tmp_path / "s.toml"), "--policy", "lifo")
    assert bad_policy.returncode == 2 and "unknown policy 'lifo'" in bad_policy.stderr
    bad_trace = modelforge(
        "trace", "alibaba", str(tmp_path / "r.jsonl"), str(tmp_path / "r.jsonl"), "--out", str(tmp_path)
    )
    assert bad_trace.returncode == 2 and "missing column(s)" in bad_trace.stderr
    assert "Traceback" not in missing.stderr + bad_policy.stderr + bad_trace.stderr
