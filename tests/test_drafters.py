"""The corpus n-gram, layer-skip and cross-tokenizer drafters: tables, caches, token boundaries, losslessness."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_gemma3, tiny_llama
from typer.testing import CliRunner

from specdec import Generator, SamplingConfig
from specdec.cli.main import app
from specdec.drafters import DraftSettings, NgramDrafter, NgramTable, SuffixDrafter, build_drafter
from specdec.drafters.layer_skip import shallow_view
from specdec.drafters.ngram import context_hash, context_hashes
from specdec.errors import ConfigError
from specdec.models import TransformersBackend, open_target
from specdec.models.backend import PackedWeights
from specdec.models.native import NativeBackend, NativeModel
from specdec.seeds import Seeds
from specdec.training.ngram import NgramBuildConfig, build_ngram_table

TOKENIZER = char_tokenizer()


def char_ids(texts: list[str]) -> list[list[int]]:
    return TOKENIZER(texts, add_special_tokens=False)["input_ids"]


def build(sources: list[str], **config: object) -> NgramTable:
    return build_ngram_table(sources, char_ids, len(TOKENIZER), NgramBuildConfig(**config), {"target": "chars"})


def test_vectorised_and_scalar_hashes_agree() -> None:
    tokens = np.array([5, 17, 3, 3, 99, 0, 4], dtype=np.int64)
    for n in (1, 2, 3):
        assert context_hashes(tokens, n).tolist() == [
            context_hash(tokens[i : i + n].tolist()) for i in range(len(tokens) - n + 1)
        ]


def test_table_counts_followers_from_files_folders_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("abcabcabd")
    (tmp_path / "docs" / "skip.bin").write_bytes(b"\x00abx")  # not a text suffix: ignored in folders
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text(json.dumps({"prompt": "xy", "continuation": "z"}) + "\n\n" + json.dumps({"text": "xyz"}) + "\n")
    table = build([str(tmp_path / "docs"), str(jsonl)], order=3)
    [ab] = char_ids(["ab"])
    followers, counts = table.followers(ab)
    got = dict(zip(TOKENIZER.convert_ids_to_tokens(followers.tolist()), counts.tolist(), strict=True))
    assert got == {"c": 2, "d": 1}
    followers, counts = table.followers(char_ids(["xy"])[0])
    # one per JSONL record
    assert TOKENIZER.convert_ids_to_tokens(followers.tolist()) == ["z"] and counts.tolist() == [2]
    assert not len(table.followers(char_ids(["b!"])[0])[0])
    # Backoff: "zb" was never seen, "b" was (followed by c twice, d once).
    followers, _ = table.longest_match(char_ids(["zb"])[0])
    assert sorted(TOKENIZER.convert_ids_to_tokens(followers.tolist())) == ["c", "d"]


def test_table_round_trip_and_size_limit(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    rng = np.random.default_rng(0)
    noise = "".join(rng.choice(list("abcdefghij"), size=5000))
    corpus.write_text(("the cat sat. " * 200) + noise)
    full = build([str(corpus)], order=3)
    path = tmp_path / "table.ngram"
    full.save(path)
    again = NgramTable.load(path)
    assert np.array_equal(again.keys, full.keys) and np.array_equal(again.counts, full.counts)
    assert again.order == 3 and again.vocab_size == len(TOKENIZER) and again.meta["target"] == "chars"
    limit_mb = 100 * 12 / 2**20  # room for 100 entries
    small = build([str(corpus)], order=3, max_mb=limit_mb)
    assert len(small.keys) == 100 < len(full.keys)
    assert np.all(small.keys[1:] > small.keys[:-1])  # still sorted, so lookups work
    [the] = char_ids(["th"])
    followers, _ = small.followers(the)  # the frequent n-grams survive pruning
    assert TOKENIZER.convert_ids_to_tokens(followers.tolist()) == ["e"]


def test_table_errors_are_clear(tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.ngram"
    bogus.write_text("not a table")
    with pytest.raises(ConfigError, match="specdec ngram build"):
        NgramTable.load(bogus)
    with pytest.raises(ConfigError, match="does not exist"):
        build([str(tmp_path / "nowhere")])
    with pytest.raises(ConfigError, match="order"):
        NgramBuildConfig(order=0)


def test_ngram_drafter_copies_first_then_continues_from_the_table(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world. " * 20)
    drafter = NgramDrafter(build([str(corpus)], order=4))
    drafter.begin(DraftSettings())
    proposal = drafter.propose(torch.tensor(char_ids(["say hel"])[0]), 5)
    assert TOKENIZER.decode(proposal.tokens.tolist()) == "lo wo"
    context = torch.tensor(char_ids(["qrs qr"])[0])  # repeats itself: prompt lookup's copy wins
    assert TOKENIZER.decode(drafter.propose(context, 2).tokens.tolist()) == "s "
    drafter.begin(DraftSettings(SamplingConfig(temperature=1.0), Seeds(0)))
    sampled = drafter.propose(torch.tensor(char_ids(["say hel"])[0]), 3)
    assert sampled.probs is not None and sampled.probs.shape == (3, len(TOKENIZER))
    assert torch.allclose(sampled.probs.sum(-1), torch.ones(3))


def test_ngram_drafter_greedy_is_identical(tmp_path: Path) -> None:
    target = loaded(tiny_llama(0, vocab=len(TOKENIZER)), tokenizer=TOKENIZER)
    baseline = Generator(target, "none")
    prompts = ["abc", "hello", "xyz q"]
    outputs = [baseline.generate(p, max_new_tokens=30, stop_on_eos=False) for p in prompts]
    corpus = tmp_path / "own.jsonl"  # the target's own continuations: a well-matched corpus
    corpus.write_text(
        "".join(json.dumps({"prompt": p, "continuation": o.text}) + "\n" for p, o in zip(prompts, outputs, strict=True))
    )
    path = tmp_path / "own.ngram"
    build([str(corpus)], order=4).save(path)
    drafted = Generator(target, f"ngram:{path}")
    accepted = 0
    for prompt, expected in zip(prompts, outputs, strict=True):
        got = drafted.generate(prompt, max_new_tokens=30, k=4, k_policy="fixed", stop_on_eos=False)
        assert got.token_ids == expected.token_ids
        accepted += got.stats.draft_tokens_accepted
    assert accepted > 0


def test_ngram_build_cli(tmp_path: Path, tiny_folder: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world. " * 20)
    out = tmp_path / "t.ngram"
    result = CliRunner().invoke(
        app, ["ngram", "build", str(corpus), "--target", str(tiny_folder), "-o", str(out), "--order", "3"]
    )
    assert result.exit_code == 0, result.output
    assert "n-grams" in result.output and NgramTable.load(out).order == 3
    again = CliRunner().invoke(app, ["ngram", "build", str(corpus), "--target", str(tiny_folder), "-o", str(out)])
    assert again.exit_code == 2 and "--overwrite" in again.output
    result = CliRunner().invoke(
        app, ["generate", "hello", "--target", str(tiny_folder), "--draft", f"ngram:{out}", "--max-new-tokens", "8"]
    )
    assert result.exit_code == 0, result.output


def test_ngram_build_seeds_a_suffix_history_the_server_starts_from(tmp_path: Path, tiny_folder: Path) -> None:
    from specdec.models import open_target
    from specdec.serving.config import ServeConfig
    from specdec.serving.suffix import server_drafter

    corpus = tmp_path / "c.txt"
    corpus.write_text("SELECT name FROM users WHERE id = 1;\n" * 5)
    history = tmp_path / "history.npz"
    args = ["ngram", "build", str(corpus), "--target", str(tiny_folder), "-o", str(tmp_path / "t.ngram")]
    result = CliRunner().invoke(app, args + ["--suffix-cache", str(history)])
    assert result.exit_code == 0, result.output
    assert "suffix history" in result.output and history.stat().st_mode & 0o777 == 0o600
    target = open_target(str(tiny_folder))
    drafter, store = server_drafter("suffix", target, ServeConfig(suffix_cache=str(history)))
    expected = target.tokenizer(corpus.read_text(), add_special_tokens=False)["input_ids"]
    assert store is not None and store.token_count == len(expected)
    # a new request starting like the corpus drafts the corpus's continuation
    context = torch.tensor(expected[:12])
    drafter.begin(DraftSettings())
    assert drafter.propose(context, k=4).tokens.tolist() == expected[12:16]
    again = CliRunner().invoke(app, args + ["--overwrite", "--suffix-cache", str(history)])
    assert again.exit_code == 0, again.output
    refused = CliRunner().invoke(app, args[:-1] + [str(tmp_path / "u.ngram"), "--suffix-cache", str(history)])
    assert refused.exit_code == 2 and "--suffix-cache" in refused.output and "--overwrite" in refused.output
    # the default drafter drafts with suffix where no eagle head pays: the server's history is then the same
    auto, kept = server_drafter("auto", target, ServeConfig(suffix_cache=str(history), suffix_max_tokens=10_000))
    assert isinstance(auto, SuffixDrafter) and kept is not None and kept.max_tokens == 10_000
    assert kept.token_count == len(expected)


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_layer_skip_view_shares_weights_and_matches_early_exit(make_target) -> None:
    model = make_target(0)
    layers = len(model.model.layers)
    view = shallow_view(model, 1)
    assert len(view.model.layers) == 1 and len(model.model.layers) == layers  # the target is untouched
    assert view.model.layers[0].mlp.down_proj.weight.data_ptr() == model.model.layers[0].mlp.down_proj.weight.data_ptr()
    assert view.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    ids = torch.tensor([[1, 4, 8, 15, 16, 23, 42, 4, 8]])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states[1]  # after the first layer
        expected = model.lm_head(model.model.norm(hidden))
        torch.testing.assert_close(view(ids).logits, expected, rtol=1e-4, atol=1e-4)
    with pytest.raises(ConfigError, match="1 <= L"):
        shallow_view(model, layers)


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_layer_skip_greedy_is_identical_and_its_cache_rolls_back(make_target) -> None:
    target = loaded(make_target(0, layers=3) if make_target is tiny_llama else make_target(0))
    baseline = Generator(target, "none")
    drafted = Generator(target, "layerskip:1")
    draft_backend = drafted.drafter.backend
    for prompt in ([1, 5, 9, 5, 9, 12], [1, 7, 7, 30, 31, 32, 33, 34, 35, 36]):
        expected = baseline.generate(prompt, max_new_tokens=30, stop_on_eos=False).token_ids
        got = drafted.generate(prompt, max_new_tokens=30, k=3, k_policy="fixed", stop_on_eos=False)
        assert got.token_ids == expected
        assert 0 < got.stats.draft_tokens_proposed
        # The draft cache holds a prefix of the sequence: its next logits must equal a fresh pass over it.
        seq, held = prompt + got.token_ids, draft_backend.cached_length
        assert 0 < held < len(seq)
        after_rollback = draft_backend.forward(torch.tensor([seq[held : held + 1]]), last=1)
        fresh = TransformersBackend(draft_backend.model).forward(torch.tensor([seq[: held + 1]]), last=1)
        torch.testing.assert_close(after_rollback, fresh, rtol=1e-4, atol=1e-4)


def test_layer_skip_needs_the_transformers_backend() -> None:
    model = tiny_llama(0, hidden=64, context=1024)  # widths the native runtime takes
    target = open_target(loaded(model))
    assert target.backend.transformers_model() is model and target.backend.packed_weights() is None
    target.backend = NativeBackend(NativeModel.from_module(model))  # a runtime that runs no transformers model
    assert target.backend.transformers_model() is None
    assert target.backend.packed_weights() == PackedWeights("int8", sum(p.numel() for p in model.parameters()))
    with pytest.raises(ConfigError, match="--runtime transformers"):
        build_drafter("layerskip:1", target)


def _readme_drafter_example() -> tuple[str, str]:
    """The README's example drafter: the class, then its use."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("### Writing a drafter", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 2, "the README's drafter section should hold the class and its use"
    return blocks[0], blocks[1]


