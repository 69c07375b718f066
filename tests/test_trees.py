"""Tree drafts: built, scored in one forward, verified exactly.

Greedy: a tree of drafts gives the target-only tokens on every backend that scores trees (native, transformers'
batched cache, single rows and batches). Sampling: the engine's output follows the target's law for deterministic
trees and for trees whose siblings are independent draws, at several shapes, with a negative control.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import loaded, perturbed, step_outcome, tiny_llama
from test_native import models

import specdec.engine.trees as trees_module
import specdec.verification.tree as tree_verifier
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.lossless import TargetLaw, sequential_pvalue
from specdec.config import BatchConfig, GuardConfig, RuntimeConfig, TypicalAcceptance
from specdec.drafters import ModelDrafter
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.drafters.prompt_lookup import PromptLookupDrafter
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.models.backend import tree_mask
from specdec.models.native import kernel_build
from specdec.scheduling import CostCurve, KPolicy
from specdec.scheduling.k_policy import TREE_TRIAL_EVERY, CostModelK, StepOutcome
from specdec.seeds import rng_on
from specdec.verification import Uniforms
from specdec.verification.sampling import draw, greedy
from specdec.verification.shaping import to_probs
from specdec.verification.tree import verify_tree_greedy

PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "abc abd abc abd abc",
    "Hello, world! Hello, there! Hello, world!",
]


def test_a_tree_merges_shared_prefixes_within_its_budget() -> None:
    tree = Proposal.tree([[1, 2, 3], [1, 2, 4], [5, 6]], budget=5)
    assert tree.tokens.tolist() == [1, 2, 3, 4, 5]
    assert tree.parents.tolist() == [-1, 0, 1, 1, -1]
    assert tree.is_tree and not Proposal.tree([[1, 2, 3]], budget=5).is_tree
    assert tree.cut(2).parents.tolist() == [-1, 0]


def test_tree_mask_sees_the_chain_the_ancestors_and_itself() -> None:
    mask = tree_mask(4, torch.tensor([-1, 0, -1]))  # one chain token, then nodes 0 -> 1 and 2
    assert mask.int().tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 1]]
    assert (mask.sum(1) - 1).tolist() == [0, 1, 2, 1]  # positions after the chain's start: depth + 1


def test_greedy_tree_verdicts_for_a_batch() -> None:
    """Row 0 follows its second root child then that child's child; row 1 matches nothing; row 2 has no nodes."""
    vocab = 10
    tokens = torch.tensor([[4, 7, 2, 8], [1, 2, 0, 0], [0, 0, 0, 0]])
    parents = torch.tensor([[-1, -1, 1, 1], [-1, 0, -1, -1], [-1, -1, -1, -1]])
    argmax = torch.tensor([[7, 0, 8, 0, 0], [3, 0, 0, 0, 0], [6, 0, 0, 0, 0]])  # column j + 1 judges node j's children
    logits = torch.nn.functional.one_hot(argmax, vocab).float()
    verdict = verify_tree_greedy(tokens, parents, torch.tensor([4, 2, 0]), greedy(logits))
    assert verdict.per_row() == [([1, 3], 0), ([], 3), ([], 6)]


def test_prompt_lookup_proposes_several_matches_as_a_tree() -> None:
    drafter = PromptLookupDrafter()
    drafter.begin(DraftSettings())
    context = torch.tensor([1, 2, 7, 8, 9, 1, 2, 3, 4, 5, 1, 2])
    proposal = drafter.propose(context, 6, branches=3)
    assert proposal.is_tree
    assert proposal.tokens.tolist() == [3, 4, 5, 1, 2, 7]  # the latest match first, whole, then the earlier one
    assert proposal.parents.tolist() == [-1, 0, 1, 2, 3, -1]
    chain = drafter.propose(context, 6)
    # the chain is the tree's first branch
    assert not chain.is_tree and proposal.tokens[: len(chain)].tolist() == chain.tokens.tolist()
    assert not drafter.propose(context, 4, branches=3).is_tree  # no room left beside it: the chain


