"""The policy's import ban is a lint rule (modelforge/policy/ruff.toml); prove it bites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = str(Path(sys.executable).parent / "ruff")


@pytest.mark.parametrize(
    "line",
    [
        "import time",
        "from datetime import datetime",
        "import random",
        "import temporalio",
        "from psycopg import connect",
        "import pynvml",
        "import os",
    ],
)
def test_impure_imports_in_the_policy_are_lint_errors(line: str) -> None:
    done = subprocess.run(
        [RUFF, "check", "--no-cache", "--stdin-filename", "modelforge/policy/_probe.py", "-"],
        input=f"{line}\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1 and "TID251" in done.stdout, done.stdout


def test_the_same_import_is_fine_outside_the_policy() -> None:
    done = subprocess.run(
        [RUFF, "check", "--no-cache", "--stdin-filename", "modelforge/_probe.py", "-"],
        input="import time\n\nprint(time.time())\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout
