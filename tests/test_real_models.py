"""The engine on the real bundled models (Gemma-3-270M target, SmolLM2-135M)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import assert_lookup_matches_greedy
from typer.testing import CliRunner

from specdec import Generator
from specdec.cli.main import app
from specdec.models import load_model
from specdec.models.llamacpp import llama_cpp_problem

pytestmark = pytest.mark.real_model

PROMPTS = [
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n\n\ndef primes_below(limit):\n",
    "The meeting is on Tuesday at 10am in room 4B. Attendees: Ana, Bo, Chen. Agenda: budget, hiring.\n"
    "Summary: The meeting is on",
    "Q: What is the capital of France?\nA: The capital of France is Paris.\nQ: What is the capital of Spain?\nA:",
]


def test_gemma_prompt_lookup_greedy_is_identical(gemma) -> None:
    accepted = assert_lookup_matches_greedy(gemma, PROMPTS, max_new_tokens=32)
    assert accepted > 0, "prompt lookup should find something to copy in these prompts"


def test_gemma_with_penalties_and_bias_is_identical_to_target_only(gemma) -> None:
    """Copies of penalized tokens are proposed and judged against the processed target at each position: greedy output
    equals target-only's with the same bias and penalties, and differs from the unprocessed output."""
    from specdec import SamplingConfig

    sampling = SamplingConfig(
        presence_penalty=0.4,
        frequency_penalty=0.6,
        repetition_penalty=1.1,
        logit_bias=((gemma.tokenizer.eos_token_id, -5.0),),
    )
    baseline, lookup = Generator(gemma, "none"), Generator(gemma, "prompt-lookup")
    proposed, changed = 0, 0
    for prompt in PROMPTS[:2]:
        expected = baseline.generate(prompt, max_new_tokens=24, sampling=sampling)
        got = lookup.generate(prompt, max_new_tokens=24, k=4, k_policy="fixed", sampling=sampling)
        assert got.token_ids == expected.token_ids, prompt
        changed += expected.token_ids != baseline.generate(prompt, max_new_tokens=24).token_ids
        proposed += got.stats.draft_tokens_proposed
    assert proposed > 0 and changed > 0


