"""pdd's layouts of vLLM's KV caches. Each cache here is allocated by vLLM's own worker
code (`vllm.v1.worker.utils.allocate_kv_cache`, the call vLLM's model runner makes,
whose per-layer views are what the connector's `register_kv_caches` receives) from the
KV cache spec vLLM's attention layer reports, in each `KVCacheLayout` the backend
runs. pdd's layout is chosen by `describe` from vLLM's description of the layer, as
in a worker; values are then written the way vLLM's kernels index the cache by an
independent reference (element offsets read off the layout's name, the K/V or latent
split of the backend's kernel) and read back through pdd, and the reverse.

FlashAttention, Triton and the MLA backends import on this CPU-only vLLM build and
are asked; FlashInfer's module needs the `flashinfer` package, so its layouts are
written down from vLLM 0.33's `vllm/v1/attention/backends/flashinfer.py`
(`FlashInferBackend.supported_kv_cache_layouts`: any, LBHNC/BLHNC on SM100) and
named with vLLM's own `get_flashinfer_layout_string`. vLLM 0.32/0.33 have no
`get_kv_cache_shape`/`get_kv_cache_stride_order` any more: shape and strides come
from the spec and the layout (`vllm.v1.kv_cache_interface.create_kv_cache_views`).
MLA and fp8 run on CPU tensors; the CUDA cases (a "cuda" device parameter, or vLLM's
CUDA kernels) run where CUDA is, and may skip in CI (`ci_may_skip`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import threading
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("vllm")

from vllm.config import CacheConfig  # noqa: E402
from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype  # noqa: E402
from vllm.v1.attention.backend import AttentionType  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa as cpu_isa  # noqa: E402 (vLLM's own choice)
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl  # noqa: E402
from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend  # noqa: E402
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import get_flashinfer_layout_string, get_supported_kv_cache_layouts  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

from pdd.engines.port import RequestError  # noqa: E402
from pdd.engines.vllm.kvio import WorkerInfo, WorkerKV  # noqa: E402
from pdd.engines.vllm.layout import (  # noqa: E402
    CpuPackedLayout,
    LatentLayout,
    TokenMajorLayout,
    check_against_vllm,
    cpu_packing,
    describe,
)
from pdd.engines.vllm.staging import SLOT_BYTES, SLOTS, Region  # noqa: E402
from pdd.engines.vllm.worker_side import WorkerSide  # noqa: E402
from pdd.kv import codec  # noqa: E402
from pdd.kv.blocks import block_hashes  # noqa: E402
from pdd.kv.continuation import CacheForm, check_continuation  # noqa: E402

MODEL_DTYPE = torch.bfloat16
FLASHINFER = SimpleNamespace(get_name=lambda: "FLASHINFER", is_mla=lambda: False)  # (see the module's docstring)
_CUDA = pytest.param(
    "cuda",
    marks=[pytest.mark.ci_may_skip, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")],
)
DEVICES = ["cpu", _CUDA]


# ---- vLLM's side: its config, layers and caches ---------------------------------------------


def vllm_config(layout: str, total_heads: int = 2, tp: int = 1, block_size: int = 16, **parallel: int) -> Any:
    cache = CacheConfig(block_size=block_size)
    cache.kv_cache_layout = layout  # (what the engine core resolved: `resolve_kv_cache_layout`)
    sizes = {"pipeline_parallel_size": 1, "decode_context_parallel_size": 1, "prefill_context_parallel_size": 1}
    return SimpleNamespace(
        cache_config=cache,
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, **{**sizes, **parallel}),
        model_config=SimpleNamespace(dtype=MODEL_DTYPE, get_total_num_kv_heads=lambda: total_heads),
        compilation_config=SimpleNamespace(static_forward_context={}),
    )


def attention_layer(backend: Any, spec: Any, cache_dtype: str = "auto", k_scale: float = 1.0, **extra: Any) -> Any:
    """What vLLM's `Attention`/`MLAAttention` module tells about itself, and its scales."""
    return SimpleNamespace(
        get_attn_backend=lambda: backend,
        get_kv_cache_spec=lambda config: spec,
        kv_cache_dtype=cache_dtype,
        _k_scale=torch.tensor(k_scale),
        _v_scale=torch.tensor(k_scale * 2),
        **extra,
    )


def dense_spec(cache_dtype: str = "auto", heads: int = 2, head_dim: int = 64, block: int = 16) -> FullAttentionSpec:
    """The spec vLLM's `Attention.get_kv_cache_spec` makes (fp8 is stored as uint8)."""
    dtype = kv_cache_dtype_str_to_dtype(cache_dtype, SimpleNamespace(dtype=MODEL_DTYPE))
    return FullAttentionSpec(block_size=block, num_kv_heads=heads, head_size=head_dim, dtype=dtype)


def mla_spec(cache_dtype: str = "auto", block: int = 16) -> MLAAttentionSpec:
    """`MLAAttention.get_kv_cache_spec` of DeepSeek V3: one "head" of 512 + 64."""
    dtype = kv_cache_dtype_str_to_dtype(cache_dtype, SimpleNamespace(dtype=MODEL_DTYPE))
    return MLAAttentionSpec(
        block_size=block, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=dtype, cache_dtype_str=cache_dtype
    )


def vllm_caches(spec: Any, layout: str, layers: int = 2, blocks: int = 3, device: str = "cpu") -> list[torch.Tensor]:
    """Per-layer caches as vLLM's worker allocates them: one buffer, strides from the layout."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    layer_stride, block_stride = compute_layout_strides(spec, blocks, layers, KVCacheLayout[layout])[:2]
    tensor = KVCacheTensor(layers * blocks * spec.page_size_bytes, names, layer_stride, block_stride)
    config = KVCacheConfig(blocks, [tensor], [KVCacheGroupSpec(names, spec)])
    caches = allocate_kv_cache(config, torch.device(device), KVCacheLayout[layout])
    return [caches[n] for n in names]


# ---- the reference: where vLLM's kernels put a token's values ----------------------------------


def offsets(cache: torch.Tensor, layout: str, layer: int, b: Any, h: Any, n: Any, c: Any) -> Any:
    """Element offsets, in the whole allocation, of logical (layer, block, head, token in
    block, content) indices: the layout's name lists the axes in memory order, outermost
    first ("LBNHC = [L, B, N, H, C]", vllm/v1/kv_cache_layout.py); no padding."""
    blocks, heads, n_tok, content = cache.shape
    size = {"L": whole(cache).numel() // cache.numel(), "B": blocks, "H": heads, "N": n_tok, "C": content}
    index = {"L": layer, "B": b, "H": h, "N": n, "C": c}
    off: Any = 0
    for axis in layout:
        off = off * size[axis] + index[axis]
    return off


def whole(cache: torch.Tensor) -> torch.Tensor:
    """The allocation behind a layer's view, as elements of the view's dtype."""
    return torch.empty(0, dtype=cache.dtype, device=cache.device).set_(cache.untyped_storage())


def token_grid(slots: torch.Tensor, heads: int, width: int, block: int) -> tuple[Any, ...]:
    t, h, d = torch.meshgrid(torch.arange(len(slots)), torch.arange(heads), torch.arange(width), indexing="ij")
    s = slots[t]
    return t, h, d, s // block, s % block


def flash_write(cache: torch.Tensor, layout: str, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """reshape_and_cache_flash: token i at slot s, head h: K[d] at content d, V[d] at D + d
    of block s // N, row s % N (csrc/cache_kernels.cu; the backends' `split(head_size)`)."""
    t, h, d, b, n = token_grid(slots, k.shape[1], k.shape[2], cache.shape[2])
    mem = whole(cache)
    mem[offsets(cache, layout, layer, b, h, n, d).to(mem.device)] = k[t, h, d].to(mem.device)
    mem[offsets(cache, layout, layer, b, h, n, k.shape[2] + d).to(mem.device)] = v[t, h, d].to(mem.device)


def flash_read(cache: torch.Tensor, layout: str, layer: int, slots: torch.Tensor, heads: int, width: int):
    t, h, d, b, n = token_grid(slots, heads, width, cache.shape[2])
    mem = whole(cache).cpu()
    return mem[offsets(cache, layout, layer, b, h, n, d)], mem[offsets(cache, layout, layer, b, h, n, width + d)]


def latent_offsets(cache: torch.Tensor, layout: str, layer: int, slots: torch.Tensor) -> Any:
    """concat_and_cache_mla: token at slot s is row s % N of block s // N, kv_c (512) then
    k_pe (64), one "head"."""
    t, _, c, b, n = token_grid(slots, 1, cache.shape[-1], cache.shape[2])
    return t, c, offsets(cache, layout, layer, b, 0, n, c)


def cpu_packed_offsets(cache: torch.Tensor, layer: int, slots: torch.Tensor, width: int) -> tuple[Any, ...]:
    """cpu_attn_reshape_and_cache with the "vec"/"vec16" kernels (csrc/cpu/cpu_attn_vec.hpp):
    block b, head h own N * 2D values (LBHNC); K is [D, N] column-major, then V [N, D]."""
    blocks, heads, n_tok, _ = cache.shape
    t, h, d, b, n = token_grid(slots, heads, width, n_tok)
    region = ((layer * blocks + b) * heads + h) * n_tok * 2 * width
    return t, h, d, region + d * n_tok + n, region + n_tok * width + n * width + d


def stored(shape: tuple[int, ...], storage: torch.dtype, values: torch.dtype, seed: int) -> torch.Tensor:
    """Random values of `values` as a cache of `storage` holds them (fp8: finite bytes)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(values).view(storage)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.cpu().contiguous().view(torch.uint8)


# ---- what vLLM runs: the layouts pdd must read -------------------------------------------------


def test_the_layouts_vllms_backends_run():
    """The layouts the tests below cover are those vLLM's backends accept and resolve."""
    assert get_supported_kv_cache_layouts([CPUAttentionBackend]) == [KVCacheLayout.LBHNC]  # CPU_ATTN: only HND
    assert get_supported_kv_cache_layouts([FlashAttentionBackend])[0] == KVCacheLayout.LBNHC  # any, NHD first
    for backend in (FlashAttentionBackend, TritonAttentionBackend, FlashMLABackend, CPUMLABackend):
        assert backend.supported_kv_cache_layouts() is None  # any layout vLLM resolves
    assert get_flashinfer_layout_string(KVCacheLayout.LBNHC) == "NHD"
    assert get_flashinfer_layout_string(KVCacheLayout.LBHNC) == "HND"
    assert get_flashinfer_layout_string(KVCacheLayout.BLHNC) == "HND"
    assert FlashMLABackend.is_mla() and CPUMLABackend.is_mla() and not TritonAttentionBackend.is_mla()


# ---- K then V: FlashAttention, FlashInfer (NHD, HND), Triton --------------------------------------

