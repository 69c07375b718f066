"""Speed-up against model size: random-weight models in the shapes of real Llama-family models, on each backend.

Usage: python benchmarks/model_sizes.py --work DIR --out FILE [--sizes 0.5b,1b,3b,8b]
       [--backends llama.cpp,native-int8,native-int4,transformers] [--acceptance 0.5,0.7,0.9] [--prompts 2]
       [--tokens 32] [--device cpu|cuda] [--llama-bench PATH]

Why random weights: no real model of these sizes is available offline, and the timing of a forward does not depend
on what the weights say. Each size is built once under --work: a transformers folder (bfloat16, the SmolLM2 tokenizer,
sizes up to --hf-max-params) and a GGUF file written from the same weights (F16) and quantized to Q4_K_M by llama.cpp's
own quantizer (llama_model_quantize). For each size and backend the script measures:

- the cost curve of one target forward over n tokens (n = 1..17, after 64 cached tokens);
- target-only greedy decoding through specdec's engine (the reference output and the baseline);
- the engine with an oracle drafter that proposes the reference continuation, each token right with probability a
  (a = 0.5, 0.7, 0.9): acceptance is controlled, every timing is real; k is the formula's best k on the curve;
- llama-cpp-python's own greedy generation on the GGUF file (the baseline users run today);
- the formula's prediction, E(a, k) / (cost(k + 1) / cost(1)) with E = (1 - a^(k+1)) / (1 - a), next to the measurement;
- peak memory above the loaded model while decoding, target-only and speculative;
- for native: the weight bytes one token reads, hence GB/s against this machine's measured read bandwidth, and in
  child processes the peak RSS of converting the checkpoint (first start) and of a start from the cache, against the
  packed model's bytes; for llama.cpp the GGUF's bytes the same way, and (--llama-bench) llama.cpp's own C++
  `llama-bench` on the same file, part for part: the prompt and the generation together (pg, the engine's measure),
  the generation alone (tg, against the engine's tokens after the first) and the prompt alone (pp, against the
  engine's first forward).

What is assumed: the acceptance a. A real drafter's acceptance on a real model of that size is not measured here.
On a GPU (--device cuda) only the transformers backend runs (llama.cpp here is a CPU build; native is CPU-only).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from specdec import Generator
from specdec.bench.memory import PeakMemory, current_bytes
from specdec.bench.methods import LlamaCppMethod, OracleDrafter
from specdec.bench.report import pyplot
from specdec.config import PRESETS, GenerationConfig, RuntimeConfig
from specdec.engine.costs import forward_cost_curve
from specdec.machine import fingerprint
from specdec.models import load_model, open_target
from specdec.models.registry import ALIASES
from specdec.scheduling import CostCurve, CostModelK, expected_tokens

# Shapes of real Llama-family models (vocabulary, width, layers, heads, KV heads, FFN width, tied output head).
SHAPES: dict[str, dict] = {
    "0.5b": dict(
        vocab_size=151936,
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        tie_word_embeddings=True,
        rope_theta=1000000.0,
        like="Qwen2.5-0.5B (without biases)",
    ),
    "1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        like="Llama-3.2-1B",
    ),
    "3b": dict(
        vocab_size=128256,
        hidden_size=3072,
        num_hidden_layers=28,
        num_attention_heads=24,
        num_key_value_heads=8,
        intermediate_size=8192,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        like="Llama-3.2-3B",
    ),
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        like="Llama-3.1-8B",
        embed_std=4.0,
    ),
    "7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        intermediate_size=11008,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        like="Llama-2-7B",
        embed_std=4.0,
    ),
}
# A Llama-architecture GGUF whose BPE tokenizer the files borrow (padded).
TOKENIZER_GGUF = ALIASES["smollm2-135m-instruct"]
CURVE_SIZES = (1, 2, 3, 5, 9, 13, 17)
MAX_K = 16


def parameters(shape: dict) -> int:
    h, f, layers, v = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"], shape["vocab_size"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = h * (2 * h + 2 * kv) + 3 * h * f + 2 * h
    return v * h * (1 if shape["tie_word_embeddings"] else 2) + layers * per_layer + h


def random_model(shape: dict, seed: int = 0) -> torch.nn.Module:
    """A LlamaForCausalLM of this shape in bfloat16 with N(0, 0.02) weights, unit norms and N(0, 1) embeddings
    (built on the meta device).

    Why the large embeddings: with every weight at 0.02 the logits of a random model are nearly flat, so near-ties are
    everywhere and a runtime whose many-token forward rounds differently from its one-token forward (llama.cpp at its
    default micro-batch) flips the greedy token at most positions: the oracle's reference would then be rejected for
    reasons that have nothing to do with its accuracy. Embeddings 50x larger dominate the residual stream, the output
    head (the same matrix, or a copy of it when untied) gives the current token a wide margin, and greedy decoding
    becomes robust to rounding; every forward still computes every layer at full size, so the timings are unchanged. The
    7B shape (32 layers, no grouped-query attention) needs 4x that: its layers' sum outgrows a unit embedding, and at
    1.0 its greedy tokens flipped under llama.cpp's rounding (accepted drafts per step fell to 0.3 at a = 0.9).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = {k: v for k, v in shape.items() if k not in ("like", "embed_std")}
    config = LlamaConfig(**fields, max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            else:
                tensor.normal_(
                    0.0,
                    shape.get("embed_std", 1.0) if name.endswith("embed_tokens.weight") else 0.02,
                    generator=generator,
                )
        if not shape["tie_word_embeddings"]:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    model.model.rotary_emb.to_empty(device="cpu")
    model.model.rotary_emb.__init__(config)  # its inverse frequencies are a buffer, not a weight
    if shape["tie_word_embeddings"]:
        model.tie_weights()
    return model.eval()


def write_gguf(model: torch.nn.Module, shape: dict, path: Path) -> None:
    """The model as an F16 GGUF file for llama.cpp's llama architecture, tensors streamed one at a time."""
    import gguf

    reader = gguf.GGUFReader(str(TOKENIZER_GGUF.locate_gguf()))
    vocab = shape["vocab_size"]
    # Cut to a smaller vocabulary, padded to a larger one.
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()[:vocab]
    types = reader.fields["tokenizer.ggml.token_type"].contents()[:vocab]
    padding = vocab - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(padding)]
    types += [gguf.TokenType.UNUSED] * padding
    kept = set(tokens)
    merges = [
        m for m in reader.fields["tokenizer.ggml.merges"].contents() if set(m.split(" ")) | {m.replace(" ", "")} <= kept
    ]
    h, heads, kv_heads = shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"random {shape['like']} shape")
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_block_count(shape["num_hidden_layers"])
    writer.add_feed_forward_length(shape["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(shape["rope_theta"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(h // heads)
    writer.add_vocab_size(shape["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)

    # Rotary halves (transformers) to interleaved pairs (llama.cpp).
    def permute(w: torch.Tensor, n: int) -> torch.Tensor:
        return w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    tensors: list[tuple[str, torch.Tensor]] = [("token_embd.weight", model.model.embed_tokens.weight)]
    for i, layer in enumerate(model.model.layers):
        for source, target in names.items():
            w = layer.get_submodule(source).weight
            w = permute(w, heads) if target == "attn_q" else permute(w, kv_heads) if target == "attn_k" else w
            tensors.append((f"blk.{i}.{target}.weight", w))
    tensors.append(("output_norm.weight", model.model.norm.weight))
    if not shape["tie_word_embeddings"]:
        tensors.append(("output.weight", model.lm_head.weight))
    for name, w in tensors:
        dtype = np.float32 if w.dim() == 1 else np.float16  # llama.cpp keeps norms in float32
        writer.add_tensor_info(name, tuple(w.shape), np.dtype(dtype), w.numel() * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, w in tensors:
        writer.write_tensor_data(w.detach().float().numpy().astype(np.float32 if w.dim() == 1 else np.float16))
    writer.close()


def quantize(source: Path, out: Path, kind: str = "Q4_K_M") -> None:
    from specdec.models.llamacpp import require_llama_cpp

    llama_cpp = require_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind}")
    partial = out.with_suffix(".partial")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama_model_quantize to {kind} failed for {source}")
    partial.replace(out)


def build(size: str, work: Path, hf_max_params: float) -> dict[str, Path | None]:
    """The size's transformers folder (if small enough) and Q4_K_M GGUF file under ``work``, built if missing."""
    shape = SHAPES[size]
    folder, gguf_file = work / f"llama-{size}", work / f"llama-{size}-Q4_K_M.gguf"
    wants_hf = parameters(shape) <= hf_max_params
    if gguf_file.exists() and (folder.exists() or not wants_hf):
        return {"hf": folder if wants_hf else None, "gguf": gguf_file}
    start = time.perf_counter()
    model = random_model(shape)
    if wants_hf and not folder.exists():
        partial = folder.with_suffix(".partial")
        model.save_pretrained(partial)
        load_model("smollm2-135m-instruct").tokenizer.save_pretrained(partial)
        partial.replace(folder)
    if not gguf_file.exists():
        f16 = work / f"llama-{size}-F16.gguf"
        write_gguf(model, shape, f16)
        del model
        gc.collect()
        quantize(f16, gguf_file)
        f16.unlink()
    print(f"built {size} in {time.perf_counter() - start:.0f} s", flush=True)
    return {"hf": folder if wants_hf else None, "gguf": gguf_file}


def best_k(curve: CostCurve, a: float) -> tuple[int, float]:
    """The k the formula prefers on this curve at acceptance a (at least 1; the oracle drafts for free), and its
    predicted speed-up.

    The formula is the cost-model policy's: expected tokens (1 - a^(k+1)) / (1 - a) over a forward of k + 1 tokens.
    """
    formula = CostModelK(MAX_K, curve, draft_s_per_token=0.0)
    k = max(range(1, MAX_K + 1), key=lambda k: formula.expected_rate(k, a))
    return k, formula.expected_rate(k, a) / formula.expected_rate(0, a)


def decode(
    generator: Generator, prompts: list[list[int]], oracle: OracleDrafter | None, references: list[list[int]]
) -> dict:
    """Generate every prompt once (after a short warm-up); tokens/s over all of them, output and peak memory."""
    if oracle is not None:
        oracle.reference = prompts[0] + references[0]
    generator.generate(prompts[0], max_new_tokens=4)
    tokens, seconds, outputs, accepted, steps = 0, 0.0, [], 0, 0
    first_s, prompt_tokens = 0.0, 0
    idle = current_bytes()
    with PeakMemory() as peak:
        for prompt, reference in zip(prompts, references, strict=True):
            if oracle is not None:
                oracle.reference = prompt + reference
            result = generator.generate(prompt)
            tokens += len(result.token_ids)
            seconds += result.stats.wall_s
            first_s += result.stats.ttft_s
            prompt_tokens += len(prompt)
            outputs.append(result.token_ids)
            accepted += result.stats.draft_tokens_accepted
            steps += result.stats.steps
    return {"tokens_per_s": tokens / seconds, "outputs": outputs, "peak_increase_mb": (peak.peak - idle) / 2**20,
            "accepted_per_step": accepted / steps,
            # llama-bench's tg and pp measure these two apart: the tokens after the first, and the prompt's forward
            "decode_tokens_per_s": (tokens - len(prompts)) / (seconds - first_s),
            "prefill_tokens_per_s": prompt_tokens / first_s}  # fmt: skip


def run_backend(
    size: str, backend: str, files: dict, args: argparse.Namespace, prompts: list[list[int]]
) -> dict | None:
    extra: dict = {}
    if backend == "llama.cpp":
        source, runtime = str(files["gguf"]), RuntimeConfig(backend="llama.cpp")
    elif backend.startswith("native-"):
        if files["hf"] is None:
            return None
        source, runtime = str(files["hf"]), RuntimeConfig(backend="native", native_format=backend.split("-")[1])
        extra["first_start"] = child_peak(child_code(source, "native", runtime.native_format))
        extra["cached_start"] = child_peak(child_code(source, "native", runtime.native_format))
    elif files["hf"] is None or (
        backend == "transformers" and args.device == "cpu" and parameters(SHAPES[size]) > args.transformers_max_params
    ):
        return None  # no transformers folder at this size, or transformers on this CPU takes seconds per forward
    else:
        runtime = RuntimeConfig(
            backend=backend, precision=PRESETS["cpu"] if backend == "transformers" and args.device == "cpu" else None
        )
        source = str(files["hf"])
    if backend != "transformers":
        extra["generating"] = child_peak(child_code(source, runtime.backend, runtime.native_format, generate=True))
    start = time.perf_counter()
    if backend == "transformers" and args.device == "cuda":
        target = open_target(load_model(source, dtype="bfloat16", device="cuda"), runtime)
    else:
        target = open_target(source, runtime)
    loaded = current_bytes()
    load_s = time.perf_counter() - start
    curve = CostCurve(forward_cost_curve(target.backend, CURVE_SIZES, repeats=3))
    config = GenerationConfig(k=1, k_policy="fixed", max_new_tokens=args.tokens, stop_on_eos=False)
    base = decode(Generator(target, "none", config), prompts, None, [[] for _ in prompts])
    references = base["outputs"]
    if backend.startswith("native-"):
        model = target.backend.model
        weights = sum(
            getattr(layer, part).nbytes for layer in model.layers for part in ("qkv", "out", "gate_up", "down")
        )
        extra["bytes_per_token"] = weights + model.head.nbytes
        extra["model_bytes"] = extra["bytes_per_token"] + model.embedding.numel() * model.embedding.element_size()
    elif backend == "llama.cpp":
        # Every tensor once (embedding: one row).
        extra["bytes_per_token"] = extra["model_bytes"] = files["gguf"].stat().st_size
    row: dict = extra | {
        "load_s": load_s,
        "loaded_mb": loaded / 2**20,
        "cost_ms": {n: 1000 * s for n, s in curve.seconds.items()},
        "target_only_tokens_per_s": base["tokens_per_s"],
        "target_only_decode_tokens_per_s": base["decode_tokens_per_s"],
        "prefill_tokens_per_s": base["prefill_tokens_per_s"],
        "target_only_peak_increase_mb": base["peak_increase_mb"],
        "oracle": {},
    }
    for a in args.acceptance:
        k, predicted = best_k(curve, a)
        oracle = OracleDrafter(a, seed=0)
        spec = decode(Generator(target, oracle, replace(config, k=k)), prompts, oracle, references)
        row["oracle"][str(a)] = {
            "k": k,
            "tokens_per_s": spec["tokens_per_s"],
            "speedup": spec["tokens_per_s"] / base["tokens_per_s"],
            "predicted_speedup": predicted,
            "accepted_per_step": spec["accepted_per_step"],
            "expected_accepted_per_step": expected_tokens(a, k) - 1,
            "identical": spec["outputs"] == references,
            "peak_increase_mb": spec["peak_increase_mb"],
        }
        print(f"{size} {backend} a={a} k={k}: {row['oracle'][str(a)]['speedup']:.2f}x "
              f"(predicted {row['oracle'][str(a)]['predicted_speedup']:.2f}x)", flush=True)  # fmt: skip
    del target
    gc.collect()
    return row


CHILD = (  # VmHWM: this process's peak RSS (ru_maxrss would keep the parent's from before exec)
    "import re, time; t = time.time(); from specdec import Generator; from specdec.models import open_target; "
    "from specdec.config import RuntimeConfig; "
    "hwm = lambda: int(re.search(r'VmHWM:\\s+(\\d+)', open('/proc/self/status').read())[1]); "
    "base = hwm(); target = open_target({source!r}, RuntimeConfig(backend={backend!r}, native_format={format!r})); "
    "{generate}print(base, hwm(), time.time() - t)"
)
GENERATE = "Generator(target, 'none').generate(list(range(3, 67)), max_new_tokens=32); "


def child_code(source: str, backend: str, format: str = "auto", generate: bool = False) -> str:
    return CHILD.format(source=source, backend=backend, format=format, generate=GENERATE if generate else "")


def child_peak(code: str) -> dict:
    """Peak RSS (MiB) of a fresh Python running ``code`` (which prints its RSS after imports, its peak and seconds)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, peak, seconds = done.stdout.split()[-3:]
    return {"rss_after_imports_mb": int(base) / 1024, "peak_rss_mb": int(peak) / 1024, "seconds": float(seconds)}


def llama_bench(binary: Path, gguf_file: Path, prompt: int, tokens: int) -> dict[str, float]:
    """llama.cpp's own C++ benchmark on this machine's cores: generation alone (tg: -n tokens after an empty
    context), the prompt alone (pp: -p prompt) and both as the engine runs them (pg: -pg prompt,tokens), each as
    tokens per second of that part (pg: new tokens over the whole time, the engine's own measure)."""
    import os
    import subprocess

    command = [str(binary), "-m", str(gguf_file), "-p", str(prompt), "-n", str(tokens), "-pg", f"{prompt},{tokens}"]
    command += ["-t", str(os.cpu_count()), "-o", "json"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    rates = {}
    for record in json.loads(done.stdout):
        part = "pg" if record["n_prompt"] and record["n_gen"] else "pp" if record["n_prompt"] else "tg"
        counted = record["n_gen"] if part != "pp" else record["n_prompt"]
        rates[part] = counted / (float(record["avg_ns"]) / 1e9)
    return rates


def llamacpp_greedy(gguf_file: Path, prompts: list[list[int]], tokens: int) -> float:
    """llama-cpp-python's own greedy generation: tokens per second over the prompts (after one warm-up)."""
    method = LlamaCppMethod(
        "llamacpp-greedy", str(gguf_file), GenerationConfig(max_new_tokens=tokens), RuntimeConfig(backend="llama.cpp")
    )
    method.run(prompts[0], None)
    records = [method.run(p, None) for p in prompts]
    return sum(len(r.token_ids) for r in records) / sum(r.wall_s for r in records)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--work", type=Path, required=True, help="where the random-weight models are built (kept for reruns)"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default="0.5b,1b,3b,8b")
    parser.add_argument("--backends", default="llama.cpp,native-int8,native-int4,transformers")
    parser.add_argument("--acceptance", default="0.5,0.7,0.9", type=lambda s: [float(x) for x in s.split(",")])
    parser.add_argument("--prompts", type=int, default=2, help="prompts of 64 random tokens")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument(
        "--hf-max-params", type=float, default=4e9, help="largest model also written as a transformers folder"
    )
    parser.add_argument(
        "--transformers-max-params",
        type=float,
        default=2e9,
        help="largest model run on the transformers backend on a CPU",
    )
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument(
        "--build-only", action="store_true", help="build the sizes' files and stop (a run then starts lean)"
    )
    parser.add_argument("--llama-bench", type=Path, help="llama.cpp's llama-bench binary (built from vendor/llama.cpp)")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    backends = ["transformers"] if args.device == "cuda" else args.backends.split(",")
    generator = torch.Generator().manual_seed(0)
    smallest = min(SHAPES[size]["vocab_size"] for size in args.sizes.split(","))
    prompts = [torch.randint(3, smallest, (64,), generator=generator).tolist() for _ in range(args.prompts)]
    results: dict = {
        "machine": fingerprint() | {"torch_threads": torch.get_num_threads(), "device": args.device},
        "sizes": {},
    }
    if args.out.exists():
        results = json.loads(args.out.read_text())  # a rerun adds to what an earlier one measured
    if "read_GBps" not in results["machine"]:
        from where_time_goes import bandwidth

        results["machine"] |= bandwidth()
    if args.build_only:
        for size in args.sizes.split(","):
            build(size, args.work, args.hf_max_params)
        return
    for size in args.sizes.split(","):
        files = build(size, args.work, args.hf_max_params)
        entry = results["sizes"].setdefault(
            size, {"parameters": parameters(SHAPES[size]), "like": SHAPES[size]["like"], "backends": {}}
        )
        if args.device == "cpu" and "llamacpp_greedy_tokens_per_s" not in entry:
            entry["llamacpp_greedy_tokens_per_s"] = llamacpp_greedy(files["gguf"], prompts, args.tokens)
            entry["gguf_mb"] = files["gguf"].stat().st_size / 2**20
        if args.llama_bench and "llama_bench" not in entry:
            entry["llama_bench"] = llama_bench(args.llama_bench, files["gguf"], len(prompts[0]), args.tokens)
            entry["llama_bench_tokens_per_s"] = entry["llama_bench"]["tg"]
        for backend in backends:
            if backend in entry["backends"]:
                continue
            row = run_backend(size, backend, files, args, prompts)
            if row is not None:
                entry["backends"][backend] = row
            args.out.write_text(json.dumps(results, indent=1))
    args.out.write_text(json.dumps(results, indent=1))
    plot(results, args.out.with_suffix(".png"))
    print(table(results))
    print()
    print(weights_table(results))


def plot(results: dict, path: Path) -> None:
    """Speed-up over each backend's own target-only against parameters, measured (solid) and predicted (dashed), per
    acceptance; and tokens/s of the best speculative backend against llama.cpp greedy."""
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    sizes = list(results["sizes"].items())
    backends = sorted({b for _, e in sizes for b in e["backends"]})
    for a in _accs(results):
        for backend in backends:
            points = [
                (e["parameters"] / 1e9, e["backends"][backend]["oracle"][a])
                for _, e in sizes
                if a in e["backends"].get(backend, {}).get("oracle", {})
            ]
            if points:
                line = left.plot(
                    [x for x, _ in points], [o["speedup"] for _, o in points], marker="o", label=f"{backend}, a={a}"
                )
                left.plot(
                    [x for x, _ in points],
                    [o["predicted_speedup"] for _, o in points],
                    linestyle="--",
                    color=line[0].get_color(),
                )
            rates = [
                (e["parameters"] / 1e9, e["backends"][backend]["oracle"][a]["tokens_per_s"])
                for _, e in sizes
                if backend in e["backends"]
            ]
            if rates and a == _accs(results)[-1]:
                right.plot([x for x, _ in rates], [r for _, r in rates], marker="o", label=f"{backend} + oracle a={a}")
    peers = [
        (e["parameters"] / 1e9, e["llamacpp_greedy_tokens_per_s"])
        for _, e in sizes
        if e.get("llamacpp_greedy_tokens_per_s")
    ]
    if peers:
        right.plot(
            [x for x, _ in peers], [r for _, r in peers], marker="s", color="black", label="llama-cpp-python greedy"
        )
    left.axhline(1.0, color="grey", linewidth=0.5)
    left.set(
        xscale="log",
        xlabel="parameters (billions)",
        ylabel="speed-up over own target-only",
        title="measured (solid), formula (dashed)",
    )
    right.set(
        xscale="log", yscale="log", xlabel="parameters (billions)", ylabel="tokens/s", title="against llama.cpp greedy"
    )
    left.legend(fontsize=6)
    right.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(results: dict) -> str:
    """Markdown: per size and backend, measured speed-up (formula's prediction) at each acceptance, and against
    llama.cpp greedy."""
    lines = [
        "| size | backend | target-only tok/s | "
        + " | ".join(f"a={a}: x own / (predicted) / x llama.cpp greedy" for a in _accs(results))
        + " |"
    ]
    lines.append("|" + "---|" * (3 + len(_accs(results))))
    for size, entry in results["sizes"].items():
        peer = entry.get("llamacpp_greedy_tokens_per_s")
        lines.append(
            f"| {size} | llama.cpp greedy (llama-cpp-python) | {peer:.1f} |" + " |" * len(_accs(results))
            if peer
            else ""
        )
        for backend, row in entry["backends"].items():
            cells = []
            for a in _accs(results):
                o = row["oracle"].get(a)
                if o is None:
                    cells.append("-")
                    continue
                vs_peer = f"{o['tokens_per_s'] / peer:.2f}x" if peer else "-"
                cells.append(f"{o['speedup']:.2f}x ({o['predicted_speedup']:.2f}x) / {vs_peer}")
            lines.append(f"| {size} | {backend} | {row['target_only_tokens_per_s']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(line for line in lines if line)


def weights_table(results: dict) -> str:
    """Markdown: per size and runtime, target-only speed against llama-cpp-python and, part for part, against
    llama-bench (prompt and generation together against its pg, generation alone against tg, the prompt against pp);
    bytes per token and the bandwidth they imply at the decoding rate, against the machine's; and peak memory
    (converting, starting from the cache, generating)."""
    read = results["machine"].get("read_GBps")
    lines = [
        "| size | runtime | target-only tok/s (x llama-bench pg) | x llama-cpp-python greedy | decoding tok/s (x tg) "
        f"| prefill tok/s (x pp) | MB read per token | GB/s decoding (of {read:.0f} measured) "
        "| peak RSS converting / model MB | start from cache | peak RSS generating |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def versus(rate: float | None, peer: float | None) -> str:
        if rate is None:
            return "-"
        return f"{rate:.1f} ({rate / peer:.2f}x)" if peer else f"{rate:.1f}"

    for size, entry in results["sizes"].items():
        greedy, bench = entry.get("llamacpp_greedy_tokens_per_s"), entry.get("llama_bench", {})
        if bench:
            lines.append(
                f"| {size} | llama-bench (C++) | {bench['pg']:.1f} | | {bench['tg']:.1f} | {bench['pp']:.1f} |"
                + " |" * 5
            )
        for backend, row in entry["backends"].items():
            rate, decoding = row["target_only_tokens_per_s"], row.get("target_only_decode_tokens_per_s")
            per_token = row.get("bytes_per_token")
            first, cached, gen = row.get("first_start"), row.get("cached_start"), row.get("generating")
            cells = [
                versus(rate, bench.get("pg")),
                f"{rate / greedy:.2f}x" if greedy else "-",
                versus(decoding, bench.get("tg")),
                versus(row.get("prefill_tokens_per_s"), bench.get("pp")),
                f"{per_token / 1e6:.0f}" if per_token else "-",
                f"{per_token * (decoding or rate) / 1e9:.1f}" if per_token else "-",
                f"{first['peak_rss_mb'] - first['rss_after_imports_mb']:.0f} / {row['model_bytes'] / 2**20:.0f}"
                if first
                else "-",
                f"{cached['seconds']:.1f} s" if cached else "-",
                f"{gen['peak_rss_mb']:.0f} MB" if gen else "-",
            ]
            lines.append(f"| {size} | {backend} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _accs(results: dict) -> list[str]:
    return sorted(
        {a for e in results["sizes"].values() for row in e["backends"].values() for a in row["oracle"]}, key=float
    )


if __name__ == "__main__":
    main()
