"""deploy/: Prometheus's alert rules and scrape jobs, the Grafana dashboard's datasource and
accelerator filter, the Temporal setup scripts, and the Temporal SDK's worker metrics. Checked
without Docker: the rules statically (promtool when installed), the namespace script against a
real Temporal dev server, the SDK's metrics from a real worker."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest
from temporalio import activity

from modelforge.failures import Alert
from modelforge.metrics import Metrics
from modelforge.temporal import SEARCH_ATTRIBUTES, TEMPORAL_METRICS_ADDRESS, temporal_metrics_address, worker_runtime
from tests.worker_process import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"


def _yaml(path: Path) -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(path.read_text())
    return loaded


def _exported() -> dict[str, set[str]]:
    """Every series name the control worker exports, with the labels it carries."""
    metrics = Metrics()
    # One sample of each family, so every labelled series is written out.
    metrics.accelerator_state.labels("default", "gpu-node/0", "pressure").set(1)
    metrics.accelerator_bytes.labels("default", "gpu-node/0", "total", "false").set(1)
    metrics.queue_depth.labels("default", "production").set(0)
    metrics.active_leases.labels("default").set(0)
    metrics.residents.labels("default", "ready").set(0)
    metrics.scrape_ok.labels("default").set(1)
    metrics.admission_seconds.labels("production").observe(0.1)
    metrics.failures.labels("GPU_OOM", "invoke_failed").inc()
    metrics.loads.labels("d").inc()
    metrics.unloads.labels("d", "ttl").inc()
    metrics.alerts.labels("GPU_PRESSURE", "gpu_pressure_entered").inc()
    metrics.events.labels("load").inc()
    metrics.queue_waiting.labels("default", "memory_held").set(0)
    metrics.eta_error.labels("default", "memory_held").observe(-1.0)
    metrics.eta_abs_error.labels("default", "memory_held").observe(1.0)
    series: dict[str, set[str]] = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name, _, rest = line.partition("{")
        labels = set(re.findall(r'(\w+)="', rest.partition("}")[0])) if rest else set()
        series.setdefault(name.split()[0], set()).update(labels)
    return series


def _metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (not functions, keywords, labels or label values)."""
    without_strings = re.sub(r'"[^"]*"', '""', expr)
    without_labels = re.sub(r"\{[^}]*\}", "{}", without_strings)
    without_groupings = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", without_labels)
    names = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b\s*(?=\{|\)|\s|$|==|>|<|-|\[)", without_groupings))
    functions = {
        *("sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile"),
        *("absent", "rate", "irate", "increase", "delta", "vector", "scalar", "histogram_quantile", "clamp_min"),
        *("max_over_time", "min_over_time", "avg_over_time", "changes", "resets", "time", "label_replace"),
    }
    keywords = {"and", "or", "unless", "by", "on", "without", "ignoring", "bool", "offset"}
    return {n for n in names if n not in functions | keywords and not n.isdigit()}


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, {label: value}) of each `metric{label="value", ...}` selector (= and =~)."""
    found = []
    for name, body in re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}", expr):
        found.append((name, dict(re.findall(r'(\w+)\s*=~?\s*"([^"]*)"', body))))
    return found


# --- Prometheus ------------------------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    return [rule for group in _yaml(DEPLOY / "prometheus/alerts.yml")["groups"] for rule in group["rules"]]


def test_prometheus_loads_the_rules_and_scrapes_every_worker() -> None:
    config = _yaml(DEPLOY / "prometheus/prometheus.yml")
    assert config["rule_files"] == ["/etc/prometheus/alerts.yml"]
    compose = _yaml(ROOT / "docker-compose.yml")["services"]
    assert "./deploy/prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in compose["prometheus"]["volumes"]
    targets = {
        job["job_name"]: [t for static in job["static_configs"] for t in static["targets"]]
        for job in config["scrape_configs"]
    }
    assert targets["modelforge-control"] == ["modelforge-control:9464"]
    # The SDK's worker metrics of both workers, on the address each is given in compose.
    for service in ("modelforge-control", "modelforge-node"):
        address = compose[service]["environment"][TEMPORAL_METRICS_ADDRESS]
        host, _, port = address.rpartition(":")
        assert host == "0.0.0.0", service  # inside the network only: no port published for it
        assert f"{service}:{port}" in targets["temporal-sdk"], service


def test_the_alert_rules_are_well_formed() -> None:
    rules = _rules()
    names = [rule["alert"] for rule in rules]
    assert len(names) == len(set(names))
    assert {
        "ModelForgeGpuPressure",
        "ModelForgeCapabilityCapacity",
        "ModelForgeSchedulerDown",
        "ModelForgeControlWorkerDown",
    } <= set(names)
    for rule in rules:
        assert set(rule) <= {"alert", "expr", "for", "labels", "annotations"}, rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], rule["alert"]
        if "for" in rule:
            assert re.fullmatch(r"\d+[smh]", rule["for"]), rule["alert"]
        expr = rule["expr"]
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), rule["alert"]
        assert expr.count('"') % 2 == 0, rule["alert"]
    # The ModelForge alerts carry the alert's name as the event log writes it.
    by_name = {rule["alert"]: rule for rule in rules}
    assert by_name["ModelForgeGpuPressure"]["labels"]["modelforge_alert"] == Alert.GPU_PRESSURE.value
    assert by_name["ModelForgeCapabilityCapacity"]["labels"]["modelforge_alert"] == Alert.CAPABILITY_CAPACITY.value


def test_every_rule_names_a_metric_the_code_exports_with_labels_it_sets() -> None:
    exported = _exported()
    policy = (ROOT / "modelforge/policy/_alerts.py").read_text() + (ROOT / "modelforge/policy/_observe.py").read_text()
    used: set[str] = set()
    for rule in _rules():
        expr = rule["expr"]
        names = _metric_names(expr)
        assert names, rule["alert"]
        for name in names - {"up"}:  # `up`: Prometheus's own, per scrape job
            assert name in exported, f"{rule['alert']}: {name} is not exported"
        used |= names
        for name, labels in _selectors(expr):
            if name == "up":
                jobs = [job["job_name"] for job in _yaml(DEPLOY / "prometheus/prometheus.yml")["scrape_configs"]]
                assert labels["job"] in jobs, rule["alert"]
                continue
            assert set(labels) <= exported[name], f"{rule['alert']}: {name} has no label {set(labels) - exported[name]}"
            # Label values the code writes: the states, alert names and event kinds.
            if "state" in labels:
                assert labels["state"] in ("pressure", "unhealthy", "stale"), rule["alert"]
            if "alert" in labels:
                assert labels["alert"] in {a.value for a in Alert}, rule["alert"]
            if "kind" in labels:
                assert f'"{labels["kind"]}"' in policy, f"{rule['alert']}: no event kind {labels['kind']}"
    assert {"modelforge_accelerator_state", "modelforge_alerts_total", "modelforge_scheduler_up"} <= used


def test_the_rules_pass_promtool_when_it_is_installed(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed: the rules are checked statically above")
    done = subprocess.run(
        [promtool, "check", "rules", str(DEPLOY / "prometheus/alerts.yml")], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


# --- Grafana ---------------------------------------------------------------------------------------


def _dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((DEPLOY / "grafana/modelforge.json").read_text())
    return loaded


def test_the_dashboard_takes_its_datasource_from_a_variable() -> None:
    dashboard = _dashboard()
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    provisioned = {d["uid"] for d in _yaml(DEPLOY / "grafana/datasource.yml")["datasources"]}
    allowed = {"${datasource}"}

    def check(node: Any, where: str) -> None:
        if isinstance(node, dict):
            source = node.get("datasource")
            if isinstance(source, dict):
                assert source.get("uid") in allowed, f"{where}: datasource uid {source.get('uid')!r} is hard-coded"
            elif source is not None:
                assert source in allowed, f"{where}: datasource {source!r}"
            for key, value in node.items():
                check(value, f"{where}.{key}")
        elif isinstance(node, list):
            for index, value in enumerate(node):
                check(value, f"{where}[{index}]")

    check(dashboard, "dashboard")
    assert "prometheus" in provisioned  # the provisioned one the variable finds (any uid would do)
    # Every panel and every query names the variable (none falls back to a default datasource).
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
    assert variables["accelerator"]["datasource"]["uid"] == "${datasource}"


def test_every_panel_honours_the_accelerator_filter() -> None:
    """A series with an accelerator label is filtered by it; one with only a pool label is
    narrowed to the pools of the selected accelerators; one with neither says so in its panel."""
    exported = _exported()
    dashboard = _dashboard()
    assert "accelerator" in {v["name"] for v in dashboard["templating"]["list"]}
    by_accelerator = 'accelerator=~"$accelerator"'
    by_pool = f'and on (pool) group by (pool) (modelforge_accelerator_bytes{{pool=~"$pool", {by_accelerator}}})'
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in _metric_names(expr):
                labels = exported[name]
                if "accelerator" in labels:
                    selectors = [s for n, s in _selectors(expr) if n == name]
                    assert selectors and all(s.get("accelerator") == "$accelerator" for s in selectors), (
                        f"{panel['title']}: {name} is not filtered by accelerator"
                    )
                elif "pool" in labels:
                    assert by_pool in expr, f"{panel['title']}: {name} is not narrowed to the selected pools"
                else:
                    assert "cannot narrow" in panel.get("description", ""), (
                        f"{panel['title']}: {name} has no accelerator or pool label and the panel does not say so"
                    )


def test_every_panel_honours_the_pool_filter() -> None:
    """A `pool` variable from the pools the schedulers report, which narrows the accelerator
    list; every selection of a series that carries a pool label is filtered by it, and a panel
    whose series carry none says so."""
    exported = _exported()
    dashboard = _dashboard()
    variables = [v["name"] for v in dashboard["templating"]["list"]]
    assert variables.index("pool") < variables.index("accelerator")  # Grafana resolves them in order
    pool = next(v for v in dashboard["templating"]["list"] if v["name"] == "pool")
    assert pool["datasource"]["uid"] == "${datasource}" and pool["includeAll"] and pool["multi"]
    source = re.fullmatch(r"label_values\((\w+), pool\)", pool["query"])
    assert source and "pool" in exported[source.group(1)], pool["query"]
    accelerator = next(v for v in dashboard["templating"]["list"] if v["name"] == "accelerator")
    assert ('pool=~"$pool"') in accelerator["query"]
    pooled = {name for name, labels in exported.items() if "pool" in labels}
    assert {"modelforge_queue_depth", "modelforge_active_leases", "modelforge_scheduler_up"} <= pooled
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            names = _metric_names(expr)
            for name in names & pooled:
                uses = len(re.findall(rf"\b{name}\b", expr))
                filtered = [s for n, s in _selectors(expr) if n == name and s.get("pool") == "$pool"]
                assert len(filtered) == uses, f"{panel['title']}: {name} is not filtered by pool in {expr}"
            if names and not names & pooled:
                assert "pool" in panel.get("description", "") and "cannot narrow" in panel["description"], panel[
                    "title"
                ]


# --- Temporal setup -----------------------------------------------------------------------------------


def _temporal_cli() -> str:
    found = shutil.which("temporal", path=str(Path(sys.executable).parent)) or shutil.which("temporal")
    if found is None:
        pytest.skip("the temporal CLI is not installed (pip install -e '.[test]')")
    return found


@pytest.fixture
def temporal_dev_server(tmp_path: Path) -> Any:
    """A Temporal dev server on a free loopback port, and the directory holding its CLI."""
    cli = _temporal_cli()
    port = free_port()
    server = subprocess.Popen(
        [cli, "server", "start-dev", "--headless", "--ip", "127.0.0.1", "--port", str(port), "--log-level", "error"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        for _ in range(120):
            done = subprocess.run(
                [cli, "operator", "cluster", "health", "--address", f"127.0.0.1:{port}"],
                capture_output=True,
                check=False,
            )
            if done.returncode == 0:
                break
            subprocess.run(["sleep", "0.5"], check=True)
        else:
            pytest.fail("the Temporal dev server did not start")
        yield f"127.0.0.1:{port}", Path(cli).parent
    finally:
        server.terminate()
        server.wait(timeout=30)


def _run_namespace_step(address: str, bin_dir: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "TEMPORAL_ADDRESS": address,
        "NAMESPACE": "modelforge-test",
        "RETENTION": "24h",
        "SEARCH_ATTRIBUTES": " ".join(key.name for key in SEARCH_ATTRIBUTES),
        **env,
    }
    return subprocess.run(
        ["sh", str(DEPLOY / "temporal/setup-namespace.sh")],
        env=environ,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_namespace_step_against_a_real_server(temporal_dev_server: tuple[str, Path]) -> None:
    address, bin_dir = temporal_dev_server
    cli = str(bin_dir / "temporal")
    first = _run_namespace_step(address, bin_dir)
    assert first.returncode == 0, first.stdout + first.stderr

    def described() -> dict[str, Any]:
        out = subprocess.run(
            [cli, "operator", "namespace", "describe", "-n", "modelforge-test", "--address", address, "-o", "json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        loaded: dict[str, Any] = json.loads(out)
        return loaded

    assert described()["config"]["workflowExecutionRetentionTtl"] == "86400s"
    listed = subprocess.run(
        [cli, "operator", "search-attribute", "list", "--namespace", "modelforge-test", "--address", address],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for key in SEARCH_ATTRIBUTES:
        assert re.search(rf"^\s*{key.name}\s+Keyword\s*$", listed, re.MULTILINE), key.name
    # Again, on the namespace it made, with another retention: it is updated, nothing fails.
    again = _run_namespace_step(address, bin_dir, RETENTION="72h")
    assert again.returncode == 0, again.stdout + again.stderr
    assert described()["config"]["workflowExecutionRetentionTtl"] == "259200s"
    # A search attribute that cannot be created (a system one of another type) fails the step.
    system = "ModelForgeTenant HistoryLength"
    failed = _run_namespace_step(address, bin_dir, SEARCH_ATTRIBUTES=system, SETUP_ATTEMPTS="2")
    assert failed.returncode != 0
    assert "HistoryLength" in failed.stderr


def test_the_setup_scripts_are_posix_sh() -> None:
    shell = shutil.which("dash") or shutil.which("sh")
    assert shell is not None
    for script in sorted((DEPLOY / "temporal").glob("*.sh")):
        done = subprocess.run([shell, "-n", str(script)], capture_output=True, text=True, check=False)
        assert done.returncode == 0, f"{script.name}: {done.stderr}"
        text = script.read_text()
        assert text.startswith("#!/bin/sh\n") and "set -eu" in text, script.name
        assert "bash" not in text.split("\n", 1)[0]


# --- the Temporal SDK's worker metrics ---------------------------------------------------------------


def test_the_sdk_metrics_address_is_a_setting_with_loopback_defaults() -> None:
    assert temporal_metrics_address("control", {}) == "127.0.0.1:9465"
    assert temporal_metrics_address("node", {}) == "127.0.0.1:9466"
    assert temporal_metrics_address("node", {TEMPORAL_METRICS_ADDRESS: "0.0.0.0:9999"}) == "0.0.0.0:9999"
    assert temporal_metrics_address("control", {TEMPORAL_METRICS_ADDRESS: "off"}) is None
    from modelforge.failures import ModelForgeError

    for bad in ("9465", "localhost", "127.0.0.1:port", "127.0.0.1:70000", ":9465", "a b:1"):
        with pytest.raises(ModelForgeError, match=TEMPORAL_METRICS_ADDRESS):
            temporal_metrics_address("control", {TEMPORAL_METRICS_ADDRESS: bad})
    assert worker_runtime("control", {TEMPORAL_METRICS_ADDRESS: "off"}) is None


def _scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        text: str = answer.read().decode()
        return text


async def test_a_worker_serves_the_sdk_metrics(dev_server_env: Any, tmp_path: Path) -> None:
    from temporalio.worker import Worker

    from modelforge.settings import Settings
    from modelforge.temporal import connect

    address = f"127.0.0.1:{free_port()}"
    target = dev_server_env.client.service_client.config.target_host
    os.environ[TEMPORAL_METRICS_ADDRESS] = address
    try:  # settings read the variable when made (keywords over the environment)
        settings = Settings(temporal_address=target, payload_dir=tmp_path / "payloads")
        client = await connect(settings, worker=True, role="control")
    finally:
        del os.environ[TEMPORAL_METRICS_ADDRESS]
    async with Worker(client, task_queue="sdk-metrics", workflows=[], activities=[_noop]):
        text = ""
        for _ in range(40):
            text = await asyncio.to_thread(_scrape, address)
            if "temporal_worker_task_slots_available" in text:
                break
            await asyncio.sleep(0.25)
    assert "temporal_worker_task_slots_available" in text, text[:2000]
    assert 'modelforge_role="control"' in text
    # A second process-wide runtime on a bound address: none, the worker runs without metrics.
    assert worker_runtime("node", {TEMPORAL_METRICS_ADDRESS: address}) is not None  # this process's own
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = f"127.0.0.1:{taken.getsockname()[1]}"
        assert worker_runtime("node", {TEMPORAL_METRICS_ADDRESS: busy}) is None


def test_both_workers_connect_with_their_role() -> None:
    control = (ROOT / "workers/control.py").read_text()
    node = (ROOT / "workers/node.py").read_text()
    assert 'connect(settings, worker=True, role="control")' in control
    assert 'connect(settings, worker=True, role="node")' in node


@activity.defn
async def _noop() -> None:
    return None
