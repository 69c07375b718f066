// Row-wise norms and the MLP's gated activation: every value by one vector code path (a row's tail through a mask), so
// a value depends neither on how many rows are computed together nor on the threads that share them (torch's own
// activations take other paths at the ends of the slices its threads share).
#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace specdec {

// act(gate) * up; act = SiLU (kind 0) or GELU's tanh form (kind 1).
void gated(const float* xp, int64_t n, int64_t f, int64_t kind, float* op) {
    const vf one = v_set1_ps(1.f), half = v_set1_ps(0.5f), two = v_set1_ps(2.f);
    const vf root = v_set1_ps(0.7978845608028654f), cubic = v_set1_ps(0.044715f);
    parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i)
            for (int64_t c = 0; c < f; c += 16) {
                const int64_t valid = std::min<int64_t>(16, f - c);
                const vf g = v_load_first(valid, xp + i * 2 * f + c);
                const vf u = v_load_first(valid, xp + i * 2 * f + f + c);
                vf a;
                if (kind == 0) {
                    a = v_div_ps(g, v_add_ps(one, v_exp(v_sub_ps(v_setzero_ps(), g))));
                } else {  // 0.5 g (1 + tanh(t)), tanh(t) = 1 - 2 / (exp(2t) + 1), t = sqrt(2/pi) (g + 0.044715 g^3)
                    const vf t = v_mul_ps(root, v_add_ps(g, v_mul_ps(cubic, v_mul_ps(g, v_mul_ps(g, g)))));
                    const vf th = v_sub_ps(one, v_div_ps(two, v_add_ps(v_exp(v_mul_ps(two, t)), one)));
                    a = v_mul_ps(v_mul_ps(half, g), v_add_ps(one, th));
                }
                v_store_first(valid, op + i * f + c, v_mul_ps(a, u));
            }
    });
}

// Rotary embedding of x [n][heads][dim] by each position's cos and sin [n][dim]: x cos + rotate_half(x) sin, where
// rotate_half(x) = (-x[half:], x[:half]); each value by the same three IEEE operations as torch's formula.
void rope(const float* xp, int64_t n, int64_t heads, int64_t dim, const float* cp, const float* sp, float* op) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < n; ++i) {
        const float* c = cp + i * dim;
        const float* s = sp + i * dim;
        for (int64_t h = 0; h < heads; ++h) {
            const float* x = xp + (i * heads + h) * dim;
            float* o = op + (i * heads + h) * dim;
            for (int64_t d = 0; d < half; ++d) o[d] = x[d] * c[d] + -x[d + half] * s[d];
            for (int64_t d = half; d < dim; ++d) o[d] = x[d] * c[d] + x[d - half] * s[d];
        }
    }
}

// -inf at each of a row's first `width` logits [rows][stride] whose bit in the row's mask is 0 (bit t of word w: token
// 32 w + t): a grammar's mask, without unpacking it. Words of all ones leave their 32 values; words of zeros fill them.
void forbid(float* logits, int64_t rows, int64_t stride, int64_t width, const int32_t* bits, int64_t words) {
    parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float* row = logits + r * stride;
            const int32_t* mask = bits + r * words;
            for (int64_t w = 0; w * 32 < width; ++w) {
                const int64_t base = w * 32, n = std::min<int64_t>(32, width - base);
                uint32_t forbidden = ~(uint32_t)mask[w];
                if (n < 32) forbidden &= (1u << n) - 1;
                if (forbidden == 0xFFFFFFFFu) {
                    for (int64_t t = 0; t < 32; ++t) row[base + t] = -INFINITY;
                    continue;
                }
                for (; forbidden; forbidden &= forbidden - 1) row[base + __builtin_ctz(forbidden)] = -INFINITY;
            }
        }
    });
}

// Each row alone, in one order (float32).
void rms_norm(const float* xp, int64_t rows, int64_t dim, const float* wp, float eps, float* op) {
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = xp + r * dim;
        vf acc = v_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const vf v = v_loadu_ps(row + d);
            acc = v_add_ps(acc, v_mul_ps(v, v));
        }
        const vf inv = v_set1_ps(1.f / std::sqrt(v_reduce_add_ps(acc) / (float)dim + eps));
        for (int64_t d = 0; d < dim; d += 16)
            v_storeu_ps(op + r * dim + d, v_mul_ps(v_mul_ps(v_loadu_ps(row + d), inv), v_loadu_ps(wp + d)));
    }
}

}  // namespace specdec
