"""The speculative decoding loop: draft, verify in one target forward, keep the accepted prefix."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from specdec.config import GenerationConfig
from specdec.drafters.base import Drafter, Proposal
from specdec.models.backend import Backend
from specdec.quality.guards import Guards
from specdec.scheduling import KPolicy, StepOutcome
from specdec.verification import typical_verify, verify
from specdec.verification.seeds import Seeds, generator_on


@dataclass
class DecodeStats:
    """Counters of one generation; derived rates are properties."""

    new_tokens: int = 0
    steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    prefill_s: float = 0.0  # the first target forward, which also reads the prompt
    draft_s: float = 0.0
    verify_s: float = 0.0  # target forwards and verification after the first step
    wall_s: float = 0.0
    ttft_s: float = 0.0
    accepted_per_step: list[int] = field(default_factory=list)
    proposed_per_step: list[int] = field(default_factory=list)  # draft tokens the target judged at each step
    k_per_step: list[int] = field(default_factory=list)  # the k chosen by the policy (before length limits)
    draft_s_per_step: list[float] = field(default_factory=list)  # the drafter's latency at each step that drafted
    anchors: int = 0  # target-only anchor steps taken by the guards
    guard_s: float = 0.0  # time spent applying guards to drafts and logits
    events: list[dict[str, object]] = field(default_factory=list)  # guard events: loop blocks, drift, anchors
    lossy: bool = False  # typical acceptance was on: the output is not the target's own

    @property
    def target_forwards(self) -> int:
        return self.steps  # one target forward per step; the first also reads the prompt

    @property
    def acceptance_rate(self) -> float:
        return self.draft_tokens_accepted / self.draft_tokens_proposed if self.draft_tokens_proposed else 0.0

    @property
    def mean_accepted_per_step(self) -> float:
        return self.draft_tokens_accepted / self.steps if self.steps else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.new_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s else 0.0

    def record_step(
        self, chosen: int, k: int, proposed: int, accepted: int, produced: int, draft_s: float, target_s: float, wall_s: float
    ) -> None:
        """Count one step: the policy chose ``chosen``, the drafter was asked for ``k`` and gave ``proposed``; the first step's target time is the prefill."""
        self.steps += 1
        self.draft_tokens_proposed += proposed
        self.draft_tokens_accepted += accepted
        self.accepted_per_step.append(accepted)
        self.proposed_per_step.append(proposed)
        self.k_per_step.append(chosen)
        if k:
            self.draft_s_per_step.append(draft_s)
        self.new_tokens += produced
        self.draft_s += draft_s
        self.wall_s = wall_s
        if self.steps == 1:
            self.ttft_s = wall_s
            self.prefill_s = target_s
        else:
            self.verify_s += target_s

    def keep_emitted(self, emitted: int) -> None:
        """Only the first ``emitted`` tokens of the last step were emitted (EOS or a stop string cut the rest): count only those.

        A cut inside the accepted drafts leaves ``emitted`` drafts proposed and
        accepted at that step (the drafts after them decided nothing that was emitted).
        """
        if not self.accepted_per_step:
            return
        produced = self.accepted_per_step[-1] + 1
        if emitted >= produced:
            return
        self.new_tokens -= produced - emitted
        accepted, proposed = self.accepted_per_step[-1], self.proposed_per_step[-1]
        if emitted < accepted:
            self.draft_tokens_accepted -= accepted - emitted
            self.draft_tokens_proposed -= proposed - emitted
            self.accepted_per_step[-1] = self.proposed_per_step[-1] = emitted

    def as_dict(self) -> dict[str, float | int | list[int]]:
        keys = (
            "new_tokens steps target_forwards draft_tokens_proposed draft_tokens_accepted acceptance_rate "
            "mean_accepted_per_step tokens_per_step tokens_per_s wall_s ttft_s prefill_s draft_s verify_s anchors guard_s lossy"
        ).split()
        return {key: getattr(self, key) for key in keys} | {
            "accepted_per_step": list(self.accepted_per_step),
            "proposed_per_step": list(self.proposed_per_step),
            "k_per_step": list(self.k_per_step),
            "draft_s_per_step": list(self.draft_s_per_step),
            "events": list(self.events),
        }


