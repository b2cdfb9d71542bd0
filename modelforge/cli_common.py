"""What every `modelforge` command module shares: the typer app and its groups, the consoles,
settings, one-line failures, JSON output, durations and sizes, the status and ps tables. The
command modules (cli.py, cli_jobs.py, cli_residency.py) import it; it imports none of them."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
import typer.core
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from modelforge.failures import FailureClass, ModelForgeError
from modelforge.settings import Settings

if TYPE_CHECKING:
    from modelforge.store import Store

# Heavy modules (temporalio, the client, the store, fastapi, torch) are imported inside the
# commands that use them: `modelforge --help`, `--version` and completion import none of them
# (tests/unit/test_cli_first_hour.py checks it).


def reflowed(help_text: str) -> str:
    """Help text with each paragraph on one line, for the terminal to wrap: typer's rich help
    keeps a docstring's line breaks, which then break sentences in the middle. Paragraphs are
    separated by a blank line; one that starts with \\b keeps its lines."""
    text, marker, rest = inspect.cleandoc(help_text).partition("\f")
    paragraphs = [p if p.startswith("\b") else " ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(p for p in paragraphs if p) + marker + rest


def summary(help_text: str) -> str:
    """A command's one-line summary: its help's whole first paragraph."""
    return reflowed(help_text).partition("\f")[0].split("\n\n")[0].strip()


class Group(typer.core.TyperGroup):
    """Each command's help is reflowed (`reflowed`), and its summary, in its group's commands
    panel and in shell completion, is its help's whole first paragraph: not broken where the
    docstring's lines break and not cut at 45 characters or the first period (click's default)."""

    def get_command(self, ctx: Any, cmd_name: str) -> Any:  # typer's own click types
        command = super().get_command(ctx, cmd_name)
        if command is not None and command.help:
            command.help = reflowed(command.help)
            command.short_help = command.short_help or summary(command.help)
        return command


app = typer.Typer(cls=Group, no_args_is_help=True, add_completion=True, help="ModelForge: GPU admission on Temporal.")
catalog_app = typer.Typer(cls=Group, no_args_is_help=True, help="The catalog of accelerators, deployments and tenants.")
db_app = typer.Typer(cls=Group, no_args_is_help=True, help="The Postgres store.")
worker_app = typer.Typer(cls=Group, no_args_is_help=True, help="Worker processes.")
app.add_typer(catalog_app, name="catalog")
app.add_typer(db_app, name="db")
app.add_typer(worker_app, name="worker")
trace_app = typer.Typer(cls=Group, no_args_is_help=True, help="Convert real traces into simulator scenarios.")
app.add_typer(trace_app, name="trace")
out = Console()
err = Console(stderr=True)
T = TypeVar("T")
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
PoolOption = Annotated[
    str | None,
    typer.Option(help="Only this pool (default: every pool, from MODELFORGE_POOLS or the running schedulers)."),
]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("modelforge")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _show_version(value: bool) -> None:
    if value:
        sys.stdout.write(f"modelforge {_version()}\n")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_show_version, is_eager=True, help="Print the version and exit."),
    ] = False,
) -> None:
    """ModelForge: GPU admission on Temporal."""


def _settings() -> Settings:
    try:
        return Settings.from_env()
    except ModelForgeError as error:
        _fail(error)


def _fail(error: ModelForgeError, code: int = 2) -> NoReturn:
    err.print(f"[red]error[/red] {error.failure.value}: {escape(error.message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _run(factory: Callable[[], Awaitable[T]]) -> T:
    import asyncio

    try:
        return asyncio.run(factory())  # type: ignore[arg-type]
    except ModelForgeError as error:
        _fail(error)
    except Exception as error:
        # A query Postgres refused (a schema not migrated, a value out of its range): one line.
        if type(error).__module__.split(".")[0] != "psycopg":
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        _fail(
            ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE, f"Postgres refused the query: {type(error).__name__}: {first}"
            )
        )


def _json(value: Any) -> None:
    def default(obj: Any) -> Any:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.asdict(obj)
        return str(obj)

    sys.stdout.write(json.dumps(value, default=default, indent=2, sort_keys=True) + "\n")


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


def _store_rows(url: str, query: Callable[[Store], Awaitable[list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Rows from one store query, the store opened and closed around it."""
    from modelforge.store import Store

    async def go() -> list[dict[str, Any]]:
        store = await Store.open(url)
        try:
            return await query(store)
        finally:
            await store.close()

    return _run(go)


