"""The batched engine: ragged caches, per-row exactness, rows joining and leaving, the dynamic k_cap."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest
import torch
from conftest import char_tokenizer, loaded, perturbed, tiny_gemma3, tiny_llama

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import K_POLICIES, BatchConfig, GuardConfig, TypicalAcceptance
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.drafters.base import Proposal
from specdec.engine import Decoder
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.models.batched import BatchedTransformersBackend
from specdec.scheduling import BatchCostCurve, CostCurve, DynamicKCap

PROMPTS = [
    [1, 5, 9, 5, 9, 5, 9, 12],
    [1, 40, 41, 42, 43, 40, 41],
    [1, 7],
    [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3],
    [1, 60, 61],
]
GREEDY = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=30, stop_on_eos=False)


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_ragged_backend_matches_lone_sequences(make_target) -> None:
    """Rows fed different counts, rolled back by different amounts, removed and added, score as if alone."""
    model = make_target(0)
    solo, batched = TransformersBackend(model), BatchedTransformersBackend(model)

    def alone(tokens: torch.Tensor, last: int) -> torch.Tensor:
        solo.reset()
        return solo.forward(tokens[None], last=last)[0]

    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, 96, (n,), generator=gen) for n in (5, 9, 14)]
    batched.add_rows(3)
    out = batched.forward([0, 1, 2], seqs, last=3)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(out[i], alone(seq, 3), atol=1e-4, rtol=1e-4)
    batched.truncate(1, 7)  # a rejection rolls row 1 back past the sliding window's start
    seqs[1] = seqs[1][:7]
    feeds = [torch.randint(3, 96, (n,), generator=gen) for n in (4, 2, 1)]
    out = batched.forward([0, 1, 2], feeds, last=2)
    for i, feed in enumerate(feeds):
        seqs[i] = torch.cat([seqs[i], feed])
        shown = min(2, feed.shape[0])  # a feed shorter than `last` has its logits right-aligned
        torch.testing.assert_close(out[i, -shown:], alone(seqs[i], shown), atol=1e-4, rtol=1e-4)
    batched.remove_rows([1])
    del seqs[1]
    batched.add_rows(1)
    seqs.append(torch.randint(3, 96, (20,), generator=gen))
    torch.testing.assert_close(batched.forward([2], [seqs[2]], last=1)[0], alone(seqs[2], 1), atol=1e-4, rtol=1e-4)
    feeds = [torch.randint(3, 96, (n,), generator=gen) for n in (3, 1, 2)]
    out = batched.forward([0, 1, 2], feeds, last=1)
    for i, feed in enumerate(feeds):
        torch.testing.assert_close(out[i], alone(torch.cat([seqs[i], feed]), 1), atol=1e-4, rtol=1e-4)
    seqs = [torch.cat([s, f]) for s, f in zip(seqs, feeds, strict=True)]
    assert batched.cached_lengths == [s.shape[0] for s in seqs]
    order, feeds = [2, 0, 1], [torch.randint(3, 96, (n,), generator=gen) for n in (2, 3, 1)]  # every row, out of order
    out = batched.forward(order, feeds, last=1)
    for i, (row, feed) in enumerate(zip(order, feeds, strict=True)):
        torch.testing.assert_close(out[i], alone(torch.cat([seqs[row], feed]), 1), atol=1e-4, rtol=1e-4)


def _drafters(model, seed: int):
    yield "prompt-lookup", PromptLookupDrafter()
    yield "noisy copy", ModelDrafter(TransformersBackend(perturbed(model, noise=0.3, seed=seed)))
    yield "none", NoDrafter()


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("k_cap", ["fixed", "dynamic"])
def test_batched_greedy_equals_each_prompt_alone(make_target, k_cap: str) -> None:
    target = loaded(make_target(1))
    expected = [Generator(target, NoDrafter()).generate(p, GREEDY).token_ids for p in PROMPTS]
    for name, drafter in _drafters(target.model, 1):
        gen = Generator(target, drafter, GREEDY, batch=BatchConfig(k_cap=k_cap))
        results = gen.generate_batch(PROMPTS)
        assert [r.token_ids for r in results] == expected, name
        assert all(r.finish_reason == "length" and r.stats.new_tokens == 30 for r in results)
        # (the dynamic k_cap may judge a draft as costly as this target not worth running)
        if name == "noisy copy" and k_cap == "fixed":
            assert sum(r.stats.draft_tokens_accepted for r in results) > 0


def test_rows_with_one_prompt_share_its_reading() -> None:
    """n answers to one prompt on the batched transformers backend: the prompt is read once (the others copy the
    first row's cache) and each answer, greedy or sampled with its own seed, is the one it gets alone."""
    from test_native import fed_lengths

    target = loaded(tiny_llama(1))
    gen = Generator(target, "prompt-lookup", GREEDY)
    configs = [
        replace(GREEDY, sampling=SamplingConfig(temperature=t), seed=seed) for t, seed in [(0, 0), (1, 1), (1, 2)]
    ]
    alone = [gen.generate(PROMPTS[3], config).token_ids for config in configs]
    decoder = gen.batch_decoder(len(configs))
    fed = fed_lengths(decoder.backend)
    assert [r.token_ids for r in gen.generate_batch([PROMPTS[3]] * 3, configs, decoder=decoder)] == alone
    assert fed[0] == [len(PROMPTS[3]) - 1] and all(max(rows) <= 1 + GREEDY.k for rows in fed[1:]), fed


def test_rows_stop_on_their_own_terms() -> None:
    """Per-row max_new_tokens, stop strings and EOS; a finished row leaves while the others go on."""
    tokenizer = char_tokenizer()
    target = loaded(tiny_llama(0, vocab=len(tokenizer)), tokenizer=tokenizer)
    gen = Generator(target, "prompt-lookup", GenerationConfig(k=3, k_policy="fixed"))
    prompts = ["abc abc abc", "hello there", "xyz", "1, 2, 3, 4"]
    alone = gen.generate(prompts[1], max_new_tokens=40)
    stop = alone.text[5:7]  # a string the target writes after a few tokens
    configs = [
        GenerationConfig(k=3, k_policy="fixed", max_new_tokens=5),
        GenerationConfig(k=3, k_policy="fixed", max_new_tokens=40, stop=(stop,)),
        GenerationConfig(k=2, k_policy="fixed", max_new_tokens=12, stop_on_eos=False),
        GenerationConfig(k=3, k_policy="fixed", max_new_tokens=20),
    ]
    results = gen.generate_batch(prompts, configs)
    for prompt, config, result in zip(prompts, configs, results, strict=True):
        single = gen.generate(prompt, config)
        assert (result.token_ids, result.text, result.finish_reason) == (
            single.token_ids,
            single.text,
            single.finish_reason,
        )
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 5
    assert results[1].finish_reason == "stop" and stop not in results[1].text


def test_rows_joining_and_leaving_do_not_disturb_the_others() -> None:
    target = loaded(tiny_gemma3(2))
    gen = Generator(target, ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.2, seed=2))), GREEDY)
    expected = {tuple(p): Generator(target, NoDrafter()).generate(p, GREEDY).token_ids for p in PROMPTS}
    decoder = gen.batch_decoder()
    runs = [gen.completion(p) for p in (PROMPTS[0], PROMPTS[1])]
    for run in runs:
        gen.admit(decoder, run)
    for step in itertools.count():
        if step == 2:  # a run joins mid-way
            runs.append(gen.completion(PROMPTS[3]))
            gen.admit(decoder, runs[-1])
        if step == 3:  # and one leaves before it is done
            decoder.leave(runs[1])
        updates = decoder.step()
        assert all(u.done == (u.completion not in decoder.rows) for u in updates)
        if not decoder.rows:
            break
    assert runs[0].token_ids == expected[tuple(PROMPTS[0])] and runs[0].finish_reason == "length"
    assert runs[2].token_ids == expected[tuple(PROMPTS[3])]
    assert (
        0 < len(runs[1].token_ids) < 30 and runs[1].token_ids == expected[tuple(PROMPTS[1])][: len(runs[1].token_ids)]
    )
    assert decoder.backend.cached_lengths == []


class _GreedyOnlyDrafter(PromptLookupDrafter):
    """Refuses sampling the way the cross-tokenizer drafter does, to make one request of a batch invalid."""

    def begin(self, settings):
        if not settings.sampling.greedy:
            raise ConfigError("this drafter supports greedy decoding only")


def test_an_invalid_request_fails_alone() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(target, _GreedyOnlyDrafter(), GREEDY)
    sampled = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=30, sampling=SamplingConfig(temperature=0.8))
    with pytest.raises(ConfigError, match="greedy decoding only"):
        gen.generate_batch(PROMPTS[:2], [GREEDY, sampled])
    decoder = gen.batch_decoder()
    good, bad = gen.completion(PROMPTS[0], GREEDY), gen.completion(PROMPTS[1], sampled)
    gen.admit(decoder, good)
    with pytest.raises(ConfigError, match="greedy decoding only"):  # refused when it joins, before any step
        gen.admit(decoder, bad)
    assert list(decoder.rows) == [good] and len(decoder.backend.cached_lengths) == 1
    while decoder.rows:
        decoder.step()
    assert good.token_ids == Generator(target, NoDrafter()).generate(PROMPTS[0], GREEDY).token_ids


GUARDED = [
    GuardConfig(repetition=True, loop_repeats=2, loop_min_span=4),
    GuardConfig(anchor_every=7),
    GuardConfig(repetition=True, loop_repeats=2, loop_min_span=4, anchor_every=5),
]


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
def test_guarded_and_typical_rows_in_a_batch_equal_each_row_alone(make_target) -> None:
    """Guards and (greedy) typical acceptance run in batches: each row's greedy output is what it gets decoded alone."""
    target = loaded(make_target(3))
    longer = replace(GREEDY, max_new_tokens=40)
    configs = [replace(longer, guards=g) for g in GUARDED] + [
        replace(longer, typical_acceptance=TypicalAcceptance()),
        longer,
    ]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    for drafter in (
        PromptLookupDrafter(),
        ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.3, seed=3))),
    ):
        gen = Generator(target, drafter, GREEDY, batch=BatchConfig(k_cap="fixed"))
        together = gen.generate_batch(prompts, configs)
        for prompt, config, got in zip(prompts, configs, together, strict=True):
            alone = gen.generate(prompt, config)
            assert got.token_ids == alone.token_ids and got.stats.events == alone.stats.events
        assert any(e["kind"] == "loop_blocked" for e in together[0].stats.events)  # the guard had something to do
        assert together[1].stats.anchors >= 5 and together[3].stats.lossy and not together[4].stats.lossy
    plain = Generator(target, NoDrafter()).generate(PROMPTS[1], longer)
    assert together[1].token_ids == plain.token_ids  # anchors change no greedy output


