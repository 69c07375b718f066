"""Batches on the native runtime: rows with ragged caches in one forward, each row's logits bit for bit those it gets
alone (chains and trees, any batch size, any thread count), and everything that batches running on it."""

from __future__ import annotations

import pytest
import torch
from conftest import char_tokenizer, loaded
from test_native import FAMILIES, NATIVE, PROMPTS, models

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.config import BatchConfig, GuardConfig
from specdec.models.native import NativeBackend, NativeModel, NativeRows, kernel_build

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")

TREE = torch.tensor([-1, -1, 0, 0, 2])  # two roots; node 0 has two children; node 2 one


def _alone(model: NativeModel, feeds: list[torch.Tensor], trees: list[torch.Tensor | None]) -> list[torch.Tensor]:
    """One row's logits of each of its forwards (every position), decoded alone on the single-sequence backend."""
    backend = NativeBackend(model)
    return [backend.forward(feed[None], last=len(feed), tree=tree)[0] for feed, tree in zip(feeds, trees, strict=True)]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("family", ["llama", "gemma3", "qwen3"])
def test_a_rows_logits_do_not_depend_on_the_batch(family: str, threads: int) -> None:
    """Rows of different lengths (past Gemma-3's window of 6), then chains of drafts, then a tree on every other row:
    every row's logits in batches of 1, 3 and 5 rows equal its logits alone, bit for bit, at 1 and 2 threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = NativeModel.from_module(models()[1][family])
        generator = torch.Generator().manual_seed(0)
        feeds = [
            [torch.randint(3, model.vocab_size, (n,), generator=generator) for n in (length, 4, 6)]
            for length in (3, 17, 9, 1, 30)
        ]
        # The last forward's feed: the pending token, then a tree of 5 nodes (even rows) or a chain (odd rows).
        shapes = [[None, None, TREE if i % 2 == 0 else None] for i in range(len(feeds))]
        expected = [_alone(model, row, shape) for row, shape in zip(feeds, shapes, strict=True)]
        for size in (1, 3, 5):
            rows = NativeRows(model)
            rows.add_rows(size)
            for step in range(3):
                step_feeds = [feeds[i][step] for i in range(size)]
                width = max(len(feed) for feed in step_feeds)
                got = rows.forward(list(range(size)), step_feeds, width, [shapes[i][step] for i in range(size)])
                for i, feed in enumerate(step_feeds):
                    assert torch.equal(got[i, width - len(feed) :], expected[i][step]), (size, step, i)
            assert rows.cached_lengths == [sum(len(f) for f in feeds[i]) for i in range(size)]
    finally:
        torch.set_num_threads(previous)


def test_rows_truncate_and_leave_on_their_own() -> None:
    """A tree's accepted path moved next to the context in one row, another row rolled back, a third removed: the
    remaining rows then score as they would alone after the same history."""
    model = NativeModel.from_module(models()[1]["llama"])
    ids = torch.randint(3, model.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    rows = NativeRows(model)
    rows.add_rows(3)
    rows.forward([0, 1, 2], [ids[:10], ids[:20], ids[:5]], 1)
    rows.forward([0, 1], [ids[10:16], ids[20:24]], 6, [TREE, None])
    rows.truncate(0, 13, [11, 13])  # kept: the pending token, then nodes 0 and 2 of the tree
    rows.truncate(1, 22)
    rows.remove_rows([2])
    got = rows.forward([0, 1], [ids[30:33], ids[33:35]], 3)

    alone = NativeBackend(model)
    alone.forward(ids[None, :10], last=1)
    alone.forward(ids[None, 10:16], last=6, tree=TREE)
    alone.truncate(13, [11, 13])
    assert torch.equal(got[0], alone.forward(ids[None, 30:33], last=3)[0])
    alone = NativeBackend(model)
    alone.forward(ids[None, :22], last=1)
    assert torch.equal(got[1, 1:], alone.forward(ids[None, 33:35], last=2)[0])
    assert rows.cached_lengths == [16, 24]


def test_hidden_states_come_per_row() -> None:
    model = NativeModel.from_module(models()[1]["gemma3"])
    ids = torch.randint(3, model.vocab_size, (12,), generator=torch.Generator().manual_seed(2))
    rows = NativeRows(model)
    rows.add_rows(2)
    rows.forward([0, 1], [ids[:7], ids[7:]], 2, features=True)
    alone = NativeBackend(model)
    alone.forward(ids[None, 7:], last=2, features=True)
    assert [h.shape[0] for h in rows.last_features] == [7, 5]
    assert torch.equal(rows.last_features[1], alone.last_features[0])


@pytest.mark.parametrize("family", FAMILIES[:2])
def test_generate_batch_on_native_equals_each_row_alone(family: str) -> None:
    """Greedy rows with and without drafts, sampled rows with their own seeds, a tree row, every k policy: each row
    of one batch (dynamic k_cap and fixed) produces what it produces alone."""
    tokenizer, model = char_tokenizer(), models()[1][family]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=NATIVE).target
    configs = [
        GenerationConfig(max_new_tokens=24, stop_on_eos=False, k=6, k_policy=policy, seed=seed, sampling=sampling)
        for policy in ("fixed", "heuristic", "cost-model")
        for seed, sampling in ((0, SamplingConfig()), (3, SamplingConfig(temperature=0.8)))
    ] + [GenerationConfig(max_new_tokens=24, stop_on_eos=False, k=6, k_policy="fixed", branches=3, seed=1)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))]
    for k_cap in ("fixed", "dynamic"):
        gen = Generator(target, "prompt-lookup", runtime=NATIVE, batch=BatchConfig(k_cap=k_cap))
        if k_cap == "dynamic":  # the k_cap may cap k: compare greedy rows with their target-only text
            greedy = [i for i, c in enumerate(configs) if c.sampling.greedy]
            solo = Generator(target, "none", runtime=NATIVE)
            batch = gen.generate_batch([prompts[i] for i in greedy], [configs[i] for i in greedy])
            for i, result in zip(greedy, batch, strict=True):
                assert result.token_ids == solo.generate(prompts[i], configs[i]).token_ids
            continue
        batch = gen.generate_batch(prompts, configs)
        for prompt, config, result in zip(prompts, configs, batch, strict=True):
            assert result.token_ids == gen.generate(prompt, config).token_ids, (family, config)


def test_a_32_row_batch_of_mixed_rows_equals_each_row_alone() -> None:
    """32 rows at once on native: greedy and sampled rows, guarded rows (loop blocking, a temperature schedule,
    anchors), a tree row, each k policy; every row's tokens are those it produces alone."""
    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=NATIVE).target
    gen = Generator(target, "prompt-lookup", runtime=NATIVE, batch=BatchConfig(k_cap="fixed"))
    guards = [
        GuardConfig(),
        GuardConfig(repetition=True, loop_min_span=8),
        GuardConfig(temperature_schedule=(0.7, 1.2), schedule_tokens=16),
        GuardConfig(anchor_every=5),
    ]
    configs = []
    for i in range(32):
        sampled = i % 3 == 0 or i % 4 == 2  # a temperature schedule samples
        sampling = SamplingConfig(temperature=0.9, top_k=20) if sampled else SamplingConfig()
        tree = i == 7
        configs.append(
            GenerationConfig(
                max_new_tokens=20 + i % 5,
                stop_on_eos=False,
                k=1 + i % 6,
                k_policy=("fixed", "heuristic", "cost-model", "confidence")[i % 4],
                seed=i,
                sampling=sampling,
                guards=GuardConfig() if tree else guards[i % 4],
                branches=3 if tree else 1,
            )
        )
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i % 4) for i in range(32)]
    batch = gen.generate_batch(prompts, configs)
    for prompt, config, result in zip(prompts, configs, batch, strict=True):
        assert result.token_ids == gen.generate(prompt, config).token_ids, config


