"""The `modelforge` command. Every read command has --json; errors are one line."""

from __future__ import annotations

# First, as the `modelforge` script: `status --json` and `request ... --json` answered from
# Temporal's HTTP API when that is safe, before typer, rich and the SDK load (_fastcli.py).
import modelforge._fastcli

# isort: split
import contextlib
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import typer
import typer.core
from rich.markup import escape
from rich.table import Table

from modelforge.cli_common import (  # shared by every command module; also cli.app, cli.render_status for callers
    MAX_EVENTS_LIMIT,
    JsonOption,
    PoolOption,
    _check_identifiers,
    _database_url,
    _fail,
    _json,
    _quiet_pool_logs,
    _run,
    _settings,
    _sleep,
    _store_rows,
    _table_console,
    app,
    catalog_app,
    check_plot_path,
    db_app,
    err,
    human_bytes,
    never_reported,
    out,
    parse_bytes,
    parse_duration,
    render_output,
    render_ps,
    render_status,
    trace_app,
    worker_app,
    written,
)
from modelforge.failures import FailureClass, ModelForgeError
from modelforge.names import scheduler_id

# Heavy modules (temporalio, the client, the store, fastapi, torch) are imported inside the
# commands that use them: `modelforge --help`, `--version` and completion import none of them
# (tests/unit/test_cli_first_hour.py checks it).


@app.command()
def dev(
    catalog: Annotated[Path | None, typer.Option(help="Catalog TOML (default: the example catalog).")] = None,
    ui_port: Annotated[int, typer.Option(help="Temporal UI port.")] = 8233,
    demo: Annotated[bool, typer.Option(help="Submit the example requests once the stack is up.")] = False,
    exit_after_demo: Annotated[bool, typer.Option(help="Stop the stack after the demo.")] = False,
) -> None:
    """Run the embedded stack in the foreground: Temporal, Postgres, workers."""
    import faulthandler
    import signal

    from modelforge.catalog import example_catalog_path
    from modelforge.dev import run_dev

    settings = _settings()
    # `kill -USR1 <pid>` prints where each thread is: a stack that will not start or stop says why.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        code = run_dev(settings, catalog or example_catalog_path(), ui_port, demo, exit_after_demo)
    except ModelForgeError as error:
        _fail(error)
    raise typer.Exit(code)


@app.command()
def request(
    capability: Annotated[str, typer.Argument(help="Capability to call, as name@version (chat.small@1).")],
    input: Annotated[str, typer.Option("--input", help="JSON object passed to the model.")] = "{}",
    priority: Annotated[
        str | None,
        typer.Option(
            help="Class (production, interactive, background, benchmark or maintenance), or a level of "
            "the catalog's queues (critical, merge.critical). Default: the tenant's."
        ),
    ] = None,
    queue: Annotated[
        str | None,
        typer.Option(help=escape("Queue whose --priority level is meant (catalogs with [[queues]]).")),
    ] = None,
    tenant: Annotated[str, typer.Option(help="Tenant (user or project).")] = "default",
    deadline: Annotated[float | None, typer.Option(help="Seconds until the answer is useless.")] = None,
    lease_timeout: Annotated[float | None, typer.Option(help="Longest wait for a lease, seconds.")] = None,
    request_id: Annotated[
        str | None,
        typer.Option(
            help="Idempotency key: asking again with the same id attaches to that request "
            "(while it runs, or its result once it succeeded) instead of starting new work."
        ),
    ] = None,
    as_json: JsonOption = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Say now / later (ETA) / never and why; send nothing, hold nothing.")
    ] = False,
) -> None:
    """Submit one capability request and print its result (exit 1 with the failure class)."""
    if dry_run:
        from modelforge.cli_queue import dry_run as answer_dry_run

        _check_identifiers(capability=capability, tenant=tenant)
        answer_dry_run(
            capability,
            tenant=tenant,
            priority=priority,
            queue=queue,
            deadline_s=deadline,
            lease_timeout_s=lease_timeout,
            as_json=as_json,
        )
    from modelforge._fastcli import attaching_client
    from modelforge.client import ModelForgeClient, Result

    try:
        payload = json.loads(input)
    except json.JSONDecodeError as error:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"--input is not JSON: {error}"), 1)
    except RecursionError:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, "--input nests too deeply to read"), 1)
    _check_identifiers(capability=capability, tenant=tenant, request_id=request_id)
    from modelforge.client import input_shape_problem
    from modelforge.messages import client_input_problem

    problem = (
        input_shape_problem(payload) or client_input_problem(payload)
        if isinstance(payload, dict)
        else "--input must be a JSON object"
    )
    if problem is not None:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, problem), 1)
    settings = _settings()

    async def go() -> Result:
        # A request the fast path sent is attached to by its id, never run twice.
        client: ModelForgeClient = await attaching_client().connect(settings)
        # On a terminal: a live line of what the request waits on (the queue, a model load with
        # its progress from the load activity's heartbeats, the invoke).
        live = err.status(f"{capability}: submitting") if not as_json and err.is_terminal else None
        with live or contextlib.nullcontext():
            return await client.request(
                capability,
                payload,
                priority=priority,
                queue=queue,
                tenant=tenant,
                deadline_s=deadline,
                lease_timeout_s=lease_timeout,
                request_id=request_id,
                on_progress=(lambda line: live.update(f"{capability}: {line}")) if live is not None else None,
            )

    result = _run(go)
    if as_json:
        _json(result)
    elif result.ok:
        lease = result.lease
        out.print(
            f"[green]ok[/green] {capability} on {lease.accelerator if lease else '?'} "
            f"({', '.join(f'{k} {v:.3f}s' if k.endswith('_s') else f'{k} {v:g}' for k, v in result.timings.items())})",
            highlight=False,
        )
        render_output(result.output, out)
    else:
        err.print(f"[red]{result.failure_class}[/red]: {escape(result.message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(0 if result.ok else 1)


def _pool_statuses(pool: str | None) -> dict[str, Any]:
    """Each pool's status (a PoolStatus) or, for a scheduler that does not answer, its error;
    exits with CAPABILITY_UNAVAILABLE when none answers."""
    from modelforge.client import ModelForgeClient
    from modelforge.policy import PoolStatus

    settings = _settings()

    async def go() -> dict[str, Any]:
        return dict(await (await ModelForgeClient.connect(settings, pool)).statuses())

    statuses = _run(go)
    if not any(isinstance(status, PoolStatus) for status in statuses.values()):
        _fail(
            ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, "; ".join(str(error.message) for error in statuses.values())
            )
        )
    return statuses


