"""Sampled output through the whole engine follows the target's law at every draft position, single and batched.

Each run drafts k = 4 tokens for 5 new tokens, so its steps reach resampling
at the first, second and later draft positions and the bonus token after
several accepted drafts (the tests count that they did). The law of a
continuation is the product of the target's conditionals, so the test
compares, position by position, the next token's counts after each observed
prefix with the exact shaped target distribution there (a chi-square summed
over prefixes). Negative controls: the same test must fail with a wrong
verifier (residual from p) and with a drafter that reports its distribution
before top-k/top-p shaping.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

import pytest
import torch
from conftest import loaded, perturbed, tiny_llama
from scipy.stats import chi2

import specdec.verification.rejection as rejection
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.drafters import ModelDrafter
from specdec.drafters.base import Proposal
from specdec.drafters.distilled import ReducedVocabBackend, build_draft
from specdec.engine import DecodeStats
from specdec.models import TransformersBackend
from specdec.training.ngram import NgramCounter
from specdec.verification import to_probs

VOCAB, PROMPT, NEW, K = 8, [1, 5, 3], 5, 4
# Shaping keeps half the vocabulary, so a draft distribution reported before shaping differs enough to be caught.
SAMPLINGS = {"plain": SamplingConfig(temperature=1.0), "shaped": SamplingConfig(temperature=1.0, top_k=4, top_p=0.97)}
MIN_PVALUE = 1e-3


def _target():
    return tiny_llama(3, vocab=VOCAB, scale=0.15)


def _drafter(kind: str, target):
    if kind == "noisy copy":  # agrees often: long accepted runs and bonus tokens
        return ModelDrafter(TransformersBackend(perturbed(target, noise=0.4, seed=1)))
    if kind == "other model":  # agrees rarely: residual resampling at every position
        return ModelDrafter(TransformersBackend(tiny_llama(4, vocab=VOCAB, scale=0.4)))
    if kind == "reduced vocabulary":  # proposes only 5 of the 8 tokens
        draft = build_draft(tiny_llama(4, vocab=VOCAB, scale=0.4), [0], torch.tensor([0, 2, 3, 5, 7]))
        return ModelDrafter(ReducedVocabBackend(draft, VOCAB))
    counter = NgramCounter(order=2, vocab_size=VOCAB, max_entries=10_000)  # counted over random text: a poorly matched table
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        counter.add(torch.randint(0, VOCAB, (40,), generator=rng).tolist())
    from specdec.drafters import NgramDrafter

    return NgramDrafter(counter.table({}))


class Law:
    """The shaped target distribution of the next token after PROMPT + prefix, from full forwards."""

    def __init__(self, model, sampling: SamplingConfig) -> None:
        self.model, self.sampling, self.cache = model, sampling, {}

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self.cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([PROMPT + list(prefix)])).logits[0, -1]
            self.cache[prefix] = to_probs(logits, self.sampling).double()
        return self.cache[prefix]


def sequential_pvalue(samples: list[tuple[int, ...]], law: Law, min_group: int = 25) -> float:
    """p-value of the samples under the target's law: chi-square of each position's next token after each prefix, summed.

    Raises if any token outside the shaped support was produced.
    """
    stat, dof = 0.0, 0
    for j in range(NEW):
        groups: dict[tuple[int, ...], Counter] = defaultdict(Counter)
        for sample in samples:
            groups[sample[:j]][sample[j]] += 1
        for prefix, counter in groups.items():
            p = law(prefix)
            observed = torch.zeros(VOCAB, dtype=torch.float64)
            for token, count in counter.items():
                observed[token] = count
            assert observed[p == 0].sum() == 0, f"a token outside the shaped support after {prefix}"
            n = observed.sum()
            if n < min_group:
                continue
            expected = p * n
            big = expected >= 5
            obs = torch.cat([observed[big], observed[~big].sum()[None]])
            exp = torch.cat([expected[big], expected[~big].sum()[None]])
            keep = exp > 0
            if keep.sum() < 2:
                continue
            stat += float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
            dof += int(keep.sum()) - 1
    assert dof > 50, "too few prefixes were tested"
    return float(chi2.sf(stat, dof))


def exercised(stats: list[DecodeStats]) -> Counter:
    """How many steps ended each way: rejection at the first, second, or a later draft; all of 2+ drafts accepted (bonus token)."""
    cases: Counter = Counter()
    for s in stats:
        for proposed, accepted in zip(s.proposed_per_step, s.accepted_per_step, strict=True):
            if not proposed:
                continue
            if accepted == proposed:
                cases["bonus after all drafts" if proposed < 2 else "bonus after 2+ drafts"] += 1
            else:
                cases[{0: "rejected at 1st", 1: "rejected at 2nd"}.get(accepted, "rejected at 3rd+")] += 1
    return cases


def _config(sampling: SamplingConfig, seed: int) -> GenerationConfig:
    return GenerationConfig(k=K, k_policy="fixed", max_new_tokens=NEW, stop_on_eos=False, sampling=sampling, seed=seed)


def run_single(gen: Generator, sampling: SamplingConfig, n: int) -> tuple[list[tuple[int, ...]], list[DecodeStats]]:
    results = [gen.generate(PROMPT, _config(sampling, seed)) for seed in range(n)]
    return [tuple(r.token_ids) for r in results], [r.stats for r in results]


def run_batched(gen: Generator, sampling: SamplingConfig, n: int, per_batch: int = 250) -> tuple[list[tuple[int, ...]], list[DecodeStats]]:
    """Rows of mixed batches: greedy rows and rows at another temperature decode alongside the sampled ones."""
    others = [
        GenerationConfig(k=3, k_policy="fixed", max_new_tokens=4, stop_on_eos=False),
        GenerationConfig(k=1, k_policy="fixed", max_new_tokens=3, stop_on_eos=False, sampling=SamplingConfig(temperature=1.3)),
    ]
    samples, stats = [], []
    for start in range(0, n, per_batch):
        configs = [_config(sampling, start + i) for i in range(per_batch)] + others
        results = gen.generate_batch([PROMPT] * per_batch + [[1, 2, 6, 6], [1, 4]], configs)[:per_batch]
        samples += [tuple(r.token_ids) for r in results]
        stats += [r.stats for r in results]
    return samples, stats


EVERY_CASE = ("rejected at 1st", "rejected at 2nd", "rejected at 3rd+", "bonus after 2+ drafts")
RUN = {"single": run_single, "batched": run_batched}


def _check(samples, stats, law: Law, cases: tuple[str, ...] = EVERY_CASE) -> float:
    seen = exercised(stats)
    for case in cases:
        assert seen[case] >= len(samples) // 100, f"too few steps ended '{case}': {dict(seen)}"
    return sequential_pvalue(samples, law)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("driver", list(RUN))
def test_sampled_output_follows_the_target_law(driver: str, sampling: str) -> None:
    """A draft that agrees often enough that every case (rejection at each position, bonus after 2+ drafts) occurs."""
    target = _target()
    gen = Generator(loaded(target), _drafter("noisy copy", target))
    samples, stats = RUN[driver](gen, SAMPLINGS[sampling], 3000)
    assert _check(samples, stats, Law(target, SAMPLINGS[sampling])) > MIN_PVALUE


@pytest.mark.parametrize("drafter", ["other model", "reduced vocabulary", "ngram"])
def test_poor_and_partial_drafts_keep_the_target_law(drafter: str) -> None:
    """Drafts that are mostly rejected, that cover part of the vocabulary, or that come from a table, under shaping."""
    target = _target()
    gen = Generator(loaded(target), _drafter(drafter, target))
    samples, stats = run_batched(gen, SAMPLINGS["shaped"], 3000)
    assert _check(samples, stats, Law(target, SAMPLINGS["shaped"]), ("rejected at 1st", "rejected at 2nd")) > MIN_PVALUE


@pytest.mark.parametrize("driver", list(RUN))
def test_a_wrong_residual_fails(monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """Negative control: resampling a rejected position from p instead of norm(max(0, p - q)) must be caught."""
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    target = _target()
    gen = Generator(loaded(target), _drafter("noisy copy", target))
    samples, stats = RUN[driver](gen, SAMPLINGS["plain"], 1500)
    assert _check(samples, stats, Law(target, SAMPLINGS["plain"])) < MIN_PVALUE


class UnshapedReport(ModelDrafter):
    """Samples its drafts from the shaped distribution but reports the one before top-k/top-p (a classic bug)."""

    def propose(self, context, k, sampling, seeds, min_confidence=0.0):
        proposal = super().propose(context, k, sampling, seeds, min_confidence)
        if proposal.probs is None:
            return proposal
        with torch.no_grad():
            logits = self.backend.model(torch.cat([context, proposal.tokens[:, :-1]], dim=1).to(self.backend.device)).logits
        plain = to_probs(logits[:, -proposal.tokens.shape[1] :], replace(sampling, top_k=None, top_p=1.0))
        return Proposal(proposal.tokens, proposal.lengths, plain)


def test_draft_probabilities_reported_before_shaping_fail() -> None:
    """Negative control: the shaped test detects a drafter whose reported q is not the shaped one it sampled from."""
    target = _target()
    gen = Generator(loaded(target), UnshapedReport(TransformersBackend(perturbed(target, noise=0.4, seed=1))))
    samples, stats = run_batched(gen, SAMPLINGS["shaped"], 1500)
    assert _check(samples, stats, Law(target, SAMPLINGS["shaped"])) < MIN_PVALUE
