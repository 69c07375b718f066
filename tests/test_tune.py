"""`specdec tune` and profiles: search on tiny and real models, profile files, their errors and warnings, the oracle."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_llama
from typer.testing import CliRunner

from specdec import Generator
from specdec.bench.methods import OracleDrafter, check_method, oracle_accuracy
from specdec.bench.prompts import BenchPrompt, round_robin
from specdec.cli.main import app
from specdec.config import PRESETS, BatchConfig, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.drafters import PromptLookupDrafter, build_drafter
from specdec.errors import ConfigError, PromptError
from specdec.profile import Profile, ProfileError, ProfileWarning
from specdec.tuning.search import DEFAULT_DRAFTER, MIN_HELD_OUT, TuneConfig, plan, tune

RUNTIMES = ("transformers/float32", "transformers/cpu")  # on every CPU; native needs head sizes the tiny model lacks


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    items = [
        ("code", "abc abc abc abc abc"),
        ("chat", "hello there hello there"),
        ("code", "x = 1; x = 1; x ="),
        ("chat", "the cat the cat"),
        ("code", "def f(): return f"),
        ("chat", "why not? why not?"),
        ("code", "a, b = b, a; a, b ="),
        ("chat", "good day to you, good day"),
    ]
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "category": c, "prompt": p}) + "\n" for i, (c, p) in enumerate(items))
    )
    return path


def profile_of(target: str, **changes: object) -> Profile:
    profile = Profile(
        target, "prompt-lookup", RuntimeConfig(precision=PRESETS["cpu"]), GenerationConfig(k=3, k_policy="fixed")
    )
    return replace(profile, **changes)


def test_a_profile_survives_json_and_reads_from_toml(tmp_path: Path) -> None:
    profile = profile_of("some-model", measured={"tokens_per_s": 12.5})
    profile.save(tmp_path / "p.json")
    assert Profile.load(tmp_path / "p.json") == profile
    data = profile.to_dict()
    toml = ['version = 1\ntarget = "some-model"\ndrafter = "prompt-lookup"']
    toml.append(
        '[runtime]\nbackend = "transformers"\ndtype = "float32"\nprecision = "' + data["runtime"]["precision"] + '"'
    )
    toml.append('[generation]\nk = 3\nk_policy = "fixed"\nbranches = 1\ntemperature = 0.0')
    toml.append("[machine]\n" + "\n".join(f"{k} = {json.dumps(v)}" for k, v in profile.machine.items()))
    (tmp_path / "p.toml").write_text("\n".join(toml) + "\n")
    assert replace(Profile.load(tmp_path / "p.toml"), measured=profile.measured) == profile
    with pytest.raises(ProfileError, match="written as JSON"):
        profile.save(tmp_path / "out.toml")
    data["batch"] = {"window": "fixed"}  # k_cap's former name, in a profile written before it
    assert Profile.from_dict(data).batch == BatchConfig(k_cap="fixed")


def test_a_profile_is_written_whole_or_not_at_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that fails before its data is on disk (a full disk, a kill) leaves the previous profile as it was, and no
    temporary file; a profile holds settings only, so it stays readable by all."""
    import os

    path = tmp_path / "profile.json"
    profile_of("tiny").save(path)
    before = path.read_text()
    assert path.stat().st_mode & 0o777 == 0o644

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        profile_of("other").save(path)
    assert path.read_text() == before and Profile.load(path).target == "tiny"
    assert [p.name for p in tmp_path.iterdir()] == ["profile.json"]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"version": 9}', "not a specdec profile of version 1"),
        ('{"version": 1, "target": "x"}', "lacks the key 'runtime'"),
        (
            '{"version": 1, "target": "x", "drafter": "none", "runtime": {"backend": "tpu"}, '
            '"generation": {"k": 2, "k_policy": "fixed"}}',
            "unknown runtime 'tpu'",
        ),
        (
            '{"version": 1, "target": "x", "drafter": "none", "runtime": {}, '
            '"generation": {"k": 0, "k_policy": "fixed"}}',
            "k \\(draft tokens per step\\)",
        ),
        (
            '{"version": 1, "target": "x", "drafter": "none", "runtime": {"colour": 1}, '
            '"generation": {"k": 2, "k_policy": "fixed"}}',
            "malformed section",
        ),
    ],
)
def test_a_broken_profile_is_one_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        Profile.load(path)