def speculative_decode(
    target: Backend,
    drafter: Drafter,
    policy: KPolicy,
    prompt: torch.Tensor,
    config: GenerationConfig,
    stats: DecodeStats,
    seeds: Seeds | None = None,
    guards: Guards | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the tokens [n] accepted at each step for a single sequence ``prompt`` [1, T] (on the host).

    Each step feeds the target every token its cache lacks (the whole prompt at
    the first step, afterwards only the pending token, the last one produced)
    followed by the k draft tokens (k chosen by ``policy``), in ONE forward pass. Invariant between
    steps: the target's cache holds every token but the pending one, and the
    drafter has been told how many of its tokens survived. The caller stops
    iteration early for EOS or stop strings; the loop itself stops at
    max_new_tokens or the model's context length (prompt plus output never exceed it).

    The context stays on the host; drafts cross to the device of the target's
    logits for verification, which draws with that device's generator from ``seeds``.

    ``guards`` adjust the target's logits at every verified position as they
    would at each target-only step, and may make a step target-only (an anchor:
    the drafter then restarts from the whole context).
    """
    start = time.perf_counter()
    stats.lossy = config.typical_acceptance is not None
    target.reset()
    drafter.begin(prompt)
    tokens = prompt
    while stats.new_tokens < config.max_new_tokens and tokens.shape[1] < target.max_context:
        chosen = policy.choose(tokens.shape[1])
        # Every step yields accepted drafts plus one target token: never draft past either limit.
        k = min(chosen, config.max_new_tokens - stats.new_tokens - 1, target.max_context - tokens.shape[1] - 1)
        anchor = guards is not None and guards.anchor_due(stats.new_tokens)
        context = tokens[0].tolist() if guards is not None else []  # the guards read the context as a list, once per step
        drafting = k > 0 and not anchor
        t0 = time.perf_counter()
        if drafting:
            proposal = drafter.propose(tokens, k, config.sampling, seeds, min_confidence=policy.min_confidence)
            if guards is not None and proposal.probs is None:
                g0 = time.perf_counter()
                proposal = proposal.cut(guards.trim(context, proposal.tokens[0].tolist()))
                stats.guard_s += time.perf_counter() - g0
        else:
            proposal = Proposal.empty(1)
        t1 = time.perf_counter()
        drafts = proposal.tokens.to(tokens.device)
        n_draft = drafts.shape[1]
        logits = target.forward(torch.cat([tokens[:, target.cached_length :], drafts], dim=1), last=n_draft + 1)
        blocked: list[int] = []
        if guards is not None:
            g0 = time.perf_counter()
            guarded, blocked = guards.adjust(context, drafts[0].tolist(), logits[0])
            logits = guarded[None]
            stats.guard_s += time.perf_counter() - g0
        judged = proposal.to(logits.device)
        generator = generator_on(seeds, logits.device)
        if config.typical_acceptance is not None:
            verdict = typical_verify(judged.tokens, judged.lengths, logits, config.sampling, config.typical_acceptance, generator)
        else:
            verdict = verify(judged.tokens, judged.lengths, logits, judged.probs, config.sampling, generator)
        accepted_host, next_host = verdict.on_host()
        accepted = int(accepted_host[0])
        target.truncate(tokens.shape[1] + accepted)
        if drafting:  # a step without drafts leaves the drafter's state as it was
            drafter.accepted(accepted_host)
        proposed = int(proposal.lengths[0])
        new = torch.cat([drafts[0, :accepted], next_host])
        tokens = torch.cat([tokens, new[None]], dim=1)
        policy.observe(StepOutcome(proposed, accepted, t1 - t0, tokens.shape[1], logits[0, : accepted + 1], new))
        t2 = time.perf_counter()

        stats.record_step(chosen, k, proposed, accepted, new.shape[0], t1 - t0, t2 - t1, t2 - start)
        at = stats.new_tokens - new.shape[0]  # output index of this step's first token
        stats.events += [{"kind": "loop_blocked", "at": at + i} for i in blocked if i <= accepted]
        if anchor:
            stats.anchors += 1
            stats.events.append({"kind": "anchor", "at": at})
            drafter.begin(tokens)  # resynchronise the drafter on the whole context
        yield new
