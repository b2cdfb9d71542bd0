"""The gateway's HTTP server: uvicorn with the limits a server facing untrusted clients needs.

uvicorn has no timeout for a request's headers: a client that opens a connection and sends its
headers a byte at a time (slowloris) holds the connection for ever, since every byte re-arms
nothing and the keep-alive timer only runs between requests. `_HeaderDeadline` closes a
connection whose request line and headers are not complete `header_timeout_s` after it opened
(or after the previous response on a kept-alive connection). The body's own deadline is the
application's (`GatewayConfig.body_timeout_s`, answered 408).

MODELFORGE_LOG_LEVEL (debug, info, warning, error) sets the level of the gateway's structured log,
its access log included (`_observe.py`)."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from modelforge.gateway._observe import log_level_from_env
from modelforge.logging import configure

if TYPE_CHECKING:
    from temporalio.client import Client

    from modelforge.settings import Settings

# Seconds a client has for its request line and headers.
HEADER_TIMEOUT_S = 10.0
# Seconds an idle kept-alive connection is held open between requests.
KEEP_ALIVE_S = 5
# Bytes of a request line and headers (h11's own limit; past it the client gets 400).
MAX_HEADER_BYTES = 16 * 1024


class _HeaderDeadline(H11Protocol):
    header_timeout_s = HEADER_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_after: object = None

    def _arm(self) -> None:
        self._disarm()
        self._waiting_after = self.cycle  # a new request replaces it
        self._deadline = self.loop.call_later(self.header_timeout_s, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self) -> None:
        self._deadline = None
        if self.cycle is self._waiting_after and not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._deadline is not None and self.cycle is not self._waiting_after:
            self._disarm()  # the headers are in: the application's body deadline takes over

    def on_response_complete(self) -> None:
        finished = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is finished:
            self._arm()  # kept alive: the next request's headers have their own deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def gateway_server(
    app: FastAPI,
    host: str,
    port: int,
    *,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    keep_alive_s: int = KEEP_ALIVE_S,
    log_level: str = "warning",
) -> uvicorn.Server:
    """A uvicorn server for the gateway app with header and keep-alive timeouts and a header
    size limit. `await server.serve()` runs it; `server.should_exit = True` stops it. With
    MODELFORGE_LOG_LEVEL set, the process's structured log takes that level (REQUEST_INVALID for
    a level that is not one), and uvicorn's own log follows it at debug."""
    if os.environ.get("MODELFORGE_LOG_LEVEL"):
        level = log_level_from_env()
        configure(level)
        if level == logging.DEBUG:
            log_level = "debug"
    protocol = type("GatewayHttpProtocol", (_HeaderDeadline,), {"header_timeout_s": header_timeout_s})
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol,
        timeout_keep_alive=keep_alive_s,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        log_level=log_level,
        lifespan="off",
    )
    return uvicorn.Server(config)


async def run_gateway(
    settings: Settings,
    database_url: str,
    host: str,
    port: int,
    keys: dict[str, str],
    pool: str | None = None,
    *,
    temporal: Client | None = None,
    announce: Callable[[str], None] | None = None,
) -> None:
    """The gateway on `host:port` until cancelled: the catalog from the store at `database_url`,
    requests through a `ModelForgeClient` on `temporal` (its own connection when None). What
    `modelforge gateway` runs, and `modelforge worker node --gateway-port` in the node worker's
    process on the node's own client, where a request routed to this node starts eagerly (the
    server hands its first workflow task back in the start's reply, to this node's worker)."""
    from modelforge.client import ModelForgeClient
    from modelforge.gateway._app import GatewayConfig, create_app
    from modelforge.store import Store

    store = await Store.open(database_url)
    try:
        # Routing reads the catalog when a pool's scheduler is slow to answer (routing.py).
        if temporal is None:
            client = await ModelForgeClient.connect(settings, pool, catalog=store.load_catalog)
        else:
            client = ModelForgeClient(temporal, pool, catalog=store.load_catalog)
        app = create_app(client, store.load_catalog, GatewayConfig(api_keys=keys))
        server = gateway_server(app, host, port)  # header-read deadline, keep-alive and header limits
        if announce is not None:
            announce(
                f"gateway on http://{host}:{port} ({f'pool {pool}' if pool else 'routing among pools'}; "
                f"{'API keys required' if keys else 'no API keys: tenant from X-ModelForge-Tenant'})"
            )
        await server.serve()
    finally:
        await store.close()