def test_a_missing_profile_says_how_to_make_one(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="specdec tune --out DIR"):
        Profile.load(tmp_path / "nope.json")


def test_another_model_or_machine_is_named_in_a_warning() -> None:
    profile = profile_of("model-a")
    assert profile.differences("model-a") == []
    notes = replace(profile, machine=profile.machine | {"cpu": "Some Other CPU", "cores": 64}).differences("model-b")
    assert "tuned for target 'model-a', not 'model-b'" in notes[0] and "specdec tune --target model-b" in notes[0]
    assert "another machine" in notes[1] and "'Some Other CPU'" in notes[1] and "64" in notes[1]


def test_a_profile_naming_what_is_not_installed_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    with pytest.raises(
        ProfileError,
        match=r"backend runs on llama.cpp, which cannot run here: llama-cpp-python is not installed: run `pip install",
    ):
        profile_of("x", runtime=RuntimeConfig(backend="llama.cpp")).check_installed()
    with pytest.raises(ProfileError, match="names '.*table.ngram', which does not exist here"):
        profile_of("x", drafter=f"ngram:{tmp_path / 'table.ngram'}").check_installed()
    profile_of("x", drafter="model:org/some-hub-model").check_installed()  # a hub id is not checked as a path


def test_generator_from_profile_runs_the_profiles_configuration(tiny_folder: Path) -> None:
    profile = profile_of(str(tiny_folder))
    generator = Generator.from_profile(profile)
    assert isinstance(generator.drafter, PromptLookupDrafter)
    assert (generator.config.k, generator.config.k_policy) == (3, "fixed")
    expected = (
        Generator(str(tiny_folder), "none", runtime=profile.runtime).generate("abcabcabc", max_new_tokens=12).token_ids
    )
    assert generator.generate("abcabcabc", max_new_tokens=12).token_ids == expected
    moved = replace(profile, machine=profile.machine | {"cores": 999})
    with pytest.warns(ProfileWarning, match="another machine"):
        Generator.from_profile(moved)


def test_the_oracle_is_right_at_the_asked_rate_and_output_stays_exact() -> None:
    oracle = OracleDrafter(accuracy=0.7, seed=3)
    oracle.reference = list(range(1, 2001))
    proposal = oracle.propose(torch.tensor([1]), 1999).tokens.tolist()
    right = sum(a == b for a, b in zip(proposal, oracle.reference[1:], strict=True))
    assert abs(right / len(proposal) - 0.7) < 0.04  # 1,999 draws: the standard error is 0.01
    assert proposal == oracle.propose(torch.tensor([1]), 1999).tokens.tolist()  # seeded by position
    assert (
        oracle_accuracy("oracle") == 1.0
        and oracle_accuracy("oracle:0.5") == 0.5
        and oracle_accuracy("prompt-lookup") is None
    )
    assert check_method("oracle:0.9", "gemma-3-270m") is None
    with pytest.raises(ConfigError, match="probability in \\(0, 1\\]"):
        check_method("oracle:1.5", "gemma-3-270m")
    target = loaded(tiny_llama(0))
    prompt = [5, 6, 7, 8, 9]
    reference = Generator(target, "none").generate(prompt, max_new_tokens=24, stop_on_eos=False).token_ids
    oracle = OracleDrafter(accuracy=0.5)
    oracle.reference = prompt + reference
    result = Generator(target, oracle).generate(prompt, max_new_tokens=24, k=4, k_policy="fixed", stop_on_eos=False)
    assert result.token_ids == reference
    assert 0.2 < result.stats.acceptance_rate < 0.8


