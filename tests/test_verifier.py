"""The verifier alone: greedy acceptance, and the exactness of rejection sampling in distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.config import SamplingConfig
from specdec.verification import rejection, verify
from specdec.verification.sampling import draw, greedy

ALPHA = 1e-3  # significance level of every distribution test here


def test_greedy_accepts_longest_matching_prefix() -> None:
    logits = torch.full((3, 4, 5), -1.0)
    argmax = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [4, 4, 4, 4]])
    logits.scatter_(2, argmax[..., None], 5.0)
    drafts = torch.tensor([[0, 1, 2], [0, 3, 2], [1, 4, 4]])
    lengths = torch.tensor([3, 3, 3])
    verdict = verify(drafts, lengths, logits, None, SamplingConfig())
    assert verdict.accepted.tolist() == [3, 1, 0]
    assert verdict.next_token.tolist() == [3, 1, 4]


def test_draft_length_caps_acceptance() -> None:
    logits = torch.zeros(1, 4, 5)
    logits[0, :, 2] = 5.0
    verdict = verify(torch.tensor([[2, 2, 2]]), torch.tensor([1]), logits, None, SamplingConfig())
    assert verdict.accepted.tolist() == [1]
    assert verdict.next_token.tolist() == [2]


def _first_token_samples(p: torch.Tensor, q: torch.Tensor | None, draft: torch.Tensor, seed: int) -> torch.Tensor:
    """The first output token of a one-step verification, for a batch of independent rows."""
    batch, vocab = draft.shape[0], p.shape[-1]
    logits = p.log().expand(batch, 2, vocab)
    probs = None if q is None else q.expand(batch, 1, vocab)
    gen = torch.Generator().manual_seed(seed)
    verdict = verify(
        draft[:, None], torch.ones(batch, dtype=torch.long), logits, probs, SamplingConfig(temperature=1.0), gen
    )
    return torch.where(verdict.accepted > 0, draft, verdict.next_token)


def _pvalue(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=p.shape[0]).double()
    return float(chisquare(counts.numpy(), (p.double() * counts.sum()).numpy()).pvalue)


P = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
Q = torch.tensor([0.05, 0.05, 0.10, 0.20, 0.30, 0.30])  # deliberately poor: mass on the target's unlikely tokens
N = 200_000


def test_rejection_sampling_keeps_target_distribution() -> None:
    gen = torch.Generator().manual_seed(1)
    draft = torch.multinomial(Q, N, replacement=True, generator=gen)
    samples = _first_token_samples(P, Q, draft, seed=2)
    assert _pvalue(samples, P) > ALPHA


def test_deterministic_draft_keeps_target_distribution() -> None:
    # A one-hot drafter (prompt lookup) always proposes token 4, which the target rarely wants.
    draft = torch.full((N,), 4)
    samples = _first_token_samples(P, None, draft, seed=3)
    assert _pvalue(samples, P) > ALPHA


def test_wrong_residual_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: resampling from p instead of norm(max(0, p - q)) must fail the same test."""
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    gen = torch.Generator().manual_seed(1)
    draft = torch.multinomial(Q, N, replacement=True, generator=gen)
    samples = _first_token_samples(P, Q, draft, seed=2)
    assert _pvalue(samples, P) < 1e-6


def test_all_accepted_gives_bonus_from_last_position() -> None:
    logits = torch.zeros(1, 3, 4)
    logits[0, 2] = torch.tensor([-50.0, -50.0, 50.0, -50.0])
    probs = torch.zeros(1, 2, 4)
    probs[0, :, 1] = 1.0
    logits[0, :2, 1] = 50.0  # target agrees with the draft at both positions
    verdict = verify(torch.tensor([[1, 1]]), torch.tensor([2]), logits, probs, SamplingConfig(temperature=1.0))
    assert verdict.accepted.tolist() == [2]
    assert verdict.next_token.tolist() == [2]


def test_inverse_cdf_draws_follow_the_distribution_and_never_a_zero() -> None:
    """The sampler every draw uses (verification/sampling.py): the target's law exactly, zeros never, rows
    independent, seeds repeat."""
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.1, 0.0, 0.0, 0.0, 0.0, 0.9]])
    rng = torch.Generator().manual_seed(0)
    draws = torch.stack([draw(probs, rng) for _ in range(20_000)])  # [N, 2]
    for row in range(2):
        counts = torch.bincount(draws[:, row], minlength=6)
        support = probs[row] > 0
        assert counts[~support].sum() == 0  # a zero-probability token is never drawn
        assert chisquare(counts[support].numpy(), (probs[row, support] * 20_000).numpy()).pvalue > 1e-3
    unnormalised = draw(probs[:1] * 7.0, torch.Generator().manual_seed(5))
    assert torch.equal(unnormalised, draw(probs[:1], torch.Generator().manual_seed(5)))  # any positive total
    assert draw(probs[0], rng).shape == () and draw(probs[None], rng).shape == (1, 2)
    # Gemma's vocabulary size
    big = torch.softmax(3 * torch.randn(262_144, generator=torch.Generator().manual_seed(1)), dim=0)
    top, mass = int(big.argmax()), float(big.max())
    assert mass > 0.02  # a token with visible mass among 262,144: float rounding of the sum must not shift it
    hits = sum(int(draw(big, rng)) == top for _ in range(4000))
    assert abs(hits / 4000 - mass) < 5 * (mass * (1 - mass) / 4000) ** 0.5


def test_the_greedy_choice_is_argmax_ties_and_nan_included() -> None:
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor([[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [2.0, 2.0, 2.0, 2.0], [-inf, -inf, 0.0, 0.0]])
    assert greedy(rows).tolist() == [1, 0, 0, 2] == rows.argmax(dim=-1).tolist()
    wide = torch.randn(2, 5, 262144, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # many ties
    assert torch.equal(greedy(wide), wide.argmax(dim=-1)) and greedy(wide).dtype == torch.long
