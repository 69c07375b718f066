"""The batched engine: ragged caches, per-row exactness, rows joining and leaving, the dynamic window."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import char_tokenizer, loaded, perturbed, tiny_gemma3, tiny_llama

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import BatchConfig
from specdec.drafters import ModelDrafter, NoDrafter, PromptLookupDrafter
from specdec.engine.batch import BatchDecoder, Row
from specdec.errors import ConfigError
from specdec.models import TransformersBackend
from specdec.models.batched import BatchedTransformersBackend
from specdec.scheduling import BatchCostCurve, CostCurve, FixedK, LoadWindow

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 12], [1, 40, 41, 42, 43, 40, 41], [1, 7], [1, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3], [1, 60, 61]]
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
    assert batched.lengths == [s.shape[0] for s in seqs]
    order, feeds = [2, 0, 1], [torch.randint(3, 96, (n,), generator=gen) for n in (2, 3, 1)]  # every row, out of order
    out = batched.forward(order, feeds, last=1)
    for i, (row, feed) in enumerate(zip(order, feeds, strict=True)):
        torch.testing.assert_close(out[i], alone(torch.cat([seqs[row], feed]), 1), atol=1e-4, rtol=1e-4)


def _drafters(model, seed: int):
    yield "prompt-lookup", PromptLookupDrafter()
    yield "noisy copy", ModelDrafter(TransformersBackend(perturbed(model, noise=0.3, seed=seed)))
    yield "none", NoDrafter()


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_gemma3], ids=["llama", "gemma3-sliding"])
@pytest.mark.parametrize("window", ["fixed", "dynamic"])
def test_batched_greedy_equals_each_prompt_alone(make_target, window: str) -> None:
    target = loaded(make_target(1))
    expected = [Generator(target, NoDrafter()).generate(p, GREEDY).token_ids for p in PROMPTS]
    for name, drafter in _drafters(target.model, 1):
        gen = Generator(target, drafter, GREEDY, batch=BatchConfig(window=window))
        results = gen.generate_batch(PROMPTS)
        assert [r.token_ids for r in results] == expected, name
        assert all(r.finish_reason == "length" and r.stats.new_tokens == 30 for r in results)
        if name == "noisy copy" and window == "fixed":  # (the dynamic window may judge a draft as costly as this target not worth running)
            assert sum(r.stats.draft_tokens_accepted for r in results) > 0


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
        assert (result.token_ids, result.text, result.finish_reason) == (single.token_ids, single.text, single.finish_reason)
    assert results[0].finish_reason == "length" and len(results[0].token_ids) == 5
    assert results[1].finish_reason == "stop" and stop not in results[1].text


def test_rows_joining_and_leaving_do_not_disturb_the_others() -> None:
    target = loaded(tiny_gemma3(2))
    gen = Generator(target, ModelDrafter(TransformersBackend(perturbed(target.model, noise=0.2, seed=2))), GREEDY)
    expected = {tuple(p): Generator(target, NoDrafter()).generate(p, GREEDY).token_ids for p in PROMPTS}
    decoder = BatchDecoder(BatchedTransformersBackend(target.model))

    def row(prompt: list[int]) -> Row:
        return Row(torch.tensor([prompt]), GREEDY, gen.drafter.fork(), FixedK(4), torch.Generator())

    rows = [row(PROMPTS[0]), row(PROMPTS[1])]
    for r in rows:
        decoder.join(r)
    produced = {r.id: [] for r in rows}
    dropped = None
    for step in itertools.count():
        if step == 2:  # a row joins mid-run
            rows.append(row(PROMPTS[3]))
            decoder.join(rows[-1])
            produced[rows[-1].id] = []
        if step == 3:  # and one leaves before it is done
            dropped = rows[1]
            decoder.leave(dropped)
        for r, new in decoder.step().items():
            produced[r.id] += new.tolist()
        for r in [r for r in decoder.rows if decoder.exhausted(r)]:
            decoder.leave(r)
        if not decoder.rows:
            break
    assert produced[rows[0].id] == expected[tuple(PROMPTS[0])]
    assert produced[rows[2].id] == expected[tuple(PROMPTS[3])]
    assert produced[dropped.id] == expected[tuple(PROMPTS[1])][: len(produced[dropped.id])]
    assert decoder.backend.rows == 0


class _GreedyOnlyDrafter(PromptLookupDrafter):
    """Refuses sampling the way the cross-tokenizer drafter does, to make one request of a batch invalid."""

    def propose(self, context, k, sampling, seeds, min_confidence=0.0):
        if not sampling.greedy:
            raise ConfigError("this drafter supports greedy decoding only")
        return super().propose(context, k, sampling, seeds, min_confidence)


def test_an_invalid_request_fails_alone() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(target, _GreedyOnlyDrafter(), GREEDY)
    sampled = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=30, sampling=SamplingConfig(temperature=0.8))
    with pytest.raises(ConfigError, match="greedy decoding only"):
        gen.generate_batch(PROMPTS[:2], [GREEDY, sampled])
    decoder = BatchDecoder(BatchedTransformersBackend(target.model))
    good, bad = (
        Row(torch.tensor([p]), c, gen.drafter.fork(), FixedK(4), torch.Generator())
        for p, c in zip(PROMPTS[:2], (GREEDY, sampled), strict=True)
    )
    decoder.join(good)
    decoder.join(bad)
    produced: list[int] = []
    while not decoder.exhausted(good):
        produced += decoder.step().get(good, torch.tensor([], dtype=torch.long)).tolist()
        assert bad in decoder.failed and bad.stats.new_tokens == 0
    decoder.leave(bad)
    assert not decoder.failed and produced == Generator(target, NoDrafter()).generate(PROMPTS[0], GREEDY).token_ids


def _compute_bound(per_token: float = 0.005, overhead: float = 0.02) -> BatchCostCurve:
    """A machine where a forward costs a fixed overhead plus a price per token: speculation pays for small batches only."""
    return BatchCostCurve({rows: CostCurve({n: overhead + per_token * rows * n for n in (1, 2, 5, 9)}) for rows in (1, 4, 16)})


def test_batch_cost_curve_interpolates_and_extends() -> None:
    curve = _compute_bound()
    assert curve(4, 2) == pytest.approx(0.02 + 0.005 * 8)
    assert curve(10, 1) == pytest.approx((curve(4, 1) + curve(16, 1)) / 2)
    assert curve(32, 1) == pytest.approx(curve(16, 1) * 2)


def test_dynamic_window_follows_load_and_memory() -> None:
    memory = [0.5]
    window = LoadWindow(_compute_bound(), memory_threshold=0.8, memory=lambda: memory[0])
    small, large = window.choose([0.8], 0.0, max_k=8), window.choose([0.8] * 32, 0.0, max_k=8)
    assert small > 0 and large == 0  # verification is cheap for one row and not for 32: speculation turns off
    assert window.choose([0.8] * 2, 0.0, max_k=8) > 0  # and back on when the load falls
    assert window.choose([0.05], 0.0, max_k=8) == 0  # drafts that are never accepted are not worth verifying
    assert window.choose([0.8], 0.0, max_k=2) <= 2
    memory[0] = 0.9
    assert window.choose([0.8], 0.0, max_k=8) == 0  # over the memory threshold


def test_window_caps_each_rows_own_policy() -> None:
    target = loaded(tiny_llama(0))
    gen = Generator(
        target,
        ModelDrafter(TransformersBackend(target.model)),
        GenerationConfig(k=6, k_policy="fixed", max_new_tokens=20, stop_on_eos=False),
    )
    # Verifying more than 3 tokens per row is dear; forwards are priced in seconds so that drafting time is negligible.
    steep = CostCurve({1: 1.0, 2: 1.1, 3: 1.2, 5: 100.0, 9: 200.0})
    decoder = BatchDecoder(BatchedTransformersBackend(target.model), LoadWindow(BatchCostCurve({1: steep}), memory=lambda: 0.0))
    runs = [Row(torch.tensor([p]), gen.config, gen.drafter.fork(), FixedK(6), torch.Generator()) for p in PROMPTS]
    for r in runs:
        decoder.join(r)
    while any(not decoder.exhausted(r) for r in decoder.rows):
        decoder.step()
    windows = [report.window for report in decoder.reports]
    assert all(w is not None and 0 < w <= 2 for w in windows)  # the window stays where verification is cheap
    for r in runs:
        assert r.stats.k_per_step == [6] * r.stats.steps  # each row's policy still chose 6
        assert max(r.stats.accepted_per_step) <= max(windows)


def test_cuda_graphs_are_skipped_without_cuda() -> None:
    """On a CPU the graph option changes nothing: no graphs are made and outputs are those of plain forwards."""
    model = tiny_gemma3(0)
    with_graphs, without = BatchedTransformersBackend(model, cuda_graphs=True), BatchedTransformersBackend(model, cuda_graphs=False)
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
    with pytest.raises(ConfigError, match="unknown window"):
        BatchConfig(window="adaptive")
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
    results = Generator(gemma, "prompt-lookup", config, batch=BatchConfig(window="dynamic")).generate_batch(prompts)
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]
    assert [r.text for r in results] == [e.text for e in expected]
