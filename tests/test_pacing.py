"""Emulated accelerators: every step of a paced engine takes at least what its chip
would take, A and B differ as the spec's chips do, and `pdd up` places and stretches
a deployment for them."""

from __future__ import annotations

import asyncio
import time

import pytest

from pdd import config as cfg
from pdd.engines.embedded.pacing import StepPacer
from pdd.engines.port import EngineConfig, open_engine
from pdd.names import Mode, RoleName
from pdd.perf.emulated import scaled, token_scale
from pdd.perf.steps import EMPTY, StepLoad, add, chunk_load
from pdd.sampling.params import SamplingParams


def test_a_prefills_faster_and_b_decodes_faster_and_dilation_stretches_both():
    a, b = StepPacer("A", 16.0), StepPacer("B", 16.0)
    prefill, decode = [(0, 2048, 2048)], [(2000, 1, 1900)] * 16
    assert a.step_s(prefill) < b.step_s(prefill)  # A: compute per price
    assert b.step_s(decode) < a.step_s(decode)  # B: bandwidth
    assert StepPacer("A", 16.0, dilation=3.0).step_s(prefill) == pytest.approx(3 * a.step_s(prefill))
    assert a.step_s([(4000, 1, 3900)]) > a.step_s([(100, 1, 50)])  # a decode reads its whole context
    assert token_scale(4096) == 16 and token_scale(1 << 20) == 1
    with pytest.raises(ValueError, match="unknown hardware"):
        StepPacer("Z80", 16.0)


def test_a_paced_engine_takes_at_least_its_chips_time(tiny_model_dir):
    engine = open_engine(tiny_model_dir, EngineConfig(hardware="B", dilation=8.0))

    async def run() -> tuple[float, list[int]]:
        started = time.perf_counter()
        tokens = [o.token async for o in engine.generate("r", list(range(20, 400)), SamplingParams(max_tokens=12,
                                                                                                  ignore_eos=True))
                  if o.token is not None]
        return time.perf_counter() - started, tokens

    try:
        elapsed, tokens = asyncio.run(run())
        pacing = engine.stats()["pacing"]
    finally:
        engine.close()
    emulated_s = (pacing["prefill_step_ms"] or 0) / 1000 + (pacing["decode_step_ms"] or 0) / 1000 * 11
    assert len(tokens) == 12 and pacing["hardware"] == "B" and pacing["steps"] == 12
    assert elapsed >= emulated_s * 0.99, (elapsed, emulated_s, pacing)
    native = open_engine(tiny_model_dir, EngineConfig())
    try:
        assert native.stats()["pacing"] == {"hardware": "native"}
    finally:
        native.close()


def test_pdd_up_puts_p_and_the_relay_on_a_md_on_b_and_same_dc_pd_all_on_a():
    dep = cfg.Deployment(topology=cfg.TopologySpec(hardware="emulated", dilation=3.0, main=2))
    chips = {i.name: (i.engine.hardware, i.engine.dilation) for i in cfg.instances_for_mode(dep, Mode.PDD)}
    assert chips == {"p0": ("A", 3.0), "rld0": ("A", 3.0), "md0": ("B", 3.0), "md1": ("B", 3.0)}
    assert {i.engine.hardware for i in cfg.instances_for_mode(dep, Mode.PD_SAME_DC)} == {"A"}
    assert [i.engine.hardware for i in cfg.instances_for_mode(dep, Mode.COLOCATED)] == ["A"]
    native = cfg.instances_for_mode(cfg.Deployment(), Mode.PDD)
    assert {i.engine.hardware for i in native} == {"native"} and native[0].role == RoleName.PREFILL
    slow = cfg.in_emulated_time(cfg.Deployment(
        line=cfg.LineSpec(bandwidth_mbps=60.0, delay_ms=2.0, jitter_ms=0.5), policy=cfg.PolicySpec(ttft_budget_ms=60.0),
        slo=cfg.SLOSpec(ttft_ms=1000.0, tpot_ms=50.0), topology=cfg.TopologySpec(hardware="emulated", dilation=3.0)))
    assert (slow.line.bandwidth_mbps, slow.line.delay_ms, slow.line.jitter_ms) == (20.0, 6.0, 1.5)
    assert (slow.policy.ttft_budget_ms, slow.slo.ttft_ms, slow.slo.tpot_ms) == (180.0, 3000.0, 150.0)
    assert cfg.in_emulated_time(cfg.Deployment()) == cfg.Deployment()


