"""Damaged model files end in one ConfigError on every load path: a small valid GGUF and safetensors checkpoint,
truncated at every header boundary and a spread of offsets, bit-flipped (seeded), with oversize counts and sizes
declared and (safetensors) JSON nested deep. Each case either loads or raises ConfigError naming the file, within a
few seconds (a hang fails) and without allocating over 1 GiB more address space (an attempt fails)."""

from __future__ import annotations

import contextlib
import json
import random
import re
import resource
import signal
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest
from conftest import tiny_llama
from transformers import AutoConfig

from specdec.config import RuntimeConfig
from specdec.errors import ConfigError
from specdec.models import load_model, open_target
from specdec.models.native import NativeModel, store

CASE_SECONDS = 10  # a case running longer hangs
HEADROOM = 2**30  # address space a case may take beyond what the process holds when the cases start
FLIPS = 64  # seeded flipped files per format
GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
}  # fmt: skip


def write_gguf(model, path: Path) -> Path:
    """``model`` as a GGUF file transformers and the native runtime load: Q8_0 matrices, F32 norms, a llama
    vocabulary (query and key rows left in transformers' order: these tests only load it)."""
    config, q8 = model.config, gguf.GGMLQuantizationType.Q8_0
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_scores([0.0] * config.vocab_size)
    writer.add_token_types([1] * config.vocab_size)
    writer.add_eos_token_id(2)
    tensors = {"token_embd.weight": model.model.embed_tokens.weight, "output_norm.weight": model.model.norm.weight}
    tensors["output.weight"] = model.lm_head.weight
    for index, layer in enumerate(model.model.layers):
        for theirs, ours in GGUF_NAMES.items():
            tensors[f"blk.{index}.{ours}.weight"] = layer.get_submodule(theirs).weight
    for name, weight in tensors.items():
        values = weight.detach().float().numpy()
        if values.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def load_gguf_natively(path: Path) -> None:
    """What the native runtime does with a GGUF file, short of its kernels: config and tokenizer from the metadata,
    every tensor read, de-quantized and packed."""
    config = AutoConfig.from_pretrained(store.gguf_metadata(path)).get_text_config()
    NativeModel.convert(config, store.gguf_reader(path, config), "int8")


def load_safetensors_natively(folder: Path) -> None:
    config = AutoConfig.from_pretrained(folder)
    NativeModel.convert(config, store.safetensors_reader(folder), "int8")


def load_with_transformers(path: Path) -> None:
    load_model(str(path))


def _address_space() -> int | None:
    """The process's address space in bytes (None where /proc does not say)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
    except (OSError, StopIteration):
        return None


@contextlib.contextmanager
def bounded() -> Iterator[Callable[[Callable[[Path], None], Path], str | None]]:
    """A runner of cases under a ceiling of address space (an allocation past it fails, with an error that is no
    ConfigError) and an alarm (a hang raises TimeoutError): each case's ConfigError message, None if it loaded."""

    def expire(signum, frame):
        raise TimeoutError(f"a case ran past {CASE_SECONDS} s")

    def run(load: Callable[[Path], None], path: Path) -> str | None:
        signal.alarm(CASE_SECONDS)
        try:
            load(path)
            return None
        except ConfigError as exc:
            message = str(exc)
            assert "\n" not in message, message
            assert not re.search("allocate|MemoryError", message), message  # a refused allocation, not a check
            return message
        finally:
            signal.alarm(0)

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    previous = signal.signal(signal.SIGALRM, expire)
    if (held := _address_space()) is not None:
        resource.setrlimit(resource.RLIMIT_AS, (held + HEADROOM, hard))
    try:
        yield run
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture
def gguf_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    return write_gguf(tiny_llama(0, hidden=64), tmp_path / "good.gguf")  # a shape the native runtime packs


@pytest.fixture
def safetensors_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "tiny"
    tiny_llama(0, hidden=64).save_pretrained(folder)
    return folder


def _gguf_layout(path: Path) -> tuple[dict[str, int], list[int]]:
    """Where each part of the file's header starts ("key/part": offset, "tensor name/part" likewise) and every
    boundary between parts, the data section's and each tensor's."""
    reader = gguf.GGUFReader(path)
    where: dict[str, int] = {}
    boundaries = {0, 4, 8, 16, 24, reader.data_offset, len(reader.data)}
    for field in [*reader.fields.values(), *(t.field for t in reader.tensors)]:
        at = field.offset
        for index, part in enumerate(field.parts[:8]):  # a long array's first items
            where[f"{field.name}/{index}"] = at
            boundaries.add(at)
            at += int(part.nbytes)
        boundaries.add(at)
    boundaries |= {int(t.data_offset) for t in reader.tensors}
    return where, sorted(boundaries)