def test_the_server_refuses_what_memory_cannot_hold_and_reports_the_caches(monkeypatch: pytest.MonkeyPatch) -> None:
    """On native, a request whose KV cache (in whole pages) could never fit in the memory left gets 400, one that
    fits alone but not beside the requests already taken (each grown to prompt + max_tokens) gets 503, both
    insufficient_memory in OpenAI's shape; one that fits is answered, and /metrics reports the caches' bytes."""
    from test_serve_faults import _ask

    from specdec.serving import batcher as batcher_module
    from specdec.serving.app import create_app
    from specdec.serving.batcher import Job, MemoryFullError

    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=NATIVE).target
    generator = Generator(target, "prompt-lookup", GenerationConfig(k=4, k_policy="fixed"))
    app = create_app(generator)
    batcher = app.state.batcher
    rows = batcher.decoder.backend
    assert isinstance(rows, NativeRows)
    page = rows.kv_bytes_for(1)  # one page in every layer
    assert rows.kv_bytes_for(256) == page and rows.kv_bytes_for(257) > page
    assert rows.kv_bytes_for(256 * 100) < 100 * page  # windowed layers hold a few pages however long the row
    monkeypatch.setattr(batcher_module, "available_bytes", lambda device: int(rows.kv_bytes_for(300) * 1.5))

    # Fits alone (two pages' worth), not beside a waiting request of the same size.
    waiting = Job(generator.completion("abc abc", max_new_tokens=290), None)  # type: ignore[arg-type]
    batcher.waiting.append(waiting)
    with pytest.raises(MemoryFullError, match="would need") as refused:
        batcher._check_memory(Job(generator.completion("abc abc", max_new_tokens=290), None))  # type: ignore[arg-type]
    assert not refused.value.alone
    batcher.waiting.clear()

    batcher.start()
    try:
        alone = _ask(app, "POST", "/v1/completions", {"prompt": "abc abc", "max_tokens": 900, "temperature": 0})
        error = alone.json()["error"]
        assert alone.status_code == 400 and error["code"] == "insufficient_memory", alone.text
        assert error["param"] == "max_tokens" and "MiB" in error["message"]
        answered = _ask(app, "POST", "/v1/completions", {"prompt": "abc abc", "max_tokens": 8, "temperature": 0})
        assert answered.status_code == 200 and answered.json()["usage"]["completion_tokens"] == 8
        assert "specdec_kv_cache_bytes" in _ask(app, "GET", "/metrics").text
    finally:
        batcher.stop(5)
