"""`pdd plan --plan-file`: the buyer's chips, prices, fleet, line and model (a Hugging
Face config.json) read from one TOML file, a mistake one line naming the key; the model's
shape computed from its config; and the verdict's break-even price, which must agree with
a re-pricing of the rows the run printed."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdd.lab.plan import paper
from pdd.lab.plan.args import add_plan_arguments
from pdd.lab.plan.command import _prepare, plan_main
from pdd.lab.plan.planner import Probe
from pdd.lab.plan.report import verdict_lines
from pdd.lab.plan.verdict import break_even, repriced_bcr, verdict
from pdd.perf.hf_model import ModelConfigError, load_model, shape_from_config
from pdd.perf.model import BF16, FP8, MODELS

DEEPSEEK = Path(__file__).parent / "data" / "deepseek-v3" / "config.json"

PLAN = f"""
[chips.X1]
memory_gb = 96
hbm_tbps = 4.0
tflops_bf16 = 700
tflops_fp8 = 1400
price_per_hour = 2.0

[chips.H800]
price_per_hour = 1.9

[sites]
A = "H800"
B = "X1"

[fleet]
gpus = 64
owned = {{ H800 = 48 }}
budget_per_hour = 400

[line]
gbps = [100]
rtt_ms = 40
price_per_gbps_hour = 0.05

[model]
config = "{DEEPSEEK}"

[workload]
task_tokens = [512, 1024]
"""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_plan_arguments(parser)
    return parser


def test_a_deepseek_v3_config_is_priced_from_its_fields() -> None:
    """DeepSeek-V3's config.json: 671B parameters, 37B active, MLA's latent of 512 + 64
    values a layer in BF16 (70,272 bytes a token), FP8 weights. A Kimi-K2-shaped config
    gives the catalog's hand-counted model, parameter for parameter."""
    v3 = load_model(DEEPSEEK)
    assert v3.name == "deepseek-v3" and v3.experts == 256 and v3.top_k == 8 and v3.moe_layers == 58
    assert 670e9 < v3.total_params < 672e9 and 36e9 < v3.active_params < 38e9
    assert v3.kv_bytes_per_token == 61 * (512 + 64) * BF16 and v3.kv_heads == 1
    assert v3.expert_bytes_per_param == v3.dense_bytes_per_param == FP8 and v3.expert_fp8
    config = json.loads(DEEPSEEK.read_text())
    kimi = config | {"n_routed_experts": 384, "num_attention_heads": 64, "first_k_dense_replace": 1}
    kimi |= {"vocab_size": 163840}
    shape, catalog = shape_from_config(kimi, "k2"), MODELS["paper-1t"]
    for field in ("expert_params", "dense_params", "embedding_params", "prefill_flops_per_pair"):
        assert getattr(shape, field) == pytest.approx(getattr(catalog, field)), field
    assert shape.decode_flops_per_pair == pytest.approx(catalog.decode_flops_per_pair)
    llama = {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    }
    dense = shape_from_config(llama, "llama-70b")
    assert dense.moe_layers == 0 and 69e9 < dense.total_params < 72e9 and dense.kv_heads == 8
    assert dense.kv_bytes_per_token == 80 * 2 * 8 * 128 * BF16
    with pytest.raises(ModelConfigError, match="num_experts_per_tok"):
        shape_from_config(config | {"num_experts_per_tok": 300}, "bad")
    with pytest.raises(ModelConfigError, match="^config.json: hidden_size is missing$"):
        shape_from_config({k: v for k, v in config.items() if k != "hidden_size"}, "bad")


