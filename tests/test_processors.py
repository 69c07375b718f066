"""Bias, penalties and min-p: OpenAI's definitions, each verified position processed from its own context (drafts
included), greedy output identical to target-only and sampled output following the processed target's law."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import loaded, perturbed, tiny_llama
from test_distribution import MIN_PVALUE, _check, _config
from typer.testing import CliRunner

import specdec.engine.rows as rows_module  # where the step shapes each row's logits (Row.shape_logits)
from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.lossless import STEP_CASES, TargetLaw
from specdec.cli.main import app
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.verification import to_probs
from specdec.verification.processors import process

PENALIZED = SamplingConfig(
    presence_penalty=0.6, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias=((3, 2.5), (5, -1.5))
)


def test_each_processor_follows_its_definition() -> None:
    """Worked by hand: bias added; a token seen in prompt or output has a positive logit divided by the repetition
    penalty and a negative one multiplied; then minus count x frequency and presence once, over the output's tokens."""
    logits = torch.tensor([[1.0, -2.0, 3.0, 0.5, 4.0, -1.0]])
    context = torch.tensor([2, 1, 4, 4, 2])  # prompt [2, 1]; output [4, 4, 2]
    sampling = SamplingConfig(
        presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0, logit_bias=((0, 1.0), (1, 1.0))
    )
    process(logits, context, 2, torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), sampling)
    expected = [
        1.0 + 1.0,  # bias only: never seen
        (-2.0 + 1.0) * 2.0,  # bias, then seen in the prompt and negative: multiplied; not in the output
        3.0 / 2.0 - (1 * 0.25 + 0.5),  # in the output once
        0.5,
        4.0 / 2.0 - (2 * 0.25 + 0.5),  # in the output twice
        -1.0,
    ]
    assert logits[0].tolist() == pytest.approx(expected)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_each_position_is_processed_as_if_decoded_alone(tree: bool) -> None:
    """Column j + 1 of a step equals the one column target-only decoding would process after the path to node j,
    bit for bit."""
    gen = torch.Generator().manual_seed(0)
    vocab, context, prompt_length = 12, torch.tensor([1, 4, 4, 7, 2, 4, 9]), 3
    drafts = torch.tensor([4, 7, 4, 11, 2, 4])
    links = torch.tensor([-1, 0, 1, 0, 3, 2]) if tree else torch.arange(-1, 5)
    raw = torch.randn(len(drafts) + 1, vocab, generator=gen) * 3
    stepped = raw.clone()
    process(stepped, context, prompt_length, drafts, links, PENALIZED)
    for column in range(len(drafts) + 1):
        path, node = [], column - 1
        while node >= 0:
            path.insert(0, int(drafts[node]))
            node = int(links[node])
        alone = raw[column : column + 1].clone()
        none = torch.zeros(0, dtype=torch.long)
        process(alone, torch.cat([context, torch.tensor(path, dtype=torch.long)]), prompt_length, none, none, PENALIZED)
        assert torch.equal(alone[0], stepped[column]), column


def test_min_p_drops_tokens_below_its_share_of_the_likeliest() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.12, 0.08]))
    probs = to_probs(logits, SamplingConfig(temperature=1.0, min_p=0.2))
    assert probs[3] == 0 and probs[2] > 0  # 0.08 < 0.2 x 0.5 <= 0.12
    assert probs.sum().item() == pytest.approx(1.0)


def test_bad_settings_are_refused_by_name() -> None:
    for settings, named in [
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"logit_bias": ((1, 200.0),)}, "logit_bias"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "logit_bias"),
        ({"logit_bias": ((1, math.nan),)}, "logit_bias"),
    ]:
        with pytest.raises(ConfigError, match=named):
            SamplingConfig(**settings)
    target = loaded(tiny_llama(0))
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        Generator(target, NoDrafter()).generate(
            [1, 2], max_new_tokens=2, sampling=SamplingConfig(logit_bias=((10**6, 1),))
        )


