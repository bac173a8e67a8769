"""vLLM behind the engine port, one engine in this process (vLLM's engine core a process of
its own, pdd's connector in it, over the bridge's socket), next to an embedded engine:
greedy output equals plain `vllm serve`; pdd's seeded draw equals the embedded
engine's; KV moves both ways between them (other page sizes, vLLM's CPU-packed
layout); a continuation computes only the handed-over tokens, in rounds; reservations
answer vLLM's own prefix-cache hit, and every way out gives vLLM's blocks back."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Coroutine
from typing import Any

import pytest
from msgspec.structs import replace  # sampling params are a msgspec struct

pytest.importorskip("vllm")

from pdd.engines.port import EngineConfig, RequestError, StepOutput, open_engine  # noqa: E402
from pdd.kv import codec  # noqa: E402
from pdd.kv.blocks import block_hashes  # noqa: E402
from pdd.kv.pages import OutOfPages  # noqa: E402
from pdd.model.tokenizer import Tokenizer  # noqa: E402
from pdd.sampling.params import SamplingParams  # noqa: E402

PAGE = 32  # vLLM's block; the embedded engine's page is 16
GREEDY = SamplingParams(max_tokens=48, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=48, ignore_eos=True, temperature=25.0, top_p=0.95, seed=1234)


def _prompts() -> list[list[int]]:
    rng = random.Random(42)
    return [[rng.randrange(16, 4096) for _ in range(n)] for n in (180, 260, 333, 410)]


class Engines:
    """A vLLM and an embedded engine, on an event loop of their own."""

    def __init__(self, model_dir) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

        async def make() -> tuple[Any, Any]:
            eos = Tokenizer.from_dir(model_dir).eos_token_ids  # as `pdd serve` opens them
            return (open_engine(model_dir, EngineConfig(backend="vllm", page_size=PAGE, num_pages=300), 1, eos),
                    open_engine(model_dir, EngineConfig(), 1, eos))

        self.vllm, self.embedded = self.run(make(), timeout=300)

    def run(self, coro: Coroutine, timeout: float = 120) -> Any:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)
        except TimeoutError:  # say where every request of vLLM's stood, for the hang's diagnosis
            held = {rid: (r.reserved, list(r.chunks), r.loaded, r.producing, r.ended, len(r.outputs))
                    for rid, r in self.vllm.reqs.items()}
            raise AssertionError(f"not within {timeout} s; vLLM's requests (reserved, chunks, loaded, producing, "
                                 f"ended, outputs): {held}; stats {self.vllm.stats()}") from None

    def close(self) -> None:
        self.vllm.close()
        self.embedded.close()
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    e = Engines(tiny_model_dir)
    yield e
    e.close()


async def _tokens(stream) -> list[int]:
    return [o.token async for o in stream if o.token is not None]


async def _prefill(engine, rid: str, prompt: list[int], params: SamplingParams) -> int:
    """P's part: the first token, the request's KV held for export."""
    return (await _tokens(engine.generate(rid, prompt, replace(params, max_tokens=1), hold=True)))[0]


async def _continue(engine, rid: str, first: int, rounds: list[list[int]] = ()) -> tuple[list[int], list[int]]:
    """MD's part after its import: catch-up `rounds` in the shadow, then produce; (outputs, caught_up seen)."""
    watch = engine.watch(rid)
    caught, out = [], [first]
    given = [first]
    for i, chunk in enumerate(rounds):
        await engine.start(rid, ([first] if i == 0 else []) + chunk, shadow=True)
        given += chunk
        async for o in watch:
            if o.caught_up is not None:
                caught.append(o.caught_up)
                break
    await engine.start(rid, [] if rounds else [first])
    out = list(given)
    async for o in watch:
        if o.token is not None:
            out.append(o.token)
        if o.finish_reason:
            break
    watch.close()
    return out, caught


