"""Why a request waits and until when, on the command line, from the one verdict source
(modelforge/verdicts.py):

    modelforge queue [--pool P] [--json]     every waiting request: position, reason, ETA
    modelforge why REQUEST_ID [--json]       one request's verdict, with who holds what it needs
    modelforge request CAP ... --dry-run     now / later (ETA) / never (class and why); nothing runs

modelforge/cli.py imports this module, which adds its commands to the app (and `request`
calls `dry_run` for --dry-run)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from modelforge.cli_common import (
    JsonOption,
    PoolOption,
    _compact_table,
    _fail,
    _run,
    _settings,
    _table_console,
    app,
    out,
    short_bytes,
)
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.policy import AdmissionCheck, Verdict


def _eta(verdict: Verdict) -> str:
    """The queue table's ETA cell: an estimate, or a bound marked `<=` / `>=`."""
    if verdict.eta_s is not None:
        text = _short(verdict.eta_s)
    elif verdict.eta_at_most_s is not None:
        text = f"<={_short(verdict.eta_at_most_s)}"
    elif verdict.eta_at_least_s is not None:
        text = f">={_short(verdict.eta_at_least_s)}"
    else:
        return "?"
    return f"{text} {verdict.eta_basis}/{verdict.eta_quality}"


def _short(seconds: float) -> str:
    return (
        f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"
    )


def _waited(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}m"


def render_queue(verdicts: list[Verdict]) -> None:
    """An squeue-like table: one line per waiting request, in each pool's queue order."""
    table = _compact_table(f"{len(verdicts)} waiting")
    for column in ("pool", "request", "tenant", "class", "pos", "deployment", "waited", "reason", "eta"):
        table.add_column(column, no_wrap=True)
    table.add_column("why", overflow="fold")
    for v in verdicts:
        table.add_row(
            escape(v.pool),
            escape(v.request_id),
            escape(v.tenant),
            escape(v.priority),
            f"{v.position_in_class}/{v.class_depth}",
            escape(f"{v.deployment} {v.position_in_deployment}/{v.deployment_depth}"),
            _waited(v.waited_s),
            v.reason,
            _eta(v),
            escape(v.message[:160] or "not yet decided"),
        )
    _table_console().print(table)


# What a verdict's bound rests on, by its basis (modelforge/policy/_verdicts.py): `why` says it.
_BOUND_WHY = {
    "queue_service": (
        "the max_duration of the running work and of the requests ahead bound it, unless a higher class "
        "arrives; nothing measured estimates its slot"
    ),
    "reservation": "the gang's reservation, from its holders' max_duration, and its load",
    "load_in_flight": "the load's end, then a slot held by work whose service was never measured",
    "gang_release": "when enough cards are free; room freed may go to others first",
}


def render_why(verdict: Verdict) -> None:
    lines = [
        f"{verdict.request_id} waits in pool {verdict.pool} for {verdict.capability} ({verdict.deployment}), "
        f"{verdict.tenant}, class {verdict.priority}, for {_waited(verdict.waited_s)}",
        f"position: {verdict.position_in_class} of {verdict.class_depth} in {verdict.priority}; "
        f"{verdict.position_in_deployment} of {verdict.deployment_depth} for {verdict.deployment}"
        + (
            f"; behind {verdict.ahead_in_higher_classes} of a higher class ({verdict.behind_class})"
            if verdict.behind_class
            else ""
        ),
        f"reason: {', '.join(verdict.reasons)}: {verdict.message or 'not yet decided'}",
    ]
    if verdict.load is not None:
        lines.append(
            f"load in flight: {verdict.load.resident_key} ({verdict.load.phase}), expected to end in "
            f"{max(0.0, verdict.load.expected_end_at - verdict.computed_at):.0f} s ({verdict.load.basis})"
        )
    for holder in verdict.held_by:
        ends = (
            "" if holder.ends_at is None else f", ends in about {max(0.0, holder.ends_at - verdict.computed_at):.0f} s"
        )
        lines.append(f"held on {holder.accelerator}: {short_bytes(holder.bytes)} {holder.kind} {holder.who}{ends}")
    bound = _BOUND_WHY.get(verdict.eta_basis, "a bound, nothing measured to estimate it")
    if verdict.eta_at_most_s is not None:
        lines.append(f"eta: at most {verdict.eta_at_most_s:.0f} s ({verdict.eta_basis}: {bound})")
    elif verdict.eta_at_least_s is not None:
        lines.append(f"eta: at least {verdict.eta_at_least_s:.0f} s ({verdict.eta_basis}: {bound})")
    elif verdict.eta_s is None:
        lines.append("eta: unknown (nothing measured to base it on)")
    else:
        samples = f", {verdict.eta_samples} service samples" if verdict.eta_samples else ""
        lines.append(f"eta: {verdict.eta_s:.0f} s ({verdict.eta_basis}, {verdict.eta_quality}{samples})")
    if verdict.starts_after_expiry:
        lines.append(
            f"expires in {max(0.0, verdict.expires_at - verdict.computed_at):.0f} s, before that: unless the "
            "queue moves faster than expected, it is refused then"
        )
    for line in lines:
        out.print(escape(line), highlight=False, soft_wrap=True)


