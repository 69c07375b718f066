"""Write BENCHMARKS.md, the page of current results, from the result files in benchmarks/results/.

What: every result folder (`specdec bench`, `bench-batch`, `bench-serve`, `quality`, `tune`) and every JSON file a
script under benchmarks/ wrote is read; for each measured thing (a method on a prompt set at a temperature, a precision
plan, a server deployment, a model size, ...) the latest result per runtime and machine is kept, and the page gets one
section per runtime with tables giving each figure's date, machine and the command that produced it.

Why: the figures on the page then come only from files under benchmarks/results/ (headlines.json holds the few the
journal states without a results file), so the page is regenerated rather than edited, and
tests/test_current_results.py checks that it matches the data. How the figures came about is the chronological
journal, benchmarks/journal/notebook.md.

Usage: python benchmarks/current_results.py [--results DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from pathlib import Path
from string import Template
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# The command that produced each result, as the journal gives it (its shell variables written out), in the journal's
# order, which breaks ties between results of the same date: a result's name, then its command on indented lines ("-"
# where neither the journal nor the file records it; `--out benchmarks/results/NAME` is added for folders). Result files
# do not record their command (ray_autoscaling.py records the server it started, not itself).
COMMANDS_TEXT = """
2026-11-29-cpu-core-float32
  specdec bench --prompts benchmarks/prompts/core.jsonl --methods none,prompt-lookup,hf-greedy,hf-prompt-lookup
  --k 2,4,8 --max-new-tokens 48 --dtype float32
2026-11-29-cpu-core-bfloat16
  specdec bench --prompts benchmarks/prompts/core.jsonl --methods none,prompt-lookup,hf-greedy,hf-prompt-lookup
  --k 2,4,8 --max-new-tokens 48 --dtype bfloat16
2026-11-29-cpu
  specdec bench --prompts benchmarks/prompts/default.jsonl
  --methods none,prompt-lookup,oracle,hf-greedy,hf-prompt-lookup,llamacpp-greedy,llamacpp-prompt-lookup
  --k 4 --max-new-tokens 32 --dtype float32
2026-11-29-cpu-hf-assisted
  specdec bench --prompts benchmarks/prompts/core.jsonl --methods none,hf-greedy,hf-assisted:smollm2-135m-instruct
  --k 4 --max-new-tokens 24
2026-11-29-cpu-llamacpp
  specdec bench --prompts benchmarks/prompts/default.jsonl --backend llama.cpp --threads 2
  --methods none,prompt-lookup,oracle,llamacpp-greedy,llamacpp-prompt-lookup --k 2,4,8 --max-new-tokens 64
2026-11-29-cpu-llamacpp-kpolicy
  specdec bench --prompts benchmarks/prompts/default.jsonl --backend llama.cpp --threads 2
  --methods none,prompt-lookup,oracle,llamacpp-greedy --k 2,8 --k-policy fixed,cost-model --max-new-tokens 64
2026-11-29-cpu-drafters-bfloat16
  specdec bench --prompts benchmarks/prompts/default.jsonl --dtype bfloat16
  --methods none,prompt-lookup,$N,model:smollm2-135m-instruct,$D,default,hf-greedy,hf-prompt-lookup,
  hf-assisted:smollm2-135m-instruct
  --k 4 --max-new-tokens 32
2026-11-29-cpu-drafters-bfloat16-t0.7
  -
2026-11-29-cpu-layerskip-bfloat16
  specdec bench --prompts benchmarks/prompts/core.jsonl --dtype bfloat16
  --methods none,layerskip:6,layerskip:9,layerskip:12,layerskip:15 --k 2 --max-new-tokens 32
2026-11-30-cpu-distilled-bfloat16
  specdec bench --prompts benchmarks/prompts/default.jsonl --dtype bfloat16
  --methods none,prompt-lookup,$N,$D,default,hf-prompt-lookup --k 8 --k-policy cost-model --max-new-tokens 32
2026-11-30-cpu-distilled-bfloat16-t0.7
  specdec bench --prompts benchmarks/prompts/default.jsonl --dtype bfloat16
  --methods none,prompt-lookup,$N,$D,default,hf-prompt-lookup --k 8 --k-policy cost-model --max-new-tokens 32
  --temperature 0.7
2026-11-30-cpu-distilled-vs-layerskip-crosstok
  specdec bench --prompts benchmarks/prompts/default.jsonl --dtype bfloat16
  --methods none,default,layerskip:12,model:smollm2-135m-instruct --k 8 --k-policy cost-model --max-new-tokens 32
2026-11-30-cpu-layerskip-t0.7
  specdec bench --prompts benchmarks/prompts/default.jsonl --dtype bfloat16
  --methods none,layerskip:12 --k 8 --k-policy cost-model --max-new-tokens 32 --temperature 0.7
2026-11-29-cpu-kpolicies-llamacpp-default
  specdec bench --prompts benchmarks/prompts/default.jsonl --backend llama.cpp --threads 2
  --methods none,prompt-lookup,$N,llamacpp-greedy --k 2,4,8
  --k-policy fixed,heuristic,perplexity,confidence,cost-model --max-new-tokens 48
2026-11-29-cpu-kpolicies-llamacpp-mixed
  specdec bench --prompts benchmarks/prompts/mixed.jsonl --backend llama.cpp --threads 2
  --methods none,prompt-lookup,$N,llamacpp-greedy --k 2,4,8
  --k-policy fixed,heuristic,perplexity,confidence,cost-model --max-new-tokens 48
2026-11-30-cpu-precision-search.json
  python benchmarks/precision_search.py --out ${J}2026-11-30-cpu-precision-search.json
  fp32 bf16 attention=bfloat16,ffn=int8,head=bfloat16 attention=bfloat16,ffn=int8,head=int8 seed
2026-11-30-cpu-precision-cpu
  $PRESET --precision cpu --methods none,prompt-lookup,$N,hf-greedy,hf-prompt-lookup,llamacpp-greedy
2026-11-30-cpu-precision-bf16
  $PRESET --precision bf16 --methods none,prompt-lookup,$N,hf-greedy,hf-prompt-lookup
2026-11-30-cpu-precision-seed
  $PRESET --precision seed --methods none,prompt-lookup,$N,hf-greedy,hf-prompt-lookup
2026-11-30-cpu-precision-seed-speed
  $PRESET --precision seed --methods none,$N
2026-11-30-cpu-llamacpp-quant-types.json
  python benchmarks/llamacpp_quant_types.py --work /tmp/quant --out ${J}2026-11-30-cpu-llamacpp-quant-types.json
2026-11-30-cpu-batch-prompt-lookup
  specdec bench-batch --precision cpu --draft prompt-lookup --batch-sizes 8,16,32 --k 5 --max-new-tokens 64
2026-12-03-cpu-native-batch
  specdec bench-batch --draft prompt-lookup --batch-sizes 1,8,32 --max-new-tokens 64 --backend native
2026-12-03-cpu-native-serve-1
  specdec bench-serve --draft prompt-lookup --clients 1 --duration 30 --max-tokens 64 --server-args "--max-batch 32"
2026-12-03-cpu-native-serve-8
  specdec bench-serve --draft prompt-lookup --clients 8 --duration 30 --max-tokens 64 --server-args "--max-batch 32"
2026-12-03-cpu-native-serve-32
  specdec bench-serve --draft prompt-lookup --clients 32 --duration 30 --max-tokens 64 --server-args "--max-batch 32"
2026-11-30-cpu-serve-load
  specdec bench-serve --clients 8 --duration 60 --max-tokens 64 --server-args "--precision cpu --max-batch 8"
2026-11-30-cpu-quality
  specdec quality --precision cpu --per-category 3 --max-new-tokens 512
2026-11-30-cpu-quality-typical-anchor
  specdec quality --precision cpu --per-category 3 --max-new-tokens 512 --configs "sampled+typical+anchor (lossy)"
2026-11-30-cpu-serve-ray-1-replica
  $SERVE "--ray --replicas 1 --cpus-per-replica 2 --precision cpu --max-batch 8"
2026-11-30-cpu-serve-ray-2-replicas
  $SERVE "--ray --replicas 2 --cpus-per-replica 1 --precision cpu --max-batch 8"
2026-11-30-cpu-serve-single-process
  $SERVE "--precision cpu --max-batch 8"
2026-11-30-cpu-serve-ray-ingress-1-replica
  $SERVE "--ray --replicas 1 --cpus-per-replica 2 --precision cpu --max-batch 8"
2026-11-30-cpu-serve-ray-ingress-2-replicas
  $SERVE "--ray --replicas 2 --cpus-per-replica 1 --precision cpu --max-batch 8"
2026-11-30-cpu-serve-single-process-rerun
  $SERVE "--precision cpu --max-batch 8"
2026-11-30-cpu-ray-autoscaling.json
  python benchmarks/ray_autoscaling.py --ray-address HOST:PORT --out ${J}2026-11-30-cpu-ray-autoscaling.json
  -- --target gemma-3-270m --precision cpu --cpus-per-replica 1 --target-ongoing-requests 2 --upscale-delay 5
  --downscale-delay 10
2026-11-30-cpu-long-sliding-window
  specdec bench --prompts benchmarks/prompts/long.jsonl --methods none,prompt-lookup --k 4
  --max-new-tokens 1536 --precision cpu
2026-12-01-cpu-serve-load-keys
  $SERVE "--precision cpu --max-batch 8" --keys
2026-12-01-cpu-serve-load-no-keys
  $SERVE "--precision cpu --max-batch 8" --no-keys
