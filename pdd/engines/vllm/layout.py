"""Token-major KV in and out of vLLM's paged caches, in every layout pdd carries exactly.

vLLM (0.32 on CPU, 0.33 on CUDA) hands the connector one tensor per layer: its logical
`[blocks, heads, block_size, content]` view of one shared allocation
(`vllm.v1.kv_cache_interface.create_kv_cache_views`), `content` in the cache's storage
dtype (uint8 for an fp8 cache). The resolved `KVCacheLayout`
(`cache_config.kv_cache_layout`) only permutes the strides: LBNHC is FlashInfer's NHD
and the default, LBHNC its HND and the CPU backend's only one, BL* interleave the
layers block by block. Indexing the logical view follows any of them; what `content`
holds is the attention backend's business:

* FlashAttention, FlashInfer, Triton (`TokenMajorLayout`): K then V, head_size each.
  The token at slot s is `[s // N, :, s % N, :D]` and `[..., D:]`; fp8 bytes stay bytes.
* MLA (`LatentLayout`): one head; `content` is one latent vector per token,
  kv_lora_rank + qk_rope_head_dim wide (DeepSeek V3: 512 + 64), no K/V split.
* CPU_ATTN (`CpuPackedLayout`): each (block, head) holds a K region then a V region of
  N * D values each, packed per instruction set: with the "vec" and "vec16" kernels
  (x86 AVX-512/AVX2) K is column-major `[D, N]` and V row-major `[N, D]`; with "amx"
  (bf16 on AMX Xeons) both are interleaved in pairs for the tiles. vLLM has a kernel
  that packs (`cpu_attn_reshape_and_cache`, what the forward pass calls) and none that
  unpacks: importing uses vLLM's kernel, and exporting reads through the packing that
  same kernel is seen to make (`cpu_packing`), whatever its instruction set.

`describe` picks the layout from what vLLM says of each layer (backend class, KV cache
spec, cache dtype, tensor-parallel shard), never from the tensor. `check_against_vllm`
then has the layer's own backend (`impl.do_kv_cache_update`, the reshape-and-cache
kernel of that device) write known values into a scratch cache with the real one's
shape, strides and dtype, and refuses to start unless pdd's layout reads them back
bit for bit: a build whose packing pdd does not know is refused, never misread.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

DENSE_CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32")
FP8_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")  # one scale a layer for K, one for V


class TokenMajorLayout:
    """A layer's K-then-V cache (`[B, H, N, 2D]`, any stride order), read and written
    through vLLM's logical view in its storage dtype."""

    def __init__(self, cache: torch.Tensor, head_dim: int) -> None:
        if cache.dim() != 4 or cache.shape[-1] != 2 * head_dim:
            raise ValueError(f"KV cache of shape {tuple(cache.shape)} is not [blocks, heads, block, 2 * {head_dim}]")
        tokens = cache.transpose(1, 2)  # [B, N, H, 2D]: the view the attention kernels index
        self.k, self.v = tokens[..., :head_dim], tokens[..., head_dim:]
        self.block_size = cache.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = slots.to(self.k.device)
        b, o = slots // self.block_size, slots % self.block_size
        self.k[b, o] = k.to(self.k.device, self.k.dtype)
        self.v[b, o] = v.to(self.v.device, self.v.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.k.device)
        b, o = slots // self.block_size, slots % self.block_size
        return self.k[b, o], self.v[b, o]


