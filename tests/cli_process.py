"""The `modelforge` CLI run as a user runs it, in a process of its own, by tests that also run a
stack on their event loop. A helper module: tests import it, never each other."""

from __future__ import annotations

import asyncio


async def run_cli(argv: list[str], env: dict[str, str], timeout_s: float) -> tuple[int, str, str]:
    """The CLI as a subprocess, without blocking the loop the stack's workers run on."""
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
    )
    try:
        out, errors = await asyncio.wait_for(process.communicate(), timeout_s)
    except TimeoutError:
        # Killed, so that its pipes close and the failure says what it was doing.
        process.kill()
        out, errors = await process.communicate()
        raise AssertionError(
            f"{argv[2:]} did not finish in {timeout_s:g} s:\n{out.decode()[-2000:]}\n{errors.decode()[-4000:]}"
        ) from None
    return process.returncode or 0, out.decode(), errors.decode()
