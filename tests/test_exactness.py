"""Exactness where it is easy to lose: devices, captured graphs, bounded caches, drafter state, shared Generators,
counts, seeds."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from conftest import char_tokenizer, loaded, perturbed, tiny_gemma3, tiny_llama
from fake_device import DEVICE, FakeDevice, OnFakeDevice
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import GPT2Config, GPT2LMHeadModel

from specdec import GenerationConfig, Generator
from specdec.config import BatchConfig
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.engine import Decoder, DecodeStats
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.models.backend import OneRow
from specdec.models.batched import BatchedTransformersBackend
from specdec.models.cuda_graphs import CudaGraphs
from specdec.models.target import Target
from specdec.scheduling import KPlan, KPolicy
from specdec.seeds import Seeds

PROMPT = [1, 5, 9, 5, 9, 5, 9, 12]


def _fake_device_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Seeds hand out the fake device's generators for the fake device (torch has none for it)."""
    create = Seeds._create
    monkeypatch.setattr(
        Seeds,
        "_create",
        lambda self, device: FakeDevice.generator(self.seed) if device == DEVICE else create(self, device),
    )


@pytest.mark.parametrize("draft_on", ["host", "fake device"])
def test_every_tensor_meets_the_logits_on_their_device(monkeypatch: pytest.MonkeyPatch, draft_on: str) -> None:
    """The target on another device than the host: no operation mixes devices, draws use that device's generator,
    output unchanged."""
    _fake_device_seeds(monkeypatch)
    model, draft = tiny_llama(0), perturbed(tiny_llama(0), noise=0.5)
    settings = dict(max_new_tokens=16, k=3, k_policy="fixed", stop_on_eos=False)
    plain = Generator(loaded(model), ModelDrafter(TransformersBackend(draft)))
    expected = plain.generate(PROMPT, **settings).token_ids
    expected_sampled = plain.generate(PROMPT, temperature=1.0, seed=(1 << 48) + 3, **settings).token_ids

    wrap = OnFakeDevice if draft_on == "fake device" else lambda backend: backend
    target = Target("tiny", OnFakeDevice(TransformersBackend(model)), None, frozenset({2}))
    gen = Generator(target, ModelDrafter(wrap(TransformersBackend(draft))))
    mode = FakeDevice()
    with torch.inference_mode(), mode:
        assert gen.generate(PROMPT, **settings).token_ids == expected
        sampled = [gen.generate(PROMPT, temperature=1.0, seed=3, **settings).token_ids for _ in range(2)]
        [batched] = gen.generate_batch(
            [PROMPT], decoder=Decoder(OnFakeDevice(BatchedTransformersBackend(model))), **settings
        )
        [batched_sampled] = gen.generate_batch(
            [PROMPT],
            decoder=Decoder(OnFakeDevice(BatchedTransformersBackend(model))),
            temperature=1.0,
            seed=3,
            **settings,
        )
    assert mode.operations > 100
    assert sampled[0] == sampled[1] == batched_sampled.token_ids  # a seed reproduces on the device it runs on
    assert batched.token_ids == expected
    if draft_on == "fake device":  # every draw is on the fake device: the same draws as host generators with its seeds
        assert sampled[0] == expected_sampled


