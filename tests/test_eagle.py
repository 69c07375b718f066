"""The feature-conditioned (eagle) head: hidden states from the backends, its distillation, lossless drafting as chains
and trees on every backend that returns features, and tree sizes priced by the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, step_outcome, tiny_llama
from test_distill import TEXT, config
from test_native import models
from transformers import DynamicCache

from specdec import GenerationConfig, Generator, SamplingConfig, drafters
from specdec.bench.lossless import TargetLaw, sequential_pvalue
from specdec.config import BatchConfig, RuntimeConfig
from specdec.drafters import FallbackDrafter, PromptLookupDrafter, SuffixDrafter, auto_draft, build_drafter
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.drafters.eagle import (
    EagleDrafter,
    ModuleHead,
    NativeHead,
    build_eagle,
    head_forward,
    load_eagle,
    why_not_native,
)
from specdec.drafters.fallback import merge_trees
from specdec.engine.costs import MachineCosts
from specdec.errors import ConfigError
from specdec.models import TransformersBackend, open_target
from specdec.models.backend import OneRow
from specdec.models.batched import BatchedTransformersBackend
from specdec.models.native import kernel_build
from specdec.scheduling import CostCurve
from specdec.scheduling.k_policy import CostModelK, StepOutcome
from specdec.training.distill import DistillConfig, DraftArch, TeacherData, distill, unrolled_eagle, unrolled_eagle_loss

PROMPTS = [
    "the cat sat on the mat. the cat sat on the",
    "abc abd abc abd abc",
    "Hello, world! Hello, there! Hello, world!",
]
RUNTIMES = ["transformers"] + (["native"] if kernel_build.compiled() is not None else [])
HEAD_RUNNERS = ["module"] + (["native"] if kernel_build.compiled() is not None else [])  # ModuleHead, NativeHead


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_backends_return_the_hidden_states_the_head_reads(family: str) -> None:
    """From the same forward: the final hidden state of every fed position, whose output-head product is the logits."""
    model = models()[1][family]
    ids = torch.randint(3, 60, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        reference = model(ids, output_hidden_states=True).hidden_states[-1][0]
        head_logits = model.lm_head(reference[-3:])
    single = TransformersBackend(model)
    logits = single.forward(ids, last=3, features=True)
    assert torch.allclose(single.last_features[0], reference, atol=1e-5)
    assert torch.allclose(logits[0], head_logits, atol=1e-4)
    batched = BatchedTransformersBackend(model)
    batched.add_rows(2)
    batched.forward([0, 1], [ids[0], ids[0, :7]], last=1, features=True)
    assert [f.shape[0] for f in batched.last_features] == [12, 7]  # each row's real positions only
    assert torch.allclose(batched.last_features[1], reference[:7], atol=1e-4)
    if kernel_build.compiled() is not None:
        native = open_target(loaded(model), RuntimeConfig(backend="native")).backend
        row = OneRow(native)
        row.add_rows(1)
        row.forward([0], [ids[0]], last=1, features=True)
        cosine = torch.nn.functional.cosine_similarity(row.last_features[0], reference, dim=-1)
        assert float(cosine.min()) > 0.97  # int8 weights: close to transformers' float32, not equal


def head_runner(family: str, runner: str) -> tuple[EagleDrafter, object]:
    """An untrained head for the tiny ``family`` model, run as its module or on the native kernels; and the model."""
    tokenizer, model = models()[0], models()[1][family]
    module = build_eagle(model, torch.arange(len(tokenizer)), 1).eval()
    embed = model.get_input_embeddings()
    head = NativeHead(module, embed) if runner == "native" else module
    return EagleDrafter(head, embed, len(tokenizer), min_score=0.0), model


@pytest.mark.parametrize("runner", HEAD_RUNNERS)
@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_eagle_drafts_give_the_target_only_tokens(family: str, runtime: str, runner: str) -> None:
    """An untrained head (its guesses are poor, so rejections are frequent) as chains and trees, on either runner."""
    tokenizer, model = models()[0], models()[1][family]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=RuntimeConfig(backend=runtime))
    module = build_eagle(model, torch.arange(len(tokenizer)), 1).eval()
    embed = target.backend.token_embeddings()
    head = NativeHead(module, embed) if runner == "native" else module
    drafted = Generator(target.target, EagleDrafter(head, embed, target.backend.vocab_size, min_score=0.0))
    for prompt in PROMPTS:
        expected = target.generate(prompt, max_new_tokens=30, stop_on_eos=False).token_ids
        for branches in (1, 3):
            got = drafted.generate(
                prompt, max_new_tokens=30, k=6, k_policy="fixed", branches=branches, stop_on_eos=False
            )
            assert got.token_ids == expected, (family, runtime, branches, prompt)
            assert got.stats.draft_tokens_proposed > 0


@pytest.mark.parametrize("runner", HEAD_RUNNERS)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_tree_level_of_the_head_equals_each_path_run_as_a_chain(family: str, runner: str) -> None:
    """Tree nodes run together (each seeing the context and its ancestors, at its depth's position) give what each
    root-to-node path gives alone: the tree mask and positions the drafter's levels rely on."""
    drafter, model = head_runner(family, runner)
    head = drafter.runner
    gen = torch.Generator().manual_seed(1)
    context, features = (
        torch.randint(3, 60, (9,), generator=gen),
        torch.randn(9, model.config.hidden_size, generator=gen),
    )
    nodes, node_features = (
        torch.randint(3, 60, (5,), generator=gen),
        torch.randn(5, model.config.hidden_size, generator=gen),
    )
    parents = torch.tensor([-1, 0, -1, 1, 2])  # two roots; paths 0-1-3 and 2-4
    with torch.inference_mode():
        cache = head.new_cache()
        head.run(cache, context, features, None)
        logits, out = head.run(cache, nodes, node_features, parents)
        assert head.length(cache) == 14
        for leaf, path in ((3, [0, 1, 3]), (4, [2, 4])):
            head.truncate(cache, 9)
            chain_logits, chain_out = head.run(cache, nodes[path], node_features[path], None)
            assert torch.allclose(chain_logits[-1], logits[leaf], atol=1e-4), (family, runner, leaf)
            assert torch.allclose(chain_out[-1], out[leaf], atol=1e-4)


@pytest.mark.parametrize("runner", HEAD_RUNNERS)
def test_a_chain_draft_is_the_heads_own_greedy_chain_even_after_an_anchor(runner: str) -> None:
    """With one branch, each level's token is the head's argmax after the previous one, fed its own output feature;
    begun mid-sequence (a guard's anchor) the head keeps only the context it read in its cache between steps."""
    drafter, model = head_runner("gemma3", runner)
    head = drafter.runner
    gen = torch.Generator().manual_seed(4)
    context, features = (
        torch.randint(3, 60, (12,), generator=gen),
        torch.randn(12, model.config.hidden_size, generator=gen),
    )
    for known in (11, 5):  # from the start, and begun mid-sequence with the last 5 positions' features
        drafter.begin(DraftSettings())
        drafter.observe_features(features[12 - 1 - known : 11] if known < 11 else features[:11])
        with torch.inference_mode():
            proposal = drafter.propose(context, 4)
            assert head.length(drafter.cache) == drafter.cached == known  # the drafts' own entries are gone
            cache = head.new_cache()
            logits, out = head.run(cache, context[12 - known :], features[11 - known : 11], None)
            expected = []
            for _ in range(4):
                token = drafter.runner.keep_ids[logits[-1].argmax()]
                expected.append(int(token))
                logits, out = head.run(cache, token[None], out[-1:], None)
        assert proposal.tokens.tolist() == expected, (runner, known)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
@pytest.mark.skipif(kernel_build.compiled() is None, reason="the native kernels are not built on this machine")
def test_the_native_head_follows_its_module(family: str) -> None:
    """int8 weights and activations: close to the module's float32 logits and features, not equal."""
    (module_drafter, model), (native_drafter, _) = head_runner(family, "module"), head_runner(family, "native")
    gen = torch.Generator().manual_seed(2)
    tokens, features = (
        torch.randint(3, 60, (16,), generator=gen),
        torch.randn(16, model.config.hidden_size, generator=gen),
    )
    with torch.inference_mode():
        got = [d.runner.run(d.runner.new_cache(), tokens, features, None) for d in (module_drafter, native_drafter)]
    (module_logits, module_out), (native_logits, native_out) = got
    assert float(torch.nn.functional.cosine_similarity(native_logits, module_logits, dim=-1).min()) > 0.97
    assert float(torch.nn.functional.cosine_similarity(native_out, module_out, dim=-1).min()) > 0.97
    assert (native_logits.argmax(-1) == module_logits.argmax(-1)).float().mean() > 0.8


def test_lookup_then_eagle_keeps_the_head_fed() -> None:
    """Prompt lookup first, the head otherwise: the head reads every step's hidden states, whoever drafted."""
    tokenizer, model = models()[0], models()[1]["llama"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none")
    head = EagleDrafter(
        build_eagle(model, torch.arange(len(tokenizer)), 1), model.get_input_embeddings(), len(tokenizer), min_score=0.0
    )
    drafted = Generator(target.target, FallbackDrafter(PromptLookupDrafter(), head))
    for prompt in PROMPTS:
        expected = target.generate(prompt, max_new_tokens=30, stop_on_eos=False).token_ids
        assert (
            drafted.generate(prompt, max_new_tokens=30, k=6, k_policy="fixed", branches=2, stop_on_eos=False).token_ids
            == expected
        )
    assert drafted.drafter.capabilities.features and head.known > 0


def test_merged_trees_share_paths_and_list_parents_first() -> None:
    lookup = Proposal(torch.tensor([5, 6, 7]))  # a chain: scores 0.6, 0.36, 0.216
    head = Proposal(torch.tensor([5, 9, 6, 4]), None, torch.tensor([-1, -1, 0, 2]), torch.tensor([0.9, 0.05, 0.5, 0.3]))
    merged = merge_trees(lookup, head, k=10)
    paths = set()
    for i in range(len(merged)):
        path, node = [], i
        while node >= 0:
            path.insert(0, int(merged.tokens[node]))
            node = int(merged.parents[node])
        paths.add(tuple(path))
        assert int(merged.parents[i]) < i
    assert paths == {(5,), (5, 6), (5, 6, 7), (5, 6, 4), (9,)}  # the shared prefix 5-6 is one path
    assert merged.scores.tolist() == pytest.approx([0.9, 0.5, 0.3, 0.216, 0.05])  # the higher score where both propose
    assert merged.is_tree and len(merge_trees(lookup, head, k=3)) == 3


class OneScoredNode(Drafter):
    """A scored second drafter that always guesses token 99 with score 0.5."""

    capabilities = DrafterCapabilities(trees=True, scores=True)

    def begin(self, settings: DraftSettings) -> None:
        pass

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        return Proposal(torch.tensor([99]), None, torch.tensor([-1]), torch.tensor([0.5]))

    def accept(self, n: int) -> None:
        pass

    def fork(self) -> OneScoredNode:
        return self


def test_merged_copies_are_scored_by_how_often_they_came_true() -> None:
    """A copied node at depth d scores a^d, a learned from whether the copies matched the text that followed them."""
    both = FallbackDrafter(PromptLookupDrafter(), OneScoredNode())
    text = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8] * 8)  # repeats itself: every copy comes true
    both.begin(DraftSettings())
    length = 10
    first = both.propose(text[:length], 4, branches=2)
    assert first.scores[first.tokens == 3].item() == pytest.approx(0.6)  # no evidence yet: the prior
    for _ in range(6):
        length += both.propose(text[:length], 4, branches=2).depth  # the text took the copy
    assert both.first_rate.value > 0.9
    merged = both.propose(text[:length], 4, branches=2)
    copy = merged.tokens != 99
    assert merged.scores[copy].tolist() == pytest.approx(
        [both.first_rate.value**d for d in range(1, int(copy.sum()) + 1)]
    )
    assert merged.tokens[0] != 99  # the copy now outranks the head's 0.5 guess
    wrong = torch.cat([text[:length], torch.tensor([42, 43, 44, 45])])  # the text went elsewhere
    before = both.first_rate.value
    both.propose(wrong, 4, branches=2)
    assert both.first_rate.value < before


