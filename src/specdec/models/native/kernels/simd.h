// The kernels are written once against 16-lane vectors: vf (float32), vi (int32), and compiled with AVX-512 (one
// register each, simd_avx512.h), AVX2 (two, simd_avx2.h) or NEON (four, simd_neon.h). Every lane-wise step is the same
// IEEE operation on each, and the horizontal sum takes one fixed order, so the builds give the same bits. Integer dot
// products of 4 bytes per lane: VNNI multiplies unsigned by signed bytes (activations stored with an OFFSET of 128,
// taken off per group); plain AVX2 multiplies |w| by sign(w) * q (no offset), exact as long as |q|, |w| <= 127; SDOT
// multiplies signed by signed bytes (no offset).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "kernels.h"

#if defined(__AVX512F__)
#include "simd_avx512.h"
#elif defined(__aarch64__)
#include "simd_neon.h"
#elif defined(__AVX2__)
#include "simd_avx2.h"
#else
#error "specdec's kernels need AVX2, AVX-512 or ARM NEON with SDOT"
#endif

#if !defined(INT16_PARTS)
// A group's int4 products (vpart): summed straight into int32 where the dot product widens by itself; plain AVX2
// defines its own, in int16.
typedef vi vpart;
static inline vpart v_part_zero() { return v_setzero_si512(); }
static inline vpart v_part_dot_int4(vpart p, vi u, vi a) { return v_dot_int4(p, u, a); }
static inline vi v_part_sums(vpart p) { return p; }
#endif

#if !defined(__aarch64__)
// The horizontal sum, in one order on every build: upper half + lower half, then the same within 128 bits, then pairs.
static inline float v_reduce_add_ps(vf x) {
    const __m256 t = v_halves(x);
    __m128 u = _mm_add_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    u = _mm_add_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return _mm_cvtss_f32(u) + _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1));
}
#endif

// exp(x) by Cephes' method: x = m ln2 + r, exp(r) by a polynomial, times 2^m. NaN stays NaN (max and min return their
// second operand when one is NaN); beyond +-88 the result is the bound's.
static inline vf v_exp(vf x) {
    x = v_min_ps(v_set1_ps(88.3762626647949f), v_max_ps(v_set1_ps(-88.3762626647949f), x));
    const vf m = v_round_ps(v_mul_ps(x, v_set1_ps(1.44269504088896341f)));
    vf r = v_fnmadd_ps(m, v_set1_ps(0.693359375f), x);
    r = v_fnmadd_ps(m, v_set1_ps(-2.12194440e-4f), r);
    vf p = v_set1_ps(1.9875691500e-4f);
    p = v_fmadd_ps(p, r, v_set1_ps(1.3981999507e-3f));
    p = v_fmadd_ps(p, r, v_set1_ps(8.3334519073e-3f));
    p = v_fmadd_ps(p, r, v_set1_ps(4.1665795894e-2f));
    p = v_fmadd_ps(p, r, v_set1_ps(1.6666665459e-1f));
    p = v_fmadd_ps(p, r, v_set1_ps(5.0000001201e-1f));
    p = v_add_ps(v_fmadd_ps(p, v_mul_ps(r, r), r), v_set1_ps(1.f));
    return v_scalef_ps(p, m);
}

// float32 to bfloat16, rounded to nearest even (NaN: the quiet NaN 0x7FC0), as torch rounds it.
static inline uint16_t to_bfloat16(float x) {
    if (std::isnan(x)) return 0x7FC0;
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

// float32 to IEEE half, rounded to nearest even, by the CPU's own conversion.
static inline uint16_t to_half(float x) {
#if defined(__aarch64__)
    return vget_lane_u16(vreinterpret_u16_f16(vcvt_f16_f32(vdupq_n_f32(x))), 0);
#else
    return (uint16_t)_cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#endif
}
