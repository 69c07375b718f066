"""One generation's lifecycle: its prompt checked and encoded, its steps decoded (alone or in a batch), its text
settled at EOS, a stop string or its limits, and the drift monitor watching it."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from specdec.config import GenerationConfig
from specdec.drafters.base import EVERYONE, HistoryScope
from specdec.engine.decoder import Decoder
from specdec.engine.stats import DecodeStats
from specdec.engine.text import TextTracker
from specdec.errors import ConfigError
from specdec.guards import Guards, NoGuards
from specdec.models.backend import TREES_UNSUPPORTED
from specdec.seeds import Seeds

if TYPE_CHECKING:
    from specdec.engine.generator import Generator

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


class Completion:
    """One generation: iterating decodes it alone and yields text deltas; :meth:`result` gives the outcome afterwards.

    In a batch (:meth:`Generator.admit`) the decoder decodes it with others, handing
    each step's tokens to :meth:`take` and calling :meth:`close` when it ends.
    """

    def __init__(self, generator: Generator, prompt: str | list[int], config: GenerationConfig) -> None:
        if config.stop and generator.tokenizer is None:
            raise ConfigError("stop strings need a tokenizer, and this model has none")
        if config.branches > 1 and not generator.backend.capabilities.trees:
            raise ConfigError(TREES_UNSUPPORTED)
        self.generator = generator
        self.config = config
        self.prompt_ids = generator.encode(prompt)
        self.stats = DecodeStats()
        self.token_ids: list[int] = []
        self.finish_reason: FinishReason = "length"
        self.text = TextTracker(generator.tokenizer, config.stop) if generator.tokenizer is not None else None
        self.seeds = Seeds(config.seed if config.seed is not None else random.randrange(2**63))
        self.scope: HistoryScope = EVERYONE  # whose history its drafter may share; the server sets it
        guards = config.guards
        ignorable = generator.ignorable() if guards.repetition else frozenset()
        self.guards = Guards(guards, len(self.prompt_ids), ignorable) if guards.active else NoGuards()
        if guards.drift_threshold is not None:
            if generator.tokenizer is None:
                raise ConfigError("the drift monitor compares text, and this model has no tokenizer")
            self.embedder = generator.embedder()
            self.prompt_text = generator.tokenizer.decode(self.prompt_ids, skip_special_tokens=True)

    def __iter__(self) -> Iterator[str]:
        """Decode alone: the same step as a batch, on this Generator's own (or a forked) single-sequence backend."""
        gen = self.generator
        backend, drafter = gen.acquire()
        decoder = None
        try:
            decoder = Decoder(
                backend.row_backend(batch=False, trees=self.config.branches > 1, cuda_graphs=gen.batch.cuda_graphs)
            )
            # after acquiring: a first measurement must not disturb another run's cache
            decoder.join(self, drafter, gen.k_policy(self.config))
            while decoder.rows:
                for update in decoder.step():
                    if update.text:
                        yield update.text
        finally:
            if decoder is not None:
                decoder.leave(self)  # abandoned or failed: its drafter still hears that it ended
            gen.release(backend)

    def take(self, ids: list[int]) -> str:
        """Add the tokens one step accepted; return the text they complete. Ends the run at EOS or a stop string (the
        stats then count only what was kept)."""
        if self.config.stop_on_eos:
            eos_at = next((i for i, t in enumerate(ids) if t in self.generator.eos_ids), None)
            if eos_at is not None:
                ids = ids[: eos_at + 1]
                self.finish_reason = "eos"
        if self.text is not None:
            ids = self.text.add(ids)
            if self.text.stopped:
                self.finish_reason = "stop"
        self.stats.keep_emitted(len(ids))
        before = len(self.token_ids)
        self.token_ids += ids
        if self.config.guards.drift_threshold is not None:
            self._watch_drift(before)
        return self.text.delta(final=self.ended) if self.text is not None else ""

    def _watch_drift(self, before: int) -> None:
        """Score each window completed since ``before`` tokens against the prompt; below the threshold, a drift event
        (and an anchor)."""
        guards = self.config.guards
        size = guards.drift_window
        start = time.perf_counter()
        for end in range(size * (before // size + 1), len(self.token_ids) + 1, size):
            window = self.generator.tokenizer.decode(self.token_ids[end - size : end], skip_special_tokens=True)
            similarity = self.embedder.similarity(self.prompt_text, [window])[0]
            if similarity < guards.drift_threshold:  # type: ignore[operator]
                self.stats.events.append({"kind": "drift", "at": end, "similarity": round(similarity, 4)})
                if guards.drift_anchor:
                    self.guards.anchor_requested = True  # type: ignore[union-attr]  # drift is a guard: self.guards is Guards
        self.stats.guard_s += time.perf_counter() - start

    @property
    def ended(self) -> bool:
        """EOS or a stop string ended the run (the token budget and the context are the decoder's limits)."""
        return self.finish_reason != "length"

    def close(self) -> str:
        """Settle the outcome after the last step; return any text held back for a possible stop string."""
        if not self.ended and len(self.token_ids) < self.config.max_new_tokens:
            self.finish_reason = "context"
        return self.text.delta(final=True) if self.text is not None else ""

    def result(self) -> GenerationResult:
        text = self.text.text if self.text is not None else ""
        return GenerationResult(text, self.token_ids, self.stats, self.finish_reason)
