"""The row lifecycle: sequences join, step together and leave; every driver (generate, stream, generate_batch, the
server) uses it.

A joining sequence (a :class:`Sink`: engine/completion.py's Completion) becomes a
:class:`~specdec.engine.rows.Row` with its own drafter, k policy, random
generators, guards and stats. Each :meth:`Decoder.step` runs the speculative step
over every row (joining rows' prompts are read in forwards of their own, grouped
by similar length, so that no row is padded much), hands each row's new tokens to
its sink, and retires the rows that ended (EOS, a stop string, their token budget
or the model's context).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import torch

from specdec.config import GenerationConfig
from specdec.drafters.base import Drafter, HistoryScope
from specdec.engine.rows import CHAINS, Row
from specdec.engine.stats import DecodeStats
from specdec.engine.step import speculative_step
from specdec.engine.trees import TREES
from specdec.errors import ConfigError, ContextLengthError
from specdec.grammar import Constraint, NoConstraint
from specdec.guards import Guards, NoGuards
from specdec.models.backend import RowBackend
from specdec.scheduling import DynamicKCap, KPolicy, StepOutcome
from specdec.seeds import Seeds
from specdec.verification.logprobs import TokenLogprob, token_logprobs


class Sink(Protocol):
    """A sequence as the decoder sees it: what its row starts from (read when it joins), and where each step's tokens
    go. engine/completion.py's Completion is the one the engine builds."""

    prompt_ids: list[int]
    config: GenerationConfig
    seeds: Seeds
    stats: DecodeStats  # the row records its steps here
    guards: Guards | NoGuards
    constraint: Constraint | NoConstraint  # its grammar's state (structured output)
    scope: HistoryScope  # DraftSettings.scope

    def take(self, ids: list[int], logprobs: list[TokenLogprob] | None = None) -> str:
        """The tokens one step accepted (with their log-probabilities where its config asks for them); returns the
        text they complete (it may keep fewer: EOS, a stop string)."""
        ...

    @property
    def ended(self) -> bool:
        """The sink ended the sequence (the token budget and the context are the decoder's limits)."""
        ...

    def close(self) -> str:
        """The sequence left after its last step; returns any text held back until then."""
        ...


S = TypeVar("S", bound=Sink)

REPORTS_KEPT = 100_000  # the latest steps' reports; a server's decoder steps forever
# Each step that drafts nothing scales the measured drafting cost by this: a cost measured in a stretch of load from
# elsewhere would otherwise keep the k_cap at 0, where nothing is drafted and the cost is never measured again.
DRAFT_COST_RELAX = 0.9


@dataclass(frozen=True)
class StepReport:
    """What one step of the decoder did, for schedulers and benchmarks."""

    rows: int
    k_cap: int | None  # the batch's cap on every row's k this step, None when nothing caps it
    seconds: float


@dataclass(frozen=True)
class Update(Generic[S]):
    """What one step did for one completion."""

    completion: S
    text: str  # the text the step completed (and, when the completion ended, the text held back until then)
    done: bool  # the completion ended and left the decoder; its result is settled