def test_the_readme_example_drafter_keeps_greedy_identity() -> None:
    definition, _ = _readme_drafter_example()
    assert len(definition.strip().splitlines()) <= 32  # a drafter is one small class
    namespace: dict = {}
    exec(definition, namespace)  # noqa: S102 - the README's own code
    target = loaded(tiny_llama(0, vocab=len(TOKENIZER)), tokenizer=TOKENIZER)
    settings = dict(max_new_tokens=30, stop_on_eos=False, k=4, k_policy="fixed")
    expected = Generator(target, "none").generate("abc", **settings)
    # the text the output quotes
    reference = TOKENIZER("abc", add_special_tokens=False)["input_ids"] + expected.token_ids
    got = Generator(target, namespace["ReferenceDrafter"](reference)).generate("abc", **settings)
    assert got.token_ids == expected.token_ids
    assert got.stats.draft_tokens_accepted > 0  # it did draft
    batched = Generator(target, namespace["ReferenceDrafter"](reference)).generate_batch(["abc", "xyz"], **settings)
    assert batched[0].token_ids == expected.token_ids


@pytest.mark.real_model
def test_the_readme_example_drafter_runs_as_written(capsys: pytest.CaptureFixture[str]) -> None:
    definition, use = _readme_drafter_example()
    exec(definition + use, {})  # noqa: S102 - the README's own code
    assert capsys.readouterr().out.strip()