def _quiet_pool_logs() -> None:
    """The connection pool logs each failed attempt over several lines; the CLI says it in one."""
    import logging

    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)


def _database_url(settings: Settings) -> str:
    url = settings.resolved_database_url()
    if url is None:
        _fail(
            ModelForgeError(
                FailureClass.CAPABILITY_UNAVAILABLE,
                f"no database: set MODELFORGE_DATABASE_URL or start `modelforge dev` ({settings.home})",
            )
        )
    _quiet_pool_logs()
    return url


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
# The longest window a history command looks back over: a century (what Postgres's interval
# arithmetic holds comfortably; a longer one means "everything" and gets the same rows).
MAX_LOOKBACK_S = 36500 * 86400.0
# `events --limit`: at most this many rows at once.
MAX_EVENTS_LIMIT = 100_000


def parse_duration(text: str) -> float:
    """`90s`, `30m`, `1h`, `7d` (or plain seconds) as seconds; anything else is REQUEST_INVALID."""
    value = text.strip().lower()
    unit = _UNITS.get(value[-1:]) if value else None
    number = value[:-1] if unit is not None else value
    try:
        seconds = float(number) * (unit or 1.0)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_LOOKBACK_S:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID,
            f"a duration is a positive number with s, m, h or d (e.g. 1h), at most {MAX_LOOKBACK_S / 86400:.0f}d, "
            f"not {text!r}",
        )
    return seconds


def check_output_path(flag: str, path: Path, *, folder: bool = False) -> None:
    """REQUEST_INVALID where nothing could be written at `path` (a file; a folder where
    `folder`), found before the work that would fill it runs: a folder where a file goes or
    the reverse, or a nearest existing folder above it that is a file or not writable (missing
    folders are made when it is written), or a path the system refuses to look at (too long)."""
    try:
        _check_output_path(flag, path, folder)
    except OSError as error:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"{flag} {str(path)[:200]!r}: {error.strerror or error}"
        ) from None


def _check_output_path(flag: str, path: Path, folder: bool) -> None:
    if folder and path.exists() and not path.is_dir():
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{flag} {path} is a file, not a folder")
    if not folder and path.is_dir():
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{flag} {path} is a folder, not a file")
    above = path if folder else path.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{flag} {path}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK | os.X_OK):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"{flag} {path}: {above} is not writable")


def check_plot_path(plot: Path) -> None:
    """`--plot`'s file, before anything is replayed: its format, matplotlib, and where it goes."""
    from modelforge.simulate import plotting_available

    if plot.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ModelForgeError(FailureClass.REQUEST_INVALID, f"--plot {plot}: the file must end .png, .svg or .pdf")
    if not plotting_available():
        raise ModelForgeError(FailureClass.REQUEST_INVALID, "--plot needs matplotlib: pip install 'modelforge[plot]'")
    check_output_path("--plot", plot)


def written(flag: str, path: Path, write: Callable[[], T]) -> T:
    """`write()`'s result, its OSError (a disk full, a folder removed meanwhile) as
    REQUEST_INVALID naming `flag` and `path` instead of a traceback."""
    try:
        return write()
    except OSError as error:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"{flag} {path}: could not write it ({error.strerror or error})"
        ) from None


