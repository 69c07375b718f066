"""The native runtime's models on disk: converted from a checkpoint one tensor at a time, cached, memory-mapped.

A safetensors checkpoint (float32, float16 or bfloat16) or a GGUF file (F32, F16, BF16 and llama.cpp's quantized
types: Q8_0, Q4_0, Q4_K, Q6_K...) is read tensor by tensor with plain file reads (no mapping of the whole file stays
resident), each tensor de-quantized if need be, packed into the native format and dropped, so memory while loading
stays near the packed model's size. The packed model is then written under ``cache_root()/native`` and later starts
memory-map it: a second start reads no checkpoint and quantizes nothing.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import logging
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.errors import ConfigError
from specdec.models.file_headers import check_gguf, check_gguf_model, one_line, safetensors_header
from specdec.models.native.model import NativeModel, Tensors
from specdec.models.registry import cache_root

log = logging.getLogger("specdec")
STORE_VERSION = 4  # the cached files' layout: change it with NativeModel.state or the packed buffers
DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
DEQUANTIZE_ROWS = 4096  # rows of a GGUF matrix de-quantized at a time


def safetensors_reader(folder: Path) -> Tensors:
    """A function reading one tensor of the folder's safetensors files by name (None if no file has it)."""
    where: dict[str, tuple[Path, int, dict]] = {}
    for file in checkpoint_files(folder):
        base, entries = safetensors_header(file)  # every offset checked against the file's size
        where |= {name: (file, base, entry) for name, entry in entries.items()}

    def read(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        file, base, entry = where[name]
        if entry["dtype"] not in DTYPES:
            raise ConfigError(
                f"tensor {name} is {entry['dtype']}: the native runtime reads F32, F16 and BF16 checkpoints"
            )
        begin, end = entry["data_offsets"]
        dtype, shape = DTYPES[entry["dtype"]], entry["shape"]  # its bytes, checked against its shape and the file's
        data = torch.empty(end - begin, dtype=torch.uint8)
        with open(file, "rb") as handle:
            handle.seek(base + begin)
            if handle.readinto(data.numpy()) != end - begin:
                raise ConfigError(f"{file} ends before tensor {name}: the file is truncated, download it again")
        return data.view(dtype).reshape(shape)

    return read


def checkpoint_files(folder: Path) -> list[Path]:
    """The checkpoint's safetensors files: those its index names (each must exist), else every one in the folder."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index} is damaged (no weight_map): download the checkpoint again") from None
        if missing := [name for name in names if not (folder / name).is_file()]:
            raise ConfigError(f"{folder} lacks the shard(s) its index names: {', '.join(missing)}: download them")
        return [folder / name for name in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{folder} has no .safetensors files: the native runtime loads safetensors checkpoints")
    return files


def gguf_reader(path: Path, config) -> Tensors:
    """A function reading one tensor of a GGUF file by its transformers name (as transformers maps and fixes them:
    Llama's query and key rows back in transformers' order, Gemma's norms less one), de-quantized to float32."""
    import gguf
    import numpy as np
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    check_gguf(path)  # gguf's reader trusts the header's counts and sizes
    try:
        reader = gguf.GGUFReader(path)
        architecture = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    except (OSError, ValueError, KeyError, IndexError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"{path} is not a GGUF file the native runtime can read ({one_line(exc)}): download it again"
        ) from None
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=config.to_dict())
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)  # only its parameter names
        mapped = get_gguf_hf_weights_map(skeleton, processor, model_type=architecture)  # named as the file names it
    except (NotImplementedError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(
            f"the tensors of {path} ({architecture}) cannot be mapped to the model's ({one_line(exc)})"
        ) from None
    names = {ours: theirs for theirs, ours in mapped.items()}
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}  # as the config has them
    # Where each tensor lies and how it is laid out; the reader's arrays map the whole file, so none is kept.
    entries = {
        e.name: (int(e.data_offset), int(e.n_bytes), e.data.dtype, e.data.shape, e.tensor_type) for e in reader.tensors
    }
    del reader, skeleton

    def read(name: str) -> torch.Tensor | None:
        gguf_name = names.get(name, "")
        if gguf_name not in entries:
            return None
        offset, size, dtype, shape, kind = entries[gguf_name]
        raw = np.empty(size, dtype=np.uint8)
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                complete = handle.readinto(raw) == size
        except OSError as exc:
            raise ConfigError(f"{path} could not be read ({exc})") from None
        if not complete:
            raise ConfigError(f"{path} ends before tensor {gguf_name}: the file is truncated, download it again")
        try:
            values = _dequantized(raw.view(dtype).reshape(shape), kind)
        except NotImplementedError:
            raise ConfigError(
                f"tensor {gguf_name} is {kind.name}, which gguf cannot de-quantize: use --runtime llama.cpp"
            ) from None
        except ValueError as exc:  # a shape its blocks do not fill
            raise ConfigError(
                f"tensor {gguf_name} of {path} cannot be de-quantized ({one_line(exc)}): the file is damaged, "
                "download it again"
            ) from None
        try:
            values = processor.process(weights=values, name=gguf_name).weights
        except ValueError:  # a reshape by the config's head counts that the tensor does not fit
            values = None
        if values is None or (name in shapes and values.shape != shapes[name]):
            raise ConfigError(
                f"tensor {gguf_name} of {path} does not fit the shape {shapes.get(name)} that the file's metadata "
                "gives it: the file is damaged, download it again"
            )
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))

    return read


