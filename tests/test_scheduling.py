"""k policies: pricing, convergence to the best fixed k, adaptation, bounds, losslessness, the cost cache."""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from argparse import Namespace

import pytest
import torch
from conftest import loaded, perturbed, step_outcome, tiny_llama

from specdec import Generator
from specdec.config import K_POLICIES, GenerationConfig
from specdec.drafters import DraftSettings, ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.engine import costs as cost_module
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.scheduling import (
    BatchCostCurve,
    ConfidenceK,
    CostCurve,
    CostModelK,
    HeuristicK,
    KPolicy,
    PerplexityK,
    StepOutcome,
    build_k_policy,
)

# Measured on the development machine (seconds per target forward over n tokens, Gemma-3-270M).
LLAMA_CPP = CostCurve({1: 0.013, 2: 0.025, 3: 0.030, 5: 0.051, 9: 0.069, 13: 0.083, 17: 0.095})
BF16 = CostCurve({1: 0.059, 2: 0.061, 3: 0.056, 5: 0.074, 9: 0.073, 13: 0.077, 17: 0.072})


def expected_rate(a: float, k: int, costs: CostCurve) -> float:
    return (1 - a ** (k + 1)) / (1 - a) / costs(k + 1)


def outcome(proposed: int, accepted: int, context_length: int = 100, nll: float = 1.0) -> StepOutcome:
    """A step's outcome whose new tokens each have negative log-likelihood ``nll`` under a 2-token target."""
    p = math.exp(-nll)
    logits = torch.tensor([[math.log(p), math.log1p(-p) if p < 1 else -50.0]]).repeat(accepted + 1, 1)
    return step_outcome(proposed, accepted, context_length=context_length, logits=logits)


def k_at(policy: KPolicy, context_length: int) -> int:
    """The k a chain row's policy plans at this context length."""
    return policy.plan(context_length, trees=False).k


def simulate(policy, accept_rate, steps: int, rng: random.Random, costs: CostCurve) -> tuple[list[int], float, float]:
    """Run ``policy`` against a drafter whose every token is accepted with probability accept_rate(step)."""
    chosen, tokens, seconds = [], 0, 0.0
    for step in range(steps):
        k = k_at(policy, 100 + tokens)
        accepted = 0
        while accepted < k and rng.random() < accept_rate(step):
            accepted += 1
        policy.observe(outcome(k, accepted))
        chosen.append(k)
        tokens += accepted + 1
        seconds += costs(k + 1)
    return chosen, tokens, seconds


def test_cost_curve_interpolates_and_extrapolates() -> None:
    curve = CostCurve({1: 1.0, 3: 2.0, 5: 4.0})
    assert curve(1) == 1.0 and curve(2) == 1.5 and curve(4) == 3.0
    assert curve(7) == 6.0  # the last segment's slope, extended
    with pytest.raises(ValueError):
        CostCurve({2: 1.0})


@pytest.mark.parametrize("costs", [LLAMA_CPP, BF16], ids=["llama.cpp", "bfloat16"])
@pytest.mark.parametrize("a", [0.3, 0.6, 0.8, 0.95])
def test_cost_model_converges_to_the_best_fixed_k(costs: CostCurve, a: float) -> None:
    max_k = 16
    best_k = max(range(max_k + 1), key=lambda k: expected_rate(a, k, costs))
    best_rate = expected_rate(a, best_k, costs)
    policy = CostModelK(max_k, costs)
    _, tokens, seconds = simulate(policy, lambda _: a, 4000, random.Random(0), costs)
    assert tokens / seconds >= 0.92 * best_rate, f"best fixed k={best_k}"
    assert all(0 <= k <= max_k for k in policy_choices(policy, a, costs))


def policy_choices(policy: CostModelK, a: float, costs: CostCurve) -> list[int]:
    chosen, _, _ = simulate(policy, lambda _: a, 200, random.Random(1), costs)
    return chosen


def test_cost_model_adapts_between_easy_and_hard_stretches() -> None:
    policy = CostModelK(8, LLAMA_CPP)
    stretch = 100
    chosen, _, _ = simulate(
        policy, lambda step: 0.97 if (step // stretch) % 2 == 0 else 0.1, 4 * stretch, random.Random(2), LLAMA_CPP
    )
    easy = chosen[stretch // 2 : stretch] + chosen[2 * stretch + stretch // 2 : 3 * stretch]
    hard = chosen[stretch + stretch // 2 : 2 * stretch] + chosen[3 * stretch + stretch // 2 :]
    assert sum(easy) / len(easy) >= 4  # long drafts where nearly every token is accepted
    assert sum(k == 0 for k in hard) / len(hard) >= 0.8  # mostly plain steps where drafts fail
    assert any(k > 0 for k in hard)  # ... but it keeps probing


def test_unknown_policy_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="cost-model"):
        build_k_policy("sometimes", 4, lambda: LLAMA_CPP)
    with pytest.raises(ConfigError, match="k policy"):
        Generator(loaded(tiny_llama(0)), NoDrafter()).generate([1, 2], k_policy="sometimes")


@pytest.mark.parametrize("policy", K_POLICIES)
def test_every_policy_is_lossless_and_within_bounds(policy: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    target = loaded(tiny_llama(0))
    drafted = 0
    for prompt in ([1, 5, 9, 5, 9, 5, 9, 12], list(range(3, 40))):
        expected = Generator(target, NoDrafter()).generate(prompt, max_new_tokens=40, stop_on_eos=False).token_ids
        for drafter in (PromptLookupDrafter(), ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.5)))):
            got = Generator(target, drafter).generate(
                prompt, max_new_tokens=40, k=6, k_policy=policy, stop_on_eos=False
            )
            assert got.token_ids == expected, drafter
            assert len(got.stats.k_per_step) == got.stats.steps
            assert all(0 <= k <= 6 for k in got.stats.k_per_step)
            drafted += got.stats.draft_tokens_proposed
    assert drafted > 0


