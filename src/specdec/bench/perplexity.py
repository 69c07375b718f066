"""Perplexity of a target under a precision plan or on the native runtime, against float32 on the same tokens.

The text is tokenized once and cut into windows of ``window`` tokens, each
scored from its own start (no overlap), so every plan sees exactly the same
predictions; perplexity is exp of the mean negative log-likelihood.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PreTrainedModel

from specdec.config import RuntimeConfig
from specdec.errors import ConfigError
from specdec.models import Backend, load_model, open_target
from specdec.models.native.perplexity_record import CHECK_TOKENS, PerplexityResult, store_check, stored_check
from specdec.models.precision import apply_plan
from specdec.training.ngram import documents

Progress = Callable[[str, int, int], None]  # label, windows done, windows in all


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
def score(model: PreTrainedModel | Backend, tokens: list[int], window: int, progress: Progress, label: str) -> float:
    """Mean negative log-likelihood of each token after the first of each window (a transformers model or a backend)."""
    windows = [tokens[i : i + window] for i in range(0, len(tokens) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    total, count = 0.0, 0
    for done, ids in enumerate(windows, 1):
        batch = torch.tensor([ids])
        if isinstance(model, PreTrainedModel):
            logits = model(input_ids=batch).logits[0, :-1].float()
        else:
            model.reset()
            logits = model.forward(batch, last=len(ids))[0, :-1].float()
        total += float(torch.nn.functional.cross_entropy(logits, batch[0, 1:], reduction="sum"))
        count += len(ids) - 1
        progress(label, done, len(windows))
    return total / count


def perplexity(
    target: str,
    runtime: RuntimeConfig,
    data: str,
    max_tokens: int = 8192,
    window: int = 512,
    progress: Progress = lambda *a: None,
) -> PerplexityResult:
    """Perplexity of ``target`` in float32 and on ``runtime`` (a precision plan, or the native backend), on the
    same tokens.

    One model in memory at a time.
    """
    if runtime.backend not in ("transformers", "native") or (
        runtime.backend == "transformers" and runtime.precision is None
    ):
        raise ConfigError("perplexity compares a precision plan or the native backend with float32: pass one of them")
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
    label = runtime.precision.describe() if runtime.precision else runtime.backend
    scored = (
        open_target(target, runtime).backend
        if runtime.backend == "native"
        else apply_plan(load_model(target).model, runtime.precision)
    )
    nll = score(scored, tokens, window, progress, label)
    return PerplexityResult(label, math.exp(nll), math.exp(reference), len(tokens))


def native_perplexity(
    target: str, identity: str, format: str, progress: Progress = lambda *a: None
) -> PerplexityResult:
    """The native backend's perplexity against float32 on the shipped default prompts: measured once per model (its
    backend's ``identity``: name, weights, format, kernel version) and stored (models/native/perplexity_record.py,
    what `generate` and `demo` read when they run on native), then read from there."""
    from specdec.bench.prompts import DEFAULT_PROMPTS, prompt_sets

    stored = stored_check(identity)
    if stored is not None:
        return stored
    result = perplexity(
        target,
        RuntimeConfig(backend="native", native_format=format),
        str(prompt_sets()[DEFAULT_PROMPTS]),
        CHECK_TOKENS,
        256,
        progress,
    )
    store_check(identity, result)
    return result
