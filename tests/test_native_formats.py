"""The native runtime's weight formats and its loading: int4 products exact against their float64 reference and
independent of the rows beside them at any thread count; every family on int4; conversion from safetensors one tensor
at a time, cached and memory-mapped; clear refusals of bad files, shapes and options."""

from __future__ import annotations

import copy
import json
import struct

import pytest
import torch
from conftest import char_tokenizer, loaded
from test_native import FAMILIES, PROMPTS, models

from specdec import Generator
from specdec.config import RuntimeConfig
from specdec.errors import ConfigError
from specdec.models import open_target
from specdec.models.native import NativeBackend, NativeModel, formats, kernel_build, store

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")
INT4 = RuntimeConfig(backend="native", native_format="int4")


def test_an_int4_grid_reaches_each_groups_largest_weight() -> None:
    """Weights near 1e-4 have float16 steps in the subnormal range, where rounding to nearest can leave a group's
    largest weight past the grid's end (clipped); such steps round up, and no group's grid stops short."""
    weight = torch.randn(64, 256, generator=torch.Generator().manual_seed(3)) * 1e-4
    _, step, least = formats.quantize_int4(weight)
    low, top = weight.reshape(64, -1, 32).amin(dim=2), weight.reshape(64, -1, 32).amax(dim=2)
    assert bool((least <= low).all() and (least + 15 * step >= top).all() and (step >= 0).all())
    nearest = ((top - least) / 15).half().float()
    assert bool((least + 15 * nearest < top).any())  # the case exists: nearest would have clipped these
    assert bool((low.half().float() > low).any())  # and a minimum rounded to nearest would have stood above some


@pytest.mark.parametrize("threads", [1, 4, 8], indirect=True)
def test_int4_products_equal_their_reference_and_a_rows_bits_do_not_depend_on_its_neighbours(threads: int) -> None:
    generator = torch.Generator().manual_seed(threads)
    weights = formats.PackedInt4(torch.randn(600, 1024, generator=generator))  # 600: a partial last block
    x = torch.randn(13, 1024, generator=generator)
    alone = torch.cat([formats.linear(x[i : i + 1], weights) for i in range(13)])
    for n in (5, 11, 13):
        assert torch.equal(formats.linear(x[:n], weights), alone[:n]), n
    assert torch.equal(alone, weights.reference(x))
    exact = x @ weights.dequantized().T
    assert float((alone - exact).norm() / exact.norm()) < 0.02  # what int8 activations add to the 4-bit weights


@pytest.mark.parametrize("threads", [1, 3], indirect=True)
def test_the_heads_argmax_is_that_of_its_logits_without_writing_them(threads: int) -> None:
    """``linear_argmax`` gives the first index of each row's largest logit, whatever the rows beside it (1 row on VNNI,
    2 or more in AMX tiles where this CPU has them): ties go to the first index, and the padding of the last block
    (outputs of 0) never wins over logits that are all negative."""
    generator = torch.Generator().manual_seed(threads)
    weight = -torch.rand(600, 256, generator=generator) - 0.5  # 600 outputs: a partial last block
    weight[[5, 77, 300, 599]] = -0.01  # four equal rows, the largest logits: index 5 must win
    heads = formats.PackedInt8(weight), formats.PackedInt8(torch.randn(600, 256, generator=generator))
    for head in heads:
        for n in (1, 2, 9, 17):
            x = torch.rand(n, 256, generator=generator) + 0.1  # positive: every logit of the first head is negative
            logits = formats.linear(x, head)
            assert torch.equal(formats.linear_argmax(x, head), logits.max(dim=-1).indices), n
    assert bool((formats.linear(x, heads[0]) < 0).all()) and formats.linear_argmax(x, heads[0]).tolist() == [5] * 17