@app.command()
def status(
    as_json: JsonOption = False,
    pool: PoolOption = None,
    builds: Annotated[bool, typer.Option("--builds", help="Which build each worker and scheduler runs.")] = False,
) -> None:
    """Per pool and accelerator: total, observed, external, resident, leased, reserve, schedulable, pressure, health."""
    from modelforge.policy import PoolStatus, merge_statuses

    if builds:
        modelforge.cli_upgrade.show_builds(as_json, pool)
        return

    statuses = _pool_statuses(pool)
    answered = [s for s in statuses.values() if isinstance(s, PoolStatus)]
    silent = {name: error.message for name, error in statuses.items() if not isinstance(error, PoolStatus)}
    if as_json:
        # Every pool as one (queues and leases summed), each accelerator and resident with its
        # pool, and each pool's own figures under `pools`.
        merged = dataclasses.asdict(merge_statuses(answered))
        merged["accelerators"] = [
            {**dataclasses.asdict(acc), "pool": s.pool} for s in answered for acc in s.accelerators
        ]
        merged["residents"] = [{**dataclasses.asdict(r), "pool": s.pool} for s in answered for r in s.residents]
        merged["pools"] = [
            {
                "pool": s.pool,
                "up": True,
                "catalog_loading": s.catalog_loading,
                "queue_depth": s.queue_depth,
                "active_leases": s.active_leases,
            }
            for s in answered
        ] + [{"pool": name, "up": False, "error": message} for name, message in sorted(silent.items())]
        _json(merged)
        return
    console = _table_console()
    for one in answered:
        render_status(one, console)
    for name, message in sorted(silent.items()):
        err.print(f"[red]pool {escape(name)}[/red]: {escape(message)}", highlight=False, soft_wrap=True)


@app.command()
def ps(as_json: JsonOption = False, pool: PoolOption = None) -> None:
    """Resident models of every pool: pool, deployment, accelerator, bytes, state, active leases, TTL left."""
    from modelforge.policy import PoolStatus

    statuses = _pool_statuses(pool)
    rows = []
    for name, one in statuses.items():
        if not isinstance(one, PoolStatus):
            err.print(f"[red]pool {escape(name)}[/red]: {escape(one.message)}", highlight=False, soft_wrap=True)
            continue
        for resident in one.residents:
            ttl_left = None if resident.expires_at is None else max(0.0, resident.expires_at - time.time())
            rows.append({"pool": one.pool, **dataclasses.asdict(resident), "ttl_left_s": ttl_left})
    if as_json:
        _json(rows)
        return
    render_ps(rows, _table_console())


