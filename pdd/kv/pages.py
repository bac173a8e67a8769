"""Which pages of a paged KV pool are free, and who may take them: the bookkeeping
half of `pdd.engines.embedded.kv_pool.KVPool`, without its tensors, so the radix cache runs
over it wherever pages are only counted (the simulator's instances).

Pages are owned exclusively, by a running sequence or by the radix cache, and come
back here when their owner lets go.
"""

from __future__ import annotations


class OutOfPages(RuntimeError):
    """The KV pool cannot hold this now; it may once other requests finish."""


class PagePool:
    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free")
        return [self._free.pop() for _ in range(n)]

    def release(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)