FIXED = BatchConfig(k_cap="fixed")
RUNTIMES = ["transformers"] + (["native"] if kernel_build.compiled() is not None else [])


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_trees_give_the_target_only_tokens(monkeypatch: pytest.MonkeyPatch, family: str, runtime: str) -> None:
    """Trees on one row, deeper than the sliding window: prompt lookup's matches (a tree where the likeliest copy leaves
    room for others) and a noisy copy's top tokens (a tree at every step); fewer forwards than the target alone."""
    tokenizer, model = models()[0], models()[1][family]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=RuntimeConfig(backend=runtime))
    noisy = ModelDrafter(TransformersBackend(perturbed(model, noise=0.2, seed=1)))
    for drafter, k in (("prompt-lookup", 16), (noisy, 12)):
        drafted = Generator(target.target, drafter)
        trees = _count_trees(drafted, monkeypatch)
        forwards = {"target only": 0, "trees": 0}
        for prompt in PROMPTS:
            expected = target.generate(prompt, max_new_tokens=40, stop_on_eos=False)
            got = drafted.generate(prompt, max_new_tokens=40, k=k, k_policy="fixed", branches=4, stop_on_eos=False)
            assert got.token_ids == expected.token_ids, (family, runtime, prompt, drafter)
            forwards["target only"] += expected.stats.target_forwards
            forwards["trees"] += got.stats.target_forwards
        assert forwards["trees"] < forwards["target only"], drafter
        assert trees[0] >= 2, drafter


def test_greedy_trees_in_a_batch_give_the_target_only_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with trees of different sizes, chains and plain steps in one batched forward (sliding window 6)."""
    tokenizer, model = models()[0], models()[1]["gemma3"]
    # k as configured, whatever the timings
    gen = Generator(loaded(model, tokenizer=tokenizer), "prompt-lookup", batch=FIXED)
    expected = [gen.generate(p, max_new_tokens=30, k=1, k_policy="fixed", stop_on_eos=False).token_ids for p in PROMPTS]
    configs = [
        GenerationConfig(k=16, k_policy="fixed", branches=4, max_new_tokens=30, stop_on_eos=False),
        GenerationConfig(k=12, k_policy="fixed", branches=2, max_new_tokens=30, stop_on_eos=False),
        GenerationConfig(k=6, k_policy="fixed", max_new_tokens=30, stop_on_eos=False),
    ]
    trees = _count_trees(gen, monkeypatch)
    results = gen.generate_batch(PROMPTS, configs)
    assert [r.token_ids for r in results] == expected
    assert trees[0] > 3


def _count_trees(gen: Generator, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A counter of the tree proposals ``gen``'s drafter (and its forks) make."""
    count = [0]
    drafter_type = type(gen.drafter)
    original = drafter_type.propose

    def counting(self, context, k, branches=1):
        proposal = original(self, context, k, branches)
        count[0] += proposal.is_tree
        return proposal

    monkeypatch.setattr(drafter_type, "propose", counting)
    return count


VOCAB, PROMPT, NEW = 8, [1, 5, 3], 5
SAMPLINGS = {"plain": SamplingConfig(temperature=1.0), "shaped": SamplingConfig(temperature=0.8, top_k=4, top_p=0.97)}
MIN_PVALUE = 1e-3


class ShapedTreeDrafter(Drafter):
    """Trees of a fixed shape from a draft model: a node's children are its top tokens (deterministic) or independent
    draws from its shaped distribution (sampled, the distribution reported for each). Asked for a chain (one branch), a
    chain as deep as the shape; ``chains`` counts those, over all its forks."""

    vocab_size = VOCAB
    capabilities = DrafterCapabilities(trees=True)

    def __init__(
        self,
        model,
        shape: tuple[int, ...],
        sampled: bool,
        chains: list[int] | None = None,
        sibling_heat: float = 0.0,
        unshaped_report: bool = False,
    ) -> None:
        """``sibling_heat``: sibling j is drawn from the draft's distribution at temperature x (1 + heat * j), each
        reporting its own; ``unshaped_report``: the reported distributions are those before top-k/top-p (a bug)."""
        self.model, self.shape, self.sampled = model, shape, sampled
        self.sibling_heat, self.unshaped_report = sibling_heat, unshaped_report
        self.chains = [0] if chains is None else chains
        self.settings = DraftSettings()

    def begin(self, settings: DraftSettings) -> None:
        self.settings = settings

    def accept(self, n: int) -> None:
        pass

    def fork(self) -> ShapedTreeDrafter:
        return ShapedTreeDrafter(
            self.model, self.shape, self.sampled, self.chains, self.sibling_heat, self.unshaped_report
        )

    @torch.no_grad()
    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        tokens, parents, probs = [], [], []
        level = [(-1, context.tolist())]
        rng = rng_on(self.settings.seeds, torch.device("cpu"))
        self.chains[0] += branches == 1
        for width in self.shape if branches > 1 else (1,) * len(self.shape):
            deeper = []
            for parent, path in level:
                logits, sampling = self.model(torch.tensor([path])).logits[0, -1], self.settings.sampling
                heats = [
                    replace(sampling, temperature=sampling.temperature * (1 + self.sibling_heat * j))
                    for j in range(width)
                ]
                qs = torch.stack([to_probs(logits, heat) for heat in heats])
                children = draw(qs, rng) if self.sampled else qs[0].topk(width).indices
                if self.unshaped_report:
                    qs = torch.stack([to_probs(logits, replace(heat, top_k=None, top_p=1.0)) for heat in heats])
                for j, token in enumerate(children.tolist()):
                    if len(tokens) == k:
                        break
                    tokens.append(token)
                    parents.append(parent)
                    probs.append(qs[j])
                    deeper.append((len(tokens) - 1, path + [token]))
            level = deeper
        if not tokens:
            return Proposal.empty()
        return Proposal(torch.tensor(tokens), torch.stack(probs) if self.sampled else None, torch.tensor(parents))