def _dequantized(raw, kind):
    """float32 values of a GGUF tensor's raw blocks, a chunk of rows at a time (de-quantizing a whole matrix at once
    holds several float32 temporaries of its size)."""
    import gguf
    import numpy as np

    if raw.ndim < 2 or len(raw) <= DEQUANTIZE_ROWS:
        return gguf.quants.dequantize(raw, kind)
    first = gguf.quants.dequantize(raw[:DEQUANTIZE_ROWS], kind)
    values = np.empty((len(raw), *first.shape[1:]), dtype=np.float32)
    values[:DEQUANTIZE_ROWS] = first
    for start in range(DEQUANTIZE_ROWS, len(raw), DEQUANTIZE_ROWS):
        values[start : start + DEQUANTIZE_ROWS] = gguf.quants.dequantize(raw[start : start + DEQUANTIZE_ROWS], kind)
    return values


def gguf_metadata(path: Path) -> Path:
    """A folder holding the config and tokenizer of a GGUF file, written once beside the cache (building them from the
    file takes seconds: the tokenizer is rebuilt from its vocabulary)."""
    from transformers import AutoConfig, AutoTokenizer

    folder = cache_root() / "native" / f"{path.stem}-{_stamp([path])}-metadata"
    if (folder / "config.json").exists():
        return folder
    values = check_gguf(path)  # transformers' reader trusts the header's counts and sizes
    try:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - transformers' errors and huggingface_hub's validation of the config
        raise ConfigError(
            f"could not read the model's config from {path} ({one_line(exc)}): is it a GGUF model file?"
        ) from None
    check_gguf_model(path, config, values)  # no model larger than the file is built from it
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # noqa: BLE001 - any failure of transformers' conversion of a GGUF vocabulary
        log.warning("no tokenizer could be built from %s (%s): the model runs on token ids", path, exc)
        # A temporary folder, not kept: the tokenizer is tried again next time.
        tokenizer, folder = None, Path(tempfile.mkdtemp(prefix="specdec-gguf-config-"))
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=folder.parent))
    try:
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        os.replace(staging, folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _stamp(files: list[Path], *extra: str) -> str:
    stamp = hashlib.sha256()
    for file in files:
        info = file.stat()
        stamp.update(f"{file.resolve()}|{info.st_size}|{info.st_mtime_ns}".encode())
    stamp.update("|".join(extra).encode())
    return stamp.hexdigest()[:16]


def cached_path(source: Path, format: str) -> Path:
    """Where the packed model of a checkpoint (a safetensors folder or a GGUF file) in ``format`` is cached (keyed by
    the checkpoint's files)."""
    files = [source] if source.suffix == ".gguf" else checkpoint_files(source) + [source / "config.json"]
    stamp = _stamp(files, format, str(STORE_VERSION))
    return cache_root() / "native" / f"{source.resolve().name}-{format}-{stamp}.pt"


def load(source: Path, config, format: str, say: Callable[[str], None] = log.warning) -> NativeModel:
    """The native model of a checkpoint (a safetensors folder or a GGUF file) in ``format`` (int8 or int4):
    memory-mapped from the cache, or converted one tensor at a time (said through ``say``, with progress) and cached."""
    path = cached_path(source, format)
    if path.exists():
        try:
            return NativeModel.restore(torch.load(path, mmap=True, weights_only=True), config)
        except (OSError, RuntimeError, ValueError, KeyError, TypeError, EOFError, pickle.UnpicklingError) as exc:
            log.warning("the cached native model %s could not be read (%s): converting again", path, exc)
    started = time.monotonic()
    say(f"converting {source.name} to the native {format} format, once (cached in {path.parent})")

    def progress(done: int, total: int) -> None:
        _release_freed_memory()
        if done == total or done % max(1, total // 4) == 0:
            say(f"  {done}/{total} layers packed ({time.monotonic() - started:.0f} s)")

    reader = gguf_reader(source, config) if source.suffix == ".gguf" else safetensors_reader(source)
    model = NativeModel.convert(config, reader, format, progress)
    save(model, path)
    return model


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc keeps a layer's freed temporaries otherwise, and the peak
    memory of a conversion grows with them)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def save(model: NativeModel, path: Path) -> None:
    """Write the packed model atomically (a reader never sees half a file); an unwritable cache is only a warning."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=path.name + ".", dir=path.parent)
        os.close(handle)
        try:
            torch.save(model.state(), staging)
            os.replace(staging, path)
        finally:
            if os.path.exists(staging):
                os.unlink(staging)
        stem = path.name.rsplit("-", 1)[0]  # the same checkpoint and format, converted before it changed
        for older in path.parent.glob(f"{stem}-*.pt"):
            if older != path:
                older.unlink(missing_ok=True)
    except (OSError, RuntimeError) as exc:  # torch.save's failed writes are RuntimeErrors
        log.warning(
            "the native model could not be cached in %s (%s): the next start converts it again", path.parent, exc
        )
