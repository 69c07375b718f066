"""One generation as a record: its checked prompt, settings, random generators, guards and stats, and what its steps'
tokens become (text settled at EOS, a stop string or its limits; the drift monitor's events). The Generator builds it;
a Decoder decodes it (alone or in a batch) through the :class:`~specdec.engine.decoder.Sink` members."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal

from specdec.config import GenerationConfig
from specdec.drafters.base import EVERYONE, HistoryScope
from specdec.engine.decoder import Sink
from specdec.engine.stats import DecodeStats
from specdec.engine.text import TextTracker
from specdec.grammar import Constraint, NoConstraint
from specdec.guards import DriftMonitor, Guards, NoGuards
from specdec.seeds import Seeds
from specdec.verification.logprobs import TokenLogprob

FinishReason = Literal["length", "eos", "stop", "context"]


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]  # the new tokens only
    stats: DecodeStats
    finish_reason: FinishReason
    logprobs: list[TokenLogprob] | None = None  # one per new token, where GenerationConfig.logprobs asked for them

    def to_dict(self) -> dict[str, object]:
        reported = {} if self.logprobs is None else {"logprobs": [_as_dict(entry) for entry in self.logprobs]}
        return {
            "text": self.text,
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "stats": self.stats.as_dict(),
        } | reported


def _as_dict(entry: TokenLogprob) -> dict[str, object]:
    return {"token": entry.token, "logprob": entry.logprob, "top": [list(pair) for pair in entry.top]}


class Completion(Sink):
    """One generation: iterating decodes it alone and yields text deltas; :meth:`result` gives the outcome afterwards.

    Built by :meth:`Generator.completion <specdec.engine.generator.Generator.completion>`, which checks and encodes the
    prompt and gives what the completion needs: ``constraint`` (its grammar's state), ``eos_ids``, ``text`` (None
    without a tokenizer), ``guards``, ``drift`` (None without a drift threshold) and ``alone``, how it decodes alone
    (the Generator's loop on a single-sequence decoder). In a batch (``Generator.admit``) the decoder decodes it with
    others, handing each step's tokens to :meth:`take` and calling :meth:`close` when it ends.
    """

    def __init__(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        *,
        constraint: Constraint | NoConstraint,
        eos_ids: frozenset[int],
        text: TextTracker | None,
        guards: Guards | NoGuards,
        drift: DriftMonitor | None,
        alone: Callable[[Completion], Iterator[str]],
    ) -> None:
        self.prompt_ids = prompt_ids
        self.config = config
        self.constraint = constraint
        self.eos_ids = eos_ids
        self.text = text
        self.guards = guards
        self.drift = drift
        self._alone = alone
        self.stats = DecodeStats()
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if config.logprobs is None else []
        self.finish_reason: FinishReason = "length"
        self.seeds = Seeds(config.seed if config.seed is not None else random.randrange(2**63))
        self.scope: HistoryScope = EVERYONE  # whose history its drafter may share; the server sets it

    def __iter__(self) -> Iterator[str]:
        """Decode alone: the same step as a batch, on its Generator's own (or a forked) single-sequence backend."""
        return self._alone(self)

    def take(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> str:
        """Add the tokens one step accepted (and their ``logprobs``, where the config asks for them); return the text
        they complete. Ends the run at EOS or a stop string (the stats then count only what was kept)."""
        if self.config.stop_on_eos:
            eos_at = next((i for i, t in enumerate(ids) if t in self.eos_ids), None)
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
        if self.logprobs is not None and logprobs is not None:
            self.logprobs += logprobs[: len(ids)]
        if self.drift is not None:
            start = time.perf_counter()
            self.stats.events += self.drift.watch(self.token_ids, before)
            self.stats.guard_s += time.perf_counter() - start
        return self.text.delta(final=self.ended) if self.text is not None else ""

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
        return GenerationResult(text, self.token_ids, self.stats, self.finish_reason, self.logprobs)