DENSE = [
    (FlashAttentionBackend, "LBNHC"),  # its default
    (FlashAttentionBackend, "BLNHC"),  # layers interleaved block by block
    (FLASHINFER, "LBNHC"),  # NHD
    (FLASHINFER, "LBHNC"),  # HND
    (FLASHINFER, "BLHNC"),  # HND, SM100's other
    (TritonAttentionBackend, "LBNHC"),
    (TritonAttentionBackend, "LBHNC"),
]
FP8 = {"auto": MODEL_DTYPE, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize(("backend", "layout"), DENSE, ids=[f"{b.get_name()}-{lay}" for b, lay in DENSE])
def test_k_then_v_caches_read_what_vllm_wrote_and_write_what_it_reads(backend, layout, cache_dtype, device):
    spec = dense_spec(cache_dtype)
    caches = vllm_caches(spec, layout, device=device)
    layers = [attention_layer(backend, spec, cache_dtype, k_scale=0.5 + i) for i in range(2)]
    shape = describe(vllm_config(layout), layers, 0, 1)
    assert (shape.backend, shape.layout, shape.latent, shape.heads, shape.head_dim) == (
        backend.get_name(),
        layout,
        False,
        2,
        64,
    )
    assert shape.dtype == FP8[cache_dtype] and shape.scales == ((0.5, 1.0, 1.5, 3.0) if cache_dtype != "auto" else ())
    layout_1 = shape.layout_of(caches[1])  # the second layer: the one interleaving moves
    assert isinstance(layout_1, TokenMajorLayout)
    slots = torch.randperm(3 * 16, generator=torch.Generator().manual_seed(2))[:30]
    k, v = (stored((30, 2, 64), spec.dtype, shape.dtype, seed) for seed in (3, 4))
    flash_write(caches[1], layout, 1, slots, k, v)
    got_k, got_v = layout_1.read(slots)
    assert torch.equal(bits(got_k), bits(k)) and torch.equal(bits(got_v), bits(v))
    assert not bits(shape.layout_of(caches[0]).read(slots)[0]).any()  # the other layer is untouched
    k2, v2 = (stored((30, 2, 64), spec.dtype, shape.dtype, seed) for seed in (5, 6))
    layout_1.write(slots, k2, v2)
    ref_k, ref_v = flash_read(caches[1], layout, 1, slots, 2, 64)
    assert torch.equal(bits(ref_k), bits(k2)) and torch.equal(bits(ref_v), bits(v2))


# ---- MLA: one latent vector a token --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize(("backend", "layout"), [(FlashMLABackend, "LBNHC"), (FlashMLABackend, "BLNHC")])
def test_latent_caches_read_what_vllm_wrote_and_write_what_it_reads(backend, layout, cache_dtype, device):
    spec = mla_spec(cache_dtype)
    caches = vllm_caches(spec, layout, device=device)
    layers = [attention_layer(backend, spec, cache_dtype, kv_lora_rank=512) for _ in range(2)]
    shape = describe(vllm_config(layout, tp=2), layers, 1, 2)  # (rank 1 holds the whole latent too)
    assert (shape.latent, shape.heads, shape.head_start, shape.head_dim, shape.dtype) == (
        True,
        1,
        0,
        576,
        FP8[cache_dtype],
    )
    layout_1 = shape.layout_of(caches[1])
    assert isinstance(layout_1, LatentLayout)
    slots = torch.tensor([0, 17, 47, 3, 30, 16])
    latent = stored((6, 1, 576), spec.dtype, shape.dtype, 7)
    t, c, off = latent_offsets(caches[1], layout, 1, slots)
    whole(caches[1])[off.to(device)] = latent[t, 0, c].to(device)
    got, nothing = layout_1.read(slots)
    assert torch.equal(bits(got), bits(latent)) and nothing.shape == (6, 1, 0)
    latent2 = stored((6, 1, 576), spec.dtype, shape.dtype, 8)
    layout_1.write(slots, latent2, latent2[..., :0])
    assert torch.equal(bits(whole(caches[1]).cpu()[off]), bits(latent2[t, 0, c]))


def test_vllms_cpu_mla_write_is_read_back_as_the_latent():
    spec = mla_spec()
    cache = vllm_caches(spec, "LBNHC", layers=1)[0]
    slots = torch.tensor([5, 40, 16, 2])
    latent = torch.randn(4, 576).to(MODEL_DTYPE)
    # CPU_MLA's own cache write (it uses nothing of its instance)
    CPUMLAImpl.do_kv_cache_update(None, latent[:, :512], latent[:, None, 512:], cache.squeeze(1), slots, "auto", None)  # type: ignore[arg-type]
    assert torch.equal(LatentLayout(cache, 576).read(slots)[0], latent[:, None])


# ---- CPU_ATTN: packed per instruction set ------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_packed_caches_read_what_vllm_packed_and_pack_what_it_reads(dtype):
    """The "vec" kernels' packing, from their source (`cpu_packed_offsets`), against what
    pdd reads and what vLLM's kernel writes (on any x86 CPU: vLLM picks "vec" where it has
    no AMX, and for fp32 where it has)."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dtype)
    caches = vllm_caches(spec, "LBHNC")
    layers = [attention_layer(CPUAttentionBackend, spec, isa="vec") for _ in range(2)]
    shape = describe(vllm_config("LBHNC"), layers, 0, 1)
    layout_1 = shape.layout_of(caches[1])
    assert isinstance(layout_1, CpuPackedLayout) and shape.isa == "vec"
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(9))[:50]
    k, v = (torch.randn(50, 2, 64, generator=torch.Generator().manual_seed(s)).to(dtype) for s in (10, 11))
    t, h, d, k_off, v_off = cpu_packed_offsets(caches[1], 1, slots, 64)
    mem = whole(caches[1])
    mem[k_off], mem[v_off] = k[t, h, d], v[t, h, d]
    got_k, got_v = layout_1.read(slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    mem.zero_()
    layout_1.write(slots, v, k)  # vLLM's own kernel packs
    assert torch.equal(mem[k_off], v[t, h, d]) and torch.equal(mem[v_off], k[t, h, d])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pdd_reads_the_packing_vllm_chooses_on_this_cpu_through_vllms_own_kernel(dtype):
    """Whatever kernel vLLM picks here ("amx" for bf16 on an AMX Xeon: pairs interleaved
    for its tiles; "vec" elsewhere), pdd reads exactly what that kernel wrote, having
    learned where it puts each value from the kernel itself (`cpu_packing`): a one-to-one
    arrangement of each (block, head)'s K and V regions, "vec"'s the one its source gives."""
    isa = cpu_isa(dtype, 32, 64, "auto")  # what vLLM's CPU metadata builder gives each layer
    assert isa in (("amx", "vec") if dtype == torch.bfloat16 else ("vec",))
    k_at, v_at = cpu_packing(isa, 32, 64, dtype)
    for offsets in (k_at, v_at):
        assert torch.equal(torch.sort(offsets.flatten()).values, torch.arange(32 * 64))
    o, d = torch.arange(32)[:, None], torch.arange(64)[None, :]
    assert (torch.equal(k_at, d * 32 + o) and torch.equal(v_at, o * 64 + d)) == (isa == "vec")
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=dtype)
    layout = CpuPackedLayout(vllm_caches(spec, "LBHNC", layers=1)[0], 64, isa)
    slots = torch.randperm(96, generator=torch.Generator().manual_seed(3))[:70]
    k, v = (torch.randn(70, 2, 64, generator=torch.Generator().manual_seed(s)).to(dtype) for s in (4, 5))
    layout.write(slots, k, v)  # vLLM's kernel
    got_k, got_v = layout.read(slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)


# ---- the start-up check: vLLM's own write, read back by pdd ----------------------------------------


def cpu_attn_layer(spec: FullAttentionSpec) -> Any:
    """A CPU_ATTN layer whose `impl.do_kv_cache_update` is vLLM's (it reads only these two
    fields of its instance; building a whole one needs a model)."""
    impl = SimpleNamespace(attn_type=AttentionType.DECODER, kv_cache_dtype="auto")
    update = functools.partial(CPUAttentionBackendImpl.do_kv_cache_update, impl)
    isa = cpu_isa(spec.dtype, spec.block_size, spec.head_size, "auto")
    layer = attention_layer(CPUAttentionBackend, spec, isa=isa, impl=SimpleNamespace(do_kv_cache_update=update))
    layer._k_scale_float = layer._v_scale_float = 1.0
    return layer


def flash_layer(spec: FullAttentionSpec, cache_dtype: str, layout: str, fp8: torch.dtype, k_scale: float) -> Any:
    """A layer whose backend writes as reshape_and_cache_flash does (an fp8 cache gets
    `key / k_scale` as fp8), into layer 0 of an allocation of `layout`."""

    def update(layer: Any, key: torch.Tensor, value: torch.Tensor, cache: torch.Tensor, slots: torch.Tensor) -> None:
        if cache_dtype != "auto":
            key, value = (
                (x.float() / s).to(fp8).view(torch.uint8) for x, s in ((key, layer._k_scale), (value, layer._v_scale))
            )
        flash_write(cache, layout, 0, slots, key, value)

    return attention_layer(
        FlashAttentionBackend, spec, cache_dtype, k_scale, impl=SimpleNamespace(do_kv_cache_update=update)
    )


def test_the_check_passes_vllms_own_writes_and_refuses_a_layout_pdd_would_misread():
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cache = vllm_caches(spec, "LBHNC", layers=1)[0]
    layer = cpu_attn_layer(spec)
    shape = describe(vllm_config("LBHNC"), [layer], 0, 1)
    check_against_vllm(shape, layer, cache, MODEL_DTYPE)  # vLLM's CPU kernel packs as pdd reads
    misread = replace(shape, backend="FLASH_ATTN")  # K then V over CPU_ATTN's packing
    with pytest.raises(RuntimeError, match=r"FLASH_ATTN cache \(LBHNC, torch.bfloat16\) is not laid out as pdd reads"):
        check_against_vllm(misread, layer, cache, MODEL_DTYPE)

    fp8_spec = dense_spec("fp8")
    fp8_cache = vllm_caches(fp8_spec, "LBNHC", layers=1)[0]
    good = flash_layer(fp8_spec, "fp8", "LBNHC", torch.float8_e4m3fn, k_scale=0.37)
    fp8_shape = describe(vllm_config("LBNHC"), [good], 0, 1)
    check_against_vllm(fp8_shape, good, fp8_cache, MODEL_DTYPE)  # quantized by the layer's scale, bytes exact
    swapped = flash_layer(fp8_spec, "fp8", "LBHNC", torch.float8_e4m3fn, k_scale=0.37)  # writes HND into NHD
    with pytest.raises(RuntimeError, match=r"FLASH_ATTN cache \(LBNHC, torch.float8_e4m3fn\) is not laid out"):
        check_against_vllm(fp8_shape, swapped, fp8_cache, MODEL_DTYPE)


def test_the_check_passes_vllms_cpu_mla_write():
    spec = mla_spec()
    cache = vllm_caches(spec, "LBNHC", layers=1)[0]
    update = functools.partial(CPUMLAImpl.do_kv_cache_update, None)
    layer = attention_layer(CPUMLABackend, spec, kv_lora_rank=512, impl=SimpleNamespace(do_kv_cache_update=update))
    check_against_vllm(describe(vllm_config("LBNHC"), [layer], 0, 1), layer, cache, MODEL_DTYPE)


@pytest.mark.ci_may_skip
@pytest.mark.skipif(
    not (torch.cuda.is_available() and hasattr(torch.ops._C_cache_ops, "reshape_and_cache_flash")),
    reason="no CUDA device with vLLM's CUDA build here",
)
@pytest.mark.parametrize("layout", ["LBNHC", "LBHNC", "BLHNC"])
@pytest.mark.parametrize("cache_dtype", ["auto", "fp8"])
def test_vllms_cuda_kernels_write_what_pdd_reads(layout, cache_dtype):
    """vLLM's own reshape_and_cache_flash and concat_and_cache_mla on the GPU."""
    spec = dense_spec(cache_dtype)
    cache = vllm_caches(spec, layout, device="cuda")[1]
    scale = torch.tensor(0.37, device="cuda")

    def update(layer: Any, key: torch.Tensor, value: torch.Tensor, kv: torch.Tensor, slots: torch.Tensor) -> None:
        k_cache, v_cache = kv.transpose(1, 2).split(64, dim=-1)
        torch.ops._C_cache_ops.reshape_and_cache_flash(key, value, k_cache, v_cache, slots, cache_dtype, scale, scale)

    layer = attention_layer(
        FlashAttentionBackend, spec, cache_dtype, 0.37, impl=SimpleNamespace(do_kv_cache_update=update)
    )
    layer._k_scale = layer._v_scale = scale
    check_against_vllm(describe(vllm_config(layout), [layer], 0, 1), layer, cache, MODEL_DTYPE)

    mla = mla_spec(cache_dtype)
    latent_cache = vllm_caches(mla, layout, device="cuda")[1]

    def mla_update(kv_c: Any, k_pe: Any, kv: Any, slots: Any, dtype: str, k_scale: Any) -> None:
        torch.ops._C_cache_ops.concat_and_cache_mla(kv_c, k_pe.squeeze(1), kv, slots, dtype, k_scale, False)

    mla_layer = attention_layer(
        FlashMLABackend, mla, cache_dtype, kv_lora_rank=512, impl=SimpleNamespace(do_kv_cache_update=mla_update)
    )
    mla_layer._k_scale = scale
    check_against_vllm(describe(vllm_config(layout), [mla_layer], 0, 1), mla_layer, latent_cache, MODEL_DTYPE)


# ---- what pdd refuses, by name -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layer", "parallel", "why"),
    [
        (
            attention_layer(
                FlashAttentionBackend,
                SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=MODEL_DTYPE, sliding_window=4096),
            ),
            {},
            r"SlidingWindowSpec \(window 4096\)",
        ),
        (
            attention_layer(
                FlashAttentionBackend,
                FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=MODEL_DTYPE, sliding_window=512),
            ),
            {},
            r"FullAttentionSpec \(window 512\)",
        ),
        (attention_layer(None, MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(MODEL_DTYPE,))), {}, "MambaSpec"),
        (attention_layer(TritonAttentionBackend, dense_spec("auto"), "fp8_per_token_head"), {}, "'fp8_per_token_head'"),
        (attention_layer(FlashMLABackend, mla_spec("fp8"), "fp8_ds_mla"), {}, "'fp8_ds_mla'"),
        (
            attention_layer(CPUAttentionBackend, dense_spec("fp8", block=32), "fp8", isa="vec"),
            {},
            "CPU_ATTN packs an fp8",
        ),
        (attention_layer(FlashAttentionBackend, dense_spec()), {"prefill_context_parallel_size": 2}, "prefill context"),
    ],
)
def test_what_pdd_cannot_carry_exactly_is_refused_by_name(layer, parallel, why):
    with pytest.raises(RuntimeError, match=why):
        describe(vllm_config("LBNHC", **parallel), [layer, layer], 0, 1)


