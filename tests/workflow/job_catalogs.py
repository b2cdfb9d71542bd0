"""The job catalogs the workflow and gateway job tests run against. A helper module: tests
import it, never each other."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MERGE = ROOT / "examples" / "jobs" / "merge_slerp.py"


def catalog_for_test(tmp_path: Path) -> Path:
    """The example catalog with the script's absolute path (its `cwd = "."` is the checkout's
    root when a stack is started there; a test may run from anywhere) and a 1 s preemption grace."""
    text = (ROOT / "examples" / "jobs" / "merge.toml").read_text()
    text = text.replace('"examples/jobs/merge_slerp.py"', f'"{MERGE}"').replace('cwd = ".", ', "")
    text = text.replace('preempt_grace_s = "10"', 'preempt_grace_s = "1"')  # a quick kill when ignored
    path = tmp_path / "merge.toml"
    path.write_text(text)
    return path