@app.command()
def events(
    as_json: JsonOption = False,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events.")] = False,
    request_id: Annotated[str | None, typer.Option(help="Only this request.")] = None,
    kind: Annotated[str | None, typer.Option(help="Only this kind (lease_granted, load, ...).")] = None,
    failure_class: Annotated[str | None, typer.Option(help="Only this failure class.")] = None,
    accelerator: Annotated[str | None, typer.Option(help="Only this accelerator.")] = None,
    alert: Annotated[
        str | None, typer.Option(help="Only alerts: GPU_PRESSURE, CAPABILITY_CAPACITY, or '*' for every alert.")
    ] = None,
    limit: Annotated[int, typer.Option(help="The newest N events.")] = 200,
) -> None:
    """The structured event log, from Postgres."""
    from modelforge.identifiers import identifier_problem
    from modelforge.store import Store

    if not 1 <= limit <= MAX_EVENTS_LIMIT:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"--limit must be between 1 and {MAX_EVENTS_LIMIT}"))
    problem = identifier_problem("request_id", request_id) if request_id is not None else None
    if problem is not None:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"--request-id: {problem}"))
    url = _database_url(_settings())

    def show(rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if as_json and follow:
                sys.stdout.write(json.dumps(row, default=str, sort_keys=True) + "\n")
            elif not as_json:
                fc = f" [red]{escape(row['failure_class'])}[/red]" if row["failure_class"] else ""
                fc += f" [yellow]ALERT {escape(row['alert'])}[/yellow]" if row.get("alert") else ""
                ids = " ".join(
                    f"{k}={row[k]}" for k in ("request_id", "lease_id", "accelerator", "deployment") if row[k]
                )
                line = escape(f"{row['at']} {row['kind']}") + fc + escape(f" {ids} {row['message']}")
                out.print(line, highlight=False, soft_wrap=True)
        sys.stdout.flush()

    async def go() -> None:
        assert url is not None
        store = await Store.open(url)
        try:
            filters: dict[str, Any] = {
                "request_id": request_id,
                "kind": kind,
                "failure_class": failure_class,
                "accelerator": accelerator,
                "alert": alert,
            }
            rows = await store.list_events(limit=limit, **filters)
            if as_json and not follow:
                _json(rows)
                return
            show(rows)
            last = rows[-1]["seq"] if rows else 0
            while follow:
                await _sleep(1.0)
                rows = await store.list_events(after_seq=last, limit=1000, **filters)
                show(rows)
                last = rows[-1]["seq"] if rows else last
        finally:
            await store.close()

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


@app.command()
def usage(
    as_json: JsonOption = False,
    since: Annotated[str | None, typer.Option(help="Only leases granted within this window (30m, 24h, 7d).")] = None,
    by: Annotated[str, typer.Option(help="Group by tenant or capability.")] = "tenant",
) -> None:
    """GPU-seconds per tenant (or capability) from the lease ledger."""

    url = _database_url(_settings())
    try:
        since_s = parse_duration(since) if since else None
    except ModelForgeError as error:
        _fail(error)

    rows = _store_rows(url, lambda store: store.usage(since_s=since_s, by=by))
    if as_json:
        _json(rows)
        return
    table = Table(title=f"usage by {by}" + (f" since {since} ago" if since else ""))
    for column in (by, "leases", "open", "GPU-hours", "GiB·GPU-hours", "ok", "failed"):
        table.add_column(column, justify="left" if column == by else "right")
    for row in rows:
        table.add_row(
            str(row[by]),
            str(row["leases"]),
            str(row["open"]),
            f"{float(row['gpu_seconds']) / 3600:.3f}",
            f"{float(row['gib_gpu_seconds']) / 3600:.3f}",
            str(row["ok"]),
            str(row["not_ok"]),
        )
    out.print(table)


@app.command()
def capacity(
    as_json: JsonOption = False,
    since: Annotated[str, typer.Option(help="How far back (30m, 1h, 7d).")] = "1h",
    accelerator: Annotated[str | None, typer.Option(help="Only this accelerator.")] = None,
    buckets: Annotated[int, typer.Option(min=1, max=500, help="Time buckets per accelerator.")] = 12,
) -> None:
    """The capacity trend from the per-minute snapshots.

    Per time bucket: the least schedulable and the most external bytes, with pressure, health
    and freshness."""

    url = _database_url(_settings())
    try:
        since_s = parse_duration(since)
    except ModelForgeError as error:
        _fail(error)

    rows = _store_rows(url, lambda store: store.capacity(since_s=since_s, buckets=buckets, accelerator=accelerator))
    if as_json:
        _json(rows)
        return
    table = Table(title=f"capacity over the last {since}")
    for column in ("accelerator", "from", "samples", "total", "min schedulable", "max external", "resident", "leased"):
        table.add_column(column, justify="left" if column in ("accelerator", "from") else "right")
    table.add_column("flags")
    for row in rows:
        flags = [
            flag
            for flag, on in (
                ("[yellow]PRESSURE[/yellow]", row["pressure"]),
                ("[red]UNHEALTHY[/red]", not row["healthy"]),
                ("[red]STALE[/red]", not row["fresh"]),
                ("simulated", row["simulated"]),
            )
            if on
        ]
        table.add_row(
            row["accelerator"],
            row["bucket"][:19].replace("T", " "),
            str(row["samples"]),
            human_bytes(row["total_bytes"]),
            human_bytes(row["min_schedulable_bytes"]),
            human_bytes(row["max_external_bytes"]),
            human_bytes(row["mean_resident_bytes"]),
            human_bytes(row["mean_leased_bytes"]),
            " ".join(flags),
        )
    if not rows:
        out.print(escape(f"no snapshots in the last {since} (the scheduler writes one per minute)"), highlight=False)
        return
    out.print(table)


def profile_outcome(accelerator_model: str, production_cards: list[str]) -> str:
    """The last line of `profile`: what the stored envelope changes, and no more."""
    if production_cards:
        return f"stored; production requests may now use {accelerator_model} cards ({', '.join(production_cards)})"
    return (
        f"stored; no {accelerator_model} card is production eligible, so production requests still cannot "
        "use this accelerator model"
    )


def _int_list(text: str, option: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"{option}: comma-separated whole numbers, not {text!r}"))


