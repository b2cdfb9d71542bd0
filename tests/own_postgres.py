"""A Postgres server of a test's own (pgserver), to stop and start without touching any other
test's, and whether a URL answers. A helper module: tests import it, never each other."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest


class OwnPostgres:
    """An embedded server of this test's own, so stopping it touches no other test."""

    def __init__(self, pgdata: Path) -> None:
        import pgserver

        self._pgserver = pgserver
        self.server = pgserver.get_server(str(pgdata), cleanup_mode="stop")

    def stop(self) -> None:
        self._pgserver.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=self.server.pgdata, user=self.server.system_user)

    def start(self) -> None:
        self.server.ensure_postgres_running()


@pytest.fixture
def outage_postgres(tmp_path: Path) -> Iterator[OwnPostgres]:
    postgres = OwnPostgres(tmp_path / "pg")
    try:
        yield postgres
    finally:
        postgres.server.cleanup()


def reachable(url: str) -> bool:
    try:
        with psycopg.connect(url, connect_timeout=2):
            return True
    except psycopg.OperationalError:
        return False