def test_heuristic_schedule() -> None:
    policy = HeuristicK(max_k=8, k=4)
    policy.observe(outcome(4, 4))
    assert k_at(policy, 50) == 6  # all accepted: +2
    policy.observe(outcome(6, 6))
    assert k_at(policy, 50) == 8  # capped at the maximum
    policy.observe(outcome(8, 3))
    assert k_at(policy, 50) == 7  # a rejection: -1
    policy.observe(outcome(0, 0))
    assert k_at(policy, 50) == 7  # nothing drafted: no information
    for _ in range(10):
        policy.observe(outcome(3, 0))
    assert k_at(policy, 50) == 1  # never below 1


def test_perplexity_rule_follows_the_seed() -> None:
    policy = PerplexityK(max_k=16)
    assert k_at(policy, 100) == 5  # nothing generated yet counts as hard: max(2, 512 // 100)
    assert k_at(policy, 40) == 12 and k_at(policy, 1000) == 2
    policy.observe(outcome(2, 2, nll=math.log(10)))  # perplexity 10: easy
    assert policy.perplexity == pytest.approx(10, rel=1e-3)
    assert k_at(policy, 100) == 5 and k_at(policy, 30) == 3 and k_at(policy, 8) == 0  # min(5, len // 10)
    for _ in range(40):
        policy.observe(outcome(0, 0, nll=math.log(200)))  # the window forgets the easy stretch
    assert k_at(policy, 64) == 8  # hard again: max(2, 512 // 64)
    assert k_at(PerplexityK(max_k=3), 20) == 3  # capped


def test_confidence_policy_stops_unsure_drafts() -> None:
    target = loaded(tiny_llama(0))
    drafter = ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.5)))
    sure = Generator(target, drafter).generate(
        [1, 5, 9], max_new_tokens=20, k=6, k_policy="confidence", stop_on_eos=False
    )
    always = Generator(target, drafter).generate([1, 5, 9], max_new_tokens=20, k=6, k_policy="fixed", stop_on_eos=False)
    assert sure.token_ids == always.token_ids
    assert sure.stats.draft_tokens_proposed < always.stats.draft_tokens_proposed
    drafter.begin(DraftSettings(min_confidence=1.01))
    assert len(drafter.propose(torch.tensor([1, 5, 9]), 4)) == 0
    assert ConfidenceK(6, threshold=0.9).min_confidence == 0.9