def _sample(
    gen: Generator, sampling: SamplingConfig, n: int, batched: bool, k_policy: str = "fixed"
) -> list[tuple[int, ...]]:
    configs = [
        GenerationConfig(
            k=8, k_policy=k_policy, branches=4, max_new_tokens=NEW, stop_on_eos=False, sampling=sampling, seed=s
        )
        for s in range(n)
    ]
    if not batched:
        return [tuple(gen.generate(PROMPT, c).token_ids) for c in configs]
    out = []
    for start in range(0, n, 250):
        part = configs[start : start + 250]
        out += [tuple(r.token_ids) for r in gen.generate_batch([PROMPT] * len(part), part)]
    return out


class PathCounter:
    """Counts the sampled tree verdicts by how they ended: down a later sibling, at a leaf with a bonus token, at the
    root."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.cases = {"later sibling": 0, "leaf bonus": 0, "root rejected": 0}
        original = tree_verifier.verify_tree_sampled

        def counting(tokens, parents, logits, probs, *args, **kwargs):
            verdict = original(tokens, parents, logits, probs, *args, **kwargs)
            path, listed = verdict.paths[0], parents.tolist()
            self.cases["root rejected"] += not path
            self.cases["later sibling"] += any(listed.index(listed[node]) != node for node in path)
            self.cases["leaf bonus"] += bool(path) and path[-1] not in listed
            return verdict

        monkeypatch.setattr("specdec.verification.verifiers.verify_tree_sampled", counting)


SHAPES = {"wide": (4, 1), "binary": (2, 2, 2), "deep": (2, 1, 1, 2)}


@pytest.mark.parametrize(
    ("shape", "sampled", "sampling", "batched"),
    [
        ("wide", False, "shaped", True),
        ("binary", True, "plain", True),
        pytest.param("deep", True, "shaped", False, marks=pytest.mark.slow),
        pytest.param("binary", False, "plain", True, marks=pytest.mark.slow),
    ],
)
def test_sampled_trees_keep_the_target_law(
    monkeypatch: pytest.MonkeyPatch, shape: str, sampled: bool, sampling: str, batched: bool
) -> None:
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    gen = Generator(loaded(target), ShapedTreeDrafter(perturbed(target, noise=0.6, seed=1), SHAPES[shape], sampled))
    counter = PathCounter(monkeypatch)
    samples = _sample(gen, SAMPLINGS[sampling], 2000, batched)
    assert all(count >= 20 for count in counter.cases.values()), counter.cases
    pvalue, dof = sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS[sampling]))
    assert dof > 50
    assert pvalue > MIN_PVALUE


@pytest.mark.slow
def test_tree_rows_that_draft_chains_while_chains_are_faster_keep_the_target_law() -> None:
    """Under the cost model a tree row drafts a tree or, where chains have been faster, a chain (a tree first, then a
    chain, then the faster way): sampled siblings, both kinds of step, the target's law."""
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    drafter = ShapedTreeDrafter(perturbed(target, noise=0.6, seed=1), SHAPES["binary"], True)
    # every row drafts its own k, whatever the load
    gen = Generator(loaded(target), drafter, batch=BatchConfig(k_cap="fixed"))
    samples = _sample(gen, SAMPLINGS["plain"], 2000, batched=True, k_policy="cost-model")
    # the second step of every sequence, and later ones while chains are faster
    assert drafter.chains[0] > 300, drafter.chains
    pvalue, dof = sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))
    assert dof > 50
    assert pvalue > MIN_PVALUE


