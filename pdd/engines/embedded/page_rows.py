"""Tokens copied into and out of a host-memory KV pool as whole pages, and as runs of
consecutive pages, where they can be.

The pool keeps a layer's K (or V) as one flat array of slots (`KVPool`), so a page's
tokens are one contiguous row of `page_size * kv_heads * head_dim` elements, and pages
with consecutive ids are one longer row. A token range that covers whole pages is
therefore a copy of rows: numpy's fancy indexing runs it as a `memcpy` a page (without
the GIL), several times faster than indexing the slots one token at a time, and a run of
consecutive pages (what a fresh sequence mostly holds) is one slice, about four times
faster again (0.12 against 0.03 s/GB for a chunk's four pages across 24 layers, here);
only the partial pages at either end go slot by slot. Host memory only: a device pool's
copies stay with torch.
"""

from __future__ import annotations

import numpy as np
import torch

MAX_RUNS = 16  # past this many runs, one fancy-indexed copy (a run is a Python-level copy each)


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
        rows, src_rows = _rows(pool, page_size), _rows(src[:, first - start : last - start], page_size)
        at = pages[first // page_size : last // page_size]
        spans = runs(at)
        if len(spans) > MAX_RUNS:  # (scattered pages: one fancy-indexed copy)
            rows[:, np.asarray(at)] = src_rows
            return
        for i, j in spans:
            rows[:, at[i] : at[i] + j - i] = src_rows[:, i:j]


def gather(out: torch.Tensor, pool: torch.Tensor, at: torch.Tensor) -> None:
    """Slots `at` (consecutive positions of a sequence) of each layer of `pool` ([layers,
    slots, ...], host memory) into `out` ([layers, len(at), ...]): a slice of all layers a
    run of consecutive slots, or, where they are scattered, a layer at a time into its
    place (all layers at once gathers into a temporary first: twice the copying)."""
    ids = at.tolist()
    spans = runs(ids)
    if len(spans) > MAX_RUNS:
        for layer in range(out.shape[0]):
            torch.index_select(pool[layer], 0, at, out=out[layer])
        return
    for i, j in spans:
        out[:, i:j].copy_(pool[:, ids[i] : ids[i] + j - i])


def runs(ids: list[int]) -> list[tuple[int, int]]:
    """`ids` as runs of consecutive values: [i, j) spans of positions, in order."""
    spans, i = [], 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            spans.append((i, j))
            i = j
    return spans


def slots(pages: list[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Slot indices of tokens [start, end) of a sequence with page table `pages`."""
    pos = torch.arange(start, end)
    return torch.tensor(pages, dtype=torch.long)[pos // page_size] * page_size + pos % page_size
