"""The narrow interface through which the engine runs a model, and its transformers implementation.

The engine needs two operations from a model runtime: score a run of new
tokens (appending them to the KV cache) and return logits for each position;
and keep only the first n cached positions after a rejection. Any runtime
(transformers, llama.cpp, ...) that offers these plugs into the engine.
"""

from __future__ import annotations

from typing import Protocol

import torch

from specdec.errors import ConfigError

TREES_UNSUPPORTED = (
    "this backend scores chains of drafts only: trees (branches > 1) run on --backend native or transformers"
)


class Backend(Protocol):
    """A model with a KV cache over one token sequence per batch row."""

    vocab_size: int
    max_context: int
    trees: bool  # forward scores a tree of drafts (``tree``) and truncate keeps its accepted branch
    last_features: (
        torch.Tensor | None
    )  # after a forward with ``features``: the final hidden state of each fed position [B, n, H]

    @property
    def identity(self) -> str:
        """What decides this backend's speed (runtime, weights, dtype, threads): the key of its measured costs."""
        ...

    @property
    def cached_length(self) -> int:
        """Positions currently held in the cache."""
        ...

    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        """Append ``tokens`` [B, n] to the cache; return logits [B, n, V], or only for the ``last`` positions.

        ``tree``: the parents of the last len(tree) tokens, a tree of drafts as in ``Proposal`` (see :func:`tree_mask`).
        ``features``: also keep every fed position's final hidden state (what the output head reads) in ``last_features``,
        from the same forward.
        """
        ...

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """Keep only the first ``length`` cached positions; with ``branch`` (cached positions, increasing), the last len(branch) of them are those positions' (a tree's accepted path)."""
        ...

    def reset(self) -> None:
        """Empty the cache for a new sequence."""
        ...

    def fork(self) -> Backend:
        """A backend over the same weights with an empty cache of its own."""
        ...


class RowBackend(Protocol):
    """A model with one cache row per sequence, each with its own length: what the decode step runs on.

    Rows are numbered 0..rows-1 in the order they were added; removing rows renumbers the rest.
    """

    vocab_size: int
    max_context: int
    trees: bool  # see Backend.trees
    lengths: list[int]  # cached positions of each row
    last_features: list[
        torch.Tensor
    ]  # after a forward with ``features``: per fed row, its positions' final hidden states [len(feed), H]

    @property
    def identity(self) -> str:
        """The model and runtime, as Backend.identity: what measured costs are cached under."""
        ...

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows."""
        ...

    def remove_rows(self, rows: list[int]) -> None:
        """Drop rows (their cache is freed)."""
        ...

    def forward(
        self,
        rows: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        """Append ``feeds[i]`` (1-D token ids) to row ``rows[i]``; logits [len(rows), last, V] of each feed's last ``last`` tokens, right-aligned.

        ``trees[i]``, if given and not None, makes the end of feed i a tree; ``features``: see Backend.forward.
        The logits are the caller's until the next forward: the step masks them in place (guards).
        """
        ...

    def truncate(self, row: int, length: int, branch: list[int] | None = None) -> None:
        """Keep only the first ``length`` cached positions of ``row`` (``branch``: see Backend.truncate)."""
        ...


def keep_branch(cache: torch.Tensor, dim: int, length: int, branch: list[int]) -> None:
    """Move the cached entries at positions ``branch`` (along ``dim``) to positions length - len(branch) .. length - 1, in place."""
    source, target = (
        torch.tensor(branch, device=cache.device),
        torch.arange(length - len(branch), length, device=cache.device),
    )
    cache.index_copy_(dim, target, cache.index_select(dim, source))


def tree_mask(length: int, parents: torch.Tensor) -> torch.Tensor:
    """Which of ``length`` new positions each one sees when the last len(parents) are a tree and the rest a chain: bool [length, length].

    Node i of the tree sees the chain, its ancestors and itself; its position in the text is the chain's end plus its depth
    (``tree_positions``).
    """
    chain = length - len(parents)
    seen = torch.ones(length, length, dtype=torch.bool).tril_()
    seen[chain:, chain:] = False
    for node, parent in enumerate(parents.tolist()):
        if parent >= 0:
            seen[chain + node, chain:] = seen[chain + parent, chain:]
        seen[chain + node, chain + node] = True
    return seen


def tree_positions(start: int | torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Each new position's place in the text under a ``tree_mask`` (the chain's end plus its depth), after ``start`` cached ones."""
    return start + visible.sum(dim=-1) - 1


class OneRow:
    """A single-sequence :class:`Backend` seen as a :class:`RowBackend` of at most one row.

    Runtimes without a batched implementation (llama.cpp), and single-sequence
    generation, where the plain cache is the fastest, run the decode step this way.
    """

    max_rows = 1  # a server on this backend runs one request at a time; the rest queue

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.vocab_size = backend.vocab_size
        self.max_context = backend.max_context
        self.trees = getattr(backend, "trees", False)
        self.last_features: list[torch.Tensor] = []
        self._rows = 0

    @property
    def identity(self) -> str:
        return self.backend.identity

    @property
    def lengths(self) -> list[int]:
        return [self.backend.cached_length] * self._rows

    def add_rows(self, count: int) -> None:
        if self._rows + count > 1:
            raise ConfigError(
                "this backend decodes one sequence at a time: use the batched transformers backend for more"
            )
        self.backend.reset()
        self._rows += count

    def remove_rows(self, rows: list[int]) -> None:
        self._rows -= len(rows)

    def forward(
        self,
        rows: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        (feed,) = feeds
        extra: dict[str, object] = {}  # a backend written before trees and features existed takes neither
        if trees and trees[0] is not None:
            extra["tree"] = trees[0]
        if features:
            extra["features"] = True
        logits = self.backend.forward(feed[None], last=last, **extra)
        if features:
            if self.backend.last_features is None:
                raise ConfigError(
                    f"{type(self.backend).__name__} does not return hidden states: use a drafter that does not need them"
                )
            self.last_features = [self.backend.last_features[0]]
        return logits

    def truncate(self, row: int, length: int, branch: list[int] | None = None) -> None:
        if branch is not None:
            self.backend.truncate(length, branch)
        else:
            self.backend.truncate(length)