class Decoder(Generic[S]):
    """Completions (sinks) decoded together on one :class:`RowBackend`, joining and leaving between steps.

    ``k_cap`` (optional) chooses the batch's k_cap each step from the load (it caps every row's k); without it
    each row drafts what its own policy chooses.
    """

    def __init__(self, backend: RowBackend, k_cap: DynamicKCap | None = None) -> None:
        self.backend = backend
        self.k_cap = k_cap
        self.rows: dict[S, Row] = {}  # in the backend's row order
        self.reports: deque[StepReport] = deque(maxlen=REPORTS_KEPT)
        self._draft_s_per_token = 0.0

    def __len__(self) -> int:
        return len(self.rows)

    def join(self, completion: S, drafter: Drafter, policy: KPolicy) -> None:
        """Add ``completion`` with its own ``drafter`` and ``policy``; its prompt is read at the next step.

        Raises ConfigError when the drafter cannot serve the completion's settings (or reads hidden states this runtime
        does not return), ContextLengthError when the prompt fills the context.
        """
        if completion in self.rows:
            raise ValueError("this completion is already decoding here: a completion joins a decoder once")
        if drafter.capabilities.features and not self.backend.capabilities.features:
            raise ConfigError(
                f"{type(drafter).__name__} drafts from the target's hidden states, which this runtime does not return: "
                "use --runtime native or transformers, or a drafter that does not read them"
            )
        if len(completion.prompt_ids) >= self.backend.max_context:
            raise ContextLengthError(
                f"a prompt of {len(completion.prompt_ids)} tokens does not fit "
                f"the context of {self.backend.max_context}"
            )
        row = Row(
            torch.tensor(completion.prompt_ids, dtype=torch.long),
            completion.config,
            drafter,
            policy,
            completion.seeds,
            completion.stats,
            prompt_length=len(completion.prompt_ids),
            guards=completion.guards,
            constraint=completion.constraint,
            scope=completion.scope,
            shape=TREES if completion.config.branches > 1 and drafter.capabilities.trees else CHAINS,
        )
        row.stats.lossy = completion.config.typical_acceptance is not None
        drafter.begin(row.draft_settings)
        self.backend.add_rows(1)
        self.rows[completion] = row

    def leave(self, completion: S) -> None:
        """Remove ``completion`` (finished, cancelled or failed), free its cache and tell its drafter; one not here is
        ignored."""
        if completion in self.rows:
            self.backend.remove_rows([list(self.rows).index(completion)])
            row = self.rows.pop(completion)
            row.drafter.finish(row.tokens, len(completion.prompt_ids))

    def step(self) -> list[Update[S]]:
        """Advance every row by one speculative step; hand each completion its tokens; retire the rows that ended.

        If it raises, the rows' state is undefined (some may have advanced without their completion hearing of it):
        make them leave.
        """
        if not self.rows:
            return []
        start = time.perf_counter()
        rows = list(self.rows.values())
        k_cap = self._cap_for(rows)
        row_ids = {row: i for i, row in enumerate(rows)}
        self._share_prompts([row for row in rows if self.backend.cached_lengths[row_ids[row]] == 0], row_ids)
        joining = [row for row in rows if self.backend.cached_lengths[row_ids[row]] == 0]
        running = [row for row in rows if self.backend.cached_lengths[row_ids[row]] > 0]
        new: dict[Row, StepOutcome] = {}
        drafted, draft_s = 0, 0.0
        for group in _by_length(joining) + ([running] if running else []):
            outcomes = speculative_step(self.backend, [row_ids[row] for row in group], group, k_cap)
            new.update(zip(group, outcomes, strict=True))
            drafted += sum(outcome.nodes for outcome in outcomes)
            draft_s += sum(outcome.draft_s for outcome in outcomes)
        if drafted:
            self._draft_s_per_token += 0.5 * (draft_s / drafted - self._draft_s_per_token)
        else:
            self._draft_s_per_token *= DRAFT_COST_RELAX
        self.reports.append(StepReport(len(rows), k_cap, time.perf_counter() - start))

        updates: list[Update[S]] = []
        for completion, row in list(self.rows.items()):
            outcome = new[row]
            reported = row.config.logprobs
            logprobs = None if reported is None else token_logprobs(outcome.logits, outcome.new_tokens, reported)
            text = completion.take(outcome.new_tokens.tolist(), logprobs)
            limit = row.stats.new_tokens >= row.config.max_new_tokens or row.length >= self.backend.max_context
            done = completion.ended or limit
            if done:
                text += completion.close()
                self.leave(completion)
            updates.append(Update(completion, text, done))
        return updates

    @torch.inference_mode()
    def _share_prompts(self, joining: list[Row], row_ids: dict[Row, int]) -> None:
        """Joining rows with one prompt (n answers to one request) read it once: the first's cache takes the prompt
        but its last token in one forward, the others' copy it, and each then reads that token with its drafts. Not
        rows whose drafter reads the target's hidden states (each would miss its prompt's)."""
        if not self.backend.capabilities.copies_rows:
            return
        same: dict[tuple[int, ...], list[Row]] = {}
        for row in joining:
            if row.length > 1 and not row.drafter.capabilities.features:
                same.setdefault(tuple(row.tokens.tolist()), []).append(row)
        sharing = {rows[0]: rows for rows in same.values() if len(rows) > 1}
        for firsts in _by_length(list(sharing)):  # the prompts read as joining rows' are: grouped by length
            start = time.perf_counter()
            self.backend.forward_argmax([row_ids[row] for row in firsts], [row.tokens[:-1] for row in firsts], 1)
            seconds = time.perf_counter() - start
            for first in firsts:
                self.backend.copy_row(row_ids[first], [row_ids[row] for row in sharing[first][1:]])
                for row in sharing[first]:  # the prompt's reading counts in each row's prefill
                    row.stats.prefill_s += seconds

    def _cap_for(self, rows: list[Row]) -> int | None:
        if self.k_cap is None:
            return None
        max_k = max(row.config.k for row in rows)
        return self.k_cap.choose([row.acceptance.value for row in rows], self._draft_s_per_token, max_k)


def _by_length(rows: list[Row]) -> list[list[Row]]:
    """Joining rows in groups of similar prompt length, so that reading prompts together pads little."""
    groups: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: r.length):
        if groups and row.length - groups[-1][0].length <= max(8, groups[-1][0].length // 4):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups
