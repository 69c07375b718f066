"""The verifier alone: greedy acceptance, and the exactness of rejection sampling in distribution."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from specdec.config import SamplingConfig
from specdec.seeds import ACCEPT, DRAFT, SAMPLE, Seeds, keyed_uniform
from specdec.verification import Uniforms, rejection, to_probs, verify, verify_tree_sampled
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


def test_deterministic_drafts_yield_the_targets_own_draws() -> None:
    """Given the uniforms, a deterministic chain or tree yields exactly the tokens the target draws alone with them,
    whatever was drafted (right, wrong, or nothing): only how many come per step changes."""
    sampling = SamplingConfig(temperature=0.8)
    logits = 2 * torch.randn(1, 5, 6, generator=torch.Generator().manual_seed(0))
    rng = torch.Generator().manual_seed(1)
    for _ in range(50):
        uniforms = Uniforms.drawn((1, 5), (1, 4), torch.device("cpu"), rng)
        own = draw(to_probs(logits, sampling), uniform=uniforms.sample)[0].tolist()  # the target's draw per position
        wrong = [(t + 1) % 6 for t in own]
        for drafts in (own[:4], wrong[:4], own[:2] + wrong[2:4], own[:3] + wrong[3:4]):
            verdict = verify(torch.tensor([drafts]), torch.tensor([4]), logits, None, sampling, uniforms=uniforms)
            n = int(verdict.accepted)
            assert drafts[:n] + verdict.next_token.tolist() == own[: n + 1]
            assert n == next((i for i in range(4) if drafts[i] != own[i]), 4)
        # a tree: level l is judged with sample[l]. The root's children: a wrong token and the target's draw; the
        # latter's child: the target's next draw. Column j + 1 of the logits scores node j's children.
        tree, parents = torch.tensor([wrong[0], own[0], own[1]]), torch.tensor([-1, -1, 1])
        tree_uniforms = Uniforms(uniforms.sample[0, :4], uniforms.accept[0, :3])
        tree_logits = logits[0, [0, 4, 1, 2]]  # node 0's children (it has none) scored by anything
        verdict = verify_tree_sampled(tree, parents, tree_logits, None, sampling, uniforms=tree_uniforms)
        assert verdict.paths == [[1, 2]] and verdict.next_token.tolist() == own[2:3]


def test_keyed_uniforms_are_uniform_independent_and_a_function_of_their_key() -> None:
    """The numbers every seeded draw reads (seeds.py): uniform over seeds, independent across what they decide and
    across positions, and the same whenever asked."""
    seeds = range(20_000)
    sample = torch.tensor([keyed_uniform(s, SAMPLE, 100) for s in seeds], dtype=torch.float64)
    accept = torch.tensor([keyed_uniform(s, ACCEPT, 100) for s in seeds], dtype=torch.float64)
    later = torch.tensor([keyed_uniform(s, SAMPLE, 101) for s in seeds], dtype=torch.float64)
    for values in (sample, accept, later):
        assert ((values >= 0) & (values < 1)).all()
        assert chisquare(torch.histc(values, bins=20, min=0, max=1).numpy()).pvalue > ALPHA
    for a, b in ((sample, accept), (sample, later)):  # the joint of two keys: uniform over a 10 x 10 grid
        cells = torch.bincount((a * 10).long() * 10 + (b * 10).long(), minlength=100)
        assert chisquare(cells.numpy()).pvalue > ALPHA
    assert keyed_uniform(7, DRAFT, 3, 1) == keyed_uniform(7, DRAFT, 3, 1) != keyed_uniform(7, DRAFT, 3, 0)
    on_host = Seeds(7).uniforms("cpu", [(SAMPLE, 100, 0), (ACCEPT, 100, 0)])
    assert on_host.dtype == torch.float64 and on_host.tolist() == [keyed_uniform(7, SAMPLE, 100), accept[7].item()]
