"""Settings from the environment (modelforge/settings.py, the README's Configuration table):
every variable parsed, the defaults, secrets from `*_FILE` files and never shown, byte sizes in
pydantic's `ByteSize` forms, and a bad value refused REQUEST_INVALID naming its variable."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.logging import get_logger
from modelforge.settings import DEFAULT_MAX_PAYLOAD_BYTES, DEFAULT_PAYLOAD_THRESHOLD_BYTES, Settings, env_var
from modelforge.temporal import temporal_metrics_address, worker_runtime

PASSWORD = "s3cret-Pa55-0123"
API_KEY = "tmprl-api-key-9876543210"


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No MODELFORGE_* variable of the test run leaks in; HOME is a fresh directory."""
    for name in list(os.environ):
        if name.upper().startswith("MODELFORGE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("HOME", str(tmp_path / "user"))


def test_the_defaults(tmp_path: Path) -> None:
    settings = Settings.from_env()
    assert settings.temporal_address == "localhost:7233"
    assert settings.temporal_namespace == "default"
    assert settings.temporal_tls is False
    assert (settings.temporal_tls_cert, settings.temporal_tls_key, settings.temporal_tls_ca) == (None, None, None)
    assert settings.temporal_api_key is None and settings.database_url is None
    assert settings.home == tmp_path / "user" / ".modelforge"
    assert settings.gpu_backend == "auto"
    assert (settings.metrics_port, settings.metrics_host) == (9464, "127.0.0.1")
    assert settings.temporal_metrics_address is None
    assert settings.temporal_metrics_bind("control") == "127.0.0.1:9465"
    assert settings.temporal_metrics_bind("node") == "127.0.0.1:9466"
    assert settings.snapshot_retention_days == 30.0
    assert settings.artifact_roots == () and settings.resolved_artifact_roots() == [settings.home / "artifacts"]
    assert settings.checkpoint_dir is None and settings.resolved_checkpoint_dir() == settings.home / "checkpoints"
    assert settings.payload_dir is None and settings.resolved_payload_dir() == settings.home / "payloads"
    assert settings.payload_threshold_bytes == DEFAULT_PAYLOAD_THRESHOLD_BYTES == 2048
    assert settings.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES == 64 * 1024 * 1024
    assert settings.payload_retention_days is None
    assert settings.replay_check_s == 60.0
    assert settings.run_dir == settings.home / "run"
    assert settings.resolved_database_url() is None


def test_every_variable_is_read(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    values = {
        "MODELFORGE_TEMPORAL_ADDRESS": "temporal.internal:7233",
        "MODELFORGE_TEMPORAL_NAMESPACE": "prod",
        "MODELFORGE_TEMPORAL_TLS": "yes",
        "MODELFORGE_TEMPORAL_TLS_CERT": "/tls/client.pem",
        "MODELFORGE_TEMPORAL_TLS_KEY": "/tls/client.key",
        "MODELFORGE_TEMPORAL_TLS_CA": "/tls/ca.pem",
        "MODELFORGE_TEMPORAL_API_KEY": API_KEY,
        "MODELFORGE_DATABASE_URL": f"postgresql://mf:{PASSWORD}@db/mf",
        "MODELFORGE_HOME": str(tmp_path / "home"),
        "MODELFORGE_GPU_BACKEND": "simulated",
        "MODELFORGE_METRICS_PORT": "9999",
        "MODELFORGE_METRICS_HOST": "0.0.0.0",
        "MODELFORGE_TEMPORAL_METRICS_ADDRESS": "0.0.0.0:9470",
        "MODELFORGE_SNAPSHOT_RETENTION_DAYS": "7.5",
        "MODELFORGE_ARTIFACT_ROOTS": os.pathsep.join(["/models", "", "/more/models"]),
        "MODELFORGE_CHECKPOINT_DIR": "/shared/checkpoints",
        "MODELFORGE_PAYLOAD_DIR": "/shared/payloads",
        "MODELFORGE_PAYLOAD_THRESHOLD_BYTES": "4096",
        "MODELFORGE_MAX_PAYLOAD_BYTES": "1000",
        "MODELFORGE_PAYLOAD_RETENTION_DAYS": "2.5",
        "MODELFORGE_REPLAY_CHECK_S": "0",
    }
    for name, value in values.items():
        monkeypatch.setenv(name, value)
    settings = Settings.from_env()
    assert settings.temporal_address == "temporal.internal:7233"
    assert settings.temporal_namespace == "prod"
    assert settings.temporal_tls is True
    assert (settings.temporal_tls_cert, settings.temporal_tls_key, settings.temporal_tls_ca) == (
        "/tls/client.pem",
        "/tls/client.key",
        "/tls/ca.pem",
    )
    assert settings.temporal_api_key == API_KEY
    assert settings.database_url == f"postgresql://mf:{PASSWORD}@db/mf"
    assert settings.resolved_database_url() == settings.database_url
    assert settings.home == tmp_path / "home"
    assert settings.gpu_backend == "simulated"
    assert (settings.metrics_port, settings.metrics_host) == (9999, "0.0.0.0")
    assert settings.temporal_metrics_bind("control") == settings.temporal_metrics_bind("node") == "0.0.0.0:9470"
    assert settings.snapshot_retention_days == 7.5
    assert settings.artifact_roots == (Path("/models"), Path("/more/models"))
    assert settings.resolved_artifact_roots() == [Path("/models"), Path("/more/models")]
    assert settings.resolved_checkpoint_dir() == Path("/shared/checkpoints")
    assert settings.resolved_payload_dir() == Path("/shared/payloads")
    assert (settings.payload_threshold_bytes, settings.max_payload_bytes) == (4096, 1000)
    assert settings.payload_retention_days == 2.5
    assert settings.replay_check_s == 0
    # The same from a mapping instead of os.environ.
    assert Settings.from_env(values) == settings


@pytest.mark.parametrize(
    ("text", "expected"), [("1", True), ("true", True), ("YES", True), ("on", True), ("0", False), ("no", False)]
)
def test_tls_takes_the_usual_booleans(monkeypatch: pytest.MonkeyPatch, text: str, expected: bool) -> None:
    monkeypatch.setenv("MODELFORGE_TEMPORAL_TLS", text)
    assert Settings.from_env().temporal_tls is expected


def test_an_empty_variable_is_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MODELFORGE_CHECKPOINT_DIR", "MODELFORGE_PAYLOAD_DIR", "MODELFORGE_MAX_PAYLOAD_BYTES"):
        monkeypatch.setenv(name, "")
    monkeypatch.setenv("MODELFORGE_PAYLOAD_RETENTION_DAYS", "")
    settings = Settings.from_env()
    assert settings.checkpoint_dir is None and settings.payload_dir is None
    assert settings.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES and settings.payload_retention_days is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2048", 2048),
        ("2 KiB", 2048),
        ("2KiB", 2048),
        ("64MiB", 64 * 1024 * 1024),
        ("64 mib", 64 * 1024 * 1024),
        ("1.5 KiB", 1536),
        ("2 KB", 2000),
        ("1GB", 10**9),
        ("1 GiB", 2**30),
        ("512b", 512),
    ],
)
def test_byte_sizes_take_units_and_stay_ints(monkeypatch: pytest.MonkeyPatch, text: str, expected: int) -> None:
    monkeypatch.setenv("MODELFORGE_MAX_PAYLOAD_BYTES", text)
    monkeypatch.setenv("MODELFORGE_PAYLOAD_THRESHOLD_BYTES", text)
    settings = Settings.from_env()
    assert settings.max_payload_bytes == settings.payload_threshold_bytes == expected
    assert type(settings.max_payload_bytes) is int and type(settings.payload_threshold_bytes) is int
    assert type(Settings().replace(max_payload_bytes=text).max_payload_bytes) is int  # copies take the same forms