def test_a_model_of_several_cache_groups_is_refused():
    full = attention_layer(FlashAttentionBackend, dense_spec())
    wide = attention_layer(FlashAttentionBackend, dense_spec(head_dim=128))
    with pytest.raises(RuntimeError, match="several: .*2 page sizes"):
        describe(vllm_config("LBNHC"), [full, wide], 0, 1)


# ---- tensor parallelism: which rank holds which heads --------------------------------------------


@pytest.mark.parametrize(
    ("total", "tp", "starts"),
    [(8, 2, [0, 4]), (2, 4, [0, 0, 1, 1]), (4, 4, [0, 1, 2, 3])],  # split, replicated past the heads, one each
)
def test_each_rank_says_which_heads_it_holds(total, tp, starts):
    spec = dense_spec(heads=max(1, total // tp))  # vLLM's ModelConfig.get_num_kv_heads
    layer = attention_layer(FlashAttentionBackend, spec)
    got = [describe(vllm_config("LBNHC", total_heads=total, tp=tp), [layer], r, tp).head_start for r in range(tp)]
    assert got == starts


class Bridge:
    """A worker's bridge channel, both ways, without the socket: what the instance sends
    goes to the worker's copy thread, whose answers go straight to the instance's
    `WorkerKV`; a staging region's descriptor is handed over as SCM_RIGHTS would (a
    duplicate)."""

    def __init__(self, kv: WorkerKV, worker: WorkerSide) -> None:
        self.kv, self.worker, self.ops, self.layout = kv, worker, [], {}
        worker.channel = SimpleNamespace(send=self.answer)

    def answer(self, header: dict[str, Any], fds: tuple[int, ...] = ()) -> None:
        if header["op"] == "layout":
            self.layout = {**header, "fds": [os.dup(fd) for fd in fds]}
        else:
            self.kv.answer(header)

    def send(self, header: dict[str, Any]) -> None:
        self.ops.append(header["op"])
        self.worker._on_message(header)


def workers(
    config: Any,
    layers: dict[str, Any],
    caches: list[dict[str, torch.Tensor]],
    slot_bytes: int = SLOT_BYTES,
    places: list[dict[str, Any]] | None = None,
) -> tuple[WorkerKV, list[Bridge]]:
    """One `WorkerSide` a rank over `caches[rank]`, registered as vLLM registers them, and
    the instance's `WorkerKV` built from their "layout" messages (`slot_bytes`: each
    staging slot's size, small to cut a request into many slices; `places`: each worker's
    tensor-parallel rank and world, pipeline stage and stages, DCP share, where not TP alone)."""
    kv, bridges = WorkerKV(), []
    config.compilation_config.static_forward_context = layers
    for rank, rank_caches in enumerate(caches):
        worker = WorkerSide.__new__(WorkerSide)  # (its __init__ dials the bridge; what it sets up besides:)
        worker.config, worker.rank, worker.world = config, rank, len(caches)
        worker.__dict__.update(places[rank] if places else {})
        worker.region, worker.copier = Region.create(slot_bytes, SLOTS), None
        worker.block_size = config.cache_config.block_size
        bridge = Bridge(kv, worker)
        worker.register_kv_caches(rank_caches)
        kv.workers[worker.index] = WorkerInfo.from_layout(bridge, bridge.layout)
        bridges.append(bridge)
    return kv, bridges


def blob(kv: WorkerKV, tokens: list[int], end: int, k: torch.Tensor, v: torch.Tensor) -> codec.KVBlob:
    w, n = kv.ranks[0], kv.num_layers
    header = codec.KVHeader(
        num_layers=n, layer_start=0, layer_end=n, kv_heads=kv.total_heads, head_dim=w.head_dim,
        dtype=w.dtype, page_size=w.block_size, token_start=0, token_end=end, block_size=16,
        block_hashes=block_hashes(tokens[:end], 16), latent=w.latent, scales=list(kv.scales),
    )  # fmt: skip
    return codec.KVBlob(header, k, v)


def test_an_mla_export_reads_rank_0_and_an_import_writes_every_rank():
    spec = mla_spec(block=32)  # (CPU_MLA)
    update = functools.partial(CPUMLAImpl.do_kv_cache_update, None)
    layer = attention_layer(CPUMLABackend, spec, kv_lora_rank=512, impl=SimpleNamespace(do_kv_cache_update=update))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    config = vllm_config("LBNHC", tp=2, block_size=32)
    caches = [dict(zip(names, vllm_caches(spec, "LBNHC"), strict=True)) for _ in range(2)]
    kv, bridges = workers(config, dict.fromkeys(names, layer), caches)
    assert [b.layout["latent"] for b in bridges] == [True, True] and kv.total_heads == 1
    assert kv.bytes_per_token == 2 * 576 * 2  # two layers of one bf16 latent, not one a rank
    tokens, blocks = list(range(100, 150)), [2, 0]
    latent = torch.randn(2, 40, 1, 576).to(MODEL_DTYPE)
    incoming = blob(kv, tokens, 40, latent, latent[..., :0])
    kv.check_import(incoming, tokens, 0, 50)
    asyncio.run(kv.write(blocks, incoming))
    for rank_caches in caches:  # the whole latent on both ranks
        cache = rank_caches[names[1]]
        assert torch.equal(cache[2, 0, :32], latent[1, :32, 0]) and torch.equal(cache[0, 0, :8], latent[1, 32:, 0])
    caches[1][names[0]].zero_()  # (an export that read rank 1 would see this)
    out = asyncio.run(kv.read(blocks, tokens, 8, 40))
    assert [b.ops for b in bridges] == [["write", "read"], ["write"]]
    assert out.header.latent and out.v.shape == (2, 32, 1, 0) and torch.equal(out.k, latent[:, 8:])
    assert codec.decode(codec.encode(out)).k.shape == (2, 32, 1, 576)


def test_replicated_heads_are_read_once_and_written_to_every_replica():
    spec = FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=MODEL_DTYPE)  # 2 heads, TP 4
    names = ["model.layers.0.self_attn.attn"]
    config = vllm_config("LBHNC", total_heads=2, tp=4, block_size=32)
    caches = [dict(zip(names, vllm_caches(spec, "LBHNC", layers=1), strict=True)) for _ in range(4)]
    kv, bridges = workers(config, {names[0]: cpu_attn_layer(spec)}, caches)
    assert [w.head_start for w in kv.ranks] == [0, 0, 1, 1] and kv.total_heads == 2
    assert kv.bytes_per_token == 2 * 2 * 64 * 2
    tokens = list(range(40))
    k, v = (torch.randn(1, 40, 2, 64).to(MODEL_DTYPE) for _ in range(2))
    asyncio.run(kv.write([1, 0], blob(kv, tokens, 40, k, v)))
    for rank, bridge in enumerate(bridges):
        got_k, got_v = bridge.worker.copier.layers[0].read(torch.cat([torch.arange(32, 64), torch.arange(8)]))
        assert torch.equal(got_k, k[0, :, rank // 2 : rank // 2 + 1]) and torch.equal(
            got_v, v[0, :, rank // 2 : rank // 2 + 1]
        )
    out = asyncio.run(kv.read([1, 0], tokens, 0, 40))
    assert [b.ops for b in bridges] == [["write", "read"], ["write"], ["write", "read"], ["write"]]
    assert torch.equal(out.k, k) and torch.equal(out.v, v)


def test_a_long_import_crosses_in_slices_on_the_copy_thread_and_is_done_only_when_its_last_slice_is():
    """A request larger than a staging slot goes slice by slice, each copied into the cache
    on the worker's copy thread (never the caller's); held back, the last slice keeps the
    write from completing (the instance reports a load only when `write` returns), and the
    export reads back every slice."""
    spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=MODEL_DTYPE)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    caches = [dict(zip(names, vllm_caches(spec, "LBHNC"), strict=True))]
    per_token = 2 * 2 * 2 * 64 * 2  # K and V, two layers, two heads of 64, bf16
    kv, bridges = workers(vllm_config("LBHNC", block_size=32), dict.fromkeys(names, cpu_attn_layer(spec)), caches,
                          slot_bytes=10 * per_token)  # fmt: skip
    copier = bridges[0].worker.copier
    assert kv.ranks[0].slice_tokens(kv.ranks[0].layers) == 10
    threads, gate, write = [], threading.Event(), copier.write

    def held_write(header: dict[str, Any]) -> None:
        threads.append(threading.current_thread().name)
        if len(threads) == 6:  # the last slice to reach the copy thread (slices may arrive in any order)
            assert gate.wait(60)
        write(header)

    copier.write = held_write
    tokens, blocks = list(range(60)), [1, 0]
    k, v = (torch.randn(2, 55, 2, 64).to(MODEL_DTYPE) for _ in range(2))

    async def go() -> None:
        task = asyncio.ensure_future(kv.write(blocks, blob(kv, tokens, 55, k, v)))
        for _ in range(2400):  # every slice asked, the last one held (a loaded machine: up to 2 minutes)
            if len(threads) == 6:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert not task.done() and len(threads) == 6
        gate.set()
        await asyncio.wait_for(task, 60)

    asyncio.run(go())
    assert bridges[0].ops == ["write"] * 6 and set(threads) == {"pdd-kv-copy"}
    out = asyncio.run(kv.read(blocks, tokens, 3, 55))
    assert bridges[0].ops[6:] == ["read"] * 6  # [3, 13), ..., [53, 55)
    assert torch.equal(out.k, k[:, 3:]) and torch.equal(out.v, v[:, 3:])


def test_slots_count_the_schedulers_blocks_where_vllm_splits_them_into_kernel_blocks():
    """A backend whose kernels take smaller blocks than the scheduler's gets each split in
    equal consecutive ones (`prepare_kernel_block_sizes`): scheduler block 32, views of 16."""
    spec = dense_spec(block=32)
    names = ["model.layers.0.self_attn.attn"]
    layer_stride, block_stride = compute_layout_strides(spec, 3, 1, KVCacheLayout.LBNHC)[:2]
    tensor = KVCacheTensor(3 * spec.page_size_bytes, names, layer_stride, block_stride)
    config = KVCacheConfig(3, [tensor], [KVCacheGroupSpec(names, spec)])
    caches = allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout.LBNHC, kernel_block_sizes=[16])
    assert caches[names[0]].shape == (6, 2, 16, 128)
    layer = flash_layer(spec, "auto", "LBNHC", torch.float8_e4m3fn, 1.0)
    kv, _ = workers(vllm_config("LBNHC", block_size=32), {names[0]: layer}, [caches])
    tokens = list(range(40))
    k, v = (torch.randn(1, 40, 2, 64).to(MODEL_DTYPE) for _ in range(2))
    asyncio.run(kv.write([2, 0], blob(kv, tokens, 40, k, v)))
    slots = torch.tensor([2 * 32 + p if p < 32 else p - 32 for p in range(40)])  # (scheduler blocks of 32)
    got_k, got_v = flash_read(caches[names[0]], "LBNHC", 0, slots, 2, 64)
    assert torch.equal(got_k, k[0]) and torch.equal(got_v, v[0])


def test_fp8_travels_as_its_bytes_with_its_scales():
    spec = dense_spec("fp8", block=32)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
    layers = {n: flash_layer(spec, "fp8", "LBNHC", torch.float8_e4m3fn, k_scale=0.25 + i) for i, n in enumerate(names)}
    config = vllm_config("LBNHC", block_size=32)
    caches = [dict(zip(names, vllm_caches(spec, "LBNHC"), strict=True))]
    kv, bridges = workers(config, layers, caches)
    assert bridges[0].layout["dtype"] == "float8_e4m3fn" and bridges[0].layout["scales"] == [0.25, 0.5, 1.25, 2.5]
    assert kv.bytes_per_token == 2 * 2 * 2 * 64  # one byte a value
    tokens = list(range(30))
    k, v = (torch.randn(2, 30, 2, 64).to(torch.float8_e4m3fn) for _ in range(2))
    incoming = blob(kv, tokens, 30, k, v)
    kv.check_import(incoming, tokens, 0, 30)
    asyncio.run(kv.write([0], incoming))
    out = asyncio.run(kv.read([0], tokens, 0, 30))
    assert (
        out.header.scales == [0.25, 0.5, 1.25, 2.5]
        and torch.equal(bits(out.k), bits(k))
        and torch.equal(bits(out.v), bits(v))
    )
    rescaled = codec.KVBlob(replace(incoming.header, scales=[1.0] * 4), k, v)
    with pytest.raises(RequestError, match="quantized with other scales than this cache's"):
        kv.check_import(rescaled, tokens, 0, 30)
    bf16 = codec.KVBlob(replace(incoming.header, dtype="bfloat16", scales=[]), k.to(MODEL_DTYPE), v.to(MODEL_DTYPE))
    with pytest.raises(RequestError, match="bfloat16 and this cache float8_e4m3fn: pdd converts no fp8 KV"):
        kv.check_import(bf16, tokens, 0, 30)


# ---- the codec: latent and fp8 blobs -------------------------------------------------------------


def header(**fields: Any) -> codec.KVHeader:
    tokens = list(range(64))
    base = dict(
        num_layers=3, layer_start=0, layer_end=3, kv_heads=1, head_dim=576, dtype="bfloat16", page_size=16,
        token_start=16, token_end=48, block_size=16, block_hashes=block_hashes(tokens[:48], 16),
    )  # fmt: skip
    return codec.KVHeader(**{**base, **fields})


def test_a_latent_blob_carries_k_alone_through_every_step_of_the_way():
    h = header(latent=True)
    latent = torch.randn(3, 32, 1, 576).to(torch.bfloat16)
    data = codec.encode(codec.KVBlob(h, latent, latent[..., :0]))
    assert h.payload_bytes == 3 * 32 * 576 * 2 and len(data) < 2 * h.payload_bytes  # one side on the wire
    back = codec.decode(data)
    assert back.header == h and torch.equal(back.k, latent) and back.v.shape == (3, 32, 1, 0)
    layers = codec.split_layers(codec.token_slice(back, 24, 40))
    joined = codec.join_layers([codec.decode(codec.encode(p)) for p in layers])
    assert joined.header == replace(h, token_start=24, token_end=40, block_hashes=h.block_hashes[:2])
    assert torch.equal(joined.k, latent[:, 8:24]) and joined.v.shape == (3, 16, 1, 0)


def test_an_fp8_blob_carries_its_bytes_and_each_layers_scales():
    h = header(kv_heads=2, head_dim=64, dtype="float8_e4m3fn", scales=[0.5, 1.0, 0.25, 2.0, 4.0, 8.0])
    k, v = (torch.randn(3, 32, 2, 64).to(torch.float8_e4m3fn) for _ in range(2))
    back = codec.decode(codec.encode(codec.KVBlob(h, k, v)))
    assert back.header == h and torch.equal(bits(back.k), bits(k)) and torch.equal(bits(back.v), bits(v))
    layers = [codec.decode(codec.encode(p)) for p in codec.split_layers(back)]
    assert [p.header.scales for p in layers] == [[0.5, 1.0], [0.25, 2.0], [4.0, 8.0]]
    assert codec.join_layers(layers).header == h
    with pytest.raises(codec.KVFormatError, match="needs 6 positive scales for float8_e4m3fn"):
        codec.decode(codec.encode(codec.KVBlob(replace(h, scales=[]), k, v)))


# sha256 of this blob as pdd encoded it before latent and fp8 blobs (cb07ecf): 6,388 bytes
BEFORE = "f2c063d352817966d6350ac27ab3619512801280910783f9646e62f2baf97378"


def test_a_plain_blob_reads_and_writes_as_before():
    h = header(kv_heads=2, head_dim=8)
    k = (torch.arange(3 * 32 * 2 * 8, dtype=torch.float32) / 64).view(3, 32, 2, 8).to(torch.bfloat16)
    data = codec.encode(codec.KVBlob(h, k, -k))
    hlen = int.from_bytes(data[6:10], "big")  # (the prefix: magic, version, header length)
    padded = data[10 : 10 + hlen]
    assert (10 + hlen) % codec.ALIGN == 0 and padded.rstrip(b" ") != padded and padded.rstrip(b" ")[-1:] == b"}"
    unpadded = data[:6] + len(padded.rstrip(b" ")).to_bytes(4, "big") + padded.rstrip(b" ") + data[10 + hlen :]
    assert (len(unpadded), hashlib.sha256(unpadded).hexdigest()) == (6388, BEFORE)  # what older pdd wrote, but for
    for blob in (data, unpadded):  # the spaces that align its tensors (which older pdd reads as JSON's whitespace)
        back = codec.decode(blob)
        assert back.header == h and torch.equal(back.k, k) and torch.equal(back.v, -k)


def test_an_importer_refuses_kv_its_cache_cannot_hold_exactly():
    tokens = list(range(64))
    latent = header(latent=True)
    shape = (3, 1, 576)
    assert check_continuation(latent, shape, tokens, 16, 64, CacheForm(latent=True)) is None
    why = check_continuation(latent, shape, tokens, 16, 64)  # (the embedded engine's call)
    assert why == "imported KV holds one latent vector a token (MLA), this cache K and V"
    assert "this cache one latent vector a token (MLA)" in check_continuation(
        header(), shape, tokens, 16, 64, CacheForm(latent=True)
    )
    fp8 = header(kv_heads=2, head_dim=64, dtype="float8_e5m2", scales=[1.0] * 6)
    why = check_continuation(fp8, (3, 2, 64), tokens, 16, 64)
    assert why == "imported KV is float8_e5m2 and this cache not fp8: pdd converts no fp8 KV"
    e4m3 = CacheForm(raw_dtype="float8_e4m3fn", scales=(1.0,) * 6)
    assert "float8_e5m2 and this cache float8_e4m3fn" in check_continuation(fp8, (3, 2, 64), tokens, 16, 64, e4m3)
    e5m2 = CacheForm(raw_dtype="float8_e5m2", scales=(1.0,) * 6)
    assert check_continuation(fp8, (3, 2, 64), tokens, 16, 64, e5m2) is None