def test_sampled_guarded_rows_in_a_batch_follow_their_seeds() -> None:
    """A temperature schedule and typical acceptance with sampling: a seeded row gives the same output in a batch as
    alone."""
    target = loaded(tiny_llama(4))
    sampled = replace(GREEDY, sampling=SamplingConfig(temperature=0.9), seed=11)
    configs = [
        replace(sampled, guards=GuardConfig(temperature_schedule=(0.5, 1.5), schedule_tokens=20)),
        replace(sampled, typical_acceptance=TypicalAcceptance()),
        sampled,
    ]
    gen = Generator(target, PromptLookupDrafter(), GREEDY, batch=BatchConfig(k_cap="fixed"))
    together = gen.generate_batch(PROMPTS[:3], configs)
    for prompt, config, got in zip(PROMPTS[:3], configs, together, strict=True):
        assert got.token_ids == gen.generate(prompt, config).token_ids


def _compute_bound(per_token: float = 0.005, overhead: float = 0.02) -> BatchCostCurve:
    """A machine where a forward costs a fixed overhead plus a price per token: speculation pays for small batches
    only."""
    return BatchCostCurve(
        {rows: CostCurve({n: overhead + per_token * rows * n for n in (1, 2, 5, 9)}) for rows in (1, 4, 16)}
    )


def test_batch_cost_curve_interpolates_and_extends() -> None:
    curve = _compute_bound()
    assert curve(4, 2) == pytest.approx(0.02 + 0.005 * 8)
    assert curve(10, 1) == pytest.approx((curve(4, 1) + curve(16, 1)) / 2)
    assert curve(32, 1) == pytest.approx(curve(16, 1) * 2)


def test_the_dynamic_k_cap_follows_load_and_memory() -> None:
    memory = [0.5]
    k_cap = DynamicKCap(_compute_bound(), memory_threshold=0.8, memory=lambda: memory[0])
    small, large = k_cap.choose([0.8], 0.0, max_k=8), k_cap.choose([0.8] * 32, 0.0, max_k=8)
    assert small > 0 and large == 0  # verification is cheap for one row and not for 32: speculation turns off
    assert k_cap.choose([0.8] * 2, 0.0, max_k=8) > 0  # and back on when the load falls
    assert k_cap.choose([0.05], 0.0, max_k=8) == 0  # drafts that are never accepted are not worth verifying
    assert k_cap.choose([0.8], 0.0, max_k=2) <= 2
    memory[0] = 0.9
    assert k_cap.choose([0.8], 0.0, max_k=8) == 0  # over the memory threshold


