"""Operator commands fail in one line naming the failure class, never with a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from modelforge.cli_common import check_output_path, parse_duration, written
from modelforge.failures import ModelForgeError
from tests.worker_process import free_port


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
        # db migrate says what it needs: a database URL or a running `modelforge dev`.
        (["db", "migrate"], {}, "db migrate needs a reachable Postgres: set MODELFORGE_DATABASE_URL, or run it while"),
        (
            ["db", "migrate"],
            {"MODELFORGE_DATABASE_URL": "postgresql://x@127.0.0.1:1/x"},
            "db migrate needs a reachable Postgres: set MODELFORGE_DATABASE_URL, or run it while",
        ),
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


@pytest.mark.parametrize("text", ["", "h", "-1h", "0m", "1w", "nan", "inf", "1e999h", "1e300d", "36501d"])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ModelForgeError, match="duration"):
        parse_duration(text)


def test_long_vectors_are_summarised_on_the_terminal_and_kept_whole_in_json() -> None:
    from modelforge.cli_common import shown_output

    output = {"embeddings": [[0.5] * 384, [0.25] * 384], "dimensions": 384, "text": "hi", "short": [1, 2, 3]}
    assert shown_output(output) == {
        "embeddings": ["[384 numbers: 0.5, 0.5, 0.5, ...]", "[384 numbers: 0.25, 0.25, 0.25, ...]"],
        "dimensions": 384,
        "text": "hi",
        "short": [1, 2, 3],
    }
    assert len(output["embeddings"][0]) == 384  # the result itself is untouched


def _deep_input(depth: int) -> dict[str, object]:
    value: object = []
    for _ in range(depth):
        value = [value]
    return {"texts": value}


UNREACHABLE_DB = {"MODELFORGE_DATABASE_URL": "postgresql://x@127.0.0.1:1/x"}
# Nothing listens here: a command that connected to Temporal would fail CAPABILITY_UNAVAILABLE,
# so REQUEST_INVALID shows the input was refused before anything was contacted.
NO_TEMPORAL = {"MODELFORGE_TEMPORAL_ADDRESS": "127.0.0.1:1"}


@pytest.mark.parametrize(
    ("args", "extra", "fragment"),
    [
        (["request", "x@1", "--input", "[" * 5000 + "]" * 5000], NO_TEMPORAL, "--input nests too deeply"),
        (["request", "x@1", "--input", json.dumps(_deep_input(200))], NO_TEMPORAL, "input nests deeper than 64"),
        (["request", "x@1", "--tenant", "t" * 3000], NO_TEMPORAL, "tenant is 3000 characters; at most 64"),
        (["request", "x@1", "--tenant", "rag\n"], NO_TEMPORAL, "tenant 'rag"),
        (["request", "x@1", "--request-id", "r1\n"], NO_TEMPORAL, "request_id 'r1"),
        (["request", "x@1\n"], NO_TEMPORAL, "capability 'x@1"),
        (["request", "x@1", "--input", '{"modelforge_operation": "profile"}'], NO_TEMPORAL, "reserved for ModelForge"),
        (["profile", "x@1", "--tenant", "a b"], {**NO_TEMPORAL, **UNREACHABLE_DB}, "tenant 'a b' is not valid"),
    ],
)
def test_bad_request_input_is_request_invalid_in_one_line(
    tmp_path: Path, args: list[str], extra: dict[str, str], fragment: str
) -> None:
    done = modelforge(*args, env=_env(tmp_path, **extra))
    assert done.returncode == 1, done.stderr
    assert "REQUEST_INVALID" in done.stderr and fragment in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["events", "--limit", "-1"], "--limit must be between 1 and 100000"),
        (["events", "--limit", "0"], "--limit must be between 1 and 100000"),
        (["events", "--limit", str(10**30)], "--limit must be between 1 and 100000"),
        (["events", "--request-id", "r1\n"], "--request-id: request_id"),
        (["usage", "--since", "1e300d"], "at most 36500d"),
        (["capacity", "--since", "1e300d"], "at most 36500d"),
    ],
)
def test_out_of_range_history_queries_are_request_invalid(tmp_path: Path, args: list[str], fragment: str) -> None:
    done = modelforge(*args, env=_env(tmp_path, **UNREACHABLE_DB))
    assert done.returncode == 2
    assert "REQUEST_INVALID" in done.stderr and fragment in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_deeply_nested_catalog_and_api_keys_files_are_request_invalid(tmp_path: Path) -> None:
    deep = "[" * 100_000 + "]" * 100_000
    catalog = tmp_path / "catalog.toml"
    catalog.write_text(f'[[deployments]]\ncapability = "x@1"\nenvelope_bytes = 1\nsurprise = {deep}\n')
    keys = tmp_path / "keys.toml"
    keys.write_text(f"[api_keys]\nk = {deep}\n")
    for args, extra in (
        (["catalog", "apply", str(catalog)], UNREACHABLE_DB),
        (["gateway"], {**UNREACHABLE_DB, "MODELFORGE_GATEWAY_API_KEYS_FILE": str(keys)}),
    ):
        done = modelforge(*args, env=_env(tmp_path, **extra))
        assert done.returncode == 2, done.stderr
        assert "REQUEST_INVALID" in done.stderr and "nests too deeply" in done.stderr, done.stderr
        assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_a_node_gateway_on_a_port_it_cannot_listen_on_fails_before_the_worker_starts(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = modelforge("worker", "node", "--node", "n", "--gateway-port", str(port), env=_env(tmp_path))
    assert done.returncode != 0
    assert f"REQUEST_INVALID: cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr
    # An interface that does not resolve: the same, typed.
    done = modelforge(
        "worker",
        "node",
        "--node",
        "n",
        "--gateway-port",
        "1",
        "--gateway-host",
        "no.such.host.invalid",
        env=_env(tmp_path),
    )
    assert "REQUEST_INVALID: cannot listen on no.such.host.invalid:1" in done.stderr, done.stderr
    # A port it can listen on, and no database to read the catalog from: said before it starts.
    port = free_port()
    done = modelforge("worker", "node", "--node", "n", "--gateway-port", str(port), env=_env(tmp_path))
    assert done.returncode != 0 and "CAPABILITY_UNAVAILABLE: no database" in done.stderr, done.stderr


def test_a_result_file_that_cannot_be_written_is_request_invalid_naming_it(tmp_path: Path) -> None:
    import errno

    def disk_full() -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(ModelForgeError) as refused:
        written("--plot", tmp_path / "out.png", disk_full)
    assert refused.value.failure.value == "REQUEST_INVALID"
    assert str(tmp_path / "out.png") in refused.value.message and "No space left on device" in refused.value.message
    assert written("--plot", tmp_path / "out.png", lambda: 7) == 7
    # A path too long to look at: refused by name, not an OSError's traceback.
    for too_long in (Path("a" * 5000 + ".png"), tmp_path / ("b" * 300) / "x.png"):
        with pytest.raises(ModelForgeError, match="File name too long") as refused:
            check_output_path("--plot", too_long)
        assert refused.value.failure.value == "REQUEST_INVALID" and len(refused.value.message) < 300
    # Missing folders are made when it is written: no refusal before.
    check_output_path("--out", tmp_path / "new" / "deeper", folder=True)
    check_output_path("--plot", tmp_path / "new" / "x.png")
