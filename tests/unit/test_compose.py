"""docker-compose.yml, checked statically (no Docker engine here): it parses, its services are
wired to each other, every ModelForge setting it passes is one the code reads, its images are
pinned, its defaults are safe (ports on loopback only, the gateway's API keys and Grafana's admin
password from secrets, a read-only Temporal UI, /metrics on loopback outside compose), Temporal
runs from the server image after a schema step and a namespace step that fails loudly, and the
Grafana dashboard only charts metrics the control worker exports. Prometheus's rules, the
dashboard's datasource and filter, and the setup scripts: tests/unit/test_deploy.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from prometheus_client import generate_latest

from modelforge.metrics import Metrics
from modelforge.temporal import SEARCH_ATTRIBUTES

ROOT = Path(__file__).resolve().parents[2]


def _compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    return loaded


def _settings_read_by_the_code() -> set[str]:
    from modelforge.settings import Settings

    names: set[str] = set(Settings.variables())  # modelforge/settings.py: named by its fields
    for path in [*(ROOT / "modelforge").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]:
        names.update(re.findall(r'"(MODELFORGE_[A-Z_]+)"', path.read_text()))
    return names


def test_services_are_wired() -> None:
    services = _compose()["services"]
    assert {
        "postgres",
        "temporal-schema",
        "temporal",
        "temporal-namespace",
        "temporal-ui",
        "modelforge-control",
        "modelforge-node",
        "modelforge-gateway",
        "prometheus",
        "grafana",
    } <= set(services)
    for name, service in services.items():
        for dependency in service.get("depends_on", []):
            assert dependency in services, f"{name} depends on unknown {dependency}"
    assert services["temporal"]["environment"]["POSTGRES_SEEDS"] == "postgres"
    assert services["temporal-schema"]["environment"]["POSTGRES_SEEDS"] == "postgres"
    assert services["temporal-namespace"]["environment"]["TEMPORAL_ADDRESS"] == "temporal:7233"
    assert services["temporal-ui"]["environment"]["TEMPORAL_ADDRESS"] == "temporal:7233"
    for name in ("modelforge-control", "modelforge-node", "modelforge-gateway"):
        env = services[name]["environment"]
        assert env["MODELFORGE_TEMPORAL_ADDRESS"] == "temporal:7233", name
        assert env["MODELFORGE_DATABASE_URL_FILE"].startswith("/run/secrets/"), name
        assert "database_url" in services[name]["secrets"], name
    # The node worker reaches the GPUs, and sees host PIDs to tell its processes from external ones.
    node = services["modelforge-node"]
    [device] = node["deploy"]["resources"]["reservations"]["devices"]
    assert device["driver"] == "nvidia" and "gpu" in device["capabilities"]
    assert node["pid"] == "host" and node["environment"]["MODELFORGE_GPU_BACKEND"] == "nvml"
    assert "127.0.0.1:9464:9464" in services["modelforge-control"]["ports"]
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["modelforge-control:9464"]


def test_temporal_runs_from_the_server_image_after_its_setup_steps() -> None:
    """temporalio/auto-setup is no longer built: the server image, after a schema step (admin-tools'
    temporal-sql-tool, as Temporal's own compose setup does) and before a namespace step."""
    services = _compose()["services"]
    images = {name: service["image"].rsplit(":", 1) for name, service in services.items() if "image" in service}
    assert not any(image == "temporalio/auto-setup" for image, _ in images.values())
    assert images["temporal"][0] == "temporalio/server"
    assert images["temporal-schema"][0] == images["temporal-namespace"][0] == "temporalio/admin-tools"
    # One Temporal release for the server and its tools.
    assert images["temporal"][1] == images["temporal-schema"][1] == images["temporal-namespace"][1]
    scripts = ROOT / "deploy" / "temporal"
    for name, script in (
        ("temporal-schema", "setup-schema.sh"),
        ("temporal", "start-server.sh"),
        ("temporal-namespace", "setup-namespace.sh"),
    ):
        service = services[name]
        assert service["entrypoint"] == ["/bin/sh", f"/etc/modelforge/temporal/{script}"], name
        assert "./deploy/temporal:/etc/modelforge/temporal:ro" in service["volumes"], name
        assert (scripts / script).is_file(), script
    schema = (scripts / "setup-schema.sh").read_text()
    for step in ("create", "setup-schema -v 0.0", "update-schema -d"):
        assert step in schema, step
    assert "temporal_visibility" in schema and "set -eu" in schema
    # The order: schema, server, namespace, then the ModelForge workers.
    assert services["temporal"]["depends_on"]["temporal-schema"]["condition"] == "service_completed_successfully"
    assert services["temporal-namespace"]["depends_on"]["temporal"]["condition"] == "service_healthy"
    control = services["modelforge-control"]["depends_on"]
    assert control["temporal-namespace"]["condition"] == "service_completed_successfully"
    # The password comes from the secret, not the file or the environment.
    for name in ("temporal-schema", "temporal"):
        assert services[name]["environment"]["POSTGRES_PWD_FILE"] == "/run/secrets/postgres_password", name
        assert "postgres_password" in services[name]["secrets"], name
        assert "POSTGRES_PWD" not in services[name]["environment"], name


def test_the_namespace_step_sets_the_retention_and_fails_loudly() -> None:
    namespace = _compose()["services"]["temporal-namespace"]
    # Retention is a setting with a default (TEMPORAL_RETENTION, 24 h).
    assert namespace["environment"]["RETENTION"] == "${TEMPORAL_RETENTION:-24h}"
    assert namespace["restart"] == "no"  # a failure stays failed (and the workers wait on it)
    script = (ROOT / "deploy/temporal/setup-namespace.sh").read_text()
    assert "set -eu" in script and "|| true" not in script
    assert "--retention" in script and "namespace update" in script  # an existing namespace too


def test_every_modelforge_setting_is_one_the_code_reads() -> None:
    read = _settings_read_by_the_code()
    passed = set()
    for service in _compose()["services"].values():
        passed.update(k for k in service.get("environment", {}) if k.startswith("MODELFORGE_"))
    assert passed and passed <= read, passed - read


def test_no_secret_is_written_into_the_file() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    assert "PASSWORD:" not in text.replace("POSTGRES_PASSWORD_FILE:", "")
    assert not re.search(r"postgresql://[^\s@]+:(?!<password>)[^\s@]+@", text)  # a placeholder only
    for name, secret in _compose()["secrets"].items():
        assert secret["file"].startswith("./deploy/secrets/"), name


def test_images_are_pinned() -> None:
    for name, service in _compose()["services"].items():
        image = service.get("image", "")
        assert image and ":" in image and not image.endswith(":latest"), f"{name}: {image!r}"


def test_search_attributes_created_are_the_ones_the_code_uses() -> None:
    created = _compose()["services"]["temporal-namespace"]["environment"]["SEARCH_ATTRIBUTES"].split()
    assert sorted(created) == sorted(key.name for key in SEARCH_ATTRIBUTES)


def test_the_catalog_it_applies_is_valid() -> None:
    from modelforge.catalog import load_catalog_file

    catalog, _ = load_catalog_file(ROOT / "deploy" / "catalog.toml")
    assert catalog.accelerators and not any(a.simulated for a in catalog.accelerators)


def test_dashboard_charts_only_exported_metrics() -> None:
    dashboard = json.loads((ROOT / "deploy/grafana/modelforge.json").read_text())
    metrics = Metrics()
    exported = {
        line.split()[2] for line in generate_latest(metrics.registry).decode().splitlines() if line.startswith("# TYPE")
    }
    # Histograms and counters are charted through their series suffixes.
    series = set(exported) | {f"{m}_total" for m in exported} | {f"{m}_bucket" for m in exported}
    used = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            used.update(re.findall(r"\b(modelforge_[a-z_]+)", target["expr"]))
    assert used and used <= series, used - series


def _published(service: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, host port) of each published port, short or long syntax."""
    published = []
    for port in service.get("ports", []):
        if isinstance(port, dict):
            published.append((str(port.get("host_ip", "")), str(port.get("published", ""))))
        else:
            parts = str(port).split(":")
            published.append((":".join(parts[:-2]), parts[-2]) if len(parts) >= 3 else ("", parts[0]))
    return published


def test_every_port_is_published_on_loopback_only() -> None:
    services = _compose()["services"]
    published = {name: _published(service) for name, service in services.items()}
    assert {"temporal-ui", "modelforge-gateway", "modelforge-control", "prometheus", "grafana"} <= {
        name for name, ports in published.items() if ports
    }
    for name, ports in published.items():
        for host_ip, _ in ports:
            assert host_ip == "127.0.0.1", f"{name} publishes a port on {host_ip or 'every interface'}"
    # The host's CLI reaches Temporal's frontend and Postgres on loopback (README: the settings
    # that point at them), nothing else does.
    assert published["temporal"] == [("127.0.0.1", "7233")]
    assert published["postgres"] == [("127.0.0.1", "5432")]
    # The SDK's worker metrics stay inside the network, where Prometheus scrapes them.
    assert published["modelforge-node"] == [] and published["temporal-namespace"] == []


def test_the_host_cli_is_documented_against_the_published_ports() -> None:
    readme = (ROOT / "README.md").read_text()
    for line in (
        "MODELFORGE_TEMPORAL_ADDRESS=127.0.0.1:7233",
        "MODELFORGE_DATABASE_URL=postgresql://modelforge:",
        "@127.0.0.1:5432/modelforge",
        "docker compose run --rm modelforge-cli",
    ):
        assert line in readme, line
    cli = _compose()["services"]["modelforge-cli"]
    assert cli["profiles"] == ["cli"]  # not started by `docker compose up`
    assert "payloads:/var/lib/modelforge/payloads" in cli["volumes"]
    assert cli["environment"]["MODELFORGE_TEMPORAL_ADDRESS"] == "temporal:7233"


def test_the_gateway_requires_api_keys_from_a_secret() -> None:
    compose = _compose()
    gateway = compose["services"]["modelforge-gateway"]
    path = gateway["environment"]["MODELFORGE_GATEWAY_API_KEYS_FILE"]
    [secret] = [name for name in gateway["secrets"] if path == f"/run/secrets/{name}"]
    assert compose["secrets"][secret]["file"].startswith("./deploy/secrets/")
    assert "database_url" in gateway["secrets"]  # overriding the anchor's list kept it
    # The example keys file is a valid one, so a copy with real keys is too.
    from modelforge.gateway import load_api_keys

    assert load_api_keys(ROOT / "deploy" / "gateway_api_keys.example.toml")


def test_the_temporal_ui_is_read_only() -> None:
    env = _compose()["services"]["temporal-ui"]["environment"]
    assert str(env["TEMPORAL_DISABLE_WRITE_ACTIONS"]).lower() == "true"


def test_grafana_has_no_default_login() -> None:
    compose = _compose()
    grafana = compose["services"]["grafana"]
    env = grafana["environment"]
    assert "GF_SECURITY_ADMIN_PASSWORD" not in env
    path = env["GF_SECURITY_ADMIN_PASSWORD__FILE"]
    [secret] = [name for name in grafana["secrets"] if path == f"/run/secrets/{name}"]
    assert compose["secrets"][secret]["file"].startswith("./deploy/secrets/")
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"


def test_metrics_listen_on_loopback_unless_configured(monkeypatch: Any) -> None:
    """Outside compose (`modelforge dev`, a bare `worker control`) /metrics binds 127.0.0.1;
    compose sets 0.0.0.0 inside its network, where Prometheus scrapes it."""
    import modelforge.metrics
    from modelforge.settings import Settings
    from workers.control import serve_metrics

    env = _compose()["services"]["modelforge-control"]["environment"]
    assert env["MODELFORGE_METRICS_HOST"] == "0.0.0.0"

    servers: list[Any] = []
    real = modelforge.metrics.start_http_server

    def recording(*args: Any, **kwargs: Any) -> Any:
        server, thread = real(*args, **kwargs)
        servers.append(server)
        return server, thread

    monkeypatch.setattr(modelforge.metrics, "start_http_server", recording)
    try:
        for configured, expected in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
            monkeypatch.delenv("MODELFORGE_METRICS_HOST", raising=False)
            if configured is not None:
                monkeypatch.setenv("MODELFORGE_METRICS_HOST", configured)
            monkeypatch.setenv("MODELFORGE_METRICS_PORT", "0")
            port = serve_metrics(modelforge.metrics.Metrics(), Settings.from_env())
            assert servers[-1].server_address == (expected, port)
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_every_process_on_the_request_path_shares_the_payload_store() -> None:
    # A payload one process stores beside the history must be readable by every other one, or a
    # request waits on a workflow task that can never decode its input.
    compose = _compose()
    services = compose["services"]
    path = "/var/lib/modelforge/payloads"
    for name in ("modelforge-control", "modelforge-node", "modelforge-gateway"):
        assert services[name]["environment"]["MODELFORGE_PAYLOAD_DIR"] == path, name
        assert f"payloads:{path}" in services[name]["volumes"], name
    assert "payloads" in compose["volumes"]
    # The node keeps its checkpoints on a volume: preempted work resumes after a restart.
    assert any(v.startswith("checkpoints:") for v in services["modelforge-node"]["volumes"])