def test_the_k_cap_caps_each_rows_own_policy() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(
        target,
        ModelDrafter(TransformersBackend(target.model)),
        GenerationConfig(k=6, k_policy="fixed", max_new_tokens=20, stop_on_eos=False),
    )
    # Verifying more than 3 tokens per row is dear; forwards are priced in seconds so that drafting time is negligible.
    steep = CostCurve({1: 1.0, 2: 1.1, 3: 1.2, 5: 100.0, 9: 200.0})
    decoder = Decoder(
        BatchedTransformersBackend(target.model), DynamicKCap(BatchCostCurve({1: steep}), memory=lambda: 0.0)
    )
    runs = [gen.completion(p) for p in PROMPTS]
    for run in runs:
        gen.admit(decoder, run)
    while decoder.rows:
        decoder.step()
    caps = [report.k_cap for report in decoder.reports]
    assert all(c is not None and 0 < c <= 2 for c in caps)  # the k_cap stays where verification is cheap
    for run in runs:
        assert run.stats.k_per_step == [6] * run.stats.steps  # each row's policy still chose 6
        assert max(run.stats.accepted_per_step) <= max(caps)


class SlowOnce(PromptLookupDrafter):
    """Prompt lookup whose first draft is held up, as by a stretch of load from another process."""

    def __init__(self, delay_s: float) -> None:
        super().__init__()
        self.delay_s = delay_s

    def propose(self, context: torch.Tensor, k: int, branches: int = 1) -> Proposal:
        proposal = super().propose(context, k, branches)
        if self.delay_s and len(proposal.tokens):
            time.sleep(self.delay_s)
            self.delay_s = 0.0
        return proposal

    def fork(self) -> SlowOnce:
        return self  # one sequence here: the delay is spent once


def test_a_drafting_cost_measured_under_load_does_not_turn_speculation_off_for_good() -> None:
    """A draft held up once makes drafting look dear and the k_cap falls to 0; with nothing drafted the measured cost
    relaxes, so drafting is tried again rather than left off for the decoder's life (a server's)."""
    target = loaded(tiny_llama(0))
    gen = Generator(
        target, SlowOnce(0.3), GenerationConfig(k=4, k_policy="fixed", max_new_tokens=80, stop_on_eos=False)
    )
    # Verifying 2 tokens costs 10% more than 1: drafting pays while it costs well under a millisecond a token.
    cheap = CostCurve({1: 0.010, 2: 0.011, 3: 0.012, 5: 0.014, 9: 0.020})
    decoder = Decoder(
        BatchedTransformersBackend(target.model), DynamicKCap(BatchCostCurve({1: cheap}), memory=lambda: 0.0)
    )
    gen.admit(decoder, gen.completion(PROMPTS[0]))
    while decoder.rows:
        decoder.step()
    caps = [report.k_cap for report in decoder.reports]
    closed = caps.index(0)  # the held-up draft closed it
    assert any(cap for cap in caps[closed:]), caps  # and it opened again


@pytest.mark.parametrize("policy", K_POLICIES)
def test_every_k_policy_runs_in_a_batch(policy: str) -> None:
    """Each row keeps its own k policy in a batch: greedy rows still equal target-only, and the policy's choices are
    recorded."""
    target = loaded(tiny_llama(2))
    expected = [Generator(target, NoDrafter()).generate(p, GREEDY).token_ids for p in PROMPTS[:3]]
    draft = ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.3, seed=2)))
    results = Generator(
        target, draft, replace(GREEDY, k_policy=policy), batch=BatchConfig(k_cap="fixed")
    ).generate_batch(PROMPTS[:3])
    assert [r.token_ids for r in results] == expected
    assert all(len(r.stats.k_per_step) == r.stats.steps and max(r.stats.k_per_step) <= GREEDY.k for r in results)


def test_cuda_graphs_are_skipped_without_cuda() -> None:
    """On a CPU the graph option changes nothing: no graphs are made and outputs are those of plain forwards."""
    model = tiny_gemma3(0)
    with_graphs, without = (
        BatchedTransformersBackend(model, cuda_graphs=True),
        BatchedTransformersBackend(model, cuda_graphs=False),
    )
    assert with_graphs.graphs is None and without.graphs is None
    for backend in (with_graphs, without):
        backend.add_rows(2)
    feeds = [torch.tensor([1, 5, 9, 5]), torch.tensor([1, 7])]
    assert torch.equal(with_graphs.forward([0, 1], feeds, last=2), without.forward([0, 1], feeds, last=2))
    assert with_graphs.cache.width == without.cache.width == 4  # no widths rounded up for graph reuse


