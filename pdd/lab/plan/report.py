"""What `pdd plan` prints: the verdict first (does B pay, at which price, what decides
it), then the detail: the ranked layouts with their ties, each family's best, each
side's layout, the assumptions, and the publication's layouts head to head."""

from __future__ import annotations

from typing import Any

from pdd.lab.plan import paper
from pdd.lab.plan.file import Fleet
from pdd.lab.plan.layouts import SIZE_TOLERANCE
from pdd.lab.plan.planner import Probe, cells_for, search_resolution, tie
from pdd.lab.plan.workload import Workload


def assumption_line(probe: Probe, workload: Workload, setting: paper.Setting = paper.SETTING) -> str:
    chips = "; ".join(
        f"GPU {hw} = {c.name} ({c.bf16_tflops:g} TFLOPS BF16, {c.mem_bw_gbs / 1000:g} TB/s, "
        f"{c.mem_gb:g} GB) at {c.price_per_hour:g}, {_sides(setting, hw)}"
        for hw, c in (("A", setting.a), ("B", setting.b))
    )
    return (
        f"{setting.model.name} ({setting.model.note}). {chips}. Memory "
        f"{setting.memory_utilization:.0%} for weights + KV. A line costs {setting.line_price_per_gbps_hour:g} per "
        f"Gbit/s, {setting.one_way_ms:g} ms one way, "
        f"TCP (initial window {setting.tcp.initial_window_segments}, {setting.tcp.window_bytes / 2**20:g} MiB "
        f"buffers). SLO: TTFT <= {probe.slo[0]:g} ms and TPOT <= {probe.slo[1]:g} ms for "
        f"{probe.attainment:.0%} of requests. Workload: {workload.name}; each probe judges {probe.requests} "
        f"requests, and at least {probe.min_window_s:g} s, after a warm start and {probe.warmup_s:g} s; "
        f"goodput found to "
        f"{search_resolution(probe):.0%}. Costs are the chips' and the line's prices an hour; BCR = goodput / cost."
    )


def cells_line(max_gpus: int, cell_gpus: int) -> str:
    """How a budget past `--cell-gpus` was planned (`pdd.lab.plan.planner.Layout.cells`)."""
    cells = cells_for(max_gpus, cell_gpus)
    return (
        f"Cells: {max_gpus} GPUs are planned as {cells} identical cells of at most {max_gpus // cells} "
        f"(--cell-gpus {cell_gpus}), each its own deployment on its share of the line, sessions split among them "
        "by a session-affine balancer; one cell is simulated at its share of the rate, and its rates and costs "
        "are multiplied by the cells."
    )


def _sides(setting: paper.Setting, hw: str) -> str:
    """Each side's instance on `hw`: its GPUs and attention layout."""
    parts = []
    for side in ("prefill", "decode"):
        chosen = setting.role_layout(hw, side)
        parts.append(f"{side} {chosen.gpus} GPUs {chosen.attention}" if chosen else f"{side}: does not fit")
    return ", ".join(parts)


def rows_table(rows: list[dict[str, Any]], title: str, probe: Probe):
    """The rows as ranked, each BCR against the first's (a tie where inside the search's
    resolution: a ranking that it cannot tell apart)."""
    from rich.table import Table

    table = Table(title=title)
    columns = (
        "#",
        "layout",
        "GPUs",
        "goodput req/s",
        "capacity",
        "cost/h",
        "BCR",
        "vs #1",
        "binding",
        "TTFT p50/p99 ms",
    )
    for col in columns:
        table.add_column(col, justify="left" if col in ("layout", "GPUs", "binding") else "right")
    top = next((r["bcr"] for r in rows if r["simulated"] and r["goodput_rps"]), None)
    for i, r in enumerate(rows, 1):
        ttft = (
            "-"
            if r["ttft_p50_ms"] is None or r["goodput_rps"] is None
            else f"{r['ttft_p50_ms']:,.0f}/{r['ttft_p99_ms']:,.0f}"
        )
        if r["goodput_rps"] is None:  # missed the SLO at the rate that would beat its family's best
            goodput, bcr = f"missed {r['missed_rps']:.1f}", "-"
        else:
            cut = "screened out" if r.get("screened_out") else "pruned"
            goodput, bcr = f"{r['goodput_rps']:.1f}" if r["simulated"] else cut, f"{r['bcr']:.3f}"
        table.add_row(
            str(i),
            r["layout"],
            "+".join(f"{n}{k}" for k, n in r["gpus"].items()),
            goodput,
            f"{r['capacity_rps']:.1f}",
            f"{r['cost_per_hour']:.1f}",
            bcr,
            _versus_top(r, top, i, probe),
            r["binding"],
            ttft,
        )
    return table


def _versus_top(row: dict[str, Any], top: float | None, rank: int, probe: Probe) -> str:
    if rank == 1 and top:
        return "best"
    if not (top and row["simulated"] and row["goodput_rps"]):
        return "-"
    return judged(row["bcr"] / top - 1, probe, short=True)


def breakdown_table(steps: list[dict[str, Any]], probe: Probe):
    from rich.table import Table

    def pct(value: float | None) -> str:
        return "-" if value is None else f"{value:+.1%}"

    table = Table(
        title="from same-dc PD on A to PDD, one change at a time (each against the row before; "
        f"tie: inside the search's {search_resolution(probe):.0%})"
    )
    for col in ("step", "layout", "goodput", "cost", "BCR", "TTFT p99"):
        table.add_column(col, justify="left" if col in ("step", "layout") else "right")
    for s in steps:
        table.add_row(
            s["step"],
            s["layout"] or "-",
            judged(s["goodput_change"], probe, short=True),
            pct(s["cost_change"]),  # (exact: goodput, and so BCR, are known to the search's resolution)
            judged(s["bcr_change"], probe, short=True),
            pct(s["ttft_p99_change"]),
        )
    return table


def judged(change: float | None, probe: Probe, short: bool = False) -> str:
    """A change of goodput or BCR, a tie where it is inside the search's resolution (`tie`)."""
    if change is None:
        return "-"
    if not tie(change, probe):
        return f"{change:+.1%}"
    return (
        f"{change:+.1%} (tie)"
        if short
        else f"{change:+.1%} (a tie: inside the search's {search_resolution(probe):.0%})"
    )


def versus_line(versus: dict[str, Any] | None, probe: Probe) -> str:
    if versus is None:
        return "Head to head: a published layout met the SLO at no rate searched."
    pub = versus["published"]
    changes = [versus[k] for k in ("goodput_change", "bcr_change", "bcr_change_their_costs")]
    ties = (
        f" (A tie: inside the search's {search_resolution(probe):.0%}.)" if any(tie(c, probe) for c in changes) else ""
    )
    goodput, bcr, theirs = (judged(c, probe, short=True) for c in changes)
    return (
        f"Head to head, PDD against same-dc PD as published: goodput {goodput} "
        f"(published {pub['goodput_change']:+.1%}), cost {versus['cost_change']:+.1%} as built, line priced "
        f"({versus['their_cost_change']:+.1%} by the publication's GPU counts; published "
        f"{pub['cost_change'][0]:+.1%} to {pub['cost_change'][1]:+.1%}), BCR {bcr} "
        f"({theirs} at the publication's costs; published up to "
        f"{pub['bcr_change']:+.1%}). {_flip_line(versus)}{ties}"
    )


def _flip_line(versus: dict[str, Any]) -> str:
    """What would make PDD's BCR equal same-dc PD's, one figure at a time."""
    price = versus["flip_b_price"]
    if price is None:
        at_price = ""
    elif price <= 0:
        at_price = f"; no price of B would, not even free B GPUs (B is at {versus['b_price']:g} a GPU hour)"
    else:
        at_price = f", or B at {price:.2f} a GPU hour (now {versus['b_price']:g})"
    return f"The BCRs would be equal at a PDD goodput of {versus['flip_goodput_rps']:.1f} req/s{at_price}."


def verdict_lines(v: dict[str, Any] | None, ratio: paper.Rho | None, probe: Probe) -> list[str]:
    """The first lines: does PDD with B pay at B's price, by how much, against what; B's
    break-even prices from re-pricing the rows; and what decides it."""
    rho = f"rho = {ratio.rho:.2f} (B's decode tokens per price over A's)" if ratio else "rho: none (no fit)"
    if v is None:
        return [f"Does PDD with B pay? Undecided: PDD or every alternative met the SLO at no rate searched. {rho}."]
    answer = {"yes": "YES", "no": "NO", "tie": "TIE"}[v["answer"]]
    first = (
        f"Does PDD with B pay at B = {v['b_price']:g} an hour? {answer}: its best, {v['pdd']}, has BCR "
        f"{judged(v['bcr_change'], probe)} against the best alternative, {v['rival']} ({v['rival_family']})."
    )
    lines = [first, f"B's break-even price (re-pricing the rows below): {_price_line(v['pdd_break_even'], 'PDD')}"]
    if v["b_break_even"] is not None:
        lines[-1] += f"; {_price_line(v['b_break_even'], 'the best layout with B against the best all-A')}"
    lines.append(
        f"What decides it: {rho}; PDD's best is bound by {v['binding']['pdd']}, the alternative by "
        f"{v['binding']['rival']}."
    )
    return lines


