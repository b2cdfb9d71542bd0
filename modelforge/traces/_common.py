"""Writing a converted scenario: `scenario.toml` (catalog tables and `[requests] path`) and
`requests.jsonl`, one request a line."""

from __future__ import annotations

import json
import math
from pathlib import Path

from modelforge.failures import FailureClass, ModelForgeError


class TraceError(ModelForgeError):
    def __init__(self, message: str) -> None:
        super().__init__(FailureClass.REQUEST_INVALID, message)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TraceError(f"cannot write {value} to TOML")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise TraceError(f"cannot write {type(value).__name__} to TOML")


def to_toml(document: dict[str, object]) -> str:
    """The small TOML subset scenarios use: tables and arrays of tables of scalars and lists."""
    lines: list[str] = []
    for name, content in document.items():
        if isinstance(content, dict):
            lines.append(f"[{name}]")
            lines.extend(f"{k} = {_value(v)}" for k, v in content.items())
            lines.append("")
        elif isinstance(content, list):
            for item in content:
                lines.append(f"[[{name}]]")
                lines.extend(f"{k} = {_value(v)}" for k, v in item.items())
                lines.append("")
        else:
            lines.append(f"{name} = {_value(content)}")
    return "\n".join(lines)


def write_scenario(out_dir: Path, scenario: dict[str, object], requests: list[dict[str, object]], header: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    requests_path = out_dir / "requests.jsonl"
    with requests_path.open("w", encoding="utf-8") as handle:
        for request in requests:
            handle.write(json.dumps(request, separators=(",", ":")) + "\n")
    document = {**scenario, "requests": {"path": requests_path.name}}
    scenario_path = out_dir / "scenario.toml"
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    scenario_path.write_text(comment + "\n" + to_toml(document), encoding="utf-8")
    return scenario_path
