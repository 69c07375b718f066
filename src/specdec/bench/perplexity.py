"""Perplexity of a target under a precision plan, against float32 on the same tokens.

The text is tokenized once and cut into windows of ``window`` tokens, each
scored from its own start (no overlap), so every plan sees exactly the same
predictions; perplexity is exp of the mean negative log-likelihood.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.config import PrecisionPlan
from specdec.errors import ConfigError
from specdec.models import load_model
from specdec.models.precision import apply_plan
from specdec.training.ngram import documents

Progress = Callable[[str, int, int], None]  # label, windows done, windows in all


@dataclass(frozen=True)
class PerplexityResult:
    plan: str
    perplexity: float
    float32_perplexity: float
    tokens: int

    @property
    def delta(self) -> float:
        return self.perplexity - self.float32_perplexity


def read_tokens(tokenizer, path: str, limit: int) -> list[int]:
    """Up to ``limit`` tokens of a text or JSONL file (records' text fields, one after another)."""
    if not Path(path).is_file():
        raise ConfigError(f"perplexity data '{path}' is not a file: pass a text or JSONL file")
    tokens: list[int] = []
    for text, _ in documents(Path(path)):
        tokens += tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(tokens) >= limit:
            break
    return tokens[:limit]


@torch.inference_mode()
def score(model, tokens: list[int], window: int, progress: Progress, label: str) -> float:
    """Mean negative log-likelihood of every token after the first of each window."""
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    total, count = 0.0, 0
    for done, ids in enumerate(windows, 1):
        batch = torch.tensor([ids])
        logits = model(input_ids=batch).logits[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, batch[0, 1:], reduction="sum"))
        count += len(ids) - 1
        progress(label, done, len(windows))
    return total / count


def perplexity(
    target: str, plan: PrecisionPlan, data: str, max_tokens: int = 8192, window: int = 512, progress: Progress = lambda *a: None
) -> PerplexityResult:
    """Perplexity of ``target`` in float32 and under ``plan``, on the same tokens (one model in memory at a time)."""
    if max_tokens < 2 or window < 2:
        raise ConfigError("perplexity needs max_tokens >= 2 and window >= 2")
    model = load_model(target, dtype="float32")
    if model.tokenizer is None:
        raise ConfigError(f"target '{target}' has no tokenizer to read the perplexity data with")
    tokens = read_tokens(model.tokenizer, data, max_tokens)
    if len(tokens) < 2:
        raise ConfigError(f"'{data}' holds fewer than 2 tokens of text")
    reference = score(model.model, tokens, window, progress, "float32")
    del model
    gc.collect()
    planned = apply_plan(load_model(target, dtype="float32").model, plan)
    nll = score(planned, tokens, window, progress, plan.describe())
    return PerplexityResult(plan.describe(), math.exp(nll), math.exp(reference), len(tokens))
