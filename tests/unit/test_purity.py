"""The policy's import ban is a lint rule (modelforge/policy/ruff.toml); prove it bites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUFF = str(Path(sys.executable).parent / "ruff")


def ruff_on(path: str, source: str) -> subprocess.CompletedProcess[str]:
    """Lint `source` as if it were the file at `path` (its folder's ruff.toml applies)."""
    return subprocess.run(
        [RUFF, "check", "--no-cache", "--stdin-filename", path, "-"],
        input=source,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


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
    done = ruff_on("modelforge/policy/_probe.py", f"{line}\n")
    assert done.returncode == 1 and "TID251" in done.stdout, done.stdout


def test_the_same_import_is_fine_outside_the_policy() -> None:
    done = ruff_on("modelforge/_probe.py", "import time\n\nprint(time.time())\n")
    assert done.returncode == 0, done.stdout


@pytest.mark.parametrize(
    ("line", "use"),
    [
        ("import time", "time.time()"),
        ("from datetime import datetime", "datetime.now()"),
        ("import datetime", "datetime.datetime.now()"),
        ("import random", "random.random()"),
        ("import uuid", "uuid.uuid4()"),
        ("import os", "os.environ"),
        ("import asyncio", "asyncio.sleep(1)"),
    ],
)
def test_nondeterministic_calls_in_workflow_code_are_lint_errors(line: str, use: str) -> None:
    # The request and scheduler workflows run outside Temporal's sandbox: this rule stands in.
    done = ruff_on("workflows/_probe.py", f"{line}\n\nx = {use}\n")
    assert done.returncode == 1 and "TID251" in done.stdout, done.stdout


def test_workflow_code_may_use_timedelta_and_asyncio_tasks() -> None:
    done = ruff_on(
        "workflows/_probe.py",
        "import asyncio\nfrom datetime import timedelta\n\nx = (timedelta(seconds=1), asyncio.ensure_future)\n",
    )
    assert done.returncode == 0, done.stdout