async def _move(src, dst, rid: str, prompt: list[int], params: SamplingParams,
                rounds=()) -> tuple[int, list[int], list]:
    first = await _prefill(src, f"{rid}-p", prompt, params)
    hit = await dst.reserve(rid, prompt, params)
    blob = await src.export_kv(f"{rid}-p", hit, len(prompt))
    await src.release(f"{rid}-p")
    await dst.import_kv(rid, blob)
    out, caught = await _continue(dst, rid, first, rounds)
    return hit, out, caught


async def _settled(engine, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.05)):
        if engine.load().free_pages == engine.load().pages and not engine.stats()["held_requests"]:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"vLLM holds blocks: {engine.load()}, {engine.stats()['held_requests']} requests")


def test_greedy_equals_plain_vllm_and_the_embedded_engine(engines, vllm_reference):
    for i, prompt in enumerate(_prompts()):
        got = engines.run(_tokens(engines.vllm.generate(f"g{i}", prompt, GREEDY)))
        assert got == vllm_reference.greedy(prompt, GREEDY.max_tokens)
        assert got == engines.run(_tokens(engines.embedded.generate(f"ge{i}", prompt, GREEDY)))
    engines.run(_settled(engines.vllm))


def test_seeded_sampling_is_pdds_draw_on_vllm(engines):
    for i, prompt in enumerate(_prompts()[:2]):
        got = engines.run(_tokens(engines.vllm.generate(f"s{i}", prompt, SEEDED)))
        assert got == engines.run(_tokens(engines.embedded.generate(f"se{i}", prompt, SEEDED)))
        assert got != engines.run(_tokens(engines.vllm.generate(f"g2{i}", prompt, GREEDY)))


SHAPED = [replace(GREEDY, repetition_penalty=2.0, frequency_penalty=2.0, presence_penalty=0.5, min_tokens=4),
          replace(SEEDED, min_p=0.2, repetition_penalty=2.0, frequency_penalty=1.0, logit_bias=((1420, 40.0),))]


@pytest.mark.parametrize("params", SHAPED, ids=["greedy", "seeded"])
def test_penalties_are_pdds_on_vllm_and_count_a_continuations_given_tokens(engines, params):
    """Shaped logits (penalties, bias, min_p, min_tokens) on vLLM are pdd's own, equal to
    the embedded engine's; continued on vLLM after P's token and a relay's, in catch-up
    rounds, the output still equals one engine's: the given tokens count as output."""
    prompt = [t ^ 3 for t in _prompts()[3]]
    want = engines.run(_tokens(engines.embedded.generate("shape-e", prompt, params)))
    assert want != engines.run(_tokens(engines.embedded.generate("plain-e", prompt, replace(
        params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=(), min_p=0.0))))
    assert engines.run(_tokens(engines.vllm.generate("shape-v", prompt, params))) == want
    _, out, _ = engines.run(_move(engines.embedded, engines.vllm, "shape-m", prompt, params, [want[1:6], want[6:9]]))
    assert out == want
    engines.run(_settled(engines.vllm))


def test_a_grammar_holds_on_vllm_as_on_the_embedded_engine_and_after_a_handover(engines):
    """A JSON Schema guide on vLLM (pdd's matcher in its logits processor): the same
    tokens as the embedded engine's, greedy and seeded, ending with EOS; continued on vLLM
    after P's token and a relay's, its grammar advanced over them, the same again."""
    schema = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 10}, "days": {"type": "integer", "maximum": 999}}}
    prompt = [t ^ 7 for t in _prompts()[1]]
    for base in (GREEDY, SEEDED):
        params = replace(base, ignore_eos=False, max_tokens=60, guide=("json_schema", json.dumps(schema)))
        want = engines.run(_tokens(engines.embedded.generate("gd-e", prompt, params)))
        assert engines.run(_tokens(engines.vllm.generate("gd-v", prompt, params))) == want
        _, out, _ = engines.run(_move(engines.embedded, engines.vllm, "gd-m", prompt, params, [want[1:4], want[4:7]]))
        assert out == want and len(want) < 60  # it ended: the grammar closed and EOS came
    engines.run(_settled(engines.vllm))