def test_lookup_and_eagle_merge_into_one_tree_and_stay_exact() -> None:
    """With branches, prompt lookup's copy and the head's tree are verified together; the tokens are target-only's."""
    tokenizer, model = models()[0], models()[1]["gemma3"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none")
    head = EagleDrafter(
        build_eagle(model, torch.arange(len(tokenizer)), 1), model.get_input_embeddings(), len(tokenizer), min_score=0.0
    )
    both = FallbackDrafter(PromptLookupDrafter(), head)
    drafted = Generator(target.target, both)
    merged_steps = 0
    original = both.propose

    def counting(context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        nonlocal merged_steps
        proposal = original(context, k, branches)
        merged_steps += len(both._proposed) == 2
        return proposal

    both.propose = counting  # type: ignore[method-assign]
    for prompt in PROMPTS:
        expected = target.generate(prompt, max_new_tokens=30, stop_on_eos=False).token_ids
        got = drafted.generate(prompt, max_new_tokens=30, k=8, k_policy="cost-model", branches=3, stop_on_eos=False)
        assert got.token_ids == expected
    assert merged_steps > 0


@pytest.mark.parametrize("merged", [False, True])
def test_eagle_trees_in_a_batch_give_each_rows_own_tokens(merged: bool) -> None:
    """Rows of different tree sizes in one batched step; ``merged``: prompt lookup's copies merged into the head's
    trees."""
    tokenizer, model = models()[0], models()[1]["gemma3"]
    drafter = EagleDrafter(
        build_eagle(model, torch.arange(len(tokenizer)), 1), model.get_input_embeddings(), len(tokenizer), min_score=0.0
    )
    if merged:
        drafter = FallbackDrafter(PromptLookupDrafter(), drafter)
    gen = Generator(loaded(model, tokenizer=tokenizer), drafter, batch=BatchConfig(k_cap="fixed"))  # k as configured
    expected = [gen.generate(p, max_new_tokens=25, k=1, k_policy="fixed", stop_on_eos=False).token_ids for p in PROMPTS]
    configs = [
        GenerationConfig(k=k, k_policy="fixed", branches=b, max_new_tokens=25, stop_on_eos=False)
        for k, b in ((8, 4), (4, 1), (6, 2))
    ]
    assert [r.token_ids for r in gen.generate_batch(PROMPTS, configs)] == expected


KEPT = torch.tensor([6, 2, 7, 0, 3])  # a head over some of the target's tokens, not in order: its q is 0 on the others


def _sampled_eagle(branches: int, merged: bool, n: int) -> tuple[list[tuple[int, ...]], TargetLaw]:
    """``n`` seeded samples of 4 tokens drafted by a head over KEPT that stops below score 0.1, and the target's law."""
    target = tiny_llama(3, vocab=8, scale=0.15)
    drafter = EagleDrafter(build_eagle(target, KEPT, 1), target.get_input_embeddings(), 8, min_score=0.1)
    if merged:
        drafter = FallbackDrafter(PromptLookupDrafter(), drafter)
    gen = Generator(loaded(target), drafter)
    sampling = SamplingConfig(temperature=0.9, top_k=5)
    configs = [
        GenerationConfig(
            k=6, k_policy="fixed", branches=branches, max_new_tokens=4, stop_on_eos=False, sampling=sampling, seed=s
        )
        for s in range(n)
    ]
    samples = []
    for start in range(0, len(configs), 250):
        part = configs[start : start + 250]
        samples += [tuple(r.token_ids) for r in gen.generate_batch([[1, 5, 3]] * len(part), part)]
    return samples, TargetLaw(target, [1, 5, 3], sampling)


@pytest.mark.parametrize(("merged", "branches"), [(False, 3), (True, 3), (False, 1), (True, 1)])
def test_sampled_eagle_drafts_keep_the_target_law(merged: bool, branches: int) -> None:
    """The head's trees and chains are deterministic (its top tokens): the target's draw decides; chi-square against
    the target's law. ``merged``: prompt lookup's copies merged into the head's trees (FallbackDrafter with branches),
    or its chains where it finds one."""
    samples, law = _sampled_eagle(branches, merged, 1500)
    pvalue, dof = sequential_pvalue(samples, law)
    assert dof > 30 and pvalue > 1e-3


def test_eagle_distillation_trains_saves_and_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer), layers=3), tokenizer=tokenizer)
    settings = config(tmp_path, arch=DraftArch.parse("eagle,keep=40"), out=str(tmp_path / "head"), checkpoint_every=20)
    assert settings.arch.layers == 1 and str(settings.arch) == "eagle,layers=1,keep=40"
    record = distill(target, settings)
    first, last = record["evaluations"][0], record["evaluations"][-1]
    assert last["held_out_loss"] < 0.8 * first["held_out_loss"]
    assert last["top1_agreement"] > first["top1_agreement"]
    drafter = build_drafter(f"model:{settings.out}", open_target(target))
    assert isinstance(drafter, EagleDrafter)
    gen = Generator(target, drafter)
    plain = Generator(target, "none").generate(TEXT[:20], max_new_tokens=30, stop_on_eos=False)
    got = gen.generate(TEXT[:20], max_new_tokens=30, branches=2, stop_on_eos=False)
    assert got.token_ids == plain.token_ids  # (a random target's output is nothing like the corpus: few drafts pass)
    assert got.stats.draft_tokens_proposed > 0
    assert isinstance(Generator(target, "auto").drafter, SuffixDrafter)  # no head ships for this target
    with pytest.raises(ConfigError, match="measured costs"):
        build_drafter("auto", open_target(target))
    monkeypatch.setattr(
        drafters, "bundled_draft", lambda name, kind="": Path(settings.out) if kind == "eagle" else None
    )
    cheap, costly = CostCurve({1: 0.010, 3: 0.0105}), CostCurve({1: 0.010, 3: 0.020})
    light, heavy = (lambda head: 0.0002), (lambda head: 0.001)  # a head's draft step: 2% or 10% of a target step
    assert auto_draft(open_target(target), lambda: cheap, light) == "lookup-then-eagle"  # as if this head shipped
    assert auto_draft(open_target(target), lambda: costly, light) == "suffix"  # its short drafts would not pay
    assert auto_draft(open_target(target), lambda: cheap, heavy) == "suffix"  # drafting them costs too much
    monkeypatch.setattr(MachineCosts, "forward", lambda self: cheap)
    monkeypatch.setattr(MachineCosts, "draft_step", lambda self, drafter, branches=1: 0.0002)
    auto = Generator(target, "auto")
    assert auto.draft_name == "lookup-then-eagle" and isinstance(auto.drafter.second, EagleDrafter)
    assert auto.generate(TEXT[:20], max_new_tokens=30, stop_on_eos=False).token_ids == plain.token_ids
    monkeypatch.undo()
    embed = target.model.get_input_embeddings()
    module = load_eagle(settings.out, embed, len(tokenizer), kernels=False)
    assert isinstance(module.runner, ModuleHead)  # asked for: the module, even where the kernels run
    if why_not_native(module.runner.module) is None:
        # by default where it runs
        assert isinstance(load_eagle(settings.out, embed, len(tokenizer)).runner, NativeHead)
    else:
        with pytest.raises(ConfigError, match="native kernels"):
            load_eagle(settings.out, embed, len(tokenizer), kernels=True)
    again = distill(
        target,
        DistillConfig(**{**settings.__dict__, "out": str(tmp_path / "again"), "steps": 1, "init_from": settings.out}),
    )
    # it starts where the saved head ended
    assert again["evaluations"][0]["held_out_loss"] < 0.8 * first["held_out_loss"]
    two_layers = {
        **settings.__dict__,
        "arch": DraftArch.parse("eagle,layers=2,keep=40"),
        "out": str(tmp_path / "two"),
        "init_from": settings.out,
    }
    with pytest.raises(ConfigError, match="another shape"):
        distill(target, DistillConfig(**two_layers))
    other = tmp_path / "other"
    other.mkdir()
    (other / "teacher.pt").write_bytes((Path(settings.out) / "teacher.pt").read_bytes())
    with pytest.raises(ConfigError, match="another kind of draft"):  # its teacher data has hidden states
        distill(target, DistillConfig(**{**settings.__dict__, "arch": DraftArch(layers=1, keep=40), "out": str(other)}))


