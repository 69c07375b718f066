"""The native CPU backend: close to transformers, position results independent of how many are scored, greedy
speculation identical to its own target-only decoding, sampling exact, clear refusals, and the server on it."""

from __future__ import annotations

import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from conftest import char_tokenizer, loaded, tiny_gemma3, tiny_llama

from specdec import Generator
from specdec.config import PRESETS, BatchConfig, GenerationConfig, RuntimeConfig, SamplingConfig
from specdec.errors import ConfigError
from specdec.models import TransformersBackend, open_target
from specdec.models.native import FIRST_CAPACITY, NativeBackend, NativeModel, formats, kernel_build, ops, paged_cache
from specdec.models.native import model as native_model

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")
NATIVE = RuntimeConfig(backend="native")
PROMPTS = ["the cat sat on the mat. the cat sat on the", "abc abc abc abc", "Hello, world! Hello, world!"]


FAMILIES = ["llama", "gemma3", "llama3-rope", "mistral", "qwen2", "qwen3"]


def tiny_family(family: str, vocab: int) -> torch.nn.Module:
    """A random model of ``family`` wide enough for the kernels (widths in multiples of 32, heads of 16), with what sets
    the family apart: Llama 3's rotary scaling, Mistral's sliding window on every layer, Qwen2's QKV biases (and a
    sliding window on its second layer), Qwen3's norms on each head's queries and keys; biases and norms randomized."""
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(5)
    if family == "llama3-rope":
        from transformers import LlamaConfig, LlamaForCausalLM

        rope = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=64)  # fmt: skip
        model = LlamaForCausalLM(LlamaConfig(**common, rope_parameters=rope))
    elif family == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=6))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, use_sliding_window=True, sliding_window=6, max_window_layers=1))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.3)
            elif "norm" in name:
                param.normal_(1, 0.2)
    return model.eval()


def models():
    """A model of every family the native backend runs (see tiny_family; Gemma-3's sliding window is 6)."""
    tokenizer = char_tokenizer()
    return tokenizer, {
        "llama": tiny_llama(3, vocab=len(tokenizer), hidden=64, context=1024),
        "gemma3": tiny_gemma3(3, vocab=len(tokenizer), hidden=64, head_dim=16, context=1024),
        **{family: tiny_family(family, len(tokenizer)) for family in FAMILIES[2:]},
    }


def test_the_tiny_families_differ_as_their_families_do() -> None:
    built = models()[1]
    assert built["llama3-rope"].config.rope_parameters["rope_type"] == "llama3"
    assert NativeModel.from_module(built["mistral"]).shape.windows == (6, 6)
    qwen2 = NativeModel.from_module(built["qwen2"])
    assert qwen2.shape.windows == (0, 6) and set(qwen2.layers[0].biases) == {"qkv"}
    assert (
        NativeModel.from_module(built["qwen3"]).shape.qk_norm
        and not NativeModel.from_module(built["llama"]).shape.qk_norm
    )


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_native_logits_follow_transformers(family: str) -> None:
    tokenizer, model = char_tokenizer(), models()[1][family]
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    with torch.inference_mode():
        reference = model(ids).logits[0]
    got = NativeBackend(NativeModel.from_module(model)).forward(ids, last=ids.shape[1])[0]
    assert got.shape == reference.shape
    # int8 weights and activations on random weights: close, not equal (a wrong rotary or norm gives cosines near 0)
    assert float(torch.nn.functional.cosine_similarity(got, reference, dim=-1).min()) > 0.97
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() > 0.85


@pytest.mark.parametrize("family", FAMILIES[2:])
def test_the_other_families_follow_transformers(family: str) -> None:
    """Rotary tables equal to transformers' own, bit for bit (Llama 3's scaling included); logits close (int8 noise on
    random weights: one position in 40 may fall to a cosine of 0.93, where a wrong rotary, window, bias or norm gives
    cosines near 0 from the first wrong position on) and greedy tokens mostly the same."""
    tokenizer, model = char_tokenizer(), models()[1][family]
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    native = NativeModel.from_module(model)
    positions = torch.arange(ids.shape[1])
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
    got_cos, got_sin = native._cos_sin("", positions)
    assert torch.equal(got_cos[:, 0], cos[0]) and torch.equal(got_sin[:, 0], sin[0])
    with torch.inference_mode():
        reference = model(ids).logits[0]
    got = NativeBackend(native).forward(ids, last=ids.shape[1])[0]
    cosines = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert float(cosines.mean()) > 0.99 and float(cosines.min()) > 0.9, cosines
    assert (got.argmax(-1) == reference.argmax(-1)).float().mean() > 0.8