async def _with_logprobs(stream) -> list[tuple[int, tuple]]:
    return [(o.token, o.logprob) async for o in stream if o.token is not None]


def test_vllms_raw_logprobs_are_the_embedded_engines_and_follow_a_continuation(engines):
    """`logprobs = 3` on vLLM: each token's raw log-probability and its top three, within
    1e-3 of the embedded engine's (both fp32); seeded too (raw: before pdd's draw, which
    leaves vLLM one token standing); and on a continuation after P's and a relay's tokens."""
    prompt = [t ^ 6 for t in _prompts()[0]]
    for params in (replace(GREEDY, logprobs=3), replace(SEEDED, logprobs=3)):
        got = engines.run(_with_logprobs(engines.vllm.generate("lp-v", prompt, params)))
        want = engines.run(_with_logprobs(engines.embedded.generate("lp-e", prompt, params)))
        assert [t for t, _ in got] == [t for t, _ in want] and all(lp is not None for _, lp in got)
        for (_, (v, top)), (_, (w, wtop)) in zip(got, want, strict=True):
            assert abs(v - w) < 1e-3 and [t for t, _ in top] == [t for t, _ in wtop]
            assert max(abs(a - b) for (_, a), (_, b) in zip(top, wtop, strict=True)) < 1e-3
    params = replace(GREEDY, logprobs=0)
    want = engines.run(_with_logprobs(engines.embedded.generate("lp-e2", prompt, params)))
    tokens = [t for t, _ in want]

    async def continued() -> list[tuple[int, tuple]]:
        await _prefill(engines.embedded, "lp-p", prompt, params)
        hit = await engines.vllm.reserve("lp-m", prompt, params)
        blob = await engines.embedded.export_kv("lp-p", hit, len(prompt))
        await engines.embedded.release("lp-p")
        await engines.vllm.import_kv("lp-m", blob)
        watch = engines.vllm.watch("lp-m")
        await engines.vllm.start("lp-m", tokens[:5])  # P's token and four of a relay's
        out = []
        async for o in watch:
            if o.token is not None:
                out.append((o.token, o.logprob))
            if o.finish_reason:
                break
        watch.close()
        return out

    got = engines.run(continued())
    assert [t for t, _ in got] == tokens[5:]
    assert max(abs(lp[0] - w[0]) for (_, lp), (_, w) in zip(got, want[5:], strict=True)) < 1e-3
    engines.run(_settled(engines.vllm))


def test_prompt_logprobs_on_vllm_are_the_embedded_engines_computed_past_the_cache(engines):
    """`prompt_logprobs = 2`: each prompt token's raw log-probability and the top two, within
    1e-3 (relative) of the embedded engine's, the first token's None; a second request for the same
    prompt gets them all again (vLLM and pdd compute the whole prompt for them, never
    reading the prefix cache, which holds KV and no logits)."""
    prompt = [t ^ 9 for t in _prompts()[1]]
    params = replace(GREEDY, max_tokens=2, prompt_logprobs=2)

    async def first_output(engine, rid: str) -> StepOutput:
        return [o async for o in engine.generate(rid, prompt, params) if o.position == 0][0]

    want = engines.run(first_output(engines.embedded, "pl-e")).prompt_logprobs
    for rid in ("pl-v1", "pl-v2"):
        out = engines.run(first_output(engines.vllm, rid))
        got = out.prompt_logprobs
        assert len(got) == len(want) == len(prompt) and got[0] is None and want[0] is None
        # (a random prompt's tokens are unlikely ones, near -40: fp32 holds them to 1e-4 of that)
        assert max(abs(g[0] - w[0]) / max(1.0, abs(w[0])) for g, w in zip(got[1:], want[1:], strict=True)) < 1e-3
        assert [[t for t, _ in g[1]] for g in got[1:]] == [[t for t, _ in w[1]] for w in want[1:]]
        assert out.cached_tokens == 0
    engines.run(_settled(engines.vllm))