2026-12-01-cpu-where-time-goes.json
  python benchmarks/where_time_goes.py --out ${J}2026-12-01-cpu-where-time-goes.json
2026-12-01-cpu-precision-int8a8.json
  python benchmarks/precision_search.py --out ${J}2026-12-01-cpu-precision-int8a8.json
  fp32 cpu attention=bfloat16,ffn=int8,head=int8a8 attention=bfloat16,ffn=int8a8,head=int8a8
2026-12-01-cpu-head-kernel-probe.json
  -
2026-12-01-cpu-vnni-default
  specdec bench --precision cpu-vnni --methods none,prompt-lookup,llamacpp-greedy,llamacpp-prompt-lookup
  --k 8 --k-policy cost-model --max-new-tokens 64
2026-12-01-cpu-plan-default
  specdec bench --precision cpu --methods none,prompt-lookup --k 8 --k-policy cost-model --max-new-tokens 64
2026-12-01-native-default
  specdec bench --backend native --methods none,prompt-lookup,llamacpp-greedy,llamacpp-prompt-lookup
  --k 8 --k-policy cost-model --max-new-tokens 64
2026-12-01-cpu-vnni-g128
  specdec bench --precision cpu-vnni --methods none,prompt-lookup --k 8 --k-policy cost-model --max-new-tokens 64
2026-12-01-cpu-where-time-goes-native.json
  python benchmarks/where_time_goes.py --runtimes cpu,cpu-vnni,native,llama.cpp
  --out ${J}2026-12-01-cpu-where-time-goes-native.json
2026-12-01-native-perplexity.json
  specdec ppl --backend native --data LICENSE.txt --max-tokens 4096
  (and --data functools.py; cpu-vnni: --precision cpu-vnni), collected by hand
2026-12-01-cpu-lookup-vs-draft
  specdec bench --precision cpu --methods none,prompt-lookup,lookup-then-draft --k 8 --k-policy cost-model
  --max-new-tokens 64
2026-12-01-cpu-trees-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,$D,$D+tree,eagle,eagle+tree,lookup-then-eagle+tree,
  hf-prompt-lookup,hf-assisted:smollm2-135m-instruct
2026-12-01-cpu-trees-t0.7
  $TREES --temperature 0.7 --methods none,prompt-lookup,prompt-lookup+tree,$D,$D+tree,eagle,eagle+tree,hf-prompt-lookup
2026-12-01-cpu-eagle-head-cost.json
  python benchmarks/eagle_head_cost.py --count 12 --out ${J}2026-12-01-cpu-eagle-head-cost.json
2026-12-01-cpu-trees-greedy-native-head
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,$N,$N+tree,model:/tmp/eagle-old,eagle,eagle+tree,
  lookup-then-eagle,lookup-then-eagle+tree,hf-prompt-lookup
2026-12-01-cpu-trees-t0.7-native-head
  $TREES --temperature 0.7 --methods none,prompt-lookup,prompt-lookup+tree,$N,eagle,eagle+tree,lookup-then-eagle,
  lookup-then-eagle+tree,hf-prompt-lookup
2026-12-01-cpu-tune
  specdec tune --budget-s 600
2026-12-01-cpu-sweep-native
  specdec bench --backend native --methods none,prompt-lookup,eagle,lookup-then-eagle --k 2,4,8
  --k-policy fixed,cost-model --max-new-tokens 32
2026-12-01-cpu-sweep-llamacpp
  specdec bench --backend llama.cpp --methods none,prompt-lookup,lookup-then-eagle --k 2,4,8
  --k-policy fixed,cost-model --max-new-tokens 32
2026-12-01-cpu-sweep-cpu-vnni
  specdec bench --precision cpu-vnni --methods none,prompt-lookup,lookup-then-draft,lookup-then-eagle --k 4,8
  --k-policy fixed,cost-model --max-new-tokens 32
2026-12-01-cpu-sweep-profile
  specdec bench --profile ${J}2026-12-01-cpu-tune/profile.json --max-new-tokens 32
2026-12-01-cpu-model-sizes.json
  python benchmarks/model_sizes.py --work /tmp/sizes2 --out ${J}2026-12-01-cpu-model-sizes.json
2026-12-01-fp32-default-drafter-greedy
  specdec bench --methods none,prompt-lookup,auto --k 10 --k-policy cost-model --max-new-tokens 64
2026-12-01-native-default-drafter-greedy
  specdec bench --backend native --methods none,prompt-lookup,lookup-then-eagle --k 10 --k-policy cost-model
  --max-new-tokens 64
2026-12-01-cpu-tree-or-chain-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree,auto
2026-12-01-cpu-auto-t0.7
  $TREES --temperature 0.7 --methods none,prompt-lookup,auto
2026-12-01-cpu-amx-before-identity-fix
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree
  --out ${J}2026-12-01-cpu-tree-per-step-greedy (the folder renamed afterwards)
2026-12-01-cpu-tree-per-step-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-trees-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,$N,$N+tree,$D,$D+tree,eagle,eagle+tree,lookup-then-eagle,
  lookup-then-eagle+tree,hf-prompt-lookup
2026-12-02-cpu-trees-greedy-after-tree-attention
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-trees-t0.7
  $TREES --temperature 0.7 --methods none,prompt-lookup,prompt-lookup+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-trees-priced-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,$N,$N+tree,eagle,eagle+tree,lookup-then-eagle,
  lookup-then-eagle+tree,hf-prompt-lookup
2026-12-02-cpu-lookup-trees-whole-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree,$N,$N+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-lookup-trees-learn-greedy
  $TREES --methods none,prompt-lookup,prompt-lookup+tree
2026-12-02-cpu-sampled-chains-t0.7
  $TREES --temperature 0.7 --methods none,prompt-lookup,prompt-lookup+tree,$N,eagle,eagle+tree,lookup-then-eagle,
  lookup-then-eagle+tree,hf-prompt-lookup
2026-12-02-cpu-eagle-t0.7
  $TREES --temperature 0.7 --methods none,eagle,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-priced-head-t0.7
  $TREES --temperature 0.7 --methods none,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-02-cpu-priced-tree-levels-t0.7
  $TREES --temperature 0.7 --methods none,eagle,eagle+tree,lookup-then-eagle,lookup-then-eagle+tree
2026-12-03-cpu-kernel-builds.json
  python benchmarks/kernel_builds.py --out ${J}2026-12-03-cpu-kernel-builds.json
2026-12-03-cpu-native-formats-perplexity.json
  python benchmarks/native_formats.py --out ${J}2026-12-03-cpu-native-formats-perplexity.json
2026-12-03-cpu-model-sizes.json
  python benchmarks/model_sizes.py --work /tmp/sizes --out ${J}2026-12-03-cpu-model-sizes.json --sizes 0.5b,1b,3b,8b
  --backends llama.cpp,native-int8,native-int4 --hf-max-params 1e10 --llama-bench PATH
2026-12-03-cpu-attention-context.json
  python benchmarks/attention_context.py --out ${J}2026-12-03-cpu-attention-context.json --before SO
  --model /tmp/sizes/llama-1b
2026-12-03-cpu-attention-context-paged.json
  python benchmarks/attention_context.py --out ${J}2026-12-03-cpu-attention-context-paged.json --before SO
  --model /tmp/sizes/llama-1b
2026-12-03-cpu-native-formats-perplexity-paged.json
  python benchmarks/native_formats.py --out ${J}2026-12-03-cpu-native-formats-perplexity-paged.json
2026-12-03-cpu-native-vs-llama-server-64-t0
  specdec bench-serve --draft prompt-lookup --clients 1,8,32 --duration 30 --max-tokens 64 --temperature 0
  --llama-server $LLAMA_SERVER
2026-12-03-cpu-native-vs-llama-server-64-t0.7
  specdec bench-serve --draft prompt-lookup --clients 1,8,32 --duration 20 --max-tokens 64 --temperature 0.7
  --llama-server $LLAMA_SERVER
2026-12-03-cpu-native-vs-llama-server-256-t0
  specdec bench-serve --draft prompt-lookup --clients 1,8,32 --duration 30 --max-tokens 256 --temperature 0
  --llama-server $LLAMA_SERVER
2026-12-03-cpu-native-vs-llama-server-256-t0.7
  specdec bench-serve --draft prompt-lookup --clients 1,8,32 --duration 20 --max-tokens 256 --temperature 0.7
  --llama-server $LLAMA_SERVER
2026-12-03-cpu-native-batch-windows
  specdec bench-batch --draft prompt-lookup --batch-sizes 8,32 --max-new-tokens 64 --backend native
2026-12-03-cpu-suffix-store.json
  python benchmarks/suffix_store.py --out ${J}2026-12-03-cpu-suffix-store.json
2026-12-03-cpu-native-suffix-agentic-t0
  $SUFFIX --prompts agentic --temperature 0
2026-12-03-cpu-native-suffix-default-t0
  $SUFFIX --prompts default --temperature 0
2026-12-03-cpu-native-suffix-agentic-t0.7
  $SUFFIX --prompts agentic --temperature 0.7
2026-12-03-cpu-native-suffix-default-t0.7
  $SUFFIX --prompts default --temperature 0.7
2026-12-03-cpu-native-serve-agentic-suffix
  specdec bench-serve --prompts agentic --draft suffix --clients 1,8 --duration 40 --max-tokens 64
2026-12-03-cpu-native-serve-agentic-prompt-lookup
  specdec bench-serve --prompts agentic --draft prompt-lookup --clients 1,8 --duration 40 --max-tokens 64
2026-12-03-cpu-native-suffix-own-default-t0.7
  $SUFFIX --prompts default --temperature 0.7