_BYTE_UNITS = {"b": 1, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


def parse_bytes(text: str) -> int:
    """`4GiB`, `512MiB` (or plain bytes); anything else is REQUEST_INVALID."""
    value = text.strip().lower().replace(" ", "")
    for unit in ("tib", "gib", "mib", "kib", "b"):
        if value.endswith(unit):
            number, scale = value[: -len(unit)], _BYTE_UNITS[unit]
            break
    else:
        number, scale = value, 1
    try:
        amount = float(number) * scale
    except ValueError:
        amount = -1.0
    if not 0 < amount < 2**50:
        raise ModelForgeError(
            FailureClass.REQUEST_INVALID, f"a size is a positive number with B, KiB, MiB, GiB or TiB, not {text!r}"
        )
    return int(amount)


def shown_output(value: Any) -> Any:
    """A request's output as a terminal shows it: long vectors summarised (`--json` keeps them whole)."""
    if isinstance(value, dict):
        return {key: shown_output(item) for key, item in value.items()}
    if isinstance(value, list):
        if len(value) > 8 and all(isinstance(x, int | float) and not isinstance(x, bool) for x in value):
            head = ", ".join(f"{x:.4g}" for x in value[:3])
            return f"[{len(value)} numbers: {head}, ...]"
        return [shown_output(item) for item in value]
    return value


# Keys of a model's output that hold vectors: left out under a chat answer (`--json` keeps them).
_VECTOR_KEYS = ("embedding", "embeddings")


def render_output(output: Any, console: Console) -> None:
    """A request's output on the terminal: a chat answer (a `text`) as its text, then the rest
    without vectors; anything else (an embedding) as JSON with long vectors summarised."""
    if isinstance(output, dict) and isinstance(output.get("text"), str):
        console.print(escape(output["text"]), highlight=False, soft_wrap=True)
        rest = {k: v for k, v in output.items() if k != "text" and k not in _VECTOR_KEYS}
        if rest:
            console.print_json(json.dumps(shown_output(rest), default=str))
        return
    console.print_json(json.dumps(shown_output(output), default=str))


def human_bytes(value: int | None) -> str:
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    amount = float(abs(value))
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if amount < 1024 or unit == "TiB":
            return f"{sign}{amount:.0f} {unit}" if unit == "B" else f"{sign}{amount:.2f} {unit}"
        amount /= 1024
    return f"{value} B"


def short_bytes(value: int | None) -> str:
    """Bytes in at most six characters for the compact tables: `24.0G`, `1.13G`, `512M`, `-`."""
    if value is None:
        return "-"
    sign = "-" if value < 0 else ""
    amount = float(abs(value))
    for unit in ("B", "K", "M", "G", "T"):
        if amount < 1000 or unit == "T":
            if unit == "B":
                return f"{sign}{amount:.0f}B"
            return f"{sign}{amount:.3g}{unit}" if amount < 100 else f"{sign}{amount:.0f}{unit}"
        amount /= 1024
    return f"{value}B"


def never_reported(accelerators: list[Any], nodes: list[str] | None = None) -> list[str]:
    """Nodes (of `nodes`, or of the accelerators) none of whose accelerators was ever observed:
    no node worker has sent telemetry for them, so requests there wait and fail stale."""
    seen = {acc.node for acc in accelerators if acc.observed_at is not None}
    wanted = nodes if nodes is not None else [acc.node for acc in accelerators]
    return sorted({node for node in wanted if node not in seen})


def _table_console() -> Console:
    """`out` on a terminal; piped, COLUMNS as it is now (rich reads it once, when `out` is made)
    or, without it (where rich assumes 80), 100 columns, what the tables fit."""
    if out.is_terminal:
        return out
    columns = os.environ.get("COLUMNS", "")
    return Console(width=int(columns) if columns.isdecimal() and int(columns) > 0 else max(out.width, 100))


def _compact_table(title: str | None = None) -> Table:
    return Table(
        title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True, pad_edge=False, title_justify="left"
    )


def render_status(pool: Any, console: Console) -> None:
    """`status` in at most 100 columns: bytes in the short form (G = GiB), the device's marks
    under its name, pressure, health and freshness folded into one `state` column."""
    table = _compact_table(f"pool {pool.pool} (G = GiB)")
    for column in ("accelerator", "total", "used", "external", "resident", "leased", "reserve", "schedulable"):
        table.add_column(column, justify="left" if column == "accelerator" else "right", no_wrap=True)
    table.add_column("state", no_wrap=True)
    for acc in pool.accelerators:
        label = escape(acc.id)
        label += "\n[yellow](simulated)[/yellow]" if acc.simulated else ""
        label += "" if acc.production_eligible else "\n[dim](not production)[/dim]"
        age = "never" if acc.observation_age_s is None else f"{acc.observation_age_s:.0f}s"
        state = [] if acc.fresh else ["[red]NEVER SEEN[/red]" if acc.observed_at is None else f"[red]STALE {age}[/red]"]
        state += ["[red]PRESSURE[/red]"] if acc.pressure else []
        state += [] if acc.healthy else ["[red]UNHEALTHY[/red]"]
        table.add_row(
            label,
            short_bytes(acc.total_bytes),
            short_bytes(acc.observed_used_bytes),
            short_bytes(acc.external_bytes),
            short_bytes(acc.resident_bytes),
            short_bytes(acc.leased_bytes),
            short_bytes(acc.reserve_bytes),
            short_bytes(acc.schedulable_bytes),
            "\n".join(state) if state else f"ok {age}",
        )
    console.print(table)
    if pool.catalog_loading:
        console.print(
            "[yellow]catalog loading[/yellow]: the scheduler is loading its catalog (at its start, or after "
            "`catalog apply`); the cards above are the catalog it had, and admissions and controls answer "
            "SCHEDULER_STATE_STALE (retryable) until it has",
            highlight=False,
        )
    order = [c for c in pool.classes if c in pool.queue_depth] + sorted(set(pool.queue_depth) - set(pool.classes))
    queue = ", ".join(f"{name} {pool.queue_depth[name]}" for name in order)
    lent = f"; free slots lent to nodes: {pool.lent_slots}" if pool.lent_slots else ""
    console.print(escape(f"queue: {queue or 'empty'}; active leases: {pool.active_leases}{lent}"), highlight=False)
    for node in never_reported(pool.accelerators):
        console.print(
            f"[yellow]never reported[/yellow]: node {escape(node)} has sent no telemetry (no node worker runs "
            f"for it: `modelforge worker node --node {escape(node)}`); requests for it wait and fail stale",
            highlight=False,
        )
    for capability in pool.capabilities:
        if capability.degraded:
            console.print(
                "[red]DEGRADED[/red] "
                + escape(
                    f"{capability.capability}: last {capability.consecutive_failures} outcomes failed, "
                    f"last {capability.last_failure} {capability.last_message}".rstrip()
                ),
                highlight=False,
            )


def render_ps(rows: list[dict[str, Any]], console: Console) -> None:
    """`ps` in well under 100 columns (the `pool` column when the rows name their pool)."""
    table = _compact_table()
    pooled = any("pool" in row for row in rows)
    columns = ("deployment", "accelerator", "bytes", "state", "residency", "leases", "ttl left")
    for column in ("pool", *columns) if pooled else columns:
        table.add_column(column, justify="right" if column in ("bytes", "leases", "ttl left") else "left")
    for row in rows:
        ttl = "-" if row["ttl_left_s"] is None else f"{row['ttl_left_s']:.0f}s"
        table.add_row(
            *([escape(str(row.get("pool", "")))] if pooled else []),
            escape(row["deployment"]),
            escape(row["accelerator"]),
            short_bytes(row["bytes"]),
            row["state"],
            row["residency"],
            str(row["active_leases"]) + (f" +{row['lent_slots']} lent" if row.get("lent_slots") else ""),
            ttl,
        )
    console.print(table)


def _check_identifiers(**values: str | None) -> None:
    """Identifiers from the command line by the one set of rules (modelforge/identifiers.py),
    before anything connects: a bad one is REQUEST_INVALID (exit 1, as a refused request)."""
    from modelforge.identifiers import identifier_problem

    for kind, value in values.items():
        problem = identifier_problem(kind, value) if value is not None else None
        if problem is not None:
            _fail(ModelForgeError(FailureClass.REQUEST_INVALID, problem), 1)
