"""Load a target or draft model and its tokenizer, converting GGUF files once.

transformers de-quantizes a GGUF file to float on every load, which takes tens
of seconds; the float copy is saved as safetensors under the cache folder and
loaded from there afterwards.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from specdec.config import DTYPES
from specdec.errors import ConfigError, ModelNotFoundError
from specdec.models.backend import with_threads
from specdec.models.file_headers import check_gguf, check_gguf_model, safetensors_header
from specdec.models.mkl import settle_mkl_functions
from specdec.models.precision import precision_of
from specdec.models.registry import (
    ALIASES,
    ModelSource,
    converted_path,
    is_cached,
    resolve,
)

TORCH_DTYPES = {name: getattr(torch, name) for name in DTYPES}


@dataclass
class LoadedModel:
    """A causal LM ready for inference, with the tokenizer that goes with it."""

    name: str
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    source: ModelSource

    @property
    def vocab_size(self) -> int:
        return self.model.get_output_embeddings().out_features


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"unknown dtype '{dtype}': use one of {', '.join(TORCH_DTYPES)}")
    return TORCH_DTYPES[dtype]


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "cpu") -> LoadedModel:
    """Load a model by name (alias, folder, .gguf file or hub id) in eval mode."""
    settle_mkl_functions()
    torch_dtype = parse_dtype(dtype)
    source = resolve(name)
    folder = materialize(source)
    if source.kind == "folder":
        for file in sorted(Path(folder).glob("*.safetensors")):
            safetensors_header(file)  # a damaged file is one line, not safetensors' own error
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch_dtype)
    except OSError as exc:
        if source.kind == "hub":
            raise ModelNotFoundError(
                f"could not load '{name}' from the Hugging Face hub ({first_line(exc)}): "
                "without network access pass a local folder, a .gguf file or a bundled alias"
            ) from exc
        raise ModelNotFoundError(f"could not load model '{name}' from {folder}: {first_line(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only folder still works with token ids
    model.to(device).eval()
    return LoadedModel(name=name, model=model, tokenizer=tokenizer, source=source)


def materialize(source: ModelSource) -> str:
    """A folder or hub id that ``from_pretrained`` can read, converting GGUF sources on first use."""
    if source.kind in ("folder", "hub"):
        return source.location
    target = converted_path(source)
    assert target is not None
    if not is_cached(source):
        gguf = ALIASES[source.location].locate_gguf() if source.kind == "alias" else Path(source.location)
        _convert_gguf(gguf, target)
    return str(target)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """De-quantize a GGUF file into a safetensors folder (written atomically)."""
    from rich.console import Console

    values = check_gguf(gguf)  # transformers' reader trusts the header's counts and sizes
    with Console(stderr=True).status(f"converting {gguf.name} to safetensors (once; cached in {target})"):
        try:
            config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            check_gguf_model(gguf, config, values)  # no model larger than the file is built from it
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
            tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        except ConfigError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure of transformers' model of a well-formed GGUF header
            raise ConfigError(
                f"transformers could not load {gguf} ({first_line(exc)}): the file is damaged or its model is not one "
                "transformers reads from GGUF; download it again, or use --runtime llama.cpp"
            ) from None
        # The weights are already float; drop the GGUF quantizer marker so transformers will serialize them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        try:
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            if target.exists():
                shutil.rmtree(target)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# Loading a cached model is quick; transformers' per-load progress bars and notes would only be noise.
hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()


def model_name(model: PreTrainedModel) -> str:
    """What decides a transformers model's speed here apart from threads (weights, precision, device): with the thread
    count, the key of its measured costs."""
    config = model.config
    weights = sum(p.numel() for p in model.parameters())
    precision = precision_of(model) or model.dtype
    device = next(model.parameters()).device
    return f"transformers|{config.name_or_path or config.model_type}|{weights}|{precision}|{device}"


def model_identity(model: PreTrainedModel) -> str:
    """What decides a transformers model's speed here (weights, precision, device, threads): the key of its measured
    costs."""
    return with_threads(model_name(model))
