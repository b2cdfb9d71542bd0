"""Waiting for what a test expects, bounded. A helper module: tests import it, never each other."""

from __future__ import annotations

import asyncio
import time
from typing import Any


async def until(probe: Any, within_s: float) -> Any:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.3)
    return await probe()
