"""Write a comparison of bench summaries as report.json, PNG plots and report.html.

The console table answers "which mode won"; the plots show *where*: PDD's claim is about
the tail (p90/p99 TTFT hidden by RelayDecode) and about what crosses the line, which a
column of numbers hides. The HTML page is self-contained (inline CSS, images by relative
name) so the whole output folder can be copied or attached as it is.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from rich.table import Table

from pdd.lab.bench.headline import format_headlines, headlines
from pdd.lab.bench.summary import PIPELINES, format_hardware_table, format_table

_QUANTILES = ("p50", "p90", "p99")
_QUANTILE_COLORS = ("#4c72b0", "#dd8452", "#c44e52")
# Above this max/min ratio a linear axis squashes the short bars to nothing.
_LOG_RATIO = 30.0
_DPI = 110

Summaries = Mapping[str, Mapping[str, Any]]


def write_report(out_dir: Path, summaries: dict[str, dict], *, title: str, meta: dict) -> dict[str, Path]:
    """Write the report files into `out_dir`; return them by kind ("json", "html", plots).

    Modes appear in the order of `summaries`. A plot whose values are all zero or missing
    (e.g. RelayDecode shares when no mode has a RelayDecode) is not drawn, and a stale
    copy from an earlier run in the same folder is removed so the page never shows it.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {"json": out_dir / "report.json"}
    _write_atomic(written["json"], json.dumps({"modes": summaries, "meta": meta}, indent=2, allow_nan=False) + "\n")
    for name, _, draw in _PLOTS:
        path = out_dir / f"{name}.png"
        figure = draw(summaries)
        if figure is None:
            path.unlink(missing_ok=True)
            continue
        FigureCanvasAgg(figure)
        figure.savefig(path, dpi=_DPI)
        written[name] = path
    plots = [(written[name].name, caption) for name, caption, _ in _PLOTS if name in written]
    written["html"] = out_dir / "report.html"
    _write_atomic(written["html"], _html(summaries, title=title, meta=meta, plots=plots))
    return written


def write_requests(out_dir: Path, records: Mapping[str, list[dict]]) -> Path:
    """Every request's record, by mode (`requests.json`): what the summaries summarize."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "requests.json"
    _write_atomic(path, json.dumps(records, allow_nan=False) + "\n")
    return path


def _write_atomic(path: Path, text: str) -> None:
    """A reader (or a browser refreshing) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---------------------------------------------------------------------------- plots


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and v > 0]


def _figure(panels: int, modes: int) -> tuple[Figure, list[Axes]]:
    width = max(5.5, 1.1 * modes + 2.5) * panels
    figure = Figure(figsize=(width, 4.2), layout="constrained")
    return figure, list(figure.subplots(1, panels, squeeze=False)[0])


