"""P streams a prefill's KV layer by layer (`pdd.kv.layer_stream`): the embedded engine puts
each layer's KV on the request's stream as soon as that layer is computed, so a frame of
layer 0 is on its way before the forward pass that computed it has ended; the pieces
are exactly the KV an export after the prefill gives; a range computed twice (a
preempted prefill) is carried once; and P's senders, in a real deployment, send frames
while its prefill still computes, the tokens colocated's."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import test_pdd
import torch
from procs import HTTP, pdd_up
from test_kv_copies import _prompt
from test_pdd import FAST_LINE, _stream, _write_config

from pdd.engines.embedded.attention import PagedAttention
from pdd.engines.embedded.engine import Engine
from pdd.engines.embedded.runtime import EngineRuntime
from pdd.engines.port import EngineConfig
from pdd.kv import codec
from pdd.kv.layer_stream import LayerStream
from pdd.sampling.params import SamplingParams

colocated = test_pdd.colocated  # (the token oracle, a fixture)
P_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)
LAYER_S = 0.03  # each layer of a slowed forward takes this long at least


@pytest.fixture
def runtime(tiny_model_dir):
    rt = EngineRuntime(Engine(tiny_model_dir, EngineConfig(page_size=16, num_pages=256, max_batch_tokens=128)))
    rt.start_thread()
    yield rt
    rt.close()


async def _prefill(rt: EngineRuntime, rid: str, prompt: list[int]) -> tuple[LayerStream, list[codec.KVBlob]]:
    """P's prefill of `prompt` with a stream; the pieces as they reached the loop."""
    stream, got = LayerStream(), []

    async def follow() -> None:
        async for piece in stream.follow():
            got.append(piece.blob)

    follower = asyncio.ensure_future(follow())
    async for _ in rt.generate(rid, prompt, P_TOKEN, hold=True, stream=stream):
        pass
    stream.close()
    await follower
    return stream, got


def _joined(pieces: list[codec.KVBlob], layer: int) -> torch.Tensor:
    ours = sorted((b for b in pieces if b.header.layer_start == layer), key=lambda b: b.header.token_start)
    for a, b in zip(ours, ours[1:], strict=False):
        assert a.header.token_end == b.header.token_start  # (one piece a range: none twice, no hole)
    return torch.cat([torch.stack([b.k[0], b.v[0]]) for b in ours], dim=1)


def test_the_stream_carries_exactly_the_computed_kv_from_where_the_cache_ends(runtime):
    prompt = _prompt(3, 400)

    async def go() -> None:
        stream, pieces = await _prefill(runtime, "a", prompt)
        assert stream.first == 0 and len({b.header.token_start for b in pieces}) >= 4  # (chunks of 128 tokens)
        whole = await runtime.export_kv("a", 0, len(prompt))
        for layer in range(whole.header.num_layers):
            assert torch.equal(_joined(pieces, layer), torch.stack([whole.k[layer], whole.v[layer]]))
        assert all(p.header.block_hashes == whole.header.block_hashes[: len(p.header.block_hashes)] for p in pieces)
        await runtime.release("a")
        # the same prefix again: the stream starts where the cache's pages end
        stream, pieces = await _prefill(runtime, "b", prompt[:300] + _prompt(4, 50))
        assert stream.first == 288 and min(b.header.token_start for b in pieces) == 288
        assert max(b.header.token_end for b in pieces) == 350

    asyncio.run(go())


def test_layer_zero_reaches_the_loop_before_its_forward_pass_ends(runtime, monkeypatch):
    """With each layer slowed as a large model's, layer 0's piece of a step is on the event
    loop while the same step's last layer is still to compute (sending it after the forward
    fails this: it would arrive after the last layer)."""
    layers = runtime.engine.model_cfg.num_layers
    put_at: dict[tuple[int, int], float] = {}  # (chunk's first token, layer) -> when the model thread put it
    call = PagedAttention.__call__

    def slowed(self, layer, q, k, v):
        out = call(self, layer, q, k, v)
        time.sleep(LAYER_S)
        return out

    monkeypatch.setattr(PagedAttention, "__call__", slowed)
    put = LayerStream.put

    def timed_put(self, blob, ready=None):
        put_at[(blob.header.token_start, blob.header.layer_start)] = time.monotonic()
        put(self, blob, ready)

    monkeypatch.setattr(LayerStream, "put", timed_put)

    async def go() -> dict[tuple[int, int], float]:
        stream, arrived = LayerStream(), {}

        async def follow() -> None:
            async for piece in stream.follow():
                arrived[(piece.blob.header.token_start, piece.blob.header.layer_start)] = time.monotonic()

        follower = asyncio.ensure_future(follow())
        async for _ in runtime.generate("a", _prompt(5, 300), P_TOKEN, hold=True, stream=stream):
            pass
        stream.close()
        await follower
        return arrived

    arrived = asyncio.run(go())
    chunks = sorted({start for start, _ in arrived})
    assert len(chunks) >= 2
    for start in chunks:
        assert arrived[(start, 0)] < put_at[(start, layers - 1)], f"layer 0 of [{start}, ...) came after its forward"
    assert threading.current_thread() is threading.main_thread()


def test_a_range_computed_again_is_streamed_once(tiny_model_dir):
    """A prefill preempted after its first chunk computes from 0 again: its stream
    carries every layer of each token once (the repeat is dropped, not sent twice)."""
    e = Engine(tiny_model_dir, EngineConfig(page_size=16, num_pages=64, max_batch_tokens=16))
    prompt = _prompt(6, 40)

    async def go() -> list[codec.KVBlob]:
        stream, got = LayerStream(), []
        e.add_request("a", prompt, P_TOKEN, hold=True, stream=stream)
        e.step()  # tokens [0, 16)
        seq = e.seqs["a"]
        e.scheduler.running.remove(seq)  # (what `Scheduler._grow` does to a victim)
        e.kv.preempt(seq)
        e.flush_cache()  # (nothing of it left there: it computes from 0 again)
        e.scheduler.add(seq)
        while e.has_work():
            e.step()
        assert e.kv.preemptions == 1 and seq.output
        await asyncio.sleep(0)  # (the pieces reach the loop)
        stream.close()
        async for piece in stream.follow():
            got.append(piece.blob)
        return got

    got = asyncio.run(go())
    for layer in range(e.model_cfg.num_layers):
        ranges = sorted((b.header.token_start, b.header.token_end) for b in got if b.header.layer_start == layer)
        assert ranges == [(0, 16), (16, 32), (32, 40)], ranges


def test_p_sends_frames_while_its_prefill_still_computes(colocated, tmp_path):
    """Through `pdd up --mode pdd` (P-RLD-MD), a prompt P prefills in several steps: some of
    its KV frames leave P before the prefill ends (counted by P), and the tokens are
    colocated's."""
    prompts = [_prompt(7, 600), _prompt(8, 500)]
    want = [colocated(p, 20) for p in prompts]
    conf = _write_config(
        tmp_path / "pdd.toml",
        line=FAST_LINE,
        policy={"pipeline": "P-RLD-MD", "handoff": "one_shot"},
        engine={"max_batch_tokens": 64},
    )
    with pdd_up("--mode", "pdd", "--config", conf) as dep:
        got = [_stream(dep.url, p, 20) for p in prompts]
        early = HTTP.get(f"{dep.http['p0']}/pdd/stats", timeout=5).json()["node"]["kv_frames_in_prefill"]
    for g in got:
        assert g["finish_reason"] == "length" and len(g["ids"]) == 20 and not g.get("error"), g
    assert [g["ids"] for g in got] == want
    assert early > 0
