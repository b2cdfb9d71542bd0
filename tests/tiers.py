"""How deep a property test goes in each tier: every example in the full suite (`./scripts/test`,
what CI runs), a fifth of them in `./scripts/test --fast` (MODELFORGE_TEST_TIER=fast), whose
point is an answer within a couple of minutes while a change is being made. The same properties
run in both; only the full suite searches as deep. A helper module: tests import it."""

from __future__ import annotations

import os

FAST = os.environ.get("MODELFORGE_TEST_TIER") == "fast"


def examples(full: int) -> int:
    """The examples a property test runs in this tier (`full` in the full suite)."""
    return max(20, full // 5) if FAST else full