def test_tuning_budgets_drafters_and_prompts_are_checked(
    tmp_path: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match="too small to measure anything"):
        TuneConfig(budget_s=5)
    with pytest.raises(ConfigError, match="cannot run"):
        plan(TuneConfig(target=str(tiny_folder), runtimes=("llama.cpp",)))
    for spec in ("oracle", "hf-prompt-lookup", "llamacpp-greedy"):
        with pytest.raises(ConfigError, match="not a drafter to tune"):
            plan(TuneConfig(target=str(tiny_folder), drafters=(spec,)))
    with pytest.raises(ConfigError, match="unknown method 'promptlookup'"):
        plan(TuneConfig(target=str(tiny_folder), drafters=("promptlookup",)))
    import specdec.tuning.search as search

    monkeypatch.setattr(
        search, "open_target", lambda *a: pytest.fail("a bad prompts file must fail before any model loads")
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ConfigError, match="has no prompts"):
        tune(TuneConfig(target=str(tiny_folder), prompts=str(empty), runtimes=RUNTIMES[:1]))
    with pytest.raises(ConfigError, match="neither a prompt set"):
        tune(TuneConfig(target=str(tiny_folder), prompts=str(tmp_path / "missing.jsonl"), runtimes=RUNTIMES[:1]))
    monkeypatch.undo()
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "a", "category": "chat", "prompt": "word " * 400}) + "\n")
    with pytest.raises(PromptError, match="nothing usable.*longer than 216 tokens"):
        tune(TuneConfig(target=str(tiny_folder), prompts=str(long), runtimes=RUNTIMES[:1], budget_s=30))
    blank = tmp_path / "blank.jsonl"
    blank.write_text(json.dumps({"id": "a", "category": "chat", "prompt": "   "}) + "\n")
    with pytest.raises(PromptError, match="nothing usable.*blank"):
        tune(TuneConfig(target=str(tiny_folder), prompts=str(blank), runtimes=RUNTIMES[:1], budget_s=30))


def test_the_prediction_replays_sampled_steps_on_each_runtimes_curve() -> None:
    from specdec.scheduling import CostCurve
    from specdec.tuning.search import DrafterSample, RuntimeFigures, _confirmation_set, _predict

    # on the flat curve verifying is nearly free; on the steep one each position costs a step
    flat = RuntimeFigures("flat", RuntimeConfig(), None, CostCurve({1: 0.010, 9: 0.011}), 1 / 0.011, 0.001, 0.0)
    steep = RuntimeFigures("steep", RuntimeConfig(), None, CostCurve({1: 0.010, 9: 0.090}), 95.0, 0.001, 0.0)
    steps = [(8, 8), (8, 0)]  # one step accepted all 8, one none
    drafting = {1: 0.0004, 8: 0.0008}  # measured at k = 1 and k = 8: a fixed cost and a cost per token
    sample = DrafterSample("prompt-lookup", ["flat", "steep"], steps, drafting)
    tree = DrafterSample("prompt-lookup+tree", ["flat"], steps, {8: 0.0008})
    candidates = _predict({"flat": flat, "steep": steep}, [sample, tree], max_k=8)
    by_key = {(c.runtime, c.drafter, c.k): c.predicted_tokens_per_s for c in candidates}
    # at k = 8 on the flat curve: (9 + 1) tokens over 2 x (11 ms + 1 ms overhead + 0.8 ms drafting)
    assert by_key[("flat", "prompt-lookup", 8)] == pytest.approx(10 / (2 * 0.0128))
    # at k = 2: min(8, 2) + 1 and 0 + 1 tokens; forwards over 3 tokens; drafting between k = 1's and k = 8's
    assert sample.draft_s(2) == pytest.approx(0.0004 + 0.0004 / 7)
    assert by_key[("flat", "prompt-lookup", 2)] == pytest.approx(4 / (2 * (0.01025 + 0.001 + sample.draft_s(2))))
    assert by_key[("flat", "none", 1)] == pytest.approx(1 / 0.011)
    # steep's target-only ran at 95 tok/s where curve and overhead say 1 / 11 ms: its predictions scale by 95 x 0.011
    assert by_key[("steep", "none", 1)] == pytest.approx(95.0)
    assert by_key[("steep", "prompt-lookup", 1)] == pytest.approx(95 * 0.011 * 3 / (2 * (0.020 + 0.001 + 0.0004)))
    assert ("steep", "prompt-lookup+tree", 8) not in by_key  # the tree does not run there
    assert [k for r, d, k in by_key if d == "prompt-lookup+tree"] == [8]  # a tree is not cut to a prefix
    assert candidates[0].runtime == "flat" and candidates[0].drafter != "none"
    steep_best = max((c for c in candidates if c.runtime == "steep"), key=lambda c: c.predicted_tokens_per_s)
    assert steep_best.k == 1 or steep_best.drafter == "none"  # where positions cost a step, drafting deep never pays
    chosen = _confirmation_set(candidates, {"flat": flat, "steep": steep}, count=2, max_k=8)
    labels = {c.label for c in chosen}
    assert {"flat / none", "steep / none"} <= labels  # target-only where a contender runs, and on the fastest
    defaults = [c for c in chosen if c.drafter == DEFAULT_DRAFTER]
    assert {c.runtime for c in defaults} == {"flat", "steep"} and all(
        c.predicted_tokens_per_s is None for c in defaults
    )
    assert all((c.k, c.k_policy) == (GenerationConfig().k, GenerationConfig().k_policy) for c in defaults)
    assert any(c.k_policy == "cost-model" and c.drafter == "prompt-lookup" for c in chosen)