@pytest.mark.slow
def test_gemma_cost_model_k_is_identical(gemma, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # measure this machine's cost curve afresh
    accepted = assert_lookup_matches_greedy(gemma, PROMPTS, max_new_tokens=32, k=8, k_policy="cost-model")
    assert accepted > 0, "in float32 verifying 5-17 tokens costs twice one token here: long copies pay"


@pytest.mark.slow
def test_gemma_layer_skip_and_ngram_drafts_are_identical(gemma, tmp_path: Path) -> None:
    from specdec.training.ngram import NgramBuildConfig, build_ngram_table

    corpus = tmp_path / "corpus.py"
    corpus.write_text(PROMPTS[0] + "    return [n for n in range(limit) if is_prime(n)]\n" * 3)
    tokenize = lambda texts: gemma.tokenizer(texts, add_special_tokens=False)["input_ids"]  # noqa: E731
    table = build_ngram_table(
        [str(corpus)], tokenize, gemma.vocab_size, NgramBuildConfig(order=4), {"target": gemma.name}
    )
    table.save(tmp_path / "gemma.ngram")
    baseline = Generator(gemma, "none")
    for spec in ("layerskip:15", f"ngram:{tmp_path / 'gemma.ngram'}"):
        drafted = Generator(gemma, spec)
        accepted = 0
        for prompt in PROMPTS[:2]:
            expected = baseline.generate(prompt, max_new_tokens=16)
            got = drafted.generate(prompt, max_new_tokens=16, k=4, k_policy="fixed")
            assert got.token_ids == expected.token_ids, (spec, prompt)
            accepted += got.stats.draft_tokens_accepted
        assert accepted > 0, spec


@pytest.mark.slow
def test_gguf_conversion_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    start = time.perf_counter()
    first = load_model("smollm2-135m-instruct")
    convert_s = time.perf_counter() - start
    start = time.perf_counter()
    second = load_model("smollm2-135m-instruct")
    cached_s = time.perf_counter() - start
    assert (tmp_path / "models" / first.source.cache_key / "config.json").exists()
    assert cached_s < convert_s / 4, f"cached load {cached_s:.1f}s vs conversion {convert_s:.1f}s"
    result = Generator(second, "prompt-lookup").generate("The capital of France is", max_new_tokens=8)
    assert len(result.token_ids) >= 1 and result.text.strip()


def test_demo_runs_on_the_default_model(gemma) -> None:
    out = CliRunner().invoke(app, ["demo", "--max-new-tokens", "24"])
    assert out.exit_code == 0, out.output
    assert "speed-up" in out.stdout and "identical" in out.stdout


@pytest.mark.parametrize(
    "preset", [pytest.param("bf16", marks=pytest.mark.slow), "cpu", pytest.param("cpu-vnni", marks=pytest.mark.slow)]
)
def test_gemma_low_precision_speculation_equals_target_only_of_the_same_plan(preset: str) -> None:
    from specdec.config import PRESETS, RuntimeConfig

    runtime = RuntimeConfig(precision=PRESETS[preset])
    baseline = Generator("gemma-3-270m", "none", runtime=runtime)
    drafted = Generator(baseline.target, "prompt-lookup", runtime=runtime)
    accepted = 0
    for prompt in PROMPTS:
        expected = baseline.generate(prompt, max_new_tokens=32).token_ids
        got = drafted.generate(prompt, max_new_tokens=32, k=4, k_policy="fixed")
        assert got.token_ids == expected, (preset, prompt)
        accepted += got.stats.draft_tokens_accepted
    assert accepted > 0


@pytest.mark.parametrize("format", ["int8", "int4"])
@pytest.mark.parametrize("target", ["gemma-3-270m", pytest.param("smollm2-135m-instruct", marks=pytest.mark.slow)])
def test_native_backend_speculation_equals_its_own_target_only(target: str, format: str) -> None:
    """Both bundled families in both native formats: prompt lookup and the cost model keep target-only greedy text."""
    from specdec.config import RuntimeConfig
    from specdec.errors import ConfigError
    from specdec.models.native import kernel_build

    if kernel_build.compiled() is None:
        pytest.skip("the native backend needs AVX2 and g++")
    runtime = RuntimeConfig(backend="native", native_format=format)
    baseline = Generator(target, "none", runtime=runtime)
    assert baseline.target.backend.model.format == format
    accepted = 0
    for k_policy in ("fixed", "cost-model"):
        drafted = Generator(baseline.target, "prompt-lookup", runtime=runtime)
        for prompt in PROMPTS:
            expected = baseline.generate(prompt, max_new_tokens=32).token_ids
            got = drafted.generate(prompt, max_new_tokens=32, k=8, k_policy=k_policy)
            assert got.token_ids == expected, (target, k_policy, prompt)
            accepted += got.stats.draft_tokens_accepted
            if k_policy == "fixed":  # logprobs make the steps write and read the logits: the same argmaxes
                with_logits = drafted.generate(prompt, max_new_tokens=32, k=8, k_policy=k_policy, logprobs=0)
                assert with_logits.token_ids == expected and with_logits.logprobs, (target, prompt)
    assert accepted > 0
    if target == "gemma-3-270m":
        with pytest.raises(ConfigError, match="distilled draft runs on the target's own embedding"):
            Generator(baseline.target, "lookup-then-draft", runtime=runtime)


@pytest.mark.slow
def test_int4_re_encodes_a_4bit_gguf_without_loss_of_perplexity() -> None:
    """SmolLM2's GGUF is Q4_1 (a step and a minimum per 32 weights, as int4 stores them): on int4 its perplexity stays
    within 1% of the float32 weights it was read as (int8 activations are all that is added)."""
    from specdec.bench.perplexity import perplexity
    from specdec.bench.prompts import DEFAULT_PROMPTS, prompt_sets
    from specdec.config import RuntimeConfig
    from specdec.models.native import kernel_build

    if kernel_build.compiled() is None:
        pytest.skip("the native backend needs AVX2 and g++")
    runtime = RuntimeConfig(backend="native", native_format="int4")
    result = perplexity(
        "smollm2-135m-instruct", runtime, str(prompt_sets()[DEFAULT_PROMPTS]), 1024, 256, lambda *a: None
    )
    assert abs(result.delta) / result.float32_perplexity < 0.01, result


@pytest.mark.parametrize(
    ("backend", "branches"),
    [
        ("native", 4),
        pytest.param("transformers", 4, marks=pytest.mark.slow),
        pytest.param("llama.cpp", 1, marks=pytest.mark.slow),
    ],
)
def test_gemma_eagle_head_is_identical_as_chain_and_tree(backend: str, branches: int) -> None:
    """The shipped eagle head on the real Gemma: each backend's own target-only tokens, with drafts accepted."""
    from specdec.config import RuntimeConfig
    from specdec.models.native import kernel_build

    if backend == "native" and kernel_build.compiled() is None:
        pytest.skip("the native backend needs AVX2 and g++")
    if backend == "llama.cpp" and (why := llama_cpp_problem()):
        pytest.skip(why)
    runtime = RuntimeConfig(backend=backend)
    baseline = Generator("gemma-3-270m", "none", runtime=runtime)
    drafted = Generator(baseline.target, "eagle", runtime=runtime)
    accepted = 0
    for prompt in PROMPTS[1:]:
        expected = baseline.generate(prompt, max_new_tokens=24)
        got = drafted.generate(
            prompt, max_new_tokens=24, k=8, k_policy="fixed", branches=branches
        )  # always draft: the cost model may not, on llama.cpp
        assert got.token_ids == expected.token_ids, (backend, prompt)
        accepted += got.stats.draft_tokens_accepted
    assert accepted > 0, backend