class AuditedGraphs(CudaGraphs):
    """CUDA graphs' bookkeeping on the host: a "replay" runs the captured step again on its static inputs, recording
    every tensor it reads."""

    def __init__(self, persistent: Callable[[], list[torch.Tensor]]) -> None:
        super().__init__()
        # tensors that outlive every graph: weights, and the cache buffers until they are reallocated
        self.persistent = persistent
        self.outside: list[str] = []  # tensors a step read that were neither static inputs nor persistent
        self.captures = self.replays = 0

    def capture(self, step):
        static = list(step.args[0].values())  # the step is the forward over the graph's static inputs
        output = self._audited(step, static)
        self.captures += 1
        graphs = self

        class Replay:
            def replay(self) -> None:
                output.copy_(graphs._audited(step, static))
                graphs.replays += 1

        return Replay(), output

    def _audited(self, step, static: list[torch.Tensor]) -> torch.Tensor:
        made: set[int] = set()
        read: dict[int, str] = {}

        class Record(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                for t in tree_flatten((args, kwargs or {}))[0]:
                    if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in made:
                        read.setdefault(t.untyped_storage().data_ptr(), f"{func} {tuple(t.shape)}")
                out = func(*args, **(kwargs or {}))
                made.update(t.untyped_storage().data_ptr() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor))
                return out

        with Record():
            result = step()
        allowed = {t.untyped_storage().data_ptr() for t in static + self.persistent()} | {0}
        self.outside += [what for ptr, what in read.items() if ptr not in allowed]
        return result


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_captured_steps_read_only_static_inputs(make_target) -> None:
    """Every tensor a captured step reads is a static input (refreshed before each replay) or a buffer that outlives
    the graph."""
    model = make_target(2)
    gen = Generator(loaded(model), PromptLookupDrafter())
    prompts = [PROMPT, [1, 40, 41, 42, 40, 41], [1, 7, 7, 7]]
    settings = dict(max_new_tokens=20, k=3, k_policy="fixed", stop_on_eos=False)
    expected = [r.token_ids for r in gen.generate_batch(prompts, **settings)]

    backend = BatchedTransformersBackend(model)
    weights = list(model.parameters()) + list(model.buffers())
    backend.graphs = graphs = AuditedGraphs(lambda: weights + backend.cache.keys + backend.cache.values)
    got = [r.token_ids for r in gen.generate_batch(prompts, decoder=Decoder(backend), **settings)]
    assert 0 < graphs.captures < graphs.replays, "steps were captured and replayed"
    assert got == expected  # replays on refreshed static inputs give the uncaptured outputs
    assert not graphs.outside, f"captured steps read tensors made outside the graph: {graphs.outside[:3]}"


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "model"])
def test_sliding_window_caches_stay_bounded(drafter: str) -> None:
    window, k = 6, 3
    model = tiny_gemma3(3, sliding_window=window)
    draft_backend = TransformersBackend(perturbed(model, noise=0.3))
    drafters = {"none": NoDrafter(), "prompt-lookup": PromptLookupDrafter(), "model": ModelDrafter(draft_backend)}
    gen = Generator(loaded(model), drafters[drafter])
    result = gen.generate(PROMPT, max_new_tokens=3 * window * 2, k=k, k_policy="fixed", stop_on_eos=False)

    with torch.no_grad():  # greedy by full forwards, without any cache
        seq = list(PROMPT)
        for _ in range(len(result.token_ids)):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    assert result.token_ids == seq[len(PROMPT) :]
    caches = [gen.backend._cache] + ([draft_backend._cache] if drafter == "model" else [])
    for cache in caches:
        sliding = [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]
        assert sliding
        assert all(layer.keys.shape[-2] <= window + k + 1 for layer in sliding), [
            layer.keys.shape[-2] for layer in sliding
        ]