@pytest.mark.parametrize("family", ["llama", "llama3-rope"])
def test_rotary_rows_keep_their_bits_as_threads_grow_the_table(family: str) -> None:
    """A position's cos and sin are computed once in the model's life: the rows built with the model keep their bits as
    the table grows, threads that grow it at once all read the same rows, and the rows grown equal transformers'."""
    model = models()[1][family]
    native = NativeModel.from_module(model)
    first = native._cos_sin("", torch.arange(FIRST_CAPACITY))
    positions = torch.arange(3 * FIRST_CAPACITY)
    barrier = threading.Barrier(4)

    def grow() -> tuple[torch.Tensor, torch.Tensor]:
        barrier.wait()
        return native._cos_sin("", positions)

    with ThreadPoolExecutor(4) as pool:
        grown = [future.result() for future in [pool.submit(grow) for _ in range(4)]]
    cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions[None])
    for got_cos, got_sin in grown:
        assert torch.equal(got_cos[:FIRST_CAPACITY], first[0]) and torch.equal(got_sin[:FIRST_CAPACITY], first[1])
        assert torch.equal(got_cos[:, 0], cos[0]) and torch.equal(got_sin[:, 0], sin[0])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_positions_logits_do_not_depend_on_how_many_are_scored(family: str) -> None:
    """Bit for bit: the whole sequence at once, one token at a time, and in chunks of 9 after a rollback; past the
    sliding window (6) and past the first cache allocation (the cache grows)."""
    model = NativeModel.from_module(models()[1][family])
    ids = torch.randint(3, model.vocab_size, (1, FIRST_CAPACITY + 40), generator=torch.Generator().manual_seed(0))
    backend = NativeBackend(model)
    whole = backend.forward(ids, last=ids.shape[1])[0]
    backend.reset()
    one = torch.cat([backend.forward(ids[:, i : i + 1], last=1)[0] for i in range(ids.shape[1])])
    assert torch.equal(one, whole)
    backend.truncate(FIRST_CAPACITY - 20)
    chunks = [
        backend.forward(ids[:, i : i + 9], last=len(ids[0, i : i + 9]))[0]
        for i in range(FIRST_CAPACITY - 20, ids.shape[1], 9)
    ]
    assert torch.equal(torch.cat(chunks), whole[FIRST_CAPACITY - 20 :])
    with pytest.raises(ValueError, match="cannot truncate"):
        backend.truncate(ids.shape[1] + 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_speculative_greedy_equals_native_target_only(family: str) -> None:
    tokenizer, model = char_tokenizer(), models()[1][family]
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=NATIVE)
    assert isinstance(target.target.backend, NativeBackend)
    for k_policy in ("fixed", "cost-model"):
        drafted = Generator(target.target, "prompt-lookup", runtime=NATIVE)
        for prompt in PROMPTS:
            expected = target.generate(prompt, max_new_tokens=32, stop_on_eos=False)
            got = drafted.generate(prompt, max_new_tokens=32, k=6, k_policy=k_policy, stop_on_eos=False)
            assert got.token_ids == expected.token_ids, (family, k_policy, prompt)
            assert got.stats.target_forwards <= expected.stats.target_forwards


def test_sampling_on_native_keeps_the_targets_distribution() -> None:
    """Chi-square of the first sampled token with a drafter against the target's own law, and a negative control."""
    from scipy.stats import chisquare

    tokenizer, model = char_tokenizer(), models()[1]["llama"]
    target = open_target(loaded(model, tokenizer=tokenizer), NATIVE)
    prompt = "abc abc abc ab"
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    probs = torch.softmax(target.backend.forward(ids, last=1)[0, 0] / 0.8, dim=-1)
    drafted = Generator(target, "prompt-lookup", runtime=NATIVE)
    draws = 600
    counts = torch.zeros(len(probs))
    for seed in range(draws):
        token = drafted.generate(
            prompt, max_new_tokens=2, temperature=0.8, seed=seed, k=4, k_policy="fixed", stop_on_eos=False
        )
        counts[token.token_ids[0]] += 1
    keep = probs * draws >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum()[None]])
    expected = torch.cat([probs[keep], probs[~keep].sum()[None]]) * draws
    assert chisquare(observed.numpy(), expected.numpy()).pvalue > 1e-3
    wrong = torch.softmax(torch.log(probs) * 2, dim=-1)  # the negative control: a sharper distribution is rejected
    expected_wrong = torch.cat([wrong[keep], wrong[~keep].sum()[None]]) * draws
    assert chisquare(observed.numpy(), expected_wrong.numpy()).pvalue < 1e-3


