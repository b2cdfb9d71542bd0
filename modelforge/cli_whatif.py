"""What-if on the record, on the command line: `modelforge simulate --from-record 7d [--pool P]
[--anonymise] [--catalog NEW.toml] [--out DIR]` and `modelforge catalog apply NEW.toml --what-if
7d` (which applies nothing). The recorded requests replay through the production policy under
the catalog that was in force and under the proposed one; modelforge/cli.py hands these options
here."""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from rich.markup import escape
from rich.table import Table

from modelforge.failures import FailureClass, ModelForgeError

if TYPE_CHECKING:
    from modelforge.simulate import RecordScenario, Replayed


def what_if(
    window: str,
    *,
    pool: str | None,
    catalog_file: Path | None,
    anonymise: bool = False,
    out_dir: Path | None = None,
    as_json: bool = False,
    plot: Path | None = None,
) -> None:
    from modelforge.catalog import load_catalog_file
    from modelforge.cli_common import (
        _database_url,
        _fail,
        _json,
        _run,
        _settings,
        check_output_path,
        check_plot_path,
        err,
        out,
        parse_duration,
        written,
    )
    from modelforge.simulate import compare, comparison_json, record_from_store, replay_processes

    try:
        window_s = parse_duration(window)
        if pool is not None and not 0 < len(pool) <= 200:
            raise ModelForgeError(FailureClass.REQUEST_INVALID, "--pool must be 1-200 characters")
        proposed = load_catalog_file(catalog_file)[0] if catalog_file is not None else None
        # Where the results go, before the record is read and replayed (a minute on a busy week).
        if plot is not None:
            check_plot_path(plot)
        if out_dir is not None:
            check_output_path("--out", out_dir, folder=True)
    except ModelForgeError as error:
        _fail(error)
    url = _database_url(_settings())
    until_s = time.time()  # the CLI's clock: the window ends now
    # Two replays: their processes start while the record is read (used if it is long).
    with replay_processes() if proposed is not None else nullcontext() as processes:
        record = _run(
            lambda: record_from_store(url, window_s=window_s, until_s=until_s, pool=pool, anonymise=anonymise)
        )
        try:
            if out_dir is not None:
                scenario_file = written("--out", out_dir, lambda: record.write(out_dir))
                err.print(escape(f"wrote {scenario_file}"), highlight=False, soft_wrap=True)
            runs = compare(record, proposed, processes=processes)
        except ModelForgeError as error:
            _fail(error)
    # The comparison is shown first: a plot that cannot be written then loses none of it.
    if as_json:
        _json(comparison_json(record, runs))
    else:
        _show_table(record, runs, window, catalog_file is not None)
    if plot is not None:
        from modelforge.simulate import write_plot

        replays = [r.result for r in runs if r.result is not None]
        title = f"record of pool {record.pool}, last {window} (simulated cards)"
        try:
            written("--plot", plot, lambda: write_plot(replays, plot, title))
        except ModelForgeError as error:
            _fail(error)
        if not as_json:
            out.print(escape(f"wrote {plot}"), highlight=False, soft_wrap=True)


def _show_table(record: RecordScenario, runs: list[Replayed], window: str, proposed: bool) -> None:
    from modelforge.cli_common import err, out
    from modelforge.simulate import comparison_table

    title = (
        f"pool {record.pool}, last {window}: {len(record.lines)} recorded requests replayed"
        " through the production policy (simulated cards)"
    )
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for run in runs:
        table.add_column(run.label, justify="right")
    for label, cells in comparison_table(runs):
        table.add_row(escape(label), *(escape(c) for c in cells))
    out.print(table)
    for note in record.notes:
        out.print(escape(f"note: {note}"), highlight=False, soft_wrap=True)
    if proposed and runs[-1].figures["invariant_violations"]:
        err.print("[red]warning[/red]: the proposed catalog's replay broke the memory invariant", highlight=False)