def test_machine_cost_curve_is_measured_once(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    # one repeat of a tiny model's forwards is mostly jitter: the plausibility checks are tested apart
    monkeypatch.setattr(cost_module, "NOISE", 0.0)
    monkeypatch.setattr(cost_module, "MOST_OTHER_LOAD", 1.0)
    calls = []
    real = cost_module.forward_cost_curve
    monkeypatch.setattr(
        cost_module, "forward_cost_curve", lambda backend: calls.append(1) or real(backend, sizes=(1, 2, 3), repeats=1)
    )
    backend = TransformersBackend(tiny_llama(0))
    first = cost_module.machine_cost_curve(backend)
    second = cost_module.machine_cost_curve(backend)
    assert calls == [1] and first == second and first(1) > 0
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1
    other = TransformersBackend(tiny_llama(0, layers=3))  # other weights: measured separately
    cost_module.machine_cost_curve(other)
    assert calls == [1, 1]


def test_costs_measured_under_load_or_falling_are_used_but_not_cached(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A curve that falls as the work grows, or one taken while other processes held the CPU, is measured again; if
    every attempt is suspect the process uses the last one and the cache stays empty, so the next process measures."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    monkeypatch.setattr(cost_module, "_cpu_times", lambda: None)  # no load seen: the curves' shape decides
    curves = iter([{"1": 0.02, "2": 0.01}, {"1": 0.02, "2": 0.012}])  # two tokens cheaper than one: twice
    measured = cost_module._cached("falling", lambda: next(curves), cost_module._falling_cost)
    assert measured == {"1": 0.02, "2": 0.012} and not (tmp_path / "costs").exists()
    assert "not cached" in caplog.text and "2 measured cheaper than 1" in caplog.text

    # /proc/stat's total and busy ticks, then this process's: others took 60 of 100 ticks, then 5 of 100
    ticks = iter([(0, 0, 0), (100, 70, 10), (100, 70, 10), (200, 80, 15)])
    monkeypatch.setattr(cost_module, "_cpu_times", lambda: next(ticks))
    calls = []
    measured = cost_module._cached("loaded", lambda: calls.append(1) or {"1": 0.02}, cost_module._falling_cost)
    assert calls == [1, 1] and measured == {"1": 0.02}
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # the second attempt, on a quiet machine, is kept

    steady = {1: {1: 0.01, 2: 0.011}, 2: {1: 0.018, 2: 0.02}}
    falling = {1: {1: 0.01, 2: 0.011}, 2: {1: 0.008, 2: 0.02}}  # two rows of one token cheaper than one row
    monkeypatch.setattr(cost_module, "_cpu_times", lambda: None)
    for table, kept in ((falling, 1), (steady, 2)):
        monkeypatch.setattr(
            cost_module,
            "batch_cost_curve",
            lambda backend, rows, t=table: BatchCostCurve({r: CostCurve(c) for r, c in t.items()}),
        )
        rows = Namespace(identity=f"rows {kept}")
        assert cost_module.machine_batch_cost_curve(rows).by_rows[2](1) == table[2][1]  # type: ignore[arg-type]
        assert len(list((tmp_path / "costs").glob("*.json"))) == kept


def test_other_processes_load_is_seen(tmp_path) -> None:
    """A process spinning on every core while a measurement runs makes it suspect."""
    others = cost_module.OtherLoad()
    spinners = [
        subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 1\nwhile time.time() < end: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    for spinner in spinners:
        spinner.wait()
    assert "other processes used" in (others.problem() or "")


def test_a_stretch_of_load_does_not_make_small_forwards_look_dear(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sizes take turns, one forward each per round: load during the first five timed forwards slows two rounds of
    one-token forwards, not all of them, and the medians ignore it (measured one size after another, n = 1 read 1 s)."""
    now, calls = [0.0], [0]

    class Timed:
        vocab_size = 10

        def reset(self) -> None:
            pass

        def truncate(self, n: int) -> None:
            pass

        def forward(self, tokens: torch.Tensor, last: int) -> None:
            calls[0] += 1
            now[0] += 0.010 * tokens.shape[1] + (1.0 if 2 < calls[0] <= 7 else 0.0)  # after the two warm-up forwards

    monkeypatch.setattr(cost_module, "_clock", lambda: now[0])
    curve = cost_module.forward_cost_curve(Timed(), sizes=(1, 2, 9), repeats=5)  # type: ignore[arg-type]
    assert curve == pytest.approx({1: 0.010, 2: 0.020, 9: 0.090})


def test_tree_overhead_is_a_trees_time_over_a_chains_as_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chain and tree forwards of each size take turns on one row; the curve is their difference, 0 at n = 1."""
    now = [0.0]

    class Rows:
        vocab_size, cached_lengths = 10, [0]

        def add_rows(self, count: int) -> None:
            pass

        def remove_rows(self, rows: list[int]) -> None:
            self.cached_lengths = []

        def truncate(self, row: int, length: int) -> None:
            pass

        def forward(
            self, rows: list[int], feeds: list[torch.Tensor], last: int, trees: list[torch.Tensor | None] | None = None
        ) -> None:
            tree = trees[0] if trees else None
            assert tree is None or (len(tree) == len(feeds[0]) - 1 and (tree[:2] == -1).all() and (tree[2:] >= 0).all())
            now[0] += 0.010 * len(feeds[0]) + (0.002 * len(tree) if tree is not None else 0.0)

    monkeypatch.setattr(cost_module, "_clock", lambda: now[0])
    rows = Rows()
    curve = cost_module.tree_overhead_curve(rows, sizes=(3, 9), context=8, repeats=3)  # type: ignore[arg-type]
    assert curve == pytest.approx({1: 0.0, 3: 0.004, 9: 0.016}) and rows.cached_lengths == []


def test_generator_measures_tree_overhead_once_for_sequences_that_branch(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real (tiny) model, on the batched cache trees decode in: measured once, cached, and priced into the policies
    of sequences that may draft trees only."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calls = []
    real = cost_module.tree_overhead_curve
    quick = lambda rows: calls.append(rows) or real(rows, sizes=(3, 5), context=8, repeats=1)  # noqa: E731
    monkeypatch.setattr(cost_module, "tree_overhead_curve", quick)
    gen = Generator(loaded(tiny_llama(0)), "prompt-lookup")
    policy = gen.k_policy(GenerationConfig(k=4, k_policy="cost-model", branches=3))
    assert len(calls) == 1 and calls[0].cached_lengths == []  # measured in a row of its own, freed afterwards
    curve = gen.tree_overhead()
    assert len(calls) == 1 and set(curve.seconds) == {1, 3, 5} and min(curve.seconds.values()) >= 0
    assert (
        isinstance(policy, CostModelK)
        and policy._tree_verify_s[2:] == [c + curve(k + 1) for k, c in enumerate(policy._verify_s)][2:]
    )
    chains = gen.k_policy(GenerationConfig(k=4, k_policy="cost-model"))
    assert chains._tree_verify_s == chains._verify_s  # type: ignore[union-attr]
