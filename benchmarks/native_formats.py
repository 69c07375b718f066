"""Perplexity of each native format against float32 on the bundled real models, with llama.cpp's on the same tokens.

Usage: python benchmarks/native_formats.py --out FILE [--tokens 4096] [--window 512] [--work DIR]

The text is the shipped default prompt set, tokenized once by the model's tokenizer and cut into windows scored from
their own start (as `specdec ppl` does). Scored on the same token ids: transformers float32 (the GGUF's weights as
transformers reads them), native int8 (with its default float32 KV cache, and in bfloat16 and float16), native int4
(bfloat16 cache), and llama.cpp on GGUF files: the bundled file itself (Gemma-3-270M:
Q4_K_M, mostly Q5_0 and Q6_K/Q8_0 tensors, as llama.cpp's mix picks for widths that K-quants do not fit; SmolLM2: Q4_1)
and, for SmolLM2, a Q4_K_M written by llama.cpp's own quantizer from an F16 GGUF of the float32 weights (--work).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from specdec.bench.perplexity import read_tokens, score
from specdec.bench.prompts import DEFAULT_PROMPTS, prompt_sets
from specdec.config import RuntimeConfig
from specdec.machine import fingerprint
from specdec.models import load_model, open_target
from specdec.models.native import NativeBackend
from specdec.models.registry import ALIASES

MODELS = ("gemma-3-270m", "smollm2-135m-instruct")


def llama_cpp_nll(gguf: Path, tokens: list[int], window: int) -> float:
    """Mean negative log-likelihood on llama.cpp, scored as every other column is (``bench.perplexity.score``)."""
    from specdec.models.llamacpp import LlamaCppBackend, require_llama_cpp

    require_llama_cpp()
    return score(LlamaCppBackend(str(gguf)), tokens, window, lambda *a: None, "llama.cpp")


def smollm2_q4_k_m(work: Path) -> Path:
    """SmolLM2 as Q4_K_M from its float32 weights (model_sizes' F16 writer with the model's own tokenizer)."""
    from model_sizes import quantize, write_gguf

    out = work / "smollm2-135m-Q4_K_M.gguf"
    if out.exists():
        return out
    model = load_model("smollm2-135m-instruct").model
    c = model.config
    shape = dict(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
        intermediate_size=c.intermediate_size, tie_word_embeddings=True, rope_theta=c.rope_parameters["rope_theta"],
        like="SmolLM2-135M",
    )  # fmt: skip
    work.mkdir(parents=True, exist_ok=True)
    f16 = work / "smollm2-135m-F16.gguf"
    write_gguf(model, shape, f16)
    quantize(f16, out)
    f16.unlink()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--work", type=Path, default=Path("/tmp/native-formats"))
    args = parser.parse_args()
    results: dict = {"machine": fingerprint(), "tokens": args.tokens, "window": args.window, "models": {}}
    data = str(prompt_sets()[DEFAULT_PROMPTS])
    for name in MODELS:
        float32 = load_model(name)
        tokens = read_tokens(float32.tokenizer, data, args.tokens)
        row = {
            "tokens": len(tokens),
            "float32": math.exp(score(float32.model, tokens, args.window, lambda *a: None, "f32")),
        }
        del float32
        for format in ("int8", "int4"):
            backend = open_target(name, RuntimeConfig(backend="native", native_format=format)).backend
            row[f"native {format}"] = math.exp(score(backend, tokens, args.window, lambda *a: None, format))
            if format == "int8":  # the KV cache's other element types (float32 is int8's default, above)
                for cache in ("bfloat16", "float16"):
                    other = NativeBackend(backend.model, cache)
                    row[f"int8, {cache} cache"] = math.exp(score(other, tokens, args.window, lambda *a: None, cache))
        row["llama.cpp, bundled GGUF"] = math.exp(llama_cpp_nll(ALIASES[name].locate_gguf(), tokens, args.window))
        if name == "smollm2-135m-instruct":
            row["llama.cpp Q4_K_M"] = math.exp(llama_cpp_nll(smollm2_q4_k_m(args.work), tokens, args.window))
        results["models"][name] = row
        print(name, json.dumps(row), flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    columns = [
        "float32",
        "native int8",
        "int8, bfloat16 cache",
        "int8, float16 cache",
        "native int4",
        "llama.cpp, bundled GGUF",
        "llama.cpp Q4_K_M",
    ]
    print("| model | tokens | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|" * len(columns))
    for name, row in results["models"].items():
        cells = []
        for column in columns:
            value = row.get(column)
            delta = "" if value is None or column == "float32" else f" ({(value / row['float32'] - 1):+.1%})"
            cells.append("-" if value is None else f"{value:.3f}{delta}")
        print(f"| {name} | {row['tokens']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
