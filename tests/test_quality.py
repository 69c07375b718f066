"""Long-generation guards, lossy typical acceptance and the quality measures, on tiny models and on Gemma."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_gemma3, tiny_llama
from scipy.stats import chisquare

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.cli.main import app
from specdec.config import GuardConfig, TypicalAcceptance
from specdec.errors import ConfigError
from specdec.guards import Guards, NoGuards, find_loop
from specdec.quality import SentenceEmbedder
from specdec.quality.metrics import contradiction_pairs, distinct_n, loop_onsets, measure, repeated_ngram_share
from specdec.verification import shape_logits, typical_verify

LOOPY = GuardConfig(repetition=True, loop_repeats=2, loop_min_span=6, loop_max_unit=8)


def test_find_loop_finds_planted_loops() -> None:
    unit = [11, 12, 13, 14, 15]
    loop = find_loop([3, 4, 5] + unit * 5)
    assert loop is not None and loop.unit == tuple(unit) and loop.next_token == 11 and loop.copies == 5
    one = find_loop([7, 8] + [9] * 30)
    assert one is not None and one.unit == (9,)
    assert find_loop([3, 4, 5] + unit * 5 + [99]) is None  # broken: only the end counts
    assert find_loop([3, 4] + unit * 2) is None  # two copies, 10 tokens: under the default 3 copies and 24 tokens
    assert find_loop(list(range(200))) is None


def test_find_loop_ignores_indentation_and_rules() -> None:
    tokenizer = char_tokenizer()
    from specdec.guards import ignorable_tokens

    ignorable = ignorable_tokens(tokenizer)
    # deep indentation, distinct lines
    code = "def f(x):\n" + "".join(f"    {'    ' * 6}y{i} = x * {i}\n" for i in range(6))
    table = ": a : b :\n" + ":---" * 12 + ":\n"  # a table border (the test tokenizer has no '|')
    for text in (code, table, "x" + " " * 40, "-" * 60):
        ids = tokenizer(text)["input_ids"]
        assert all(find_loop(ids[:i], ignorable=ignorable) is None for i in range(len(ids) + 1)), repr(text)
    looping = tokenizer("print('again')\n" * 4)["input_ids"]
    assert find_loop(looping, ignorable=ignorable) is not None


def test_guards_block_the_loop_and_schedule_the_temperature() -> None:
    guards = Guards(GuardConfig(repetition=True, temperature_schedule=(0.5, 1.5), schedule_tokens=10), prompt_length=2)
    tokens = torch.tensor([1, 2] + [7, 8] * 12)  # the output loops on (7, 8)
    logits = torch.zeros(2, 10)
    temperatures = guards.adjust(tokens, torch.tensor([7]), logits)  # in place
    assert logits[0, 7] == float("-inf") and torch.isfinite(logits[0, :7]).all()
    assert logits[1, 8] == float("-inf")  # after the draft token 7 the loop continues with 8
    assert guards.settle(at=24, accepted=1, anchored=False) == [
        {"kind": "loop_blocked", "at": 24},
        {"kind": "loop_blocked", "at": 25},
    ]
    assert torch.allclose(temperatures, torch.tensor([guards.temperature_at(24), guards.temperature_at(25)]))
    assert guards.temperature_at(0) == 0.5 and guards.temperature_at(5) == 1.0 and guards.temperature_at(99) == 1.5
    assert guards.trim(tokens, torch.tensor([7, 8])) == 0 and guards.trim(tokens, torch.tensor([5, 7])) == 2
    assert (
        NoGuards().adjust(tokens, torch.tensor([7]), logits) is None
        and NoGuards().trim(tokens, torch.tensor([7, 8])) == 2
    )
    anchor = Guards(GuardConfig(anchor_every=10), 0)
    assert [anchor.anchor_due(n) for n in (0, 9, 10, 11, 25, 29, 30)] == [False, False, True, False, True, False, True]


def _rule(config: GuardConfig, output: list[int], ignorable: frozenset[int]) -> set[int]:
    """The repetition guard's rule written out: after a loop found at most loop_cooldown tokens ago, every token that
    would repeat an n-gram of ``output``, and the one that would continue a loop it ends in now."""

    def loop(tokens: list[int]):
        return find_loop(tokens, config.loop_repeats, config.loop_min_span, config.loop_max_unit, ignorable)

    now, n = loop(output), config.block_ngram
    recent = range(len(output) - 1, max(len(output) - config.loop_cooldown, 0), -1)
    if now is None and not any(loop(output[:length]) for length in recent):
        return set()
    key = output[len(output) - n + 1 :]
    followers = {output[i + n - 1] for i in range(len(output) - n + 1) if output[i : i + n - 1] == key}
    return (followers if len(output) >= n else set()) | ({now.next_token} if now else set())


def test_the_repetition_guard_follows_its_rule_step_by_step() -> None:
    """Guards keeps its loops and n-grams as the output grows, and scans each step's drafts from there: at every
    position of every step (drafts trimmed, then logits masked, a random share accepted) it blocks what the rule
    written out blocks, over random settings, ignorable tokens and loopy outputs of a small vocabulary."""
    import random

    vocab, blocked_somewhere = 8, 0
    for trial in range(60):
        rng = random.Random(trial)
        config = GuardConfig(
            repetition=True,
            loop_repeats=rng.choice([2, 3, 4]),
            loop_min_span=rng.choice([2, 4, 9, 24]),
            loop_max_unit=rng.choice([1, 3, 7, 16]),
            loop_cooldown=rng.choice([1, 2, 5, 30]),
            block_ngram=rng.choice([1, 2, 3, 5]),
        )
        ignorable = frozenset(rng.sample(range(vocab), rng.choice([0, 2, 4])))
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(5))]
        guards, output = Guards(config, len(prompt), ignorable), []
        for _ in range(30):
            drafts: list[int] = []  # mostly copies of recent tokens: loops
            for _ in range(rng.randrange(7)):
                recent = output[-5:] + drafts[-3:]
                drafts.append(rng.choice(recent) if recent and rng.random() < 0.7 else rng.randrange(vocab))
            context = torch.tensor(prompt + output)
            kept = guards.trim(context, torch.tensor(drafts, dtype=torch.long))
            rules = [_rule(config, output + drafts[:i], ignorable) for i in range(len(drafts) + 1)]
            assert kept == next((i for i, t in enumerate(drafts) if t in rules[i]), len(drafts))
            logits = torch.zeros(kept + 1, vocab)
            guards.adjust(context, torch.tensor(drafts[:kept], dtype=torch.long), logits)
            for i in range(kept + 1):
                assert set((logits[i] == float("-inf")).nonzero().flatten().tolist()) == rules[i], (trial, i)
                blocked_somewhere += bool(rules[i])
            recent = output[-3:]
            output += drafts[: rng.randrange(kept + 1)] + [rng.choice(recent) if recent else rng.randrange(vocab)]
    assert blocked_somewhere > 500  # the rule had work to do


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize(
    "guards",
    [LOOPY, GuardConfig(anchor_every=7), GuardConfig(repetition=True, anchor_every=5, loop_repeats=2, loop_min_span=4)],
    ids=["repetition", "anchor", "both"],
)
def test_each_guard_keeps_greedy_identity_with_the_guarded_target(make_target, guards: GuardConfig) -> None:
    target = loaded(make_target(0))
    plain = Generator(target, "none")
    for drafter in ("prompt-lookup", "layerskip:1"):
        drafted = Generator(target, drafter)
        for prompt in ([1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41], [1, 7]):
            expected = plain.generate(prompt, max_new_tokens=40, stop_on_eos=False, guards=guards)
            got = drafted.generate(prompt, max_new_tokens=40, k=4, k_policy="fixed", stop_on_eos=False, guards=guards)
            assert got.token_ids == expected.token_ids, (drafter, prompt)
            if guards.anchor_every:
                at = [e["at"] for e in got.stats.events if e["kind"] == "anchor"]
                assert len(at) == got.stats.anchors >= 40 // guards.anchor_every - 1
                # the first step at or after each multiple of anchor_every (a step makes at most k + 1 = 5 tokens)
                assert all(j * guards.anchor_every <= a < j * guards.anchor_every + 5 for j, a in enumerate(at, 1))
            if guards.repetition:
                out = got.token_ids
                for i in range(len(out)):  # a detected loop is never continued
                    loop = find_loop(out[:i], guards.loop_repeats, guards.loop_min_span, guards.loop_max_unit)
                    assert loop is None or out[i] != loop.next_token


def test_the_repetition_guard_changes_a_looping_output() -> None:
    target = loaded(tiny_llama(0))
    plain = Generator(target, "prompt-lookup")
    looping = [
        p
        for p in ([1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41], [1, 7], [1, 3, 3, 3])
        if loop_onsets(plain.generate(p, max_new_tokens=60, stop_on_eos=False).token_ids, LOOPY)
    ]
    assert looping, "the tiny model must loop on at least one prompt for this test to mean anything"
    for prompt in looping:
        guarded = plain.generate(prompt, max_new_tokens=60, stop_on_eos=False, guards=LOOPY)
        assert any(e["kind"] == "loop_blocked" for e in guarded.stats.events)
        assert guarded.token_ids != plain.generate(prompt, max_new_tokens=60, stop_on_eos=False).token_ids


def _expected_guarded(model, prompt: list[int], temperatures: tuple[float, float, float]) -> torch.Tensor:
    """The law of three tokens at the scheduled temperatures, the third never repeating two equal tokens before it."""
    vocab = model.config.vocab_size
    probs = torch.ones(1)
    contexts = [prompt]
    for step, temperature in enumerate(temperatures):
        with torch.no_grad():
            logits = model(torch.tensor(contexts)).logits[:, -1].float()
        if step == 2:
            for row, context in enumerate(contexts):
                if context[-1] == context[-2]:
                    logits[row, context[-1]] = float("-inf")
        p = shape_logits(logits, SamplingConfig(temperature=temperature)).softmax(-1)
        probs = (probs[:, None] * p).flatten()
        contexts = [c + [t] for c in contexts for t in range(vocab)]
    return probs


def test_guarded_sampling_follows_the_guarded_target_law() -> None:
    """Temperature schedule and repetition guard together, through speculation with a poor draft: a chi-square test."""
    vocab = 6
    target = loaded(tiny_llama(3, vocab=vocab, scale=0.15))
    guards = GuardConfig(
        repetition=True,
        loop_repeats=2,
        loop_min_span=2,
        loop_max_unit=1,
        block_ngram=1,
        temperature_schedule=(1.4, 0.6),
        schedule_tokens=2,
    )
    gen = Generator(target, "layerskip:1")
    prompt = [1, 5, 3]
    expected = _expected_guarded(target.model, prompt, (1.4, 1.0, 0.6))
    n, counts, rejected = 3000, torch.zeros(vocab**3), 0
    for seed in range(n):
        r = gen.generate(
            prompt,
            max_new_tokens=3,
            k=2,
            k_policy="fixed",
            seed=seed,
            stop_on_eos=False,
            temperature=1.0,
            guards=guards,
        )
        a, b, c = r.token_ids
        counts[(a * vocab + b) * vocab + c] += 1
        rejected += r.stats.draft_tokens_proposed - r.stats.draft_tokens_accepted
    assert rejected > n * 0.2, "the draft must be poor enough that residual resampling is exercised"
    assert counts[expected == 0].sum() == 0, "a blocked loop continuation was produced"
    big = expected * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    wanted = torch.cat([expected[big], expected[~big].sum()[None]]).double() * n
    assert chisquare(observed.numpy(), (wanted * observed.sum() / wanted.sum()).numpy()).pvalue > 1e-3


def test_typical_acceptance_is_lossy_only_when_asked() -> None:
    assert GenerationConfig().typical_acceptance is None
    target = loaded(tiny_llama(0))
    gen = Generator(target, "layerskip:1")
    exact = gen.generate([1, 5, 9], max_new_tokens=30, k=4, k_policy="fixed", stop_on_eos=False)
    assert (
        not exact.stats.lossy
        and exact.token_ids
        == Generator(target, "none").generate([1, 5, 9], max_new_tokens=30, stop_on_eos=False).token_ids
    )
    loose = TypicalAcceptance(epsilon=0.5, alpha=0.9)
    lossy = gen.generate(
        [1, 5, 9], max_new_tokens=30, k=4, k_policy="fixed", stop_on_eos=False, typical_acceptance=loose
    )
    assert lossy.stats.lossy and lossy.to_dict()["stats"]["lossy"] is True
    assert lossy.stats.acceptance_rate >= exact.stats.acceptance_rate


def test_typical_rule_accepts_plausible_tokens_and_always_the_argmax() -> None:
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.2, 0.0001], [0.97, 0.01, 0.01, 0.01], [0.25, 0.25, 0.25, 0.25]]]))
    rule = TypicalAcceptance()
    greedy = SamplingConfig()
    # position 0 uncertain: 0.3 is plausible; position 1 confident: 0.01 is not
    verdict = typical_verify(torch.tensor([[1, 1]]), torch.tensor([2]), logits, greedy, rule)
    assert verdict.accepted.tolist() == [1] and verdict.next_token.tolist() == [0]
    verdict = typical_verify(torch.tensor([[3, 0]]), torch.tensor([2]), logits, greedy, rule)
    assert verdict.accepted.tolist() == [0]  # 0.0001 is below any threshold
    argmax = typical_verify(torch.tensor([[0, 0]]), torch.tensor([2]), logits, greedy, rule)
    assert argmax.accepted.tolist() == [2]


def test_guard_and_acceptance_errors() -> None:
    with pytest.raises(ConfigError, match="temperature > 0"):
        GenerationConfig(guards=GuardConfig(temperature_schedule=(0.7, 1.2)))
    with pytest.raises(ConfigError, match="drift_threshold"):
        GuardConfig(drift_anchor=True)
    with pytest.raises(ConfigError, match="anchor_every"):
        GuardConfig(anchor_every=0)
    with pytest.raises(ConfigError, match="epsilon"):
        TypicalAcceptance(epsilon=0)


def test_token_measures() -> None:
    assert distinct_n([1, 2, 3, 4], 1) == 1.0 and distinct_n([1, 1, 1, 1], 1) == 0.25
    assert repeated_ngram_share([1, 2, 3, 4, 1, 2, 3, 4], n=4) == pytest.approx(1 / 5)
    assert repeated_ngram_share(list(range(50)), n=4) == 0.0
    assert loop_onsets([5, 6] + [1, 2, 3] * 10) == [2 + 24]  # 8 copies of 3 tokens reach the 24-token span


def test_drift_monitor_reports_events_and_anchors_without_changing_greedy_output() -> None:
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    # no window is identical to the prompt
    always = GuardConfig(drift_threshold=1.0, drift_window=10, drift_anchor=True)
    guarded = Generator(target, "prompt-lookup").generate(
        "the cat sat on the mat", max_new_tokens=40, stop_on_eos=False, guards=always
    )
    drift = [e for e in guarded.stats.events if e["kind"] == "drift"]
    assert [e["at"] for e in drift] == [10, 20, 30, 40] and all(e["similarity"] < 1.0 for e in drift)
    assert guarded.stats.anchors >= 3  # each event but the last asks for an anchor step
    plain = Generator(target, "none").generate("the cat sat on the mat", max_new_tokens=40, stop_on_eos=False)
    assert guarded.token_ids == plain.token_ids


def test_embedding_measures_drift_and_negated_pairs() -> None:
    """The bundled all-MiniLM-L6-v2 (a real model): on-topic text scores above off-topic; one negation pair is found."""
    embedder = SentenceEmbedder()
    on, off = embedder.similarity(
        "How do I bake sourdough bread?",
        ["Feed the starter, mix flour and water, then bake.", "The senate passed a tax bill."],
    )
    assert on > 0.3 > off
    text = (
        "The bridge is open to traffic today. Cats sleep for most of the day. The bridge is not open to traffic today."
    )
    pairs = contradiction_pairs(embedder, text)
    assert len(pairs) == 1 and "not" in pairs[0][1]
    assert (
        contradiction_pairs(embedder, "The bridge is open to traffic today. The bridge is open to traffic today.") == []
    )
    words = "the bridge is open to traffic today and the river runs below it".split()
    ids = list(range(100)) + [7, 8, 9] * 40
    report = measure("bridge", ids, lambda chunk: " ".join(words[i % len(words)] for i in chunk), embedder)
    assert report.tokens == 220 and len(report.drift_curve) == 2 and len(report.repetition_curve) == 2
    assert report.repetition_curve[0] == 0.0 and report.repetition_curve[1] > 0.9 and report.loop_onsets == [124]


def test_quality_command_writes_report_and_plots(tiny_folder: Path, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "\n".join(
            json.dumps({"id": f"p{i}", "category": c, "prompt": f"the {c} prompt {i}"})
            for i, c in enumerate(["chat", "story"])
        )
    )
    out = tmp_path / "quality"
    args = [
        "quality",
        "--prompts",
        str(prompts),
        "--target",
        str(tiny_folder),
        "--draft",
        "prompt-lookup",
        "--categories",
        "chat,story",
    ]
    args += [
        "--per-category",
        "1",
        "--max-new-tokens",
        "100",
        "--configs",
        "greedy+repetition,sampled+typical (lossy)",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    # baselines added
    assert set(results["summary"]) == {"greedy", "sampled", "greedy+repetition", "sampled+typical (lossy)"}
    assert len(results["runs"]) == 8 and all(len(r["token_ids"]) == 100 for r in results["runs"])
    assert all(r["stats"]["lossy"] == ("typical" in r["config"]) for r in results["runs"])
    assert (out / "drift.png").stat().st_size > 0 and (out / "repetition.png").stat().st_size > 0
    assert "## chat" in (out / "report.md").read_text()
    bad = CliRunner().invoke(app, [*args[:-2], "--configs", "greedy+magic", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "greedy+magic" in bad.output


@pytest.mark.real_model
def test_guards_keep_gemma_greedy_identity(gemma) -> None:
    guards = GuardConfig(repetition=True, anchor_every=40)
    prompt = "List the days of the week, one per line, again and again:\nMonday\nTuesday\n"
    expected = Generator(gemma, "none").generate(prompt, max_new_tokens=120, stop_on_eos=False, guards=guards)
    got = Generator(gemma, "prompt-lookup").generate(
        prompt, max_new_tokens=120, k=8, k_policy="fixed", stop_on_eos=False, guards=guards
    )
    assert got.token_ids == expected.token_ids
    assert got.stats.anchors >= 2 and expected.stats.anchors >= 2
