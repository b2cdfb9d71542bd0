"""Residency on demand on the command line: `modelforge load | unload | pin | unpin DEPLOYMENT
[--accelerator A] [--drain]`, through the pool scheduler (recorded as events; a refusal is typed
and exits 1). modelforge/cli.py imports this module, which adds its commands to the app."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from modelforge.cli_common import JsonOption, _fail, _json, _run, _settings, app, out
from modelforge.failures import FailureClass, ModelForgeError

Deployment = Annotated[str, typer.Argument(help="A deployment id or a capability (e.g. chat.small@1).")]
Accelerator = Annotated[str, typer.Option(help="Only the resident on this accelerator (e.g. gpu-node/0).")]
Pool = Annotated[str | None, typer.Option(help="Only this pool (default: each pool in turn until one acts).")]
Tenant = Annotated[str, typer.Option(help="Whose class a load is admitted at (its default class).")]


def _control(
    action: str, deployment: str, accelerator: str, drain: bool, pool: str | None, tenant: str, as_json: bool
) -> None:
    from modelforge.client import ModelForgeClient
    from modelforge.identifiers import identifier_problem

    problem = identifier_problem("capability", deployment) or identifier_problem("tenant", tenant)
    if problem is not None:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, problem), 1)
    settings = _settings()

    async def go() -> object:
        client = await ModelForgeClient.connect(settings, pool)
        try:
            return await client.residency(
                action, deployment, accelerator=accelerator, drain=drain, tenant=tenant, actor="modelforge CLI"
            )
        except ModelForgeError as refused:
            return refused

    reply = _run(go)
    if isinstance(reply, ModelForgeError):
        _fail(reply, 1)  # refused, as a refused request exits
    if as_json:
        _json(reply)
        return
    out.print(escape(str(getattr(reply, "message", reply))), highlight=False, soft_wrap=True)


LoadAccelerator = Annotated[
    str,
    typer.Option(
        "--accelerator",
        help="Load on this accelerator now, or be refused (no room, a card it may not use) and change nothing.",
    ),
]


@app.command("load")
def load(
    deployment: Deployment,
    accelerator: LoadAccelerator = "",
    pool: Pool = None,
    tenant: Tenant = "default",
    as_json: JsonOption = False,
) -> None:
    """Load a deployment now, before any request asks for it.

    It is placed and admitted like a request of the tenant's class, and then stays by its residency.
    With --accelerator it loads on that card now or is refused, typed, making no room.
    """
    _control("load", deployment, accelerator, False, pool, tenant, as_json)


@app.command("unload")
def unload(
    deployment: Deployment,
    accelerator: Accelerator = "",
    drain: Annotated[
        bool, typer.Option(help="With active leases: take no new one and unload when the last ends.")
    ] = False,
    pool: Pool = None,
    as_json: JsonOption = False,
) -> None:
    """Unload a resident model now; with active leases it is refused (EVICTION_NOT_ALLOWED) unless --drain."""
    _control("unload", deployment, accelerator, drain, pool, "default", as_json)


@app.command("pin")
def pin(deployment: Deployment, accelerator: Accelerator = "", pool: Pool = None, as_json: JsonOption = False) -> None:
    """Keep a resident model loaded (never evicted, no TTL) until it is unpinned."""
    _control("pin", deployment, accelerator, False, pool, "default", as_json)


@app.command("unpin")
def unpin(
    deployment: Deployment, accelerator: Accelerator = "", pool: Pool = None, as_json: JsonOption = False
) -> None:
    """Give a pinned model back to its catalog residency (its TTL counts from now)."""
    _control("unpin", deployment, accelerator, False, pool, "default", as_json)
