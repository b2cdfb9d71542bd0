"""Operator commands fail in one line naming the failure class, never with a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelforge.cli import parse_duration
from modelforge.failures import ModelForgeError


def modelforge(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "modelforge", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MODELFORGE_")}
    env["MODELFORGE_HOME"] = str(tmp_path / "home")
    env.update(extra)
    return env


@pytest.mark.parametrize(
    ("args", "extra", "fragment"),
    [
        (["usage"], {}, "CAPABILITY_UNAVAILABLE: no database"),
        (["capacity", "--since", "1h"], {}, "CAPABILITY_UNAVAILABLE: no database"),
        (
            ["capacity", "--since", "yesterday"],
            {"MODELFORGE_DATABASE_URL": "postgresql://x@127.0.0.1:1/x"},
            "REQUEST_INVALID",
        ),
        (["usage", "--since", "-5m"], {"MODELFORGE_DATABASE_URL": "postgresql://x@127.0.0.1:1/x"}, "REQUEST_INVALID"),
        (["gateway"], {}, "CAPABILITY_UNAVAILABLE: no database"),
        (
            ["gateway"],
            {
                "MODELFORGE_DATABASE_URL": "postgresql://x@127.0.0.1:1/x",
                "MODELFORGE_GATEWAY_API_KEYS_FILE": "/nope.toml",
            },
            "REQUEST_INVALID: /nope.toml: cannot read",
        ),
        (["events"], {"MODELFORGE_SNAPSHOT_RETENTION_DAYS": "0"}, "MODELFORGE_SNAPSHOT_RETENTION_DAYS"),
    ],
)
def test_one_line_errors(tmp_path: Path, args: list[str], extra: dict[str, str], fragment: str) -> None:
    done = modelforge(*args, env=_env(tmp_path, **extra))
    assert done.returncode != 0
    assert fragment in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_unreachable_database_is_one_line(tmp_path: Path) -> None:
    done = modelforge("usage", env=_env(tmp_path, MODELFORGE_DATABASE_URL="postgresql://mf:s3cret@127.0.0.1:1/mf"))
    assert done.returncode != 0 and "CAPABILITY_UNAVAILABLE: cannot reach Postgres" in done.stderr
    assert "s3cret" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("30m", 1800), ("1h", 3600), ("7d", 604800), ("45", 45)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "-1h", "0m", "1w", "nan", "inf", "1e999h"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ModelForgeError, match="duration"):
        parse_duration(text)


def test_long_vectors_are_summarised_on_the_terminal_and_kept_whole_in_json() -> None:
    from modelforge.cli import shown_output

    output = {"embeddings": [[0.5] * 384, [0.25] * 384], "dimensions": 384, "text": "hi", "short": [1, 2, 3]}
    assert shown_output(output) == {
        "embeddings": ["[384 numbers: 0.5, 0.5, 0.5, ...]", "[384 numbers: 0.25, 0.25, 0.25, ...]"],
        "dimensions": 384,
        "text": "hi",
        "short": [1, 2, 3],
    }
    assert len(output["embeddings"][0]) == 384  # the result itself is untouched
