"""The port a model server or a gang's rendezvous is told to listen on: found free below the
kernel's ephemeral range, where no outgoing connection's source port can take it before the
process binds it (the parallel test run saw a gang's rank 0 fail with EADDRINUSE on a port
found free in that range a moment before)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from modelforge.runtimes import _process
from modelforge.runtimes._process import free_port


def _range(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ip_local_port_range"
    path.write_text(text)
    return path


def test_a_port_below_the_ephemeral_range_that_a_server_can_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_process, "_EPHEMERAL_RANGE", _range(tmp_path, "32768\t60999\n"))
    ports = {free_port("127.0.0.1") for _ in range(20)}
    assert all(10000 <= port < 32768 for port in ports), ports
    assert len(ports) > 1  # chosen at random: two servers starting at once rarely collide
    with socket.socket() as server:
        server.bind(("127.0.0.1", ports.pop()))
        server.listen()


@pytest.mark.parametrize("text", ["1024 65535", "", "not a range"])
def test_no_room_below_the_range_or_no_range_read_leaves_the_choice_to_the_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    monkeypatch.setattr(_process, "_EPHEMERAL_RANGE", _range(tmp_path, text))
    port = free_port("127.0.0.1")
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))