def test_unsupported_models_and_options_are_refused_clearly() -> None:
    narrow = loaded(tiny_llama(0), tokenizer=char_tokenizer())  # heads of 8: the attention kernel needs multiples of 16
    with pytest.raises(ConfigError, match="head size that is a multiple of 16.*--runtime transformers"):
        open_target(narrow, NATIVE)
    # auto falls back
    assert isinstance(open_target(narrow, RuntimeConfig(backend="auto")).backend, TransformersBackend)
    with pytest.raises(ConfigError, match="--precision plans apply to the transformers backend"):
        RuntimeConfig(backend="native", precision=PRESETS["cpu"])
    with pytest.raises(ConfigError, match="--dtype applies to the transformers backend"):
        RuntimeConfig(backend="native", dtype="bfloat16")


def test_the_server_batches_native_requests(tmp_path) -> None:
    """`specdec serve --runtime native`: concurrent requests decode together (rows join between steps); each gets the
    target's own greedy text."""
    from concurrent.futures import ThreadPoolExecutor

    from test_serve import Server

    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    local = Generator(str(tmp_path / "tiny"), "none", runtime=NATIVE)
    server = Server(str(tmp_path / "tiny"), "--runtime", "native", "--draft", "prompt-lookup", "--max-batch", "8")
    try:
        model_id = server.client.models.list().data[0].id
        with ThreadPoolExecutor(4) as pool:
            answers = list(
                pool.map(
                    lambda p: server.client.completions.create(model=model_id, prompt=p, max_tokens=20, temperature=0),
                    PROMPTS,
                )
            )
        for prompt, answer in zip(PROMPTS, answers, strict=True):
            assert answer.choices[0].text == local.generate(prompt, max_new_tokens=20).text
    finally:
        code, log = server.stop()
    assert code == 0, log


def fed_lengths(backend) -> list[list[int]]:
    """Record the tokens each row of each forward of ``backend`` is fed (logits or argmaxes asked alike)."""
    fed: list[list[int]] = []
    inside = []  # a forward_argmax that runs forward is one forward
    for name in ("forward", "forward_argmax"):
        real = getattr(backend, name)

        def recorded(row_ids, feeds, *args, real=real, **kwargs):
            if not inside:
                fed.append([len(feed) for feed in feeds])
            inside.append(True)
            try:
                return real(row_ids, feeds, *args, **kwargs)
            finally:
                inside.pop()

        setattr(backend, name, recorded)
    return fed


def test_rows_with_one_prompt_read_it_once(tmp_path) -> None:
    """n answers to one prompt (a server's n > 1): the first row's forward reads the prompt, the others copy its cache,
    and every answer is bit for bit what it is alone, greedy or sampled with its own seed."""
    tokenizer, model = char_tokenizer(), models()[1]["gemma3"]
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    gen = Generator(str(tmp_path / "tiny"), "prompt-lookup", runtime=NATIVE, batch=BatchConfig(k_cap="fixed"))
    settings = [(0.0, None), (1.0, 1), (1.0, 2), (0.7, 3)]
    fixed = GenerationConfig(k=4, k_policy="fixed", max_new_tokens=16, stop_on_eos=False)
    configs = [replace(fixed, sampling=SamplingConfig(temperature=t), seed=seed) for t, seed in settings]
    alone = [gen.generate(PROMPTS[0], config).token_ids for config in configs]
    decoder = gen.batch_decoder(len(configs))
    fed = fed_lengths(decoder.backend)
    results = gen.generate_batch([PROMPTS[0]] * len(configs), configs, decoder=decoder)
    assert [result.token_ids for result in results] == alone
    prompt = len(gen.completion(PROMPTS[0], configs[0]).prompt_ids)
    assert fed[0] == [prompt - 1]  # the first row alone reads the prompt but its last token
    assert all(max(rows) <= 1 + 4 for rows in fed[1:]), fed  # then every row that token and its drafts at most


