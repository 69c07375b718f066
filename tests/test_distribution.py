"""Sampled output through the whole engine follows the target's law at every draft position, single and batched.

Each run drafts k = 4 tokens for 5 new tokens, so its steps reach resampling
at the first, second and later draft positions and the bonus token after
several accepted drafts (the tests count that they did); the check itself
(bench/lossless.py) compares each position's next token after each prefix with
the exact target law. Negative controls: the same test must fail with a wrong
verifier (residual from p) and with a drafter that reports its distribution
before top-k/top-p shaping.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import loaded, perturbed, tiny_llama

import specdec.engine.rows as rows_module
import specdec.verification.rejection as rejection
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.lossless import STEP_CASES, TargetLaw, sequential_pvalue, step_cases
from specdec.drafters import ModelDrafter
from specdec.drafters.base import Proposal
from specdec.drafters.distilled import ReducedVocabBackend, build_draft
from specdec.engine import DecodeStats
from specdec.models import TransformersBackend
from specdec.seeds import SAMPLE
from specdec.training.ngram import NgramCounter
from specdec.verification import to_probs

VOCAB, PROMPT, NEW, K = 8, [1, 5, 3], 5, 4
# Shaping keeps half the vocabulary, so a draft distribution reported before shaping differs enough to be caught.
# Its temperature differs from 1, so a temperature applied to q differently than to p would be caught too.
SAMPLINGS = {"plain": SamplingConfig(temperature=1.0), "shaped": SamplingConfig(temperature=0.8, top_k=4, top_p=0.97)}
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
    # counted over random text: a poorly matched table
    counter = NgramCounter(order=2, vocab_size=VOCAB, max_entries=10_000)
    rng = torch.Generator().manual_seed(0)
    for _ in range(50):
        counter.add(torch.randint(0, VOCAB, (40,), generator=rng).tolist())
    from specdec.drafters import NgramDrafter

    return NgramDrafter(counter.table({}))


def _config(sampling: SamplingConfig, seed: int) -> GenerationConfig:
    return GenerationConfig(k=K, k_policy="fixed", max_new_tokens=NEW, stop_on_eos=False, sampling=sampling, seed=seed)


def run_single(gen: Generator, sampling: SamplingConfig, n: int) -> tuple[list[tuple[int, ...]], list[DecodeStats]]:
    results = [gen.generate(PROMPT, _config(sampling, seed)) for seed in range(n)]
    return [tuple(r.token_ids) for r in results], [r.stats for r in results]


def run_batched(
    gen: Generator, sampling: SamplingConfig, n: int, per_batch: int = 250
) -> tuple[list[tuple[int, ...]], list[DecodeStats]]:
    """Rows of mixed batches: greedy rows and rows at another temperature decode alongside the sampled ones."""
    others = [
        GenerationConfig(k=3, k_policy="fixed", max_new_tokens=4, stop_on_eos=False),
        GenerationConfig(
            k=1, k_policy="fixed", max_new_tokens=3, stop_on_eos=False, sampling=SamplingConfig(temperature=1.3)
        ),
    ]
    samples, stats = [], []
    for start in range(0, n, per_batch):
        configs = [_config(sampling, start + i) for i in range(per_batch)] + others
        results = gen.generate_batch([PROMPT] * per_batch + [[1, 2, 6, 6], [1, 4]], configs)[:per_batch]
        samples += [tuple(r.token_ids) for r in results]
        stats += [r.stats for r in results]
    return samples, stats


RUN = {"single": run_single, "batched": run_batched}
# the plain law test and the broken-verifier control run on the batched driver in the slow tier only (the fast tier
# keeps the single driver's, and the batched driver's reduced-vocabulary law test)
DRIVERS = ["single", pytest.param("batched", marks=pytest.mark.slow)]


def _check(samples, stats, law: TargetLaw, cases: tuple[str, ...] = STEP_CASES) -> float:
    seen = step_cases(stats)
    for case in cases:
        assert seen[case] >= len(samples) // 100, f"too few steps ended '{case}': {dict(seen)}"
    pvalue, dof = sequential_pvalue(samples, law)
    assert dof > 50, "too few prefixes were tested"
    return pvalue


@pytest.mark.parametrize("sampling", ["plain", pytest.param("shaped", marks=pytest.mark.slow)])
@pytest.mark.parametrize("driver", DRIVERS)
def test_sampled_output_follows_the_target_law(driver: str, sampling: str) -> None:
    """A draft that agrees often enough that every case (rejection at each position, bonus after 2+ drafts) occurs."""
    target = _target()
    gen = Generator(loaded(target), _drafter("noisy copy", target))
    samples, stats = RUN[driver](gen, SAMPLINGS[sampling], 3000)
    assert _check(samples, stats, TargetLaw(target, PROMPT, SAMPLINGS[sampling])) > MIN_PVALUE


@pytest.mark.parametrize(
    ("drafter", "driver"),
    [
        pytest.param("other model", "batched", marks=pytest.mark.slow),
        ("reduced vocabulary", "batched"),
        pytest.param("ngram", "single", marks=pytest.mark.slow),
    ],
)
def test_poor_and_partial_drafts_keep_the_target_law(drafter: str, driver: str) -> None:
    """Drafts that are mostly rejected, that cover part of the vocabulary, or that come from a table, under shaping."""
    target = _target()
    gen = Generator(loaded(target), _drafter(drafter, target))
    samples, stats = RUN[driver](gen, SAMPLINGS["shaped"], 3000)
    assert (
        _check(samples, stats, TargetLaw(target, PROMPT, SAMPLINGS["shaped"]), ("rejected at 1st", "rejected at 2nd"))
        > MIN_PVALUE
    )


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_wrong_residual_fails(monkeypatch: pytest.MonkeyPatch, driver: str) -> None:
    """Negative control: resampling a rejected position from p instead of norm(max(0, p - q)) must be caught."""
    monkeypatch.setattr(rejection, "residual_distribution", lambda p, q: p)
    target = _target()
    gen = Generator(loaded(target), _drafter("noisy copy", target))
    samples, stats = RUN[driver](gen, SAMPLINGS["plain"], 1500)
    assert _check(samples, stats, TargetLaw(target, PROMPT, SAMPLINGS["plain"])) < MIN_PVALUE


@pytest.mark.slow
def test_one_uniform_for_the_accept_test_and_the_residual_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: a drawn draft's acceptance test keyed like the target's own draw at its position (so a
    rejection's residual is drawn with the very uniform that rejected) must be caught."""
    monkeypatch.setattr(rows_module, "ACCEPT", SAMPLE)
    target = _target()
    gen = Generator(loaded(target), _drafter("other model", target))
    samples, stats = run_single(gen, SAMPLINGS["plain"], 1500)
    assert _check(samples, stats, TargetLaw(target, PROMPT, SAMPLINGS["plain"])) < MIN_PVALUE


class UnshapedReport(ModelDrafter):
    """Samples its drafts from the shaped distribution but reports the one before top-k/top-p (a classic bug)."""

    def propose(self, context, k, branches=1):
        proposal = super().propose(context, k)
        if proposal.probs is None:
            return proposal
        with torch.no_grad():
            logits = self.backend.model(
                torch.cat([context, proposal.tokens[:-1]])[None].to(self.backend.device)
            ).logits[0]
        plain = to_probs(logits[-len(proposal) :], replace(self.settings.sampling, top_k=None, top_p=1.0))
        return Proposal(proposal.tokens, plain)


def test_draft_probabilities_reported_before_shaping_fail() -> None:
    """Negative control: the shaped test detects a drafter whose reported q is not the shaped one it sampled from."""
    target = _target()
    gen = Generator(loaded(target), UnshapedReport(TransformersBackend(perturbed(target, noise=0.4, seed=1))))
    samples, stats = run_batched(gen, SAMPLINGS["shaped"], 1500)
    assert _check(samples, stats, TargetLaw(target, PROMPT, SAMPLINGS["shaped"])) < MIN_PVALUE
