"""A progress bar for long replays, on stderr: the command's output (a table, or JSON) stays clean
on stdout, and a replay shorter than `after_s` never draws one."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

from modelforge.simulate._engine import Progress as ProgressCallback


class ReplayProgress:
    def __init__(self, console: Console, after_s: float = 1.0) -> None:
        self.console = console
        self.after_s = after_s
        self.bar: Progress | None = None
        self.shown = False

    def __enter__(self) -> ReplayProgress:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def policy(self, name: str, total: int) -> ProgressCallback:
        """The callback for one policy's replay: its row appears once the replay has run for
        `after_s` of wall time (or at once, when an earlier policy's already did)."""
        started = time.perf_counter()
        task: list[TaskID] = []

        def update(ended: int, requests: int, virtual_t: float) -> None:
            if self.bar is None:
                if time.perf_counter() - started < self.after_s:
                    return
                self.bar = Progress(
                    TextColumn("{task.description}"),
                    BarColumn(),
                    MofNCompleteColumn(),
                    TextColumn("requests ended, virtual {task.fields[virtual]}"),
                    TimeElapsedColumn(),
                    console=self.console,
                    transient=True,
                )
                self.bar.start()
                self.shown = True
            if not task:
                task.append(self.bar.add_task(name, total=requests, virtual=""))
            self.bar.update(task[0], completed=ended, virtual=f"{virtual_t:,.0f} s")

        return update