BAD = [
    ("MODELFORGE_TEMPORAL_TLS", "maybe"),
    ("MODELFORGE_GPU_BACKEND", "cuda"),
    ("MODELFORGE_METRICS_PORT", "metrics"),
    ("MODELFORGE_METRICS_PORT", "70000"),
    ("MODELFORGE_METRICS_PORT", "-1"),
    ("MODELFORGE_METRICS_HOST", "  "),
    ("MODELFORGE_METRICS_HOST", "two words"),
    ("MODELFORGE_TEMPORAL_METRICS_ADDRESS", "9465"),
    ("MODELFORGE_TEMPORAL_METRICS_ADDRESS", "127.0.0.1:70000"),
    ("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "0"),
    ("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "-3"),
    ("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "month"),
    ("MODELFORGE_SNAPSHOT_RETENTION_DAYS", "inf"),
    ("MODELFORGE_PAYLOAD_RETENTION_DAYS", "soon"),
    ("MODELFORGE_PAYLOAD_RETENTION_DAYS", "0"),
    ("MODELFORGE_PAYLOAD_RETENTION_DAYS", "nan"),
    ("MODELFORGE_PAYLOAD_THRESHOLD_BYTES", "0"),
    ("MODELFORGE_PAYLOAD_THRESHOLD_BYTES", "-2048"),
    ("MODELFORGE_PAYLOAD_THRESHOLD_BYTES", "two kilobytes"),
    ("MODELFORGE_MAX_PAYLOAD_BYTES", "0"),
    ("MODELFORGE_MAX_PAYLOAD_BYTES", "64 MiBs"),
    ("MODELFORGE_MAX_PAYLOAD_BYTES", "lots"),
    ("MODELFORGE_REPLAY_CHECK_S", "3"),
    ("MODELFORGE_REPLAY_CHECK_S", "86401"),
    ("MODELFORGE_REPLAY_CHECK_S", "-1"),
    ("MODELFORGE_REPLAY_CHECK_S", "often"),
]


@pytest.mark.parametrize(("name", "value"), BAD)
def test_a_bad_value_is_refused_naming_its_variable(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ModelForgeError) as refused:
        Settings.from_env()
    assert refused.value.failure is FailureClass.REQUEST_INVALID
    assert refused.value.message.startswith(f"{name} must be "), refused.value.message
    assert repr(value) in refused.value.message
    assert "validation error" not in str(refused.value) and "pydantic" not in str(refused.value)


def test_a_bad_value_in_a_mapping_or_a_copy_is_refused_too() -> None:
    with pytest.raises(ModelForgeError, match="MODELFORGE_MAX_PAYLOAD_BYTES"):
        Settings.from_env({"MODELFORGE_MAX_PAYLOAD_BYTES": "0"})
    with pytest.raises(ModelForgeError, match="MODELFORGE_REPLAY_CHECK_S"):
        Settings.from_env().replace(replay_check_s=2)


def test_the_sdk_metrics_address_is_a_setting() -> None:
    assert temporal_metrics_address("node", {}) == "127.0.0.1:9466"
    assert temporal_metrics_address("node", {"MODELFORGE_TEMPORAL_METRICS_ADDRESS": "OFF"}) is None
    assert Settings(temporal_metrics_address="none").temporal_metrics_bind("control") is None
    assert worker_runtime("control", Settings(temporal_metrics_address="off")) is None


def test_secrets_come_from_files_ahead_of_the_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    url_file = tmp_path / "database_url"
    url_file.write_text(f"postgresql://modelforge:{PASSWORD}@db.internal:5432/mf\n")
    key_file = tmp_path / "api_key"
    key_file.write_text(f"  {API_KEY}\n")
    monkeypatch.setenv("MODELFORGE_DATABASE_URL", "postgresql://someone:else@elsewhere/mf")
    monkeypatch.setenv("MODELFORGE_DATABASE_URL_FILE", str(url_file))
    monkeypatch.setenv("MODELFORGE_TEMPORAL_API_KEY_FILE", str(key_file))
    settings = Settings.from_env()
    assert settings.database_url == f"postgresql://modelforge:{PASSWORD}@db.internal:5432/mf"
    assert settings.temporal_api_key == API_KEY
    # Keywords still come first (tests).
    assert Settings(temporal_api_key="given").temporal_api_key == "given"


def test_secrets_are_never_shown(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    key_file = tmp_path / "api_key"
    key_file.write_text(API_KEY)
    monkeypatch.setenv("MODELFORGE_TEMPORAL_API_KEY_FILE", str(key_file))
    monkeypatch.setenv("MODELFORGE_DATABASE_URL", f"postgresql://mf:{PASSWORD}@db/mf")
    settings = Settings.from_env()
    assert settings.temporal_api_key == API_KEY and settings.database_url is not None
    shown = [repr(settings), str(settings), f"{settings}", str(settings.model_dump()), settings.model_dump_json()]
    with capture_logs() as logs:
        get_logger("test").info("settings", settings=settings)
    shown += [repr(entry) for entry in logs]
    for text in shown:
        assert API_KEY not in text and PASSWORD not in text, text
    assert "temporal_address" in repr(settings)  # the rest is shown
    # A copy keeps them, still hidden.
    copy = settings.replace(home=tmp_path)
    assert copy.temporal_api_key == API_KEY and copy.database_url == settings.database_url
    assert API_KEY not in repr(copy)


def test_an_unreadable_secret_file_names_the_variable_and_never_the_contents(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("MODELFORGE_TEMPORAL_API_KEY_FILE", str(tmp_path / "missing"))
    with pytest.raises(ModelForgeError) as refused:
        Settings.from_env()
    assert refused.value.failure is FailureClass.REQUEST_INVALID
    assert refused.value.message.startswith("MODELFORGE_TEMPORAL_API_KEY_FILE: cannot read ")
    monkeypatch.delenv("MODELFORGE_TEMPORAL_API_KEY_FILE")
    directory = tmp_path / "a-directory"
    directory.mkdir()
    monkeypatch.setenv("MODELFORGE_DATABASE_URL_FILE", str(directory))
    with pytest.raises(ModelForgeError, match="MODELFORGE_DATABASE_URL_FILE: cannot read"):
        Settings.from_env()


def test_keywords_and_copies(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("MODELFORGE_TEMPORAL_NAMESPACE", "from-env")
    settings = Settings(home=tmp_path, payload_dir=tmp_path / "payloads")
    assert settings.home == tmp_path and settings.resolved_payload_dir() == tmp_path / "payloads"
    assert settings.temporal_namespace == "from-env"  # keywords over the environment
    copy = settings.replace(max_payload_bytes="2 KiB", artifact_roots=[tmp_path / "a"])
    assert copy.max_payload_bytes == 2048 and copy.artifact_roots == (tmp_path / "a",)
    assert copy.home == tmp_path and settings.max_payload_bytes == DEFAULT_MAX_PAYLOAD_BYTES
    monkeypatch.setenv("MODELFORGE_TEMPORAL_NAMESPACE", "changed")
    assert settings.replace().temporal_namespace == "from-env"  # a copy does not read the environment
    with pytest.raises(ValueError):  # frozen
        settings.home = tmp_path / "elsewhere"
    assert hash(settings) == hash(settings.replace())


def test_every_setting_is_in_the_readme_configuration_table() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    table = readme.split("## Configuration", 1)[1].split("\n\n", 2)[1]
    for name in Settings.model_fields:
        variable = env_var(name)
        short = "..." + variable.removeprefix("MODELFORGE_TEMPORAL")  # `..._TLS_CERT` in the TLS row
        assert f"`{variable}`" in table or f"`{short}`" in table, variable
    for secret in ("temporal_api_key", "database_url"):
        assert f"`{env_var(secret)}` / `..." in table and "_FILE`" in table
    assert "ByteSize" in readme and "64MiB" in readme


def test_the_variables_read() -> None:
    variables = Settings.variables()
    assert "MODELFORGE_MAX_PAYLOAD_BYTES" in variables and "MODELFORGE_TEMPORAL_METRICS_ADDRESS" in variables
    assert {"MODELFORGE_DATABASE_URL_FILE", "MODELFORGE_TEMPORAL_API_KEY_FILE"} <= set(variables)
    assert len(variables) == len(set(variables)) == len(Settings.model_fields) + 2