def test_a_prompts_first_token_costs_what_target_onlys_did_whatever_drafts_after_it() -> None:
    from specdec.scheduling import CostCurve
    from specdec.tuning.search import DrafterSample, RuntimeFigures, _predict

    # decoding at 100 tok/s after a 0.1 s first token, 33 tokens a prompt: 33 / (0.1 + 32 / 100) tok/s over a prompt
    figures = RuntimeFigures("r", RuntimeConfig(), None, CostCurve({1: 0.010, 9: 0.010}), 0.0, 0.0, 0.0)
    figures.target_only_tokens_per_s, figures.decode_tokens_per_s = 33 / 0.42, 100.0
    figures.first_token_s, figures.tokens_per_prompt = 0.1, 33
    assert figures.prompt_rate(100.0) == pytest.approx(33 / 0.42)
    # a drafter that doubles the decoding rate (one of every step's 2 drafts kept, verifying free) does not double
    # the prompt's rate: its first token still takes 0.1 s
    sample = DrafterSample("prompt-lookup", ["r"], [(2, 1)] * 10, {1: 0.0, 2: 0.0})
    drafted = [c for c in _predict({"r": figures}, [sample], max_k=2) if c.k == 2][0]
    assert drafted.predicted_tokens_per_s == pytest.approx(33 / (0.1 + 32 / 200))


def test_a_fixed_cost_per_step_is_not_scaled_away_at_small_k() -> None:
    from specdec.tuning.search import DrafterSample

    head = DrafterSample("eagle", ["native"], [(8, 1)], {1: 0.005, 8: 0.006})
    assert head.draft_s(1) == 0.005 and head.draft_s(4) == pytest.approx(0.005 + 0.003 / 7)
    assert head.draft_s(12) == 0.006  # flat beyond the measured k
    assert DrafterSample("x", ["native"], [(8, 1)], {8: 0.002}).draft_s(1) == 0.002  # one measurement: flat


def test_prompts_are_split_per_category_and_small_files_or_budgets_are_refused() -> None:
    from specdec.tuning.search import _split

    pool = [(BenchPrompt(f"{c}{i}", c, "x"), [1, 2]) for c in ("a", "b", "c") for i in range(4)]
    search, held_out = _split(pool, TuneConfig(), prompt_s=0.01, drafters=3, runtimes=2, spent_s=1.0)
    assert [p.id for p, _ in held_out] == ["a0", "b0", "c0", "a2", "b2", "c2"]
    assert [p.id for p, _ in search] == ["a1", "b1", "c1", "a3", "b3", "c3"]
    with pytest.raises(PromptError, match=f"at least {MIN_HELD_OUT} held-out prompts.*give at least 8 prompts"):
        _split(pool[:2] + pool[4:6], TuneConfig(), prompt_s=0.01, drafters=3, runtimes=2, spent_s=1.0)
    with pytest.raises(PromptError, match="two of every category"):
        _split(pool[:9], TuneConfig(), prompt_s=0.01, drafters=3, runtimes=2, spent_s=1.0)  # c has one prompt
    # at 5 s a prompt, 8 contenders on 4 held-out prompts need 160 s of the 40% left for confirmation
    with pytest.raises(ConfigError, match="--budget-s 120 buys .* held-out prompts here.*give at least 400 s"):
        _split(pool, TuneConfig(budget_s=120), prompt_s=5.0, drafters=3, runtimes=2, spent_s=10.0)
    # 200 s buy 5 held-out prompts at 40 s; 290 s buy 3 search prompts at 80 s (10 drafters): every category
    search, held_out = _split(pool, TuneConfig(budget_s=500), prompt_s=5.0, drafters=10, runtimes=2, spent_s=10.0)
    assert len(held_out) == 5 and [p.category for p, _ in search] == ["a", "b", "c"]