def test_kv_from_vllm_continues_on_the_embedded_engine(engines, vllm_reference):
    prompt = [t ^ 5 for t in _prompts()[0]]
    engines.run(_tokens(engines.embedded.generate("warm", prompt[:100], replace(GREEDY, max_tokens=1))))
    hit, out, _ = engines.run(_move(engines.vllm, engines.embedded, "ve", prompt, GREEDY))
    assert out == vllm_reference.greedy(prompt, GREEDY.max_tokens)
    assert hit == 96  # the embedded engine's own prefix (six 16-token pages): only the rest came from vLLM
    blob = engines.run(_blob_of(engines.vllm, prompt))
    assert (blob.header.page_size, blob.header.block_size, blob.header.dtype) == (PAGE, 16, "float32")


async def _blob_of(engine, prompt: list[int]):
    await _prefill(engine, "blob", prompt, GREEDY)
    try:
        return await engine.export_kv("blob", 0, len(prompt))
    finally:
        await engine.release("blob")


def test_kv_from_the_embedded_engine_continues_on_vllm_computing_only_what_it_must(engines, vllm_reference):
    prompt = [t ^ 1 for t in _prompts()[1]]  # nothing of it cached anywhere
    before = dict(engines.vllm.stats())
    hit, out, _ = engines.run(_move(engines.embedded, engines.vllm, "ev", prompt, GREEDY))
    assert hit == 0 and out == vllm_reference.greedy(prompt, GREEDY.max_tokens)
    engines.run(_settled(engines.vllm))
    after = engines.vllm.stats()
    # vLLM's own scheduler: the prompt's last token (vLLM never schedules a request with
    # nothing to compute), P's first token, then one token per decode step
    assert after["computed_by_request"]["ev"] == GREEDY.max_tokens
    assert after["prompt_tokens_external"] - before["prompt_tokens_external"] == len(prompt)
    assert after["imported_tokens"] - before["imported_tokens"] == len(prompt)


def test_catch_up_rounds_extend_the_same_vllm_request(engines, vllm_reference):
    prompt = [t ^ 2 for t in _prompts()[2]]
    want = vllm_reference.greedy(prompt, GREEDY.max_tokens)
    rounds = [want[1:8], want[8:9], want[9:20]]  # relay tokens, handed over in three chunks
    hit, out, caught = engines.run(_move(engines.embedded, engines.vllm, "cu", prompt, GREEDY, rounds))
    assert out == want
    assert caught == [8, 9, 20]  # output positions MD holds after each chunk
    engines.run(_settled(engines.vllm))
    # the prompt's last token, the 20 handed-over tokens, then the decodes after them: nothing twice
    assert engines.vllm.stats()["computed_by_request"]["cu"] == 1 + 20 + (GREEDY.max_tokens - 20 - 1)


