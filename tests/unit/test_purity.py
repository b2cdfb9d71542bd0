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
    done = subprocess.run(
        [RUFF, "check", "--no-cache", "--stdin-filename", "workflows/_probe.py", "-"],
        input=f"{line}\n\nx = {use}\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1 and "TID251" in done.stdout, done.stdout


def test_workflow_code_may_use_timedelta_and_asyncio_tasks() -> None:
    done = subprocess.run(
        [RUFF, "check", "--no-cache", "--stdin-filename", "workflows/_probe.py", "-"],
        input="import asyncio\nfrom datetime import timedelta\n\nx = (timedelta(seconds=1), asyncio.ensure_future)\n",
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout
