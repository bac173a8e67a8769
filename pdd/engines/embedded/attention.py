"""Attention over the paged KV pool for one engine step.

New tokens' K/V are written to their slots first; every query then reads all of its
keys back from the pool, so a token sees identical K/V (same dtype, same values)
whether it was computed by a prefill, an extend, a decode or imported from another
instance. Keys are gathered a whole page at a time (one contiguous block per page,
not one row per token: half the copying on CPU). Single-token queries (decodes) share
one padded batched call; multi-token queries (prefill chunks, extends) run one call
each with a causal mask offset by their cached length.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pdd.engines.embedded.kv_pool import KVPool


class PagedAttention:
    def __init__(self, pool: KVPool, spans: list[tuple[list[int], int, int]], device: str) -> None:
        """spans: (page table, cached tokens, new tokens) per sequence, in batch order."""
        self.pool = pool
        # called with (layer, K, V of the step's new tokens) once a layer's KV is written
        self.on_layer: Callable[[int, torch.Tensor, torch.Tensor], None] | None = None
        ps = pool.page_size
        write: list[torch.Tensor] = []
        decodes: list[tuple[int, list[int], int]] = []  # (flat row, pages, context)
        self.multi: list[tuple[int, int, torch.Tensor, torch.Tensor]] = []  # (start, new, pages, mask)
        offset = 0
        for pages, cached, new in spans:
            context = cached + new
            write.append(pool.slots(pages, cached, context))
            used = pages[: pool.pages_for(context)]
            if new == 1:
                decodes.append((offset, used, context))
            else:
                q_pos = torch.arange(cached, context, device=device)[:, None]
                k_pos = torch.arange(len(used) * ps, device=device)[None, :]
                self.multi.append((offset, new, torch.tensor(used, device=device), k_pos <= q_pos))
            offset += new
        self.write_slots = torch.cat(write).to(device)
        self.decode_rows: torch.Tensor | None = None
        if decodes:
            width = max(len(p) for _, p, _ in decodes)
            table = torch.tensor([p + [0] * (width - len(p)) for _, p, _ in decodes], device=device)
            lengths = torch.tensor([c for _, _, c in decodes], device=device)
            self.decode_pages = table
            self.decode_mask = (torch.arange(width * ps, device=device)[None, :] < lengths[:, None])[:, None, None, :]
            self.decode_rows = torch.tensor([r for r, _, _ in decodes], device=device)

    def _gather(self, which: int, cache: torch.Tensor, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """K (`which` 0) or V (1) of whole pages: [..., pages * page_size, kv_heads, head_dim],
        valid until the next gather of that kind."""
        return self.pool.gather(which, cache, pages).flatten(-4, -3).to(dtype)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        kc[self.write_slots] = k.to(kc.dtype)
        vc[self.write_slots] = v.to(vc.dtype)
        if self.on_layer is not None:
            self.on_layer(layer, k, v)
        out = torch.empty_like(q)
        if self.decode_rows is not None:
            qd = q[self.decode_rows].unsqueeze(2)  # [B, H, 1, D]
            kd = self._gather(0, kc, self.decode_pages, q.dtype).transpose(1, 2)  # [B, KVH, L, D]
            vd = self._gather(1, vc, self.decode_pages, q.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, enable_gqa=True)
            out[self.decode_rows] = o.squeeze(2)
        for start, new, pages, mask in self.multi:
            qs = q[start : start + new].transpose(0, 1).unsqueeze(0)
            ks = self._gather(0, kc, pages, q.dtype).transpose(0, 1).unsqueeze(0)
            vs = self._gather(1, vc, pages, q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[start : start + new] = o.squeeze(0).transpose(0, 1)
        return out
