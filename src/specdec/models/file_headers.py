"""The headers of GGUF and safetensors files, read with every declared count, length, offset and size checked
against the file's size before anything is allocated or handed to a reader that trusts them (gguf's, transformers',
safetensors'). A truncated or damaged file is one ConfigError naming the file and what is wrong, never a
``struct.error``, a ``RecursionError``, a terabyte allocation or a loop over 2^60 array items.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import struct
from pathlib import Path

from specdec.errors import ConfigError

GGUF_VERSIONS = (2, 3)  # those gguf's and transformers' readers take (version 1 counted in 32 bits)
GGUF_MAX_DIMS = 4  # ggml's tensors have at most 4 dimensions
GGUF_ALIGNMENT = 32  # the data section's alignment unless general.alignment says otherwise
# Metadata value types: the fixed-size ones and their widths, a string (8) and an array (9).
GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
GGUF_STRING, GGUF_ARRAY, GGUF_UINT32 = 8, 9, 4
GGUF_LAYER = re.compile(r"blk\.(\d+)\.")  # a layer's tensors are named blk.N.*

SAFETENSORS_HEADER_LIMIT = 100_000_000  # safetensors' own ceiling on a header's bytes
# Bits per value of every dtype the safetensors format names.
SAFETENSORS_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "F64": 64, "I64": 64, "U64": 64, "C64": 64, "F4": 4,
    "F6_E2M3": 6, "F6_E3M2": 6,
}  # fmt: skip
# What a malformed header can raise on its way through the parsers (besides the checks' own refusals).
PARSE_ERRORS = (struct.error, RecursionError, MemoryError, UnicodeDecodeError, ValueError, OverflowError)


def one_line(exc: BaseException) -> str:
    """A library's error message on one line (some span several)."""
    return " ".join(str(exc).split()) or type(exc).__name__


class _Damaged(Exception):
    """What is wrong with a file's header (made into the ConfigError that names the file)."""


def _refusal(path: Path, kind: str, or_else: str, exc: BaseException) -> ConfigError:
    """The one-line error for a header that could not be read (``exc``): unreadable, or damaged as found."""
    if isinstance(exc, OSError):
        return ConfigError(f"{path} could not be read ({exc})")
    why = str(exc) if isinstance(exc, _Damaged) else f"{type(exc).__name__}: {one_line(exc)}"  # none expected
    return ConfigError(f"{path} is not a readable {kind} file ({why}): it is truncated or {or_else}, download it again")


def check_gguf(path: Path) -> int:
    """The number of values ``path``'s tensors hold, or a ConfigError unless its GGUF header is whole and consistent:
    its metadata and tensor table lie inside the file, with known value and tensor types, UTF-8 names, no key or
    tensor twice, no nested arrays, no more layers declared than it has tensors for, and each tensor's data (its
    offset plus its shape's bytes) ends within the file."""
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 24:
                raise _Damaged(f"it has {size} bytes, fewer than a GGUF header's first 24")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _GgufHeader(data, size).walk()
    except (OSError, _Damaged, *PARSE_ERRORS) as exc:
        raise _refusal(path, "GGUF", "not a GGUF file", exc) from None


