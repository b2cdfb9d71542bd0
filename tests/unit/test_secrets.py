"""Secrets come from the environment or files and never reach a log line, an error or a repr.
Model-server secrets are referenced by name in the catalog (`env_from_secrets`), never written
there, and resolved on the node when its worker starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from modelforge.catalog import CatalogError, parse_catalog
from modelforge.domain import GiB
from modelforge.failures import ModelForgeError
from modelforge.runtimes._secrets import NodeSecrets
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


HF_TOKEN = "hf_Vh8sEcReTvAlUe0123456789"


def _catalog(runtime: str = "subprocess_http", **deployment: Any) -> dict[str, Any]:
    command = {"command": ["vllm", "serve", "{artifact}", "--port", "{port}"]} if runtime == "subprocess_http" else {}
    return {
        "accelerators": [{"id": "n/0", "node": "n", "total_bytes": 24 * GiB}],
        "deployments": [{"capability": "c@1", "envelope_bytes": GiB, "runtime": runtime, **command, **deployment}],
    }


@pytest.mark.parametrize(
    ("runtime", "config"),
    [
        ("subprocess_http", {"env.HF_TOKEN": HF_TOKEN}),
        ("subprocess_http", {"env.OPENAI_API_KEY": HF_TOKEN, "api": "openai_chat"}),
        ("subprocess_http", {"env.DB_PASSWORD": HF_TOKEN}),
        ("subprocess_http", {"env.my_secret": HF_TOKEN}),
        ("simulated", {"env.HF_TOKEN": HF_TOKEN}),
        ("simulated", {"api_key": HF_TOKEN}),
    ],
)
def test_a_secret_written_in_the_catalog_is_refused_pointing_to_the_reference_syntax(
    runtime: str, config: dict[str, str]
) -> None:
    with pytest.raises(CatalogError) as refused:
        parse_catalog(_catalog(runtime, runtime_config=config))
    message = str(refused.value)
    assert "env_from_secrets" in message and "MODELFORGE_SECRET_" in message and "MODELFORGE_SECRETS_DIR" in message
    assert HF_TOKEN not in message and HF_TOKEN not in repr(refused.value)


def test_secrets_are_referenced_by_name_and_only_names_reach_the_catalog() -> None:
    catalog, _ = parse_catalog(
        _catalog(env_from_secrets={"HF_TOKEN": "hf_token"}, runtime_config={"env.VLLM_SERVER_DEV_MODE": "1"})
    )
    [deployment] = catalog.deployments
    assert deployment.env_from_secrets == {"HF_TOKEN": "hf_token"}
    # What Postgres stores and Temporal carries (LoadInput, ResidencyInput) holds the name only.
    assert dataclasses.asdict(deployment)["env_from_secrets"] == {"HF_TOKEN": "hf_token"}
    for bad, why in [
        ({"HF TOKEN": "hf_token"}, "not an environment variable name"),
        ({"HF_TOKEN": "../../etc/shadow"}, "a secret name is"),
        ({"HF_TOKEN": ""}, "a secret name is"),
    ]:
        with pytest.raises(CatalogError, match=why):
            parse_catalog(_catalog(env_from_secrets=bad))
    with pytest.raises(CatalogError, match="is set too"):
        parse_catalog(_catalog(env_from_secrets={"HF_HOME": "hf"}, runtime_config={"env.HF_HOME": "/x"}))
    with pytest.raises(CatalogError, match="only subprocess_http"):
        parse_catalog(_catalog("sentence_transformers", env_from_secrets={"HF_TOKEN": "hf_token"}))


def test_node_secrets_are_read_at_start_from_the_environment_or_files_and_never_shown(tmp_path: Path) -> None:
    (tmp_path / "hf_token").write_text(HF_TOKEN + "\n")
    (tmp_path / "api.key").write_text("from-file")
    (tmp_path / "big").write_bytes(b"x" * (70 * 1024))  # over the limit: not a secret
    (tmp_path / "linked").symlink_to(tmp_path / "hf_token")  # never followed
    secrets = NodeSecrets.from_env(
        {"MODELFORGE_SECRETS_DIR": str(tmp_path), "MODELFORGE_SECRET_API_KEY": "from-env", "PATH": "/bin"}
    )
    assert secrets.get("hf_token") == HF_TOKEN
    assert secrets.get("api.key") == "from-env"  # the environment first
    assert secrets.get("big") is None and secrets.get("linked") is None and secrets.get("PATH") is None
    assert secrets.resolve({"HF_TOKEN": "hf_token"}) == {"HF_TOKEN": HF_TOKEN}
    assert HF_TOKEN not in repr(secrets) and HF_TOKEN not in str(secrets) and "from-env" not in repr(secrets)
    with pytest.raises(ModelForgeError) as missing:
        secrets.resolve({"HF_TOKEN": "hf_token", "OTHER": "nope"})
    assert "MODELFORGE_SECRET_NOPE" in missing.value.message and HF_TOKEN not in str(missing.value)
    # Read once: a file written later is not seen until the node worker restarts.
    (tmp_path / "later").write_text("v")
    assert secrets.get("later") is None
