"""The engine on tiny random-weight models: greedy identity, sampled distribution, KV rollback, stopping."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import char_tokenizer, loaded, perturbed, tiny_gemma3, tiny_llama

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import with_overrides
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.drafters.base import Drafter, DrafterCapabilities, DraftSettings, Proposal
from specdec.engine import Decoder
from specdec.models import TransformersBackend
from specdec.models.backend import OneRow
from specdec.scheduling import FixedK

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41], [1, 7]]


def _drafters(target_model, seed: int):
    yield "prompt-lookup", PromptLookupDrafter()
    yield "same model", ModelDrafter(TransformersBackend(target_model))  # good draft: always right
    # partial agreement
    yield "noisy copy", ModelDrafter(TransformersBackend(perturbed(target_model, noise=0.5, seed=seed)))
    yield "random model", ModelDrafter(TransformersBackend(tiny_llama(seed + 100, layers=1)))  # bad draft


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_greedy_is_identical_to_target_only(make_target, seed: int) -> None:
    target = loaded(make_target(seed))
    baseline = Generator(target, NoDrafter())
    for prompt in PROMPTS:
        expected = baseline.generate(prompt, max_new_tokens=30, stop_on_eos=False).token_ids
        assert len(expected) == 30
        for (name, drafter), k in itertools.product(_drafters(target.model, seed), (1, 3, 8)):
            got = Generator(target, drafter).generate(
                prompt, max_new_tokens=30, k=k, k_policy="fixed", stop_on_eos=False
            )
            assert got.token_ids == expected, f"{name} k={k} prompt={prompt}"


def test_good_draft_is_fully_accepted_and_bad_draft_is_not() -> None:
    target = loaded(tiny_llama(0))
    good = Generator(target, ModelDrafter(TransformersBackend(target.model))).generate(
        [1, 3], max_new_tokens=25, k=4, k_policy="fixed", stop_on_eos=False
    )
    assert good.stats.acceptance_rate == 1.0
    assert good.stats.target_forwards == 5  # 5 steps of 5 tokens; the first also reads the prompt
    bad = Generator(target, ModelDrafter(TransformersBackend(tiny_llama(7)))).generate(
        [1, 3], max_new_tokens=25, k=4, k_policy="fixed", stop_on_eos=False
    )
    assert bad.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_cache_after_rejection_equals_fresh_forward(make_target) -> None:
    model = make_target(5)
    backend = TransformersBackend(model)
    seq = torch.randint(3, 90, (1, 20), generator=torch.Generator().manual_seed(0))
    backend.forward(seq[:, :9])
    for step_end in (12, 15, 20):
        # A step that feeds the true tokens plus a wrong guess, then rolls back as after a rejection.
        accepted = seq[:, backend.cached_length : step_end - 1]
        backend.forward(torch.cat([accepted, torch.randint(3, 90, (1, 4))], dim=1))
        backend.truncate(step_end - 1)
        got = backend.forward(seq[:, step_end - 1 : step_end])[0, -1]
        with torch.no_grad():
            fresh = model(seq[:, :step_end]).logits[0, -1]
        torch.testing.assert_close(got, fresh, rtol=1e-4, atol=1e-4)


def test_engine_keeps_caches_at_accepted_prefix() -> None:
    target_model = tiny_gemma3(1)
    draft_model = perturbed(target_model, noise=0.5)
    target, draft = TransformersBackend(target_model), TransformersBackend(draft_model)
    drafter = ModelDrafter(draft)
    prompt = [1, 4, 8, 15, 16, 23, 42]
    run = Generator(loaded(target_model), drafter).completion(prompt, max_new_tokens=40, stop_on_eos=False)
    decoder = Decoder(OneRow(target))
    decoder.join(run, drafter, FixedK(4))
    while decoder.rows:
        decoder.step()
        tokens = len(prompt) + len(run.token_ids)
        assert target.cached_length == tokens - 1  # all but the pending token
        assert draft.cached_length <= tokens - 1
    stats = run.stats
    assert stats.new_tokens == 40
    assert 0 < stats.draft_tokens_accepted < stats.draft_tokens_proposed


def test_seeded_sampling_is_reproducible() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(target, ModelDrafter(TransformersBackend(tiny_llama(1))))
    # k must not depend on wall-clock time (cost-model's draft-cost estimate does): fixed k here.
    runs = [
        gen.generate(
            [1, 2, 3], max_new_tokens=20, temperature=1.0, seed=s, k_policy="fixed", stop_on_eos=False
        ).token_ids
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


class Oracle(Drafter):
    """Deterministic drafts from a known continuation, every third token wrong (a tree: the wrong chain beside the
    right one): steps accept, reject and branch, whatever k."""

    capabilities = DrafterCapabilities(trees=True)

    def __init__(self, known: list[int]) -> None:
        self.known = known

    def begin(self, settings: DraftSettings) -> None:
        pass

    def fork(self) -> Oracle:
        return Oracle(self.known)

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        right = self.known[len(context) : len(context) + k]
        wrong = [t if (len(context) + i) % 3 else (t + 1) % 96 for i, t in enumerate(right)]
        if branches == 1:
            return Proposal(torch.tensor(wrong, dtype=torch.long), steps=0)
        return Proposal.tree([wrong, right], k, steps=0)


def test_a_seed_gives_the_target_only_output_whatever_is_drafted() -> None:
    """Sampling with a seed and deterministic drafts: the target-only output for that seed, whatever k, chains or
    trees, alone or beside other rows under the dynamic k_cap (which caps k by the load)."""
    target = loaded(tiny_llama(0))
    settings = dict(max_new_tokens=40, temperature=0.8, seed=7, stop_on_eos=False)
    expected = Generator(target, "none").generate(PROMPTS[0], **settings).token_ids
    gen = Generator(target, Oracle(PROMPTS[0] + expected))
    for k, branches in ((1, 1), (3, 1), (8, 1), (8, 4)):
        got = gen.generate(PROMPTS[0], k=k, k_policy="fixed", branches=branches, **settings)
        assert got.token_ids == expected, (k, branches)
        assert 0 < got.stats.draft_tokens_accepted < got.stats.draft_tokens_proposed
    beside = GenerationConfig(k=2, max_new_tokens=30, stop_on_eos=False, sampling=SamplingConfig(temperature=1.0))
    together = gen.generate_batch(
        [PROMPTS[0], [1, 40, 41]], [with_overrides(GenerationConfig(k=6), **settings), beside]
    )
    assert together[0].token_ids == expected
    assert Generator(target, "prompt-lookup").generate(PROMPTS[0], **settings).token_ids == expected


def test_text_stop_strings_eos_and_streaming() -> None:
    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer))
    gen = Generator(loaded(model, tokenizer=tokenizer), PromptLookupDrafter())
    full = gen.generate("ab ab ab", max_new_tokens=40, stop_on_eos=False)
    assert len(full.token_ids) == 40 and full.finish_reason == "length"
    stop = full.text[5:7]
    stopped = gen.generate("ab ab ab", max_new_tokens=40, stop=stop, stop_on_eos=False)
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.find(stop)]
    assert stopped.token_ids == full.token_ids[: len(stopped.token_ids)]
    assert "".join(gen.stream("ab ab ab", max_new_tokens=40, stop_on_eos=False)) == full.text
    assert "".join(gen.stream("ab ab ab", max_new_tokens=40, stop=stop, stop_on_eos=False)) == stopped.text

    eos_model = tiny_llama(0, vocab=len(tokenizer))
    with torch.no_grad():
        eos_model.lm_head.bias = None
        eos_model.lm_head.weight[2] = eos_model.lm_head.weight[full.token_ids[3]] * 2  # EOS wins where token 3 would
    ended = Generator(loaded(eos_model, tokenizer=tokenizer), NoDrafter()).generate("ab ab ab", max_new_tokens=40)
    assert ended.finish_reason == "eos"
    assert ended.token_ids[-1] == 2 and len(ended.token_ids) < 40


def test_stop_strings_are_searched_where_they_can_complete() -> None:
    """Each step searches only from the longest stop string's length before the new text: over random texts of a few
    letters fed in random chunks, with overlapping stop strings, the tracker keeps the tokens, cuts the text and
    streams the pieces that searching the whole text every step gives, and never takes streamed text back."""
    import random

    from specdec.engine.text import TextTracker

    def held(text: str, stops: tuple[str, ...]) -> int:  # the end of what may be streamed, searched the long way
        end = len(text)
        for stop in stops:
            end -= next((n for n in range(min(len(stop) - 1, end), 0, -1) if text[end - n : end] == stop[:n]), 0)
        return end

    tokenizer = char_tokenizer()
    rng, stopped = random.Random(0), 0
    for _ in range(300):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(1, 150)))
        stops = tuple({"".join(rng.choice("ab c") for _ in range(rng.randrange(1, 14))) for _ in range(4)})
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]  # one token per character
        tracker, fed, streamed, emitted = TextTracker(tokenizer, stops), 0, "", 0
        while fed < len(ids) and not tracker.stopped:
            chunk = ids[fed : fed + rng.randrange(1, 10)]
            starts = [text[: fed + len(chunk)].find(stop) for stop in stops]
            cut = min((i for i in starts if i >= 0), default=None)
            kept = (
                len(chunk)
                if cut is None
                else next(n for n in range(1, len(chunk) + 1) if any(0 <= text[: fed + n].find(stop) for stop in stops))
            )
            assert tracker.add(chunk) == chunk[:kept]
            fed += kept
            expected = text[:fed] if cut is None else text[:cut]
            assert tracker.text == expected and tracker.stopped == (cut is not None)
            piece = tracker.delta(final=tracker.stopped)
            end = len(expected) if tracker.stopped else max(held(expected, stops), emitted)
            assert piece == expected[emitted:end]
            streamed, emitted = streamed + piece, end
        stopped += tracker.stopped
        assert streamed + tracker.delta(final=True) == tracker.text
    assert stopped > 100  # stop strings were found, mid-chunk and across chunks


def test_context_limit_ends_generation() -> None:
    model = tiny_llama(0)
    gen = Generator(loaded(model), PromptLookupDrafter())
    result = gen.generate([1, 5, 9] * 80, max_new_tokens=100, k=8, k_policy="fixed", stop_on_eos=False)
    assert result.finish_reason == "context"
    assert 240 + len(result.token_ids) == 256
