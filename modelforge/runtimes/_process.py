"""Process trees on Linux, read from /proc: a model server may fork workers (vLLM does), and
all of them are ModelForge's, so their GPU bytes are attributed and reclaimed together."""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")


def _parent_of(pid: int) -> int | None:
    try:
        stat = (_PROC / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # The command name may hold spaces and parentheses: the fields after the last ')' are fixed.
    fields = stat.rsplit(")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 else None


def process_tree(root: int) -> set[int]:
    """`root` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            parent = _parent_of(int(entry.name))
            if parent is not None:
                children.setdefault(parent, []).append(int(entry.name))
    tree = {root}
    frontier = [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in tree:
                tree.add(child)
                frontier.append(child)
    return tree


def rss_bytes(pids: set[int]) -> int:
    """Resident memory of these processes (what a model on the host CPU holds)."""
    total = 0
    for pid in sorted(pids):
        try:
            for line in (_PROC / str(pid) / "status").read_text(encoding="ascii", errors="replace").splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
                    break
        except OSError:
            continue
    return total


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes: it holds no memory and answers nothing.
    try:
        state = (_PROC / str(pid) / "stat").read_text(encoding="ascii", errors="replace").rsplit(")", 1)[-1].split()
        return not state or state[0] != "Z"
    except OSError:
        return False