@app.command()
def profile(
    deployment: Annotated[str, typer.Argument(help="Deployment to measure, as in the catalog.")],
    batch_sizes: Annotated[str, typer.Option(help="Texts per embedding call, comma-separated.")] = "1,8,32",
    context_words: Annotated[str, typer.Option(help="Words per text or prompt, comma-separated.")] = "16,256",
    concurrency: Annotated[str, typer.Option(help="Calls in flight at once, comma-separated.")] = "1,2",
    priority: Annotated[str, typer.Option(help="Class of the profiling lease.")] = "benchmark",
    tenant: Annotated[str, typer.Option(help="Tenant the profiling lease is charged to.")] = "default",
    as_json: JsonOption = False,
) -> None:
    """Measure DEPLOYMENT's idle and peak bytes and store its envelope.

    The measurement holds a lease of its own: it waits like any request and never displaces
    production. Production may then use the deployment on that accelerator model's
    production-eligible cards."""
    from modelforge.client import ModelForgeClient
    from modelforge.messages import PROFILE_OPERATION
    from modelforge.store import Store
    from modelforge.temporal import connect

    _check_identifiers(tenant=tenant)
    settings = _settings()
    url = _database_url(settings)
    spec = {
        "batch_sizes": _int_list(batch_sizes, "--batch-sizes"),
        "context_words": _int_list(context_words, "--context-words"),
        "concurrency": _int_list(concurrency, "--concurrency"),
    }

    async def go() -> dict[str, Any]:
        store = await Store.open(url)
        try:
            catalog = await store.load_catalog()
            target = catalog.deployment(deployment)
            if target is None:
                known = ", ".join(sorted(d.deployment_id for d in catalog.deployments)) or "none"
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID, f"no deployment {deployment!r} in the catalog (known: {known})"
                )
            client = await ModelForgeClient.connect(settings)
            result = await client.request(
                target.capability, spec, priority=priority, tenant=tenant, operation=PROFILE_OPERATION
            )
            if not result.ok or result.lease is None or not isinstance((result.output or {}).get("profile"), dict):
                raise ModelForgeError(
                    FailureClass(result.failure_class or FailureClass.INVALID_OUTPUT.value),
                    result.message or "the node returned no profile",
                )
            accelerator = catalog.accelerator(result.lease.accelerator)
            measured = dict((result.output or {})["profile"])
            envelope = {
                **measured,
                "deployment": target.deployment_id,
                "accelerator": result.lease.accelerator,
                "accelerator_model": accelerator.model if accelerator is not None and accelerator.model else "",
                "measured_at": time.time(),
            }
            if not envelope["accelerator_model"]:
                raise ModelForgeError(
                    FailureClass.REQUEST_INVALID,
                    f"{result.lease.accelerator} has no `model` in the catalog: an envelope is per accelerator model",
                )
            await store.record_envelope(envelope)
        finally:
            await store.close()
        pools = sorted({a.pool for a in catalog.accelerators})
        temporal = await connect(settings)
        for pool in pools:  # the schedulers reload the catalog, now with the measured envelope
            await temporal.get_workflow_handle(scheduler_id(pool)).signal("catalog_changed")
        production_cards.extend(
            sorted(
                acc.id
                for acc in catalog.accelerators
                if acc.model == envelope["accelerator_model"] and acc.production_eligible
            )
        )
        return envelope

    production_cards: list[str] = []
    try:
        envelope = _run(go)
    except ModelForgeError as error:
        _fail(error, 1)
    if as_json:
        _json(envelope)
        return
    label = " (SIMULATED device)" if envelope.get("simulated") else ""
    out.print(
        escape(
            f"{envelope['deployment']} on {envelope['accelerator_model']} ({envelope['accelerator']}){label}: "
            f"idle {human_bytes(envelope['idle_bytes'])}, peak {human_bytes(envelope['peak_bytes'])}; "
            f"{envelope['runtime']} ({envelope['runtime_version']})"
        ),
        highlight=False,
    )
    table = Table(title="cases")
    for column in ("batch", "words", "concurrency", "peak", "seconds"):
        table.add_column(column, justify="right")
    for case in envelope["cases"]:
        table.add_row(
            str(case["batch_size"]),
            str(case["context_words"]),
            str(case["concurrency"]),
            human_bytes(case["peak_bytes"]),
            f"{case['seconds']:.3f}",
        )
    out.print(table)
    out.print(escape(profile_outcome(envelope["accelerator_model"], production_cards)), highlight=False)