def test_a_budget_too_small_is_refused_after_one_prompt_before_it_is_spent(
    tmp_path: Path, prompts_file: Path, tiny_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a slow machine (faked: a target-only prompt takes 20 s), a budget that cannot buy the least search is
    refused in one line naming the budget to give, after the first prompt: no cost curve, probe or drafter runs."""
    import time

    import specdec.tuning.search as search
    from specdec.engine.stats import DecodeStats

    monkeypatch.setattr(search, "_first_prompt", lambda *a: DecodeStats(new_tokens=32, steps=32, wall_s=20.0))
    monkeypatch.setattr(search, "_measure_runtime", lambda *a: pytest.fail("the budget was spent before refusing"))
    config = TuneConfig(
        target=str(tiny_folder), prompts=str(prompts_file), budget_s=300, runtimes=RUNTIMES[:1], drafters=("suffix",)
    )
    started = time.perf_counter()
    with pytest.raises(ConfigError, match=r"--budget-s 300 cannot buy.*20\.0 s on transformers/float32") as error:
        tune(config)
    assert time.perf_counter() - started < 30 and "\n" not in str(error.value)
    # 2 categories and 4 held-out prompts: 4 contenders (suffix, its cost-model policy, target-only, the default) on 4
    # prompts at 20 s need 320 s, 40% of 800
    least = int(str(error.value).rsplit("give at least ", 1)[1].removesuffix(" s"))
    assert least == 800
    monkeypatch.setattr(search, "_measure_runtime", lambda *a: pytest.fail("measured"))
    with pytest.raises(pytest.fail.Exception, match="measured"):  # that budget passes the check
        tune(replace(config, budget_s=least))


def test_slower_runtimes_leave_the_confirmation_when_the_budget_left_cannot_buy_them() -> None:
    from specdec.scheduling import CostCurve
    from specdec.tuning.search import Candidate, RuntimeFigures, _affordable

    def figures(label: str, prompt_s: float) -> RuntimeFigures:
        return RuntimeFigures(label, RuntimeConfig(), None, CostCurve({1: 0.01}), 10 / prompt_s, 0.0, 1.0, prompt_s)

    measured = {"native": figures("native", 1.0), "transformers/cpu": figures("transformers/cpu", 5.0)}
    chosen = [
        Candidate("native", "suffix", 5, "fixed", 30.0),
        Candidate("transformers/cpu", "eagle", 5, "fixed", 25.0),
        Candidate("native", "none", 1, "fixed", 10.0),
        Candidate("transformers/cpu", "none", 1, "fixed", 2.0),
        Candidate("native", DEFAULT_DRAFTER, 8, "cost-model", None),
        Candidate("transformers/cpu", DEFAULT_DRAFTER, 8, "cost-model", None),
    ]
    notes: list[str] = []
    assert _affordable(chosen, measured, 4, 4 * 18.0, notes) == chosen and not notes  # all of it fits
    kept = _affordable(chosen, measured, 4, 4 * 10.0, notes)  # only the fastest runtime's part fits
    assert [c.runtime for c in kept] == ["native"] * 3 and "transformers/cpu / eagle" in notes[0]
    assert _affordable(chosen, measured, 4, 4 * 2.0, []) == chosen  # not even that: the confirmation says so later


def test_the_default_is_kept_unless_a_contender_beats_it_beyond_the_noise() -> None:
    from specdec.tuning.search import Candidate, _choose

    def measured(drafter: str, rates: list[float]) -> Candidate:
        c = Candidate("native", drafter, 8, "fixed", 100.0)
        c.measured_by_prompt = rates
        c.measured_tokens_per_s = statistics.mean(r for r in rates if r)
        return c

    default = measured(DEFAULT_DRAFTER, [100, 100, 100, 100])
    target_only = measured("none", [60, 60, 60, 60])
    steady = measured("eagle", [106, 106, 106, 106])  # 6% faster on every prompt: beyond the margin and the noise
    assert _choose([default, target_only, steady], 4)[0] is steady
    noisy = measured("eagle", [150, 70, 140, 80])  # 10% faster overall, but up and down by prompt
    chosen, reference, threshold = _choose([default, target_only, noisy], 4)
    assert chosen is default and reference is default and threshold > 1.10
    slight = measured("eagle", [102, 102, 102, 102])  # within the margin
    assert _choose([default, target_only, slight], 4)[0] is default
    slow_default = measured(DEFAULT_DRAFTER, [50, 50, 50, 50])  # the default loses to target-only: target-only wins
    assert _choose([slow_default, target_only], 4)[0] is target_only
    once = measured("eagle", [300, None, None, None])  # fast on the one prompt it ran: too few to rest a choice on
    assert _choose([default, target_only, once], 4)[0] is default


def test_a_drafter_that_learns_starts_every_confirmation_round_afresh(tiny_folder: Path) -> None:
    from specdec.drafters.suffix import LEAD_IN
    from specdec.models import open_target
    from specdec.scheduling import CostCurve
    from specdec.tuning.search import Candidate, Confirmation, RuntimeFigures

    target = open_target(str(tiny_folder))
    figures = RuntimeFigures("t", RuntimeConfig(), target, CostCurve({1: 0.01}), 100.0, 0.0, 0.0)
    prompts = [(BenchPrompt(f"p{i}", "chat", "x"), target.tokenizer(f"ab ab ab {i}")["input_ids"]) for i in range(3)]
    notes: list[str] = []
    confirmation = Confirmation({"t": figures}, prompts, GenerationConfig(max_new_tokens=8), notes)
    learning, fixed = Candidate("t", "suffix", 4, "fixed", 1.0), Candidate("t", "prompt-lookup", 4, "fixed", 1.0)
    confirmation.add([learning, fixed])
    before = list(confirmation.generators)
    confirmation.run(deadline=float("inf"))
    confirmation.run(deadline=float("inf"), only=[learning])
    assert confirmation.generators[0] is not before[0] and confirmation.generators[1] is before[1]
    # nothing of the earlier rounds kept: only the warm-up's 4 tokens, led in by its prompt's last tokens
    assert confirmation.generators[0].drafter.store.token_count == 4 + LEAD_IN
    confirmation.record()
    assert learning.measured_tokens_per_s and len(learning.measured_by_prompt) == 3 and not notes


def test_sampled_prompts_cover_every_category() -> None:
    prompts = [BenchPrompt(f"{c}{i}", c, "x") for c in ("a", "b", "c") for i in range(5)]
    assert [p.category for p in round_robin(prompts)[:4]] == ["a", "b", "c", "a"]
    assert len(round_robin(prompts)) == 15


def test_tune_measures_predicts_confirms_on_held_out_prompts_and_never_picks_slower_than_the_default(
    tmp_path: Path, prompts_file: Path
) -> None:
    tokenizer = char_tokenizer()
    folder = tmp_path / "model"
    tiny_llama(1, vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    seen: list[str] = []
    config = TuneConfig(
        target=str(folder),
        prompts=str(prompts_file),
        budget_s=40,
        runtimes=RUNTIMES,
        drafters=("prompt-lookup", "suffix"),
    )
    profile, results = tune(config, seen.append)
    assert len(seen) == plan(config)[2]  # one progress unit per runtime, per drafter, and the confirmation
    assert set(results["runtimes"]) == set(RUNTIMES)
    for figures in results["runtimes"].values():
        assert figures["cost_ms"][1] > 0 and figures["target_only_tokens_per_s"] > 0 and figures["prompt_s"] > 0
    sampled = results["drafters"]["prompt-lookup"]
    assert sampled["steps"] > 0 and set(sampled["sampled_draft_ms_by_k"]) == {1, 8}
    assert {1, 8} <= set(sampled["draft_ms_by_k"])  # a k re-measured under load is added, none dropped
    # the search and the confirmation use different prompts, each covering both categories
    split = results["prompts"]
    assert len(split["held_out"]) == len(split["search"]) == 4 and not set(split["held_out"]) & set(split["search"])
    assert set(results["categories"]) == {"code", "chat"}
    predicted = {(c["runtime"], c["drafter"], c["k"]) for c in results["candidates"]}
    assert {(r, "prompt-lookup", k) for r in RUNTIMES for k in range(1, 9)} <= predicted
    confirmed = results["confirmed"]
    measured = [c for c in confirmed if c["measured_tokens_per_s"]]
    assert all(len(c["measured_by_prompt"]) == 4 for c in measured)
    # auto resolves to prompt lookup here: the cost-model contender is the default's configuration, run once
    assert [c["k_policy"] for c in confirmed if c not in measured] in ([], ["cost-model"])
    assert {c["drafter"] for c in confirmed} >= {"none", DEFAULT_DRAFTER, "prompt-lookup"}
    default = [c for c in confirmed if c["label"] == results["default"]][0]
    assert default["drafter"] == DEFAULT_DRAFTER and default["drafts_with"] == "suffix"  # auto, resolved
    # the fastest, unless it beats the default by less than the margin or the noise: then the default
    chosen = [c for c in confirmed if c["label"] == results["chosen"]][0]
    ratios = [a / b for a, b in zip(chosen["measured_by_prompt"], default["measured_by_prompt"], strict=True)]
    # the default, or a contender faster than it by the bar on the geometric mean of per-prompt ratios
    assert chosen is default or math.prod(ratios) ** (1 / len(ratios)) >= results["threshold"] > 1
    assert profile.measured["held_out_prompts"] == 4
    assert profile.target == str(folder) and profile.runtime.backend == "transformers"
    assert profile.drafter != DEFAULT_DRAFTER  # a profile names what runs
    assert results["elapsed_s"] < config.budget_s + 15  # the last confirmation round may overrun a little


class SlowsDownLater(PromptLookupDrafter):
    """Prompt lookup that sleeps at every step once it has drafted ``fast_steps``: a drafter whose short sample
    misjudges its cost (one that slows as its history grows, or a model the sample found in a warm cache)."""

    def __init__(self, fast_steps: int) -> None:
        super().__init__()
        self.left = fast_steps

    def propose(self, context: torch.Tensor, k: int, branches: int = 1):
        self.left -= 1
        if self.left < 0:
            import time

            time.sleep(0.02)
        return super().propose(context, k, branches)


@pytest.mark.slow
def test_a_drafter_far_slower_than_predicted_is_re_measured_and_not_chosen(
    tmp_path: Path, prompts_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import specdec.tuning.search as search

    tokenizer = char_tokenizer()
    folder = tmp_path / "model"
    tiny_llama(1, vocab=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    built = []

    def build(spec, target, runtime):  # the stand-in for every prompt-lookup the tuner builds (auto builds its own)
        if spec != "prompt-lookup":
            return build_drafter(spec, target, runtime)
        built.append(SlowsDownLater(fast_steps=10_000 if len(built) == 0 else 0))  # fast while sampled only
        return built[-1]

    monkeypatch.setattr(search, "build_drafter", build)
    config = TuneConfig(
        target=str(folder),
        prompts=str(prompts_file),
        budget_s=60,
        runtimes=RUNTIMES[:1],
        drafters=("prompt-lookup",),
        new_tokens=16,
    )
    profile, results = tune(config)
    stand_in = [c for c in results["confirmed"] if c["drafter"] == "prompt-lookup" and c["k_policy"] == "fixed"]
    assert stand_in and all(c["off_by"] < -0.15 for c in stand_in)  # far slower than predicted
    assert any("predicted" in note and "measured" in note for note in results["notes"])
    drafting = results["drafters"]["prompt-lookup"]["draft_ms_by_k"]
    assert any(ms >= 20 for ms in drafting.values())  # its drafting cost re-measured from the confirmation
    assert all(ms < 20 for ms in results["drafters"]["prompt-lookup"]["sampled_draft_ms_by_k"].values())
    chosen = [c for c in results["confirmed"] if c["label"] == results["chosen"]][0]
    assert chosen["drafter"] in (DEFAULT_DRAFTER, "none")  # neither the stand-in's fixed k nor its cost-model policy
    from specdec.tuning.report import write_tune_report

    write_tune_report(profile, results, tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    assert "off by more than 15%" in report and "Held out (4" in report


def test_tune_and_profile_on_the_command_line(tmp_path: Path, prompts_file: Path, tiny_folder: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "tuned"
    args = ["tune", "--target", str(tiny_folder), "--prompts", str(prompts_file), "--budget-s", "30", "--out", str(out)]
    result = runner.invoke(app, args + ["--runtimes", RUNTIMES[0], "--drafters", "prompt-lookup"])
    assert result.exit_code == 0, result.output
    assert "chosen:" in result.output
    for name in ("profile.json", "report.md", "results.json", "predicted_vs_measured.png"):
        assert (out / name).stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "| candidate | predicted | measured | measured / predicted |" in report and "## Runtimes" in report
    profile = out / "profile.json"
    generated = runner.invoke(
        app, ["generate", "abc abc", "--profile", str(profile), "--max-new-tokens", "6", "--json"]
    )
    assert generated.exit_code == 0, generated.output
    assert json.loads(generated.stdout.strip().splitlines()[-1])["stats"]["new_tokens"] == 6
    data = json.loads(profile.read_text())
    data["machine"]["cpu"] = "Another CPU"
    data["generation"]["k"] = 8  # so that --k 2 below is seen to win
    profile.write_text(json.dumps(data))
    warned = runner.invoke(
        app, ["generate", "abc", "--profile", str(profile), "--max-new-tokens", "12", "--k", "2", "--json"]
    )
    assert warned.exit_code == 0 and "tuned on another machine" in warned.output
    stats = json.loads(warned.stdout.strip().splitlines()[-1])["stats"]
    assert max(stats["k_per_step"]) <= 2  # --k given: the drafter group (draft, k, k policy) is the command line's
    switched = runner.invoke(
        app, ["generate", "abc", "--profile", str(profile), "--max-new-tokens", "2", "--dtype", "bfloat16"]
    )
    # --dtype given: the profile's precision plan is not applied with it
    assert switched.exit_code == 0, switched.output
    benched = runner.invoke(
        app,
        ["bench", "--profile", str(profile), "--prompts", str(prompts_file), "--quick", "--out", str(tmp_path / "b")],
    )
    assert benched.exit_code == 0, benched.output
    methods = json.loads((tmp_path / "b" / "results.json").read_text())["methods"]
    assert "none" in methods and all(name == "none" or name.startswith(f"{data['drafter']}@") for name in methods)
    chosen = runner.invoke(
        app,
        ["bench", "--profile", str(profile), "--prompts", str(prompts_file), "--quick", "--out", str(tmp_path / "c")]
        + ["--methods", "none,prompt-lookup"],
    )
    # --methods given: the profile's k = 8 (tuned for its drafter) is not taken
    assert chosen.exit_code == 0, chosen.output
    assert set(json.loads((tmp_path / "c" / "results.json").read_text())["methods"]) == {"none", "prompt-lookup@k4"}
    profile.write_text("{broken")
    broken = runner.invoke(app, ["generate", "abc", "--profile", str(profile)])
    assert broken.exit_code == 2 and "is not valid JSON" in broken.output and "Traceback" not in broken.output
    too_small = runner.invoke(app, args[:-2] + ["--budget-s", "3", "--out", str(tmp_path / "x")])
    assert too_small.exit_code == 2 and "too small to measure anything" in too_small.output
    sampling = runner.invoke(app, args[:-2] + ["--sampling", "hot", "--out", str(tmp_path / "y")])
    assert sampling.exit_code == 2 and "greedy or a temperature" in sampling.output
    small = tmp_path / "small.jsonl"
    small.write_text("".join(prompts_file.read_text().splitlines(keepends=True)[:4]))
    few = runner.invoke(
        app, args[:-2] + ["--runtimes", RUNTIMES[0], "--prompts", str(small), "--out", str(tmp_path / "z")]
    )
    said = " ".join(few.output.split())
    assert few.exit_code == 2 and "needs at least 4 held-out prompts" in said and "Traceback" not in said
    assert not (tmp_path / "z").exists()  # nothing written


@pytest.mark.slow
@pytest.mark.real_model
def test_tune_on_the_real_gemma_picks_a_configuration_at_least_as_fast_as_target_only(tmp_path: Path) -> None:
    config = TuneConfig(
        prompts="core",
        budget_s=150,
        runtimes=("transformers/cpu",),
        drafters=("prompt-lookup",),
        temperature=0.7,
        new_tokens=16,
    )
    profile, results = tune(config)
    sampled = results["drafters"]["prompt-lookup"]
    # the core prompts repeat themselves: some drafts are accepted
    assert sampled["steps"] > 10 and sampled["acceptance"] > 0
    target_only = [c for c in results["confirmed"] if c["drafter"] == "none"][0]
    assert profile.measured["tokens_per_s"] >= target_only["measured_tokens_per_s"]
    assert profile.generation.sampling == SamplingConfig(0.7)
    profile.save(tmp_path / "p.json")
    generator = Generator.from_profile(tmp_path / "p.json")
    assert generator.generate("def add(a, b):", max_new_tokens=8, seed=1).stats.new_tokens == 8


def test_serve_takes_its_runtime_from_a_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdec.models import llamacpp

    monkeypatch.setattr(llamacpp, "llama_cpp_problem", lambda: None)  # as where llama.cpp runs: serve's own refusal
    profile = tmp_path / "p.json"
    profile_of("gemma-3-270m", runtime=RuntimeConfig(backend="llama.cpp")).save(profile)
    result = CliRunner().invoke(app, ["serve", "--profile", str(profile)])
    assert result.exit_code == 2 and "the server runs transformers or native targets" in result.output
