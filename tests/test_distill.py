"""Distillation on a tiny model: loss falls, acceptance rises; save/load, resume, lossless reduced-vocabulary drafts."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from conftest import char_tokenizer, loaded, tiny_llama
from typer.testing import CliRunner

from specdec import Generator
from specdec.bench.prompts import load_prompts, prompt_sets
from specdec.cli.main import app
from specdec.drafters.distilled import ReducedVocabBackend, is_distilled_draft, load_draft, own_parameters
from specdec.errors import ConfigError
from specdec.training.distill import DistillConfig, DraftArch, collect_tokens, distill
from specdec.training.on_policy import continue_prompts, corpus_prompts, general_prompts, mixed_prompts

TEXT = "the cat sat on the mat. the dog sat on the log. a cat and a dog sat on a mat and a log.\n"


@pytest.fixture
def target():
    tokenizer = char_tokenizer()
    return loaded(tiny_llama(0, vocab=len(tokenizer), layers=3), tokenizer=tokenizer)


def config(tmp_path: Path, **overrides) -> DistillConfig:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT * 60)
    settings = dict(
        data=(str(corpus),),
        out=str(tmp_path / "draft"),
        arch=DraftArch(layers=1, keep=40),
        steps=40,
        batch=4,
        seq_len=32,
        lr=3e-3,
        teacher_tokens=4000,
        top_k=8,
        eval_every=40,
        checkpoint_every=10,
    )
    return DistillConfig(**(settings | overrides))


def test_distillation_lowers_loss_and_raises_acceptance(target, tmp_path: Path) -> None:
    record = distill(target, config(tmp_path))
    first, last = record["evaluations"][0], record["evaluations"][-1]
    assert first["step"] == 0 and last["step"] == 40
    assert last["held_out_loss"] < 0.8 * first["held_out_loss"]
    assert last["acceptance_rate"] > first["acceptance_rate"]
    assert last["top1_agreement"] > first["top1_agreement"]


def test_saved_draft_loads_and_is_lossless(target, tmp_path: Path) -> None:
    cfg = config(tmp_path, steps=20)
    distill(target, cfg)
    assert is_distilled_draft(cfg.out)
    assert sum(f.stat().st_size for f in Path(cfg.out).iterdir() if f.name == "model.safetensors") > 0
    draft = load_draft(cfg.out, target.model)
    assert draft.model.embed_tokens is target.model.model.embed_tokens  # shared, not copied
    assert draft.keep_ids.numel() == 40
    baseline = Generator(target, "none")
    drafted = Generator(target, f"model:{cfg.out}")  # the spec users pass
    assert isinstance(drafted.drafter.backend, ReducedVocabBackend)
    for prompt in ("the cat", "a dog sat", "xyz"):
        expected = baseline.generate(prompt, max_new_tokens=24, stop_on_eos=False).token_ids
        assert (
            drafted.generate(prompt, max_new_tokens=24, k=4, k_policy="fixed", stop_on_eos=False).token_ids == expected
        )


def test_resume_continues_where_it_stopped(target, tmp_path: Path) -> None:
    distill(target, config(tmp_path, steps=20, eval_every=20))
    with pytest.raises(ConfigError, match="--resume"):
        distill(target, config(tmp_path, steps=20))
    record = distill(target, config(tmp_path, steps=30, eval_every=10), resume=True)
    assert [e["step"] for e in record["evaluations"]] == [0, 20, 30]  # no restart from step 0
    assert record["steps"] == 30
    with pytest.raises(ConfigError, match="nothing to resume"):
        distill(target, config(tmp_path, out=str(tmp_path / "elsewhere")), resume=True)


def test_a_damaged_checkpoint_or_teacher_file_is_one_line_not_a_traceback(target, tmp_path: Path) -> None:
    """Checkpoints and teacher data are written whole or not at all (owner-only); one damaged anyway (a disk fault, a
    copy cut short) stops --resume with a one-line ConfigError that says what to delete."""
    cfg = config(tmp_path, steps=10, eval_every=10)
    distill(target, cfg)
    out = Path(cfg.out)
    checkpoint, teacher = out / "checkpoint.pt", out / "teacher.pt"
    assert checkpoint.stat().st_mode & 0o777 == 0o600 and teacher.stat().st_mode & 0o777 == 0o600
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    checkpoint.write_bytes(checkpoint.read_bytes()[: checkpoint.stat().st_size // 2])
    with pytest.raises(ConfigError, match="checkpoint.pt' cannot be resumed from.*delete it") as error:
        distill(target, config(tmp_path, steps=20), resume=True)
    assert "\n" not in str(error.value)
    teacher.write_bytes(b"not a teacher file")
    with pytest.raises(ConfigError, match="teacher.pt' cannot be read.*score the data again") as error:
        distill(target, config(tmp_path, steps=20), resume=True)
    assert "\n" not in str(error.value)


def test_distill_cli_and_arch_errors(tiny_folder: Path, tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text(TEXT * 40)
    out = tmp_path / "d"

    def distill(out: Path, arch: str) -> list[str]:
        return ["distill", "--target", str(tiny_folder), "--data", str(corpus), "--out", str(out), "--arch", arch]

    train = ["--steps", "6", "--seq-len", "16", "--batch", "2", "--eval-every", "3", "--teacher-tokens", "2000"]
    result = CliRunner().invoke(app, distill(out, "layers=1,keep=30") + train)
    assert result.exit_code == 0, result.output
    assert "held-out acceptance" in result.output and is_distilled_draft(out)
    bad = CliRunner().invoke(app, distill(tmp_path / "e", "layers=two"))
    assert bad.exit_code == 2 and "layers=N" in bad.output
    with pytest.raises(ConfigError, match="layers"):
        DraftArch(layers=2).layer_ids(2)


def test_exit_draft_trains_only_its_exit_on_shared_layers(target, tmp_path: Path) -> None:
    cfg = config(tmp_path, arch=DraftArch(exit=1, keep=40), steps=30, eval_every=30)
    record = distill(target, cfg)
    assert record["evaluations"][-1]["held_out_loss"] < record["evaluations"][0]["held_out_loss"]
    draft = load_draft(cfg.out, target.model)
    assert draft.model.layers[0] is target.model.model.layers[0]  # the target's own layer, not a copy
    assert len(target.model.model.layers) == 3 and "keep_ids" not in dict(target.model.named_buffers())
    assert all(name.startswith("model.norm.") for name in own_parameters(draft))  # only the exit is stored
    baseline = Generator(target, "none")
    drafted = Generator(target, f"model:{cfg.out}")
    for prompt in ("the cat", "a dog sat"):
        expected = baseline.generate(prompt, max_new_tokens=20, stop_on_eos=False).token_ids
        assert (
            drafted.generate(prompt, max_new_tokens=20, k=3, k_policy="fixed", stop_on_eos=False).token_ids == expected
        )


def test_prompt_only_records_are_continued_by_the_target_in_batches(target, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(f'{{"prompt": "the {w} sat on"}}\n' for w in ("cat", "dog", "log"))
        + '{"prompt": "a", "text": " given"}\n'
    )
    cfg = config(tmp_path, data=(str(prompts),), teacher_tokens=10_000, continue_tokens=12, generate_batch=2)
    stream = collect_tokens(target, cfg, lambda *a: None)
    text = target.tokenizer.decode(stream)
    alone = [
        target.tokenizer.decode(ids[1:])
        for p in ("the cat sat on", "the dog sat on", "the log sat on")
        for ids, _ in continue_prompts(target, iter([p]), 12, 1)
    ]
    for continuation in alone:  # batched with left padding, each row writes what it writes alone
        assert continuation in text and len(continuation) > len("the cat sat on")
    assert "a given" in text  # the record with its own text is read, not continued


def test_on_policy_prompts_come_from_the_corpus_in_every_shape(target, tmp_path: Path) -> None:
    corpus = tmp_path / "doc.md"
    corpus.write_text("# Sorting lists\n\n" + "Sorting puts items in order. The sort method works in place.\n" * 30)
    prompts = list(
        itertools.islice(corpus_prompts([str(corpus)], seed=1, chat_template=lambda m: f"<chat>{m}</chat>"), 8)
    )
    assert prompts == list(
        itertools.islice(corpus_prompts([str(corpus)], seed=1, chat_template=lambda m: f"<chat>{m}</chat>"), 8)
    )
    assert any(p.startswith("Sorting") for p in prompts)  # plain continuation of a passage
    # a request about a passage
    assert any(p.startswith("User: ") and "Sorting puts" in p and p.endswith("Assistant:") for p in prompts)
    assert any(p.startswith("<chat>") for p in prompts)  # the model's own chat template
    assert any("Sorting lists" in p and p.startswith("User: ") for p in prompts)  # a question about a heading
    with pytest.raises(ConfigError, match="text files"):
        next(corpus_prompts([str(tmp_path / "none.jsonl")], seed=0, chat_template=None))


def test_general_prompts_mix_chat_and_writing_in_two_languages_and_no_benchmark_prompt() -> None:
    prompts = list(itertools.islice(general_prompts(seed=3), 400))
    assert prompts == list(itertools.islice(general_prompts(seed=3), 400))  # seeded
    assert any(p.startswith("User: ") and p.endswith("\nAssistant:") for p in prompts)  # chat requests
    assert any(p.startswith("用户：") and p.endswith("\n助手：") for p in prompts)
    assert any(not p.startswith(("User: ", "用户：")) for p in prompts)  # openings to continue
    english = sum(p.isascii() for p in prompts) / len(prompts)
    assert 0.55 < english < 0.85  # every topic equally likely: about 110 English and 48 Chinese ones
    benchmark = {record.prompt for name in prompt_sets() for record in load_prompts(name)}
    assert not benchmark & set(prompts)  # training prompts are never the benchmarks' own


def test_on_policy_prompts_mix_general_ones_at_the_share_asked(target, tmp_path: Path) -> None:
    corpus = tmp_path / "doc.md"
    corpus.write_text("# Sorting lists\n\n" + "Sorting puts items in order. The sort method works in place.\n" * 30)
    drawn = corpus_prompts([str(corpus)], seed=1, chat_template=None)
    mixed = list(itertools.islice(mixed_prompts(drawn, general_prompts(seed=1), 0.75, seed=1), 200))
    from_corpus = sum("Sort" in p for p in mixed) / len(mixed)
    assert 0.15 < from_corpus < 0.35
    with pytest.raises(ConfigError, match="general_prompts"):
        config(tmp_path, general_prompts=1.5)
    with pytest.raises(ConfigError, match="--on-policy-tokens"):  # a share of nothing would be silently ignored
        config(tmp_path, general_prompts=0.5, on_policy_tokens=0)


def test_on_policy_tokens_are_written_by_the_target_and_held_out_last(target, tmp_path: Path) -> None:
    cfg = config(tmp_path, teacher_tokens=3000, on_policy_tokens=1000, continue_tokens=16, generate_batch=4)
    stream = collect_tokens(target, cfg, lambda *a: None)
    assert len(stream) == 3000
    assert target.tokenizer.decode(stream[:2000]) in TEXT * 60  # the corpus part is the corpus
    assert target.tokenizer.decode(stream[2000:]) not in TEXT * 60  # the rest is the target's own writing
    with pytest.raises(ConfigError, match="on_policy_tokens"):
        config(tmp_path, on_policy_tokens=5000, teacher_tokens=4000)


def test_calibration_finds_the_confidence_floor(target, tmp_path: Path) -> None:
    record = distill(target, config(tmp_path))
    assert 0.0 <= record["min_confidence"] <= 1.0
    assert abs(sum(row["share"] for row in record["calibration"]) - 1.0) < 1e-6
    drafted = Generator(target, f"model:{config(tmp_path).out}")
    assert drafted.drafter.min_confidence == record["min_confidence"]  # the drafter uses the calibrated floor