@app.command()
def envelopes(
    deployment: Annotated[str | None, typer.Option(help="Only this deployment.")] = None,
    as_json: JsonOption = False,
) -> None:
    """Measured envelopes (from `modelforge profile`)."""

    url = _database_url(_settings())

    rows = _store_rows(url, lambda store: store.envelopes(deployment=deployment))
    if as_json:
        _json(rows)
        return
    table = Table(title="measured envelopes")
    for column in ("deployment", "accelerator model", "idle", "peak", "runtime", "measured"):
        table.add_column(column)
    for row in rows:
        table.add_row(
            row["deployment"],
            row["accelerator_model"] + (" (simulated)" if row["simulated"] else ""),
            human_bytes(row["idle_bytes"]),
            human_bytes(row["peak_bytes"]),
            f"{row['runtime']} ({row['runtime_version']})",
            time.strftime("%Y-%m-%d %H:%M", time.gmtime(float(row["measured_at"]))),
        )
    out.print(table)


@catalog_app.command("apply")
def catalog_apply(
    file: Annotated[Path, typer.Argument(help="Catalog TOML to validate and apply.")],
    what_if: Annotated[
        str | None,
        typer.Option(help="Apply nothing: replay this last window (7d) under the catalog as it was and FILE."),
    ] = None,
    pool: Annotated[str | None, typer.Option(help="--what-if: the pool whose record replays.")] = None,
    as_json: JsonOption = False,
    plot: Annotated[Path | None, typer.Option(help="--what-if: draw both replays into a .png, .svg or .pdf.")] = None,
) -> None:
    """Validate FILE and apply it atomically; the running scheduler reloads it."""
    if what_if is not None:  # modelforge/cli_whatif.py
        from modelforge.cli_whatif import what_if as replay_record

        return replay_record(what_if, pool=pool, catalog_file=file, as_json=as_json, plot=plot)
    from modelforge.catalog import load_catalog_file
    from modelforge.store import Store

    settings = _settings()
    try:
        catalog, _ = load_catalog_file(file)
    except ModelForgeError as error:
        _fail(error)
    url = _database_url(settings)

    async def go() -> tuple[dict[str, int], list[str]]:
        assert url is not None
        store = await Store.open(url)
        try:
            await store.migrate()
            counts = await store.apply_catalog(catalog)
        finally:
            await store.close()
        from datetime import timedelta

        from modelforge.policy import PoolStatus
        from modelforge.temporal import connect

        silent: list[str] = []
        try:
            client = await connect(settings)
        except Exception as error:  # the catalog is stored; the schedulers read it when they start
            err.print(
                f"[yellow]note[/yellow]: schedulers not told ({type(error).__name__}); they load the catalog at start"
            )
            return counts, silent
        # Each pool's scheduler on its own: a pool new in this catalog has none yet (the control
        # worker starts it, and it loads the catalog then), which must not keep the others stale.
        for pool in sorted({acc.pool for acc in catalog.accelerators}):
            try:
                handle = client.get_workflow_handle(scheduler_id(pool))
                await handle.signal("catalog_changed")
                # Which of this pool's nodes has a worker: the scheduler's observations so far.
                current = await handle.query("status", result_type=PoolStatus, rpc_timeout=timedelta(seconds=5))
                nodes = [acc.node for acc in catalog.accelerators if acc.pool == pool]
                silent += never_reported(current.accelerators, nodes)
            except Exception as error:
                err.print(
                    f"[yellow]note[/yellow]: the scheduler of pool {escape(pool)} not told ({type(error).__name__}); "
                    "it loads the catalog at start",
                    highlight=False,
                )
        return counts, silent

    counts, silent = _run(go)
    out.print(escape(f"applied {file}: {counts}"), highlight=False)
    for node in silent:
        err.print(
            f"[yellow]warning[/yellow]: node {escape(node)} has never reported (no node worker runs for it): "
            f"requests placed there wait and fail SCHEDULER_STATE_STALE until "
            f"`modelforge worker node --node {escape(node)}` runs",
            highlight=False,
            soft_wrap=True,
        )


