"""The batched speculative step: every active sequence drafts, one target forward verifies them all.

Each row keeps what the single-sequence loop keeps (its tokens, its drafter,
its k policy, its random generators, its stats) and the same invariant between
steps: the target's cache holds every token of the row but the pending one.
A step drafts for every row (each row's k is its own policy's choice, capped
by the batch's window), feeds each row its pending token and drafts in one
forward of the batched backend, verifies (greedy rows in one vectorised call;
sampled rows with their own generators, on the device of the logits), and rolls each row's cache back to
its own accepted prefix. Rows join and leave between steps; joining rows'
prompts are read in forwards of their own, grouped by similar length, so that
no row is padded much.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from specdec.config import GenerationConfig
from specdec.drafters.base import Drafter, Proposal
from specdec.engine.loop import DecodeStats
from specdec.errors import SpecDecError
from specdec.models.batched import BatchedTransformersBackend
from specdec.scheduling import AcceptanceEstimate, KPolicy, LoadWindow, StepOutcome
from specdec.verification import verify
from specdec.verification.seeds import Seeds


@dataclass(eq=False)
class Row:
    """One sequence of the batch."""

    tokens: torch.Tensor  # [1, T]: prompt and every token accepted so far
    config: GenerationConfig
    drafter: Drafter
    policy: KPolicy
    seeds: Seeds
    stats: DecodeStats = field(default_factory=DecodeStats)
    acceptance: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    id: int = field(default_factory=itertools.count().__next__)
    started: float = field(default_factory=time.perf_counter)

    @property
    def length(self) -> int:
        return self.tokens.shape[1]


@dataclass
class StepReport:
    """What one batched step did, for schedulers and benchmarks."""

    rows: int
    window: int | None  # the cap on k, None when no window is used
    seconds: float


def _by_length(rows: list[Row]) -> list[list[Row]]:
    """Joining rows in groups of similar prompt length, so that reading prompts together pads little."""
    groups: list[list[Row]] = []
    for row in sorted(rows, key=lambda r: r.length):
        if groups and row.length - groups[-1][0].length <= max(8, groups[-1][0].length // 4):
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


class BatchDecoder:
    """Advances many sequences together on one batched backend.

    ``window`` (optional) caps every row's k each step from the load; without
    it each row drafts what its own policy chooses (a fixed window when the
    policies are fixed).
    """

    def __init__(self, backend: BatchedTransformersBackend, window: LoadWindow | None = None) -> None:
        self.backend = backend
        self.window = window
        self.rows: list[Row] = []
        self.failed: dict[Row, SpecDecError] = {}  # rows whose request turned out invalid while drafting; the caller removes them
        self._draft_s_per_token = 0.0
        self.reports: list[StepReport] = []

    def join(self, row: Row) -> None:
        """Add a sequence; its prompt is read at the next step."""
        if row.length >= self.backend.max_context:
            raise ValueError(f"a prompt of {row.length} tokens does not fit the context of {self.backend.max_context}")
        self.backend.add_rows(1)
        row.drafter.begin(row.tokens)
        self.rows.append(row)

    def leave(self, row: Row) -> None:
        """Remove a sequence and free its cache."""
        index = self.rows.index(row)
        self.backend.remove_rows([index])
        del self.rows[index]
        self.failed.pop(row, None)

    def exhausted(self, row: Row) -> bool:
        """The row reached its token budget or the model's context."""
        return row.stats.new_tokens >= row.config.max_new_tokens or row.length >= self.backend.max_context

    def step(self) -> dict[Row, torch.Tensor]:
        """Advance every row that is not exhausted by one speculative step; return the tokens each accepted."""
        start = time.perf_counter()
        active = [row for row in self.rows if not self.exhausted(row) and row not in self.failed]
        if not active:
            return {}
        window = self._window(active)
        new: dict[Row, torch.Tensor] = {}
        cached = {row: self.backend.lengths[i] for i, row in enumerate(self.rows)}
        joining = [row for row in active if cached[row] == 0]
        running = [row for row in active if cached[row] > 0]
        for group in _by_length(joining) + ([running] if running else []):
            new.update(self._advance(group, window))
        self.reports.append(StepReport(len(active), window, time.perf_counter() - start))
        return new

    def _window(self, active: list[Row]) -> int | None:
        if self.window is None:
            return None
        max_k = max(row.config.k for row in active)
        return self.window.choose([row.acceptance.value for row in active], self._draft_s_per_token, max_k)

    def _advance(self, group: list[Row], window: int | None) -> dict[Row, torch.Tensor]:
        t0 = time.perf_counter()
        chosen, asked, proposals = [], [], []
        for row in group:
            k = row.policy.choose(row.length)
            chosen.append(k)
            # Every step yields accepted drafts plus one target token: never draft past either limit.
            k = min(k, window if window is not None else k, row.config.max_new_tokens - row.stats.new_tokens - 1)
            k = min(k, self.backend.max_context - row.length - 1)
            asked.append(k)
            t_row = time.perf_counter()
            try:
                proposal = (
                    row.drafter.propose(row.tokens, k, row.config.sampling, row.seeds, min_confidence=row.policy.min_confidence)
                    if k > 0
                    else Proposal.empty(1)
                )
            except SpecDecError as exc:  # this row's request cannot be drafted (e.g. sampling with a greedy-only drafter)
                self.failed[row] = exc
                proposal = Proposal.empty(1)
            proposals.append((proposal, time.perf_counter() - t_row))
        keep = [i for i, row in enumerate(group) if row not in self.failed]
        if len(keep) < len(group):
            group, chosen, asked, proposals = ([xs[i] for i in keep] for xs in (group, chosen, asked, proposals))
            if not group:
                return {}
        t1 = time.perf_counter()
        drafted = sum(int(p.lengths[0]) for p, _ in proposals)
        if drafted:
            self._draft_s_per_token += 0.5 * ((t1 - t0) / drafted - self._draft_s_per_token)

        position = {row: i for i, row in enumerate(self.rows)}
        indices = [position[row] for row in group]
        lengths = [int(p.lengths[0]) for p, _ in proposals]
        width = max(lengths)
        drafts = [p.tokens[0, :n].cpu() for (p, _), n in zip(proposals, lengths, strict=True)]  # the context lives on the host
        feeds = [torch.cat([row.tokens[0, self.backend.lengths[i] :], d]) for row, i, d in zip(group, indices, drafts, strict=True)]
        logits = self.backend.forward(indices, feeds, last=width + 1)
        # Row i's k_i drafts sit at the end of its feed: shift its logits left so position j judges draft j.
        device = logits.device
        shift = torch.tensor([width - n for n in lengths]).to(device)
        columns = (torch.arange(width + 1, device=device)[None, :] + shift[:, None]).clamp(max=width)
        if any(n < width for n in lengths):
            logits = logits.gather(1, columns[:, :, None].expand(-1, -1, logits.shape[-1]))
        tokens = torch.zeros(len(group), width, dtype=torch.long)
        for i, d in enumerate(drafts):
            tokens[i, : lengths[i]] = d
        verdicts = self._verify(group, tokens.to(device), lengths, logits, [p for p, _ in proposals])
        t2 = time.perf_counter()

        new: dict[Row, torch.Tensor] = {}
        for i, (row, index, (_, draft_s)) in enumerate(zip(group, indices, proposals, strict=True)):
            accepted, next_token = verdicts[i]
            self.backend.truncate(index, row.length + accepted)
            if asked[i] > 0:  # a row that did not draft this step leaves its drafter's state as it was
                row.drafter.accepted(torch.tensor([accepted]))
            tokens_i = torch.cat([drafts[i][:accepted], torch.tensor([next_token])])
            row.tokens = torch.cat([row.tokens, tokens_i[None]], dim=1)
            row.policy.observe(StepOutcome(lengths[i], accepted, draft_s, row.length, logits[i, : accepted + 1], tokens_i))
            row.acceptance.observe(lengths[i], accepted)
            row.stats.record_step(
                chosen[i], asked[i], lengths[i], accepted, tokens_i.shape[0], draft_s, t2 - t1, time.perf_counter() - row.started
            )
            new[row] = tokens_i
        return new

    def _verify(
        self, group: list[Row], tokens: torch.Tensor, lengths: list[int], logits: torch.Tensor, proposals: list[Proposal]
    ) -> list[tuple[int, int]]:
        """Greedy rows in one vectorised call (their verdicts cross to the host together); a sampled row alone, with its own generator (per-request seeds)."""
        out: list[tuple[int, int] | None] = [None] * len(group)
        device = logits.device
        greedy = [i for i, row in enumerate(group) if row.config.sampling.greedy]
        if greedy:
            pick = torch.tensor(greedy).to(device)
            lengths_on_device = torch.tensor([lengths[i] for i in greedy]).to(device)
            verdict = verify(tokens[pick], lengths_on_device, logits[pick], None, group[greedy[0]].config.sampling)
            for i, (accepted, token) in zip(greedy, verdict.on_host().T.tolist(), strict=True):
                out[i] = (accepted, token)
        for i, row in enumerate(group):
            if out[i] is None:
                n = lengths[i]
                judged = proposals[i].to(device)
                verdict = verify(
                    tokens[i : i + 1, :n],
                    judged.lengths,
                    logits[i : i + 1, : n + 1],
                    judged.probs,
                    row.config.sampling,
                    row.seeds.on(device),
                )
                accepted, token = verdict.on_host()[:, 0].tolist()
                out[i] = (accepted, token)
        return out  # type: ignore[return-value]
