"""The paged KV pool: fixed-size pages of per-token K/V slots over a `PagePool`
(which pages are free, and who owns them).

K and V live in one flat slot array per layer (slot = page * page_size + offset), so
a sequence's KV is addressed by a page table and a token's slot is computed, not
looked up.
"""

from __future__ import annotations

import torch

from pdd.engines.embedded import page_rows
from pdd.kv.pages import PagePool
from pdd.model.config import ModelConfig


class KVPool(PagePool):
    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: str) -> None:
        super().__init__(num_pages, page_size)
        self.dtype = dtype
        shape = (cfg.num_layers, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Gather buffers (K, V), kept across steps and grown as needed: a fresh tensor of
        # tens of MB per gather costs more in page faults than the copy itself on CPU.
        self._gather_buffers: list[torch.Tensor] = [torch.empty(0, dtype=dtype, device=device)] * 2

    def slots(self, pages: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of tokens [start, end) of a sequence with this page table."""
        return page_rows.slots(pages, self.page_size, start, end)

    def gather(self, which: int, cache: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """Whole pages of one layer's K (`which` 0) or V (1): `pages`' shape then
        [page_size, kv_heads, head_dim], in a buffer the next gather of that kind reuses."""
        paged = cache.view(-1, self.page_size, *cache.shape[1:])
        n = pages.numel()
        buffer = self._gather_buffers[which]
        if buffer.shape[0] < n:
            buffer = self._gather_buffers[which] = torch.empty(
                (n, *paged.shape[1:]), dtype=cache.dtype, device=cache.device
            )
        out = buffer[:n]
        torch.index_select(paged, 0, pages.flatten(), out=out)
        return out.view(*pages.shape, *paged.shape[1:])

    def bytes_per_token(self) -> int:
        return 2 * self.k.shape[0] * self.k.shape[2] * self.k.shape[3] * self.k.element_size()