def _no_data(ax: Axes, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax.set_xticks([])
    ax.set_yticks([])


def _short(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def _label_panel(ax: Axes, modes: list[str], unit: str, title: str) -> None:
    """The axes, title and legend every grouped-bar panel shares."""
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel(unit)
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.12)


def _quantile_panel(ax: Axes, summaries: Summaries, key: str, title: str) -> None:
    """p50/p90/p99 side by side per mode, log scale when the spread is wide."""
    modes = list(summaries)
    rows = {q: [(summaries[m].get(key) or {}).get(q) for m in modes] for q in _QUANTILES}
    present = _present([v for values in rows.values() for v in values])
    if not present:
        _no_data(ax, title)
        return
    width = 0.8 / len(_QUANTILES)
    for i, (q, color) in enumerate(zip(_QUANTILES, _QUANTILE_COLORS, strict=True)):
        heights = [math.nan if v is None else v for v in rows[q]]
        offsets = [x + (i - 1) * width for x in range(len(modes))]
        bars = ax.bar(offsets, heights, width, label=q, color=color)
        ax.bar_label(bars, labels=["" if v is None else _short(v) for v in rows[q]], fontsize=7, padding=1)
    if max(present) / min(present) > _LOG_RATIO:
        ax.set_yscale("log")
    _label_panel(ax, modes, "ms", title)


def _ttft_plot(summaries: Summaries) -> Figure | None:
    if not _present([(s.get("ttft_ms") or {}).get(q) for s in summaries.values() for q in _QUANTILES]):
        return None
    figure, (ax,) = _figure(1, len(summaries))
    _quantile_panel(ax, summaries, "ttft_ms", "Time to first token")
    return figure


def _decode_plot(summaries: Summaries) -> Figure | None:
    keys = ("tpot_ms", "max_itl_ms")
    if not _present([(s.get(k) or {}).get(q) for s in summaries.values() for k in keys for q in _QUANTILES]):
        return None
    figure, (left, right) = _figure(2, len(summaries))
    _quantile_panel(left, summaries, "tpot_ms", "Time per output token")
    _quantile_panel(right, summaries, "max_itl_ms", "Longest gap between two tokens")
    return figure


def _byte_unit(largest: float) -> tuple[str, float]:
    for unit, size in (("GiB", 1024.0**3), ("MiB", 1024.0**2), ("KiB", 1024.0)):
        if largest >= size:
            return unit, size
    return "B", 1.0


def _line_plot(summaries: Summaries) -> Figure | None:
    modes = list(summaries)
    line_bytes = [summaries[m].get("line_bytes") or 0 for m in modes]
    hits = [summaries[m].get("d_hit_rate") for m in modes]
    if not _present(line_bytes) and not _present(hits):
        return None
    figure, (left, right) = _figure(2, len(modes))
    if _present(line_bytes):
        unit, size = _byte_unit(max(line_bytes))
        bars = left.bar(modes, [b / size for b in line_bytes], color="#55a868")
        left.bar_label(bars, labels=[f"{b / size:,.1f}" for b in line_bytes], fontsize=8, padding=1)
        left.set_ylabel(unit)
        left.set_title("Bytes across the line")
        left.margins(y=0.12)
    else:
        _no_data(left, "Bytes across the line")
    if _present(hits):
        bars = right.bar(modes, [math.nan if h is None else 100 * h for h in hits], color="#8172b3")
        right.bar_label(bars, labels=["" if h is None else f"{100 * h:.1f} %" for h in hits], fontsize=8, padding=1)
        right.set_ylim(0, 110)
        right.set_ylabel("% of prompt tokens")
        right.set_title("Decode-side prefix-cache hit rate")
    else:
        _no_data(right, "Decode-side prefix-cache hit rate")
    return figure


def _producer_plot(summaries: Summaries) -> Figure | None:
    """Who produced the output tokens, and through which pipeline requests went."""
    modes = list(summaries)
    rld = [summaries[m].get("relay_output_tokens") or 0 for m in modes]
    md = [summaries[m].get("main_output_tokens") or 0 for m in modes]
    counts: dict[str, list[int]] = {
        p: [(summaries[m].get("pipelines") or {}).get(p) or 0 for m in modes] for p in PIPELINES
    }
    if not any(rld) and not any(md) and not any(any(c) for c in counts.values()):
        return None
    figure, (left, right) = _figure(2, len(modes))
    if any(rld) or any(md):
        totals = [summaries[m].get("output_tokens") or 0 for m in modes]
        # Tokens neither RLD nor MD claims come from a baseline's decoder; shown so every
        # bar reaches 100 % and baselines read as "no relay" rather than as missing.
        other = [max(0, t - r - d) for t, r, d in zip(totals, rld, md, strict=True)]
        bottom = [0.0] * len(modes)
        for label, part, color in (
            ("RelayDecode", rld, "#dd8452"),
            ("MainDecode", md, "#4c72b0"),
            ("baseline decoder", other, "#bbbbbb"),
        ):
            share = [100 * p / t if t else 0.0 for p, t in zip(part, totals, strict=True)]
            bars = left.bar(modes, share, bottom=bottom, label=label, color=color)
            left.bar_label(
                bars, labels=[f"{s:.1f} %" if s >= 3 else "" for s in share], label_type="center", fontsize=8
            )
            bottom = [b + s for b, s in zip(bottom, share, strict=True)]
        # Headroom above 100 % keeps the legend off the bars and their labels.
        left.set_ylim(0, 118)
        left.set_yticks(range(0, 101, 20))
        left.set_ylabel("% of output tokens")
        left.set_title("Output tokens by producer")
        left.legend(fontsize=8, loc="upper center", ncols=3)
    else:
        _no_data(left, "Output tokens by producer")
    if any(any(c) for c in counts.values()):
        _count_panel(right, modes, counts, "Requests by pipeline")
    else:
        _no_data(right, "Requests by pipeline")
    return figure


def _count_panel(ax: Axes, modes: list[str], counts: Mapping[str, list[int]], title: str) -> None:
    """Request counts per mode, one bar per series, side by side."""
    width = 0.8 / len(counts)
    for i, (label, values) in enumerate(counts.items()):
        offsets = [x + (i - (len(counts) - 1) / 2) * width for x in range(len(modes))]
        bars = ax.bar(offsets, values, width, label=label)
        ax.bar_label(bars, labels=[str(v) if v else "" for v in values], fontsize=7)
    _label_panel(ax, modes, "requests", title)


def _handoff_plot(summaries: Summaries) -> Figure | None:
    """MD's stall when it takes over, and how the relayed requests ended."""
    modes = list(summaries)
    if not _present([(s.get("handoff_stall_ms") or {}).get(q) for s in summaries.values() for q in _QUANTILES]):
        return None
    figure, (left, right) = _figure(2, len(modes))
    _quantile_panel(left, summaries, "handoff_stall_ms", "MD's extend stall at a handoff")
    kinds = {
        "one-shot handoff": ("handoffs", "one_shot"),
        "catch-up handoff": ("handoffs", "catch_up"),
        "ended on the relay": ("fallbacks", "relay_finished"),
    }
    counts = {
        label: [(summaries[m].get(key) or {}).get(name, 0) for m in modes] for label, (key, name) in kinds.items()
    }
    _count_panel(right, modes, counts, "Requests through a relay")
    return figure


_PLOTS: list[tuple[str, str, Callable[[Summaries], Figure | None]]] = [
    ("ttft", "Time to first token, p50 / p90 / p99 per mode.", _ttft_plot),
    (
        "decode",
        "Time per output token and the longest stall between two tokens (a handoff's extend step shows up here).",
        _decode_plot,
    ),
    (
        "line",
        "Bytes that crossed the line, and the decode side's prefix-cache hit rate that keeps them low.",
        _line_plot,
    ),
    (
        "producers",
        "Share of output tokens produced by RelayDecode and MainDecode, and requests per pipeline.",
        _producer_plot,
    ),
    (
        "handoffs",
        "The stall of MainDecode's extend step when a relay hands a request over by "
        "token IDs, and how requests through a relay ended.",
        _handoff_plot,
    ),
]


# ----------------------------------------------------------------------------- html

_PAGE = jinja2.Environment(
    loader=jinja2.PackageLoader("pdd.lab.bench", "templates"),
    autoescape=True,
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
).get_template("report.html.jinja")


class _TableRows(NamedTuple):
    header: list[str]
    rows: list[list[str]]


def _rows(table: Table) -> _TableRows:
    """A console table's header and rows, so the page and the terminal agree."""
    cells = [[str(cell) for cell in c.cells] for c in table.columns]
    return _TableRows([str(c.header) for c in table.columns], [list(row) for row in zip(*cells, strict=True)])


def _meta_rows(meta: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
    """(key, text, whether it is a block) per field; the three every report has come first."""
    order = [k for k in ("date", "command", "config") if k in meta]
    order += [k for k in meta if k not in order]
    out = []
    for key in order:
        value = meta[key]
        text = value if isinstance(value, str) else json.dumps(value, indent=2, default=str)
        out.append((key, text, not isinstance(value, str) or "\n" in value))
    return out


def _html(summaries: Summaries, *, title: str, meta: Mapping[str, Any], plots: list[tuple[str, str]]) -> str:
    hardware = format_hardware_table(summaries)
    figures_of_run = headlines(summaries)
    headline = None if all(h.value is None for h in figures_of_run) else _rows(format_headlines(figures_of_run))
    return _PAGE.render(
        title=title,
        meta=_meta_rows(meta),
        key_numbers=_rows(format_table(summaries)),
        headline=headline,
        hardware=None if hardware is None else _rows(hardware),
        plots=plots,
    )
