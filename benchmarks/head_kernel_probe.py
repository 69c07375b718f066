"""How fast can the output head be on this CPU if its weights are read once per step for every position? (issue 23)

Usage: python benchmarks/head_kernel_probe.py [--out FILE]

A probe, not a backend: a 60-line AVX-512 VNNI kernel (compiled on the fly with torch's cpp_extension;
needs g++, ninja and a CPU with avx512_vnni) computes Gemma-3-270M's head (262,144 x 640) in int8 with a
scale per vocabulary row, each row's weights loaded once and used for all n positions. Integer dot
products are exact, so a row's logits do not depend on n (batch-invariant: a 9-token verification
computes what nine one-token steps would). Compared with torch's bfloat16 and float32 products on the
same shapes and with the measured roofline, and checked against a float32 reference of the same int8 values.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// y[i, v] = (sum_k a[i, k] * w[v, k] - 128 * wsum[v]) * a_scale[i] * w_scale[v], a stored as unsigned (a + 128).
// N is a template argument so that the N accumulators stay in registers.
template <int N>
void head_n(const uint8_t* a, const float* as, const int8_t* w, const float* ws, const int32_t* wsum, float* out, int64_t k, int64_t vocab) {
    #pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < vocab; ++v) {
        __m512i acc[N];
        for (int i = 0; i < N; ++i) acc[i] = _mm512_setzero_si512();
        const int8_t* row = w + v * k;
        for (int64_t c = 0; c < k; c += 64) {
            __m512i wv = _mm512_loadu_si512((const void*)(row + c));
            for (int i = 0; i < N; ++i)
                acc[i] = _mm512_dpbusd_epi32(acc[i], _mm512_loadu_si512((const void*)(a + i * k + c)), wv);
        }
        for (int i = 0; i < N; ++i)
            out[i * vocab + v] = (float)(_mm512_reduce_add_epi32(acc[i]) - 128 * wsum[v]) * as[i] * ws[v];
    }
}

torch::Tensor head(torch::Tensor a_u8, torch::Tensor a_scale, torch::Tensor w_s8, torch::Tensor w_scale, torch::Tensor w_sum) {
    const int64_t n = a_u8.size(0), k = a_u8.size(1), vocab = w_s8.size(0);
    TORCH_CHECK(k % 64 == 0 && n >= 1 && n <= 17, "k must be a multiple of 64 and n in 1..17");
    auto y = torch::empty({n, vocab}, torch::kFloat32);
    auto args = std::make_tuple(a_u8.data_ptr<uint8_t>(), a_scale.data_ptr<float>(), w_s8.data_ptr<int8_t>(),
                                w_scale.data_ptr<float>(), w_sum.data_ptr<int32_t>(), y.data_ptr<float>(), k, vocab);
    switch (n) {
#define CASE(N) case N: std::apply(head_n<N>, args); break;
        CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9)
        CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16) CASE(17)
#undef CASE
    }
    return y;
}
"""


def build():
    return load_inline(
        "specdec_head_probe_n",
        cpp_sources=SOURCE,
        functions=["head"],
        extra_cflags=["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"],
        extra_ldflags=["-fopenmp"],
        verbose=False,
    )


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = x.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8), scale.float()


def best_ms(f, repeats: int = 9) -> float:
    f()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        f()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    args = parser.parse_args()
    from specdec.models import load_model

    weight = load_model("gemma-3-270m").model.get_output_embeddings().weight.detach().float().contiguous()
    vocab, width = weight.shape
    w8, w_scale = quantize_rows(weight)
    w_sum = w8.sum(dim=1, dtype=torch.int32)
    kernel = build()
    bf16, rows = weight.bfloat16(), {}
    for n in (1, 2, 5, 9, 17):
        hidden = torch.randn(n, width) * 3
        a8, a_scale = quantize_rows(hidden)
        a_u8 = (a8.to(torch.int16) + 128).to(torch.uint8).contiguous()
        logits = kernel.head(a_u8, a_scale, w8, w_scale, w_sum)
        reference = (a8.float() @ w8.float().T) * a_scale[:, None] * w_scale[None, :]
        alone = torch.cat([kernel.head(a_u8[i : i + 1], a_scale[i : i + 1], w8, w_scale, w_sum) for i in range(n)])
        rows[n] = {
            "int8 VNNI, weights read once": best_ms(partial(kernel.head, a_u8, a_scale, w8, w_scale, w_sum)),
            "torch bfloat16": best_ms(partial(torch.nn.functional.linear, hidden.bfloat16(), bf16)),
            "torch float32": best_ms(partial(torch.nn.functional.linear, hidden, weight), repeats=3),
            "max |error| vs float32 of the same int8 values": float((logits - reference).abs().max()),
            "rows equal computed alone": bool(torch.equal(logits, alone)),
        }
        cells = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in rows[n].items())
        print(f"n={n:2d}: {cells}", flush=True)
    print(f"int8 head: {w8.numel() / 1e6:.0f} MB, bfloat16 {2 * w8.numel() / 1e6:.0f} MB, float32 {4 * w8.numel() / 1e6:.0f} MB")
    if args.out:
        Path(args.out).write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