@pytest.mark.parametrize("size", [1.0, 1e-3])  # 1e-3: steps among float16's subnormals
def test_weights_on_a_4bit_grid_are_packed_without_loss(size: float) -> None:
    """A group already on a grid d u + m (float16 d and m, u in 0..15 spanning 0 and 15), as a Q4_1 GGUF's weights
    are, comes back bit for bit: such a checkpoint loses nothing more in int4."""
    generator = torch.Generator().manual_seed(0)
    step = ((torch.rand(64, 8, generator=generator) * 0.05 + 0.001) * size).half().float()
    least = (torch.randn(64, 8, generator=generator) * 0.1 * size).half().float()
    u = torch.randint(0, 16, (64, 8, 32), generator=generator)
    u[:, :, 0], u[:, :, 1] = 0, 15
    weight = (u * step[:, :, None] + least[:, :, None]).reshape(64, 256)
    assert torch.equal(formats.PackedInt4(weight).dequantized(), weight)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_runs_on_int4_exactly_as_its_own_target_only(family: str) -> None:
    """Logits near transformers' on the same 4-bit weights (the difference is int8 activations and head; a wrong
    layout or grid gives cosines near 0); position results independent of chunking; speculation identical."""
    tokenizer, model = char_tokenizer(), models()[1][family]
    ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
    native = NativeModel.from_module(model, "int4")
    assert native.format == "int4" and native.layers[0].gate_up.format == "int4" and native.head.format == "int8"
    on_grid = copy.deepcopy(model)
    with torch.no_grad():
        for module in on_grid.model.layers.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(formats.PackedInt4(module.weight).dequantized())
        reference = on_grid(ids).logits[0]
    backend = NativeBackend(native)
    whole = backend.forward(ids, last=ids.shape[1])[0]
    cosines = torch.nn.functional.cosine_similarity(whole, reference, dim=-1)
    assert float(cosines.mean()) > 0.99 and float(cosines.min()) > 0.9, cosines
    backend.reset()
    assert torch.equal(torch.cat([backend.forward(ids[:, i : i + 1], last=1)[0] for i in range(ids.shape[1])]), whole)
    target = Generator(loaded(model, tokenizer=tokenizer), "none", runtime=INT4)
    drafted = Generator(target.target, "prompt-lookup", runtime=INT4)
    for prompt in PROMPTS:
        expected = target.generate(prompt, max_new_tokens=24, stop_on_eos=False)
        assert drafted.generate(prompt, max_new_tokens=24, k=6, stop_on_eos=False).token_ids == expected.token_ids


