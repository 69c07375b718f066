"""Exact int8 x int8 products for linear layers on CPUs with AVX-512 VNNI: each weight row is read once per call.

``matmul(a8, a_scale, w8, w_scale, w_sum)`` is ``(a8 @ w8.T) * a_scale[:, None] * w_scale``: integer dot
products (exact), converted to float32, then scaled in that order. Up to 16 positions share one pass over
the weights (a step's verification; a long prefill makes one pass per 16). Measured here
(BENCHMARKS.md, issue 23), Gemma-3-270M's head takes 5 ms for one position and 13 ms for nine with this
kernel, against 21 and 27 ms in bfloat16 and 13 and 50 ms with torch's int8-weight kernel. A row's result
does not depend on the other rows (the property speculative greedy decoding needs).

The kernel is compiled on first use (apply_plan asks for it) (torch's cpp_extension: g++ and ninja, about 30 s here, then
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
FALLBACK_ROWS = 8192  # weight rows per float64 product on the exact path without the kernel

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

// out[i, v] = (float)(sum_k a[i, k] * w[v, k]) * as[i] * ws[v]; a is stored as unsigned a + 128, hence the
// 128 * wsum[v] correction. N rows at a time, a compile-time count, so that their accumulators stay in registers.
template <int N>
void block(const uint8_t* a, const float* as, const int8_t* w, const float* ws, const int32_t* wsum, float* out,
           int64_t k, int64_t vocab) {
    at::parallel_for(0, vocab, 256, [&](int64_t begin, int64_t end) {
        for (int64_t v = begin; v < end; ++v) {
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
    });
}

torch::Tensor int8_matmul(torch::Tensor a_u8, torch::Tensor a_scale, torch::Tensor w_s8, torch::Tensor w_scale, torch::Tensor w_sum) {
    const int64_t n = a_u8.size(0), k = a_u8.size(1), vocab = w_s8.size(0);
    TORCH_CHECK(k % 64 == 0 && w_s8.size(1) == k, "the widths must agree and be a multiple of 64");
    TORCH_CHECK(a_u8.scalar_type() == torch::kUInt8 && w_s8.scalar_type() == torch::kInt8, "uint8 activations, int8 weights");
    TORCH_CHECK(a_scale.scalar_type() == torch::kFloat32 && w_scale.scalar_type() == torch::kFloat32 && w_sum.scalar_type() == torch::kInt32,
                "float32 scales, int32 row sums");
    TORCH_CHECK(a_u8.is_contiguous() && w_s8.is_contiguous() && a_scale.is_contiguous() && w_scale.is_contiguous() && w_sum.is_contiguous(),
                "contiguous tensors");
    TORCH_CHECK(a_scale.numel() == n && w_scale.numel() == vocab && w_sum.numel() == vocab, "one scale per row");
    auto y = torch::empty({n, vocab}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;  // the server's event loop runs while a step computes
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
    a_scale, w_scale = a_scale.float().contiguous(), w_scale.float().contiguous()
    kernel = compiled() if a8.device.type == "cpu" and a8.shape[1] % 64 == 0 else None
    if kernel is not None:
        a_u8 = (a8.to(torch.int16) + 128).to(torch.uint8).contiguous()
        return kernel.int8_matmul(a_u8, a_scale, w8.contiguous(), w_scale, w_sum.int().contiguous())
    a64 = a8.double()
    pieces = []
    for start in range(0, w8.shape[0], FALLBACK_ROWS):  # a slice of the weights in float64 at a time, not a copy of all
        exact = (a64 @ w8[start : start + FALLBACK_ROWS].double().T).float()  # integer sums: exact, rounded once as the kernel does
        pieces.append(exact * a_scale[:, None] * w_scale[None, start : start + FALLBACK_ROWS])
    return torch.cat(pieces, dim=1)


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
            "specdec_int8_vnni_v2",
            cpp_sources=SOURCE,
            functions=["int8_matmul"],
            extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mavx512vnni", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as exc:  # noqa: BLE001 - no compiler or ninja: the same results, computed slower
        reason = (str(exc).splitlines() or [repr(exc)])[0][:200]
        log.warning("the int8 VNNI kernel could not be built (%s): using the exact float64 path", reason)
        return None