def test_scaling_a_steps_total_load_equals_scaling_each_sequence():
    """The pacer prices a step from its total load (`scaled`), exactly as if each prompt
    chunk and context were `s` times longer, and each decode, and each output a chunk
    computes again (MD's extend of relay tokens), still one token over a context s times
    longer: outputs are not scaled, so a handoff's extend costs what its tokens cost."""
    # (start, tokens, prompt): two prompt chunks, two decodes, an extend of 20 relay tokens
    # and one that also recomputes the last prompt token (an output too: the engine's rule)
    computed, s = [(0, 300, 2000), (1200, 40, 2000), (2000, 1, 1500), (3000, 1, 2900), (990, 20, 990),
                   (989, 30, 990)], 16.0
    total = EMPTY
    for start, n, prompt in computed:
        total = add(total, chunk_load(start, n, prompt))
    each = EMPTY
    for start, n, prompt in computed:
        if n == 1:
            each = add(each, chunk_load(round(start * s), 1))
            continue
        body = n if start + n <= prompt else 0  # a prompt chunk: s times longer; an extend: outputs
        pairs = chunk_load(round(start * s), round(body * s)).attn_pairs
        each = add(each, StepLoad(round(body * s), pairs, 1, 0, 1, pairs))
        for q in range(start + body, start + n):  # each output: one token at s x its context
            each = add(each, StepLoad(1, s * q + 1, 0, 0, 0, s * q + 1, 1, s * q + 1))
    got = scaled(total, s)
    for name in ("new_tokens", "attn_pairs", "seqs", "chunks", "chunk_pairs", "output_tokens", "output_pairs"):
        assert float(getattr(got, name)) == pytest.approx(float(getattr(each, name))), name
    # the extend of 20 relay tokens is priced as 20 tokens, not 320: what a handoff's stall rests on
    assert float(got.new_tokens) == 300 * s + 40 * s + 2 + 20 + 30


def test_hardware_means_one_thing_everywhere():
    """`native`, `emulated` (the chip of each role) or one chip: on `pdd up` (the topology),
    `pdd serve` (the flags) and an instance's engine alike; `emulated` never reaches an engine."""
    import argparse

    from pdd.instance.cli import add_engine_arguments, engine_from_flags
    from pdd.names import CHIPS
    from pdd.perf.hardware import CATALOG

    assert tuple(CATALOG) == CHIPS  # the names pdd accepts are the chips the pacer can price
    for hardware, want in (("native", {"p0": "native", "rld0": "native", "md0": "native"}),
                           ("emulated", {"p0": "A", "rld0": "A", "md0": "B"}),
                           ("B", {"p0": "B", "rld0": "B", "md0": "B"})):
        dep = cfg.Deployment(topology=cfg.TopologySpec(hardware=hardware))
        assert {i.name: i.engine.hardware for i in cfg.instances_for_mode(dep, "pdd")} == want, hardware
    with pytest.raises(ValueError, match="hardware must be one of native, emulated, A, B"):
        cfg.TopologySpec(hardware="H100")
    with pytest.raises(ValueError, match="engine hardware must be native or a chip"):
        EngineConfig(hardware="emulated")
    p = argparse.ArgumentParser()
    p.add_argument("--role", default="standalone")
    add_engine_arguments(p)
    for argv, want in ((["--hardware", "emulated"], "A"), (["--hardware", "emulated", "--role", "main"], "B"),
                       (["--hardware", "B"], "B"), ([], "native")):
        args = p.parse_args(argv)
        args.engine_flags, args.vllm_arg = [], []
        assert engine_from_flags(args).hardware == want, argv
