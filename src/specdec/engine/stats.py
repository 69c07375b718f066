"""What one generation did, step by step: the counters every driver and benchmark reads."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdec.scheduling import StepOutcome


@dataclass
class DecodeStats:
    """Counters of one generation; derived rates are properties."""

    new_tokens: int = 0
    steps: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    # the first target forward, which also reads the prompt (and the forward that read it for rows that share one)
    prefill_s: float = 0.0
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

    def record_step(self, outcome: StepOutcome, wall_s: float) -> None:
        """Count one step (``wall_s``: seconds since the generation started); the first step's target time is the
        prefill."""
        self.steps += 1
        self.draft_tokens_proposed += outcome.nodes
        self.draft_tokens_accepted += outcome.accepted
        self.accepted_per_step.append(outcome.accepted)
        self.proposed_per_step.append(outcome.nodes)
        self.k_per_step.append(outcome.chosen)
        if outcome.asked:
            self.draft_s_per_step.append(outcome.draft_s)
        self.new_tokens += len(outcome.new_tokens)
        self.draft_s += outcome.draft_s
        self.anchors += outcome.anchored
        self.wall_s = wall_s
        if self.steps == 1:
            self.ttft_s = wall_s
            self.prefill_s += outcome.target_s
        else:
            self.verify_s += outcome.target_s

    def keep_emitted(self, emitted: int) -> None:
        """Only the first ``emitted`` tokens of the last step were emitted (EOS or a stop string cut the rest): count
        only those.

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
            "mean_accepted_per_step tokens_per_step tokens_per_s wall_s ttft_s prefill_s draft_s verify_s "
            "anchors guard_s lossy"
        ).split()
        return {key: getattr(self, key) for key in keys} | {
            "accepted_per_step": list(self.accepted_per_step),
            "proposed_per_step": list(self.proposed_per_step),
            "k_per_step": list(self.k_per_step),
            "draft_s_per_step": list(self.draft_s_per_step),
            "events": list(self.events),
        }
