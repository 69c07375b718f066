"""Training data the target writes itself (training/native_data.py): batched continuations with the hidden states a
head reads, each sequence what the target writes and returns alone, in shards a stopped run continues exactly."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded
from test_native import NATIVE, models
from typer.testing import CliRunner

from specdec import Generator
from specdec.cli.main import app
from specdec.errors import ConfigError
from specdec.models.native import NativeBackend, kernel_build
from specdec.training.distill import DistillConfig, DraftArch, distill, teacher_from_data
from specdec.training.native_data import MANIFEST, DataConfig, read_sequences, row_config, write_data
from specdec.training.on_policy import prompt_ids

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")

TEXT = (
    "The cat sat on the mat. The dog sat on the log.\n"
    "A bird sang in the tree, and the cat looked up.\n"
    "def add(a, b):\n    return a + b\n"
    "Rain fell on the town all night; by morning the river had risen.\n"
) * 4


def _target():
    return Generator(loaded(models()[1]["gemma3"], tokenizer=char_tokenizer()), "none", runtime=NATIVE).target


def _config(tmp_path: Path, name: str, tokens: int) -> DataConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT)
    return DataConfig(
        out=str(tmp_path / name),
        tokens=tokens,
        sources=(str(corpus),),
        batch=3,
        max_new_tokens=6,
        max_prompt_tokens=40,
        general_share=0.0,
        sampled_share=0.5,
        seed=1,  # rows 0-2: one greedy, two sampled
    )


def test_each_sequence_is_what_the_target_writes_and_reads_alone(tmp_path: Path) -> None:
    """Every recorded sequence: its output is what the target writes for that prompt alone with the row's settings
    (greedy and sampled, seeded), and its features are the final hidden states a forward over it alone returns."""
    target = _target()
    config = _config(tmp_path, "data", tokens=12)
    manifest = write_data(target, config)
    sequences = list(read_sequences(config.out))
    assert len(sequences) == 3 * len(manifest["shards"]) and len(manifest["shards"]) >= 1
    assert sum(s["new_tokens"] for s in manifest["shards"]) >= config.tokens
    assert {w.temperature == 0 for w in sequences} == {True, False}
    solo = Generator(target, "none", runtime=NATIVE)
    assert [w.row for w in sequences] == list(range(len(sequences)))  # in row order, whatever order they ended in
    for row, written in enumerate(sequences):
        prompt = written.tokens[: written.prompt_length].tolist()
        settings = row_config(config, row)
        greedy, temperature = settings.sampling.greedy, settings.sampling.temperature
        assert written.temperature == pytest.approx(0.0 if greedy else temperature)
        again = solo.generate(prompt, settings)
        assert written.tokens[written.prompt_length :].tolist() == again.token_ids, row
        backend = NativeBackend(target.backend.model)
        backend.forward(written.tokens[None, :-1], last=1, features=True)
        assert written.features.shape == (len(written.tokens) - 1, backend.last_features.shape[-1])
        assert torch.equal(written.features, backend.last_features[0].to(torch.bfloat16)), row


def test_a_stopped_run_continues_to_what_an_unbroken_run_writes(tmp_path: Path) -> None:
    target = _target()
    unbroken = write_data(target, _config(tmp_path, "whole", tokens=30))
    first = write_data(target, _config(tmp_path, "parts", tokens=10))
    assert len(first["shards"]) < len(unbroken["shards"])
    continued = write_data(target, _config(tmp_path, "parts", tokens=30))

    def entries(manifest: dict) -> list[dict]:
        return [{k: v for k, v in s.items() if k != "seconds"} for s in manifest["shards"]]

    assert entries(continued) == entries(unbroken)
    for entry in unbroken["shards"]:
        name = entry["file"]
        assert (tmp_path / "whole" / name).read_bytes() == (tmp_path / "parts" / name).read_bytes(), name


def test_data_runs_refuse_what_they_cannot_continue(tmp_path: Path) -> None:
    target = _target()
    config = _config(tmp_path, "data", tokens=3)
    write_data(target, config)
    with pytest.raises(ConfigError, match="other settings .*max_new_tokens"):
        write_data(target, replace(config, max_new_tokens=7))
    (Path(config.out) / MANIFEST).write_text("{not json")
    with pytest.raises(ConfigError, match="damaged"):
        write_data(target, config)
    with pytest.raises(ConfigError, match="holds no training data"):
        list(read_sequences(tmp_path / "nothing"))
    with pytest.raises(ConfigError, match="exceed the context"):
        write_data(target, replace(config, out=str(tmp_path / "long"), max_prompt_tokens=10**6))
    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    write_data(target, replace(config, out=str(tmp_path / "fresh")))
    settings = DistillConfig(data=(), teacher_data=str(tmp_path / "fresh"), out=str(tmp_path / "x"), seq_len=4)
    with pytest.raises(ConfigError, match="written by 'tiny', not 'other'"):
        teacher_from_data(loaded(model, name="other", tokenizer=tokenizer), settings, lambda *a: None)
    with pytest.raises(ConfigError, match="share between 0 and 1"):
        replace(config, sampled_share=1.5)
    with pytest.raises(ConfigError, match="temperature range"):
        replace(config, temperatures=(1.0, 0.5))


@pytest.mark.real_model
def test_gemma_writes_data_from_the_command_line(tmp_path: Path, gemma) -> None:
    """`specdec distill-data` on the bundled Gemma (native): shards of its own continuations with 640-wide hidden
    states, prompts with one beginning-of-sequence token, and the run's rate on stdout."""
    corpus = tmp_path / "corpus.md"
    corpus.write_text("# Gardens\n\nA garden needs water, light and patience. Tomatoes like the sun.\n" * 20)
    out = tmp_path / "data"
    args = ["distill-data", "--out", str(out), "--tokens", "20", "--batch", "8", "--max-new-tokens", "6"]
    args += ["--general-share", "0", "--data", str(corpus), "--runtime", "native"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "new tokens/s" in result.stdout
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["target"] == "gemma-3-270m" and manifest["shards"]
    sequences = list(read_sequences(out))
    assert len(sequences) == 8 * len(manifest["shards"])
    assert all(w.features.shape == (len(w.tokens) - 1, 640) for w in sequences)
    bos = gemma.tokenizer.bos_token_id
    assert all(w.tokens[0] == bos and w.tokens[1] != bos for w in sequences)
    # a prompt whose text already starts with it (a chat template's) gets no second one
    assert prompt_ids(gemma.tokenizer, "<bos>Hello")[:2] == prompt_ids(gemma.tokenizer, "Hello")[:2] != [bos, bos]
    assert all(len(w.tokens) - w.prompt_length <= 6 for w in sequences)


def test_an_eagle_head_trains_on_the_recorded_states(tmp_path: Path) -> None:
    """`distill --teacher-data`: windows within each recorded sequence, the next token's top-k from the recorded
    states and the target's output rows (no target forward), the states kept for the head; the head then trains, saves
    and drafts with the target's greedy output unchanged."""
    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    target = loaded(model, tokenizer=tokenizer)
    data = _config(tmp_path, "data", tokens=240)
    write_data(Generator(target, "none", runtime=NATIVE).target, replace(data, max_new_tokens=24, batch=8))
    settings = DistillConfig(
        data=(),
        teacher_data=data.out,
        out=str(tmp_path / "head"),
        arch=DraftArch.parse("eagle,keep=40"),
        steps=30,
        batch=4,
        seq_len=16,
        lr=3e-3,
        top_k=8,
        eval_every=30,
        checkpoint_every=30,
    )
    teacher = teacher_from_data(target, settings, lambda *a: None)
    first = next(read_sequences(data.out))
    with torch.no_grad():
        head = model.get_output_embeddings().weight[teacher.keep_ids].float()
        expected = torch.log_softmax(first.features[:16].float() @ head.T, dim=-1).topk(8, dim=-1)
    assert torch.equal(teacher.tokens[0], first.tokens[:16]) and torch.equal(teacher.hidden[0], first.features[:16])
    assert torch.equal(teacher.top_ids[0], expected.indices.int())
    record = distill(target, settings)
    first_eval, last_eval = record["evaluations"][0], record["evaluations"][-1]
    assert last_eval["held_out_loss"] < first_eval["held_out_loss"]
    plain = Generator(target, "none").generate(TEXT[:20], max_new_tokens=20, stop_on_eos=False)
    drafted = Generator(target, f"model:{settings.out}").generate(TEXT[:20], max_new_tokens=20, stop_on_eos=False)
    assert drafted.token_ids == plain.token_ids and drafted.stats.draft_tokens_proposed > 0
    with pytest.raises(ConfigError, match="pass one of them"):
        DistillConfig(data=("x",), teacher_data=data.out, out=str(tmp_path / "x"))