def test_kernels_refuse_bad_input_as_the_reference_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """NaN or inf activations: a ValueError from the kernel and from its float64 reference alike (the kernel's quantizer
    used to turn NaN into 0); tensors off the CPU, empty weights and mismatched shapes: a ValueError, no crash."""
    weights = formats.PackedInt8(torch.randn(48, 64))
    x = torch.randn(3, 64)
    assert formats.linear(torch.empty(0, 64), weights).shape == (0, 48)
    for bad in (float("nan"), float("inf"), -float("inf")):
        poisoned = x.clone()
        poisoned[1, 7] = bad
        with pytest.raises(ValueError, match="NaN or infinite activations"):
            formats.linear(poisoned, weights)
        with monkeypatch.context() as patch:
            patch.setattr(kernel_build, "compiled", lambda: None)  # the reference path
            with pytest.raises(ValueError, match="NaN or infinite activations"):
                formats.linear(poisoned, weights)
    assert torch.isfinite(formats.linear(x, weights)).all()
    with pytest.raises(ValueError, match="of 64 inputs got activations of width 32"):
        formats.linear(torch.randn(2, 32), weights)
    for weight, words in (
        (torch.empty(0, 64), "non-empty matrix"),
        (torch.full((16, 64), float("nan")), "NaN or infinite"),
    ):
        with pytest.raises(ValueError, match=words):
            formats.PackedInt8(weight)
    meta, kv = torch.empty(2, 4, 16, device="meta"), torch.zeros(2, 2, 16)
    cache = paged_cache.PagedCache((0,), kv_heads=2, head_dim=16)
    cache.reserve(2)
    with pytest.raises(ValueError, match="compute on the CPU"):
        ops.attention(meta, kv, kv, cache, 0, 0, 0, 0.25)
    with pytest.raises(ValueError, match="compute on the CPU"):
        ops.rms_norm(torch.empty(2, 16, device="meta"), torch.ones(16), 1e-6)
    with pytest.raises(ValueError, match="native kernel: attention shapes"):
        ops.attention(torch.randn(2, 3, 16), kv, kv, cache, 0, 0, 0, 0.25)  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="native kernel: the cache does not hold the pages"):
        ops.attention(torch.randn(2, 4, 16), kv, kv, cache, 0, paged_cache.PAGE, 0, 0.25)  # none reserved there
    with pytest.raises(ValueError, match="do not fit the cache's pages"):
        ops.attention(torch.randn(2, 4, 16), torch.zeros(2, 4, 16), torch.zeros(2, 4, 16), cache, 0, 0, 0, 0.25)
    with pytest.raises(ValueError, match="native kernel: the norm's width"):
        ops.rms_norm(torch.randn(2, 16), torch.ones(0), 1e-6)
    with pytest.raises(ValueError, match="native kernel: cos and sin"):
        ops.rotate(torch.randn(2, 4, 16), torch.ones(2, 1, 8), torch.ones(2, 1, 8))
    with pytest.raises(ValueError, match="native kernel: cos and sin"):
        ops.rotate(torch.randn(2, 4, 16), torch.ones(2, 16), torch.ones(2, 16))  # the right count, not the shape
    with pytest.raises(ValueError, match="compute on the CPU"):
        ops.rotate(torch.randn(2, 4, 16), torch.empty(2, 1, 16, device="meta"), torch.ones(2, 1, 16))


@pytest.mark.parametrize("width", [300, 288, 17])  # 300: a last word of 12 tokens; 17: within the first word
def test_the_mask_kernel_forbids_what_the_packed_bits_forbid(width: int) -> None:
    """A grammar's token mask by the kernel: -inf exactly where torch's unpacked mask has it, every other value left
    as it was, on rows of a wider tensor (strided), with words of no, all and some tokens allowed."""
    generator = torch.Generator().manual_seed(0)
    words = (width + 31) // 32
    bits = torch.randint(-(2**31), 2**31 - 1, (5, words + 1), dtype=torch.int32, generator=generator)
    bits[1] = 0  # nothing allowed
    bits[2] = -1  # everything allowed
    bits[3, ::2] = 0
    scores = torch.randn(5, 320, generator=generator)
    expected = scores.clone()
    ops.forbid_reference(expected[:, :310], bits, width)
    ops.forbid(scores[:, :310], bits, width)
    assert torch.equal(scores, expected)
    assert (
        torch.isinf(scores[1, :width]).all()
        and torch.isfinite(scores[2]).all()
        and torch.isfinite(scores[:, width:]).all()
    )
    with pytest.raises(ValueError, match="native kernel: width"):
        ops.forbid(scores, bits, 32 * (words + 1) + 1)
    with pytest.raises(ValueError, match="native kernel: bits"):
        ops.forbid(scores, bits[:4], width)


@pytest.mark.parametrize("dim", [256, 80, 64])  # 80: halves of 40, not a whole number of vectors
def test_the_rotary_kernel_gives_the_bits_of_torchs_formula(dim: int) -> None:
    generator = torch.Generator().manual_seed(dim)
    x = torch.randn(9, 4, dim, generator=generator) * 3
    cos, sin = torch.randn(2, 9, 1, dim, generator=generator)
    x[0, 0, :8], cos[1, 0, :8], sin[2, 0, :8] = 0.0, -0.0, 0.0  # signed zeros: the bits, not only the values
    expected = ops.rotate_reference(x, cos, sin)
    rotated = ops.rotate(x, cos, sin)
    assert torch.equal(rotated.view(torch.int32), expected.view(torch.int32))
    single = ops.rotate(x[:, :1], cos, sin)  # a single KV head, as keys have
    assert torch.equal(single.view(torch.int32), expected[:, :1].contiguous().view(torch.int32))


