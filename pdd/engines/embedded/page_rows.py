"""Tokens written into a host-memory KV pool as whole pages where they can be.

The pool keeps a layer's K (or V) as one flat array of slots (`KVPool`), so a page's
tokens are one contiguous row of `page_size * kv_heads * head_dim` elements. A token
range that covers whole pages is therefore a copy of rows, which numpy's fancy indexing
runs as one `memcpy` a row (and without the GIL), several times faster than indexing the
slots one token at a time; only the partial pages at either end go slot by slot.
Host memory only: a device pool's copies stay with torch. (Reading pages out gains
nothing: torch's `index_select` into its place already copies at memory speed.)
"""

from __future__ import annotations

import numpy as np
import torch


def _rows(t: torch.Tensor, page_size: int) -> np.ndarray:
    """`t` ([layers, tokens, ...], tokens a multiple of `page_size`, each layer's tokens
    contiguous) as bytes: [layers, pages, a page's bytes], a view of its memory."""
    rows = t.flatten(2).view(torch.uint8).numpy().view()
    rows.shape = (t.shape[0], t.shape[1] // page_size, -1)  # (raises where it would take a copy)
    return rows


def _split(start: int, end: int, page_size: int) -> tuple[int, int]:
    """[start, end)'s whole pages: the first and last token they cover (first == last: none)."""
    first = min(end, -(-start // page_size) * page_size)
    last = max(first, end // page_size * page_size)
    return first, last


def put(pool: torch.Tensor, pages: list[int], page_size: int, start: int, src: torch.Tensor) -> None:
    """Write `src` ([layers, n, ...]), tokens [start, start + n) of a sequence with page
    table `pages`, into `pool` ([layers, slots, ...], host memory)."""
    end = start + src.shape[1]
    first, last = _split(start, end, page_size)
    for a, b in ((start, first), (last, end)):  # the partial pages, slot by slot
        if a < b:
            pool[:, slots(pages, page_size, a, b)] = src[:, a - start : b - start]
    if first < last:
        rows = _rows(pool, page_size)
        at = np.asarray(pages[first // page_size : last // page_size])
        rows[:, at] = _rows(src[:, first - start : last - start], page_size)


def slots(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Slot indices of tokens [start, end) of a sequence with page table `pages`."""
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size
