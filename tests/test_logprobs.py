"""Log-probabilities: what speculative decoding reports equals what target-only decoding reports (bit for bit on the
native runtime), and a prompt's scores equal one forward's log-softmax."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, perturbed, tiny_llama

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import RuntimeConfig
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.errors import ConfigError
from specdec.models import TransformersBackend

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41]]


def _config(**settings) -> GenerationConfig:
    return GenerationConfig(k=4, k_policy="fixed", max_new_tokens=20, stop_on_eos=False, logprobs=3, **settings)


def _same(got, expected, exact: bool) -> None:
    assert [e.token for e in got] == [e.token for e in expected]
    for a, b in zip(got, expected, strict=True):
        if exact:
            assert (a.logprob, a.top) == (b.logprob, b.top)
        else:
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize(
    "sampling",
    [SamplingConfig(), SamplingConfig(frequency_penalty=0.7, logit_bias=((9, 2.0),))],
    ids=["plain", "penalized"],
)
def test_speculative_logprobs_equal_target_only(sampling: SamplingConfig) -> None:
    """Chains, trees and batches report each token's log-probability and its top 3 as target-only decoding does; with
    penalties, those of the penalized distribution."""
    target = tiny_llama(0)
    config = _config(sampling=sampling)
    expected = [Generator(loaded(target), NoDrafter()).generate(p, config) for p in PROMPTS]
    assert all(
        len(r.logprobs) == len(r.token_ids) and r.logprobs[0].top[0][1] >= r.logprobs[0].logprob for r in expected
    )
    drafted = Generator(loaded(target), ModelDrafter(TransformersBackend(perturbed(target, noise=0.03, seed=1))))
    for results in (
        [drafted.generate(p, config) for p in PROMPTS],
        drafted.generate_batch(PROMPTS, config),
        [drafted.generate(p, config, branches=2) for p in PROMPTS],
    ):
        assert sum(r.stats.draft_tokens_accepted for r in results) > 0
        for got, want in zip(results, expected, strict=True):
            _same(got.logprobs, want.logprobs, exact=False)


def test_native_logprobs_are_bit_equal_to_target_only(tmp_path: Path) -> None:
    tokenizer = char_tokenizer()
    folder = tmp_path / "tiny"
    tiny_llama(0, vocab=len(tokenizer), hidden=64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    native = RuntimeConfig(backend="native")
    prompt = "abcabcabcabc"
    expected = Generator(str(folder), "none", runtime=native).generate(prompt, _config())
    got = Generator(str(folder), f"model:{folder}", runtime=native).generate(prompt, _config())
    assert got.stats.draft_tokens_accepted > 0
    _same(got.logprobs, expected.logprobs, exact=True)


def test_a_prompt_is_scored_by_one_forward() -> None:
    target = tiny_llama(0)
    prompt = [1 + i % 90 for i in range(150)]  # past one chunk of positions
    scored = Generator(loaded(target), PromptLookupDrafter()).score(prompt, top=2)
    with torch.no_grad():
        logp = torch.log_softmax(target(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert scored[0] is None and len(scored) == len(prompt)
    for i, entry in enumerate(scored[1:]):
        assert entry.token == prompt[i + 1] and entry.logprob == pytest.approx(float(logp[i, prompt[i + 1]]), abs=1e-4)
        assert [t for t, _ in entry.top] == logp[i].topk(2).indices.tolist()


def test_logprobs_follow_the_tokens_kept_and_are_bounded() -> None:
    """A run cut at EOS keeps one log-probability per kept token; more than 20 alternatives is refused by name."""
    target = tiny_llama(0)
    gen = Generator(loaded(target), PromptLookupDrafter())
    free = gen.generate(PROMPTS[0], _config())
    gen.eos_ids = frozenset({free.token_ids[5]})
    cut = gen.generate(PROMPTS[0], GenerationConfig(k=4, k_policy="fixed", max_new_tokens=20, logprobs=0))
    assert cut.finish_reason == "eos" and len(cut.logprobs) == len(cut.token_ids) <= 6
    assert all(entry.top == () for entry in cut.logprobs)
    with pytest.raises(ConfigError, match="logprobs"):
        GenerationConfig(logprobs=21)
