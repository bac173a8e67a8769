"""The progress bar long runs show on stderr (`pdd bench`, `pdd demo`, `pdd soak`, `pdd plan`, `pdd sim calibrate`)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def progress_bar(console: Console, quiet: bool) -> Progress:
    """Done of total and the time so far; hidden when quiet or when stderr is no terminal
    (a log file gets no redraws)."""
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet or not console.is_terminal,
    )
