"""Process trees on Linux, read from /proc: a model server may fork workers (vLLM does), and
all of them are ModelForge's, so their GPU bytes are attributed and reclaimed together."""

from __future__ import annotations

import os
import random
import socket
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


# Ports handed to a process that binds them a moment later (a model server, a gang's rendezvous)
# are chosen below the kernel's ephemeral range: a port in that range found free can be taken as
# the source port of any outgoing connection on the host before the process binds it
# (EADDRINUSE); one below it only by another explicit bind.
_EPHEMERAL_RANGE = _PROC / "sys" / "net" / "ipv4" / "ip_local_port_range"
_LOWEST_PORT = 10000
_PORT_TRIES = 64


def free_port(address: str) -> int:
    """A port free on `address` now, for a process to listen on: one below the ephemeral range
    where the host leaves room for it (tried at random), else one the kernel gives."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        ephemeral_from = int(_EPHEMERAL_RANGE.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = 0
    candidates = range(_LOWEST_PORT, ephemeral_from)
    for _ in range(_PORT_TRIES if len(candidates) > _PORT_TRIES else 0):
        port = random.choice(candidates)
        with socket.socket(family) as probe:
            try:
                probe.bind((address, port))
            except OSError:
                continue
            return port
    with socket.socket(family) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])