2026-12-03-cpu-native-suffix-own-agentic-t0
  $SUFFIX --prompts agentic --temperature 0
2026-12-03-cpu-native-suffix-own-default-t0
  $SUFFIX --prompts default --temperature 0
2026-12-03-cpu-native-suffix-own-agentic-t0.7
  $SUFFIX --prompts agentic --temperature 0.7
2026-12-03-cpu-tune-default
  specdec tune
2026-12-03-cpu-tune-unseen
  specdec tune --prompts benchmarks/prompts/tune-unseen.jsonl
2026-12-03-cpu-tune-agentic
  specdec tune --prompts agentic
2026-12-03-cpu-tune-default-t0.7
  specdec tune --sampling 0.7
2026-12-03-cpu-tune-unseen-300s
  specdec tune --prompts benchmarks/prompts/tune-unseen.jsonl --budget-s 300
2026-12-03-cpu-native-amx-agentic-t0
  $NATIVE --methods none,prompt-lookup,suffix --k 8 --prompts agentic --temperature 0
2026-12-03-cpu-native-amx-default-t0
  $NATIVE --methods none,prompt-lookup,suffix,lookup-then-eagle --k 8 --temperature 0
2026-12-03-cpu-native-amx-default-t0.7
  $NATIVE --methods none,prompt-lookup,suffix,lookup-then-eagle --k 8 --temperature 0.7
2026-12-03-cpu-native-amx-agentic-k16-t0
  $NATIVE --methods none,prompt-lookup,suffix --k 16 --prompts agentic --temperature 0
2026-12-03-cpu-native-amx-agentic-t0.7
  $NATIVE --methods none,prompt-lookup,suffix --k 8 --prompts agentic --temperature 0.7
2026-12-03-cpu-native-amx2-agentic-t0
  $NATIVE --methods none,prompt-lookup,suffix,auto --k 8 --prompts agentic --temperature 0
2026-12-03-cpu-native-amx2-default-t0
  $NATIVE --methods none,prompt-lookup,suffix,lookup-then-eagle,auto --k 8 --temperature 0
2026-12-04-cpu-kernel-steps.json
  python benchmarks/kernel_steps.py --out ${J}2026-12-04-cpu-kernel-steps.json --llama-bench $LLAMA_BENCH
  --llama-bench-avx2 $LLAMA_BENCH_AVX2
2026-12-04-cpu-soak.json
  python benchmarks/soak.py --out ${J}2026-12-04-cpu-soak.json
2026-12-04-cpu-serve-avx2
  SPECDEC_KERNELS=avx2 specdec bench-serve --clients 8 --duration 45 --max-tokens 64
2026-12-05-cpu-serve-avx2-vs-llama-server
  SPECDEC_KERNELS=avx2 specdec bench-serve --clients 8 --duration 30 --max-tokens 64 --temperature 0
  --llama-server $LLAMA_SERVER_AVX2
2026-12-05-cpu-serve-avx2-vs-llama-server-zen4
  SPECDEC_KERNELS=avx2 specdec bench-serve --clients 8 --duration 30 --max-tokens 64 --temperature 0
  --llama-server $LLAMA_SERVER_AVX2
2026-12-05-cpu-model-sizes-avx2.json
  SPECDEC_KERNELS=avx2 python benchmarks/model_sizes.py --work /tmp/sizes --out ${J}2026-12-05-cpu-model-sizes-avx2.json
  --sizes 1b,3b --backends native-int4 --llama-bench $LLAMA_BENCH_AVX2
2026-12-05-cpu-model-sizes-avx2-parts.json
  SPECDEC_KERNELS=avx2 python benchmarks/model_sizes.py --work /tmp/sizes
  --out ${J}2026-12-05-cpu-model-sizes-avx2-parts.json --sizes 1b,3b --backends native-int4
  --llama-bench $LLAMA_BENCH_AVX2 --tokens 64 --acceptance 0.7
2026-12-05-cpu-grammar-mask.json
  python benchmarks/grammar_mask.py --repeats 1 --out ${J}2026-12-05-cpu-grammar-mask.json
2026-12-06-cpu-kernel-steps-zen4.json
  python benchmarks/kernel_steps.py --out ${J}2026-12-06-cpu-kernel-steps-zen4.json --builds avx2,avx512
  --llama-bench $LLAMA_BENCH --llama-bench-avx2 $LLAMA_BENCH_AVX2
2026-12-06-cpu-int4-grids.json
  python benchmarks/int4_grids.py --out ${J}2026-12-06-cpu-int4-grids.json
2026-12-07-cpu-kernel-steps-intel.json
  python benchmarks/kernel_steps.py --out ${J}2026-12-07-cpu-kernel-steps-intel.json --llama-bench $LLAMA_BENCH
  --llama-bench-avx2 $LLAMA_BENCH_AVX2 --llama-bench-avx2-vnni $LLAMA_BENCH_AVX2_VNNI
2026-12-07-cpu-model-sizes-avx2-intel.json
  SPECDEC_KERNELS=avx2 python benchmarks/model_sizes.py --work /tmp/sizes
  --out ${J}2026-12-07-cpu-model-sizes-avx2-intel.json --sizes 1b,3b --backends native-int4
  --llama-bench $LLAMA_BENCH_AVX2 --tokens 64 --acceptance 0.7
2026-12-07-cpu-greedy-head.json
  python benchmarks/greedy_head.py --out ${J}2026-12-07-cpu-greedy-head.json
2026-12-07-cpu-kernel-steps-intel-argmax.json
  python benchmarks/kernel_steps.py --out ${J}2026-12-07-cpu-kernel-steps-intel-argmax.json --llama-bench $LLAMA_BENCH
  --llama-bench-avx2 $LLAMA_BENCH_AVX2 --llama-bench-avx2-vnni $LLAMA_BENCH_AVX2_VNNI
2026-12-07-cpu-native-vs-llama-server-64-t0
  specdec bench-serve --clients 1,8 --duration 30 --max-tokens 64 --temperature 0 --llama-server $LLAMA_SERVER_AVX512
2026-12-07-cpu-grammar-mask.json
  python benchmarks/grammar_mask.py --repeats 1 --out ${J}2026-12-07-cpu-grammar-mask.json