def test_int4_refuses_what_it_cannot_hold_in_one_line() -> None:
    with pytest.raises(ValueError, match="multiple of 32, not 48"):
        formats.PackedInt4(torch.randn(16, 48))
    with pytest.raises(ValueError, match="NaN or infinite values"):
        formats.PackedInt4(torch.full((16, 64), float("nan")))
    with pytest.raises(ValueError, match="float16's range"):
        formats.PackedInt4(torch.full((16, 64), 1e6))
    weights = formats.PackedInt4(torch.randn(16, 64))
    poisoned = torch.randn(2, 64)
    poisoned[0, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or infinite activations"):
        formats.linear(poisoned, weights)
    with pytest.raises(ValueError, match="of 64 inputs got activations of width 32"):
        formats.linear(torch.randn(2, 32), weights)
    with pytest.raises(ConfigError, match="unknown native format 'int3'"):
        RuntimeConfig(backend="native", native_format="int3")
    with pytest.raises(ConfigError, match="--native-format applies to the native backend"):
        RuntimeConfig(backend="transformers", native_format="int4")


@pytest.fixture
def checkpoint(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """A tiny Qwen2 (biases, a sliding window) saved as bfloat16 safetensors, with a cache folder of its own."""
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer, model = char_tokenizer(), models()[1]["qwen2"]
    model.to(torch.bfloat16).save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    return tmp_path / "tiny", model.float()


def test_a_checkpoint_converts_tensor_by_tensor_to_the_model_from_memory_then_starts_from_the_cache(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, model = checkpoint
    first = open_target(str(folder), INT4)
    assert first.runtime == "native" and first.backend.model.format == "int4" and first.chosen is None
    expected = NativeModel.from_module(model, "int4")
    for got, want in zip(first.backend.model.layers, expected.layers, strict=True):
        assert torch.equal(got.qkv.packed, want.qkv.packed) and torch.equal(got.biases["qkv"], want.biases["qkv"])
    (cached,) = (folder.parent / "cache" / "native").glob("*.pt")
    monkeypatch.setattr(NativeModel, "convert", lambda *a, **k: pytest.fail("converted again"))
    second = open_target(str(folder), INT4)
    assert mapped_from(second.backend.model.layers[0].gate_up.packed, cached)
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    logits = first.backend.forward(ids, last=5)
    assert torch.equal(logits, second.backend.forward(ids, last=5))
    assert torch.equal(logits, NativeBackend(expected).forward(ids, last=5))  # every weight as converted from memory
    assert second.eos_ids == first.eos_ids and second.tokenizer is not None


def test_a_tied_checkpoint_packs_its_head_from_the_embedding(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tokenizer = char_tokenizer()
    torch.manual_seed(4)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "tied")  # no lm_head.weight in the file
    tokenizer.save_pretrained(tmp_path / "tied")
    target = open_target(str(tmp_path / "tied"), RuntimeConfig(backend="native", native_format="int8"))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    expected = NativeBackend(NativeModel.from_module(model, "int8")).forward(ids, last=5)
    assert torch.equal(target.backend.forward(ids, last=5), expected)


def test_sharded_checkpoints_follow_their_index_and_bad_configs_fail_in_one_line(checkpoint) -> None:
    from specdec.errors import ModelNotFoundError

    folder, _ = checkpoint
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002-of-00002.safetensors"}})
    )
    with pytest.raises(ConfigError, match="lacks the shard.*model-00002-of-00002.safetensors"):
        open_target(str(folder), INT4)
    (folder / "model.safetensors.index.json").unlink()
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ModelNotFoundError, match="could not read the config"):
        open_target(str(folder), INT4)


def mapped_from(tensor: torch.Tensor, path) -> bool:
    """Whether ``tensor``'s memory lies in a mapping of the file ``path`` (Linux's /proc/self/maps)."""
    where = tensor.data_ptr()
    for line in open("/proc/self/maps"):
        span, *rest = line.split()
        if rest and rest[-1] == str(path):
            low, high = (int(v, 16) for v in span.split("-"))
            if low <= where < high:
                return True
    return False


def test_a_damaged_cache_is_converted_again_and_a_damaged_checkpoint_is_refused(checkpoint) -> None:
    folder, _ = checkpoint
    open_target(str(folder), INT4)
    (cached,) = (folder.parent / "cache" / "native").glob("*.pt")
    cached.write_bytes(b"not a model")
    assert open_target(str(folder), INT4).runtime == "native"
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ConfigError, match="truncated"):
        open_target(str(folder), INT4)
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(ConfigError, match="header is damaged"):
        open_target(str(folder), INT4)


