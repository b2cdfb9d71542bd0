"""Secrets come from the environment or files and never reach a log line, an error or a repr."""

from __future__ import annotations

from pathlib import Path

import pytest
from structlog.testing import capture_logs

from modelforge.failures import ModelForgeError
from modelforge.settings import Settings
from modelforge.store import Store

PASSWORD = "s3cret-Pa55"
API_KEY = "tmprl-api-key-0123456789"


def test_settings_read_secrets_from_files_and_never_show_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url_file = tmp_path / "database_url"
    url_file.write_text(f"postgresql://modelforge:{PASSWORD}@db.internal:5432/mf\n")
    key_file = tmp_path / "api_key"
    key_file.write_text(API_KEY)
    monkeypatch.setenv("MODELFORGE_DATABASE_URL_FILE", str(url_file))
    monkeypatch.setenv("MODELFORGE_TEMPORAL_API_KEY_FILE", str(key_file))
    settings = Settings.from_env()
    assert settings.database_url and PASSWORD in settings.database_url
    assert settings.temporal_api_key == API_KEY
    assert PASSWORD not in repr(settings) and API_KEY not in repr(settings)


def test_an_unreadable_secret_file_is_a_typed_error_without_contents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MODELFORGE_DATABASE_URL_FILE", str(tmp_path / "missing"))
    with pytest.raises(ModelForgeError, match="MODELFORGE_DATABASE_URL_FILE: cannot read"):
        Settings.from_env()


async def test_an_unreachable_database_is_reported_without_the_password() -> None:
    url = f"postgresql://modelforge:{PASSWORD}@127.0.0.1:1/mf"
    with capture_logs() as logs, pytest.raises(ModelForgeError) as refused:
        await Store.open(url, timeout=2.0)
    assert "cannot reach Postgres" in refused.value.message
    assert PASSWORD not in refused.value.message and PASSWORD not in str(refused.value)
    assert all(PASSWORD not in repr(entry) for entry in logs)