def _price_line(even: dict[str, Any], who: str) -> str:
    if not even["wins"]:
        return f"{who} loses at every price of B up to {even['span']:.3g} an hour, even free B GPUs"
    if even["wins"] == [[0.0, even["span"]]]:
        return f"{who} wins at every price of B up to {even['span']:.3g} an hour"
    ranges = " and ".join(_range(low, high, even["span"]) for low, high in even["wins"])
    return f"{who} wins {ranges} an hour"


def _range(low: float, high: float, span: float) -> str:
    if low == 0.0:
        return f"below {high:.3g}"
    return f"above {low:.3g}" if high == span else f"between {low:.3g} and {high:.3g}"


def seeds_line(spread: list[dict[str, Any]], probe: Probe) -> str:
    """The verdict's two layouts probed again with other seeds: each goodput's range and
    the BCR change's, a tie where the seeds disagree on its sign."""
    pdd = [s["pdd_rps"] for s in spread]
    rival = [s["rival_rps"] for s in spread]
    changes = [s["bcr_change"] for s in spread]
    split = min(changes) < 0 < max(changes)
    return (
        f"Over {len(spread)} seeds: PDD's best {min(pdd):.2f}-{max(pdd):.2f} req/s, the alternative "
        f"{min(rival):.2f}-{max(rival):.2f}; BCR change {min(changes):+.1%} to {max(changes):+.1%}"
        + (" (a tie: the seeds disagree on the sign)." if split else ".")
    )


def sides_table(options: list[dict[str, Any]]):
    """Each side's layouts on each chip, priced, the best size of each layout (and any
    chosen); the chosen marked with the sides that took them, those within
    `SIZE_TOLERANCE` of the best a tie, and those serving cannot run."""
    from rich.table import Table

    table = Table(title="each side's attention layout and instance size (EP over the instance), by tokens/s per price")
    for col in ("side", "chip", "attention", "GPUs", "tokens/s", "per price", ""):
        table.add_column(col, justify="left" if col in ("side", "chip", "attention", "") else "right")
    best: dict[tuple[str, str, str], dict[str, Any]] = {}
    for o in options:
        key = (o["side"], o["hw"], o["attention"])
        if key not in best or o["per_price"] > best[key]["per_price"]:
            best[key] = o
    for o in sorted(options, key=lambda o: (o["side"], o["hw"], -o["per_price"])):
        if not o["chosen"] and best[(o["side"], o["hw"], o["attention"])] is not o:
            continue
        top = max(x["per_price"] for x in options if (x["side"], x["hw"]) == (o["side"], o["hw"]))
        tied = o["per_price"] >= (1 - SIZE_TOLERANCE) * top  # (a ranking it cannot tell apart)
        mark = ("chosen: " + ", ".join(o["chosen"])) if o["chosen"] else ("tie" if tied else "")
        if not o["served"]:
            mark = f"{mark} not served: {o['why_not_served']}".strip()
        cells = (o["side"], f"{o['hw']} {o['chip']}", o["attention"], str(o["gpus"]))
        table.add_row(*cells, f"{o['tokens_per_s']:,.0f}", f"{o['per_price']:,.1f}", mark)
    return table


def slim(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows without their runs' detail."""
    return [{k: v for k, v in r.items() if k != "run"} for r in rows]


def assumptions(setting: paper.Setting, probe: Probe, workload: Workload, fleet: Fleet) -> dict[str, Any]:
    """Everything a plan assumed, for its JSON."""
    return setting.to_dict() | {
        "slo": {"ttft_ms": probe.slo[0], "tpot_ms": probe.slo[1], "attainment": probe.attainment},
        "workload": workload.name,
        "fleet": {"owned": fleet.owned, "budget_per_hour": fleet.budget_per_hour},
        "probe": {
            "judged_requests": probe.requests,
            "warmup_s": probe.warmup_s,
            "min_window_s": probe.min_window_s,
            "steps": probe.steps,
        },
    }


def step_lines(steps: list[dict[str, Any]]) -> list[str]:
    """Where each side's step times come from: AIConfigurator (the roofline fitted to it,
    and how closely), or the roofline, and why."""
    lines = []
    for step in steps:
        source = step["source"] + (f" (fit within {step['fit_error']:.0%})" if "scale" in step else f": {step['why']}")
        lines.append(
            f"Step times, {step['side']} on {step['chip']} ({step['attention']}, {step['gpus']} GPUs): {source}"
        )
    return lines
