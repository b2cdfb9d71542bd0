"""docker-compose.yml, checked statically (no Docker engine here): it parses, its services are
wired to each other, every ModelForge setting it passes is one the code reads, its images are
pinned, and the Grafana dashboard only charts metrics the control worker exports."""

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
    names: set[str] = set()
    for path in [*(ROOT / "modelforge").rglob("*.py"), *(ROOT / "workers").rglob("*.py")]:
        names.update(re.findall(r'"(MODELFORGE_[A-Z_]+)"', path.read_text()))
    return names


def test_services_are_wired() -> None:
    services = _compose()["services"]
    assert {
        "postgres",
        "temporal",
        "temporal-ui",
        "temporal-search-attributes",
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
    assert "9464" in str(services["modelforge-control"]["ports"])
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["modelforge-control:9464"]


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
    command = str(_compose()["services"]["temporal-search-attributes"]["entrypoint"])
    for key in SEARCH_ATTRIBUTES:
        assert key.name in command


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
