"""llama.cpp quantization types as precision plans: speed, perplexity and speculation per type.

Usage: python benchmarks/llamacpp_quant_types.py --work DIR [--out FILE] [TYPE ...]
The bundled Gemma-3-270M GGUF is Q4_K_M (the only file available offline). llama.cpp's own
quantizer (llama_model_quantize) re-quantizes it to F16 (exactly the Q4_K_M weights, which the
transformers target also runs after conversion), and F16 to each TYPE. For each file: target-only
greedy tok/s and prompt lookup's tok/s on the core prompts (32 new tokens, after a warm-up), and
perplexity on the same tokens and windows as benchmarks/precision_search.py, against transformers
float32 (the same weights).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import sysconfig
import time
from pathlib import Path

from specdec import Generator
from specdec.bench.perplexity import read_tokens, score
from specdec.bench.prompts import load_prompts
from specdec.config import RuntimeConfig
from specdec.models import load_model
from specdec.models.llamacpp import LlamaCppBackend, require_llama_cpp
from specdec.models.registry import ALIASES

PPL_FILES = ("LICENSE.txt", "functools.py")
TYPES = ("F16", "Q8_0", "Q5_K_M", "Q4_K_M", "Q4_0")


def quantize(source: Path, out: Path, kind: str) -> Path:
    if out.exists():
        return out
    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed with status {status}")
    return out


def llamacpp_nll(gguf: Path, tokens: list[int], window: int = 512) -> float:
    return score(LlamaCppBackend(str(gguf)), tokens, window, lambda *a: None, gguf.name)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("types", nargs="*", default=TYPES)
    parser.add_argument("--work", required=True, help="folder for the quantized files")
    parser.add_argument("--prompts", default="core")
    parser.add_argument("--out")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    bundled = ALIASES["gemma-3-270m"].locate_gguf()
    f16 = quantize(bundled, work / "gemma-3-270m-F16.gguf", "F16")
    files = {"Q4_K_M (bundled)": bundled} | {
        t: f16 if t == "F16" else quantize(f16, work / f"gemma-3-270m-{t}.gguf", t) for t in args.types
    }
    reference = load_model("gemma-3-270m")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = {name: read_tokens(reference.tokenizer, str(stdlib / name), 4096) for name in PPL_FILES}
    float32 = {name: math.exp(score(reference.model, ids, 512, lambda *a: None, "")) for name, ids in texts.items()}
    del reference
    prompts = [p.prompt for p in load_prompts(args.prompts)]
    rows = []
    for kind, path in files.items():
        runtime = RuntimeConfig(backend="llama.cpp")
        speeds = {}
        for drafter in ("none", "prompt-lookup"):
            generator = Generator(str(path), drafter, runtime=runtime)
            generator.generate(prompts[0], max_new_tokens=8)  # warm-up
            started, produced = time.perf_counter(), 0
            for prompt in prompts:
                produced += generator.generate(
                    prompt, max_new_tokens=32, k=8, k_policy="cost-model", stop_on_eos=False
                ).stats.new_tokens
            speeds[drafter] = produced / (time.perf_counter() - started)
            del generator
        ppl = {
            name: {"float32": float32[name], "type": math.exp(llamacpp_nll(path, ids))} for name, ids in texts.items()
        }
        rows.append({"type": kind, "file_mb": path.stat().st_size / 2**20, "tokens_per_s": speeds, "perplexity": ppl})
        deltas = ", ".join(f"{n} {v['type']:.3f} ({v['type'] - v['float32']:+.3f})" for n, v in ppl.items())
        print(
            f"{kind:18s} {rows[-1]['file_mb']:6.0f} MB  none {speeds['none']:6.1f} tok/s  "
            f"prompt lookup {speeds['prompt-lookup']:6.1f} tok/s  ppl {deltas}",
            flush=True,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