"""
VARIABLES = {
    "J": "benchmarks/results/",
    "LLAMA_SERVER": "vendor/llama.cpp/build/bin/llama-server",
    # cmake -DGGML_NATIVE=OFF, AVX2, FMA, F16C, AVX-VNNI, AVX-512 (VNNI, BF16) ON, AMX OFF (a native build's AMX path
    # crashed in llama-bench here)
    "LLAMA_BENCH": "vendor/llama.cpp/build-avx512/bin/llama-bench",
    # cmake -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF
    "LLAMA_BENCH_AVX2": "vendor/llama.cpp/build-avx2/bin/llama-bench",
    # cmake -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON (no AVX-512)
    "LLAMA_BENCH_AVX2_VNNI": "vendor/llama.cpp/build-avxvnni/bin/llama-bench",
    # the same AVX2 build's server
    "LLAMA_SERVER_AVX2": "vendor/llama.cpp/build-avx2/bin/llama-server",
    # the AVX-512 build's server (LLAMA_BENCH's flags)
    "LLAMA_SERVER_AVX512": "vendor/llama.cpp/build-avx512/bin/llama-server",
    "SUFFIX": "specdec bench --methods none,prompt-lookup,prompt-lookup+tree,suffix,suffix+tree --k 8 "
    "--k-policy cost-model --max-new-tokens 64 --backend native",
    "NATIVE": "specdec bench --k-policy cost-model --max-new-tokens 64 --backend native",
    "N": "ngram:/tmp/gemma-corpus.ngram",
    "D": "model:src/specdec/data/drafts/gemma-3-270m",
    "TREES": "specdec bench --precision cpu --k 10 --k-policy cost-model --max-new-tokens 64",
    "SERVE": "specdec bench-serve --clients 8 --duration 45 --max-tokens 64 --server-args",
    "PRESET": "specdec bench --prompts benchmarks/prompts/default.jsonl --k 8 --k-policy cost-model "
    "--max-new-tokens 32",
}


def parse_commands(text: str) -> dict[str, str | None]:
    """COMMANDS_TEXT as {result name: command}, in its order; a line ending in "," continues without a space."""
    commands: dict[str, str] = {}
    name = ""
    for line in text.strip().splitlines():
        if not line.startswith(" "):
            name = line
            commands[name] = ""
        else:
            part = line.strip()
            commands[name] += part if commands[name].endswith(",") or not commands[name] else " " + part
    return {name: None if c == "-" else Template(c).substitute(VARIABLES) for name, c in commands.items()}


COMMANDS = parse_commands(COMMANDS_TEXT)
J = VARIABLES["J"]

# Where a result file does not record its machine, the journal's section says which it was.
AMD = "AMD EPYC, 2 cores"
JOURNAL_MACHINES = dict.fromkeys(
    [
        "2026-11-30-cpu-llamacpp-quant-types.json",
        "2026-11-30-cpu-precision-search.json",
        "2026-11-30-cpu-ray-autoscaling.json",
        "2026-11-30-cpu-serve-load",
        "2026-11-30-cpu-serve-single-process",
        "2026-11-30-cpu-serve-ray-1-replica",
        "2026-11-30-cpu-serve-ray-2-replicas",
        "2026-11-30-cpu-serve-ray-ingress-1-replica",
        "2026-11-30-cpu-serve-ray-ingress-2-replicas",
        "2026-11-30-cpu-serve-single-process-rerun",
        "2026-12-01-cpu-serve-load-keys",
        "2026-12-01-cpu-serve-load-no-keys",
        "2026-12-01-cpu-where-time-goes.json",
        "2026-12-01-cpu-where-time-goes-native.json",
        "2026-12-01-cpu-precision-int8a8.json",
        "2026-12-01-native-perplexity.json",
        "2026-12-01-cpu-eagle-head-cost.json",
    ],
    AMD,
) | dict.fromkeys(
    ["2026-12-03-cpu-native-serve-1", "2026-12-03-cpu-native-serve-8", "2026-12-03-cpu-native-serve-32"],
    "Intel(R) Xeon(R) Processor, 2 cores",
)
# Results the journal says not to use, and why; listed at the end of the page instead of in the tables.
EXCLUDED = {
    "2026-11-30-cpu-precision-seed": "its speeds are not usable, a test run shared the 2 cores for part of it "
    '(journal, "Precision plans"); its speed-only rerun is 2026-11-30-cpu-precision-seed-speed',
}
# The paged run of native_formats.py named its columns by the then default cache (bfloat16; journal, "The KV cache in
# pages"): its "native int8" is int8 with a bfloat16 cache and its "native int4" has a bfloat16 cache too.
RELABEL = {
    "2026-12-03-cpu-native-formats-perplexity-paged.json": {
        "native int8": "int8, bfloat16 cache",
        "int8, float32 cache": "native int8, float32 cache",
        "native int4": "native int4, bfloat16 cache",
    }
}
# `specdec bench-batch`'s ways under the names results written before k_cap (the batch's cap on k) carry
BATCH_WAYS = {"fixed window": "fixed k_cap", "dynamic window": "dynamic k_cap"}
PLANS = {  # the precision presets of src/specdec/config.py, by their describe() string
    "attention=bfloat16,ffn=bfloat16,head=bfloat16,draft=bfloat16,verify=bfloat16": "bf16",
    "attention=float16,ffn=int8,head=float16,draft=float8,verify=float16": "fp8-draft",
    "attention=bfloat16,ffn=int8,head=bfloat16,draft=bfloat16,verify=float32": "cpu",
    "attention=bfloat16,ffn=int8,head=int8a8,draft=bfloat16,verify=float32": "cpu-vnni",
}
SECTIONS = ("native", "transformers", "llama.cpp", "Across runtimes")


@dataclass(frozen=True, eq=False)
class Result:
    name: str  # the folder's name, or the file's with its .json
    data: Any
    folder: bool

    @property
    def date(self) -> str:
        return self.name[:10]

    @property
    def path(self) -> str:
        return f"{J}{self.name}{'/report.md' if self.folder else ''}"

    @property
    def link(self) -> str:
        return f"[{self.name.removesuffix('.json')[11:]}]({self.path})"

    @property
    def machine(self) -> str:
        recorded = self.data.get("machine", {}) if isinstance(self.data, dict) else {}
        if "cpu" in recorded:  # with its accelerator where it ran on one
            gpu = next(
                (recorded[k] for k in ("accelerator", "device") if recorded.get(k) not in (None, "none", "cpu")), ""
            )
            return f"{recorded['cpu']}, {recorded['cores']} cores" + (f", {gpu}" if gpu else "")
        return f"{JOURNAL_MACHINES[self.name]} (journal)" if self.name in JOURNAL_MACHINES else "a machine not recorded"


Block = tuple[str, list[str]]  # (section, markdown lines)


def load(results: Path) -> list[Result]:
    """Every result under `results`, oldest first (by date, then in the journal's order, then by name)."""
    found = []
    for path in results.iterdir():
        if path.is_dir() and (path / "results.json").exists():
            found.append(Result(path.name, json.loads((path / "results.json").read_text()), True))
        elif path.suffix == ".json" and path.name != "headlines.json":
            found.append(Result(path.name, json.loads(path.read_text()), False))
    order = {name: i for i, name in enumerate(COMMANDS)}
    return sorted(found, key=lambda r: (r.date, order.get(r.name, len(order)), r.name))


def kind(data: Any) -> str:
    """Which writer made a result, from its shape."""
    if isinstance(data, list):
        return "quant-types" if "type" in data[0] else "precision-search"
    shapes = {
        "methods": "bench",
        "batches": "batch",
        "summary": "quality",
        "candidates": "tune",
        "levels": "eagle-head",
        "rows": "head-probe",
        "sizes": "model-sizes",
        "same_bits": "attention",
        "builds": "kernel-steps",
        "kernels": "kernel-builds",
        "models": "native-formats",
        "clients": "autoscaling",
        "results": "serve",
        "runs": "serve-runs",
        "runtimes": "where-time-goes",
        "store_sizes": "suffix-store",
        "soak": "soak",
        "grids": "int4-grids",
        "engines": "grammar-mask",
        "greedy_head": "greedy-head",
    }
    found = [name for key, name in shapes.items() if key in data]
    return found[0] if found else "ppl" if all(" " in key for key in data) else "unknown"


def num(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def ppl(value: float, reference: float) -> str:
    return f"{value:.3f} ({value / reference - 1:+.1%})"


def table(header: list[str], rows: Iterable[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + ["| " + " | ".join(r) + " |" for r in rows]


def block(
    section: str, title: str, header: list[str], rows: list[list[str]], used: Iterable[Result], note: str = ""
) -> Block:
    """A table under its title, then the command of every result it shows."""
    lines = [f"### {title}", ""] + ([note, ""] if note else []) + table(header, rows) + ["", "Commands:", ""]
    for r in sorted(set(used), key=lambda r: r.name):
        command = COMMANDS.get(r.name)
        out = "" if command is None or "--out" in command or not r.folder else f" --out {J}{r.name}"
        lines.append(f"- [`{r.name}`]({r.path}): " + ("not recorded" if command is None else f"`{command}{out}`"))
    return section, lines + [""]


def latest(entries: Iterable[tuple[Hashable, Result, Any]]) -> dict[Any, tuple[Result, Any]]:
    """The last (newest) entry per key, in the order the keys first came; entries come oldest first."""
    kept: dict[Any, tuple[Result, Any]] = {}
    for key, result, value in entries:
        kept[key] = (result, value)
    return kept


def newest_per_machine(results: list[Result], by_build: bool = False) -> list[Result]:
    """For results that are one measurement as a whole: the newest per machine (and ``by_build``: per kernel build,
    a build forced by its command's SPECDEC_KERNELS apart from the machine's own)."""
    return [r for r, _ in latest(((r.machine, by_build and forced_build(r)), r, None) for r in results).values()]


def forced_build(r: Result) -> str:
    """The kernel build a result's command forced (``SPECDEC_KERNELS=...``), or "" for the machine's own."""
    found = re.match(r"SPECDEC_KERNELS=(\S+) ", COMMANDS.get(r.name) or "")
    return found.group(1) if found else ""


def plan(describe: str) -> str:
    """A precision plan's describe() string, completed with verify=float32 where it predates that part."""
    return describe if "verify=" in describe else describe + ",verify=float32"


def runtime(machine: dict) -> tuple[str, str]:
    """(section, runtime) of a `specdec bench` run."""
    backend, dtype = machine.get("backend", "transformers"), machine["dtype"]
    if backend == "llama.cpp":
        return backend, "llama.cpp, the target's GGUF file"
    if "=" in dtype:
        dtype = f"`{PLANS[plan(dtype)]}` plan" if plan(dtype) in PLANS else plan(dtype)
    return backend, f"{backend}, {dtype}"


def bench(results: list[Result]) -> list[Block]:
    """`specdec bench` runs: the latest row per runtime, machine, target, prompts, new tokens, temperature, method."""
    entries = []
    for r in results:
        c, (section, rt) = r.data["config"], runtime(r.data["machine"])
        prompts = c["prompts"].removeprefix("benchmarks/prompts/").removesuffix(".jsonl")
        for name, m in r.data["methods"].items():
            key = (section, rt, r.machine, c["target"], prompts, c["max_new_tokens_used"], c["temperature"], name)
            entries.append((key, r, m))
    rows = latest(entries)
    groups: dict[tuple, list] = {}
    for (section, rt, machine, target, prompts, tokens, t, name), (r, m) in rows.items():
        groups.setdefault((section, rt, machine, target), []).append((prompts, tokens, t, name != "none", name, r, m))
    blocks = []
    for (section, rt, machine, target), entries in sorted(groups.items()):
        cells = []
        for prompts, tokens, t, _, name, r, m in sorted(entries, key=lambda e: e[:5]):
            o = m["categories"]["overall"]
            identical = num(o["identical_share"], "{:.0%}") if t == 0 else "n/a"
            cells.append(
                [prompts, str(tokens), f"{t:g}", name, f"{o['tokens_per_s']:.2f}", f"{o['speedup_vs_none']:.2f}x"]
                + [num(o["tokens_per_step"]), num(o["acceptance_rate"], "{:.0%}"), identical, r.date, r.link]
            )
        header = ["prompts", "new tokens", "T", "method", "tok/s", "vs none", "tokens/step", "acceptance", "identical"]
        title = f"{rt}: `{target}` on {machine}"
        blocks.append(block(section, title, header + ["date", "result"], cells, [e[5] for e in entries]))
    return blocks + by_category(results)


def by_category(results: list[Result]) -> list[Block]:
    """`specdec bench` runs with a drafter that learns from earlier answers (suffix): each method's speed-up over
    target-only per category and along the run, one table per prompt set and temperature (the latest)."""
    blocks = []
    learning = [r for r in results if any(name.startswith("suffix") for name in r.data["methods"])]
    keyed = [((r.machine, r.data["config"]["prompts"], r.data["config"]["temperature"]), r, None) for r in learning]
    for r, _ in latest(keyed).values():
        methods, c = r.data["methods"], r.data["config"]
        categories = [k for k in r.data["categories"] if k != "overall"] + ["overall"]
        positions = r.data.get("positions", {})
        groups = [p["positions"] for p in next(iter(positions.values()), [])]
        cells = [
            [name]
            + [f"{m['categories'][k]['speedup_vs_none']:.2f}x" for k in categories]
            + [f"{p['speedup_vs_none']:.2f}x" for p in positions.get(name, [])]
            for name, m in methods.items()
        ]
        header = ["method"] + categories + [f"prompts {g}" for g in groups]
        sampling = "greedy" if c["temperature"] == 0 else f"T = {c['temperature']}"
        prompts = c["prompts"].removeprefix("benchmarks/prompts/").removesuffix(".jsonl")
        title = f"Speed-up over target-only by category and along the run: `{prompts}`, {sampling}, {r.machine}"
        note = (
            f"One run ({r.link}), {c['max_new_tokens_used']} new tokens; prompts k-n: the k-th to n-th prompt of each "
            "category in run order (a drafter that learns from earlier answers speeds up along the run)."
        )
        blocks.append(block(runtime(r.data["machine"])[0], title, header, cells, [r], note))
    return blocks


def suffix_store(results: list[Result]) -> list[Block]:
    """benchmarks/suffix_store.py: the suffix drafter's proposal time and memory by store size."""
    cells = [
        [f"{s['cached_tokens']:,}", f"{s['propose_ms_p50']:.3f} / {s['propose_ms_p99']:.3f}"]
        + [f"{s['bytes_per_token']:.0f}", f"{s['store_bytes'] / 2**20:.0f}", f"{s['peak_rss_bytes'] / 2**20:.0f}"]
        + [f"{s['peak_rss_before_store_bytes'] / 2**20:.0f}", f"{s['add_ms_per_answer']:.2f}"]
        + [num(s.get("add_ms_per_answer_when_full")), r.machine, r.date, r.link]
        for r in newest_per_machine(results)
        for s in r.data["store_sizes"]
    ]
    header = ["cached tokens", "propose p50 / p99 ms", "bytes per token", "store MiB", "peak RSS MiB"]
    header += ["RSS before the store MiB", "add ms per 256-token answer", "add ms when full", "machine", "date"]
    header += ["result"]
    title = "The suffix drafter's store at scale (`benchmarks/suffix_store.py`)"
    return [block("Across runtimes", title, header, cells, newest_per_machine(results))] if cells else []


def batch(results: list[Result]) -> list[Block]:
    """`specdec bench-batch` runs: the latest row per machine, batch size and way, one table per runtime."""
    blocks = []
    for section in SECTIONS:
        rows = latest(
            ((r.machine, size, BATCH_WAYS.get(way, way)), r, (m, ways["target-only"]["tokens_per_s"]))
            for r in results
            if runtime(r.data["machine"])[0] == section
            for size, ways in r.data["batches"].items()
            for way, m in ways.items()
        )
        if not rows:
            continue
        cells = [
            [size, way, f"{m['tokens_per_s']:.1f}", f"{m['tokens_per_s'] / base:.2f}x"]
            + [" / ".join(num(m.get(f"{s}_latency_s")) for s in ("mean", "p50", "p95", "p99"))]
            + [num(m["acceptance_rate"], "{:.0%}"), r.machine, r.date, r.link]
            for (machine, size, way), (r, (m, base)) in rows.items()
        ]
        header = ["batch", "way", "tok/s", "vs batched target-only", "latency mean / p50 / p95 / p99 s", "acceptance"]
        shown = {r.name: r for r, _ in rows.values()}.values()
        setups = sorted(
            {f"{runtime(r.data['machine'])[1]}, {r.data['config']['draft']}, k {r.data['config']['k']}" for r in shown}
        )
        title = f"Batched speculative decoding (`specdec bench-batch`: {'; '.join(setups)})"
        blocks.append(block(section, title, header + ["machine", "date", "result"], cells, shown))
    return blocks


def serve(results: list[Result]) -> list[Block]:
    rows = latest(
        ((" ".join(c["server_args"]), c["clients"], bool(c.get("keys")), spec), r, m)
        for r in results
        for c in [r.data["config"]]
        for spec, m in r.data["results"].items()
    )
    cells = [
        [f"`{args}`", str(clients), "required" if keys else "none", spec, str(m["requests"])]
        + [f"{m['requests_per_s']:.2f}"]
        + [f"{m['tokens_per_s']:.1f}", " / ".join(f"{m['latency_s'][p]:.2f}" for p in ("p50", "p95", "p99"))]
        + [" / ".join(f"{m['ttft_s'][p]:.2f}" for p in ("p50", "p95")), str(m["errors"]), r.machine, r.date, r.link]
        for (args, clients, keys, spec), (r, m) in rows.items()
    ]
    header = ["server args", "clients", "API keys", "speculation", "requests", "req/s", "tok/s"]
    header += ["latency p50 / p95 / p99 s"]
    header += ["TTFT p50 / p95 s", "errors", "machine", "date", "result"]
    title = "The server under load (`specdec bench-serve`, streaming clients)"
    return [block("transformers", title, header, cells, [r for r, _ in rows.values()])]


def serve_runs(results: list[Result]) -> list[Block]:
    """`bench-serve` runs at several client counts (against llama-server where it ran): one table per run."""
    kept = latest(
        ((c["prompts"], c["draft"], c["max_tokens"], c["temperature"], " ".join(c["server_args"]), r.machine), r, None)
        for r in results
        for c in [r.data["config"]]
    )
    blocks = []
    for (prompts, _, tokens, temperature, args, _), (r, _) in kept.items():
        runs = r.data["runs"]
        speed = {(run["server"], run["speculation"].split(" ")[0], run["clients"]): run["tokens_per_s"] for run in runs}
        cells = []
        for run in runs:
            solo = speed.get((run["server"], run["speculation"].split(" ")[0], 1))
            llama = speed.get(("llama-server", "on", run["clients"]))
            cells.append(
                [run["server"], run["speculation"], str(run["clients"]), f"{run['tokens_per_s']:.1f}"]
                + [f"{run['tokens_per_s'] / solo:.2f}x" if solo else "-"]
                + [f"{run['tokens_per_s'] / llama:.2f}x" if llama else "-"]
                + [" / ".join(num(run["latency_s"][p]) for p in ("p50", "p99"))]
                + [f"{run['peak_rss_bytes'] / 2**20:.0f}", num(run["identical_share"], "{:.0%}"), str(run["errors"])]
            )
        header = ["server", "speculation", "clients", "tok/s", "vs 1 client", "vs llama-server spec. on"]
        header += ["latency p50 / p99 s", "peak RSS MiB", "identical", "errors"]
        sampling = "greedy" if temperature == 0 else f"T = {temperature}"
        against = " against llama-server" if "llama-server" in {run["server"] for run in runs} else ""
        title = f"specdec serve{against} (`{prompts}` prompts, {tokens}-token answers, {sampling}, {r.machine})"
        note = (
            f"One run ({r.link}); specdec options: `{args or 'defaults'}`, {r.data['config']['slots']} sequences "
            "decoded together by each server. vs 1 client: over the same server with one client (requests one after "
            "another); identical: greedy answers equal to the same server's with speculation off."
        )
        blocks.append(block("Across runtimes", title, header, cells, [r], note))
    return blocks


def autoscaling(results: list[Result]) -> list[Block]:
    cells = [
        [
            str(d["clients"]),
            f"{d['load_start_to_second_replica_running_s']:.1f}",
            f"{d['load_end_to_one_replica_s']:.1f}",
        ]
        + [str(d["requests"]), ", ".join(map(str, d["statuses"])), r.machine, r.date, r.link]
        for r in newest_per_machine(results)
        for d in [r.data]
    ]
    header = ["clients", "load start to 2nd replica s", "load end to 1 replica s", "requests", "statuses"]
    title = "Ray Serve autoscaling, 1 to 2 replicas (`benchmarks/ray_autoscaling.py`)"
    return [block("transformers", title, header + ["machine", "date", "result"], cells, newest_per_machine(results))]


def int4_grids(results: list[Result]) -> list[Block]:
    """benchmarks/int4_grids.py: candidate 4-bit grids on Gemma-3-270M, perplexity and KL from float32."""
    used = newest_per_machine(results)
    cells = [
        [name, f"{g['bits']:.3g}", f"{g['perplexity']:.3f}", f"{g['kl']:.4f}", r.machine, r.date, r.link]
        for r in used
        for name, g in r.data["grids"].items()
    ]
    header = ["grid (per 32 inputs)", "bits a weight", "perplexity", "KL from float32", "machine", "date", "result"]
    title = "4-bit weight grids judged before kernels (`benchmarks/int4_grids.py`: Gemma-3-270M, float32 activations)"
    return [block("native", title, header, cells, used)] if cells else []


def greedy_head(results: list[Result]) -> list[Block]:
    """benchmarks/greedy_head.py: a greedy step with the logits written and their argmax taken, against the output
    head's own argmax, per forced build."""
    used = newest_per_machine(results)
    cells = [
        [build, name.removeprefix("gemma-3-270m "), f"{m['logits']:.2f}", f"{m['argmax']:.2f}", f"{m['ratio']:.3f}"]
        + [r.machine, r.date, r.link]
        for r in used
        for build, parts in r.data["greedy_head"].items()
        for name, m in parts.items()
        if name != "build"
    ]
    header = ["build", "format x positions", "logits, then argmax ms", "head's argmax ms", "ratio", "machine", "date"]
    title = "Greedy steps without logits (`benchmarks/greedy_head.py`: Gemma-3-270M, 64 cached tokens, median)"
    return [block("native", title, header + ["result"], cells, used)] if cells else []


def soak(results: list[Result]) -> list[Block]:
    def row(r: Result) -> list[str]:
        d, config = r.data["soak"], r.data["config"]
        statuses = ", ".join(f"{code}: {n}" for code, n in d["statuses"].items())
        fives = sum(n for code, n in d["statuses"].items() if code.startswith("5")) + len(d["server_errors"])
        left = int(sum(d["left_open"].values())) + len(d["hangs"])
        rss = f"{d['rss_reference_bytes'] / 2**20:.0f} -> {d['rss_end_bytes'] / 2**20:.0f} MiB"
        rss += f" ({d['rss_end_over_reference'] - 1:+.1%})"
        first = [str(config["clients"]), f"{config['duration']:.0f}", config["draft"], str(d["requests"]), statuses]
        return first + [str(fives), str(left), rss, r.machine, r.date, r.link]

    header = ["clients", "s", "draft", "requests", "answers by status", "5xx", "left open", "memory after 1 min -> end"]
    title = "A soak of `specdec serve` (`benchmarks/soak.py`: a tenth hang up early, a tenth malformed)"
    used = newest_per_machine(results)
    return [block("native", title, header + ["machine", "date", "result"], [row(r) for r in used], used)]


def quality(results: list[Result]) -> list[Block]:
    rows = latest(
        ((r.machine, name), r, (s["all"], r.data["summary"][r.data["baselines"][name]]["all"]))
        for r in results
        for name, s in r.data["summary"].items()
    )
    cells = [
        [name, f"{s['tokens_per_s']:.1f}", f"{s['tokens_per_s'] / base['tokens_per_s']:.2f}x"]
        + [f"{s[k]:.0%}" for k in ("repeated_4gram_share", "distinct_2", "looping_share")]
        + [f"{s['drift_mean']:.2f}", machine, r.date, r.link]
        for (machine, name), (r, (s, base)) in rows.items()
    ]
    header = ["config", "tok/s", "vs its baseline", "repeated 4-grams", "distinct-2", "in loops", "drift", "machine"]
    note = "Baseline: the greedy or sampled configuration of the same run."
    title = "Long-generation quality (`specdec quality`)"
    return [block("transformers", title, header + ["date", "result"], cells, [r for r, _ in rows.values()], note)]


def precision_search(results: list[Result]) -> list[Block]:
    rows = latest(
        ((r.machine, plan(p["describe"])), r, (p, fp32))
        for r in results
        for fp32 in [next(p for p in r.data if p["plan"] == "fp32")]
        for p in r.data
    )
    cells = [
        [p["plan"], describe, f"{p['tokens_per_s']:.2f}", f"{p['tokens_per_s'] / fp32['tokens_per_s']:.2f}x"]
        + [ppl(x["plan"], x["float32"]) for x in p["perplexity"].values()]
        + [machine, r.date, r.link]
        for (machine, describe), (r, (p, fp32)) in rows.items()
    ]
    header = ["plan", "parts", "tok/s", "vs fp32", "PPL LICENSE.txt", "PPL functools.py", "machine", "date", "result"]
    note = "Target-only speed; perplexity on the same tokens of each file, against float32."
    title = "Precision plans, target-only (`benchmarks/precision_search.py`)"
    return [block("transformers", title, header, cells, [r for r, _ in rows.values()], note)]


def eagle_head(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results):
        none = r.data["engine"]["none"]["tokens_per_s"]
        cells = [
            [name, f"{e['tokens_per_s']:.2f}", f"{e['tokens_per_s'] / none:.2f}x", f"{e['draft_ms_p50']:.2f}"]
            + [f"{e['accepted_per_step']:.2f}", f"{e['identical']:.0%}", r.date, r.link]
            for name, e in r.data["engine"].items()
        ]
        header = ["head", "tok/s", "vs none", "draft ms p50", "accepted/step", "identical", "date", "result"]
        note = "The eagle head as its transformers module and on the native int8 kernels; `cpu` plan, greedy."
        title = f"The eagle head's cost (`benchmarks/eagle_head_cost.py`) on {r.machine}"
        blocks.append(block("transformers", title, header, cells, [r], note))
    return blocks


def head_probe(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results):
        rows = r.data["rows"]
        names = [k for k in next(iter(rows.values())) if k.startswith(("int8", "torch"))]
        cells = [
            [n] + [f"{v[k]:.2f}" for k in names] + [str(v["rows equal computed alone"]).lower()]
            for n, v in rows.items()
        ]
        header = ["positions"] + [f"{k} ms" for k in names] + ["rows equal alone"]
        title = f"Gemma-3-270M's output head in int8 (`benchmarks/head_kernel_probe.py`) on {r.machine}, {r.date}"
        blocks.append(block("transformers", title, header, cells, [r]))
    return blocks


def quant_types(results: list[Result]) -> list[Block]:
    rows = latest(((r.machine, q["type"]), r, q) for r in results for q in r.data)
    cells = [
        [t, f"{q['file_mb']:.0f}", f"{q['tokens_per_s']['none']:.1f}", f"{q['tokens_per_s']['prompt-lookup']:.1f}"]
        + [f"{q['tokens_per_s']['prompt-lookup'] / q['tokens_per_s']['none']:.2f}x"]
        + [ppl(x["type"], x["float32"]) for x in q["perplexity"].values()]
        + [machine, r.date, r.link]
        for (machine, t), (r, q) in rows.items()
    ]
    header = ["type", "file MB", "target-only tok/s", "prompt lookup tok/s", "vs target-only", "PPL LICENSE.txt"]
    header += ["PPL functools.py", "machine", "date", "result"]
    title = "Quantization types written by llama.cpp's own quantizer (`benchmarks/llamacpp_quant_types.py`)"
    return [block("llama.cpp", title, header, cells, [r for r, _ in rows.values()])]


def where_time_goes(results: list[Result]) -> list[Block]:
    rows = latest(
        ((r.machine, name), r, (v, r.data["machine"]["read_GBps"]))
        for r in results
        for name, v in r.data["runtimes"].items()
    )
    ns = ("1", "2", "5", "9", "17")
    cells = [
        [name, f"{v['weight_MB']:.0f}", f"{v['roofline_ms']:.1f}"]
        + [f"{v['forward'][n]['total'] * 1000:.1f}" for n in ns]
        + [f"{v['engine']['per_step_ms']:.2f}", f"{gbps:.1f}", machine, r.date, r.link]
        for (machine, name), (r, (v, gbps)) in rows.items()
    ]
    header = ["runtime", "weights MB", "roofline ms"] + [f"forward n={n} ms" for n in ns]
    header += ["bookkeeping ms/step", "read GB/s", "machine", "date", "result"]
    note = "Gemma-3-270M, a forward over n new tokens after 64 cached ones; roofline: weights over read bandwidth."
    title = "Where a forward's time goes (`benchmarks/where_time_goes.py`)"
    return [block("Across runtimes", title, header, cells, [r for r, _ in rows.values()], note)]


def grammar_mask(results: list[Result]) -> list[Block]:
    """Structured output: the grammar engines' mask cost and JSON-schema requests with and without speculation."""
    blocks = []
    for r in newest_per_machine(results):
        d = r.data
        rows = [
            [
                row["draft"],
                "yes" if row["schema"] else "no",
                f"{row['tokens_per_s']:.1f}",
                f"{row['vs_target_only']:.2f}x",
                f"{row['acceptance']:.0%}",
            ]
            for row in d["requests"]
        ]
        engines = "; ".join(
            f"{name} {e['mask_us_median']:.1f} us median ({e['mask_us_mean']:.1f} mean) a token's mask, "
            f"tokenizer table {e['tokenizer_table_s']:.2f} s, compile {e['compile_ms_mean']:.1f} ms"
            for name, e in d["engines"].items()
        )
        note = (
            f"Gemma-3-270M on the native runtime, greedy, {d['new_tokens']} new tokens, {d['prompts']} extraction "
            f"prompts with their JSON schemas (written in the script), against target-only with the same setting; "
            f"{r.machine}, {r.date}. Masks walking valid JSON documents: {engines}. The engine's mask (llguidance's "
            f"bitmask applied to the logits) cost {d['mask_us_per_position']:.0f} us per verified position."
        )
        title = "Structured output: JSON-schema requests with and without speculation (`benchmarks/grammar_mask.py`)"
        header = ["drafter", "schema", "tok/s", "vs target-only (same schema setting)", "acceptance"]
        blocks.append(block("native", title, header, rows, [r], note))
    return blocks


def tune(results: list[Result]) -> list[Block]:
    blocks = []
    held_out = [r for r in results if "default" in r.data]  # tuned on a search part, confirmed on a held-out part
    for r in newest_per_machine([r for r in results if r not in held_out]):
        d = r.data
        cells = [
            [c["label"] + (" (chosen)" if c["label"] == d["chosen"] else ""), f"{c['predicted_tokens_per_s']:.1f}"]
            + [f"{c['measured_tokens_per_s']:.1f}", r.date, r.link]
            for c in d["confirmed"]
        ]
        alone = ", ".join(f"{n} {v['target_only_tokens_per_s']:.1f}" for n, v in d["runtimes"].items())
        cfg = d["config"]
        note = f"`{cfg['target']}`, prompts `{cfg['prompts']}`, T {cfg['temperature']:g}; target-only tok/s: {alone}."
        title = f"`specdec tune`: the configurations it confirmed, on {r.machine}"
        header = ["configuration", "predicted tok/s", "measured tok/s", "date", "result"]
        blocks.append(block("Across runtimes", title, header, cells, [r], note))
    keyed = [
        (
            (r.machine, r.data["config"]["prompts"], r.data["config"]["temperature"], r.data["config"]["budget_s"]),
            r,
            None,
        )
        for r in held_out
    ]
    for r, _ in latest(keyed).values():
        d, cfg = r.data, r.data["config"]
        confirmed = [c for c in d["confirmed"] if c["measured_tokens_per_s"]]
        by_label = {c["label"]: c["measured_tokens_per_s"] for c in confirmed}
        best, default, chosen = max(by_label.values()), by_label[d["default"]], by_label[d["chosen"]]
        cells = []
        for c in sorted(confirmed, key=lambda c: -c["measured_tokens_per_s"]):
            role = " (chosen)" if c["label"] == d["chosen"] else ""
            role += " (default)" if c["label"] == d["default"] else ""
            predicted = c["predicted_tokens_per_s"]
            cells.append(
                [
                    c["label"] + role,
                    "-" if predicted is None else f"{predicted:.1f}",
                    f"{c['measured_tokens_per_s']:.1f}",
                    "-" if predicted is None else f"{c['measured_tokens_per_s'] / predicted:.2f}",
                    f"{c['measured_tokens_per_s'] / default:.2f}x",
                    r.date,
                    r.link,
                ]
            )
        split = d["prompts"]
        note = (
            f"`{cfg['target']}`, prompts `{cfg['prompts']}`, T {cfg['temperature']:g}, budget {cfg['budget_s']:g} s "
            f"(used {d['elapsed_s']:.0f}); sampled on {len(split['search'])} prompts, confirmed on "
            f"{len(split['held_out'])} others. The profile, out of sample: {chosen / best:.2f}x the best confirmed "
            f"contender, {chosen / default:.2f}x the default; a contender had to beat the default by "
            f"{d['threshold']:.3f}x."
        )
        title = (
            f"`specdec tune` on `{Path(cfg['prompts']).stem}`, {cfg['budget_s']:g} s, held-out prompts, on {r.machine}"
        )
        header = ["contender", "predicted tok/s", "measured tok/s", "measured / predicted", "vs default", "date"]
        blocks.append(block("Across runtimes", title, header + ["result"], cells, [r], note))
    return blocks


def model_sizes(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results, by_build=True):
        on = f"{r.machine}, the {forced_build(r)} build (forced)" if forced_build(r) else r.machine
        speed, memory = [], []
        alphas = list(next(iter(r.data["sizes"].values()))["backends"].values())[0]["oracle"]
        for size, s in r.data["sizes"].items():
            greedy, bench_ = s["llamacpp_greedy_tokens_per_s"], s.get("llama_bench_tokens_per_s")
            speed.append([size, "llama.cpp greedy (llama-cpp-python)", f"{greedy:.1f}"] + [""] * (2 + len(alphas)))
            parts = s.get("llama_bench")  # pg, tg and pp apart (older runs: tg alone)
            if parts:
                rates = f"{parts['pg']:.1f} / {parts['tg']:.1f} / {parts['pp']:.1f}"
                speed.append([size, "llama-bench (C++): pg / tg / pp", rates] + [""] * (2 + len(alphas)))
            elif bench_:
                speed.append([size, "llama-bench (C++)", f"{bench_:.1f}"] + [""] * (2 + len(alphas)))
            for name, b in s["backends"].items():
                alone = b["target_only_tokens_per_s"]
                oracle = [
                    f"{o['speedup']:.2f}x ({o['predicted_speedup']:.2f}x) / {o['tokens_per_s'] / greedy:.2f}x"
                    for o in b["oracle"].values()
                ]
                versus = [f"{alone / greedy:.2f}x", f"{alone / bench_:.2f}x" if bench_ else "-"]
                if parts and "target_only_decode_tokens_per_s" in b:  # part for part: prompt + generation, each
                    decoding, prefill = b["target_only_decode_tokens_per_s"], b["prefill_tokens_per_s"]
                    versus[1] = (
                        f"{alone / parts['pg']:.2f}x pg; decoding {decoding:.1f} = {decoding / parts['tg']:.2f}x tg; "
                        f"prefill {prefill:.1f} = {prefill / parts['pp']:.2f}x pp"
                    )
                speed.append([size, name, f"{alone:.1f}"] + versus + oracle)
                if "generating" in b:
                    gb = b["bytes_per_token"] / 1e9
                    first = b.get("first_start")
                    grew = first["peak_rss_mb"] - first["rss_after_imports_mb"] if first else 0.0
                    # a first start from a cache the run found already filled converted nothing: no figure
                    converting = f"{grew:.0f} / " if grew > b["model_bytes"] / 2**20 / 2 else "- / "
                    start = f"{b['cached_start']['seconds']:.1f}" if "cached_start" in b else "-"
                    memory.append(
                        [
                            size,
                            name,
                            f"{gb * 1000:.0f}",
                            f"{gb * b.get('target_only_decode_tokens_per_s', alone):.1f}",
                            converting + f"{b['model_bytes'] / 2**20:.0f}",
                        ]
                        + [start, f"{b['generating']['peak_rss_mb']:.0f}"]
                    )
        header = ["size", "runtime", "target-only tok/s", "x llama.cpp greedy", "x llama-bench"]
        header += [f"a={a}: x own (predicted) / x llama.cpp greedy" for a in alphas]
        note = "Random weights in real shapes; an oracle drafter right with probability a, k the cost model's; one run."
        title = f"Model sizes: target-only and speculation (`benchmarks/model_sizes.py`) on {on}, {r.date}"
        blocks.append(block("Across runtimes", title, header, speed, [r], note))
        if memory:
            header = [
                "size",
                "runtime",
                "MB read per token",
                "GB/s (decoding where measured)",
                "peak RSS converting / model MB",
            ]
            header += ["start from cache s", "peak RSS generating MB"]
            note = f"The same run; measured read bandwidth {r.data['machine']['read_GBps']:.1f} GB/s."
            title = f"Model sizes: bytes, bandwidth and memory on {on}, {r.date}"
            blocks.append(block("Across runtimes", title, header, memory, [r], note))
    return blocks


def attention(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results):
        variants = [k for k in r.data if k not in ("machine", "same_bits", "whole_steps")]
        cells = [
            [shape]
            + [
                f"{r.data[v][shape]['1']:.2f} / {r.data[v][shape]['9']:.2f} ({r.data[v][shape]['ratio']:.2f}x)"
                for v in variants
            ]
            for shape in r.data[variants[0]]
        ]
        steps = "; ".join(
            f"after {ctx} cached, {w['1']:.1f} / {w['9']:.1f} ms ({w['ratio']:.2f}x)"
            for ctx, w in r.data["whole_steps"].items()
        )
        note = f"One layer's attention; the same bits as before: {str(r.data['same_bits']).lower()}."
        note += f" Whole steps of the `--model`, 1 / 9 new positions: {steps}."
        header = ["shape @ context"] + [f"{v}: 1 / 9 positions ms" for v in variants]
        title = f"Attention against context (`benchmarks/attention_context.py`) on {r.machine}, {r.date}"
        blocks.append(block("native", title, header, cells, [r], note))
    return blocks


def kernel_builds(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results):
        cells = [
            [name, f"{k['1']:.2f}", f"{k['9']:.2f}", f"{k['9'] / k['1']:.2f}x", str(k["rows independent"]).lower()]
            for name, k in r.data["kernels"].items()
        ]
        header = ["kernel", "1 row ms", "9 rows ms", "9 over 1", "rows independent"]
        note = f"An 8B Llama's MLP input matrix, {r.data['copies']} copies multiplied in turn."
        title = f"The 4- and 8-bit kernels (`benchmarks/kernel_builds.py`) on {r.machine}, {r.date}"
        blocks.append(block("native", title, header, cells, [r], note))
    return blocks


def kernel_steps(results: list[Result]) -> list[Block]:
    """Per machine: each build's step at 1 and 9 positions and where it goes; against llama-bench; the bare kernels."""
    blocks = []
    for r in newest_per_machine(results):
        d, read = r.data, r.data["bandwidth"]["read_GBps"]
        parts = {
            "head": ["output head"],
            "other linear": ["other linear layers"],
            "attention": ["attention"],
            "norms, activation": ["rms_norm", "gated"],
            "rest": ["other (torch operations, Python)"],
        }
        cells = []
        for build, b in d["builds"].items():
            for name, m in b["models"].items():
                one, nine = m["steps_ms"]["1"], m["steps_ms"]["9"]
                cells.append(
                    [
                        build,
                        name,
                        f"{one['total']:.1f}",
                        f"{nine['total']:.1f}",
                        f"{nine['total'] / one['total']:.2f}x",
                        f"{m['weight_bytes'] / read / 1e6:.1f}",
                    ]
                    + [
                        " / ".join(f"{sum(s.get(k, 0) for k in keys):.1f}" for s in (one, nine))
                        for keys in parts.values()
                    ]
                )
        header = ["build", "model", "1 position ms", "9 positions ms", "9 over 1", "roofline ms"]
        header += [f"{p}: 1 / 9 ms" for p in parts]
        note = (
            f"A forward over 1 and 9 new positions after 64 cached ones (median of 7; the split: mean of 7 timed "
            f"apart). Roofline: the weights one step reads over the read bandwidth measured in the same run "
            f"({read:.1f} GB/s). Each build forced with SPECDEC_KERNELS; a forced build differs from a CPU of its kind "
            f"only in clock and caches."
        )
        title = f"Verification's price per kernel build (`benchmarks/kernel_steps.py`) on {r.machine}, {r.date}"
        blocks.append(block("native", title, header, cells, [r], note))

        cells = []
        for build, b in d["builds"].items():
            peer = d.get(f"llama_bench_{build.replace('-', '_')}", d.get("llama_bench", {}))
            tg = peer.get(f"tg{d['tokens']}")
            for fmt, e in b["engine"].items():
                pre = b["models"][f"gemma-3-270m {fmt}"]["prefill_tok_s"]
                row = [build, fmt]
                for prompts in ("default", "kernels-unseen"):
                    none, auto = e[f"none {prompts}"], e[f"auto {prompts}"]
                    row += [
                        f"{none:.1f}",
                        num(tg and none / tg, "{:.2f}x"),
                        f"{auto / none:.2f}x",
                        num(tg and auto / tg, "{:.2f}x"),
                    ]
                for n in ("512", "2048"):
                    row += [f"{pre[n]:.0f}", num(peer.get(f"pp{n}") and pre[n] / peer[f"pp{n}"], "{:.2f}x")]
                cells.append(row)
        header = ["build", "format"]
        for prompts in ("default", "unseen"):
            header += [f"{prompts}: none tok/s", "none vs llama-bench tg", "auto vs none", "auto vs llama-bench tg"]
        header += ["prefill 512 tok/s", "vs llama-bench pp512", "prefill 2048 tok/s", "vs llama-bench pp2048"]
        same = [b for b in d["builds"] if f"llama_bench_{b.replace('-', '_')}" in d]
        peers = "; ".join(
            f"{label}: " + ", ".join(f"{k} {v:.1f}" for k, v in d[key].items())
            for key, label in (
                ("llama_bench", "llama-bench built for AVX-512 and AVX-VNNI"),
                ("llama_bench_avx2", "llama-bench built for AVX2 alone"),
                ("llama_bench_avx2_vnni", "llama-bench built for AVX2 and AVX-VNNI"),
            )
            if key in d
        )
        note = (
            f"Gemma-3-270M through the engine (`Generator`, greedy, {d['tokens']} new tokens, prefill included), on "
            f"the default prompts and on benchmarks/prompts/kernels-unseen.jsonl; llama-bench on its Q4_K_M GGUF, "
            f"2 threads, tokens/s: {peers or 'not measured'}. Each forced build is compared with llama-bench built for "
            f"the same instruction sets where it was measured ({', '.join(same) or 'none'}), every other build with "
            f"llama-bench built for AVX-512"
            + (" (llama.cpp's AMX path crashed on this machine)." if "amx" in d["builds"] else ".")
        )
        title = (
            f"Native against `llama-bench`, per kernel build (`benchmarks/kernel_steps.py`) on {r.machine}, {r.date}"
        )
        blocks.append(block("native", title, header, cells, [r], note))

        labels = list(next(iter(d["builds"].values()))["kernels"])
        cells = [
            [build] + [f"{b['kernels'][k]['us']:.0f} ({b['kernels'][k]['gmacs']:.0f})" for k in labels]
            for build, b in d["builds"].items()
        ]
        note = (
            "One thread, kernels/harness.cpp's timing mode: microseconds per call (G multiply-adds per second). The "
            "head shape (640 x 262,144) streams from memory; the L2 shape (640 x 2,048, 1.3 MB in int8) stays in the "
            "caches: the build's compute ceiling."
        )
        title = f"The bare kernels per build (`benchmarks/kernel_steps.py`) on {r.machine}, {r.date}"
        blocks.append(block("native", title, ["build"] + labels, cells, [r], note))
    return blocks


def native_formats(results: list[Result]) -> list[Block]:
    blocks = []
    for r in newest_per_machine(results):
        relabel = RELABEL.get(r.name, {})
        models = {m: {relabel.get(k, k): v for k, v in d.items()} for m, d in r.data["models"].items()}
        columns = list(dict.fromkeys(k for d in models.values() for k in d if k not in ("tokens", "float32")))
        cells = [
            [m, str(d["tokens"]), f"{d['float32']:.3f}"] + [ppl(d[c], d["float32"]) if c in d else "-" for c in columns]
            for m, d in models.items()
        ]
        note = f"The default prompt set, windows of {r.data['window']} tokens, the same token ids for every column."
        if relabel:
            note += " Columns renamed as the journal says: that run named them by the then default cache, bfloat16."
        title = f"Perplexity per format (`benchmarks/native_formats.py`) on {r.machine}, {r.date}"
        blocks.append(block("Across runtimes", title, ["model", "tokens", "float32"] + columns, cells, [r], note))
    return blocks


def perplexity(results: list[Result]) -> list[Block]:
    rows = latest(((r.machine, key), r, v) for r in results for key, v in r.data.items())
    cells = [
        [*key.split(" ", 1), f"{v[0]:.3f}", f"{v[1]:.3f}", f"{v[2]:+.3f}", machine, r.date, r.link]
        for (machine, key), (r, v) in rows.items()
    ]
    header = ["runtime", "text", "float32", "runtime's", "difference", "machine", "date", "result"]
    title = "Perplexity against float32, 4,096 tokens (`specdec ppl`)"
    return [block("Across runtimes", title, header, cells, [r for r, _ in rows.values()])]


WRITERS: dict[str, Callable[[list[Result]], list[Block]]] = {
    "bench": bench,
    "batch": batch,
    "serve": serve,
    "serve-runs": serve_runs,
    "autoscaling": autoscaling,
    "quality": quality,
    "precision-search": precision_search,
    "eagle-head": eagle_head,
    "head-probe": head_probe,
    "quant-types": quant_types,
    "kernel-builds": kernel_builds,
    "kernel-steps": kernel_steps,
    "attention": attention,
    "where-time-goes": where_time_goes,
    "tune": tune,
    "model-sizes": model_sizes,
    "native-formats": native_formats,
    "ppl": perplexity,
    "suffix-store": suffix_store,
    "soak": soak,
    "int4-grids": int4_grids,
    "grammar-mask": grammar_mask,
    "greedy-head": greedy_head,
}


# A headline that compares the code before and after a change names the commit it started from: it is history (the
# journal keeps it), not a current figure.
BEFORE_AFTER = re.compile(r"\bbefore \([0-9a-f]{7,40}\)")


def headlines(path: Path) -> list[str]:
    """The figures the journal states from commands that wrote no results file (headlines.json), but before-and-after
    comparisons of the code (BEFORE_AFTER)."""
    cells = [
        [
            h["date"],
            h["machine"],
            h["what"],
            h["figure"],
            "not recorded" if h["command"] is None else f"`{h['command']}`",
        ]
        + [f'"{h["journal"]}"']
        for h in json.loads(path.read_text())
        if not BEFORE_AFTER.search(h["what"])
    ]
    header = ["date", "machine", "what", "figure", "command", "journal section"]
    intro = "Figures the journal states from commands that wrote no results file (`benchmarks/results/headlines.json`)"
    return ["## Measured by commands without a results file", "", intro + ".", "", *table(header, cells), ""]


INTRO = """
Generated by `python benchmarks/current_results.py` from the files in `benchmarks/results/`: do not edit it by hand
(`tests/test_current_results.py` fails when it differs from what the script writes). For each measured thing (a method
on a prompt set at a temperature, a precision plan, a server deployment, a model size) the page keeps the latest result
per runtime and machine, with its date, machine and command; "Across runtimes" holds the runs that measured several
runtimes at once. Speed-ups and other ratios compare figures of one run on one machine only: rows of one table can come
from different runs (see their date and result), and absolute tokens/s on these shared 2-core VMs move by 5-10% between
runs, so compare ratios, not tokens/s across runs. A machine marked (journal) is not recorded in its file but named by
the journal; commands are the journal's. In `specdec bench` tables the figures are over all prompts: vs none is tokens/s
over specdec's target-only (`none`) in the same run, tokens/step the tokens each target forward yields, acceptance the
share of drafted tokens accepted, identical the share of greedy outputs equal to target-only's.
"""
HISTORY = """
This page shows current results only. How these figures were reached, with the runs they replaced, before-and-after
comparisons of the code, abandoned experiments and the machines used before:
[benchmarks/journal/notebook.md](benchmarks/journal/notebook.md), the chronological notebook (frozen).
"""


def page(results_dir: Path) -> str:
    """The whole of BENCHMARKS.md for the results in `results_dir`."""
    by_kind: dict[str, list[Result]] = {}
    for r in load(results_dir):
        if r.name not in EXCLUDED:
            by_kind.setdefault(kind(r.data), []).append(r)
    blocks = [b for name, writer in WRITERS.items() for b in writer(by_kind.get(name, []))]
    lines = ["# Benchmarks: current results", "", " ".join(INTRO.split()), ""]
    for section in SECTIONS:
        lines += [f"## {section}", ""] + [line for s, block_lines in blocks if s == section for line in block_lines]
    if (results_dir / "headlines.json").exists():
        lines += headlines(results_dir / "headlines.json")
    left_out = [f"- `{name}`: {why}" for name, why in sorted(EXCLUDED.items())]
    left_out += [f"- `{r.name}`: not a format this script reads" for r in by_kind.get("unknown", [])]
    lines += ["## Results not shown", "", *left_out, ""] if left_out else []
    return "\n".join(lines + ["## History", "", " ".join(HISTORY.split())]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    parser.add_argument("--out", type=Path, default=ROOT / "BENCHMARKS.md")
    args = parser.parse_args()
    args.out.write_text(page(args.results))


if __name__ == "__main__":
    main()