@db_app.command("migrate")
def db_migrate() -> None:
    """Apply pending migrations in order.

    They go to the Postgres of MODELFORGE_DATABASE_URL, or of a running `modelforge dev` (which
    applies them itself when it starts)."""
    from modelforge.store import Store

    settings = _settings()
    needs = (
        "db migrate needs a reachable Postgres: set MODELFORGE_DATABASE_URL, or run it while `modelforge dev` "
        "is up (dev applies the migrations itself when it starts)"
    )
    url = settings.resolved_database_url()
    if url is None:
        _fail(ModelForgeError(FailureClass.CAPABILITY_UNAVAILABLE, f"{needs}; no database found ({settings.home})"))
    _quiet_pool_logs()

    async def go() -> list[str]:
        assert url is not None
        try:
            store = await Store.open(url, timeout=5.0)
        except ModelForgeError as error:
            raise ModelForgeError(error.failure, f"{needs}; {error.message}") from None
        try:
            return await store.migrate()
        finally:
            await store.close()

    applied = _run(go)
    out.print(escape(f"applied: {', '.join(applied) if applied else 'nothing new'}"), highlight=False)


@worker_app.command("control")
def worker_control(
    pool: Annotated[
        list[str] | None,
        typer.Option(
            help="A pool whose scheduler this worker starts and serves; repeatable (default: the catalog's pools)."
        ),
    ] = None,
) -> None:
    """The control worker (workflows, catalog and event activities, the pools' schedulers)."""
    from modelforge.logging import configure
    from workers import control

    configure()
    try:
        _run(lambda: control.run(_settings(), pool or ()))
    except KeyboardInterrupt:
        pass


@worker_app.command("node")
def worker_node(
    node: Annotated[str, typer.Option(help="This GPU host's node name.")],
    simulate_from: Annotated[Path | None, typer.Option(help="Catalog whose devices to simulate.")] = None,
    pool: Annotated[
        list[str] | None,
        typer.Option(
            help="A pool of this node's cards: its scheduler receives the node's telemetry and lends it slots; "
            "repeatable, for a node whose cards are in several pools (default: default)."
        ),
    ] = None,
    cpu_device_bytes: Annotated[
        str | None,
        typer.Option(help="Serve this host's CPU as the device <node>/cpu with this memory budget (e.g. 4GiB)."),
    ] = None,
    rack_id: Annotated[str, typer.Option(envvar="MODELFORGE_RACK_ID", help="Rack label of this node's devices.")] = "",
    network_bandwidth_gbps: Annotated[
        float | None,
        typer.Option(envvar="MODELFORGE_NETWORK_BANDWIDTH_GBPS", min=0, help="This node's network bandwidth, Gbit/s."),
    ] = None,
    gateway_port: Annotated[
        int | None,
        typer.Option(
            min=1,
            max=65535,
            help="Also serve the HTTP gateway from this process (as `modelforge gateway` does), on this port: "
            "requests routed to this node then start their workflow here without a round trip through the server.",
        ),
    ] = None,
    gateway_host: Annotated[str, typer.Option(help="The interface the gateway listens on.")] = "127.0.0.1",
) -> None:
    """A node worker: NVML and runtimes of one GPU host."""
    from modelforge.logging import configure
    from workers import node as node_worker

    configure()
    gateway = None
    if gateway_port is not None:
        settings = _settings()
        _listenable(gateway_host, gateway_port)
        gateway = node_worker.NodeGateway(gateway_host, gateway_port, _database_url(settings), _gateway_keys())
    try:
        budget = parse_bytes(cpu_device_bytes) if cpu_device_bytes else None
    except ModelForgeError as error:
        _fail(error)
    try:
        labels = {"rack_id": rack_id} if rack_id else {}
        if network_bandwidth_gbps is not None:
            labels["network_bandwidth_gbps"] = f"{network_bandwidth_gbps:g}"
        pools = list(dict.fromkeys(pool or ["default"]))
        _run(lambda: node_worker.run(_settings(), node, simulate_from, pools, budget, labels, gateway))
    except KeyboardInterrupt:
        pass


