"""Imports into a host-memory pool by whole pages (`pdd.engines.embedded.page_rows`): the same slots
as the token-by-token write, for every way a range can meet its pages."""

import pytest
import torch

from pdd.engines.embedded import page_rows

PAGE = 16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.int8])
@pytest.mark.parametrize(
    ("start", "n"),
    [(0, 128), (0, 1), (5, 3), (5, 11), (5, 100), (16, 7), (32, 48), (3, 13), (0, 15)],
    ids=lambda x: str(x),
)
def test_a_put_writes_exactly_the_slots_of_its_tokens(dtype: torch.dtype, start: int, n: int) -> None:
    layers, heads, dim, num_pages = 3, 2, 8, 24
    gen = torch.Generator().manual_seed(start * 1000 + n)
    pages = torch.randperm(num_pages, generator=gen)[:12].tolist()
    src = torch.randint(-100, 100, (layers, n, heads, dim), generator=gen).to(dtype)
    pool = torch.zeros(layers, num_pages * PAGE, heads, dim, dtype=dtype)
    want = pool.clone()
    want[:, page_rows.slots(pages, PAGE, start, start + n)] = src
    page_rows.put(pool, pages, PAGE, start, src)
    assert torch.equal(pool, want)  # (every other slot, of other pages and of these, untouched)


def test_a_put_into_a_layer_range_and_from_a_token_slice_of_a_blob() -> None:
    """The engine writes `pool.k[layers]` from `blob.k[:, a:b]`: views, not copies."""
    pool = torch.zeros(4, 64, 2, 8)
    blob = torch.arange(4 * 40 * 2 * 8, dtype=torch.float32).view(4, 40, 2, 8)
    pages = [3, 1, 0, 2]
    page_rows.put(pool[1:3], pages, PAGE, 16, blob[1:3, 16:40])
    assert torch.equal(pool[1:3][:, page_rows.slots(pages, PAGE, 16, 40)], blob[1:3, 16:40])
    assert not pool[0].any() and not pool[3].any()


PAGE_TABLES = {  # (24 pages each)
    "one run": list(range(24)),
    "runs": [9, 10, 11, 2, 3, 20, 21, 22, 23, 0, 1, 5, 6, 7, 8, 4, 12, 13, 14, 15, 16, 17, 18, 19],
    "scattered": [22, 3, 17, 8, 1, 12, 19, 5, 14, 0, 10, 6, 21, 2, 16, 9, 23, 4, 11, 7, 18, 13, 20, 15],
}


@pytest.mark.parametrize("table", PAGE_TABLES, ids=str)
@pytest.mark.parametrize(("start", "n"), [(0, 384), (5, 300), (16, 320), (3, 370)], ids=str)
def test_runs_of_consecutive_pages_are_written_and_read_as_the_slots_are(table: str, start: int, n: int) -> None:
    """A run of consecutive pages is one slice each way; pages scattered past `MAX_RUNS`
    runs, one indexed copy; either way the very slots of the tokens, in their order."""
    pages = PAGE_TABLES[table][: -(-(start + n) // PAGE)]
    assert table != "scattered" or len(page_rows.runs(pages)) > page_rows.MAX_RUNS
    layers, heads, dim = 3, 2, 8
    src = torch.randn(layers, n, heads, dim).to(torch.bfloat16)
    pool = torch.zeros(layers, 24 * PAGE, heads, dim, dtype=torch.bfloat16)
    at = page_rows.slots(pages, PAGE, start, start + n)
    want = pool.clone()
    want[:, at] = src
    page_rows.put(pool, pages, PAGE, start, src)
    assert torch.equal(pool, want)
    out = torch.empty_like(src)
    page_rows.gather(out, pool, at)
    assert torch.equal(out, src)


def test_runs_are_spans_of_consecutive_ids() -> None:
    assert page_rows.runs([]) == []
    assert page_rows.runs([7]) == [(0, 1)]
    assert page_rows.runs([3, 4, 5, 9, 10, 2, 2]) == [(0, 3), (3, 5), (5, 6), (6, 7)]