@app.command("queue")
def queue(
    pool: PoolOption = None,
    tenant: Annotated[str, typer.Option(help="Only this tenant's.")] = "",
    as_json: JsonOption = False,
) -> None:
    """Every waiting request: its position, why it waits and when it should start."""
    from modelforge.client import ModelForgeClient
    from modelforge.identifiers import identifier_problem
    from modelforge.verdicts import pool_verdicts

    problem = identifier_problem("tenant", tenant) if tenant else None
    if problem is not None:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, problem), 1)
    settings = _settings()

    async def go() -> list[Verdict]:
        return await pool_verdicts(await ModelForgeClient.connect(settings, pool), pool, tenant=tenant)

    found = _run(go)
    if as_json:
        _print_json([v.to_json() for v in found])
        return
    render_queue(found)


@app.command("why")
def why(
    request_id: Annotated[
        str, typer.Argument(help="The request's id (modelforge request --request-id, or its answer).")
    ],
    pool: PoolOption = None,
    as_json: JsonOption = False,
) -> None:
    """Why a request waits: position, the policy's reason, who holds what it needs, and its ETA.
    Exit 1 when no pool has it waiting (not admitted yet, already running or done)."""
    from modelforge.client import ModelForgeClient
    from modelforge.identifiers import identifier_problem
    from modelforge.verdicts import request_verdict

    problem = identifier_problem("request_id", request_id)
    if problem is not None:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, problem), 1)
    settings = _settings()

    async def go() -> Verdict | None:
        return await request_verdict(await ModelForgeClient.connect(settings, pool), request_id, pool=pool)

    found = _run(go)
    if found is None:
        if as_json:
            _print_json({"request_id": request_id, "state": "not_waiting"})
        else:
            out.print(
                escape(f"{request_id} is not waiting in any pool (not admitted yet, running, or done)"),
                highlight=False,
                soft_wrap=True,
            )
        raise typer.Exit(1)
    if as_json:
        _print_json(found.to_json())
        return
    render_why(found)


def dry_run(
    capability: str,
    *,
    tenant: str,
    priority: str | None,
    queue: str | None,
    deadline_s: float | None,
    lease_timeout_s: float | None,
    as_json: bool,
) -> None:
    """`modelforge request ... --dry-run`: the scheduler's answer for this request now, without
    sending it. Exit 0 for now or later, 1 for never (as a refused request)."""
    from modelforge.client import ModelForgeClient
    from modelforge.verdicts import CheckSpec, admission_check

    settings = _settings()
    spec = CheckSpec(
        capability=capability,
        tenant=tenant,
        priority=priority,
        queue=queue,
        deadline_s=deadline_s,
        lease_timeout_s=lease_timeout_s,
    )

    async def go() -> AdmissionCheck:
        return await admission_check(await ModelForgeClient.connect(settings), spec)

    check = _run(go)
    if as_json:
        _print_json(check.to_json())
    else:
        colour = {"now": "green", "later": "yellow", "never": "red"}[check.answer]
        out.print(
            f"[{colour}]{check.answer}[/{colour}] {escape(check.line().partition(': ')[2])}",
            highlight=False,
            soft_wrap=True,
        )
    raise typer.Exit(1 if check.answer == "never" else 0)


def _print_json(value: object) -> None:
    import json
    import sys

    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True) + "\n")
