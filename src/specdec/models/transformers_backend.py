"""The transformers implementation of :class:`~specdec.models.backend.Backend`: any causal LM, one sequence."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from specdec.errors import ConfigError
from specdec.models.backend import (
    TREES_UNSUPPORTED,
    Backend,
    BackendCapabilities,
    Embed,
    ModelInfo,
    OneRow,
    RowBackend,
)
from specdec.models.loading import model_name


class TransformersBackend(Backend):
    """Runs any transformers causal LM with a DynamicCache that can be rolled back.

    Its own cache keeps chains only: a sequence that drafts trees, and a batch, run on the batched backend over the
    same weights (``row_backend``), whose cache is addressed by slot.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.info = transformers_info(model, BackendCapabilities(trees=True, features=True, max_rows=None))
        self.last_features: torch.Tensor | None = None
        self.reset()

    @property
    def cached_length(self) -> int:
        return self._length

    def fork(self) -> TransformersBackend:
        return TransformersBackend(self.model)

    def token_embeddings(self) -> Embed:
        """The model's input embedding as a function of token ids (a feature-conditioned draft embeds with it)."""
        return self.model.get_input_embeddings()

    def transformers_model(self) -> PreTrainedModel:
        """The model itself: drafts in torch may run on its weights."""
        return self.model

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> RowBackend:
        """The plain cache keeps one chain: a batch, or one sequence's trees, decode in a batched cache over these
        weights."""
        if not batch and not trees:
            return OneRow(self)
        from specdec.models.batched import BatchedTransformersBackend  # it builds on this module

        return BatchedTransformersBackend(self.model, cuda_graphs=cuda_graphs)

    def reset(self) -> None:
        self._cache = DynamicCache(config=self.model.config)
        for layer in self._cache.layers:
            # Sliding-window layers drop old states unless told to keep them until the next crop.
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        self._length = 0

    @torch.inference_mode()
    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        if tree is not None:
            raise ConfigError(TREES_UNSUPPORTED)
        batch, n = tokens.shape
        positions = torch.arange(self._length, self._length + n, device=self.device).expand(batch, n)
        out = self.model(
            input_ids=tokens.to(self.device),
            position_ids=positions,
            cache=self._cache,
            use_cache=True,
            logits_to_keep=last or 0,  # the output head is costly: skip positions nobody reads
            output_hidden_states=features,
        )
        self._length += n
        # the last is after the final norm: the head's input
        self.last_features = out.hidden_states[-1] if features else None
        return out.logits

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot truncate a cache of {self._length} positions to {length}")
        if branch is not None and branch != list(range(length - len(branch), length)):
            raise ConfigError(TREES_UNSUPPORTED)
        if self._length == 0:
            return  # an empty cache's layers cannot be cropped
        # A negative count removes that many positions; even 0 trims sliding-window layers back to their window,
        # which keep every position until cropped (so that a rejection can roll them back).
        self._cache.crop(length - self._length)
        self._length = length


def transformers_info(model: PreTrainedModel, capabilities: BackendCapabilities, runtime: str = "") -> ModelInfo:
    """The record of a transformers model as it is now (its precision plan applied), on a runtime named ``runtime``
    (a prefix of its name)."""
    return ModelInfo(
        name=runtime + model_name(model),
        vocab_size=model.get_output_embeddings().out_features,
        max_context=getattr(model.config.get_text_config(), "max_position_embeddings", None) or 2**31,
        device=next(model.parameters()).device,
        capabilities=capabilities,
    )