def test_the_plan_file_sets_the_chips_prices_fleet_line_and_model(tmp_path: Path) -> None:
    (tmp_path / "deepseek-v3").mkdir()
    (tmp_path / "deepseek-v3" / "config.json").write_text(DEEPSEEK.read_text())
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.replace(str(DEEPSEEK), "deepseek-v3/config.json"))  # (relative to the file)
    plan = _prepare(_parser().parse_args(["--plan-file", str(path)]))
    s = plan.setting
    assert (s.a.name, s.a.price_per_hour, s.a.mem_gb) == ("H800", 1.9, 80.0)  # the catalog's, re-priced
    assert (s.b.name, s.b.mem_gb, s.b.mem_bw_gbs, s.b.fp8_tflops, s.b.price_per_hour) == ("X1", 96, 4000, 1400, 2)
    assert s.one_way_ms == 20.0 and s.line_price_per_gbps_hour == 0.05 and s.model.name == "deepseek-v3"
    assert plan.fleet.owned == {"A": 48} and plan.fleet.budget_per_hour == 400
    for lay in plan.layouts:
        bill = paper.bill(lay.spec(s), s)
        assert bill.gpus.get("A", 0) <= 48 and bill.per_hour <= 400 and sum(bill.gpus.values()) <= 64
        assert lay.line_gbps in (0.0, 100.0)
    assert {lay.family for lay in plan.layouts} >= {"pdd", "pd-same-dc-b", "pd-same-dc"}  # all-A: on the 48 owned
    for lay in plan.layouts:  # each spends what the fleet allows: no further instance would fit it
        for more in (replace(lay, prefill=lay.prefill + 1), replace(lay, main=lay.main + 1)):
            assert not plan.fleet.allows(more, s, 64), (lay, more)
    spec = next(lay for lay in plan.layouts if lay.family == "pdd").spec(s)
    assert spec.line.one_way_ms == 20.0 and spec.line.price_per_hour == pytest.approx(5.0)
    flags = _prepare(_parser().parse_args(["--plan-file", str(path), "--max-gpus", "48", "--line-gbps", "25"]))
    assert all(lay.gpus(flags.setting) <= 48 and lay.line_gbps in (0.0, 25.0) for lay in flags.layouts)
    path.write_text(path.read_text().replace("budget_per_hour = 400", "budget_per_hour = 400\ncell_gpus = 64"))
    cells = _prepare(_parser().parse_args(["--plan-file", str(path), "--max-gpus", "128"]))
    assert cells.layouts and {lay.cells for lay in cells.layouts} == {2}
    assert all(cells.fleet.allows(lay, s, 128) for lay in cells.layouts)  # the fleet owned is every cell's
    with pytest.raises(ValueError, match="no layout fits a cell of 32 GPUs"):
        _prepare(_parser().parse_args(["--plan-file", str(path), "--cell-gpus", "32"]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("hbm_tbps = 4.0", "hbm_tbs = 4.0"), "[chips.X1] hbm_tbs: unknown key"),
        (("hbm_tbps = 4.0\n", ""), "[chips.X1] hbm_tbps: missing"),
        (('B = "X1"', 'B = "X2"'), "[sites] B: unknown chip 'X2'"),
        (("rtt_ms = 40", 'rtt_ms = "forty"'), "[line] rtt_ms: expected a number > 0, got 'forty'"),
        (("[fleet]", "[fleets]"), "[fleets]: unknown table"),
        (("rtt_ms = 40", "rtt = 40"), "[line] rtt: unknown key (expected one of gbps, rtt_ms, price_per_gbps_hour)"),
        (("owned = { H800 = 48 }", "owned = { H100 = 48 }"), "[fleet] owned.H100: not a chip of [sites]"),
        (("task_tokens = [512, 1024]", "task_tokens = 512"), "[workload] task_tokens: expected [LOW, HIGH]"),
        (('config = "', 'config = "/nowhere'), "[model] config: /nowhere"),
        (("budget_per_hour = 400", "cell_gpus = -8"), "[fleet] cell_gpus: expected GPUs >= 0 (0: one cell), got -8"),
    ],
)
def test_a_mistake_in_the_plan_file_is_one_line_naming_the_key(tmp_path: Path, capsys, change, message) -> None:
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.replace(*change, 1))
    assert plan_main(_parser().parse_args(["--plan-file", str(path), "--quiet"])) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pdd plan: {message}") and err.count("\n") == 1, err