def _listenable(host: str, port: int) -> None:
    """Fail now, typed, when `host:port` cannot be listened on (taken, no such interface), not
    once the worker has started."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind(infos[0][4])
    except (OSError, UnicodeError) as error:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"cannot listen on {host}:{port}: {error}"))


def _gateway_keys() -> dict[str, str]:
    """The gateway's API keys from MODELFORGE_GATEWAY_API_KEYS_FILE (none without it)."""
    from modelforge.gateway import load_api_keys

    keys_path = os.environ.get("MODELFORGE_GATEWAY_API_KEYS_FILE")
    try:
        return load_api_keys(Path(keys_path)) if keys_path else {}
    except ModelForgeError as error:
        _fail(error)
    except RecursionError:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"{keys_path}: nests too deeply to read"))


@app.command()
def gateway(
    host: Annotated[str, typer.Option(help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port.")] = 8080,
    pool: Annotated[
        str | None,
        typer.Option(help="The pool whose scheduler admits every request (default: each routed to a pool serving it)."),
    ] = None,
) -> None:
    """The HTTP gateway: the request API and OpenAI-compatible endpoints.

    POST /v1/requests, GET /v1/status, and OpenAI-compatible /v1/embeddings, /v1/chat/completions
    and /v1/models. API keys (key = tenant) come from the TOML file named by
    MODELFORGE_GATEWAY_API_KEYS_FILE; without it, the tenant comes from X-ModelForge-Tenant."""
    from modelforge.gateway import run_gateway
    from modelforge.logging import configure

    configure()
    settings = _settings()
    url = _database_url(settings)
    keys = _gateway_keys()

    async def go() -> None:
        await run_gateway(settings, url, host, port, keys, pool, announce=err.print)

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


@app.command()
def simulate(
    scenario: Annotated[
        Path | None,
        typer.Argument(help="Scenario TOML: a catalog plus the requests to replay (docs/SIMULATOR.md)."),
    ] = None,
    policy: Annotated[
        str,
        typer.Option(
            help="modelforge (the production policy), fifo, ollama or fifo-gang; 'all' runs them side by side."
        ),
    ] = "modelforge",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print JSON instead of a table, with per-minute series (no progress bar).")
    ] = False,
    plot: Annotated[
        Path | None,
        typer.Option(help="Also draw the policies side by side into a .png, .svg or .pdf (the plot extra)."),
    ] = None,
    from_record: Annotated[
        str | None, typer.Option(help="Replay the store's record of this last window (7d, 12h) instead of SCENARIO.")
    ] = None,
    pool: Annotated[str | None, typer.Option(help="--from-record: the pool whose record replays.")] = None,
    anonymise: Annotated[bool, typer.Option(help="--from-record: rename tenants, number request ids.")] = False,
    catalog: Annotated[
        Path | None, typer.Option(help="--from-record: also replay under this proposed catalog, side by side.")
    ] = None,
    out_dir: Annotated[Path | None, typer.Option("--out", help="--from-record: also write the scenario here.")] = None,
) -> None:
    """Replay SCENARIO in virtual time through the production policy or a baseline.

    Waits count every request (one never served waits forever, shown as `never`), goodput is
    deadlines met per offered request, and utilization is measured over the scenario's own span,
    the same for every policy. A replay that runs longer than a second draws a progress bar on
    stderr when stderr is a terminal, never with --json. --from-record replays what the store
    recorded (modelforge/cli_whatif.py)."""
    if from_record is not None or scenario is None:
        if from_record is None or scenario is not None:
            _fail(ModelForgeError(FailureClass.REQUEST_INVALID, "give either SCENARIO or --from-record WINDOW"))
        from modelforge.cli_whatif import what_if

        return what_if(
            from_record,
            pool=pool,
            catalog_file=catalog,
            anonymise=anonymise,
            out_dir=out_dir,
            as_json=as_json,
            plot=plot,
        )
    from modelforge.simulate import POLICIES, ReplayProgress, comparison_rows, load_scenario
    from modelforge.simulate import simulate as run_simulation

    names = list(POLICIES) if policy == "all" else [policy]
    if any(name not in POLICIES for name in names):
        choices = ", ".join(POLICIES)
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"unknown policy {policy!r}; choose {choices} or all"))
    try:
        if plot is not None:
            check_plot_path(plot)
        loaded = load_scenario(scenario)
        with ReplayProgress(err) as bars:
            show = not as_json and err.is_terminal
            results = [
                run_simulation(loaded, name, bars.policy(name, len(loaded.requests)) if show else None)
                for name in names
            ]
    except ModelForgeError as error:
        _fail(error)
    title = f"{scenario.name}: {len(loaded.requests)} requests, virtual time (simulated cards)"
    if plot is not None:
        from modelforge.simulate import write_plot

        try:
            written("--plot", plot, lambda: write_plot(results, plot, title))
        except ModelForgeError as error:
            _fail(error)
    if as_json:
        _json(results[0].to_json() if policy != "all" else [r.to_json() for r in results])
        return
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for result in results:
        table.add_column(result.policy, justify="right")
    for label, cells in comparison_rows(results):
        table.add_row(label, *cells)
    out.print(table)
    if plot is not None:
        out.print(escape(f"wrote {plot}"), highlight=False, soft_wrap=True)


