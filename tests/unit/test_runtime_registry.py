"""The runtime registry (modelforge/runtimes/_registry.py): the catalog validates `runtime`
through it, and a node builds every runtime it lists."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from modelforge.catalog import CatalogError, CatalogFile, parse_catalog
from modelforge.domain import Deployment, GiB
from modelforge.failures import FailureClass
from modelforge.gpu import NodeDevices, SimulatedDevice, SimulatedGpuBackend
from modelforge.runtimes import RUNTIMES, Speaks, build_runtimes, runtime_names, speaks
from modelforge.runtimes._http_api import API_NAMES

ACC = {"id": "gpu-node/0", "node": "gpu-node", "total_bytes": 24 * GiB}
# A deployment each registered runtime accepts. A new runtime adds its own: the test below
# fails until it does.
VALID: dict[str, dict[str, Any]] = {
    "simulated": {},
    "subprocess_http": {"command": ["server", "--port", "{port}"], "runtime_config": {"api": "openai_chat"}},
    "subprocess_job": {"command": ["python", "train.py"]},
    "sentence_transformers": {"runtime_config": {"dimensions": "384"}},
}


def _catalog(runtime: str, **deployment: Any) -> dict[str, Any]:
    dep = {"capability": "x@1", "envelope_bytes": GiB, "runtime": runtime, **deployment}
    return {"accelerators": [ACC], "deployments": [dep]}


def test_an_unknown_runtime_is_refused_naming_the_known_ones() -> None:
    with pytest.raises(CatalogError) as caught:
        parse_catalog(_catalog("vllm"))
    assert caught.value.failure is FailureClass.REQUEST_INVALID
    message = caught.value.message
    assert "deployments.0.runtime" in message and "unknown runtime 'vllm'" in message
    assert f"(known: {', '.join(RUNTIMES)})" in message
    for bad in ("", 7):
        with pytest.raises(CatalogError, match=r"deployments\.0\.runtime"):
            parse_catalog(_catalog(bad))  # type: ignore[arg-type]


def test_the_catalog_schema_lists_the_registered_runtimes() -> None:
    schema = CatalogFile.model_json_schema()
    assert schema["$defs"]["DeploymentSpec"]["properties"]["runtime"]["enum"] == list(RUNTIMES)


@pytest.mark.parametrize("name", list(RUNTIMES))
def test_every_registered_runtime_builds_on_a_node_and_validates_its_config(name: str, tmp_path: Path) -> None:
    assert set(VALID) == set(RUNTIMES), "give each registered runtime a valid deployment in VALID"
    spec = RUNTIMES[name]
    backend = SimulatedGpuBackend([SimulatedDevice(0, "GPU-sim-0", "sim", 24 * GiB)])
    runtimes = build_runtimes(NodeDevices(backend), tmp_path, "gpu-node")
    assert runtimes[name].name == name
    catalog, _ = parse_catalog(_catalog(name, **VALID[name]))
    [deployment] = catalog.deployments
    assert deployment.runtime == name
    if spec.config is not None:
        spec.config(deployment)  # the same check the node makes at load
        unknown_option = {**VALID[name].get("runtime_config", {}), "no_such_option": "1"}
        with pytest.raises(CatalogError, match=rf"runtime_config\.no_such_option: unknown for {name}"):
            parse_catalog(_catalog(name, **{**VALID[name], "runtime_config": unknown_option}))
    if spec.runs_command:
        with pytest.raises(CatalogError, match=f"{name} needs `command`"):
            parse_catalog(_catalog(name, **{**VALID[name], "command": []}))
    else:
        runners = " and ".join(runtime_names(lambda other: other.runs_command))
        with pytest.raises(CatalogError, match=f"command: only {runners} run a command, not {name}"):
            parse_catalog(_catalog(name, **VALID[name], command=["server"]))
    if not spec.env_from_secrets:
        with pytest.raises(CatalogError, match=f"env_from_secrets: only subprocess_http .* not {name}"):
            parse_catalog(_catalog(name, **VALID[name], env_from_secrets={"HF_TOKEN": "hf_token"}))


def test_a_node_on_real_cards_builds_no_simulated_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(NodeDevices, "simulated_gpus", property(lambda self: False))
    devices = NodeDevices(SimulatedGpuBackend([SimulatedDevice(0, "GPU-0", "real", 24 * GiB)]))
    built = build_runtimes(devices, tmp_path, "gpu-node")
    assert set(built) == {name for name, spec in RUNTIMES.items() if not spec.simulated_only}
    assert "simulated" not in built


def test_the_deployment_default_runtime_is_registered() -> None:
    assert Deployment(capability="x@1", envelope_bytes=GiB).runtime in RUNTIMES


def _modules_after(code: str) -> list[str]:
    probe = f"import json, sys\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return list(json.loads(done.stdout.strip().splitlines()[-1]))


def test_the_catalog_uses_the_policy_public_api_and_the_cli_imports_no_worker() -> None:
    catalog_source = Path(__file__).parents[2].joinpath("modelforge", "catalog.py").read_text(encoding="utf-8")
    assert "modelforge.policy._" not in catalog_source
    cli_modules = _modules_after("import modelforge.cli")
    assert not [m for m in cli_modules if m.split(".")[0] in ("workers", "workflows", "activities")]
    # The registry is read when a catalog is, not when the catalog module is imported.
    assert "modelforge.runtimes" not in _modules_after("import modelforge.catalog")


@pytest.mark.parametrize("name", list(RUNTIMES))
def test_every_registered_runtime_says_what_it_speaks(name: str) -> None:
    """The gateway decides by `speaks` (the registry's entry), never by a runtime's name."""
    catalog, _ = parse_catalog(_catalog(name, **VALID[name]))
    [deployment] = catalog.deployments
    said = speaks(deployment)
    assert isinstance(said, Speaks)
    assert said.api is None or said.api in API_NAMES
    assert said.answers and said.answers <= {"text", "vectors", "scores"}
    assert said.job == RUNTIMES[name].job


def test_what_an_http_server_speaks_follows_its_api() -> None:
    for api, answers in (
        ("openai_chat", {"text"}),
        ("openai_embeddings", {"vectors"}),
        ("tei_embed", {"vectors"}),
        ("rerank", {"scores"}),
    ):
        config = {**VALID["subprocess_http"], "runtime_config": {"api": api}}
        [deployment] = parse_catalog(_catalog("subprocess_http", **config))[0].deployments
        # Only a chat server takes a prompt as it is (its completions route: raw, fill-in-the-middle).
        assert speaks(deployment) == Speaks(api, frozenset(answers), raw_prompt=api == "openai_chat")
    [default] = parse_catalog(_catalog("subprocess_http", command=["server"]))[0].deployments
    assert speaks(default).api == "openai_embeddings"


def test_the_gateway_compares_no_runtime_name() -> None:
    """No runtime name as a string of its own in modelforge/gateway/*.py, and no comparison with
    a deployment's `runtime`: adding a runtime touches the registry only. (Prose in messages and
    docstrings may still name one.)"""
    found = []
    for path in sorted(Path(__file__).parents[2].joinpath("modelforge", "gateway").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in RUNTIMES:
                found.append(f"{path.name}:{node.lineno}: {node.value!r}")
            if isinstance(node, ast.Compare):
                sides = [node.left, *node.comparators]
                if any(isinstance(side, ast.Attribute) and side.attr == "runtime" for side in sides):
                    found.append(f"{path.name}:{node.lineno}: compares .runtime")
    assert not found, found