def test_batched_generation_errors() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(target, "prompt-lookup")
    with pytest.raises(ConfigError, match="one config, or one per prompt"):
        gen.generate_batch([[1, 2], [1, 3]], [GREEDY])
    with pytest.raises(ConfigError, match="unknown k_cap"):
        BatchConfig(k_cap="adaptive")
    with pytest.warns(DeprecationWarning, match="use k_cap"):  # the former name, still accepted
        assert BatchConfig(window="fixed") == BatchConfig(k_cap="fixed")
    with pytest.raises(ConfigError, match="give k_cap alone"):  # two names that disagree: neither is guessed
        BatchConfig(k_cap="fixed", window="dynamic")
    with pytest.raises(ConfigError, match="memory_threshold"):
        BatchConfig(memory_threshold=1.5)


@pytest.mark.real_model
def test_gemma_batched_greedy_equals_alone(gemma) -> None:
    prompts = [
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
        "The three primary colours are",
        "Question: What is the capital of France?\nAnswer:",
        "import numpy as np\nx = np.arange(10)\ny = x ** 2\nprint(",
    ]
    config = GenerationConfig(k=6, k_policy="fixed", max_new_tokens=24)
    alone = Generator(gemma, "none", config)
    expected = [alone.generate(p) for p in prompts]
    results = Generator(gemma, "prompt-lookup", config, batch=BatchConfig(k_cap="dynamic")).generate_batch(prompts)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]


# Client settings at their bounds, as a request sends them (the server refuses anything past them): one case per
# kind of work they drive.
EXTREME_REQUESTS = {
    "loops found and blocked most": {
        "guards": {
            "repetition": True,
            "loop_repeats": 2,
            "loop_min_span": 2,
            "loop_max_unit": 256,
            "loop_cooldown": 4096,
            "block_ngram": 32,
        }
    },
    "every repeated token blocked": {"guards": {"repetition": True, "loop_repeats": 2, "block_ngram": 1}},
    "the longest loops": {"guards": {"repetition": True, "loop_repeats": 16, "loop_min_span": 4096}},
    "an anchor every token": {"guards": {"anchor_every": 1}},
    "the longest stop strings": {"stop": [ch * 255 + "#" for ch in "eat "]},  # long partial matches to hold back
}


@pytest.mark.parametrize("body", EXTREME_REQUESTS.values(), ids=EXTREME_REQUESTS.keys())
def test_a_request_at_the_settings_bounds_does_not_slow_the_batch(body: dict) -> None:
    """The engine thread is shared: a request with settings at their bounds costs the batch's steps less than twice
    what a request with the defaults does, however long its output grows. Two batches (a plain request and the one
    with settings; the plain request and one with defaults) are stepped in turn; medians over the later steps of this
    process's CPU time per step, on one thread (which other processes' load hardly moves)."""
    import time

    from specdec.serving.protocol import CompletionRequest

    tokenizer = char_tokenizer()
    model = tiny_llama(0, vocab=len(tokenizer), context=4096)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied: it repeats itself, so the guards have work
    target = loaded(model, tokenizer=tokenizer)
    gen = Generator(target, "prompt-lookup", GenerationConfig(k=8, k_policy="fixed"), batch=BatchConfig(k_cap="fixed"))

    def request(settings: dict):
        sent = CompletionRequest(prompt="the cat sat on the mat. the cat", temperature=0, ignore_eos=True, **settings)
        sent.unsupported()  # the server's every check
        return gen.completion(sent.prompt, sent.generation_config(gen.config, 3000))

    batches = []
    for settings in ({}, body):
        decoder = gen.batch_decoder()
        for completion in (request({}), request(settings)):
            gen.admit(decoder, completion)
        batches.append((decoder, []))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # idle pool threads spinning would count as CPU time
    try:
        for _ in range(200):
            for decoder, costs in batches:
                start = time.process_time()
                decoder.step()
                costs.append(time.process_time() - start)
    finally:
        torch.set_num_threads(threads)
    assert all(len(decoder.rows) == 2 and min(len(c.token_ids) for c in decoder.rows) >= 200 for decoder, _ in batches)
    normal, extreme = (sorted(costs[100:])[50] for _, costs in batches)
    assert extreme < 2 * normal, (extreme, normal)