def _row(family: str, goodput: float, a: int, b: int, b_price: float, line: float = 0.0) -> dict:
    cost = a * 1.0 + b * b_price + line
    gpus = {k: n for k, n in (("A", a), ("B", b)) if n}
    return {
        "layout": f"{family} {a}A {b}B",
        "family": family,
        "gpus": gpus,
        "goodput_rps": goodput,
        "cost_per_hour": cost,
        "bcr": goodput / cost,
        "simulated": True,
        "binding": "main",
    }


def test_the_break_even_price_is_where_the_re_priced_rows_tie() -> None:
    """B at 1.25: PDD (48 A + 32 B) against all-A (80 A) and all-B (64 B). Its break-even
    price is where its re-priced BCR meets the best alternative's, whichever that is there;
    PDD wins below it and loses above; a PDD that loses even with free B says so."""
    rows = [
        _row("pdd", 14.0, 48, 32, 1.25, 1.0),
        _row("pd-same-dc", 10.0, 80, 0, 1.25),
        _row("pd-same-dc-b", 9.0, 0, 64, 1.25),
    ]
    found = verdict(rows, 1.25, Probe())
    assert found is not None and found["pdd"] == "pdd 48A 32B" and found["rival"] == "pd-same-dc 80A 0B"
    assert found["answer"] == "yes" and found["bcr_change"] == pytest.approx((14 / 89) / (10 / 80) - 1)
    even = found["pdd_break_even"]

    def gap(price: float) -> float:
        pdd = repriced_bcr(rows[0], price, 1.25)
        return pdd / max(repriced_bcr(r, price, 1.25) for r in rows[1:]) - 1

    # free B GPUs make all-B the best; dear ones all-A: PDD wins between
    assert len(even["prices"]) == 2 and even["wins"] == [even["prices"]]
    low, high = even["prices"]
    for price in (low, high):
        assert gap(price) == pytest.approx(0.0, abs=1e-8)
        assert gap(price * 0.99) * gap(price * 1.01) < 0
    assert low == pytest.approx(9 * 49 / (64 * 14 - 9 * 32))  # 14 / (49 + 32p) = 9 / (64p)
    assert high == pytest.approx((14 / (10 / 80) - 48 - 1) / 32)  # 14 / (49 + 32p) = 10 / 80
    assert "PDD wins between 0.725 and 1.97 an hour" in verdict_lines(found, None, Probe())[1]
    losing = [_row("pdd", 6.0, 48, 32, 1.25, 1.0), *rows[1:]]
    assert break_even(losing[:1], losing[1:], 1.25) == {"prices": [], "wins": [], "span": 10.0}


