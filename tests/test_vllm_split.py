"""pdd's connector where vLLM splits a request's KV across ranks other than by heads, on
synthetic caches (vLLM's own allocation and, for the latent, its CPU_MLA write): pipeline
stages (each stage's workers hold its layers) and decode context parallelism (each rank
holds the tokens vLLM's interleave rule gives it: `pdd.engines.vllm.split`)."""

from __future__ import annotations

import asyncio
import functools
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from test_vllm_layouts import (  # noqa: E402
    MODEL_DTYPE,
    attention_layer,
    blob,
    cpu_attn_layer,
    mla_spec,
    vllm_caches,
    vllm_config,
    workers,
)
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from pdd.engines.vllm.split import TokenSplit  # noqa: E402


def names(layers: range) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in layers]


# ---- pipeline stages ---------------------------------------------------------------------


def staged_workers(gate_rank: int | None = None) -> tuple[Any, list[Any], threading.Event]:
    """Four layers in two stages of two tensor-parallel ranks (one of the two KV heads
    each), CPU_ATTN caches; with `gate_rank`, that worker's writes wait for the gate."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=MODEL_DTYPE)
    layer = cpu_attn_layer(spec)
    stage_names = [names(range(0, 2)), names(range(2, 4))]
    caches = [dict(zip(stage_names[s], vllm_caches(spec, "LBHNC"), strict=True)) for s in (0, 0, 1, 1)]
    places = [{"rank": r, "world": 2, "stage": s, "stages": 2} for s in (0, 1) for r in (0, 1)]
    kv, bridges = workers(
        vllm_config("LBHNC", total_heads=2, tp=2, block_size=32, pipeline_parallel_size=2),
        dict.fromkeys(names(range(4)), layer),
        caches,
        places=places,
    )
    gate = threading.Event()
    if gate_rank is not None:
        copier = bridges[gate_rank].worker.copier
        write = copier.write
        copier.write = lambda header: (gate.wait(60), write(header))
    return kv, bridges, gate


def test_each_stage_carries_its_own_layers_and_an_export_gathers_every_stage():
    kv, bridges, _ = staged_workers()
    assert [(b.layout["rank"], b.layout["layer_start"], b.layout["layers"]) for b in bridges] == [
        (0, 0, 2), (1, 0, 2), (2, 2, 2), (3, 2, 2),
    ]  # fmt: skip
    assert kv.num_layers == 4 and kv.total_heads == 2 and kv.bytes_per_token == 2 * 4 * 2 * 64 * 2
    tokens, blocks = list(range(50)), [1, 0]
    k, v = (torch.randn(4, 40, 2, 64).to(MODEL_DTYPE) for _ in range(2))
    kv.check_import(blob(kv, tokens, 40, k, v), tokens, 0, 50)
    asyncio.run(kv.write(blocks, blob(kv, tokens, 40, k, v)))
    slots = torch.cat([torch.arange(32, 64), torch.arange(8)])  # blocks 1 then 0, of 32 tokens
    for bridge in bridges:
        w = bridge.worker
        for i, cache in enumerate(w.copier.layers):  # its stage's layers, its head
            got_k, got_v = cache.read(slots)
            layer, head = 2 * w.stage + i, slice(w.rank, w.rank + 1)
            assert torch.equal(got_k, k[layer, :, head]) and torch.equal(got_v, v[layer, :, head])
    out = asyncio.run(kv.read(blocks, tokens, 0, 40))
    assert torch.equal(out.k, k) and torch.equal(out.v, v) and out.header.num_layers == 4
    middle = asyncio.run(kv.read(blocks, tokens, 5, 33, range(1, 3)))  # a layer of each stage
    assert (middle.header.layer_start, middle.header.layer_end) == (1, 3)
    assert torch.equal(middle.k, k[1:3, 5:33]) and torch.equal(middle.v, v[1:3, 5:33])
    late = asyncio.run(kv.read(blocks, tokens, 0, 40, range(3, 4)))  # the last stage's alone
    assert torch.equal(late.k, k[3:]) and [b.ops.count("read") for b in bridges] == [2, 2, 3, 3]


def test_an_import_is_in_only_once_the_last_stage_has_its_part():
    kv, bridges, gate = staged_workers(gate_rank=3)
    tokens = list(range(40))
    k, v = (torch.randn(4, 40, 2, 64).to(MODEL_DTYPE) for _ in range(2))

    async def go() -> None:
        task = asyncio.ensure_future(kv.write([0, 1], blob(kv, tokens, 40, k, v)))
        for _ in range(600):  # stages 0 and rank 2 answer; rank 3 waits at the gate
            if all(b.ops == ["write"] for b in bridges) and len(kv._waiting) == 1:
                break
            await asyncio.sleep(0.05)
        assert not task.done() and len(kv._waiting) == 1
        gate.set()
        await asyncio.wait_for(task, 60)

    asyncio.run(go())
    out = asyncio.run(kv.read([0, 1], tokens, 0, 40))
    assert torch.equal(out.k, k) and torch.equal(out.v, v)


def test_stages_that_do_not_tile_the_model_are_refused():
    kv, _, _ = staged_workers()
    kv.workers[2].layer_start = kv.workers[3].layer_start = 3
    with pytest.raises(RuntimeError, match=r"pipeline stages holding layers \[\(0, 2\), \(3, 2\)\]"):
        kv.check_stages()


# ---- decode context parallelism ----------------------------------------------------------


def vllms_slot(position: int, blocks: list[int], block: int, ranks: int, rank: int, interleave: int) -> int | None:
    """Where DCP rank `rank` keeps `position`, or None: vLLM's slot-mapping kernel
    (`vllm.v1.worker.block_table.ComputeSlotMappingKernel.kernel`), one position at a time."""
    virtual_block_size = block * ranks
    virtual_block_index, offset = divmod(position, virtual_block_size)
    if (offset // interleave) % ranks != rank:
        return None
    local = (offset // (ranks * interleave)) * interleave + offset % interleave
    return blocks[virtual_block_index] * block + local


def dcp_workers(interleave: int, told: int | None = None) -> tuple[Any, list[Any], list[dict[str, torch.Tensor]]]:
    """Two layers of a DeepSeek-V3 latent (CPU_MLA's write) on TP 2 = DCP 2, 16-token
    blocks; each worker told `told` as its interleave (vLLM's, unless given)."""
    spec = mla_spec(block=16)
    update = functools.partial(CPUMLAImpl.do_kv_cache_update, None)
    layer = attention_layer(CPUMLABackend, spec, kv_lora_rank=512, impl=SimpleNamespace(do_kv_cache_update=update))
    caches = [dict(zip(names(range(2)), vllm_caches(spec, "LBNHC", blocks=6), strict=True)) for _ in range(2)]
    for rank_caches in caches:
        for cache in rank_caches.values():
            cache.zero_()
    places = [{"split": TokenSplit(r, 2, told or interleave)} for r in range(2)]
    config = vllm_config("LBNHC", tp=2, block_size=16, decode_context_parallel_size=2)
    kv, bridges = workers(config, dict.fromkeys(names(range(2)), layer), caches, places=places)
    return kv, bridges, caches


def placed_as_vllm_places(caches: list[dict[str, torch.Tensor]], latent: torch.Tensor, blocks: list[int],
                          interleave: int) -> bool:  # fmt: skip
    """Whether each rank's cache holds exactly the positions vLLM's rule gives it, each
    where vLLM's kernel would write it, and nothing anywhere else."""
    for rank, rank_caches in enumerate(caches):
        for layer, cache in enumerate(rank_caches.values()):
            flat = cache.reshape(-1, cache.shape[-1])  # [slots, 576]
            want = torch.zeros_like(flat)
            for p in range(latent.shape[1]):
                slot = vllms_slot(p, blocks, 16, 2, rank, interleave)
                if slot is not None:
                    want[slot] = latent[layer, p, 0]
            if not torch.equal(flat, want):
                return False
    return True


@pytest.mark.parametrize("interleave", [1, 4, 16])
def test_dcp_ranks_hold_the_tokens_vllms_interleave_gives_them_and_an_export_gathers_them_in_order(interleave):
    kv, bridges, caches = dcp_workers(interleave)
    assert [b.layout["block_size"] for b in bridges] == [32, 32]  # the scheduler's block: 16 tokens a rank
    assert kv.total_heads == 1 and kv.bytes_per_token == 2 * 576 * 2  # one latent a token, not one a rank
    tokens, blocks = list(range(100, 190)), [2, 0, 1]  # 3 scheduler blocks of 32
    latent = torch.randn(2, 90, 1, 576).to(MODEL_DTYPE)
    incoming = blob(kv, tokens, 90, latent, latent[..., :0])
    kv.check_import(incoming, tokens, 0, 90)
    asyncio.run(kv.write(blocks, incoming))
    assert placed_as_vllm_places(caches, latent, blocks, interleave)
    out = asyncio.run(kv.read(blocks, tokens, 0, 90))
    assert [b.ops for b in bridges] == [["write", "read"], ["write", "read"]]  # each rank's own tokens
    assert torch.equal(out.k.view(torch.int16), latent.view(torch.int16)) and out.v.shape == (2, 90, 1, 0)
    part = asyncio.run(kv.read(blocks, tokens, 7, 61, range(1, 2)))  # off every boundary
    assert torch.equal(part.k, latent[1:, 7:61])


def test_a_rank_told_another_interleave_than_vllms_misplaces_what_vllm_reads():
    """The layout test's own edge: workers splitting by 1 token where vLLM splits by 4
    round-trip their own writes but hold them where vLLM's attention does not look."""
    kv, _, caches = dcp_workers(4, told=1)
    tokens, blocks = list(range(64)), [1, 0]
    latent = torch.randn(2, 64, 1, 576).to(MODEL_DTYPE)
    asyncio.run(kv.write(blocks, blob(kv, tokens, 64, latent, latent[..., :0])))
    assert torch.equal(asyncio.run(kv.read(blocks, tokens, 0, 64)).k, latent)
    assert not placed_as_vllm_places(caches, latent, blocks, 4)
    assert placed_as_vllm_places(caches, latent, blocks, 1)


@pytest.mark.parametrize(("interleave", "rank"), [(1, 0), (1, 1), (4, 1), (16, 0)])
def test_the_split_is_vllms_slot_mapping_position_by_position(interleave, rank):
    split, blocks = TokenSplit(rank, 2, interleave), [5, 2, 7]
    held = split.positions(0, 96)
    assert held.tolist() == [p for p in range(96) if vllms_slot(p, blocks, 16, 2, rank, interleave) is not None]
    got = split.slots(torch.tensor(blocks), held, 16).tolist()
    assert got == [vllms_slot(p, blocks, 16, 2, rank, interleave) for p in held.tolist()]