# an 8B Llama's: torch splits an activation over so many values across threads, at slice ends differently
WIDE_FFN = 14336


@pytest.mark.parametrize("threads", [3, 4, 8], indirect=True)
def test_the_activation_of_a_row_does_not_depend_on_its_neighbours_or_threads(threads: int) -> None:
    gate_up = torch.randn(13, 2 * WIDE_FFN, generator=torch.Generator().manual_seed(threads))
    gate, up = gate_up.chunk(2, dim=1)
    for gelu in (False, True):
        alone = torch.cat([ops.gated(gate_up[i : i + 1], gelu) for i in range(13)])
        for n in (5, 11, 13):
            assert torch.equal(ops.gated(gate_up[:n], gelu), alone[:n]), (gelu, n)
        expected = (torch.nn.functional.gelu(gate, approximate="tanh") if gelu else torch.nn.functional.silu(gate)) * up
        # torch's values to a few units in the last place
        torch.testing.assert_close(alone, expected, rtol=2e-6, atol=2e-6)
    odd = torch.randn(3, 2 * 37)  # a width that ends in a partial vector: the masked tail
    g, u = odd.chunk(2, dim=1)
    torch.testing.assert_close(ops.gated(odd, False), torch.nn.functional.silu(g) * u, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(
        ops.gated(odd, True), torch.nn.functional.gelu(g, approximate="tanh") * u, rtol=2e-6, atol=2e-6
    )
    nan = gate_up[:1].clone()
    nan[0, 3] = float("nan")
    assert torch.isnan(ops.gated(nan, False)[0, 3]) and torch.isfinite(ops.gated(nan, False)[0, 4:]).all()


@pytest.mark.parametrize("threads", [4, 8], indirect=True)
def test_a_positions_logits_do_not_depend_on_threads_at_an_8b_ffn_width(threads: int) -> None:
    """End to end on a Llama with an 8B model's FFN width: 5, 11 and 13 positions scored together give each position
    the bits it gets scored alone (torch's SiLU, used before, broke this at 3 threads and more)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=WIDE_FFN, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    model = NativeModel.from_module(LlamaForCausalLM(config).eval())
    ids = torch.randint(3, 96, (1, 13), generator=torch.Generator().manual_seed(1))
    backend = NativeBackend(model)
    alone = torch.cat([backend.forward(ids[:, i : i + 1], last=1)[0] for i in range(13)])
    for n in (5, 11, 13):
        backend.reset()
        assert torch.equal(backend.forward(ids[:, :n], last=n)[0], alone[:n]), n


def test_rotary_embeddings_the_native_backend_does_not_compute_are_refused_by_name() -> None:
    from transformers import LlamaConfig

    base = dict(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1, intermediate_size=128
    )
    dynamic = LlamaConfig(**base, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ConfigError, match="not 'dynamic': use --runtime transformers"):
        native_model._shape(dynamic)
    partial = LlamaConfig(
        **base, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    )
    with pytest.raises(ConfigError, match="rotates whole heads, not a share of 0.5"):
        native_model._shape(partial)


RACE = """
import threading, torch
from specdec.models.mkl import MKL_FUNCTIONS, settle_mkl_functions
settle_mkl_functions()
inputs = [torch.linspace(0.01, 0.99, 8192, dtype=dtype) for dtype in (torch.float32, torch.float64)]
def results():
    return [function(x) for x in inputs for function in MKL_FUNCTIONS]
got, meet = [None] * 4, threading.Barrier(4)
def run(i):
    meet.wait()
    got[i] = results()
threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
expected = results()
print(all(torch.equal(a, b) for each in got for a, b in zip(each, expected, strict=True)))
"""


@pytest.mark.slow
def test_threads_that_first_call_mkl_functions_at_once_agree_once_they_are_settled() -> None:
    """Four threads' first calls of every MKL-backed function (float32 and float64) at once, in a fresh process (a
    server's engine and request threads at its first request), give what a later call gives once
    `settle_mkl_functions` (run by open_target, load_model and the native model) has run; a process per try, since only
    a function's first call in a process can go wrong."""
    for _ in range(12):
        run = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0 and run.stdout.strip() == "True", run.stdout + run.stderr[-2000:]
