"""Every Temporal name the code calls by string exists where it is called: activities a workflow
schedules are registered by some worker, and the signals, updates and queries sent to workflows
are handled by one of ModelForge's workflows. A renamed handler, or a typo in a call, fails here
rather than as a task retried forever (an unknown activity) or a signal dropped (an unknown
signal) in production."""

from __future__ import annotations

import ast
from pathlib import Path

import temporalio.workflow

from workflows import ALL_WORKFLOWS

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [p for d in ("workflows", "activities", "modelforge", "workers") for p in (ROOT / d).rglob("*.py")]
ACTIVITY_CALLS = {"execute_activity", "start_activity", "execute_local_activity", "start_local_activity"}
MESSAGE_CALLS = {"signal": "signals", "execute_update": "updates", "start_update": "updates", "query": "queries"}


def _calls() -> list[tuple[str, str, str]]:
    """(kind of call, name, where) for every call that names its target by a string literal."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            first = node.args[0]
            if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if node.func.attr in ACTIVITY_CALLS:
                found.append(("activity", first.value, where))
            elif node.func.attr in MESSAGE_CALLS:
                found.append((MESSAGE_CALLS[node.func.attr], first.value, where))
    return found


def _registered_activities() -> set[str]:
    """Every activity name defined in the code (`@activity.defn(name=...)` or the function's)."""
    names = set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for decorator in node.decorator_list:
                call = decorator if isinstance(decorator, ast.Call) else None
                target = call.func if call else decorator
                if (
                    isinstance(target, ast.Attribute)
                    and target.attr == "defn"
                    and getattr(target.value, "id", "") == "activity"
                ):
                    named = [k.value.value for k in (call.keywords if call else []) if k.arg == "name"]
                    names.add(named[0] if named else node.name)
    return names


def _handlers() -> dict[str, set[str]]:
    handlers: dict[str, set[str]] = {"signals": set(), "updates": set(), "queries": set()}
    for cls in ALL_WORKFLOWS:
        definition = temporalio.workflow._Definition.must_from_class(cls)
        handlers["signals"] |= {n for n in definition.signals if n}
        handlers["updates"] |= {n for n in definition.updates if n}
        handlers["queries"] |= {n for n in definition.queries if n}
    return handlers


def test_every_activity_a_workflow_calls_is_defined() -> None:
    defined = _registered_activities()
    calls = [(name, where) for kind, name, where in _calls() if kind == "activity"]
    assert len(calls) >= 10, "the scan found too few activity calls: it no longer reads the code"
    missing = [(name, where) for name, where in calls if name not in defined]
    assert not missing, f"activities called but defined nowhere: {missing}"


def test_every_signal_update_and_query_sent_is_handled_by_a_workflow() -> None:
    handlers = _handlers()
    calls = [(kind, name, where) for kind, name, where in _calls() if kind != "activity"]
    assert {kind for kind, _, _ in calls} >= {"signals", "updates", "queries"}
    missing = [(kind, name, where) for kind, name, where in calls if name not in handlers[kind]]
    assert not missing, f"sent but handled by no workflow: {missing}"