def _outcome(
    accepted: int, draft_s: float, nodes: int, branched: bool = False, verify_s: float | None = None
) -> StepOutcome:
    """A step of a row that chose k = 4 and drafted 4 levels (``nodes`` of them verified)."""
    return step_outcome(4, accepted, nodes=nodes, draft_s=draft_s, branched=branched, verify_s=verify_s)


def test_tree_rows_draft_whichever_way_has_been_faster() -> None:
    """Trees first, then a chain; then the faster of the two, the other on trial steps that grow rarer while it stays
    slower (after 8 steps, then 16, then every 32), until they swap, when the other one is tried after 8 again."""
    policy = CostModelK(8, CostCurve({1: 0.010, 9: 0.020}))

    def step(tree_accepts: int, chain_accepts: int) -> bool:
        tree = policy.choose_tree()
        accepted = tree_accepts if tree else chain_accepts
        policy.observe(_outcome(accepted, 0.001, 8 if tree else 4))
        return tree

    assert [step(1, 3), step(1, 3)] == [True, False]
    chains_win = [step(1, 3) for _ in range(4 * TREE_TRIAL_EVERY)]  # steps 3 to 34
    # a tree only on trial steps: after 8, then 16 more
    assert [i + 3 for i, tree in enumerate(chains_win) if tree] == [8, 24]
    later = [step(7, 0) for _ in range(6 * TREE_TRIAL_EVERY)]  # now trees win
    # a chain again after 8 steps: the ways swapped
    assert sum(later[-2 * TREE_TRIAL_EVERY :]) == 2 * TREE_TRIAL_EVERY - 1
    seeded = CostModelK(8, CostCurve({1: 0.010, 9: 0.020}), draft_s_per_token=0.0)
    seeded.choose_tree()
    seeded.observe(_outcome(1, 5.0, 8))
    # a seeded run prices drafting, never times it: the choices repeat
    assert seeded.ways.rates[True] == pytest.approx((2, 0.02))
    overhead = CostCurve({1: 0.0, 9: 0.008})  # a tree forward's seconds over a chain's
    # a tree step whose drafts happened not to branch costs a chain's forward
    for branched, seconds in ((False, 0.024), (True, 0.032)):
        # 4 levels drafted (a draft step each) for 8 nodes verified
        priced = CostModelK(8, CostCurve({1: 0.010, 9: 0.020}), draft_s_per_token=0.001, tree_overhead=overhead)
        assert priced.choose_tree()
        priced.observe(_outcome(1, 5.0, 8, branched=branched))
        assert priced.ways.rates[True] == pytest.approx((2, seconds))
        # only a chain-shaped step teaches k
        assert (priced.acceptance == CostModelK(8, CostCurve({1: 0.010})).acceptance) == branched
    timed = CostModelK(8, CostCurve({1: 0.010, 9: 0.020}))
    timed.choose_tree()
    timed.observe(_outcome(1, 0.5, 8, verify_s=0.25))
    # Otherwise the step's own time: a tree's forward costs more than the curve says.
    assert timed.ways.rates[True] == pytest.approx((2, 0.75))