class Recording:
    """A backend that records which token it wrote at each position, and every rollback that dropped an accepted
    position."""

    def __init__(self, inner: TransformersBackend) -> None:
        self.inner = inner
        self.writes: list[tuple[int, int]] = []  # (position, token)
        self.kept = 0  # positions kept by the last rollback: accepted, never to be dropped in this sequence
        self.dropped: list[tuple[int, int]] = []  # (kept, truncated to) of rollbacks below an accepted position

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def forward(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        start = self.inner.cached_length
        self.writes += [(start + i, int(t)) for i, t in enumerate(tokens[0])]
        return self.inner.forward(tokens, last, tree, features)

    def forward_argmax(
        self, tokens: torch.Tensor, last: int | None = None, tree: torch.Tensor | None = None, features: bool = False
    ) -> torch.Tensor:
        return self.forward(tokens, last, tree, features).max(dim=-1).indices

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        if length < self.kept:
            self.dropped.append((self.kept, length))
        self.kept = max(self.kept, length)
        self.inner.truncate(length, branch)

    def reset(self) -> None:
        self.kept = 0
        self.inner.reset()

    def row_backend(self, *, batch: bool, trees: bool = False, cuda_graphs: bool = True) -> OneRow:
        """Rows over this wrapper, so that a sequence's steps are recorded."""
        return OneRow(self.fork() if batch else self)


class Alternating(KPolicy):
    """k = 4, then a step without drafts, and so on."""

    def __init__(self) -> None:
        self.ks = itertools.cycle([4, 0])

    def plan(self, context_length: int, trees: bool) -> KPlan:
        return KPlan(next(self.ks))

    def observe(self, outcome) -> None:
        pass


def test_a_step_without_drafts_keeps_the_draft_cache() -> None:
    """Steps with k = 0 between drafting steps: the draft model never re-reads a token its cache already held."""
    target = tiny_llama(0)
    draft = Recording(TransformersBackend(perturbed(target, noise=0.5)))
    drafter = ModelDrafter(draft)
    run = Generator(loaded(target), drafter).completion(PROMPT, k=4, max_new_tokens=40, stop_on_eos=False)
    decoder = Decoder(OneRow(TransformersBackend(target)))
    decoder.join(run, drafter, Alternating())
    while decoder.rows:
        decoder.step()
    stats, tokens = run.stats, PROMPT + run.token_ids
    assert stats.draft_tokens_accepted > 0 and 0 in stats.k_per_step
    assert not draft.dropped, f"the draft's cache dropped accepted positions (kept, truncated to): {draft.dropped}"
    assert {p for p, _ in draft.writes} >= set(range(len(tokens) - 1 - 4))  # it did keep reading the new context


def _char_generator(drafter_model=None) -> tuple[Generator, Any]:
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    draft = ModelDrafter(TransformersBackend(drafter_model or perturbed(model, noise=0.5)))
    return Generator(loaded(model, tokenizer=tokenizer), draft), model


def test_interleaved_completions_on_one_generator(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    gen, _ = _char_generator()
    settings = dict(max_new_tokens=24, k=3, k_policy="fixed", stop_on_eos=False)
    alone = {p: gen.generate(p, **settings).token_ids for p in ("ab ab ab", "the cat")}

    # One run starts, a second runs to its end, the first finishes.
    first = gen.completion("ab ab ab", **settings)
    pieces = iter(first)
    next(pieces)
    assert gen.generate("the cat", **settings).token_ids == alone["the cat"]
    list(pieces)
    assert first.result().token_ids == alone["ab ab ab"]

    # A run that measures the cost curve for the first time (cost-model k) while another is suspended mid-run.
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    solo, _ = _char_generator()
    solo.backend = solo_recorded = Recording(solo.backend)
    solo.generate("ab ab ab", **settings)
    fresh, _ = _char_generator()
    fresh.backend = recorded = Recording(fresh.backend)
    first = fresh.completion("ab ab ab", **settings)
    pieces = iter(first)
    next(pieces)
    fresh.generate("the cat", max_new_tokens=4, k_policy="cost-model")
    list(pieces)
    assert (tmp_path / "costs").is_dir()  # it did measure
    assert first.result().token_ids == alone["ab ab ab"]
    # The measurement neither used nor emptied the suspended run's cache.
    assert recorded.writes and recorded.writes == solo_recorded.writes

    # Two runs advance in turn, the first one ends first.
    runs = [gen.completion(p, **settings) for p in ("ab ab ab", "the cat")]
    iterators = [iter(run) for run in runs]
    for step in itertools.zip_longest(*iterators):
        assert any(piece is not None for piece in step)
    assert [run.result().token_ids for run in runs] == [alone["ab ab ab"], alone["the cat"]]
    assert gen.generate("the cat", **settings).token_ids == alone["the cat"]  # the Generator's own state is free again


class SingleSequence(TransformersBackend):
    """A backend that cannot fork, like llama.cpp's."""

    def fork(self):
        raise ConfigError("a llama.cpp model decodes one sequence per context")


def test_second_live_completion_on_a_single_sequence_backend_is_an_error() -> None:
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    gen = Generator(Target("tiny", SingleSequence(model), tokenizer, frozenset({2})), PromptLookupDrafter())
    first = iter(gen.stream("ab ab", max_new_tokens=10, stop_on_eos=False))
    next(first)
    with pytest.raises(ConfigError, match="another completion of this Generator is still decoding"):
        next(iter(gen.stream("the cat", max_new_tokens=10)))
    list(first)
    assert gen.generate("the cat", max_new_tokens=4).token_ids  # free again once the first has ended


def _emitted_per_step(stats: DecodeStats, emitted: int) -> None:
    """The stats describe exactly the ``emitted`` tokens: each step's accepted drafts were emitted, and nothing else
    counts."""
    assert stats.new_tokens == emitted
    assert stats.draft_tokens_accepted == sum(stats.accepted_per_step)
    assert stats.draft_tokens_proposed == sum(stats.proposed_per_step)
    produced = [a + 1 for a in stats.accepted_per_step]
    assert sum(produced[:-1]) < emitted <= sum(produced)
    assert stats.accepted_per_step[-1] <= emitted - sum(produced[:-1])


def test_counts_match_what_was_emitted() -> None:
    """EOS and stop strings inside a run of accepted drafts: only the tokens emitted count as accepted."""
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    with torch.no_grad():
        model.lm_head.weight[2] = model.lm_head.weight[2] * 0 + model.lm_head.weight[14] * 2  # EOS wins where "l" would
    gen = Generator(loaded(model, tokenizer=tokenizer), ModelDrafter(TransformersBackend(model)))  # a perfect draft
    settings = dict(max_new_tokens=40, k=8, k_policy="fixed")
    ended = gen.generate("ab ab ab", **settings)
    full = gen.generate("ab ab ab", stop_on_eos=False, **settings)
    assert ended.finish_reason == "eos" and len(ended.token_ids) < len(full.token_ids)
    last = len(ended.stats.accepted_per_step) - 1  # the two runs take the same steps up to here
    assert full.stats.accepted_per_step[last] > ended.stats.accepted_per_step[last], (
        "EOS fell inside a run of accepted drafts"
    )
    _emitted_per_step(ended.stats, len(ended.token_ids))

    stop = full.text[3:5]
    stopped = gen.generate("ab ab ab", stop=stop, stop_on_eos=False, **settings)
    assert stopped.finish_reason == "stop"
    _emitted_per_step(stopped.stats, len(stopped.token_ids))
    [batched] = gen.generate_batch(["ab ab ab"], **settings)
    assert batched.token_ids == ended.token_ids
    _emitted_per_step(batched.stats, len(batched.token_ids))


def test_draft_model_context_limit_is_respected() -> None:
    """A draft with learned positions for 32 tokens (an IndexError past them) under a target with 256."""
    target = tiny_llama(0)
    draft = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    expected = Generator(loaded(target), NoDrafter()).generate(PROMPT, max_new_tokens=60, stop_on_eos=False).token_ids
    settings = dict(max_new_tokens=60, k=4, k_policy="fixed", stop_on_eos=False)
    gen = Generator(loaded(target), ModelDrafter(TransformersBackend(draft)))
    result = gen.generate(PROMPT, **settings)
    assert result.token_ids == expected
    # drafting stopped at the draft's limit
    assert result.stats.proposed_per_step[0] > 0 and result.stats.proposed_per_step[-1] == 0
    [batched] = gen.generate_batch([PROMPT], **settings)
    assert batched.token_ids == expected


class JitteryClock:
    """A clock whose intervals are random: live timings that differ from run to run."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.rng.choice([1e-6, 1e-4, 1e-2, 1.0])
        return self.now


def test_a_seed_reproduces_output_under_the_default_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    import specdec.engine.rows as rows  # the step's clock (Timer)

    assert GenerationConfig().k_policy == "cost-model"
    target = tiny_llama(0, layers=8)  # costlier than its one-layer draft, so the cost model drafts
    settings = dict(max_new_tokens=30, temperature=1.0, seed=11, stop_on_eos=False)
    runs, batched = [], []
    for clock in range(3):
        monkeypatch.setattr(rows, "time", JitteryClock(clock))
        # A batch's dynamic k_cap follows the load (other rows, memory): a seed reproduces a batched row under the
        # fixed k_cap.
        gen = Generator(
            loaded(target),
            ModelDrafter(TransformersBackend(tiny_llama(1, layers=1))),
            batch=BatchConfig(k_cap="fixed"),
        )
        runs.append(gen.generate(PROMPT, **settings))
        batched.append(gen.generate_batch([PROMPT], **settings)[0].token_ids)
    assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids
    assert batched[0] == batched[1] == batched[2]
    assert any(runs[0].stats.k_per_step)  # the policy did draft


def test_each_device_draws_its_own_stream() -> None:
    """One seed, different generators per device: a draft's draws on one GPU must not decide the verifier's on
    another."""
    seeds = Seeds(7)
    per_device = [seeds.seed_for(torch.device(d)) for d in ("cpu", "cuda:0", "cuda:1", "mps:0")]
    assert per_device[0] == 7 and len(set(per_device)) == 4
    assert all(0 <= s < 2**63 for s in per_device) and Seeds(7).seed_for(torch.device("cuda:1")) == per_device[2]
    assert seeds.on("cpu") is seeds.on(torch.device("cpu")) and seeds.on("cpu").initial_seed() == 7


def test_distilled_drafts_live_on_the_targets_device(tmp_path) -> None:
    """A distilled draft borrows the target's embedding and head: its own layers must be built on the target's device
    too."""
    from specdec.drafters.distilled import build_draft, build_exit_draft, load_draft, save_draft

    keep = torch.tensor([0, 2, 3, 5, 7, 11])
    save_draft(build_draft(tiny_llama(0), [1], keep), tmp_path / "layers", {"arch": {}})
    save_draft(build_exit_draft(tiny_llama(0), 1, keep), tmp_path / "exit", {"arch": {"exit": 1}})
    target = tiny_llama(0).to("meta")  # any device but the host: parameters built on the host would show
    drafts = {
        "built": build_draft(target, [1], keep),
        "exit": build_exit_draft(target, 1, keep),
        "loaded": load_draft(tmp_path / "layers", target),
        "loaded exit": load_draft(tmp_path / "exit", target),
    }
    for name, draft in drafts.items():
        placed = {t.device.type for t in list(draft.parameters()) + list(draft.buffers())}
        assert placed == {"meta"}, f"{name}: {placed}"
