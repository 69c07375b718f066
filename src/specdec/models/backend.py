"""The contracts through which the engine runs a model: a single-sequence Backend and a RowBackend of many rows.

The engine needs two operations from a model runtime: score a run of new tokens (appending them to the KV cache) and
return logits for each position; and keep only the first n cached positions after a rejection. Any runtime that
implements these classes (transformers, llama.cpp, the native kernels) plugs into the engine; what it is (vocabulary,
context, device, name) and what else it can do (``capabilities``) are declared once in its :class:`ModelInfo`, never
probed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from specdec.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

TREES_UNSUPPORTED = (
    "this backend scores chains of drafts only: trees (branches > 1) run on --runtime native or transformers"
)

Embed = Callable[[torch.Tensor], torch.Tensor]  # token ids -> the model's input embeddings, its scale included


@dataclass(frozen=True)
class BackendCapabilities:
    """What a runtime can do beyond scoring chains of one sequence."""

    # Sequences on it may draft trees: the rows it gives them (Backend.row_backend(trees=True)) score trees of drafts
    # and keep a tree's accepted path.
    trees: bool = False
    features: bool = False  # a forward can also return the final hidden states (what an eagle head reads)
    max_rows: int | None = 1  # sequences one forward holds; None: as many as memory allows
    # Rows can take another row's cached positions (RowBackend.copy_row): sequences with one prompt read it once.
    copies_rows: bool = False


@dataclass(frozen=True)
class PackedWeights:
    """The weights of a runtime that runs specdec's packed formats (native): what the CLI reports and measures."""

    format: str  # the decoder layers' packed format (models/native/formats.py: int8, int4)
    count: int  # the model's weights, as a checkpoint counts them


@dataclass(frozen=True)
class ModelInfo:
    """What a backend is, fixed when it is built: both contracts read their vocabulary, context, device and
    capabilities here."""

    # What decides its speed apart from torch's threads (runtime, weights, format, precision, device): with the thread
    # count, the key of its measured costs (``identity``).
    name: str
    vocab_size: int
    max_context: int
    device: torch.device = torch.device("cpu")
    capabilities: BackendCapabilities = BackendCapabilities()
    # Its speed follows torch's thread count, which may change after it is built: ``identity`` appends the count at
    # the time it is read. False for a runtime with a thread pool of its own (llama.cpp), whose name says its threads.
    torch_threads: bool = True


def with_threads(name: str) -> str:
    """``name`` with torch's current thread count: the identity of something whose speed follows it."""
    return f"{name}|threads={torch.get_num_threads()}"


class Described(ABC):
    """What both contracts share: a :class:`ModelInfo`, read through properties."""

    info: ModelInfo

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def max_context(self) -> int:
        return self.info.max_context

    @property
    def device(self) -> torch.device:
        return self.info.device

    @property
    def capabilities(self) -> BackendCapabilities:
        return self.info.capabilities

    @property
    def identity(self) -> str:
        """What decides this model's speed (runtime, weights, dtype, threads now): the key of its measured costs."""
        return with_threads(self.info.name) if self.info.torch_threads else self.info.name


class Backend(Described):
    """A model with a KV cache over one token sequence."""

    #: after a forward with ``features``: the final hidden state of each fed position [1, n, H]
    last_features: torch.Tensor | None = None

    @property
    @abstractmethod
    def cached_length(self) -> int:
        """Positions currently held in the cache."""

    @abstractmethod
    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        """Append ``tokens`` [1, n] to the cache; return logits [1, n, V], or only for the ``last`` positions.

        ``tree``: the parents of the last len(tree) tokens, a tree of drafts as in ``Proposal`` (see :func:`tree_mask`).
        ``features``: also keep every fed position's final hidden state (what the output head reads) in
        ``last_features``, from the same forward.
        """

    def forward_argmax(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        """As :meth:`forward`, but each position's argmax (the first index of its largest logit), long [1, n or
        ``last``], instead of its logits: all a greedy step needs where nothing reshapes them. By default the argmax of
        ``forward``'s logits; a runtime that can find it without writing the logits overrides this."""
        return self.forward(tokens, last, tree, features).max(dim=-1).indices

    @abstractmethod
    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """Keep only the first ``length`` cached positions; with ``branch`` (cached positions, increasing), the last
        len(branch) of them are those positions' (a tree's accepted path)."""

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache for a new sequence."""

    @abstractmethod
    def fork(self) -> Backend:
        """A backend over the same weights with an empty cache of its own (ConfigError where the runtime cannot)."""

    def token_embeddings(self) -> Embed | None:
        """The model's input embedding as a function of token ids (a feature-conditioned draft embeds with it); None
        where this runtime cannot give it."""
        return None

    def transformers_model(self) -> PreTrainedModel | None:
        """The transformers model this backend runs, for drafts that run in torch on its weights (a layerskip view of
        its first layers, a distilled draft on its embedding and output rows); None where the runtime runs none."""
        return None

    def packed_weights(self) -> PackedWeights | None:
        """The format and count of its weights where the runtime runs specdec's packed formats (native); else None."""
        return None

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> RowBackend:
        """The rows sequences decode in: for one sequence (``batch`` False) this backend's own cache, for a batch a
        cache of its own over the same weights. ``trees``: the rows may score trees (a runtime whose plain cache keeps
        chains only then gives rows that keep trees). ``cuda_graphs``: replay captured CUDA graphs where it can."""
        return OneRow(self.fork() if batch else self)


class RowBackend(Described):
    """A model with one cache row per sequence, each with its own length: what the decode step runs on.

    Rows are numbered 0..rows-1 in the order they were added (its row id); removing rows renumbers the
    rest.
    """

    cached_lengths: list[int]  # cached positions of each row
    #: after a forward with ``features``: per fed row, its positions' final hidden states [len(feed), H]
    last_features: list[torch.Tensor]

    @abstractmethod
    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows."""

    @abstractmethod
    def remove_rows(self, row_ids: list[int]) -> None:
        """Drop rows (their cache is freed)."""

    @abstractmethod
    def forward(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        """Append ``feeds[i]`` (1-D token ids) to row ``row_ids[i]``; logits [len(row_ids), last, V] of each feed's last
        ``last`` tokens, right-aligned.

        ``trees[i]``, if given and not None, makes the end of feed i a tree; ``features``: see Backend.forward.
        The logits are the caller's until the next forward: the step masks them in place (guards).
        """

    def forward_argmax(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        """As :meth:`forward`, but each position's argmax (the first index of its largest logit), long
        [len(row_ids), last], instead of its logits (see Backend.forward_argmax)."""
        return self.forward(row_ids, feeds, last, trees, features).max(dim=-1).indices

    @abstractmethod
    def truncate(self, row_id: int, length: int, branch: list[int] | None = None) -> None:
        """Keep only the first ``length`` cached positions of row ``row_id`` (``branch``: see Backend.truncate)."""

    def copy_row(self, source: int, targets: list[int]) -> None:
        """Give each row of ``targets`` (empty rows) row ``source``'s cached positions, where the capabilities say
        ``copies_rows``."""
        raise NotImplementedError(f"{type(self).__name__} does not copy rows (its capabilities say copies_rows=False)")

    def kv_bytes(self) -> int:
        """Bytes the rows' KV caches hold now (0 where the runtime does not say)."""
        return 0

    def kv_bytes_for(self, positions: int) -> int:
        """The most a row's KV cache holds at ``positions`` cached positions, every layer's keys and values, as this
        runtime allocates them (0 where it does not say: a runtime whose cache is allocated whole when it is made)."""
        return 0

    def kv_bytes_for_rows(self, positions: list[int]) -> int:
        """The most the KV caches hold once the rows have ``positions`` cached positions each: what admitting requests
        may take. The sum of each row's by default; a runtime whose rows share a buffer says what it then holds."""
        return sum(self.kv_bytes_for(p) for p in positions)


def keep_branch(cache: torch.Tensor, dim: int, length: int, branch: list[int]) -> None:
    """Move the cached entries at positions ``branch`` (along ``dim``) to positions length - len(branch) .. length - 1,
    in place."""
    source, target = (
        torch.tensor(branch, device=cache.device),
        torch.arange(length - len(branch), length, device=cache.device),
    )
    cache.index_copy_(dim, target, cache.index_select(dim, source))


def tree_mask(length: int, parents: torch.Tensor) -> torch.Tensor:
    """Which of ``length`` new positions each one sees when the last len(parents) are a tree and the rest a chain:
    bool [length, length].

    Node i of the tree sees the chain, its ancestors and itself; its position in the text is the chain's end plus its
    depth (``tree_positions``).
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
    """Each new position's place in the text under a ``tree_mask`` (the chain's end plus its depth), after ``start``
    cached ones."""
    return start + visible.sum(dim=-1) - 1


class OneRow(RowBackend):
    """A single-sequence :class:`Backend` seen as a :class:`RowBackend` of at most one row: the only adapter.

    Runtimes without a batched implementation (llama.cpp, native), and single-sequence generation, where the plain
    cache is the fastest, run the decode step this way.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.info = replace(backend.info, capabilities=replace(backend.capabilities, max_rows=1, copies_rows=False))
        self.last_features: list[torch.Tensor] = []
        self._rows = 0

    @property
    def cached_lengths(self) -> list[int]:  # type: ignore[override]
        return [self.backend.cached_length] * self._rows

    def add_rows(self, count: int) -> None:
        if self._rows + count > 1:
            raise ConfigError(
                "this backend decodes one sequence at a time: use the batched transformers backend for more"
            )
        self.backend.reset()
        self._rows += count

    def remove_rows(self, row_ids: list[int]) -> None:
        self._rows -= len(row_ids)

    def forward(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        return self._forward(self.backend.forward, feeds, last, trees, features)

    def forward_argmax(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        return self._forward(self.backend.forward_argmax, feeds, last, trees, features)

    def _forward(
        self,
        forward: Callable[..., torch.Tensor],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None,
        features: bool,
    ) -> torch.Tensor:
        (feed,) = feeds
        tree = trees[0] if trees else None
        scores = forward(feed[None], last=last, tree=tree, features=features)
        if features:
            if self.backend.last_features is None:
                raise ConfigError(
                    f"{type(self.backend).__name__} declares hidden states but returned none: a bug in that backend"
                )
            self.last_features = [self.backend.last_features[0]]
        return scores

    def truncate(self, row_id: int, length: int, branch: list[int] | None = None) -> None:
        self.backend.truncate(length, branch)
