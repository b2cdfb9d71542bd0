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


RECORDINGS = Path(__file__).resolve().parents[2] / "data" / "nvidia-smi"


def test_external_usage_can_come_from_a_real_recording(tmp_path: Path) -> None:
    # A T4 recording: 388 MiB driver-reserved, 5 MiB no process accounts for, and two processes
    # (22 and 1,005 MiB): four unmanaged entries, 1,420 MiB in all.
    (tmp_path / "t4.xml").write_bytes((RECORDINGS / "tesla-t4.xml").read_bytes())
    (tmp_path / "c.toml").write_text(
        '[[accelerators]]\nid = "n/0"\nnode = "n"\ntotal_bytes = 16106127360\n'
        '[[external]]\naccelerator = "n/0"\nrecording = "t4.xml"\nstart_s = 5\n'
    )
    _, external = load_catalog_file(tmp_path / "c.toml")
    assert sum(e.bytes for e in external) == 1420 * 1024**2
    assert [e.name for e in external][:2] == ["driver reserved (recorded)", "unattributed (recorded)"]
    assert {e.start_s for e in external} == {5.0}


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ('bytes = 10\nrecording = "t4.xml"', "give bytes or recording, not both"),
        ("", "give bytes or recording, not neither"),
        ('recording = "missing.xml"', "external[0].recording: recording not found"),
    ],
)
def test_bad_recorded_external_usage_is_refused_naming_the_field(tmp_path: Path, entry: str, fragment: str) -> None:
    (tmp_path / "c.toml").write_text(
        '[[accelerators]]\nid = "n/0"\nnode = "n"\ntotal_bytes = 16106127360\n'
        f'[[external]]\naccelerator = "n/0"\n{entry}\n'
    )
    with pytest.raises(CatalogError) as error:
        load_catalog_file(tmp_path / "c.toml")
    assert fragment in error.value.message