class LatentLayout:
    """A layer's MLA cache (`[B, 1, N, L]`): K is the latent `[T, 1, L]`, V is empty."""

    def __init__(self, cache: torch.Tensor, width: int) -> None:
        if cache.dim() != 4 or cache.shape[1] != 1 or cache.shape[-1] != width:
            raise ValueError(f"MLA cache of shape {tuple(cache.shape)} is not [blocks, 1, block, {width}]")
        self.latent = cache.transpose(1, 2)  # [B, N, 1, L]
        self.block_size = cache.shape[2]

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        slots = slots.to(self.latent.device)
        self.latent[slots // self.block_size, slots % self.block_size] = k.to(self.latent.device, self.latent.dtype)

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        slots = slots.to(self.latent.device)
        k = self.latent[slots // self.block_size, slots % self.block_size]
        return k, k[..., :0]


@functools.cache
def cpu_packing(isa: str, block_size: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Where vLLM's CPU kernel for `isa` puts value d of a block's token o, in its (block,
    head)'s K region and in its V region: two `[N, D]` offsets into N * D values each.
    Seen, not assumed: the kernel itself writes a block whose every value is its token's
    position + 1, then one whose every value is its dimension + 1 (exact integers in any
    cache dtype), and where each (o, d) landed is read off; a packing that is not a
    one-to-one arrangement of each region is refused."""
    from vllm import _custom_ops as ops

    n, d = block_size, head_dim
    exact = int(2 / torch.finfo(dtype).eps)  # integers up to this are exact in `dtype` (bf16: 256)
    if max(n, d) > exact:
        raise ValueError(f"pdd cannot learn vLLM's {isa!r} KV packing of {n} x {d} in {dtype}")
    cache = torch.zeros(1, 1, 2 * n, d, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    seen = []
    for values in (torch.arange(1, n + 1)[:, None].expand(n, d), torch.arange(1, d + 1)[None, :].expand(n, d)):
        cache.zero_()
        x = values[:, None, :].to(dtype).contiguous()  # [N, 1 head, D]
        ops.cpu_attn_reshape_and_cache(x, x, key_cache, value_cache, torch.arange(n), isa)
        seen.append(cache.view(2, n * d).long() - 1)
    token, dim = seen
    packing = []
    for side in range(2):  # K, V
        where = token[side] * d + dim[side]  # the (o, d) each offset holds, as o * D + d
        if not torch.equal(torch.sort(where).values, torch.arange(n * d)):
            raise ValueError(f"vLLM's {isa!r} CPU kernel does not pack KV one value to one place: pdd cannot read it")
        offsets = torch.empty(n * d, dtype=torch.long)
        offsets[where] = torch.arange(n * d)
        packing.append(offsets.view(n, d))
    return packing[0], packing[1]


class CpuPackedLayout:
    """A layer's cache on CPU, packed as vLLM's kernel for `isa` packs it (`cpu_packing`)."""

    def __init__(self, cache: torch.Tensor, head_dim: int, isa: str) -> None:
        blocks, heads, n, content = cache.shape
        if content != 2 * head_dim:
            raise ValueError(f"KV cache of shape {tuple(cache.shape)} is not [blocks, heads, block, 2 * {head_dim}]")
        # the forward pass's own view: [B, H, 2N, D] split in two along the token axis
        self.key_cache, self.value_cache = cache.view(blocks, heads, 2 * n, head_dim).chunk(2, dim=2)
        self.k_regions = self.key_cache.reshape(blocks, heads, n * head_dim)  # (views: the regions are contiguous)
        self.v_regions = self.value_cache.reshape(blocks, heads, n * head_dim)
        self.k_offsets, self.v_offsets = cpu_packing(isa, n, head_dim, cache.dtype)
        self.heads = torch.arange(heads)[None, :, None]
        self.block_size, self.isa = n, isa

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        dtype = self.key_cache.dtype
        ops.cpu_attn_reshape_and_cache(
            k.to(dtype).contiguous(), v.to(dtype).contiguous(), self.key_cache, self.value_cache, slots, self.isa
        )

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, o = (slots // self.block_size)[:, None, None], slots % self.block_size
        k = self.k_regions[b, self.heads, self.k_offsets[o][:, None, :]]  # [T, H, D]
        v = self.v_regions[b, self.heads, self.v_offsets[o][:, None, :]]
        return k, v


Layout = TokenMajorLayout | LatentLayout | CpuPackedLayout


@dataclass(frozen=True)
class CacheShape:
    """What one worker's caches hold, as vLLM describes it; the same for every layer."""

    backend: str  # vLLM's attention backend, e.g. "FLASH_ATTN", "CPU_ATTN", "FLASHMLA"
    layout: str  # vLLM's resolved KVCacheLayout, e.g. "LBNHC" (NHD), "LBHNC" (HND)
    latent: bool  # MLA: one latent vector a token, no heads, no K/V split
    heads: int  # this rank's KV heads (1 for a latent)
    head_start: int  # the first of them among the model's (ranks past the heads hold replicas)
    head_dim: int  # K's and V's width each, or the latent's
    dtype: torch.dtype  # of the values: the model's, or an fp8 the cache stores as bytes
    isa: str  # CPU_ATTN's packing; "" elsewhere
    scales: tuple[float, ...]  # an fp8 cache's K and V scale of every layer; () otherwise

    def layout_of(self, cache: torch.Tensor) -> Layout:
        """pdd's layout over one layer's cache of this shape."""
        if self.latent:
            return LatentLayout(cache, self.head_dim)
        if self.backend == "CPU_ATTN":
            return CpuPackedLayout(cache, self.head_dim, self.isa)
        return TokenMajorLayout(cache, self.head_dim)


def describe(vllm_config: Any, layers: list[Any], rank: int, world: int) -> CacheShape:
    """The shape of these attention layers' caches on tensor-parallel rank `rank` of
    `world`, from vLLM's own description of each; whatever pdd cannot carry exactly is
    refused by name. (A pipeline stage's layers and a decode-context-parallel rank's
    tokens are the worker's to say: `worker_side`, `split`.)"""
    from vllm.platforms import current_platform
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec

    if vllm_config.parallel_config.prefill_context_parallel_size > 1:
        raise RuntimeError("pdd's KV connector does not carry KV whose tokens prefill context parallelism shards")
    first = layers[0]
    specs = [layer.get_kv_cache_spec(vllm_config) for layer in layers]
    spec = specs[0]
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec) or window:
        kind = f"{type(spec).__name__}" + (f" (window {window})" if window else "")
        raise RuntimeError(f"pdd's KV connector cannot carry vLLM's {kind} cache exactly")
    if any(s != spec for s in specs[1:]):
        raise RuntimeError(
            "pdd's KV connector carries one KV cache group of identical layers; this model has several: "
            f"{sorted({type(s).__name__ for s in specs})}, {len({s.page_size_bytes for s in specs})} page sizes"
        )
    backend = first.get_attn_backend()
    cache_dtype = first.kv_cache_dtype
    if cache_dtype not in DENSE_CACHE_DTYPES + FP8_CACHE_DTYPES or spec.state_content_bytes or spec.num_head_slots:
        raise RuntimeError(f"pdd's KV connector cannot carry vLLM's {cache_dtype!r} KV cache exactly")
    fp8 = cache_dtype in FP8_CACHE_DTYPES
    if fp8 and backend.get_name() == "CPU_ATTN":
        raise RuntimeError("vLLM's CPU_ATTN packs an fp8 KV cache for AVX-512/AMX; pdd does not read it")
    latent = backend.is_mla()
    total_heads = 1 if latent else vllm_config.model_config.get_total_num_kv_heads()
    replicas = max(1, world // total_heads)  # consecutive ranks holding the same heads (vLLM's QKV split)
    if fp8:
        values = torch.float8_e5m2 if cache_dtype == "fp8_e5m2" else current_platform.fp8_dtype()
    else:
        values = spec.dtype
    return CacheShape(
        backend=backend.get_name(),
        layout=vllm_config.cache_config.get_resolved_kv_cache_layout().name,
        latent=latent,
        heads=spec.num_kv_heads,
        head_start=rank // replicas * spec.num_kv_heads,
        head_dim=spec.head_size,
        dtype=values,
        isa=first.isa if backend.get_name() == "CPU_ATTN" else "",
        scales=tuple(float(s) for layer in layers for s in (layer._k_scale, layer._v_scale)) if fp8 else (),
    )


def check_against_vllm(shape: CacheShape, layer: Any, cache: torch.Tensor, input_dtype: torch.dtype) -> None:
    """Write known values into a two-block scratch cache with `cache`'s strides and dtype
    through the layer's own vLLM backend, as a forward pass writes them (`input_dtype`:
    the model's); refuse to start unless pdd's layout reads back exactly those values."""
    scratch = torch.empty_strided((2, *cache.shape[1:]), cache.stride(), dtype=cache.dtype, device=cache.device)
    scratch.zero_()
    what = f"vLLM's {shape.backend} cache ({shape.layout}, {shape.dtype})"
    if shape.latent:
        rank = layer.kv_lora_rank

        def write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            latent = _quantized_input(k, layer._k_scale, shape.dtype, input_dtype).squeeze(1)
            kv_c, k_pe = latent[:, :rank].contiguous(), latent[:, None, rank:].contiguous()
            layer.impl.do_kv_cache_update(kv_c, k_pe, scratch.squeeze(1), slots, layer.kv_cache_dtype, layer._k_scale)

    else:

        def write(slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
            key = _quantized_input(k, layer._k_scale, shape.dtype, input_dtype)
            value = _quantized_input(v, layer._v_scale, shape.dtype, input_dtype)
            layer.impl.do_kv_cache_update(layer, key, value, scratch, slots)

    _expect_readback(shape.layout_of(scratch), write, scratch, shape.head_dim, what, shape.dtype)


def _quantized_input(
    x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, input_dtype: torch.dtype
) -> torch.Tensor:
    """What the model would feed vLLM for cache values `x` (its storage bytes): for an
    fp8 cache `x * scale` in the model's dtype, which vLLM's kernel divides by `scale`
    back to exactly `x` (bf16 rounds by 2^-9 at most, fp8's steps are 2^-4 apart)."""
    if dtype.itemsize != 1:  # (fp8 is the only one-byte dtype pdd carries)
        return x
    return (x.view(dtype).float() * scale.to(x.device).float()).to(input_dtype)


def _expect_readback(
    layout: Layout,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
    scratch: torch.Tensor,
    width: int,
    what: str,
    dtype: torch.dtype | None = None,
) -> None:
    """Write 1.5 blocks of known values in shuffled slots with `write` (vLLM's own) and
    refuse unless `layout.read` returns them bit for bit."""
    blocks, heads, n, _ = scratch.shape
    gen = torch.Generator().manual_seed(0)
    count = blocks * n * 3 // 4
    slots = torch.randperm(blocks * n, generator=gen)[:count].to(scratch.device)
    sides = [torch.randn(count, heads, width, generator=gen) for _ in range(2)]
    k, v = (_as_stored(x, dtype or scratch.dtype, scratch.dtype).to(scratch.device) for x in sides)
    write(slots, k, v)
    got_k, got_v = layout.read(slots)
    want_v = v[..., :0] if isinstance(layout, LatentLayout) else v
    if not (_same_bits(got_k, k) and _same_bits(got_v, want_v)):
        raise RuntimeError(f"{what} is not laid out as pdd reads it: refusing to move KV")


def _as_stored(x: torch.Tensor, values: torch.dtype, storage: torch.dtype) -> torch.Tensor:
    """`x` as a cache of `values` stores it (fp8: its bytes, in `storage`)."""
    return x.to(values).view(storage)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(
        a.cpu().contiguous().view(torch.uint8), b.cpu().contiguous().view(torch.uint8)
    )