def test_a_timed_tree_row_starts_from_its_generators_earlier_rows() -> None:
    """Unseeded, tree rows of one generator with the same settings share their tree and chain rates: a row's first steps
    draft whichever way earlier rows found faster. A seeded row, or one with other settings, starts afresh."""
    gen = Generator(loaded(tiny_llama(3, vocab=VOCAB)), PromptLookupDrafter())
    gen.costs = gen.tree_overhead = lambda: CostCurve({1: 0.010, 9: 0.020})  # type: ignore[method-assign]
    config = GenerationConfig(k=8, branches=2, k_policy="cost-model")

    def steps(policy: KPolicy, n: int, tree_accepts: int, chain_accepts: int) -> list[bool]:
        assert isinstance(policy, CostModelK)
        drafted = []
        for _ in range(n):
            tree = policy.choose_tree()
            accepted = tree_accepts if tree else chain_accepts
            policy.observe(_outcome(accepted, 0.001, 8 if tree else 4))
            drafted.append(tree)
        return drafted

    assert steps(gen.k_policy(config), 2, 0, 3) == [True, False]  # no rates yet: a tree, then a chain
    assert steps(gen.k_policy(config), 2, 7, 0) == [False, False], "chains were faster for the first row"
    assert steps(gen.k_policy(config), TREE_TRIAL_EVERY, 7, 0)[-4:] == [True] * 4, "trees win once a trial shows it"
    assert steps(gen.k_policy(config), 2, 7, 0) == [True, True], "a fresh row would draft a chain on its second step"
    for fresh in (
        replace(config, seed=0),
        replace(config, k=6),
        replace(config, sampling=SamplingConfig(temperature=0.7)),
    ):
        assert steps(gen.k_policy(fresh), 2, 7, 0) == [True, False]
    assert steps(gen.k_policy(config, batched=True), 2, 7, 0) == [True, False], (
        "a batch row's steps are timed with the batch"
    )


def test_a_wrong_sibling_residual_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control, patched where tree.py reads it: trying the next drawn sibling against p instead of
    norm(max(0, p - q)) must be caught. (Deterministic siblings read no residual: the target draws and descends to the
    sibling it drew; their control is the next test.)"""
    monkeypatch.setattr(tree_verifier, "residual_distribution", lambda p, q: p)
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    gen = Generator(loaded(target), ShapedTreeDrafter(perturbed(target, noise=0.6, seed=1), SHAPES["wide"], True))
    samples = _sample(gen, SAMPLINGS["plain"], 1500, batched=True)
    assert sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))[0] < MIN_PVALUE


def one_uniform_for_every_level(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break trees of deterministic siblings: every level drawn with its first level's uniform instead of its own."""
    original = trees_module.Trees.uniforms

    def one_for_every_level(self, row, proposal, device):
        uniforms = original(self, row, proposal, device)
        return Uniforms(uniforms.sample[:1].expand_as(uniforms.sample), uniforms.accept)

    monkeypatch.setattr(trees_module.Trees, "uniforms", one_for_every_level)


def test_deterministic_siblings_judged_with_one_uniform_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control for deterministic siblings (top tokens, as eagle and model trees draft; prompt lookup's
    matches are verified the same way): every level of a tree drawn with its first level's uniform, instead of the
    uniform of its own position, must be caught."""
    one_uniform_for_every_level(monkeypatch)
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    gen = Generator(loaded(target), ShapedTreeDrafter(perturbed(target, noise=0.6, seed=1), SHAPES["wide"], False))
    samples = _sample(gen, SAMPLINGS["plain"], 1500, batched=True)
    assert sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))[0] < MIN_PVALUE


def one_q_per_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broken verifier: every sibling is judged against the first sibling's q (as if siblings shared one draft
    law)."""
    original = tree_verifier.verify_tree_sampled

    def judged_with_one_q(tokens, parents, logits, probs, *args, **kwargs):
        if probs is not None:
            listed = parents.tolist()
            probs = probs[[listed.index(parent) for parent in listed]]
        return original(tokens, parents, logits, probs, *args, **kwargs)

    monkeypatch.setattr("specdec.verification.verifiers.verify_tree_sampled", judged_with_one_q)


@pytest.mark.parametrize("broken", [False, pytest.param(True, id="negative control", marks=pytest.mark.slow)])
def test_siblings_drawn_from_different_laws_keep_the_target_law(monkeypatch: pytest.MonkeyPatch, broken: bool) -> None:
    """Sibling j drawn at its own temperature and reporting its own q: the target's law; the same tree judged against
    one q per parent must fail."""
    if broken:
        one_q_per_parent(monkeypatch)
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    draft = ShapedTreeDrafter(perturbed(target, noise=0.6, seed=1), SHAPES["wide"], sampled=True, sibling_heat=1.5)
    samples = _sample(Generator(loaded(target), draft), SAMPLINGS["plain"], 2000, batched=True)
    pvalue = sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["plain"]))[0]
    assert pvalue < MIN_PVALUE if broken else pvalue > MIN_PVALUE