def _patched(data: bytes, at: int, format: str, value: int) -> bytes:
    return data[:at] + struct.pack("<" + format, value) + data[at + struct.calcsize(format) :]


def _cut_points(boundaries: list[int], size: int) -> list[int]:
    """Every boundary, a byte either side of each, and a spread of offsets through the file."""
    points = {b + d for b in boundaries for d in (-1, 0, 1)} | set(range(0, size, max(1, size // 40)))
    return sorted(p for p in points if 0 <= p < size)


def _flipped(data: bytes, within: int, rng: random.Random) -> bytes:
    flipped = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4])):
        flipped[rng.randrange(within)] ^= 1 << rng.randrange(8)
    return bytes(flipped)


GGUF_PATHS = [load_gguf_natively, load_with_transformers]


@pytest.mark.parametrize("backend", ["native", "auto", "transformers"])
def test_a_gguf_cut_inside_its_metadata_is_refused_by_every_backend(gguf_file: Path, backend: str) -> None:
    """The reported cuts (once a struct.error from transformers' GGUF reader), through open_target itself."""
    runtime = RuntimeConfig(backend=backend, **({"native_format": "int8"} if backend != "transformers" else {}))
    good = gguf_file.read_bytes()
    for cut in (10, 100, 400, 2000):
        path = gguf_file.with_name(f"cut-{cut}.gguf")
        path.write_bytes(good[:cut])
        with pytest.raises(ConfigError, match=f"{re.escape(str(path))} is not a readable GGUF file"):
            open_target(str(path), runtime)


def test_truncated_gguf_files_are_refused_on_every_load_path(gguf_file: Path) -> None:
    good = gguf_file.read_bytes()
    _, boundaries = _gguf_layout(gguf_file)
    with bounded() as run:
        for cut in _cut_points(boundaries, len(good)):
            path = gguf_file.with_name(f"cut-{cut}.gguf")
            path.write_bytes(good[:cut])
            for load in GGUF_PATHS:
                assert str(path) in (run(load, path) or "loaded"), (cut, load.__name__)