def test_a_final_chunk_vllm_merged_into_the_load_chunks_output_still_streams(engines, vllm_reference, monkeypatch):
    """vLLM merges the outputs its reader has not taken yet (`RequestOutputCollector.put`), across a
    session's chunks too: here the load chunk's dropped token and the final chunk's tokens come
    as one output, as when the instance's loop is busy for a step or two. (It was the stall under
    load: the final chunk's tokens were read as the load chunk's and dropped.)"""
    from vllm.v1.engine.output_processor import RequestOutputCollector

    prompt = [t ^ 6 for t in _prompts()[0]]
    want = vllm_reference.greedy(prompt, GREEDY.max_tokens)
    v, gate, read = engines.vllm, asyncio.Event(), []
    real_get = RequestOutputCollector.get

    async def late_get(self):  # the reader of request "mg" is late for its first output
        if self.request_id.startswith("mg-"):
            await gate.wait()
        out = await real_get(self)
        if self.request_id.startswith("mg-") and not read:
            read.append(len(out.outputs[0].token_ids))
        return out

    monkeypatch.setattr(RequestOutputCollector, "get", late_get)

    async def scenario() -> list[int]:
        first = await _prefill(engines.embedded, "mgp", prompt, GREEDY)
        hit = await v.reserve("mg", prompt, GREEDY)
        blob = await engines.embedded.export_kv("mgp", hit, len(prompt))
        await engines.embedded.release("mgp")
        await v.import_kv("mg", blob)
        watch = v.watch("mg")
        await v.start("mg", [first])
        await asyncio.sleep(1.0)  # vLLM computes the load chunk, then the final chunk's tokens: nobody reads them
        gate.set()
        async with asyncio.timeout(20):
            return [first] + await _tokens(watch)

    assert engines.run(scenario(), timeout=60) == want
    assert read[0] > 1  # the premise: the first output pdd read was the load chunk's and more
    engines.run(_settled(v))


def test_the_next_turn_hits_vllms_own_cache(engines, vllm_reference):
    prompt = [t ^ 3 for t in _prompts()[3]]
    _, out, _ = engines.run(_move(engines.embedded, engines.vllm, "t1", prompt, GREEDY))
    engines.run(_settled(engines.vllm))
    turn = prompt + out + list(range(100, 140))
    held = (len(prompt) + len(out) - 1) // PAGE * PAGE  # the session's full blocks: prompt and output
    assert engines.run(engines.vllm.cached_prefix(turn)) == held
    seq, hashes = engines.run(engines.vllm.cache_snapshot())
    assert set(block_hashes(turn, PAGE)[: held // PAGE]) <= set(hashes)  # the router's mirror reads the same
    hits = engines.vllm.stats()["prefix_cache_hits"]
    async def uncached() -> int:  # the cross-datacenter PD baseline: nothing of vLLM's cache is reused
        hit = await engines.vllm.reserve("nc", turn, GREEDY, use_cache=False)
        await engines.vllm.release("nc")
        return hit

    assert engines.run(uncached()) == 0
    hit, out2, _ = engines.run(_move(engines.embedded, engines.vllm, "t2", turn, GREEDY))
    assert hit == held and out2 == vllm_reference.greedy(turn, GREEDY.max_tokens)
    assert engines.vllm.stats()["prefix_cache_hits"] - hits >= held  # vLLM's own counter
    engines.run(_settled(engines.vllm))


def test_every_way_out_gives_vllms_blocks_back(engines):
    v = engines.vllm
    prompt = [t ^ 4 for t in _prompts()[1]]
    blob = engines.run(_blob_of(engines.embedded, prompt))

    async def scenario() -> None:
        await v.reserve("rel", prompt, GREEDY)
        await v.release("rel")  # before any KV came
        await v.reserve("ab", prompt, GREEDY)
        await v.import_kv("ab", codec.token_slice(blob, 0, 64))
        v.abort("ab")  # half its KV in
        with pytest.raises(RequestError):
            await v.import_kv("ab", blob)
        await v.reserve("cut", prompt, GREEDY)
        await v.import_kv("cut", blob)
        watch = v.watch("cut")
        await v.start("cut", [5])
        async for o in watch:
            if o.token is not None and o.position >= 6:
                break
        output = await v.cut("cut")  # a relay handing over
        assert output[0] == 5 and len(output) >= 7
        assert [o.finish_reason async for o in watch][-1] == "abort"
        one = replace(GREEDY, max_tokens=1)
        await v.reserve("big1", list(range(16, 4016)), one)
        await v.reserve("big2", list(range(17, 4017)), one)
        with pytest.raises(OutOfPages):  # 300 blocks hold two 4,000-token prompts, not three
            await v.reserve("big3", list(range(18, 4018)), one)
        await v.release("big1")
        await v.release("big2")
        await _settled(v)

    engines.run(scenario())