@pytest.mark.slow
def test_a_tree_reporting_its_q_before_shaping_fails() -> None:
    """Negative control: drawn siblings sampled from the shaped distribution but reported before top-k/top-p."""
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    draft = ShapedTreeDrafter(
        perturbed(target, noise=0.6, seed=1), SHAPES["binary"], sampled=True, unshaped_report=True
    )
    samples = _sample(Generator(loaded(target), draft), SAMPLINGS["shaped"], 5000, batched=True)
    assert sequential_pvalue(samples, TargetLaw(target, PROMPT, SAMPLINGS["shaped"]))[0] < MIN_PVALUE


def test_tree_settings_are_checked() -> None:
    with pytest.raises(ConfigError, match="branches"):
        GenerationConfig(branches=0)
    with pytest.raises(ConfigError, match="guards"):
        GenerationConfig(branches=2, guards=GuardConfig(repetition=True))


def test_model_drafts_as_trees_give_the_target_only_tokens() -> None:
    """A model draft's tree (its chain plus the next most likely tokens as leaves) on one row and in a batch."""
    tokenizer, model = models()[0], models()[1]["llama"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none")
    gen = Generator(target.target, ModelDrafter(TransformersBackend(perturbed(model, noise=0.3, seed=1))), batch=FIXED)
    expected = [target.generate(p, max_new_tokens=30, stop_on_eos=False).token_ids for p in PROMPTS]
    chains = [gen.generate(p, max_new_tokens=30, k=6, k_policy="fixed", stop_on_eos=False) for p in PROMPTS]
    trees = [gen.generate(p, max_new_tokens=30, k=6, k_policy="fixed", branches=3, stop_on_eos=False) for p in PROMPTS]
    assert [r.token_ids for r in trees] == expected == [r.token_ids for r in chains]
    assert sum(r.stats.draft_tokens_accepted for r in trees) > sum(r.stats.draft_tokens_accepted for r in chains)
    configs = [
        GenerationConfig(k=6, k_policy="fixed", branches=b, max_new_tokens=30, stop_on_eos=False) for b in (3, 1, 2)
    ]
    assert [r.token_ids for r in gen.generate_batch(PROMPTS, configs)] == expected


def test_the_proposal_contract_is_enforced() -> None:
    """Drawn siblings with scores are refused (ordering or cutting them by score biases the law); a chain with both,
    and a deterministic tree with scores, are fine. A greedy tree with two equal siblings is refused."""
    q = torch.full((3, VOCAB), 1 / VOCAB)
    tree, chain = torch.tensor([-1, -1, 0]), torch.tensor([-1, 0, 1])
    with pytest.raises(ValueError, match="drawn siblings.*cannot carry scores"):
        Proposal(torch.tensor([1, 2, 3]), q, tree, torch.tensor([0.9, 0.5, 0.4]))
    Proposal(torch.tensor([1, 2, 3]), q, chain, torch.tensor([0.9, 0.5, 0.4]))
    Proposal(torch.tensor([1, 2, 3]), None, tree, torch.tensor([0.9, 0.5, 0.4]))
    choice = greedy(torch.zeros(1, 4, VOCAB))
    with pytest.raises(ValueError, match="two siblings with the same token"):
        verify_tree_greedy(torch.tensor([[4, 4, 1]]), tree[None], torch.tensor([3]), choice)
    verify_tree_greedy(torch.tensor([[4, 5, 4]]), tree[None], torch.tensor([3]), choice)  # cousins may repeat a token
    verify_tree_greedy(torch.tensor([[4, 5, 4]]), tree[None], torch.tensor([2]), choice)  # past a row's count: ignored


class AlwaysTrees(PromptLookupDrafter):
    """A drafter that proposes a tree even when asked for a chain (branches 1)."""

    def propose(self, context, k, branches=1):
        return Proposal(torch.tensor([3, 4]), None, torch.tensor([-1, -1]))


def test_a_tree_row_with_guards_or_typical_acceptance_is_refused_by_the_step() -> None:
    gen = Generator(loaded(tiny_llama(3, vocab=VOCAB)), AlwaysTrees())
    for config in (
        GenerationConfig(k=2, k_policy="fixed", max_new_tokens=4, guards=GuardConfig(repetition=True)),
        GenerationConfig(k=2, k_policy="fixed", max_new_tokens=4, typical_acceptance=TypicalAcceptance()),
    ):
        with pytest.raises(ConfigError, match="tree row cannot use guards or typical acceptance"):
            gen.generate(PROMPT, config)
