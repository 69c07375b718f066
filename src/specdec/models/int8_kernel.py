"""Exact int8 x int8 products for linear layers on CPUs with AVX-512 VNNI: each weight row is read once per call.

``matmul(a8, a_scale, w8, w_scale, w_sum)`` is ``(a8 @ w8.T) * a_scale[:, None] * w_scale``: integer dot
products (exact), converted to float32, then scaled in that order. Measured here
(BENCHMARKS.md, issue 23), Gemma-3-270M's head takes 5 ms for one position and 13 ms for nine with this
kernel, against 21 and 27 ms in bfloat16 and 13 and 50 ms with torch's int8-weight kernel. A row's result
does not depend on the other rows (the property speculative greedy decoding needs).

The kernel is compiled on first use (torch's cpp_extension: g++ and ninja, about 30 s here, then
cached). Where it cannot be (another CPU, no compiler, a width that is not a multiple of 64), the same
numbers come from a float64 product of the same integers, which is exact too: both paths give
bit-identical results, only slower.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger("specdec")

SOURCE = r"""
#include <torch/extension.h>
#include <immintrin.h>

// out[i, v] = (float)(sum_k a[i, k] * w[v, k]) * as[i] * ws[v]; a is stored as unsigned a + 128, hence the
// 128 * wsum[v] correction. N rows at a time, a compile-time count, so that their accumulators stay in registers.
template <int N>
void block(const uint8_t* a, const float* as, const int8_t* w, const float* ws, const int32_t* wsum, float* out,
           int64_t k, int64_t vocab) {
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

torch::Tensor int8_matmul(torch::Tensor a_u8, torch::Tensor a_scale, torch::Tensor w_s8, torch::Tensor w_scale, torch::Tensor w_sum) {
    const int64_t n = a_u8.size(0), k = a_u8.size(1), vocab = w_s8.size(0);
    TORCH_CHECK(k % 64 == 0, "the width must be a multiple of 64");
    auto y = torch::empty({n, vocab}, torch::kFloat32);
    const uint8_t* a = a_u8.data_ptr<uint8_t>();
    const float* as = a_scale.data_ptr<float>();
    float* out = y.data_ptr<float>();
    for (int64_t r = 0; r < n; r += 16) {
        const int64_t m = std::min<int64_t>(16, n - r);
        auto args = std::make_tuple(a + r * k, as + r, w_s8.data_ptr<int8_t>(), w_scale.data_ptr<float>(),
                                    w_sum.data_ptr<int32_t>(), out + r * vocab, k, vocab);
        switch (m) {
#define CASE(N) case N: std::apply(block<N>, args); break;
            CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
            CASE(9) CASE(10) CASE(11) CASE(12) CASE(13) CASE(14) CASE(15) CASE(16)
#undef CASE
        }
    }
    return y;
}
"""


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and a float32 scale per row (symmetric: the row's largest magnitude is 127)."""
    x = x.float()
    scale = x.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(x / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def matmul(a8: torch.Tensor, a_scale: torch.Tensor, w8: torch.Tensor, w_scale: torch.Tensor, w_sum: torch.Tensor) -> torch.Tensor:
    """``(a8 @ w8.T) * a_scale[:, None] * w_scale`` in float32, exactly (``w_sum``: each weight row's sum, int32)."""
    kernel = compiled() if a8.device.type == "cpu" and a8.shape[1] % 64 == 0 else None
    if kernel is not None:
        a_u8 = (a8.to(torch.int16) + 128).to(torch.uint8).contiguous()
        return kernel.int8_matmul(a_u8, a_scale.contiguous(), w8, w_scale, w_sum)
    exact = (a8.double() @ w8.double().T).float()  # integer sums below 2^53: exact, then rounded to float32 as the kernel does
    return exact * a_scale[:, None] * w_scale[None, :]


def vnni_available() -> bool:
    """Whether this CPU has AVX-512 VNNI (the kernel's instructions)."""
    try:
        return "avx512_vnni" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@functools.cache
def compiled():
    """The compiled kernel, or None (the exact float64 path is used) where this CPU or machine cannot run or build it."""
    if not vnni_available():
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            "specdec_int8_vnni",
            cpp_sources=SOURCE,
            functions=["int8_matmul"],
            extra_cflags=["-O3", "-std=c++17", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # noqa: BLE001 - no compiler or ninja: the same results, computed slower
        log.warning("the int8 VNNI kernel could not be built (%s): using the exact float64 path", str(exc).splitlines()[0][:200])
        return None
