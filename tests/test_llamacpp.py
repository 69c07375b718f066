"""The llama.cpp backend on the real bundled Gemma GGUF (runs where the llamacpp extra is installed; CI installs it)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import assert_lookup_matches_greedy
from typer.testing import CliRunner

from specdec import Generator, RuntimeConfig
from specdec.cli.main import app
from specdec.errors import ConfigError, MissingPackageError
from specdec.models import open_target
from specdec.models.llamacpp import llama_cpp_problem

CANNOT_RUN = llama_cpp_problem()
needs_llama_cpp = pytest.mark.skipif(CANNOT_RUN is not None, reason=CANNOT_RUN or "")

PROMPTS = [
    "def is_even(n):\n    return n % 2 == 0\n\n\ndef is_odd(n):\n",
    "Name: Ana. City: Lisbon. Job: pilot.\nName: Bo. City: Oslo. Job: chef.\nName: Chen. City:",
    "The three primary colours are red, yellow and blue. The three primary colours are",
]


def test_missing_package_is_one_clear_line(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(MissingPackageError) as exc:
        open_target("gemma-3-270m", RuntimeConfig(backend="llama.cpp"))
    assert ".[llamacpp]" in str(exc.value) and "\n" not in str(exc.value)
    out = CliRunner().invoke(app, ["generate", "hi", "--runtime", "llama.cpp"])
    assert out.exit_code == 2 and "llama-cpp-python" in out.output


def test_non_gguf_target_is_refused(tiny_folder) -> None:
    out = CliRunner().invoke(app, ["generate", "hi", "--runtime", "llama.cpp", "--target", str(tiny_folder)])
    assert out.exit_code == 2 and "GGUF" in out.output


@pytest.fixture(scope="module")
def exact_target():
    return open_target("gemma-3-270m", RuntimeConfig(backend="llama.cpp", threads=2, ubatch=1))


@needs_llama_cpp
@pytest.mark.real_model
def test_batched_generation_is_refused_on_llama_cpp(exact_target) -> None:
    with pytest.raises(ConfigError, match="one sequence at a time.*--runtime native or transformers"):
        Generator(exact_target, "prompt-lookup").generate_batch(PROMPTS[:2])
    with pytest.raises(ConfigError, match="one sequence per context"):
        exact_target.backend.fork()


@needs_llama_cpp
@pytest.mark.real_model
def test_rollback_matches_fresh_decoding(exact_target) -> None:
    backend = exact_target.backend
    seq = torch.tensor([exact_target.tokenizer(PROMPTS[0])["input_ids"]])
    backend.reset()
    backend.forward(seq[:, :10], last=1)
    for end in (13, 16, seq.shape[1]):
        accepted = seq[:, backend.cached_length : end - 1]
        backend.forward(torch.cat([accepted, torch.tensor([[5, 6, 7]])], dim=1), last=1)  # a wrong guess after them
        backend.truncate(end - 1)
        got = backend.forward(seq[:, end - 1 : end])[0, -1].clone()
        keep = backend.cached_length
        backend.reset()
        fresh = backend.forward(seq[:, :end], last=1)[0, -1]
        torch.testing.assert_close(got, fresh, rtol=0, atol=0)  # ubatch=1: every token computed alike
        backend.reset()
        backend.forward(seq[:, :keep], last=1)


@needs_llama_cpp
@pytest.mark.real_model
def test_greedy_on_llama_cpp_is_identical_with_exact_batches(exact_target) -> None:
    assert assert_lookup_matches_greedy(exact_target, PROMPTS, max_new_tokens=40) > 0


@needs_llama_cpp
@pytest.mark.slow
@pytest.mark.real_model
def test_cost_model_k_follows_the_measured_costs(exact_target, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """k follows the measured costs: ubatch=1 prices n tokens near n one-token forwards, so it never drafts more
    than batched."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    batched = open_target("gemma-3-270m", RuntimeConfig(backend="llama.cpp", threads=2))
    chosen, first_best = {}, {}
    for name, target in (("exact", exact_target), ("batched", batched)):
        generator = Generator(target, "prompt-lookup")
        curve = generator.costs()
        result = generator.generate(PROMPTS[1], max_new_tokens=40, k=8, k_policy="cost-model")
        chosen[name] = result.stats.k_per_step
        assert all(0 <= k <= 8 for k in chosen[name])
        assert curve(9) > curve(1) > 0
        # Before any observation the policy stands on its prior acceptance (0.8) and the measured curve alone.
        first_best[name] = max(range(9), key=lambda k, c=curve: (1 - 0.8 ** (k + 1)) / 0.2 / c(k + 1))
    assert len(list((tmp_path / "costs").glob("*.json"))) == 2  # one curve per runtime setting, cached
    # k follows this machine's costs
    assert [chosen[name][0] for name in chosen] == [first_best[name] for name in chosen]
    assert chosen["exact"][0] <= chosen["batched"][0]
    assert sum(chosen["exact"]) <= sum(chosen["batched"])


@needs_llama_cpp
@pytest.mark.real_model
def test_mixed_runtimes_and_sampling_on_llama_cpp(tiny_folder) -> None:
    fast = open_target("gemma-3-270m", RuntimeConfig(backend="llama.cpp", threads=2))
    result = Generator(fast, "prompt-lookup").generate(
        PROMPTS[1], max_new_tokens=24, k=4, k_policy="fixed", temperature=0.8, seed=3
    )
    again = Generator(fast, "prompt-lookup").generate(
        PROMPTS[1], max_new_tokens=24, k=4, k_policy="fixed", temperature=0.8, seed=3
    )
    assert result.token_ids == again.token_ids and len(result.token_ids) >= 1
    # A GGUF draft on llama.cpp (here the target's own file: every token accepted) with a llama.cpp target.
    self_draft = Generator(fast, "gguf:gemma-3-270m").generate(PROMPTS[0], max_new_tokens=16, k=3, k_policy="fixed")
    assert self_draft.stats.acceptance_rate > 0.9
    # A torch draft with another tokenizer (a tiny character-level model) is re-tokenized for a llama.cpp target.
    out = CliRunner().invoke(
        app, ["generate", "hi", "--runtime", "llama.cpp", "--draft", f"model:{tiny_folder}", "--max-new-tokens", "8"]
    )
    assert out.exit_code == 0, out.output