@trace_app.command("azure")
def trace_azure(
    trace: Annotated[Path, typer.Argument(help="Azure LLM trace CSV (TIMESTAMP,ContextTokens,GeneratedTokens).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for scenario.toml and requests.jsonl.")],
    repeat: Annotated[int, typer.Option(help="Tile the trace this many times back to back.")] = 1,
    prefill_tps: Annotated[float, typer.Option(help="Prefill tokens per second per sequence.")] = 4000.0,
    decode_tps: Annotated[float, typer.Option(help="Decode tokens per second per sequence.")] = 40.0,
    seed: Annotated[
        int, typer.Option(help="Seed of what the trace does not say (the same file and seed, the same scenario).")
    ] = 7,
) -> None:
    """A mixed single-GPU scenario from an Azure LLM trace.

    The trace's LLM calls (production) with embedding traffic, a lab's experimental model and
    background evaluation jobs, on a card shared with a media server."""
    from modelforge.traces import AzureOptions, convert_azure

    if prefill_tps <= 0 or decode_tps <= 0:
        _fail(ModelForgeError(FailureClass.REQUEST_INVALID, "--prefill-tps and --decode-tps must be positive"))
    options = AzureOptions(prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps, repeat=repeat, seed=seed)
    try:
        path = convert_azure(trace, out_dir, options)
    except ModelForgeError as error:
        _fail(error)
    out.print(escape(f"wrote {path}"), highlight=False, soft_wrap=True)


@trace_app.command("alibaba")
def trace_alibaba(
    nodes_csv: Annotated[Path, typer.Argument(help="Node list CSV (sn,cpu_milli,memory_mib,gpu,model).")],
    pods_csv: Annotated[Path, typer.Argument(help="Pod list CSV (name,...,num_gpu,gpu_milli,qos,...).")],
    out_dir: Annotated[Path, typer.Option("--out", help="Folder for scenario.toml and requests.jsonl.")],
    gpu_memory: Annotated[
        list[str] | None, typer.Option(help="MODEL=GiB for a GPU model, e.g. G2=24; repeatable.")
    ] = None,
    nodes: Annotated[int, typer.Option(help="A smaller cluster: N nodes evenly spaced through the file (0: all).")] = 0,
    pods: Annotated[int, typer.Option(help="N pods evenly spaced through the file (0: all).")] = 0,
    max_time_s: Annotated[float, typer.Option(help="Only pods created before this (0: all).")] = 0.0,
) -> None:
    """A cluster scenario: the trace's nodes and GPU models as accelerators, its pods as jobs."""
    from modelforge.traces import AlibabaOptions, convert_alibaba

    sizes: dict[str, float] = {}
    for item in gpu_memory or []:
        model, _, value = item.partition("=")
        try:
            sizes[model.strip()] = float(value)
        except ValueError:
            _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"--gpu-memory {item!r}: expected MODEL=GiB"))
        if not model.strip() or sizes[model.strip()] <= 0:
            _fail(ModelForgeError(FailureClass.REQUEST_INVALID, f"--gpu-memory {item!r}: expected MODEL=GiB"))
    options = AlibabaOptions(gpu_gib=sizes, nodes=nodes, pods=pods, max_time_s=max_time_s)
    try:
        path = convert_alibaba(nodes_csv, pods_csv, out_dir, options)
    except ModelForgeError as error:
        _fail(error)
    out.print(escape(f"wrote {path}"), highlight=False, soft_wrap=True)


import modelforge.cli_jobs  # noqa: E402  (adds `modelforge job submit|jobs|logs|artifacts`)
import modelforge.cli_queue  # noqa: E402  (adds `modelforge queue|why`)
import modelforge.cli_residency  # noqa: E402  (adds `modelforge load|unload|pin|unpin`)
import modelforge.cli_upgrade  # noqa: E402  (adds `modelforge upgrade`; `status --builds`)


def main() -> None:
    try:
        app()
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    # Skip interpreter finalization: the Temporal client's Rust runtime can crash a short-lived
    # process while Python tears down (temporalio/sdk-python#300). Everything this process
    # started is already stopped and every stream is flushed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
