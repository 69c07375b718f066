"""The native runtime's KV cache: per sequence and layer, pages of keys and values the attention kernel writes and
reads."""

from __future__ import annotations

import torch

from specdec.errors import ConfigError
from specdec.models.native import kernel_build

PAGE = 256  # positions per page of a PagedCache (a power of two)
CACHE_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}  # the kernel's codes for the cache's element types


class PagedCache:
    """Keys and values of one sequence, per layer in pages of PAGE positions ([2, kv heads, PAGE, head dim]: keys, then
    values) of ``dtype``, written and read by :func:`attention`. Growing adds pages and copies nothing; a layer with a
    sliding window releases the pages more than one page behind its window, so it holds at most window // PAGE + 3
    pages besides those of the step being written (a truncation may go back up to a page; further back the cache says
    it cannot).
    """

    def __init__(self, windows: tuple[int, ...], kv_heads: int, head_dim: int, dtype: str = "float32") -> None:
        if dtype not in CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache type '{dtype}': use one of {', '.join(CACHE_DTYPES)}")
        self.windows, self.kv_heads, self.head_dim, self.dtype = windows, kv_heads, head_dim, dtype
        self.kind = CACHE_DTYPES[dtype]
        self.length = 0
        self.pages: list[list[torch.Tensor | None]] = [[] for _ in windows]
        self.tables = torch.zeros(len(windows), 4, dtype=torch.long)  # each page's address, 0 where none is held
        self._swept = 0  # the length up to which windowed layers have released pages

    @property
    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return sum(page.nbytes for pages in self.pages for page in pages if page is not None)

    def reserve(self, length: int) -> None:
        """Hold the pages for positions up to ``length`` (written next), after releasing those no window reads again."""
        if self.length >= self._swept + PAGE:
            self._release()
        wanted = -(-length // PAGE)
        if wanted > self.tables.shape[1]:
            tables = torch.zeros(len(self.windows), max(wanted, 2 * self.tables.shape[1]), dtype=torch.long)
            tables[:, : self.tables.shape[1]] = self.tables
            self.tables = tables
        first = self.length // PAGE  # pages below hold written positions (or were released)
        for layer, pages in enumerate(self.pages):
            pages.extend([None] * (wanted - len(pages)))
            for index in range(first, wanted):
                if pages[index] is None:
                    size = (2, self.kv_heads, PAGE, self.head_dim)
                    page = pages[index] = torch.empty(size, dtype=getattr(torch, self.dtype))
                    self.tables[layer, index] = page.data_ptr()

    def copy(self) -> PagedCache:
        """A cache of its own holding the same positions (each held page copied)."""
        twin = PagedCache(self.windows, self.kv_heads, self.head_dim, self.dtype)
        twin.length, twin._swept = self.length, self._swept
        twin.tables = torch.zeros_like(self.tables)
        for layer, pages in enumerate(self.pages):
            twin.pages[layer] = [None if page is None else page.clone() for page in pages]
            for index, page in enumerate(twin.pages[layer]):
                if page is not None:
                    twin.tables[layer, index] = page.data_ptr()
        return twin

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """Keep the first ``length`` positions; with ``branch`` (ascending cache indices, a tree's accepted path) the
        last len(branch) of them are the states at those indices."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if branch and (
            len(branch) > length or branch != sorted(set(branch)) or branch[-1] >= self.length or branch[0] < 0
        ):
            raise ValueError(
                f"a tree path {branch} cannot end a cache of {length} positions: its cached positions ascend, "
                f"below {self.length}"
            )
        for layer, window in enumerate(self.windows):
            lowest = max(0, length - window + 1) if window and length else length
            if any(page is None for page in self.pages[layer][lowest // PAGE : -(-length // PAGE)]):
                raise ValueError(
                    f"the sliding-window cache no longer holds position {lowest}: truncate at most {PAGE} positions "
                    f"behind the last step, or reset and run the text again"
                )
        if branch:
            kernel = kernel_build.compiled()
            sources = torch.tensor(branch, dtype=torch.long)
            move = kernel.move_positions
            target = length - len(branch)
            kernel_build.call(move, self.tables, self.kind, PAGE, self.kv_heads, self.head_dim, sources, target)
        self.length = length
        self._swept = min(self._swept, length)

    def _release(self) -> None:
        for layer, window in enumerate(self.windows):
            if window:
                below = max(0, self.length - window + 1 - PAGE) // PAGE  # pages wholly before the window, less one page
                for index in range(min(below, len(self.pages[layer]))):
                    self.pages[layer][index] = None
                    self.tables[layer, index] = 0
        self._swept = self.length
