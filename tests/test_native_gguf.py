"""GGUF files straight into the native formats: tensor by tensor, each type de-quantized as transformers reads it (so
the packed weights are those of the model transformers loads from the same file), cached, and refused in one line
when damaged."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from specdec.config import RuntimeConfig
from specdec.errors import ConfigError
from specdec.models import open_target
from specdec.models.native import NativeBackend, NativeModel, kernel_build, store

pytestmark = pytest.mark.skipif(kernel_build.compiled() is None, reason="the native backend needs AVX2 and g++")
TYPES = ["F16", "BF16", "Q8_0", "Q4_0"]
LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(6)
    config = LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def write_gguf(model, path: Path, kind: str) -> Path:
    """``model`` as a llama.cpp GGUF file: matrices in ``kind``, norms in F32, query and key rows in llama.cpp order."""
    import gguf

    config, qtype = model.config, gguf.GGMLQuantizationType[kind]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_vocab_size(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_token_merges([])
    writer.add_eos_token_id(2)

    def permute(w: torch.Tensor, heads: int) -> torch.Tensor:  # transformers' rotary halves to llama.cpp's pairs
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    tensors = [("token_embd.weight", model.model.embed_tokens.weight)]
    for index, layer in enumerate(model.model.layers):
        for source, target in LAYER_NAMES.items():
            weight = layer.get_submodule(source).weight
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(target)
            tensors.append((f"blk.{index}.{target}.weight", permute(weight, heads) if heads else weight))
    tensors += [("output_norm.weight", model.model.norm.weight), ("output.weight", model.lm_head.weight)]
    for name, weight in tensors:
        values = weight.detach().float().numpy()
        if values.ndim == 1:
            writer.add_tensor(name, values)
        else:
            writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("kind", TYPES)
def test_a_gguf_file_packs_as_the_model_transformers_reads_from_it(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every packed weight equals the one packed from transformers' own reading of the file (its de-quantization, its
    query/key row order); the second start maps the cache and converts nothing."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    original = tiny_llama()
    path = write_gguf(original, tmp_path / f"tiny-{kind}.gguf", kind)
    target = open_target(str(path), RuntimeConfig(backend="native", native_format="int8"))
    assert target.runtime == "native"
    read = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=path.name).eval()
    expected = NativeModel.from_module(read, "int8")
    got = target.backend.model
    for mine, theirs in zip(got.layers, expected.layers, strict=True):
        for part in ("qkv", "out", "gate_up", "down"):
            assert torch.equal(getattr(mine, part).packed, getattr(theirs, part).packed), part
        assert all(torch.equal(mine.norms[n], theirs.norms[n]) for n in theirs.norms)
    assert torch.equal(got.head.packed, expected.head.packed) and torch.equal(got.embedding, expected.embedding)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    logits = target.backend.forward(ids, last=6)
    assert torch.equal(logits, NativeBackend(expected).forward(ids, last=6))
    with torch.inference_mode():
        float32 = original(ids).logits
    assert (logits.argmax(-1) == float32.argmax(-1)).float().mean() >= 0.5  # the file's rounding, then int8's
    monkeypatch.setattr(NativeModel, "convert", lambda *a, **k: pytest.fail("converted again"))
    again = open_target(str(path), RuntimeConfig(backend="native", native_format="int8"))
    assert torch.equal(again.backend.forward(ids, last=6), logits)


def test_a_damaged_gguf_file_is_refused_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = write_gguf(tiny_llama(), tmp_path / "tiny.gguf", "Q8_0")
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(tmp_path), gguf_file=path.name)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])  # the last tensors cut off
    with pytest.raises(ConfigError, match="(truncated|not a GGUF file)"):
        NativeModel.convert(config, store.gguf_reader(path, config), "int8")
    path.write_bytes(b"GGUF" + b"\xff" * 60)
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        store.gguf_reader(path, config)


def test_a_large_matrix_is_de_quantized_a_chunk_of_rows_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf

    monkeypatch.setattr(store, "DEQUANTIZE_ROWS", 7)
    values = np.random.default_rng(0).standard_normal((30, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)
    whole = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(store._dequantized(raw, gguf.GGMLQuantizationType.Q4_0), whole)


@pytest.mark.real_model
@pytest.mark.slow  # the fast tier packs a GGUF written from a small model the same way (above)
@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "gemma-3-270m"])
def test_the_bundled_gguf_files_pack_as_transformers_reads_them(name: str, tmp_path: Path, monkeypatch) -> None:
    """SmolLM2's Q4_1 file (llama.cpp's query/key order) and Gemma-3's Q4_K_M mix (Q4_K, Q5_0, Q6_K and Q8_0 tensors,
    norms stored plus one) straight from the GGUF and through transformers' float32 reading of it: the same model."""
    from transformers import AutoConfig

    from specdec.models import load_model
    from specdec.models.registry import ALIASES

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    path = ALIASES[name].locate_gguf()
    config = AutoConfig.from_pretrained(store.gguf_metadata(path)).get_text_config()
    direct = NativeModel.convert(config, store.gguf_reader(path, config), "int8")
    expected = NativeModel.from_module(load_model(name).model, "int8")
    for mine, theirs in zip(direct.layers, expected.layers, strict=True):
        assert torch.equal(mine.qkv.packed, theirs.qkv.packed) and torch.equal(mine.down.packed, theirs.down.packed)
    assert torch.equal(direct.head.packed, expected.head.packed)
    assert all(torch.equal(direct.layers[-1].norms[n], expected.layers[-1].norms[n]) for n in expected.layers[-1].norms)