def test_gguf_files_declaring_more_than_they_hold_are_refused(gguf_file: Path) -> None:
    """A 1 TB tensor, an offset past the end, 2^60 array items or metadata entries or tensors, a string of 2^62
    bytes, 2^29 layers, a width of 2^20: each refused before anything of that size is allocated or looped over."""
    good = gguf_file.read_bytes()
    where, _ = _gguf_layout(gguf_file)
    dims, offset = where["output.weight/3"], where["output.weight/5"]  # its [in, out] and its data's offset
    past_the_end = "past the file's end"
    cases = {  # each file, and what its refusal says
        "1 TB tensor": (_patched(good, dims + 8, "Q", 2**40 // 68), past_the_end),  # rows of two 34-byte blocks
        "offset past the end": (_patched(good, offset, "Q", 2**40), past_the_end),
        "2^60 strings": (_patched(good, where["tokenizer.ggml.tokens/4"], "Q", 2**60), f"declares {2**60} items"),
        "2^60 floats": (_patched(good, where["tokenizer.ggml.scores/4"], "Q", 2**60), f"declares {2**60} items"),
        "2^60 metadata entries": (_patched(good, 16, "Q", 2**60), f"declares {2**60} items"),
        "2^60 tensors": (_patched(good, 8, "Q", 2**60), f"declares {2**60} items"),
        "a 2^62-byte string": (
            _patched(good, where["tokenizer.ggml.tokens/5"], "Q", 2**62),
            "runs past the file's end",
        ),
        "a 2^62-byte key": (_patched(good, where["general.architecture/0"], "Q", 2**62), past_the_end),
        "2^29 layers": (_patched(good, where["llama.block_count/3"], "I", 2**29), f"declares {2**29} layers"),
        "a width of 2^20": (_patched(good, where["llama.embedding_length/3"], "I", 2**20), "declares a model of"),
        "an FFN of 2^24": (_patched(good, where["llama.feed_forward_length/3"], "I", 2**24), "declares a model of"),
        "5 dimensions": (_patched(good, where["output.weight/2"], "I", 5), "declares 5 dimensions"),
        "an unknown tensor type": (_patched(good, where["output.weight/4"], "I", 1000), "unknown type 1000"),
        "an unknown value type": (_patched(good, where["llama.block_count/2"], "I", 1000), "unknown value type"),
    }
    with bounded() as run:
        for case, (data, what) in cases.items():
            path = gguf_file.with_name(f"{case.replace(' ', '-')}.gguf")
            path.write_bytes(data)
            for load in GGUF_PATHS:
                message = run(load, path) or "loaded"
                assert str(path) in message and what in message, (case, load.__name__, message)


def test_bit_flipped_gguf_files_load_or_are_refused(gguf_file: Path) -> None:
    good = gguf_file.read_bytes()
    header = gguf.GGUFReader(gguf_file).data_offset  # flips in the tensors' values only change them
    rng = random.Random(0)
    outcomes = []
    with bounded() as run:
        for index in range(FLIPS):
            path = gguf_file.with_name(f"flipped-{index}.gguf")
            path.write_bytes(_flipped(good, header, rng))
            outcomes += [run(load, path) for load in GGUF_PATHS]
    assert None in outcomes and any(outcomes)  # the flips hit what matters and what does not


SAFETENSORS_PATHS = [load_safetensors_natively, load_with_transformers]


def test_truncated_safetensors_files_are_refused_on_every_load_path(safetensors_folder: Path) -> None:
    file = safetensors_folder / "model.safetensors"
    good = file.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    header = json.loads(good[8 : 8 + length])
    boundaries = [0, 8, 8 + length] + [8 + length + e["data_offsets"][0] for n, e in header.items() if n[0] != "_"]
    with bounded() as run:
        for cut in _cut_points(boundaries, len(good)):
            file.write_bytes(good[:cut])
            for load in SAFETENSORS_PATHS:
                assert str(file) in (run(load, safetensors_folder) or "loaded"), (cut, load.__name__)


def test_safetensors_files_declaring_more_than_they_hold_are_refused(safetensors_folder: Path) -> None:
    """A 1 TB tensor, a header longer than the file, a shape of 2^60 values, JSON nested 100,000 deep, a header that
    is not UTF-8 or not an object: each refused before anything of that size is allocated."""
    file = safetensors_folder / "model.safetensors"
    good = file.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    header, data = json.loads(good[8 : 8 + length]), good[8 + length :]

    def rewritten(change: Callable[[dict], object]) -> bytes:
        entries = json.loads(json.dumps(header))
        text = json.dumps(change(entries) or entries).encode()
        return struct.pack("<Q", len(text)) + text + data

    def one_terabyte(entries: dict) -> None:
        entries["lm_head.weight"] = {"dtype": "F32", "shape": [2**38], "data_offsets": [0, 2**40]}

    def huge_shape(entries: dict) -> None:
        entries["lm_head.weight"]["shape"] = [2**30, 2**30]

    def raw(text: bytes) -> bytes:
        return struct.pack("<Q", len(text)) + text + data

    def shared_bytes(entries: dict) -> None:
        entries[f"{layer}1.{query}"]["data_offsets"] = entries[f"{layer}0.{query}"]["data_offsets"]

    layer, query = "model.layers.", "self_attn.q_proj.weight"
    cases = {  # each file, and what its refusal says
        "1 TB tensor": (rewritten(one_terabyte), "declares data up to byte 1099511627776"),
        "2^60 values": (rewritten(huge_shape), "for its shape [1073741824, 1073741824]"),
        "a header of 2^63 bytes": (struct.pack("<Q", 2**63) + good[8:], f"declares {2**63} bytes"),
        "deep nesting": (raw(b'{"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"), "nested too deeply"),
        "a header that is not UTF-8": (raw(b'{"\xff\xfe": 1}'), "not UTF-8 JSON"),
        "a list for a header": (raw(b"[" * 100_000 + b"]" * 100_000), "does not start with '{'"),
        "metadata of numbers": (rewritten(lambda entries: entries | {"__metadata__": {"v": 1}}), "__metadata__"),
        "a list for a dtype": (rewritten(lambda entries: entries[f"{layer}0.{query}"].update(dtype=["F32"])), "dtype"),
        "two tensors on the same bytes": (rewritten(shared_bytes), "not where the one before ends"),
    }
    with bounded() as run:
        for case, (content, what) in cases.items():
            file.write_bytes(content)
            for load in SAFETENSORS_PATHS:
                message = run(load, safetensors_folder) or "loaded"
                assert str(file) in message and what in message, (case, load.__name__, message)


def test_bit_flipped_safetensors_headers_load_or_are_refused(safetensors_folder: Path) -> None:
    file = safetensors_folder / "model.safetensors"
    good = file.read_bytes()
    (length,) = struct.unpack("<Q", good[:8])
    rng = random.Random(0)
    outcomes = []
    with bounded() as run:
        for _ in range(FLIPS):
            file.write_bytes(_flipped(good, 8 + length, rng))
            outcomes += [run(load, safetensors_folder) for load in SAFETENSORS_PATHS]
    assert None in outcomes and any(outcomes)