def test_a_checkpoint_of_integer_tensors_is_refused_by_name(tmp_path) -> None:
    header = json.dumps({"w": {"dtype": "I8", "shape": [2, 2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 4)
    with pytest.raises(ConfigError, match="tensor w is I8"):
        store.safetensors_reader(tmp_path)("w")


def test_auto_chooses_a_format_by_measurement_and_says_how(checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _ = checkpoint
    target = open_target(str(folder), RuntimeConfig(backend="native"))
    assert target.backend.model.format in ("int8", "int4")
    assert target.chosen.startswith(f"--native-format auto chose {target.backend.model.format}, measured on ")
    monkeypatch.setattr(formats, "_pass_times", lambda *a: pytest.fail("measured again"))
    again = open_target(str(folder), RuntimeConfig(backend="native"))  # the measurement is kept per machine and shape
    assert again.chosen == target.chosen
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.num_hidden_layers = 3  # another shape: measured afresh, here with int4 twice as fast
    monkeypatch.setattr(
        formats, "_pass_times", lambda packed, copies: [1.0, 2.0] if packed.format == "int4" else [2.0, 4.0]
    )
    chosen, why = formats.measured_format(config)
    assert chosen == "int8" and "under 1B weights" in why  # a small model keeps int8
    monkeypatch.setattr(formats, "INT4_MIN_WEIGHTS", 0)
    config.num_hidden_layers = 4
    assert formats.measured_format(config)[0] == "int4"


@pytest.mark.parametrize("family", ["gemma3", "llama"])
def test_logits_do_not_depend_on_the_thread_count(family: str) -> None:
    """Attention splits its queries into tasks by the thread count; a position's bits must not follow them."""
    ids = torch.randint(3, 60, (1, 40), generator=torch.Generator().manual_seed(3))
    backend = NativeBackend(NativeModel.from_module(models()[1][family], "int4"))
    before = torch.get_num_threads()
    results = []
    try:
        for count in (1, 3, 8):
            torch.set_num_threads(count)
            backend.reset()
            results.append(backend.forward(ids, last=40))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(r, results[0]) for r in results[1:])


BUILDS = [name for name, (needs, _) in kernel_build.VARIANTS.items() if set(needs) <= kernel_build.cpu_flags()]


@pytest.mark.parametrize("name", BUILDS)
@pytest.mark.parametrize("threads", [4], indirect=True)
def test_every_kernel_build_this_cpu_runs_gives_the_same_bits(
    name: str, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each build this CPU runs (AMX, AVX-512, AVX2 with AVX-VNNI, plain AVX2) against the default: each kernel bit for
    bit, rows independent of their neighbours, NaN refused, and a whole model's logits and greedy speculation the
    same."""
    build, default = kernel_build.build(name=name), kernel_build.compiled()
    assert build.tiles_in_use() == (name == "amx")  # the AMX build's tiles do run: this test compares them
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(13, 1024, generator=generator)
    for packed in (
        formats.PackedInt8(torch.randn(600, 1024, generator=generator)),
        formats.PackedInt4(torch.randn(600, 1024)),
    ):
        got = packed.product(build, x)
        assert torch.equal(got, packed.product(default, x))
        assert torch.equal(got[:5], packed.product(build, x[:5].contiguous()))
    wide, packed = torch.randn(35, 640, generator=generator), formats.PackedInt8(torch.randn(600, 640))
    for rows in (1, 2, 16, 17, 35):  # AMX takes 2 rows or more, in tiles of 16: a partial last tile
        chosen = wide[:rows].contiguous()
        assert torch.equal(packed.product(build, chosen), packed.product(default, chosen)), rows
    gate_up = torch.randn(11, 2 * 14336 + 74, generator=generator) * 4  # a partial last vector: the masked tail
    for gelu in (0, 1):
        assert torch.equal(build.gated(gate_up, gelu), default.gated(gate_up, gelu))
    poisoned = x.clone()
    poisoned[3, 9] = float("nan")
    for packed in (formats.PackedInt8(torch.randn(16, 1024)), formats.PackedInt4(torch.randn(16, 1024))):
        with pytest.raises(RuntimeError, match="NaN or infinite"):
            packed.product(build, poisoned)
    monkeypatch.setattr(kernel_build, "compiled", lambda: build)
    tokenizer, models_by_family = char_tokenizer(), models()[1]
    for family in ("gemma3", "qwen2"):
        ids = torch.tensor([tokenizer(PROMPTS[0])["input_ids"]])
        native = NativeModel.from_module(models_by_family[family], "int4")
        got = NativeBackend(native).forward(ids, last=ids.shape[1])
        monkeypatch.setattr(kernel_build, "compiled", lambda: default)
        assert torch.equal(got, NativeBackend(native).forward(ids, last=ids.shape[1])), family
        monkeypatch.setattr(kernel_build, "compiled", lambda: build)


def test_an_arm_cpu_with_sdot_gets_the_neon_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NEON build is chosen by the flags an ARM CPU reports (compiled for aarch64 with SDOT, not run here)."""
    arm = frozenset({"fp", "asimd", "evtstrm", "aes", "crc32", "asimddp", "fphp", "asimdhp"})
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: arm)
    monkeypatch.delenv(kernel_build.FORCE, raising=False)
    assert kernel_build.variant() == "neon" and "-march=armv8.2-a+dotprod" in kernel_build.VARIANTS["neon"][1]
    monkeypatch.setattr(kernel_build, "cpu_flags", lambda: arm - {"asimddp"})  # an ARMv8.0 core: no SDOT
    assert kernel_build.variant() is None
