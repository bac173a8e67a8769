"""Checks e and f (scripts/gpu_check.py runs them): the embedded engine's KV imports and exports, copied on
its copy thread beside its steps (pdd/engines/embedded/copies.py: on CUDA through page-locked memory and a copy
stream ordered by events), on the device, and `pdd bench stall`'s figures there; a prefill's layers
streamed off the device as they are computed (pdd/kv/layer_stream.py). scripts/ is no package:
gpu_check.py imports this file by its folder."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from pdd.engines.embedded import copies, kv_moves
from pdd.engines.embedded.engine import Engine
from pdd.engines.embedded.runtime import EngineRuntime
from pdd.engines.port import EngineConfig
from pdd.kv import codec
from pdd.kv.layer_stream import LayerStream
from pdd.sampling.params import SamplingParams

# the tiny model's KV is 4 KiB a token in fp32: 4 tokens a slice, a prompt of a few hundred ~50-100 slices
SMALL_SLICE = 16 << 10
# `pdd bench stall` beside an import: small enough for seconds on a CPU, 16 MiB of KV to land
STALL = argparse.Namespace(streams=4, import_tokens=2048, trials=2, threads=1, engine="embedded", layers=8)


@contextlib.contextmanager
def small_slices(nbytes: int = SMALL_SLICE) -> Iterator[None]:
    """While it lasts, copies move `nbytes` of KV a slice at most: an import is many slices."""
    before = copies.SLICE_BYTES
    copies.SLICE_BYTES = nbytes
    try:
        yield
    finally:
        copies.SLICE_BYTES = before


@contextlib.contextmanager
def lost_slice() -> Iterator[list[tuple[int, int]]]:
    """The lost-slice fault: while it lasts, the first import claimed loses its middle slice, as a copy
    skipped or reordered past its stream's event would; yields the token ranges lost."""
    claim = kv_moves.import_copy
    lost: list[tuple[int, int]] = []

    def losing(*args: Any, **kwargs: Any) -> copies.Copy:
        copy = claim(*args, **kwargs)
        if not lost and len(copy.slices) > 2:
            a, b, _ = copy.slices.pop(len(copy.slices) // 2)
            lost.append((a, b))
        return copy

    kv_moves.import_copy = losing  # the name the engine's claim_import calls
    try:
        yield lost
    finally:
        kv_moves.import_copy = claim


def cpu_exports(cpu: Engine, batch: list[list[int]]) -> tuple[list[codec.KVBlob], list[list[int]]]:
    """Each prompt prefilled on the CPU engine, held, its KV exported and sent as bytes (as check b's
    handover); the blobs as decoded from the bytes, and each prompt's first token."""
    cpu.flush_cache()
    for i, p in enumerate(batch):
        cpu.add_request(f"x{i}", p, SamplingParams(max_tokens=1, ignore_eos=True), hold=True)
    while cpu.has_work():
        cpu.step()
    blobs = [codec.decode(codec.encode(cpu.export_kv(f"x{i}", 0, len(p)))) for i, p in enumerate(batch)]
    firsts = [list(cpu.seqs[f"x{i}"].output) for i in range(len(batch))]
    for i in range(len(batch)):
        cpu.release(f"x{i}")
    return blobs, firsts


def _pool_kv(e: Engine, rid: str, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [0, n) of a sequence's KV as its pages hold it, on the CPU (the engine thread's)."""
    slots = e.pool.slots(e.seqs[rid].pages, 0, n).to(e.pool.k.device)
    return e.pool.k[:, slots].cpu(), e.pool.v[:, slots].cpu()


async def _round_trip(
    rt: EngineRuntime,
    batch: list[list[int]],
    blobs: list[codec.KVBlob],
    firsts: list[list[int]],
    params: SamplingParams,
) -> tuple[int, int, int, list[list[int]]]:
    """Each prompt's KV imported into the runtime's pool, read there, exported back, then decoded on: each
    next import and export runs beside the decode of those started before it. How many prompts' KV landed
    byte for byte, how many came back so, the engine's steps while the copies ran, and each continuation."""
    landed, back, beside, streams = 0, 0, 0, []
    for i, (p, blob, first) in enumerate(zip(batch, blobs, firsts, strict=True)):
        rid = f"e{i}"
        await rt.reserve(rid, p, params, use_cache=False)
        steps = rt.engine.stats.steps
        await rt.import_kv(rid, blob)
        k, v = await rt.call(functools.partial(_pool_kv, rid=rid, n=len(p)))
        landed += torch.equal(k, blob.k) and torch.equal(v, blob.v)
        out = await rt.export_kv(rid, 0, len(p))
        beside += rt.engine.stats.steps - steps
        back += torch.equal(out.k.cpu(), blob.k) and torch.equal(out.v.cpu(), blob.v)
        watch = rt.watch(rid)
        await rt.start(rid, first)
        streams.append(asyncio.ensure_future(_continuation(watch, first)))
    return landed, back, beside, list(await asyncio.gather(*streams))


async def _continuation(watch: Any, first: list[int]) -> list[int]:
    try:
        return first + [out.token async for out in watch if out.token is not None]
    finally:
        watch.close()


def copies_on_device(
    cpu: Engine, model: Path, device: str, batch: list[list[int]], want: list[list[int]], params: SamplingParams
) -> tuple[bool, str]:
    """Part 1 of check e: the CPU engine's exported KV of `batch` imported by an `EngineRuntime` on `device`
    in slices of SMALL_SLICE, exported back, and decoded on there: the bytes equal the CPU's both ways (fp32,
    exactly) and the continuations equal `want`, a colocated CPU run's."""
    blobs, firsts = cpu_exports(cpu, batch)
    rt = EngineRuntime(Engine(model, EngineConfig(page_size=16, num_pages=512, device=device)))
    rt.start_thread()
    try:
        with small_slices():
            landed, back, beside, got = asyncio.run(_round_trip(rt, batch, blobs, firsts, params))
        slices = rt.copies.slices_done
    finally:
        rt.close()
    equal = sum(g == w for g, w in zip(got, want, strict=True))
    n = len(batch)
    mib = sum(2 * b.k.numel() * b.k.element_size() for b in blobs) / 2**20
    said = (
        f"cpu's KV of {n} prompts ({mib:.1f} MiB) imported into {device} and exported back in {slices} slices of "
        f"{SMALL_SLICE >> 10} KiB, beside {beside} decode steps: {landed}/{n} landed byte-equal, {back}/{n} "
        f"exported back byte-equal; {equal}/{n} continuations ({params.max_tokens} tokens) equal a colocated cpu run"
    )
    return landed == back == equal == n, said


def stall_figures(device: str) -> str:
    """Part 2 of check e: `pdd bench stall`'s measure on `device` (its own slices): its streams' inter-token
    latency without an import and during one, and the import's rate. Printed, never judged."""
    from pdd.lab.bench import stall
    from pdd.model.tiny import make_tiny

    args = argparse.Namespace(**vars(STALL), device=device)
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny(Path(tmp) / "stall", layers=args.layers, max_position=4096)
        r = stall.measure(str(model), args)
    w, d = r["itl_without"], r["itl_during"]
    return (
        f"bench stall ({args.streams} streams, {args.import_tokens}-token import of {r['import_bytes'] / 2**20:.0f} "
        f"MiB, {args.layers} layers): ITL p50/p99 {w['p50_ms']:.1f}/{w['p99_ms']:.1f} ms without, "
        f"{d['p50_ms']:.1f}/{d['p99_ms']:.1f} ms during; import {r['import_mb_s']:,.0f} MB/s"
    )


@contextlib.contextmanager
def stale_piece() -> Iterator[None]:
    """The stale-piece fault: while it lasts, the first layer a prefill streams is put with its values
    zeroed, as a copy read before the layer's event (the model's stream had not written it yet) would."""
    put = LayerStream.put
    done: list[bool] = []

    def stale(self: LayerStream, blob: codec.KVBlob, ready: Any = None) -> None:
        if not done:
            done.append(True)
            blob = codec.KVBlob(blob.header, torch.zeros_like(blob.k), blob.v)
        put(self, blob, ready)

    LayerStream.put = stale  # type: ignore[method-assign]
    try:
        yield
    finally:
        LayerStream.put = put  # type: ignore[method-assign]


async def _streamed(rt: EngineRuntime, rid: str, prompt: list[int]) -> tuple[int, bool]:
    """P's prefill of `prompt` with a stream: the pieces, once each one's copy is done, against the
    device's own export of the same tokens afterwards (how many pieces, and whether every byte matched)."""
    stream, pieces = LayerStream(), []

    async def follow() -> None:
        async for piece in stream.follow():
            if piece.ready is not None:
                await asyncio.to_thread(piece.ready)
            pieces.append(piece.blob)

    follower = asyncio.ensure_future(follow())
    async for _ in rt.generate(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True), hold=True, stream=stream):
        pass
    stream.close()
    await follower
    whole = await rt.export_kv(rid, 0, len(prompt))
    await rt.release(rid)
    equal = all(
        torch.equal(b.k[0].cpu(), whole.k[b.header.layer_start, b.header.token_start : b.header.token_end].cpu())
        and torch.equal(b.v[0].cpu(), whole.v[b.header.layer_start, b.header.token_start : b.header.token_end].cpu())
        for b in pieces
    )
    covered = sum(b.header.num_tokens for b in pieces) == len(prompt) * whole.header.num_layers
    return len(pieces), equal and covered


def streamed_on_device(model: Path, device: str, batch: list[list[int]]) -> tuple[bool, str]:
    """Check f: each prompt prefilled on `device` in 64-token steps with a `LayerStream` (P's layer-by-layer
    path: each layer's new KV queued off the device as it is computed, `CopyStream.to_host`); every piece,
    read once its copy is done, equals the device's own export of those tokens afterwards, byte for byte."""
    rt = EngineRuntime(Engine(model, EngineConfig(page_size=16, num_pages=512, device=device, max_batch_tokens=64)))
    rt.start_thread()

    async def go() -> list[tuple[int, bool]]:
        return [await _streamed(rt, f"f{i}", p) for i, p in enumerate(batch)]

    try:
        got = asyncio.run(go())
    finally:
        rt.close()
    equal = sum(ok for _, ok in got)
    pieces = sum(n for n, _ in got)
    said = (
        f"{len(batch)} prompts prefilled on {device} in 64-token steps, {pieces} layer pieces streamed: "
        f"{equal}/{len(batch)} prompts' pieces equal {device}'s export byte for byte"
    )
    return equal == len(batch), said
