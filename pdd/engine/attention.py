"""Attention over the paged KV pool for one engine step.

New tokens' K/V are written to their slots first; every query then reads all of its
keys back from the pool, so a token sees identical K/V (same dtype, same values)
whether it was computed by a prefill, an extend, a decode or imported from another
instance. Single-token queries (decodes) share one padded batched call; multi-token
queries (prefill chunks, extends) run one call each with a causal mask offset by
their cached length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdd.engine.kv_pool import KVPool


@dataclass
class _Span:
    start: int  # offset of the span's first new token in the flat batch
    length: int  # new tokens
    context: int  # cached + new tokens
    slots: torch.Tensor  # [context] slot of every key


class PagedAttention:
    def __init__(self, pool: KVPool, spans: list[tuple[list[int], int, int]], device: str) -> None:
        """spans: (page table, cached tokens, new tokens) per sequence, in batch order."""
        self.pool = pool
        write: list[torch.Tensor] = []
        decodes: list[_Span] = []
        self.multi: list[tuple[_Span, torch.Tensor]] = []
        offset = 0
        for pages, cached, new in spans:
            slots = pool.slots(pages, 0, cached + new)
            write.append(slots[cached:])
            span = _Span(offset, new, cached + new, slots.to(device))
            if new == 1:
                decodes.append(span)
            else:
                q_pos = torch.arange(cached, cached + new, device=device)[:, None]
                k_pos = torch.arange(cached + new, device=device)[None, :]
                self.multi.append((span, k_pos <= q_pos))
            offset += new
        self.write_slots = torch.cat(write).to(device)
        self.decode_rows: torch.Tensor | None = None
        if decodes:
            longest = max(s.context for s in decodes)
            gather = torch.zeros(len(decodes), longest, dtype=torch.long, device=device)
            mask = torch.zeros(len(decodes), 1, 1, longest, dtype=torch.bool, device=device)
            for i, s in enumerate(decodes):
                gather[i, : s.context] = s.slots
                mask[i, 0, 0, : s.context] = True
            self.decode_rows = torch.tensor([s.start for s in decodes], device=device)
            self.decode_gather, self.decode_mask = gather, mask

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kc, vc = self.pool.k[layer], self.pool.v[layer]
        kc[self.write_slots] = k.to(kc.dtype)
        vc[self.write_slots] = v.to(vc.dtype)
        out = torch.empty_like(q)
        if self.decode_rows is not None:
            qd = q[self.decode_rows].unsqueeze(2)  # [B, H, 1, D]
            kd = kc[self.decode_gather].to(q.dtype).transpose(1, 2)  # [B, KVH, L, D]
            vd = vc[self.decode_gather].to(q.dtype).transpose(1, 2)
            o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=self.decode_mask, enable_gqa=True)
            out[self.decode_rows] = o.squeeze(2)
        for span, mask in self.multi:
            qs = q[span.start : span.start + span.length].transpose(0, 1).unsqueeze(0)
            ks = kc[span.slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
            vs = vc[span.slots].to(q.dtype).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, enable_gqa=True)
            out[span.start : span.start + span.length] = o.squeeze(0).transpose(0, 1)
        return out