def test_the_verdict_of_a_plan_file_run_agrees_with_re_pricing_its_rows(tmp_path: Path, capsys) -> None:
    """The must-show run, small: a chip the catalog lacks, the buyer's prices, a fleet owned,
    DeepSeek-V3's config.json and a 40 ms line. The verdict is the first lines printed, and
    its break-even prices are where the printed rows, re-priced, tie; `--seeds 2` probes
    the verdict's two layouts again with another seed and prints the spread."""
    path = tmp_path / "plan.toml"
    path.write_text(PLAN)
    out = tmp_path / "plan.json"
    args = ["--plan-file", str(path), "--requests", "20", "--warmup-s", "5", "--min-window-s", "0", "--steps", "1"]
    args += ["--workers", "1", "--no-published", "--quiet", "--out", str(out), "--seeds", "2"]
    assert plan_main(_parser().parse_args(args)) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert printed.startswith("Does PDD with B pay at B = 2 an hour?")
    report = json.loads(out.read_text())
    found, rows = report["verdict"], [r for r in report["layouts"] if r["simulated"] and r["goodput_rps"]]
    assert found is not None, printed
    pdd = [r for r in rows if r["family"] == "pdd"]
    others = [r for r in rows if r["family"] != "pdd"]

    def gap(price: float) -> float:
        best = max(repriced_bcr(r, price, 2.0) for r in pdd)
        return best / max(repriced_bcr(r, price, 2.0) for r in others) - 1

    even = found["pdd_break_even"]
    for price in even["prices"]:
        assert gap(price) == pytest.approx(0.0, abs=1e-8)
        assert f"{price:.3g}" in printed
    for low, high in even["wins"]:
        assert gap((low + high) / 2) > 0
    if not even["wins"]:
        assert gap(0.0) < 0 and gap(even["span"]) < 0 and "loses at every price of B" in printed
    assert found["answer"] in ("yes", "no", "tie") and "What decides it: rho =" in printed
    screen = report["screen_error"]  # the analytic capacity against the simulated goodput, printed
    errors = [r["capacity_rps"] / r["goodput_rps"] - 1 for r in rows]
    assert screen["layouts"] == len(rows) and screen["low"] == min(errors) and screen["high"] == max(errors)
    assert "The analytic screen against the simulation" in printed
    seeds = report["seeds"]  # the verdict's two layouts, probed again with another seed
    assert [s["seed"] for s in seeds] == [0, 1] and "Over 2 seeds: PDD's best" in printed
    assert seeds[0]["pdd_rps"] == next(r["goodput_rps"] for r in rows if r["layout"] == found["pdd"])


def test_step_times_come_from_aiconfigurator_where_it_covers_the_chip_model_and_layout(tmp_path: Path) -> None:
    """`--aiconfigurator MODEL_ID` (the plan extra): a side on a chip, model and layout
    AIConfigurator's databases cover takes the roofline fitted to its estimates, within
    `MAX_FIT_ERROR` of each; the rest keep the roofline, each with why."""
    pytest.importorskip("aiconfigurator_core")
    from pdd.lab.plan.layouts import choose
    from pdd.lab.plan.measured import MAX_FIT_ERROR, measure, samples
    from pdd.names import AttentionLayout
    from pdd.perf.hardware import CHIPS

    model = "deepseek-ai/DeepSeek-V3"
    setting = replace(paper.SETTING, a=CHIPS["H800"], b=CHIPS["H200"], model=load_model(DEEPSEEK))
    setting, _ = choose(setting, 0.05, [AttentionLayout.TP])
    fitted, report = measure(setting, model)
    by = {(r["side"], r["hw"]): r for r in report}
    assert by["decode", "A"]["source"] == "roofline" and by["decode", "A"]["why"] == "AIConfigurator has no H800"
    b = by["decode", "B"]
    assert b["source"] == "AIConfigurator" and b["fit_error"] <= MAX_FIT_ERROR and b["gpus"] == 8
    physics = fitted.physics("B", 8, "decode")
    assert physics.eff.scale != (1.0, 1.0, 1.0) and physics != setting.physics("B", 8, "decode")
    for load, seconds in samples(model, "H200", AttentionLayout.TP, 8, True):
        assert abs(physics.step_s(load) / seconds - 1) <= b["fit_error"] + 1e-9
    assert fitted.physics("A", 16, "decode") == setting.physics("A", 16, "decode")
    _, unknown = measure(setting, "no/such-model")
    assert {r["why"] for r in unknown} == {"AIConfigurator has no no/such-model"}
    path = tmp_path / "plan.toml"
    path.write_text(PLAN.replace("[model]\n", f'[model]\naiconfigurator = "{model}"\n'))
    plan = _prepare(_parser().parse_args(["--plan-file", str(path)]))
    assert {r["why"] for r in plan.steps} == {"AIConfigurator has no H800", "AIConfigurator has no X1"}
