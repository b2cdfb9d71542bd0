"""The modelforge CLI against a test database. A helper module: tests import it, never each
other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def modelforge(database_url: str, tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env.update(MODELFORGE_DATABASE_URL=database_url, MODELFORGE_HOME=str(tmp_path), COLUMNS="160")
    return subprocess.run(
        [sys.executable, "-m", "modelforge", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )
