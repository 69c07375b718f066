"""A transformers backend over many sequences at once, each with its own cache length.

Speculative rows accept different numbers of tokens, so after a step their
caches end at different positions. Here every row owns a run of slots in one
key/value buffer per layer, and slot j of a row always holds its token at
position j: a forward writes each row's new states at that row's own next
slots, and rolling back a rejection only moves the row's length (stale slots
are masked, then overwritten). Positions therefore equal slots, so rotary
positions and sliding windows see exactly what a lone sequence would.

Rows of one forward feed different numbers of tokens; the feed is left-padded
so that every row's last token is in the last column, which lets the output
head run on the last few columns only. Padding columns write to slots past
their row's end and attend to nothing real.
"""

from __future__ import annotations

from functools import partial

import torch
from transformers import Cache, PreTrainedModel

from specdec.errors import ConfigError
from specdec.models.backend import BackendCapabilities, RowBackend, keep_branch, tree_mask, tree_positions
from specdec.models.cuda_graphs import CudaGraphs
from specdec.models.precision import PADDED_ATTENTION
from specdec.models.transformers_backend import transformers_info

ATTENTION_KINDS = ("full_attention", "sliding_attention")


class RowCache(Cache):
    """Keys and values of every row in one buffer per layer; a forward writes each row's new states at its own slots."""

    def __init__(self) -> None:
        super().__init__(layers=[])
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.capacity = 0
        # Set by the backend at each forward: which rows it covers, where each fed token goes, how many slots to read.
        self.active: torch.Tensor = torch.zeros(0, dtype=torch.long)
        self.every_row = False
        self.slots: torch.Tensor = torch.zeros(0, 0, dtype=torch.long)
        self.width = 0

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):  # first use of this layer: size its buffers from the states
            _, heads, _, dim = key_states.shape
            self.keys.append(key_states.new_zeros(self.rows, heads, self.capacity, dim))
            self.values.append(value_states.new_zeros(self.rows, heads, self.capacity, dim))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        rows = self.active[:, None]
        keys[rows, :, self.slots] = key_states.transpose(1, 2).to(keys.dtype)
        values[rows, :, self.slots] = value_states.transpose(1, 2).to(values.dtype)
        if self.every_row:  # every row in buffer order: views, no copy
            return keys[:, :, : self.width], values[:, :, : self.width]
        return keys[self.active, :, : self.width], values[self.active, :, : self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def resize(self, rows: torch.Tensor | None = None, capacity: int | None = None) -> None:
        """Keep the buffer rows ``rows`` in that order (-1 makes a new empty row) and grow every row to ``capacity``
        slots."""
        rows = torch.arange(self.rows) if rows is None else rows
        capacity = max(self.capacity, capacity or 0)
        if capacity == self.capacity and torch.equal(rows, torch.arange(self.rows)):
            return
        kept = (rows >= 0).nonzero().squeeze(1)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                new = old.new_zeros(rows.shape[0], old.shape[1], capacity, old.shape[3])
                new[kept, :, : self.capacity] = old[rows[kept]]
                buffers[i] = new
        self.rows = rows.shape[0]
        self.capacity = capacity


class BatchedTransformersBackend(RowBackend):
    """Runs a transformers causal LM over rows that join, leave and roll back independently.

    Shares the weights of ``model``; holds its own cache. Rows are numbered
    0..rows-1 in the order they were added; removing rows renumbers the rest.
    With ``cuda_graphs`` on a CUDA device, steps over every row replay
    captured graphs (models/cuda_graphs.py); elsewhere the flag does nothing.
    """

    def __init__(self, model: PreTrainedModel, cuda_graphs: bool = True) -> None:
        config = model.config.get_text_config()
        kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
        if not kinds <= set(ATTENTION_KINDS):
            raise ConfigError(
                "batched decoding supports full and sliding-window attention; "
                f"this model has {sorted(kinds - set(ATTENTION_KINDS))}: "
                "decode its prompts one at a time with Generator.generate"
            )
        if model.config._attn_implementation not in ("eager", "sdpa", PADDED_ATTENTION):
            raise ConfigError(
                f"batched decoding needs eager or sdpa attention, not {model.config._attn_implementation}"
            )
        self.model = model
        self.sliding_window: int | None = (
            getattr(config, "sliding_window", None) if "sliding_attention" in kinds else None
        )
        self.layer_kinds = kinds
        capabilities = BackendCapabilities(trees=True, features=True, max_rows=None, copies_rows=True)
        self.info = transformers_info(model, capabilities, runtime="batched|")
        self.mask_dtype = model.get_input_embeddings().weight.dtype
        self.cache = RowCache()
        self.cached_lengths: list[int] = []
        self.last_features: list[torch.Tensor] = []
        self._hidden: torch.Tensor | None = None
        self.graphs = CudaGraphs() if cuda_graphs and self.device.type == "cuda" else None

    @property
    def row_count(self) -> int:
        return len(self.cached_lengths)

    def add_rows(self, count: int) -> None:
        """Append ``count`` empty rows."""
        keep = torch.cat([torch.arange(self.row_count), torch.full((count,), -1)])
        self._resize(keep)
        self.cached_lengths += [0] * count

    def remove_rows(self, row_ids: list[int]) -> None:
        """Drop rows (their cache is freed); the remaining rows keep their order."""
        gone = set(row_ids)
        keep = [i for i in range(self.row_count) if i not in gone]
        self._resize(torch.tensor(keep, dtype=torch.long))
        self.cached_lengths = [self.cached_lengths[i] for i in keep]

    def truncate(self, row_id: int, length: int, branch: list[int] | None = None) -> None:
        """Keep only the first ``length`` positions of row ``row_id``; with ``branch``, the last len(branch) of them are
        those slots' states."""
        if not 0 <= length <= self.cached_lengths[row_id]:
            raise ValueError(f"cannot truncate row {row_id} of {self.cached_lengths[row_id]} positions to {length}")
        if branch:  # a tree's accepted path moves next to the positions before it, so that slots equal positions again
            for buffer in self.cache.keys + self.cache.values:
                keep_branch(buffer[row_id], 1, length, branch)
        self.cached_lengths[row_id] = length

    @torch.inference_mode()
    def copy_row(self, source: int, targets: list[int]) -> None:
        length = self.cached_lengths[source]
        for buffer in self.cache.keys + self.cache.values:
            buffer[targets, :, :length] = buffer[source, :, :length].clone()
        for target in targets:
            self.cached_lengths[target] = length

    def kv_bytes(self) -> int:
        return sum(buffer.nbytes for buffer in self.cache.keys + self.cache.values)

    def kv_bytes_for(self, positions: int) -> int:
        """A row's slots for ``positions`` positions (the buffer grows by half at least, so up to half as many again;
        with CUDA graphs from a power of two) times what a slot holds: every layer's key and value."""
        width = positions if self.graphs is None else max(64, 1 << (positions - 1).bit_length())
        return _round_up(width, 64) * 3 // 2 * self._slot_bytes()

    def kv_bytes_for_rows(self, positions: list[int]) -> int:
        """Every row has as many slots as the buffer, which is sized for the longest row and never shrinks."""
        slots = max(self.kv_bytes_for(max(positions, default=0)), self.cache.capacity * self._slot_bytes())
        return len(positions) * slots

    def _slot_bytes(self) -> int:
        """Bytes of one position of one row in every layer's keys and values: the buffers' own once made, before that
        the text config's layers x key/value heads x head size x 2 in the embeddings' dtype."""
        if self.cache.keys:
            return sum(b.shape[1] * b.shape[3] * b.element_size() for b in self.cache.keys + self.cache.values)
        config = self.model.config.get_text_config()
        heads = config.num_key_value_heads or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return config.num_hidden_layers * heads * head_dim * 2 * self.mask_dtype.itemsize

    @torch.inference_mode()
    def forward(
        self,
        row_ids: list[int],
        feeds: list[torch.Tensor],
        last: int,
        trees: list[torch.Tensor | None] | None = None,
        features: bool = False,
    ) -> torch.Tensor:
        """Append ``feeds[i]`` (1-D token ids) to row ``row_ids[i]``; return logits [len(row_ids), last, V] of each
        feed's last ``last`` tokens.

        A feed shorter than ``last`` gets its logits right-aligned; the columns before them are padding. A feed ending
        in a tree (``trees[i]``) writes its nodes at consecutive slots, each at the position of its depth.
        """
        n = max(feed.shape[0] for feed in feeds)
        trees = trees or [None] * len(feeds)
        starts = torch.tensor([self.cached_lengths[r] for r in row_ids])
        sizes = torch.tensor([feed.shape[0] for feed in feeds])
        pads = n - sizes
        column = torch.arange(n)[None, :]
        real = column >= pads[:, None]
        # Padding columns write past their row's real tokens, where nothing reads them.
        slots = torch.where(real, starts[:, None] + column - pads[:, None], starts[:, None] + sizes[:, None] + column)
        visible = (torch.arange(n)[None, :, None] >= torch.arange(n)[None, None, :]).expand(len(row_ids), n, n).clone()
        for i, tree in enumerate(trees):  # within each feed: causal, or a tree at its end
            if tree is not None:
                visible[i, pads[i] :, pads[i] :] = tree_mask(int(sizes[i]), tree)
        positions = torch.where(real, tree_positions(starts[:, None] - pads[:, None], visible), 0)
        tokens = torch.zeros(len(row_ids), n, dtype=torch.long)
        for i, feed in enumerate(feeds):
            tokens[i, pads[i] :] = feed
        width = int((starts + n).max())
        if self.graphs is not None:
            width = max(64, 1 << (width - 1).bit_length())  # few distinct widths, so few graphs
        if width > self.cache.capacity:  # grow by half at least, so copies stay rare
            self._resize(capacity=max(_round_up(width, 64), self.cache.capacity * 3 // 2))
        self.cache.every_row = row_ids == list(range(self.row_count))
        self.cache.width = width
        active = torch.tensor(row_ids, dtype=torch.long)
        masks = self._masks(positions, slots, starts, pads, visible, real, width)
        inputs = {"tokens": tokens, "positions": positions, "slots": slots, "active": active} | masks
        inputs = {name: tensor.to(self.device) for name, tensor in inputs.items()}
        logits = None
        if self.graphs is not None and self.cache.every_row and not features:
            logits = self.graphs.run((len(row_ids), n, width, last), inputs, partial(self._run, last=last))
        if logits is None:
            logits = self._run(inputs, last, features)
        if features:  # each row's real columns
            self.last_features = [hidden[pad:] for hidden, pad in zip(self._hidden, pads.tolist(), strict=True)]
        for row_id, size in zip(row_ids, sizes.tolist(), strict=True):
            self.cached_lengths[row_id] += size
        return logits

    def _run(self, inputs: dict[str, torch.Tensor], last: int, features: bool = False) -> torch.Tensor:
        """The model over ``inputs``: every tensor the step reads that changes between steps is one of them (a captured
        graph replays with them).

        With ``features``, the final hidden states (after the last norm) are kept in ``_hidden``."""
        self.cache.slots, self.cache.active = inputs["slots"], inputs["active"]
        masks = {kind: inputs[kind] for kind in ATTENTION_KINDS if kind in inputs}
        out = self.model(
            input_ids=inputs["tokens"],
            position_ids=inputs["positions"],
            attention_mask=masks if len(masks) > 1 else masks["full_attention"],
            cache=self.cache,
            use_cache=True,
            logits_to_keep=last,
            output_hidden_states=features,
        )
        self._hidden = out.hidden_states[-1] if features else None
        return out.logits

    def _resize(self, rows: torch.Tensor | None = None, capacity: int | None = None) -> None:
        self.cache.resize(rows, capacity)
        if self.graphs is not None:
            self.graphs.clear()  # graphs hold the old buffers

    def _masks(
        self,
        positions: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        pads: torch.Tensor,
        visible: torch.Tensor,
        real: torch.Tensor,
        width: int,
    ) -> dict[str, torch.Tensor]:
        """Additive masks [B, 1, n, width] by layer kind: a real token sees its row's slots before the feed and the fed
        slots it is ``visible`` to, by column (within the window of its position on sliding layers)."""
        n = visible.shape[2]
        slot = torch.arange(width)[None, None, :]
        fed = slot - (starts - pads)[:, None, None]  # the key's column in the feed
        inside = (fed >= pads[:, None, None]) & (fed < n)  # the key is one of the row's fed tokens
        column = fed.clamp(0, n - 1)
        sees = visible.gather(2, column.expand(-1, n, -1))
        causal = (~inside | sees) & (slot <= slots[:, :, None]) & real[:, :, None]
        # padding queries attend to slot 0 only, so no row of the softmax is empty
        causal |= ~real[:, :, None] & (slot == 0)
        masks = {"full_attention": causal}
        if "sliding_attention" in self.layer_kinds:  # by positions in the text: a tree node's slot is past its position
            key_position = torch.where(inside, positions.gather(1, column[:, 0])[:, None, :], slot)
            masks["sliding_attention"] = causal & (
                (key_position > positions[:, :, None] - self.sliding_window) | ~real[:, :, None]
            )
        low = torch.finfo(self.mask_dtype).min
        return {
            kind: torch.zeros(mask.shape, dtype=self.mask_dtype).masked_fill_(~mask, low)[:, None]
            for kind, mask in masks.items()
        }


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step
