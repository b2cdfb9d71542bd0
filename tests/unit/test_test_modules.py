"""Test modules share code through helper modules (tests/gateway/serving.py, tests/runtimes/jobs.py,
tests/cli_process.py, ...), never by importing each other: a test module imported by another is
a helper nobody can find by its name, its fixtures leak into the importer, and running one test
file runs the other's module code too."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _test_module_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [name for name in names if name.startswith("tests.") and name.rsplit(".", 1)[-1].startswith("test_")]
    return found


def test_no_test_module_imports_another() -> None:
    offenders = {
        str(path.relative_to(TESTS)): imported
        for path in sorted(TESTS.rglob("*.py"))
        if (imported := _test_module_imports(path))
    }
    assert not offenders, f"move what they share into a helper module (no test_ prefix): {offenders}"


def test_the_check_sees_both_import_forms(tmp_path: Path) -> None:
    module = tmp_path / "test_x.py"
    module.write_text("from tests.gateway.test_gateway import CATALOG\nimport tests.unit.test_queues\n")
    assert _test_module_imports(module) == ["tests.gateway.test_gateway", "tests.unit.test_queues"]
    module.write_text("from tests.gateway.serving import CATALOG\nfrom modelforge.test_x import y\n")
    assert _test_module_imports(module) == []
