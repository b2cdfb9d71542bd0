"""The chaos round's checker reads what really ran on the simulated card: a byte violation there
is a real over-commit, where the ledger's rows may disagree by the clocks that stamped them."""

from __future__ import annotations

import json
from pathlib import Path

from bench.chaos import ChaosReport, _sweep, check_invokes

SLOT, BIG = "chaos.slot@1@chaos-node/0", "chaos.big@1@chaos-node/0"  # 4 and 8 GiB a lease


def _invokes(path: Path, runs: list[tuple[str, float, float]]) -> Path:
    lines = [json.dumps({"key": key, "lease_id": f"l{n}", "start": s, "end": e}) for n, (key, s, e) in enumerate(runs)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_each_record_of_a_sweep_has_its_own_moment() -> None:
    # Three heavy intervals overlap at 2; four light ones later, at 6.5.
    most, count_at, weight, weight_at = _sweep([(0, 10, 8), (1, 5, 8), (2, 3, 8), (4, 20, 1), (6, 7, 1), (6.5, 8, 1)])
    assert (most, count_at) == (4, 6.5)
    assert (weight, weight_at) == (24, 2)


def test_lease_bytes_beyond_the_card_on_its_own_record_are_a_violation(tmp_path: Path) -> None:
    # Two big and two slot invokes at once: 24 GiB of lease bytes beside a 2 GiB model on 24 GiB.
    path = _invokes(tmp_path / "over.jsonl", [(BIG, 0, 5), (BIG, 1, 5), (SLOT, 2, 5), (SLOT, 3, 5)])
    report = ChaosReport()
    check_invokes(path, report)
    assert report.invokes == 4
    [violation] = report.violations
    assert "24.0 GiB of invokes' lease bytes ran at once at 3.000" in violation


def test_within_concurrency_and_bytes_nothing_is_reported(tmp_path: Path) -> None:
    # The same invokes one after another where they would not fit: 20 GiB at most.
    path = _invokes(tmp_path / "ok.jsonl", [(BIG, 0, 5), (BIG, 1, 5), (SLOT, 2, 5), (SLOT, 5, 9)])
    report = ChaosReport()
    check_invokes(path, report)
    assert report.violations == []
