"""An ASGI app served by uvicorn on a free loopback port, on the test's event loop. A helper
module: tests import it, never each other."""

from __future__ import annotations

import asyncio

import uvicorn
from fastapi import FastAPI


async def serve_app(app: FastAPI) -> tuple[uvicorn.Server, asyncio.Task[None], int]:
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, task, port
