"""The library entry point: a target, a drafter and a config; prompts in, text and stats out."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch

from specdec.config import GenerationConfig, RuntimeConfig, with_overrides
from specdec.drafters import Drafter, build_drafter
from specdec.engine.costs import machine_cost_curve
from specdec.engine.loop import DecodeStats, speculative_decode
from specdec.engine.text import TextTracker
from specdec.errors import ConfigError, PromptError, VocabularyMismatchError
from specdec.models import DEFAULT_TARGET, LoadedModel, Target, open_target
from specdec.scheduling import CostCurve, build_k_policy

FinishReason = Literal["length", "eos", "stop", "context"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only
    stats: DecodeStats
    finish_reason: FinishReason

    def to_dict(self) -> dict[str, object]:
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        }


class Generator:
    """Speculative text generation whose output is the target's own.

    ``target`` and ``drafter`` are names (``"gemma-3-270m"``, ``"prompt-lookup"``,
    ``"model:PATH"``) or ready objects; ``runtime`` says where named models run
    (transformers or llama.cpp, dtype, threads); ``config`` holds the defaults
    that keyword arguments of :meth:`generate` and :meth:`stream` override.
    """

    def __init__(
        self,
        target: str | LoadedModel | Target = DEFAULT_TARGET,
        drafter: str | Drafter = "none",
        config: GenerationConfig | None = None,
        runtime: RuntimeConfig = RuntimeConfig(),
    ) -> None:
        self.config = config or GenerationConfig()
        self.target = target if isinstance(target, Target) else open_target(target, runtime)
        self.tokenizer = self.target.tokenizer
        self.backend = self.target.backend
        self.drafter = build_drafter(drafter, self.target, runtime) if isinstance(drafter, str) else drafter
        if self.drafter.vocab_size is not None and self.drafter.vocab_size != self.backend.vocab_size:
            raise VocabularyMismatchError(
                f"the draft's vocabulary has {self.drafter.vocab_size} tokens but the target's has "
                f"{self.backend.vocab_size}: use a draft built for this target (same tokenizer), a draft model "
                "with a tokenizer (it is then re-tokenized), or --draft prompt-lookup"
            )
        self.eos_ids = self.target.eos_ids
        self._costs: CostCurve | None = None

    def costs(self) -> CostCurve:
        """The target's forward cost curve on this machine (measured on first use, cached on disk)."""
        if self._costs is None:
            self._costs = machine_cost_curve(self.backend)
        return self._costs

    def generate(self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, or token ids) and return it with stats."""
        run = _Run(self, prompt, with_overrides(config or self.config, **overrides))
        for _ in run:
            pass
        return run.result()

    def stream(self, prompt: str | list[int], config: GenerationConfig | None = None, **overrides: object) -> Iterator[str]:
        """Yield pieces of text as the target accepts tokens."""
        yield from _Run(self, prompt, with_overrides(config or self.config, **overrides))

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptError("the prompt is empty: pass some text to continue")
            if self.tokenizer is None:
                raise PromptError(f"model '{self.target.name}' has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
            if not ids:
                raise PromptError("the prompt is empty: pass at least one token id")
            bad = [t for t in ids if not 0 <= t < self.backend.vocab_size]
            if bad:
                raise PromptError(f"token id {bad[0]} is outside the vocabulary (0..{self.backend.vocab_size - 1})")
        if len(ids) >= self.backend.max_context:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but model '{self.target.name}' has a context of "
                f"{self.backend.max_context}: shorten the prompt"
            )
        return ids


class _Run:
    """One generation: iterating yields text deltas; :meth:`result` gives the outcome afterwards."""

    def __init__(self, generator: Generator, prompt: str | list[int], config: GenerationConfig) -> None:
        if config.stop and generator.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer, and this model has none")
        self.generator = generator
        self.config = config
        self.prompt_ids = generator.encode(prompt)
        self.stats = DecodeStats()
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason = "length"
        self.text = TextTracker(generator.tokenizer, config.stop) if generator.tokenizer is not None else None

    def __iter__(self) -> Iterator[str]:
        gen = self.generator
        seed = self.config.seed if self.config.seed is not None else random.randrange(2**63)
        rng = torch.Generator().manual_seed(seed)
        prompt = torch.tensor([self.prompt_ids], dtype=torch.long)
        policy = build_k_policy(self.config.k_policy, self.config.k, gen.costs)
        steps = speculative_decode(gen.backend, gen.drafter, policy, prompt, self.config, self.stats, rng)
        for new in steps:
            ids = new.tolist()
            if self.config.stop_on_eos:
                eos_at = next((i for i, t in enumerate(ids) if t in gen.eos_ids), None)
                if eos_at is not None:
                    ids = ids[: eos_at + 1]
                    self.finish_reason = "eos"
            if self.text is not None:
                ids = self.text.add(ids)
                if self.text.stopped:
                    self.finish_reason = "stop"
            self.token_ids += ids
            if self.text is not None:
                piece = self.text.delta(final=self.finish_reason != "length")
                if piece:
                    yield piece
            if self.finish_reason != "length":
                break
        else:
            if len(self.token_ids) < self.config.max_new_tokens:
                self.finish_reason = "context"
        self.stats.new_tokens = len(self.token_ids)
        if self.text is not None and (tail := self.text.delta(final=True)):
            yield tail

    def result(self) -> GenerationResult:
        text = self.text.text if self.text is not None else ""
        return GenerationResult(text, self.token_ids, self.stats, self.finish_reason)