def test_greedy_with_penalties_equals_target_only_and_a_plain_loop() -> None:
    """Single and batched, chains and trees: speculative greedy output equals target-only's, and both equal a loop of
    full forwards applying the definitions by hand."""
    target = tiny_llama(0)
    prompts = [[1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41]]
    config = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=24, stop_on_eos=False, sampling=PENALIZED)
    expected = [_by_hand(target, p, 24, PENALIZED) for p in prompts]
    baseline = Generator(loaded(target), NoDrafter())
    assert [baseline.generate(p, config).token_ids for p in prompts] == expected
    drafted = Generator(loaded(target), ModelDrafter(TransformersBackend(perturbed(target, noise=0.2, seed=1))))
    for run in (
        lambda: [drafted.generate(p, config).token_ids for p in prompts],
        lambda: [r.token_ids for r in drafted.generate_batch(prompts, config)],
        lambda: [drafted.generate(p, config, branches=2).token_ids for p in prompts],
    ):
        assert run() == expected
    looked_up = Generator(loaded(target), PromptLookupDrafter())
    results = [looked_up.generate(p, config) for p in prompts]
    assert [r.token_ids for r in results] == expected
    assert sum(r.stats.draft_tokens_proposed for r in results) > 0  # copies of penalized tokens were proposed


def _by_hand(model, prompt: list[int], new: int, s: SamplingConfig) -> list[int]:
    """Greedy decoding by full forwards, each processor written out from its definition."""
    tokens = list(prompt)
    for _ in range(new):
        with torch.no_grad():
            logits = model(torch.tensor([tokens])).logits[0, -1].float()
        for token, bias in s.logit_bias:
            logits[token] += bias
        output = tokens[len(prompt) :]
        for token in set(tokens):
            value = logits[token]
            logits[token] = value / s.repetition_penalty if value > 0 else value * s.repetition_penalty
        for token in set(output):
            logits[token] -= output.count(token) * s.frequency_penalty + s.presence_penalty
        tokens.append(int(logits.argmax()))
    return tokens[len(prompt) :]


VOCAB, PROMPT = 8, [1, 5, 3]
SAMPLED = SamplingConfig(
    temperature=1.0, top_p=0.97, min_p=0.05, presence_penalty=1.2, frequency_penalty=0.8, logit_bias=((2, 1.0),)
)


class ProcessedLaw(TargetLaw):
    """The target's law after ``prompt`` + prefix with bias and penalties processed from that whole context."""

    def __call__(self, prefix: tuple[int, ...]) -> torch.Tensor:
        if prefix not in self._cache:
            with torch.no_grad():
                logits = self.model(torch.tensor([self.prompt + list(prefix)])).logits[0, -1:].float()
            none = torch.zeros(0, dtype=torch.long)
            process(logits, torch.tensor(self.prompt + list(prefix)), len(self.prompt), none, none, self.sampling)
            self._cache[prefix] = to_probs(logits[0], self.sampling).double()
        return self._cache[prefix]


def _sampled_law_pvalue() -> float:
    target = tiny_llama(3, vocab=VOCAB, scale=0.15)
    gen = Generator(loaded(target), ModelDrafter(TransformersBackend(perturbed(target, noise=0.4, seed=1))))
    results = [gen.generate(PROMPT, _config(SAMPLED, seed)) for seed in range(3000)]
    samples, stats = [tuple(r.token_ids) for r in results], [r.stats for r in results]
    return _check(samples, stats, ProcessedLaw(target, PROMPT, SAMPLED), STEP_CASES)


@pytest.mark.slow  # 25-40 s: the fast tier keeps greedy identity under the same processors
def test_sampled_output_with_penalties_follows_the_processed_law() -> None:
    assert _sampled_law_pvalue() > MIN_PVALUE


@pytest.mark.slow
def test_penalties_that_ignore_the_drafts_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: every position processed from the context without the drafts before it breaks the law."""
    real = rows_module.process

    def without_drafts(logits, context, prompt_length, drafts, links, sampling) -> None:
        real(logits, context, prompt_length, drafts[:0], links[:0], sampling)

    monkeypatch.setattr(rows_module, "process", without_drafts)
    try:
        pvalue = _sampled_law_pvalue()
    except AssertionError as caught:  # a token the processed law gives no chance (min-p, top-p): caught outright
        assert "outside the shaped target's support" in str(caught)
        return
    assert pvalue < MIN_PVALUE


def test_the_cli_takes_penalties_and_refuses_a_malformed_bias(tiny_folder) -> None:
    runner = CliRunner()
    args = ["generate", "hello", "--target", str(tiny_folder), "--draft", "none", "--max-new-tokens", "4"]
    ok = runner.invoke(app, [*args, "--frequency-penalty", "0.5", "--logit-bias", "3=-100", "--min-p", "0.1"])
    assert ok.exit_code == 0, ok.output
    bad = runner.invoke(app, [*args, "--logit-bias", "three=1"])
    assert bad.exit_code != 0 and "--logit-bias takes TOKEN_ID=BIAS" in bad.output and "Traceback" not in bad.output
