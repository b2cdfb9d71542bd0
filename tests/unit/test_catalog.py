"""Catalog files: the example loads; bad files fail with the field and the value named."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelforge.catalog import CatalogError, example_catalog_path, load_catalog_file, parse_catalog
from modelforge.domain import GiB, Priority, Residency


def test_example_catalog_is_the_seed_m5_installation() -> None:
    catalog, external = load_catalog_file(example_catalog_path())
    gpu = catalog.accelerator("gpu-node/0")
    desktop = catalog.accelerator("desktop/0")
    assert gpu is not None and gpu.total_bytes == 24 * GiB and gpu.production_eligible
    assert desktop is not None and not desktop.production_eligible
    [ollama] = external
    assert (ollama.accelerator, ollama.bytes, ollama.name) == ("gpu-node/0", 6 * GiB, "ollama")
    embedding = catalog.deployment_for("rag.embedding@1")
    assert embedding is not None
    assert (
        embedding.envelope_bytes,
        embedding.residency,
        embedding.ttl_s,
        embedding.concurrency,
        embedding.queue_limit,
    ) == (1_216_348_160, Residency.KEEP_WARM, 901, 1, 16)
    assert any(d.residency == Residency.LOAD_ON_DEMAND for d in catalog.deployments)
    shadow = catalog.tenant("rag-shadow")
    assert shadow is not None and shadow.max_priority == Priority.BACKGROUND


ACC = {"id": "n/0", "node": "n", "total_bytes": 8 * GiB}
DEP = {"capability": "x@1", "envelope_bytes": GiB}


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"accelerators": [{**ACC, "total_bytes": -5}]}, "accelerators.0.total_bytes"),
        ({"accelerators": [{**ACC, "total_bytes": "lots"}]}, "'lots'"),
        ({"accelerators": [ACC], "deployments": [{**DEP, "envelope_bytes": 0}]}, "deployments.0.envelope_bytes"),
        ({"deployments": [{**DEP, "residency": "forever"}]}, "deployments.0.residency"),
        ({"deployments": [{**DEP, "residency": "lab_only"}]}, "reserved for later"),
        ({"deployments": [{**DEP, "capability": "x; rm -rf /"}]}, "deployments.0.capability"),
        ({"deployments": [{**DEP, "surprise": 1}]}, "deployments.0.surprise"),
        ({"accelerators": [ACC, ACC]}, "duplicate 'n/0'"),
        ({"accelerators": [{**ACC, "kind": "cpu", "production_eligible": True}]}, "never production eligible"),
        ({"accelerators": [ACC], "deployments": [{**DEP, "accelerators": ["nope/0"]}]}, "unknown accelerator"),
        (
            {"tenants": [{"name": "t", "default_priority": "production", "max_priority": "background"}]},
            "tenants[0].default_priority",
        ),
        ({"external": [{"accelerator": "ghost/0", "bytes": 1}]}, "external[0].accelerator"),
    ],
)
def test_invalid_catalogs_name_the_field(data: dict[str, object], fragment: str) -> None:
    with pytest.raises(CatalogError) as raised:
        parse_catalog(data)
    assert fragment in raised.value.message
    assert raised.value.failure.value == "REQUEST_INVALID"


def test_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="not found"):
        load_catalog_file(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[accelerators]\nid=")
    with pytest.raises(CatalogError, match="not valid TOML"):
        load_catalog_file(broken)