def check_gguf_model(path: Path, config, values: int) -> None:
    """Raise a ConfigError if the model ``config`` (read from ``path``'s metadata) holds far more values than the
    file's tensors (``values``, from ``check_gguf``): a damaged width or count would have it allocated."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):  # sizes only, no memory
            declared = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    except Exception as exc:  # noqa: BLE001 - any failure of transformers to build the model the metadata describes
        raise ConfigError(
            f"{path}'s metadata describes no model transformers can build ({one_line(exc)}): the file is damaged or "
            "not a model it reads, download it again"
        ) from None
    if declared > values * 5 // 4 + 2**16:  # a model's own files hold every weight (a tied head once)
        raise ConfigError(
            f"{path}'s metadata declares a model of {declared} values, its tensors hold {values}: the file is "
            "damaged, download it again"
        )


class _GgufHeader:
    """A walk through a GGUF file's header that refuses whatever would read past its end."""

    def __init__(self, data: mmap.mmap, size: int) -> None:
        self.data, self.size, self.at = data, size, 0

    def take(self, count: int, what: str) -> int:
        """The offset of the next ``count`` bytes (``what`` they are), which must lie in the file."""
        if count > self.size - self.at:
            raise _Damaged(f"{what} at byte {self.at} needs {count} bytes, past the file's end at {self.size}")
        at, self.at = self.at, self.at + count
        return at

    def unpack(self, format: str, what: str) -> tuple:
        layout = struct.Struct("<" + format)
        return layout.unpack_from(self.data, self.take(layout.size, what))

    def string(self, what: str) -> str:
        (length,) = self.unpack("Q", f"the length of {what}")
        at = self.take(length, f"{what} of {length} bytes")
        try:
            return str(self.data[at : at + length], "utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"{what} at byte {at} is not UTF-8") from None

    def count(self, count: int, least: int, what: str) -> None:
        """Refuse ``count`` items of at least ``least`` bytes each that the rest of the file cannot hold."""
        if count * least > self.size - self.at:
            raise _Damaged(f"{what} declares {count} items, more than the {self.size - self.at} bytes left hold")

    def walk(self) -> int:
        if self.data[:4] != b"GGUF":
            raise _Damaged("it does not start with the GGUF magic bytes")
        self.at = 4
        (version,) = self.unpack("I", "the version")
        if version not in GGUF_VERSIONS:
            raise _Damaged(f"it is version {version}: GGUF versions {' and '.join(map(str, GGUF_VERSIONS))} are read")
        tensors, entries = self.unpack("QQ", "the tensor and metadata counts")
        self.count(entries, 8 + 4 + 1, "the metadata")  # a key's length, a type, a 1-byte value
        alignment, values = GGUF_ALIGNMENT, {}
        for _ in range(entries):
            key = self.string("a metadata key")
            if key in values:
                raise _Damaged(f"metadata key {key!r} appears twice")
            (kind,) = self.unpack("I", f"the type of {key!r}")
            values[key] = value = self.value(kind, key)
            if key == "general.alignment":
                if kind != GGUF_UINT32 or value == 0 or value & (value - 1):
                    raise _Damaged(f"general.alignment is {value!r}, not a power of two (uint32)")
                alignment = value
        self.count(tensors, 8 + 4 + 4 + 8, "the tensor table")  # a name's length, dimensions, type, offset
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        sizes = {int(kind): block for kind, block in GGML_QUANT_SIZES.items()}
        names: set[str] = set()
        table = []
        for _ in range(tensors):
            name = self.string("a tensor name")
            if name in names:
                raise _Damaged(f"tensor {name!r} appears twice")
            names.add(name)
            (dims,) = self.unpack("I", f"the dimension count of tensor {name!r}")
            if dims > GGUF_MAX_DIMS:
                raise _Damaged(f"tensor {name!r} declares {dims} dimensions, more than ggml's {GGUF_MAX_DIMS}")
            shape = self.unpack(f"{dims}Q", f"the shape of tensor {name!r}")
            kind, offset = self.unpack("IQ", f"the type and offset of tensor {name!r}")
            if kind not in sizes:
                raise _Damaged(f"tensor {name!r} has the unknown type {kind}")
            block, block_bytes = sizes[kind]
            if shape and shape[0] % block:
                raise _Damaged(
                    f"tensor {name!r} has rows of {shape[0]} values, not whole {GGMLQuantizationType(kind).name} "
                    f"blocks of {block}"
                )
            count = math.prod(shape)
            table.append((name, offset, count, count // block * block_bytes))
        start = -(-self.at // alignment) * alignment
        for name, offset, _, nbytes in table:
            if start + offset + nbytes > self.size:
                raise _Damaged(
                    f"tensor {name!r} declares {nbytes} bytes at byte {start + offset}, past the file's end at "
                    f"{self.size}"
                )
        # Layers are built before any tensor is read: as many as the metadata says, each with tensors in the file.
        layers = 1 + max((int(match[1]) for name in names if (match := GGUF_LAYER.match(name))), default=-1)
        declared = values.get(f"{values.get('general.architecture')}.block_count")
        if isinstance(declared, int) and declared > layers:
            raise _Damaged(f"its metadata declares {declared} layers, its tensors are those of {layers}")
        return sum(count for _, _, count, _ in table)

    def value(self, kind: int, key: str) -> object:
        """Read one metadata value (returned when it is a number or a string)."""
        if kind in GGUF_SCALARS:
            return self.unpack(GGUF_SCALARS[kind], f"the value of {key!r}")[0]
        if kind == GGUF_STRING:
            return self.string(f"the value of {key!r}")
        if kind != GGUF_ARRAY:
            raise _Damaged(f"{key!r} has the unknown value type {kind}")
        item, count = self.unpack("IQ", f"the array header of {key!r}")
        if item in GGUF_SCALARS:
            width = struct.calcsize(GGUF_SCALARS[item])
            self.count(count, width, f"the array {key!r}")
            self.take(count * width, f"the array {key!r}")
        elif item == GGUF_STRING:  # a vocabulary's hundreds of thousands: the string walk, inlined
            self.count(count, 8, f"the array {key!r}")  # a string's length at least
            length_at, data, at = struct.Struct("<Q").unpack_from, self.data, self.at
            for _ in range(count):
                if self.size - at < 8 or (length := length_at(data, at)[0]) > self.size - at - 8:
                    raise _Damaged(f"a string of {key!r} at byte {at} runs past the file's end at {self.size}")
                try:
                    str(data[at + 8 : at + 8 + length], "utf-8")
                except UnicodeDecodeError:
                    raise _Damaged(f"a string of {key!r} at byte {at} is not UTF-8") from None
                at += 8 + length
            self.at = at
        else:
            raise _Damaged(f"{key!r} is an array of type {item}: GGUF readers take arrays of numbers or strings")
        return None


def safetensors_header(file: Path) -> tuple[int, dict[str, dict]]:
    """Where a safetensors file's data starts and its tensors' entries (``dtype``, ``shape``, ``data_offsets``), or a
    ConfigError: the header's length within the file, its JSON an object of known dtypes with whole shapes, and the
    tensors' bytes (each its shape's size) tiling the data exactly to the file's end, as safetensors itself checks."""
    try:
        with open(file, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size < 8:
                raise _Damaged(f"it has {size} bytes, fewer than the header's length takes")
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > min(size - 8, SAFETENSORS_HEADER_LIMIT):
                raise _Damaged(f"its header is damaged: it declares {length} bytes, the file holds {size - 8} after it")
            text = handle.read(length)
        if not text.startswith(b"{"):  # safetensors' own reader refuses anything else
            raise _Damaged("its header is damaged: it does not start with '{'")
        try:
            header = json.loads(text.decode("utf-8"))
        except RecursionError:
            raise _Damaged("its header is damaged: JSON nested too deeply") from None
        except (UnicodeDecodeError, ValueError) as exc:
            raise _Damaged(f"its header is damaged: not UTF-8 JSON ({exc})") from None
        return 8 + length, _tensor_entries(header, size - 8 - length)
    except (OSError, _Damaged, *PARSE_ERRORS) as exc:
        raise _refusal(file, "safetensors", "damaged", exc) from None


def _tensor_entries(header: dict, data_bytes: int) -> dict[str, dict]:
    """The tensors of a parsed safetensors header (a JSON object), each checked, whose bytes must fill ``data_bytes``
    exactly."""
    metadata = header.get("__metadata__")
    if not (metadata is None or isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise _Damaged("its header is damaged: __metadata__ is not an object of strings")
    entries = {name: entry for name, entry in header.items() if name != "__metadata__"}
    spans = []
    for name, entry in entries.items():
        if not isinstance(entry, dict):
            raise _Damaged(f"its header is damaged: tensor {name!r} is not an object")
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not (
            isinstance(dtype, str)
            and dtype in SAFETENSORS_BITS
            and isinstance(shape, list)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(v) is int and v >= 0 for v in [*shape, *offsets])
        ):
            raise _Damaged(f"its header is damaged: tensor {name!r} has no known dtype, shape or data_offsets")
        begin, end = offsets
        if end > data_bytes:
            raise _Damaged(f"tensor {name!r} declares data up to byte {end}, the file holds {data_bytes}")
        bits = math.prod(shape) * SAFETENSORS_BITS[dtype]
        if bits % 8 or end - begin != bits // 8:
            raise _Damaged(f"tensor {name!r} has {end - begin} bytes for its shape {shape} of {dtype}")
        spans.append((begin, end, name))
    covered = 0
    for begin, end, name in sorted(spans):
        if begin != covered:
            raise _Damaged(f"tensor {name!r} starts at byte {begin} of the data, not where the one before ends")
        covered = end
    if covered != data_bytes:
        raise _Damaged(f"its tensors take {covered} bytes of data, the file holds {data_bytes}")
    return entries