@torch.no_grad()
def test_the_training_time_test_sees_what_the_head_sees_when_it_drafts() -> None:
    """Depth 2 of the unrolled head in one masked forward equals the head drafting incrementally: the target-fed pairs
    of positions 0..p in its cache, then its own feature from depth 1 with the next token at position p + 1; depth 3
    likewise after its own chain. Depth 1 is the plain teacher-forced forward."""
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer), layers=3)
    target = loaded(model, tokenizer=tokenizer)
    keep_ids = torch.arange(40)
    head = build_eagle(model, keep_ids, 1).float().eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 40, (2, 9), generator=generator)
    hidden = torch.randn(2, 9, model.config.hidden_size, generator=generator).to(torch.bfloat16)
    top_ids = torch.randint(0, 40, (2, 9, 4), generator=generator).int()
    teacher = TeacherData(tokens, top_ids, torch.zeros(2, 9, 4, dtype=torch.float16), keep_ids, 1, hidden)
    rows = torch.arange(2)
    states = hidden.float()
    (l1, f1), (l2, f2), (l3, _) = unrolled_eagle(target, head, tokens, states[:, :-1], 3)
    embed = model.get_input_embeddings()
    for p in range(6):
        cache = DynamicCache()
        first, _ = head_forward(head, embed, tokens[:, 1 : p + 2], states[:, : p + 1], torch.arange(p + 1)[None], cache)
        second, mine = head_forward(
            head, embed, tokens[:, p + 2 : p + 3], f1[:, p : p + 1], torch.tensor([[p + 1]]), cache
        )
        third, _ = head_forward(head, embed, tokens[:, p + 3 : p + 4], mine, torch.tensor([[p + 2]]), cache)
        torch.testing.assert_close(first[:, -1], l1[:, p], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(second[:, 0], l2[:, p], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(mine[:, 0], f2[:, p], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(third[:, 0], l3[:, p], rtol=1e-4, atol=1e-4)
    loss, losses, agreement = unrolled_eagle_loss(target, head, teacher, rows, 0.0, 3)
    assert len(losses) == len(agreement) == 3
    torch.testing.assert_close(loss, losses[0] + 0.8 * losses[1] + 0.64 * losses[2])
    with pytest.raises(ConfigError, match="--arch eagle"):
        DistillConfig(data=("x",), out="o", unroll=2)
    with pytest.raises(ConfigError, match="longer --seq-len"):
        DistillConfig(data=("x",), out="o", arch=DraftArch.parse("eagle,keep=40"), unroll=4, seq_len=4)


def test_eagle_arch_errors() -> None:
    with pytest.raises(ConfigError, match="eagle head takes"):
        DraftArch.parse("eagle,exit=3")
    with pytest.raises(ConfigError, match="bad --arch part"):
        DraftArch.parse("eagles")


@pytest.mark.parametrize("runner", HEAD_RUNNERS)
def test_a_seeded_run_prices_the_heads_draft_steps(
    runner: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The head runs outside a Backend: its draft step (a chain's, and a tree level's apart) is measured once, kept
    under its identity, and prices a seeded run's steps by the head's runs (one per level drafted); a copy costs none, a
    merged tree the head's runs."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    head, model = head_runner("llama", runner)
    tokenizer = models()[0]
    both = FallbackDrafter(PromptLookupDrafter(), head)
    for drafter in (head, both):
        gen = Generator(loaded(model, tokenizer=tokenizer), drafter)
        assert 0 < gen.draft_cost() < 1.0
        # measured once, then read from the cache
        assert gen.draft_cost() == Generator(gen.target, drafter).draft_cost()
    # the fallback is priced by its head, under the head's identity
    assert len(list((tmp_path / "costs").iterdir())) == 1
    # a tree's level, measured apart
    assert 0 < gen.draft_cost(3) < 1.0 and len(list((tmp_path / "costs").iterdir())) == 2
    head.begin(DraftSettings())
    head.observe_features(torch.zeros(7, model.config.hidden_size))
    context = torch.tensor([5, 6, 7, 8, 5, 6, 7, 9])
    chain = head.propose(context, 4)
    assert chain.draft_steps == 4 == len(chain)  # the context's run drafts the first level, one run per further level
    assert chain.cut(2).draft_steps == 4  # the drafting done stays when the engine verifies fewer
    copyable = torch.tensor([5, 6, 7, 8, 5, 6, 7, 9, 5, 6, 7])
    for branches in (1, 2):  # a copy, and a tree of copies, run no model
        copied = PromptLookupDrafter().propose(copyable, 4, branches=branches)
        assert len(copied) > 0 and copied.draft_steps == 0
    tree = Proposal(torch.tensor([5, 9]), None, torch.tensor([-1, -1]), torch.tensor([0.9, 0.1]), steps=3)
    assert merge_trees(Proposal(torch.tensor([5, 6]), steps=0), tree, k=4).draft_steps == 3  # a copy costs no step
    priced = CostModelK(8, CostCurve({1: 0.010, 9: 0.020}), draft_s_per_token=0.002, tree_draft_s_per_step=0.005)
    # two tree levels at the tree's price; three chain steps at a chain's
    for steps, seconds in ((2, 0.030), (3, 0.026)):
        way = priced.choose_tree()  # a tree step first, then a chain step: each way records its own price
        priced.observe(_outcome(depth=2, accepted=1, nodes=8, draft_steps=steps))
        assert priced.ways.rates[way] == pytest.approx((2, seconds))


def test_tree_size_follows_the_costs_and_learns_the_scores_calibration() -> None:
    """Cheap verification keeps every useful node; expensive verification keeps only the likely ones; a drafter whose
    scores are too hopeful is trusted less afterwards; a tree's extra forward cost is charged once the nodes branch."""
    scores = torch.tensor([0.9, 0.8, 0.6, 0.3, 0.1, 0.05])
    parents = torch.tensor([-1, 0, 1, 0, 2, 3])  # a chain of three, then branches
    cheap = CostModelK(8, CostCurve({1: 0.010, 9: 0.011}))
    costly = CostModelK(8, CostCurve({1: 0.010, 9: 0.090}))
    assert cheap.tree_size(scores, parents, 0.0, 4) == 6
    assert costly.tree_size(scores, parents, 0.0, 4) < cheap.tree_size(scores, parents, 0.0, 4)
    seeded = CostModelK(8, CostCurve({1: 0.010, 9: 0.090}), draft_s_per_token=0.0)
    # a seeded run's cut never follows the clock
    assert seeded.tree_size(scores, parents, 0.0, 4) == seeded.tree_size(scores, parents, 0.5, 4)
    assert costly.tree_size(scores, parents, 0.5, 4) != costly.tree_size(scores, parents, 0.0, 4)
    dear_trees = CostModelK(8, CostCurve({1: 0.010, 9: 0.011}), tree_overhead=CostCurve({1: 0.0, 3: 0.010, 9: 0.010}))
    # the chain, uncharged; branching would not pay the overhead
    assert dear_trees.tree_size(scores, parents, 0.0, 4) == 3
    assert dear_trees.tree_size(scores, torch.arange(-1, 5), 0.0, 6) == 6  # a chain of six is never charged it
    before = cheap.calibration
    cheap.tree_size(scores, parents, 0.0, 4)
    cheap.observe(_outcome(depth=6, accepted=0, nodes=6, draft_steps=6, draft_s=0.0))
    assert cheap.calibration < before


def test_eagle_survives_one_token_prompts_and_anchor_steps() -> None:
    """A one-token prompt, and a guard's anchor steps (the drafter starts over mid-sequence): still drafting, still
    lossless."""
    from specdec.config import GuardConfig

    tokenizer, model = models()[0], models()[1]["llama"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none")
    drafter = EagleDrafter(
        build_eagle(model, torch.arange(len(tokenizer)), 1), model.get_input_embeddings(), len(tokenizer), min_score=0.0
    )
    gen = Generator(target.target, drafter)
    one = [int(tokenizer("a")["input_ids"][-1])]
    assert (
        gen.generate(one, max_new_tokens=12, stop_on_eos=False, k_policy="fixed").token_ids
        == target.generate(one, max_new_tokens=12, stop_on_eos=False).token_ids
    )
    anchored = GenerationConfig(
        k=4, k_policy="fixed", max_new_tokens=40, stop_on_eos=False, guards=GuardConfig(anchor_every=8)
    )
    got = gen.generate(PROMPTS[0], anchored)
    assert got.token_ids == target.generate(PROMPTS[0], anchored).token_ids
    assert got.stats.anchors >= 3
    assert any(got.stats.proposed_per_step[-6:]), "the head drafts again after the anchors"


def _outcome(depth: int, accepted: int, nodes: int, draft_steps: int, draft_s: float = 5.0) -> StepOutcome:
    """A step that drafted ``depth`` levels in ``draft_steps`` model steps for ``nodes`` verified nodes, priced."""
    return step_outcome(depth, accepted, nodes=nodes, draft_steps=draft_steps, draft_s=draft_s)
