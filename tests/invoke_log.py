"""The simulated card's own record of the invokes that really ran on it
(MODELFORGE_SIMULATED_INVOKE_LOG, modelforge/runtimes/_simulated.py): what tests check a
model's concurrency against, whatever the ledger says (bench/chaos.py reads it likewise)."""

from __future__ import annotations

import json
from pathlib import Path


def most_at_once(invoke_log: Path, key: str) -> int:
    """The most invokes of `key` that really ran at one instant on the simulated card, by its
    own record (health checks, under no lease, left out; an end before a start at a tie)."""
    points: list[tuple[float, int]] = []
    for line in invoke_log.read_text(encoding="utf-8").splitlines() if invoke_log.exists() else []:
        ran = json.loads(line)
        if ran["key"] == key and ran["lease_id"]:
            points += [(float(ran["start"]), 1), (float(ran["end"]), -1)]
    running = most = 0
    for _, step in sorted(points):
        running += step
        most = max(most, running)
    return most
