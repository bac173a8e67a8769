"""Workload generators: the agentic session plan and the Mooncake trace replay."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pdd.lab.workload.agentic import AgenticConfig, estimate_hits, iter_sessions, plan_sessions
from pdd.lab.workload.mooncake import MooncakeConfig, load_trace, scaled_lengths, trace_sessions
from pdd.lab.workload.scenarios import SCENARIOS, TINY_KV_BYTES_PER_TOKEN, fit_scenario

# 35 unchanged lines of the published Mooncake conversation trace (tests/data/README.md):
# in the checkout, so the test never depends on a file a clean CI checkout lacks
TRACE_EXCERPT = Path(__file__).resolve().parent / "data" / "mooncake_conversation_excerpt.jsonl"


# --- agentic -------------------------------------------------------------------------

def test_same_seed_same_requests_and_longer_runs_extend_shorter_ones():
    config = AgenticConfig(seed=7)
    assert plan_sessions(config, 300) == plan_sessions(config, 300)
    assert plan_sessions(config, 300) != plan_sessions(AgenticConfig(seed=8), 300)
    # A 100-turn run replays the first 100 turns of a 300-turn run, turn for turn.
    short = [(s.id, t) for s in plan_sessions(config, 100) for t in s.turns]
    long = [(s.id, t) for s in plan_sessions(config, 300) for t in s.turns]
    assert short == long[:100]


def test_plan_has_exactly_the_requested_turns_with_poisson_starts():
    config = AgenticConfig(seed=1)
    assert sum(len(s.turns) for s in plan_sessions(config, 137)) == 137
    assert {s.start_s for s in plan_sessions(config, 500)} == {0.0}  # rate inf: all at once
    starts = [s.start_s for s in plan_sessions(config, 20_000, rate=4.0)]
    assert starts[0] == 0.0 and starts == sorted(starts)
    assert np.mean(np.diff(starts)) == pytest.approx(0.25, rel=0.15)


def test_token_ids_stay_in_the_allowed_range():
    config = AgenticConfig(seed=2, vocab_size=300, low_id=20)
    ids = [i for s in plan_sessions(config, 400) for t in s.turns for i in t.append_ids]
    assert min(ids) >= 20 and max(ids) < 300


def test_scenarios_are_fitted_to_the_served_model():
    paper = SCENARIOS["paper"]
    same, note = fit_scenario(paper, 4096, 4096, TINY_KV_BYTES_PER_TOKEN)
    assert same == paper and "as published" in note  # the tiny model: the published arithmetic, unchanged
    # half the context, 12x the KV per token, a bigger vocabulary
    fitted, note = fit_scenario(paper, 2048, 49152, 12 * TINY_KV_BYTES_PER_TOKEN)
    w = fitted.workload
    assert (w.max_context, w.system_prompt_tokens, w.task_tokens, w.output_tokens) == (2000, 64, (150, 400), (160, 384))
    assert w.vocab_size == 49152 and w.turns == paper.workload.turns
    assert fitted.bandwidth_mbps == pytest.approx(paper.bandwidth_mbps * 6)  # x 12 KV, x 0.5 context
    assert "2048" in note and "300 Mbit/s" in note
    # a full-context miss still takes the line as long as with the tiny model
    assert (w.max_context * 12 * TINY_KV_BYTES_PER_TOKEN / fitted.bandwidth_mbps
            == pytest.approx(paper.workload.max_context * TINY_KV_BYTES_PER_TOKEN / paper.bandwidth_mbps))
    for context in (256, 512, 1000):  # small contexts still make valid, fitting workloads
        for scenario in SCENARIOS.values():
            w = fit_scenario(scenario, context, 1000, TINY_KV_BYTES_PER_TOKEN)[0].workload
            sessions = plan_sessions(w, 60)
            assert w.max_context <= context and max(i for s in sessions for t in s.turns for i in t.append_ids) < 1000
            for session in sessions:
                used = 0
                for turn in session.turns:
                    used += len(turn.append_ids) + turn.max_tokens
                    assert used <= w.max_context


def test_hit_rates_are_skewed_like_the_paper():
    hits = estimate_hits(AgenticConfig(seed=3), 3000)
    rates = np.array([h.hit_rate for h in hits])
    later = [h.hit_rate for h in hits if h.turn > 0]
    assert np.mean(np.array(later) > 0.95) >= 0.6
    # PDD_SPEC: 70-80 % of requests hit > 95 %, about 90 % on average, a minority little.
    assert 0.65 <= np.mean(rates > 0.95) <= 0.85
    assert 0.8 <= rates.mean() <= 0.95
    assert 0.03 <= np.mean(rates < 0.5) <= 0.2


def test_anomalous_requests_are_long_short_and_cold():
    config = AgenticConfig(seed=4)
    hits = estimate_hits(config, 3000)
    anomalous = [h for h in hits if h.anomalous]
    assert 0.02 <= len(anomalous) / len(hits) <= 0.04
    median_prompt = np.median([h.prompt_tokens for h in hits])
    assert all(h.hit_tokens == 0 and h.prompt_tokens > median_prompt for h in anomalous)
    plan = plan_sessions(config, 3000)
    assert all(len(s.turns) == 1 and s.turns[0].max_tokens <= 4 for s in plan if s.anomalous)
    tenth = estimate_hits(AgenticConfig(seed=4, anomalous_fraction=0.1), 3000)
    assert 0.08 <= np.mean([h.anomalous for h in tenth]) <= 0.12


@pytest.mark.parametrize("config", [AgenticConfig(seed=5),
                                    AgenticConfig(seed=5, max_context=1000, task_tokens=(64, 256))])
def test_no_request_exceeds_the_context_cap(config):
    hits = estimate_hits(config, 2000)
    plan = plan_sessions(config, 2000)
    max_tokens = [t.max_tokens for s in plan for t in s.turns]
    longest = max(h.prompt_tokens + n for h, n in zip(hits, max_tokens, strict=True))
    assert longest <= config.max_context
    # Sessions end at the cap instead of running past it: many get close.
    assert max(h.prompt_tokens for h in hits) > 0.9 * config.max_context


def test_later_turns_append_to_the_previous_context():
    session = next(s for s in iter_sessions(AgenticConfig(seed=6)) if len(s.turns) > 3)
    hits = estimate_hits(AgenticConfig(seed=6), 500)
    mine = [h for h in hits if h.session == session.id]
    for prev, cur, turn in zip(mine, mine[1:], session.turns[1:], strict=False):
        assert cur.hit_tokens == prev.prompt_tokens + session.turns[prev.turn].max_tokens
        assert cur.prompt_tokens == cur.hit_tokens + len(turn.append_ids)


def test_impossible_configs_are_rejected():
    with pytest.raises(ValueError, match="max_context"):
        AgenticConfig(max_context=500)
    with pytest.raises(ValueError, match="output_tokens"):
        AgenticConfig(output_tokens=(10, 5))
    with pytest.raises(ValueError, match="rate"):
        plan_sessions(AgenticConfig(), 10, rate=0)


# --- mooncake ------------------------------------------------------------------------

def _write(path: Path, rows: list[dict | str]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _row(ts: int, inp: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": ids}


def test_shared_hash_prefix_gives_identical_leading_blocks(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [_row(0, 1400, 100, [0, 1, 2]),
                                          _row(10, 1300, 100, [0, 1, 5]),
                                          _row(20, 1024, 100, [9, 1])])
    a, b, c = (s.turns[0].append_ids for s in trace_sessions(load_trace(trace), MooncakeConfig()))
    assert MooncakeConfig().block_tokens == 32
    assert a[:64] == b[:64] and a[64:70] != b[64:70]
    # The same hash id is the same block wherever it appears.
    assert c[32:64] == a[32:64] and c[:32] != a[:32]


def test_lengths_and_times_are_scaled(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [_row(0, 1400, 3, [0, 1, 2]),
                                          _row(1000, 1030, 350, [0, 1, 3]),
                                          _row(3000, 512, 5000, [4])])
    config = MooncakeConfig(scale=16, time_scale=2.0)
    sessions = trace_sessions(load_trace(trace), config)
    assert [len(s.turns[0].append_ids) for s in sessions] == [88, 65, 32]
    assert [s.turns[0].max_tokens for s in sessions] == [1, 22, 64]  # minimum 1, cap 64
    assert [s.start_s for s in sessions] == [0.0, 0.5, 1.5]
    own = MooncakeConfig(scale=16, output_scale=2, max_output_tokens=500)
    assert [scaled_lengths(r, own)[1] for r in load_trace(trace)] == [2, 175, 500]


def test_context_cap_cuts_the_tail_and_keeps_the_prefix(tmp_path):
    trace = _write(tmp_path / "t.jsonl", [_row(0, 2048, 640, [0, 1, 2, 3])])
    full = trace_sessions(load_trace(trace), MooncakeConfig())[0].turns[0]
    capped = trace_sessions(load_trace(trace), MooncakeConfig(max_context=100))[0].turns[0]
    assert len(full.append_ids) == 128 and capped.max_tokens == 40
    assert capped.append_ids == full.append_ids[:60]


@pytest.mark.parametrize("line, problem", [
    ("{not json", "not valid JSON"),
    (json.dumps({"timestamp": 0, "input_length": 10, "hash_ids": [0]}), "output_length"),
    (json.dumps(_row(0, 1500, 5, [0, 1])), "needs 3 hash_ids"),
    (json.dumps(_row(0, 10, 5, ["a"])), "hash_ids"),
])
def test_bad_line_is_reported_with_its_line_number(tmp_path, line, problem):
    trace = _write(tmp_path / "t.jsonl", [_row(0, 100, 5, [0]), line])
    with pytest.raises(ValueError, match=rf"t\.jsonl:2: .*{problem}"):
        load_trace(trace)
    assert len(load_trace(trace, limit=1)) == 1  # the bad line is never read


def test_published_trace_loads_and_keeps_its_shared_prefixes():
    records = load_trace(TRACE_EXCERPT)
    config = MooncakeConfig()
    sessions = trace_sessions(records, config)
    assert len(records) == len(sessions) == 35
    assert all(r.hash_ids[0] == 0 for r in records)  # the trace's common system prompt
    prompts = [s.turns[0].append_ids for s in sessions]
    assert len({p[: config.block_tokens] for p in prompts}) == 1
    block = config.block_tokens
    longer = 0
    for i, a in enumerate(records):  # equal leading hash ids, and only they, give equal leading tokens
        for j in range(i):
            b = records[j]
            k = next((n for n, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y),
                     min(len(a.hash_ids), len(b.hash_ids)))
            shared = min(k * block, len(prompts[i]), len(prompts[j]))
            assert prompts[i][:shared] == prompts[j][:shared]
            if k < min(len(a.hash_ids), len(b.hash_ids)):
                assert prompts[i][k * block:(k + 1) * block] != prompts[j][k * block:(k + 1) * block]
            longer += k >= 2
    assert longer == 3  # the excerpt's three pairs sharing more than the first block
    assert [len(p) for p in prompts] == [scaled_lengths(r, config)[0] for r in records]
    starts = [s.start_s for s in sessions]
    assert starts == sorted(starts) and starts[0] == 0.0 and starts[-1] == records[-1].timestamp_ms / 1000
    assert all(math.isfinite(t) for t in starts)


def test_tool_time_spaces_turns_and_changes_nothing_else():
    """A later turn waits for its tool (drawn in `tool_time_s`), the first never does, and
    the turns themselves are the ones drawn without tool time (its RNG is its own)."""
    plain = plan_sessions(AgenticConfig(), 60)
    timed = plan_sessions(AgenticConfig(tool_time_s=(2.0, 5.0)), 60)
    strip = [[(t.append_ids, t.max_tokens) for t in s.turns] for s in timed]
    assert strip == [[(t.append_ids, t.max_tokens) for t in s.turns] for s in plain]
    assert all(t.pause_s == 0 for s in plain for t in s.turns)
    pauses = [t.pause_s for s in timed for t in s.turns[1:]]
    assert pauses and all(2.0 <= p <= 5.0 for p in pauses) and len(set(pauses)) == len(pauses)
    assert all(s.turns[0].pause_s == 0 for s in timed)
    with pytest.raises(ValueError, match="tool_time_s"):
        AgenticConfig(tool_time_s=(3.0, 1.0))
