"""The CPU kernels of specdec's own formats: exact int8 and int4 linear layers, attention, norms, the MLP's activation.

Speculative greedy decoding reproduces one-token decoding only if a position's result does not depend on
how many positions are scored together, and verification pays only if scoring nine positions costs little
more than one. The kernels are built for that:

- ``linear(x, packed)``: ``x @ W.T`` with packed weights (``PackedInt8``: int8, one scale per output; ``PackedInt4``:
  4 bits, a step and a minimum per 32 inputs) and int8 activations (one scale per group of a position's inputs, so an
  outlier spoils only its group). Integer products are exact; the float32 steps after them run in a fixed order. The
  weights are packed in blocks of 16 outputs, each read from memory once per call, whatever the number of positions.
- ``attention(...)``: causal (optionally sliding-window, or tree) attention of new positions over a paged KV cache
  (``PagedCache``: float32, bfloat16 or float16, written by the kernel as the new keys arrive): each KV head's keys and
  values are read once for all the queries that share them, and each (position, head) pair is computed over exactly its
  visible keys, in one order; ``rms_norm``, each row alone; ``gated``, the MLP's activation times its up projection,
  every value by one vector code path (torch's activations take other paths at the ends of the slices its threads share,
  so their bits depend on the row count and threads).

One C++ source, compiled on first use with torch's cpp_extension (g++ and ninja, under a minute, then cached in
``build_folder()``) for the best of ``VARIANTS`` this CPU runs: AVX-512 with AMX (tile products for 2 positions or
more), AVX-512 VNNI, AVX2 with AVX-VNNI, AVX2, or ARM NEON with SDOT; all give the same bits. Where none can be built
(no AVX2 or SDOT, no compiler), ``linear`` gives the same numbers from each format's float64 reference (exact, only
slower) and the other kernels are unavailable (the native backend says so).
"""

from __future__ import annotations

import abc
import functools
import logging
import os
import sys
import time
from pathlib import Path

import torch

from specdec.errors import ConfigError
from specdec.machine import cpu_flags

log = logging.getLogger("specdec")
GROUP = 128  # activation inputs per scale (a narrower layer uses the widest of 64 and 32 that divides it)
BLOCK = 16  # outputs per packed block: one AVX-512 vector of int32 sums
FALLBACK_ROWS = 8192  # weight rows per float64 product on the exact path without the kernel
# The compiled module's name: change it with SOURCE (a cached build is reused by name).
BUILD = "specdec_cpu_kernels_v28"

SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__aarch64__)
#include <arm_neon.h>
#else
#include <immintrin.h>
#endif
#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

// The kernels below are written once against 16-lane vectors: vf (float32), vi (int32), and compiled with AVX-512 (one
// register each), AVX2 (two registers each) or NEON (four). Every lane-wise step is the same IEEE operation on each,
// and the horizontal sum takes one fixed order, so the builds give the same bits. Integer dot products of 4 bytes per
// lane: VNNI multiplies unsigned by signed bytes (activations stored with an OFFSET of 128, taken off per group); plain
// AVX2 multiplies |w| by sign(w) * q (no offset), exact as long as |q|, |w| <= 127.
typedef uint32_t vmask;

#if defined(__AVX512F__)
typedef __m512 vf;
typedef __m512i vi;
#define OFFSET 128
#define v_set1_ps _mm512_set1_ps
#define v_setzero_ps _mm512_setzero_ps
#define v_loadu_ps _mm512_loadu_ps
#define v_storeu_ps _mm512_storeu_ps
#define v_add_ps _mm512_add_ps
#define v_sub_ps _mm512_sub_ps
#define v_mul_ps _mm512_mul_ps
#define v_div_ps _mm512_div_ps
#define v_min_ps _mm512_min_ps
#define v_max_ps _mm512_max_ps
#define v_fmadd_ps _mm512_fmadd_ps
#define v_fnmadd_ps _mm512_fnmadd_ps
#define v_abs_ps _mm512_abs_ps
#define v_cvtps_epi32 _mm512_cvtps_epi32
#define v_cvtepi32_ps _mm512_cvtepi32_ps
#define v_scalef_ps _mm512_scalef_ps
#define v_reduce_max_ps _mm512_reduce_max_ps
#define v_reduce_add_epi32 _mm512_reduce_add_epi32
#define v_set1_epi32 _mm512_set1_epi32
#define v_set1_epi8 _mm512_set1_epi8
#define v_setzero_si512 _mm512_setzero_si512
#define v_loadu_si512 _mm512_loadu_si512
#define v_add_epi32 _mm512_add_epi32
#define v_sub_epi32 _mm512_sub_epi32
#define v_mullo_epi32 _mm512_mullo_epi32
#define v_and_si512 _mm512_and_si512
#define v_srli_epi16 _mm512_srli_epi16
static inline vf v_round_ps(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vmask v_not_below(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLT_UQ); }
static inline void v_store_epi8(void* p, vi v) { _mm_storeu_si128((__m128i*)p, _mm512_cvtepi32_epi8(v)); }
static inline vf v_load_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
static inline vf v_load_first(int64_t n, const float* p) {
    return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p);
}
static inline void v_store_first(int64_t n, float* p, vf v) { _mm512_mask_storeu_ps(p, (__mmask16)((1u << n) - 1), v); }
static inline vi v_dot_int8(vi acc, vi a, vi w) { return _mm512_dpbusd_epi32(acc, a, w); }  // a: q + OFFSET
static inline vi v_dot_int4(vi acc, vi u, vi a) { return _mm512_dpbusd_epi32(acc, u, a); }  // u: 0..15
static inline __m256 v_halves(vf x) {
    return _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)), _mm512_castps512_ps256(x));
}
#elif defined(__aarch64__)
// NEON: four registers each. Every vector step mirrors the x86 one bit for bit: fused multiply-adds, IEEE division,
// rounding to nearest even, min and max returning their second operand when a comparison fails, and the same order of
// the horizontal sum. SDOT multiplies signed bytes by signed bytes, so activations carry no offset.
struct vf { float32x4_t q[4]; };
struct vi { int32x4_t q[4]; };
#define OFFSET 0
#define QUAD_F(name, expr) static inline vf name(vf a, vf b) { \
    vf r; \
    for (int j = 0; j < 4; ++j) { const float32x4_t x = a.q[j], y = b.q[j]; r.q[j] = expr; } \
    return r; \
}
#define QUAD_I(name, expr) static inline vi name(vi a, vi b) { \
    vi r; \
    for (int j = 0; j < 4; ++j) { const int32x4_t x = a.q[j], y = b.q[j]; r.q[j] = expr; } \
    return r; \
}
QUAD_F(v_add_ps, vaddq_f32(x, y))
QUAD_F(v_sub_ps, vsubq_f32(x, y))
QUAD_F(v_mul_ps, vmulq_f32(x, y))
QUAD_F(v_div_ps, vdivq_f32(x, y))
QUAD_F(v_min_ps, vbslq_f32(vcltq_f32(x, y), x, y))
QUAD_F(v_max_ps, vbslq_f32(vcgtq_f32(x, y), x, y))
QUAD_I(v_add_epi32, vaddq_s32(x, y))
QUAD_I(v_sub_epi32, vsubq_s32(x, y))
QUAD_I(v_mullo_epi32, vmulq_s32(x, y))
QUAD_I(v_and_si512, vandq_s32(x, y))
static inline vf v_set1_ps(float x) { const float32x4_t v = vdupq_n_f32(x); return {{v, v, v, v}}; }
static inline vf v_setzero_ps() { return v_set1_ps(0.f); }
static inline vf v_loadu_ps(const float* p) {
    return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}};
}
static inline void v_storeu_ps(float* p, vf v) { for (int j = 0; j < 4; ++j) vst1q_f32(p + 4 * j, v.q[j]); }
static inline vf v_fmadd_ps(vf a, vf b, vf c) {
    vf r;
    for (int j = 0; j < 4; ++j) r.q[j] = vfmaq_f32(c.q[j], a.q[j], b.q[j]);
    return r;
}
static inline vf v_fnmadd_ps(vf a, vf b, vf c) {
    vf r;
    for (int j = 0; j < 4; ++j) r.q[j] = vfmsq_f32(c.q[j], a.q[j], b.q[j]);
    return r;
}
static inline vf v_abs_ps(vf a) { vf r; for (int j = 0; j < 4; ++j) r.q[j] = vabsq_f32(a.q[j]); return r; }
static inline vf v_round_ps(vf a) { vf r; for (int j = 0; j < 4; ++j) r.q[j] = vrndnq_f32(a.q[j]); return r; }
static inline vi v_cvtps_epi32(vf a) { vi r; for (int j = 0; j < 4; ++j) r.q[j] = vcvtnq_s32_f32(a.q[j]); return r; }
static inline vf v_cvtepi32_ps(vi a) { vf r; for (int j = 0; j < 4; ++j) r.q[j] = vcvtq_f32_s32(a.q[j]); return r; }
static inline vmask v_not_below(vf a, vf b) {
    static const uint32_t bits[4] = {1, 2, 4, 8};
    vmask mask = 0;
    for (int j = 0; j < 4; ++j)
        mask |= (vmask)vaddvq_u32(vandq_u32(vmvnq_u32(vcltq_f32(a.q[j], b.q[j])), vld1q_u32(bits))) << (4 * j);
    return mask;
}
// p * 2^m for integral m in [-128, 128], as the AVX2 build computes it: two exact power-of-two factors.
static inline vf v_scalef_ps(vf p, vf m) {
    vf r;
    for (int j = 0; j < 4; ++j) {
        const float32x4_t h = vrndmq_f32(vmulq_f32(m.q[j], vdupq_n_f32(0.5f)));
        const int32x4_t bias = vdupq_n_s32(127);
        const float32x4_t a = vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(h), bias), 23));
        const float32x4_t b =
            vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(vsubq_f32(m.q[j], h)), bias), 23));
        r.q[j] = vmulq_f32(vmulq_f32(p.q[j], a), b);
    }
    return r;
}
static inline float v_reduce_max_ps(vf a) {
    return std::max(std::max(vmaxvq_f32(a.q[0]), vmaxvq_f32(a.q[1])), std::max(vmaxvq_f32(a.q[2]), vmaxvq_f32(a.q[3])));
}
static inline int32_t v_reduce_add_epi32(vi a) {
    return vaddvq_s32(vaddq_s32(vaddq_s32(a.q[0], a.q[1]), vaddq_s32(a.q[2], a.q[3])));
}
static inline vi v_set1_epi32(int32_t x) { const int32x4_t v = vdupq_n_s32(x); return {{v, v, v, v}}; }
static inline vi v_set1_epi8(char x) { const int32x4_t v = vreinterpretq_s32_s8(vdupq_n_s8(x)); return {{v, v, v, v}}; }
static inline vi v_setzero_si512() { return v_set1_epi32(0); }
static inline vi v_loadu_si512(const void* p) {
    const int32_t* s = (const int32_t*)p;
    return {{vld1q_s32(s), vld1q_s32(s + 4), vld1q_s32(s + 8), vld1q_s32(s + 12)}};
}
static inline vi v_srli_epi16(vi a, int n) {
    vi r;
    for (int j = 0; j < 4; ++j)
        r.q[j] = vreinterpretq_s32_u16(vshlq_u16(vreinterpretq_u16_s32(a.q[j]), vdupq_n_s16((int16_t)-n)));
    return r;
}
static inline void v_store_epi8(void* p, vi v) {  // the low byte of each lane, in lane order
    const int16x8_t low = vcombine_s16(vmovn_s32(v.q[0]), vmovn_s32(v.q[1]));
    const int16x8_t high = vcombine_s16(vmovn_s32(v.q[2]), vmovn_s32(v.q[3]));
    vst1q_s8((int8_t*)p, vcombine_s8(vmovn_s16(low), vmovn_s16(high)));
}
static inline vf v_load_half(const uint16_t* p) {
    vf r;
    for (int j = 0; j < 4; ++j) r.q[j] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * j)));
    return r;
}
static inline vf v_load_first(int64_t n, const float* p) {
    float lanes[16] = {0.f};
    std::memcpy(lanes, p, std::max<int64_t>(0, std::min<int64_t>(n, 16)) * sizeof(float));
    return v_loadu_ps(lanes);
}
static inline void v_store_first(int64_t n, float* p, vf v) {
    float lanes[16];
    v_storeu_ps(lanes, v);
    std::memcpy(p, lanes, std::max<int64_t>(0, std::min<int64_t>(n, 16)) * sizeof(float));
}
static inline vi v_dot_int8(vi acc, vi a, vi w) {  // a: q, signed
    vi r;
    for (int j = 0; j < 4; ++j)
        r.q[j] = vdotq_s32(acc.q[j], vreinterpretq_s8_s32(a.q[j]), vreinterpretq_s8_s32(w.q[j]));
    return r;
}
static inline vi v_dot_int4(vi acc, vi u, vi a) { return v_dot_int8(acc, u, a); }  // u: 0..15, exact as signed bytes
// The horizontal sum in the x86 builds' order: lanes j + 8 and j, then the upper and lower four, then pairs.
static inline float v_reduce_add_ps(vf x) {
    const float32x4_t t_lo = vaddq_f32(x.q[2], x.q[0]), t_hi = vaddq_f32(x.q[3], x.q[1]);
    const float32x4_t u = vaddq_f32(t_hi, t_lo);
    const float32x4_t w = vaddq_f32(u, vextq_f32(u, u, 2));
    return vgetq_lane_f32(w, 0) + vgetq_lane_f32(w, 1);
}
static inline vf v_load_bf16(const uint16_t* p) {
    vf r;
    for (int j = 0; j < 4; ++j) r.q[j] = vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p + 4 * j), 16));
    return r;
}
#else
struct vf { __m256 lo, hi; };
struct vi { __m256i lo, hi; };
#define PAIR_F(name, op) static inline vf name(vf a, vf b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
#define PAIR_I(name, op) static inline vi name(vi a, vi b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
PAIR_F(v_add_ps, _mm256_add_ps)
PAIR_F(v_sub_ps, _mm256_sub_ps)
PAIR_F(v_mul_ps, _mm256_mul_ps)
PAIR_F(v_div_ps, _mm256_div_ps)
PAIR_F(v_min_ps, _mm256_min_ps)
PAIR_F(v_max_ps, _mm256_max_ps)
PAIR_I(v_add_epi32, _mm256_add_epi32)
PAIR_I(v_sub_epi32, _mm256_sub_epi32)
PAIR_I(v_mullo_epi32, _mm256_mullo_epi32)
PAIR_I(v_and_si512, _mm256_and_si256)
static inline vf v_set1_ps(float x) { const __m256 v = _mm256_set1_ps(x); return {v, v}; }
static inline vf v_setzero_ps() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
static inline vf v_loadu_ps(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void v_storeu_ps(float* p, vf v) { _mm256_storeu_ps(p, v.lo); _mm256_storeu_ps(p + 8, v.hi); }
static inline vf v_fmadd_ps(vf a, vf b, vf c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf v_fnmadd_ps(vf a, vf b, vf c) {
    return {_mm256_fnmadd_ps(a.lo, b.lo, c.lo), _mm256_fnmadd_ps(a.hi, b.hi, c.hi)};
}
static inline vf v_abs_ps(vf a) {
    const __m256 sign = _mm256_set1_ps(-0.f);
    return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
static inline vf v_round_ps(vf a) {
    return {_mm256_round_ps(a.lo, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
            _mm256_round_ps(a.hi, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
}
static inline vi v_cvtps_epi32(vf a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
static inline vf v_cvtepi32_ps(vi a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
static inline vmask v_not_below(vf a, vf b) {
    return (vmask)_mm256_movemask_ps(_mm256_cmp_ps(a.lo, b.lo, _CMP_NLT_UQ)) |
           ((vmask)_mm256_movemask_ps(_mm256_cmp_ps(a.hi, b.hi, _CMP_NLT_UQ)) << 8);
}
// p * 2^m for integral m in [-128, 128] (as AVX-512's scalef): two exact power-of-two factors, one rounding at most.
static inline __m256 scale_by(__m256 p, __m256 m) {
    const __m256 h = _mm256_floor_ps(_mm256_mul_ps(m, _mm256_set1_ps(0.5f)));
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(h), bias), 23));
    const __m256 b =
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(_mm256_sub_ps(m, h)), bias), 23));
    return _mm256_mul_ps(_mm256_mul_ps(p, a), b);
}
static inline vf v_scalef_ps(vf p, vf m) { return {scale_by(p.lo, m.lo), scale_by(p.hi, m.hi)}; }
static inline float v_reduce_max_ps(vf a) {
    const __m256 t = _mm256_max_ps(a.hi, a.lo);
    __m128 u = _mm_max_ps(_mm256_extractf128_ps(t, 1), _mm256_castps256_ps128(t));
    u = _mm_max_ps(u, _mm_shuffle_ps(u, u, _MM_SHUFFLE(1, 0, 3, 2)));
    return std::max(_mm_cvtss_f32(u), _mm_cvtss_f32(_mm_shuffle_ps(u, u, 1)));
}
static inline int32_t v_reduce_add_epi32(vi a) {
    alignas(32) int32_t lanes[8];
    _mm256_store_si256((__m256i*)lanes, _mm256_add_epi32(a.lo, a.hi));
    int32_t sum = 0;
    for (int32_t x : lanes) sum += x;
    return sum;
}
static inline vi v_set1_epi32(int32_t x) { const __m256i v = _mm256_set1_epi32(x); return {v, v}; }
static inline vi v_set1_epi8(char x) { const __m256i v = _mm256_set1_epi8(x); return {v, v}; }
static inline vi v_setzero_si512() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
static inline vi v_loadu_si512(const void* p) {
    return {_mm256_loadu_si256((const __m256i*)p), _mm256_loadu_si256((const __m256i*)p + 1)};
}
static inline vi v_srli_epi16(vi a, int n) { return {_mm256_srli_epi16(a.lo, n), _mm256_srli_epi16(a.hi, n)}; }
static inline void v_store_epi8(void* p, vi v) {  // the low byte of each lane, in lane order
    const __m256i byte = _mm256_set1_epi32(0xFF);
    const __m256i words = _mm256_permute4x64_epi64(
        _mm256_packus_epi32(_mm256_and_si256(v.lo, byte), _mm256_and_si256(v.hi, byte)), 0xD8);
    _mm_storeu_si128((__m128i*)p, _mm_packus_epi16(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1)));
}
static inline vf v_load_half(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
            _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 8)))};
}
static inline __m256i first_lanes(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
static inline vf v_load_first(int64_t n, const float* p) {
    return {_mm256_maskload_ps(p, first_lanes(n)), _mm256_maskload_ps(p + 8, first_lanes(n - 8))};
}
static inline void v_store_first(int64_t n, float* p, vf v) {
    _mm256_maskstore_ps(p, first_lanes(n), v.lo);
    _mm256_maskstore_ps(p + 8, first_lanes(n - 8), v.hi);
}
#if defined(__AVXVNNI__)
#define OFFSET 128
static inline vi v_dot_int8(vi acc, vi a, vi w) {
    return {_mm256_dpbusd_avx_epi32(acc.lo, a.lo, w.lo), _mm256_dpbusd_avx_epi32(acc.hi, a.hi, w.hi)};
}
static inline vi v_dot_int4(vi acc, vi u, vi a) {
    return {_mm256_dpbusd_avx_epi32(acc.lo, u.lo, a.lo), _mm256_dpbusd_avx_epi32(acc.hi, u.hi, a.hi)};
}
#else
#define OFFSET 0
static inline __m256i dot4(__m256i acc, __m256i u, __m256i s) {  // u unsigned, s signed; pairs within int16 here
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
static inline vi v_dot_int8(vi acc, vi a, vi w) {  // a: q, signed
    return {dot4(acc.lo, _mm256_sign_epi8(w.lo, w.lo), _mm256_sign_epi8(a.lo, w.lo)),
            dot4(acc.hi, _mm256_sign_epi8(w.hi, w.hi), _mm256_sign_epi8(a.hi, w.hi))};
}
static inline vi v_dot_int4(vi acc, vi u, vi a) { return {dot4(acc.lo, u.lo, a.lo), dot4(acc.hi, u.hi, a.hi)}; }
#endif
static inline __m256 v_halves(vf x) { return _mm256_add_ps(x.hi, x.lo); }
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

static const char* NON_FINITE = "NaN or infinite activations";
// Activations: per row and group, scale = max(|x|, 1e-8) / 127, q = clamp(round(x / scale), -127, 127), stored as
// q + OFFSET (VNNI multiplies unsigned by signed bytes; the OFFSET * sum(w) this adds is taken off per group).
// Returns false if any x is NaN or infinite (no integer stands for it: the caller refuses the input).
static bool quantize(const float* x, int64_t n, int64_t k, int64_t group, uint8_t* q, float* scales) {
    const int64_t groups = k / group;
    const vf lo = v_set1_ps(-127.f), hi = v_set1_ps(127.f), inf = v_set1_ps(INFINITY);
    const vi offset = v_set1_epi32(OFFSET);
    vmask bad = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            const float* src = x + i * k + g * group;
            vf top = v_setzero_ps();
            for (int64_t c = 0; c < group; c += 16) {
                const vf a = v_abs_ps(v_loadu_ps(src + c));
                bad |= v_not_below(a, inf);  // NaN (unordered) or infinite
                top = v_max_ps(top, a);
            }
            const float scale = std::max(v_reduce_max_ps(top), 1e-8f) / 127.f;
            scales[i * groups + g] = scale;
            const vf divisor = v_set1_ps(scale);
            for (int64_t c = 0; c < group; c += 16) {
                vf v = v_round_ps(v_div_ps(v_loadu_ps(src + c), divisor));
                v = v_min_ps(hi, v_max_ps(lo, v));
                v_store_epi8(q + i * k + g * group + c, v_add_epi32(v_cvtps_epi32(v), offset));
            }
        }
    return bad == 0;
}

// One block of 16 outputs for N rows: per group, int32 sums, then sum * the row's scale added to a float32 total; at
// the end, the total times the channel's scale. Plain arrays and unrolled loops: g++ then keeps them all in registers.
template <int N>
static void tile(const uint8_t* q, const float* qs, const int8_t* wb, const int32_t* gsum, const float* ws, float* out,
                 int64_t k, int64_t group, int64_t outs) {
    const int64_t groups = k / group, quads = group / 4;
    vf total[N];
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) total[i] = v_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        vi acc[N];
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) acc[i] = v_setzero_si512();
        const int8_t* wg = wb + g * group * 16;
        const uint8_t* qg = q + g * group;
        for (int64_t t = 0; t < quads; ++t) {
            const vi w = v_loadu_si512((const void*)(wg + t * 64));
#pragma GCC unroll 16
            for (int i = 0; i < N; ++i) {
                int32_t a4;
                std::memcpy(&a4, qg + i * k + t * 4, 4);
                acc[i] = v_dot_int8(acc[i], v_set1_epi32(a4), w);
            }
        }
        const vi corr = v_mullo_epi32(v_loadu_si512((const void*)(gsum + g * 16)), v_set1_epi32(OFFSET));
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) {
            const vf sum = v_cvtepi32_ps(v_sub_epi32(acc[i], corr));
            total[i] = v_add_ps(total[i], v_mul_ps(sum, v_set1_ps(qs[i * groups + g])));
        }
    }
    const vf scale = v_loadu_ps(ws);
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) v_storeu_ps(out + i * outs, v_mul_ps(total[i], scale));
}

#if defined(__AMX_INT8__)
// AMX: the same int32 group sums from tile products (TDPBUSD, unsigned activations by signed weights, exact), then the
// same float32 steps in the same order as tile<N>, so the bits do not change; only the integer products move from one
// VNNI instruction per row and 4 inputs to one tile instruction per 16 rows and 64 inputs. The packed weights are
// already in the layout a B tile reads: per 4 inputs, 16 outputs of 4 bytes.
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

static bool amx_ready() {  // Linux grants the tile registers' state to a process that asks (once) for it
    static const bool ready = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
    return ready;
}

static void amx_configure(int last) {  // sums, activations: tiles 0, 1 of 16 rows and 3, 4 of `last` rows; weights: 2
    static thread_local TileConfig c;  // (the intrinsic declares a read of the config's first bytes only)
    c = TileConfig{};
    c.palette = 1;
    for (int t = 0; t < 5; ++t) c.colsb[t] = 64;
    c.rows[0] = c.rows[1] = c.rows[2] = 16;
    c.rows[3] = c.rows[4] = (uint8_t)last;
    asm volatile("" ::: "memory");
    _tile_loadconfig(&c);
}

// One group's int32 sums of a block, in tile SUMS, from activations read into tile ACTS (the intrinsics take the
// tiles' numbers as literals).
#define AMX_GROUP(SUMS, ACTS)                                        \
    _tile_zero(SUMS);                                                \
    for (int64_t s = 0; s < steps; ++s) {                            \
        _tile_loadd(ACTS, q + g * group + s * 64, k);                \
        _tile_loadd(2, wb + (g * group + s * 64) * 16, 64);          \
        _tile_dpbusd(SUMS, ACTS, 2);                                 \
    }                                                                \
    _tile_stored(SUMS, sums, 64);

// One block of 16 outputs for `rows` rows: 16 (tiles 0 and 1) or the last few (`last`: tiles 3 and 4).
static void amx_block(const uint8_t* q, const float* qs, const int8_t* wb, const int32_t* gsum, const float* ws,
                      float* out, int64_t rows, bool last, int64_t k, int64_t group, int64_t outs) {
    const int64_t groups = k / group, steps = group / 64;
    alignas(64) int32_t sums[16 * 16];
    vf total[16];
    for (int64_t i = 0; i < rows; ++i) total[i] = v_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        if (last) {
            AMX_GROUP(3, 4)
        } else {
            AMX_GROUP(0, 1)
        }
        const vi corr = v_mullo_epi32(v_loadu_si512((const void*)(gsum + g * 16)), v_set1_epi32(OFFSET));
        for (int64_t i = 0; i < rows; ++i) {
            const vf sum = v_cvtepi32_ps(v_sub_epi32(v_loadu_si512((const void*)(sums + i * 16)), corr));
            total[i] = v_add_ps(total[i], v_mul_ps(sum, v_set1_ps(qs[i * groups + g])));
        }
    }
    const vf scale = v_loadu_ps(ws);
    for (int64_t i = 0; i < rows; ++i) v_storeu_ps(out + i * outs, v_mul_ps(total[i], scale));
}
#undef AMX_GROUP

static void amx_linear(const uint8_t* qp, const float* qsp, const int8_t* w, const int32_t* gs, const float* ws,
                       float* out, int64_t n, int64_t k, int64_t group, int64_t blocks, int64_t outs) {
    const int64_t groups = k / group, full = n / 16 * 16;
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        amx_configure((int)std::max<int64_t>(1, n - full));
        for (int64_t b = begin; b < end; ++b) {  // a block's weights stay in L1 for all the rows
            const int8_t* wb = w + b * 16 * k;
            for (int64_t r = 0; r < full; r += 16)
                amx_block(qp + r * k, qsp + r * groups, wb, gs + b * groups * 16, ws + b * 16, out + r * outs + b * 16,
                          16, false, k, group, outs);
            if (full < n)
                amx_block(qp + full * k, qsp + full * groups, wb, gs + b * groups * 16, ws + b * 16,
                          out + full * outs + b * 16, n - full, true, k, group, outs);
        }
        _tile_release();
    });
}
// Whether int8 layers of 2 positions or more multiply in AMX tiles here: the AMX build, where Linux grants their state.
bool tiles_in_use() { return amx_ready(); }
#else
bool tiles_in_use() { return false; }
#endif
#define AMX_MIN_ROWS 2  // one row reads every weight for one product: VNNI keeps up with memory there

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor gsum,
                          int64_t group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x: contiguous float32 [n, k]");
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kInt8 && packed.is_contiguous(),
                "packed int8 weights");
    const int64_t n = x.size(0), k = x.size(1), blocks = packed.size(0), outs = blocks * 16;
    TORCH_CHECK(packed.size(1) * 4 == k && packed.size(2) == 16 && packed.size(3) == 4,
                "weights packed for another shape");
    TORCH_CHECK(group > 0 && group % 16 == 0 && k % group == 0,
                "the group must be a multiple of 16 that divides the width");
    TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == outs && w_scale.is_contiguous(),
                "one float32 scale per output");
    TORCH_CHECK(gsum.scalar_type() == torch::kInt32 && gsum.numel() == outs * (k / group) && gsum.is_contiguous(),
                "int32 group sums");
    auto y = torch::empty({n, outs}, torch::kFloat32);
    auto q = torch::empty({n, k}, torch::kUInt8);
    auto qs = torch::empty({n, k / group}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;  // the server's event loop runs while a step computes
    TORCH_CHECK(quantize(x.data_ptr<float>(), n, k, group, q.data_ptr<uint8_t>(), qs.data_ptr<float>()), NON_FINITE);
    const uint8_t* qp = q.data_ptr<uint8_t>();
    const float* qsp = qs.data_ptr<float>();
    const int8_t* w = packed.data_ptr<int8_t>();
    const int32_t* gs = gsum.data_ptr<int32_t>();
    const float* ws = w_scale.data_ptr<float>();
    float* out = y.data_ptr<float>();
#if defined(__AMX_INT8__)
    if (n >= AMX_MIN_ROWS && group % 64 == 0 && amx_ready()) {
        amx_linear(qp, qsp, w, gs, ws, out, n, k, group, blocks, outs);
        return y;
    }
#endif
    const int64_t groups = k / group;
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            for (int64_t r = 0; r < n; r += 12) {  // a block's weights stay in L1 for every 12 rows after the first
                auto args = std::make_tuple(qp + r * k, qsp + r * groups, w + b * 16 * k, gs + b * groups * 16,
                                            ws + b * 16, out + r * outs + b * 16, k, group, outs);
                switch (std::min<int64_t>(12, n - r)) {
#define CASE(N) case N: std::apply(tile<N>, args); break;
                    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
                }
            }
        }
    });
    return y;
}

// Activations for int4 layers: per row and group of 32, scale = max(|x|, 1e-8) / 127, q = clamp(round(x / scale),
// -127, 127) as signed bytes, and the group's sum of q as a float (exact; a weight is d u + m, so
// dot(q, w) = d dot(q, u) + m sum(q)).
static bool quantize_signed(const float* x, int64_t n, int64_t k, int8_t* q, float* scales, float* sums) {
    const int64_t groups = k / 32;
    const vf lo = v_set1_ps(-127.f), hi = v_set1_ps(127.f), inf = v_set1_ps(INFINITY);
    vmask bad = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            const float* src = x + i * k + g * 32;
            const vf a = v_loadu_ps(src), b = v_loadu_ps(src + 16);
            bad |= v_not_below(v_abs_ps(a), inf) | v_not_below(v_abs_ps(b), inf);
            const float scale = std::max(v_reduce_max_ps(v_max_ps(v_abs_ps(a), v_abs_ps(b))), 1e-8f) / 127.f;
            scales[i * groups + g] = scale;
            const vf divisor = v_set1_ps(scale);
            const vi qa = v_cvtps_epi32(v_min_ps(hi, v_max_ps(lo, v_round_ps(v_div_ps(a, divisor)))));
            const vi qb = v_cvtps_epi32(v_min_ps(hi, v_max_ps(lo, v_round_ps(v_div_ps(b, divisor)))));
            v_store_epi8(q + i * k + g * 32, qa);
            v_store_epi8(q + i * k + g * 32 + 16, qb);
            sums[i * groups + g] = (float)v_reduce_add_epi32(v_add_epi32(qa, qb));
        }
    return bad == 0;
}

// One block of 16 outputs of an int4 layer for N rows. Per group of 32 inputs: 256 bytes of weights u in [0, 15] (4
// vectors; in each, 16 outputs x 4 inputs of one quad in the low nibbles and of the next quad in the high ones), an
// int32 sum of q u per row; then (sum * d + m * sum(q)) * the row's scale (d, m: the 16 outputs' float16 step and
// minimum), added to a float32 total. Each row's steps are the same whatever N is.
template <int N>
static void tile4(const int8_t* q, const float* qs, const float* qsum, const uint8_t* wb, const uint16_t* ws,
                  const uint16_t* wm, float* out, int64_t k, int64_t outs) {
    const int64_t groups = k / 32;
    const vi low = v_set1_epi8(0x0F);
    vf total[N];
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) total[i] = v_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        vi acc[N];
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) acc[i] = v_setzero_si512();
        const uint8_t* wg = wb + g * 256;
        const int8_t* qg = q + g * 32;
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
            const vi v = v_loadu_si512((const void*)(wg + t * 64));
            const vi w0 = v_and_si512(v, low), w1 = v_and_si512(v_srli_epi16(v, 4), low);
#pragma GCC unroll 16
            for (int i = 0; i < N; ++i) {
                int32_t a0, a1;
                std::memcpy(&a0, qg + i * k + t * 8, 4);
                std::memcpy(&a1, qg + i * k + t * 8 + 4, 4);
                acc[i] = v_dot_int4(acc[i], w0, v_set1_epi32(a0));
                acc[i] = v_dot_int4(acc[i], w1, v_set1_epi32(a1));
            }
        }
        const vf step = v_load_half(ws + g * 16);
        const vf least = v_load_half(wm + g * 16);
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) {
            const vf dot = v_add_ps(v_mul_ps(v_cvtepi32_ps(acc[i]), step),
                                             v_mul_ps(least, v_set1_ps(qsum[i * groups + g])));
            total[i] = v_add_ps(total[i], v_mul_ps(dot, v_set1_ps(qs[i * groups + g])));
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) v_storeu_ps(out + i * outs, total[i]);
}

torch::Tensor int4_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor steps, torch::Tensor minima) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x: contiguous float32 [n, k]");
    TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous() &&
                    packed.size(2) == 256,
                "packed int4 weights [blocks, groups, 256]");
    const int64_t n = x.size(0), k = x.size(1), blocks = packed.size(0), groups = packed.size(1), outs = blocks * 16;
    TORCH_CHECK(k == groups * 32, "weights packed for another width");
    TORCH_CHECK(steps.scalar_type() == torch::kFloat16 && steps.is_contiguous() && steps.numel() == outs * groups,
                "one float16 step per output and group");
    TORCH_CHECK(minima.scalar_type() == torch::kFloat16 && minima.is_contiguous() && minima.numel() == outs * groups,
                "one float16 minimum per output and group");
    auto y = torch::empty({n, outs}, torch::kFloat32);
    auto q = torch::empty({n, k}, torch::kInt8);
    auto qs = torch::empty({n, groups}, torch::kFloat32);
    auto qsum = torch::empty({n, groups}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;
    TORCH_CHECK(quantize_signed(x.data_ptr<float>(), n, k, q.data_ptr<int8_t>(), qs.data_ptr<float>(),
                                qsum.data_ptr<float>()),
                NON_FINITE);
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* qsp = qs.data_ptr<float>();
    const float* qsump = qsum.data_ptr<float>();
    const uint8_t* w = packed.data_ptr<uint8_t>();
    const uint16_t* ws = (const uint16_t*)steps.data_ptr<at::Half>();
    const uint16_t* wm = (const uint16_t*)minima.data_ptr<at::Half>();
    float* out = y.data_ptr<float>();
    at::parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            for (int64_t r = 0; r < n; r += 8) {
                auto args = std::make_tuple(qp + r * k, qsp + r * groups, qsump + r * groups, w + b * groups * 256,
                                            ws + b * groups * 16, wm + b * groups * 16, out + r * outs + b * 16,
                                            k, outs);
                switch (std::min<int64_t>(8, n - r)) {
#define CASE(N) case N: std::apply(tile4<N>, args); break;
                    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                }
            }
        }
    });
    return y;
}

// The KV cache's element types: float32 (0), bfloat16 (1), float16 (2). Values are rounded to nearest even once, when
// written, and read back as float32, so a key has the same bits whichever positions are scored with it.
#if !defined(__aarch64__)  // (NEON's is with its vector layer)
static inline vf v_load_bf16(const uint16_t* p) {
#if defined(__AVX512F__)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
#else
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)),
            _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16))};
#endif
}
#endif
template <int KIND> static inline vf v_load_kv(const char* p) {
    if constexpr (KIND == 0) return v_loadu_ps((const float*)p);
    else if constexpr (KIND == 1) return v_load_bf16((const uint16_t*)p);
    else return v_load_half((const uint16_t*)p);
}
static void store_kv(int64_t kind, char* to, const float* x, int64_t dim) {
    if (kind == 0) std::memcpy(to, x, dim * sizeof(float));
    for (int64_t e = 0; kind == 1 && e < dim; ++e) ((uint16_t*)to)[e] = c10::BFloat16(x[e]).x;
    for (int64_t e = 0; kind == 2 && e < dim; ++e) ((uint16_t*)to)[e] = c10::Half(x[e]).x;
}

// A layer's pages: `table[p]` is the address of page p, [2, kv heads, page, dim] (keys, then values), or 0 if not held.
struct Pages {
    const int64_t* table;
    int64_t count, page, kv_heads, dim, bytes, shift;  // pages in the table, positions per page (2^shift), element size
    char* at(int64_t part, int64_t head, int64_t index) const {
        return (char*)table[index >> shift] + ((part * kv_heads + head) * page + (index & (page - 1))) * dim * bytes;
    }
    bool held(int64_t from, int64_t to) const {  // every page of positions from..to-1
        for (int64_t p = from / page; p < (to + page - 1) / page; ++p)
            if (p >= count || table[p] == 0) return false;
        return true;
    }
};

static Pages pages_of(torch::Tensor tables, int64_t layer, int64_t kind, int64_t page, int64_t kv_heads, int64_t dim) {
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.is_contiguous() && layer >= 0 &&
                    layer < tables.size(0), "tables: contiguous int64 [layers, pages]");
    TORCH_CHECK(kind >= 0 && kind <= 2 && page > 0 && (page & (page - 1)) == 0, "cache kind 0, 1 or 2, pages of 2^k");
    int64_t shift = 0;
    while ((int64_t{1} << shift) < page) ++shift;
    return {tables.data_ptr<int64_t>() + layer * tables.size(1), tables.size(1), page, kv_heads, dim,
            kind == 0 ? 4 : 2, shift};
}

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

// The body of `attention`, for one cache element type. Each task takes a chunk of one KV head's queries and reads that
// head's keys and values once, a block at a time, for all of them; the chunks only spread the work over threads. A
// query's arithmetic is the same in any chunk and at any n: its visible keys in cache order, the scores, their maximum,
// exp and sum, then per output lane sum(p v) in key order.
template <int KIND>
static void attend(const float* qp, float* op, const Pages& pages, int64_t n, int64_t heads, int64_t start,
                   int64_t window, float scale, const uint8_t* seen, const std::vector<int64_t>& position) {
    const int64_t dim = pages.dim, kv_heads = pages.kv_heads, group = heads / kv_heads, queries = n * group;
    const bool tree = seen != nullptr;
    const int64_t bytes = pages.bytes, values = kv_heads * pages.page * dim * bytes;  // a page's keys, then its values
    const int64_t per_head =
        std::max<int64_t>(1, (2 * at::get_num_threads() + kv_heads - 1) / kv_heads);  // ~2 a thread
    const int64_t chunk = std::min<int64_t>(64, (queries + per_head - 1) / per_head);  // bounds each task's lists
    const int64_t chunks = (queries + chunk - 1) / chunk;
    at::parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
        std::vector<std::vector<int64_t>> reads(chunk);
        std::vector<std::vector<const char*>> rows(chunk);  // each read key's address (its value's: + values)
        std::vector<std::vector<float>> scores(chunk);
        std::vector<float> acc(chunk * dim), total(chunk);
        std::vector<size_t> cursor(chunk);
        for (int64_t task = begin; task < end; ++task) {
            const int64_t kv = task / chunks, first = (task % chunks) * chunk, count = std::min(chunk, queries - first);
            int64_t last = 0;  // one past the highest key any query of the chunk reads
            for (int64_t c = 0; c < count; ++c) {
                const int64_t i = (first + c) / group, pos = position[i];
                const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
                auto& read = reads[c];
                read.clear();
                for (int64_t j = lo; j < (tree ? start : pos + 1); ++j) read.push_back(j);
                if (tree)
                    for (int64_t j = 0; j < n; ++j)
                        if (seen[i * n + j] && position[j] >= lo) read.push_back(start + j);
                if (!read.empty()) last = std::max(last, read.back() + 1);
                scores[c].resize(read.size());
                rows[c].resize(read.size());
                for (size_t r = 0; r < read.size(); ++r) rows[c][r] = pages.at(0, kv, read[r]);
            }
            const int64_t block = 64;
            // queries c .. c + 3 are four heads of one position (the same keys, in the same order) that share each
            // key's and value's load; which queries share depends on the chunking, but a query's arithmetic is the
            // same shared or alone, so its bits do not
            auto shares = [&](int64_t c) {
                return c + 4 <= count && (first + c) % group % 4 == 0 && (first + c) % group + 4 <= group;
            };
            std::fill(cursor.begin(), cursor.end(), 0);
            for (int64_t b = 0; b < last; b += block)  // scores: each block of keys once for the whole chunk
                for (int64_t c = 0; c < count; ++c) {
                    if (shares(c)) {  // four heads of one position: each key read once for the four
                        const int64_t i = (first + c) / group, h = kv * group + (first + c) % group;
                        const float* q0 = qp + (i * heads + h) * dim;
                        const auto& read = reads[c];
                        size_t& r = cursor[c];
                        for (; r < read.size() && read[r] < b + block; ++r) {
                            const char* key = rows[c][r];
                            vf s0 = v_setzero_ps(), s1 = v_setzero_ps(), s2 = v_setzero_ps(), s3 = v_setzero_ps();
                            for (int64_t d = 0; d < dim; d += 16) {
                                const vf kd = v_load_kv<KIND>(key + d * bytes);
                                s0 = v_fmadd_ps(v_loadu_ps(q0 + d), kd, s0);
                                s1 = v_fmadd_ps(v_loadu_ps(q0 + dim + d), kd, s1);
                                s2 = v_fmadd_ps(v_loadu_ps(q0 + 2 * dim + d), kd, s2);
                                s3 = v_fmadd_ps(v_loadu_ps(q0 + 3 * dim + d), kd, s3);
                            }
                            scores[c][r] = v_reduce_add_ps(s0) * scale;
                            scores[c + 1][r] = v_reduce_add_ps(s1) * scale;
                            scores[c + 2][r] = v_reduce_add_ps(s2) * scale;
                            scores[c + 3][r] = v_reduce_add_ps(s3) * scale;
                        }
                        cursor[c + 1] = cursor[c + 2] = cursor[c + 3] = r;
                        c += 3;
                        continue;
                    }
                    const auto& read = reads[c];
                    const int64_t i = (first + c) / group, h = kv * group + (first + c) % group;
                    const float* query = qp + (i * heads + h) * dim;
                    size_t& r = cursor[c];
                    // four keys at a time, each its own chain of the same steps: the chains overlap in the CPU
                    for (; r + 4 <= read.size() && read[r + 3] < b + block; r += 4) {
                        const char *k0 = rows[c][r], *k1 = rows[c][r + 1], *k2 = rows[c][r + 2], *k3 = rows[c][r + 3];
                        vf s0 = v_setzero_ps(), s1 = v_setzero_ps(), s2 = v_setzero_ps(), s3 = v_setzero_ps();
                        for (int64_t d = 0; d < dim; d += 16) {
                            const vf qd = v_loadu_ps(query + d);
                            s0 = v_fmadd_ps(qd, v_load_kv<KIND>(k0 + d * bytes), s0);
                            s1 = v_fmadd_ps(qd, v_load_kv<KIND>(k1 + d * bytes), s1);
                            s2 = v_fmadd_ps(qd, v_load_kv<KIND>(k2 + d * bytes), s2);
                            s3 = v_fmadd_ps(qd, v_load_kv<KIND>(k3 + d * bytes), s3);
                        }
                        scores[c][r] = v_reduce_add_ps(s0) * scale;
                        scores[c][r + 1] = v_reduce_add_ps(s1) * scale;
                        scores[c][r + 2] = v_reduce_add_ps(s2) * scale;
                        scores[c][r + 3] = v_reduce_add_ps(s3) * scale;
                    }
                    for (; r < read.size() && read[r] < b + block; ++r) {
                        const char* key = rows[c][r];
                        vf sum = v_setzero_ps();
                        for (int64_t d = 0; d < dim; d += 16)
                            sum = v_fmadd_ps(v_loadu_ps(query + d), v_load_kv<KIND>(key + d * bytes), sum);
                        scores[c][r] = v_reduce_add_ps(sum) * scale;
                    }
                }
            for (int64_t c = 0; c < count; ++c) {
                float top = -INFINITY;
                for (float s : scores[c]) top = std::max(top, s);
                float* e = scores[c].data();
                const int64_t size = (int64_t)scores[c].size();
                const vf shift = v_set1_ps(top);
                for (int64_t r = 0; r < size; r += 16) {  // every score by one vector path, the tail masked
                    const int64_t lanes = std::min<int64_t>(16, size - r);
                    v_store_first(lanes, e + r, v_exp(v_sub_ps(v_load_first(lanes, e + r), shift)));
                }
                float sum = 0.f;
                for (int64_t r = 0; r < size; ++r) sum += e[r];
                total[c] = sum;
                std::fill(acc.begin() + c * dim, acc.begin() + (c + 1) * dim, 0.f);
            }
            std::fill(cursor.begin(), cursor.end(), 0);
            for (int64_t b = 0; b < last; b += block)  // values: each block once, p v added in key order per lane
                for (int64_t c = 0; c < count; ++c) {
                    if (shares(c)) {  // four heads of one position: each value read once for the four
                        const auto& read = reads[c];
                        size_t& r = cursor[c];
                        const size_t from = r;
                        while (r < read.size() && read[r] < b + block) ++r;
                        const float *p0 = scores[c].data(), *p1 = scores[c + 1].data(), *p2 = scores[c + 2].data(),
                                    *p3 = scores[c + 3].data();
                        float* a = acc.data() + c * dim;
                        for (int64_t d = 0; d < dim; d += 16) {
                            vf l0 = v_loadu_ps(a + d), l1 = v_loadu_ps(a + dim + d), l2 = v_loadu_ps(a + 2 * dim + d),
                               l3 = v_loadu_ps(a + 3 * dim + d);
                            for (size_t x = from; x < r; ++x) {
                                const vf value = v_load_kv<KIND>(rows[c][x] + values + d * bytes);
                                l0 = v_fmadd_ps(v_set1_ps(p0[x]), value, l0);
                                l1 = v_fmadd_ps(v_set1_ps(p1[x]), value, l1);
                                l2 = v_fmadd_ps(v_set1_ps(p2[x]), value, l2);
                                l3 = v_fmadd_ps(v_set1_ps(p3[x]), value, l3);
                            }
                            v_storeu_ps(a + d, l0);
                            v_storeu_ps(a + dim + d, l1);
                            v_storeu_ps(a + 2 * dim + d, l2);
                            v_storeu_ps(a + 3 * dim + d, l3);
                        }
                        cursor[c + 1] = cursor[c + 2] = cursor[c + 3] = r;
                        c += 3;
                        continue;
                    }
                    const auto& read = reads[c];
                    float* a = acc.data() + c * dim;
                    size_t& r = cursor[c];
                    const size_t from = r;
                    while (r < read.size() && read[r] < b + block) ++r;
                    int64_t d = 0;
                    for (; d + 64 <= dim; d += 64) {  // four lanes at a time, each its own chain in key order
                        vf l0 = v_loadu_ps(a + d), l1 = v_loadu_ps(a + d + 16), l2 = v_loadu_ps(a + d + 32),
                           l3 = v_loadu_ps(a + d + 48);
                        for (size_t x = from; x < r; ++x) {
                            const vf p = v_set1_ps(scores[c][x]);
                            const char* value = rows[c][x] + values + d * bytes;
                            l0 = v_fmadd_ps(p, v_load_kv<KIND>(value), l0);
                            l1 = v_fmadd_ps(p, v_load_kv<KIND>(value + 16 * bytes), l1);
                            l2 = v_fmadd_ps(p, v_load_kv<KIND>(value + 32 * bytes), l2);
                            l3 = v_fmadd_ps(p, v_load_kv<KIND>(value + 48 * bytes), l3);
                        }
                        v_storeu_ps(a + d, l0);
                        v_storeu_ps(a + d + 16, l1);
                        v_storeu_ps(a + d + 32, l2);
                        v_storeu_ps(a + d + 48, l3);
                    }
                    for (; d < dim; d += 16) {
                        vf lane = v_loadu_ps(a + d);
                        for (size_t x = from; x < r; ++x)
                            lane = v_fmadd_ps(v_set1_ps(scores[c][x]),
                                              v_load_kv<KIND>(rows[c][x] + values + d * bytes), lane);
                        v_storeu_ps(a + d, lane);
                    }
                }
            for (int64_t c = 0; c < count; ++c) {
                const int64_t i = (first + c) / group, h = kv * group + (first + c) % group;
                float* o = op + (i * heads + h) * dim;
                for (int64_t d = 0; d < dim; d += 16)
                    v_storeu_ps(o + d, v_div_ps(v_loadu_ps(acc.data() + c * dim + d), v_set1_ps(total[c])));
            }
        }
    });
}

// q: [n, heads, dim]; k, v: the n new positions' keys and values [n, kv heads, dim], written first into the layer's
// pages at start..start+n-1. With `visible` empty the new positions are a chain: position start + i sees keys
// lo..start + i (lo: the sliding window's first key, or 0). Otherwise `visible` (uint8 [n, n]) is a tree: new position
// i sees the cached keys from lo and the new ones j with visible[i][j] (itself and its ancestors), at its position in
// the text, `positions[i]` (start + its depth). Keys are read in cache order, so a tree node's result has the same bits
// as the same token decoded along its path alone.
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor tables, int64_t layer,
                        int64_t kind, int64_t page, int64_t start, int64_t window, double scale, torch::Tensor visible,
                        torch::Tensor positions) {
    TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
                "q: contiguous float32 [n, heads, dim]");
    const int64_t n = q.size(0), heads = q.size(1), dim = q.size(2);
    TORCH_CHECK(k.dim() == 3 && k.scalar_type() == torch::kFloat32 && k.is_contiguous() &&
                    k.size(0) == n && k.size(2) == dim && k.sizes() == v.sizes() &&
                    v.scalar_type() == torch::kFloat32 && v.is_contiguous(),
                "k, v: contiguous float32 [n, kv heads, dim]");
    const int64_t kv_heads = k.size(1);
    TORCH_CHECK(dim % 16 == 0 && kv_heads > 0 && heads % kv_heads == 0 && start >= 0, "attention shapes");
    const Pages pages = pages_of(tables, layer, kind, page, kv_heads, dim);
    const int64_t lowest = window > 0 ? std::max<int64_t>(0, start - window + 1) : 0;  // the first key any query reads
    TORCH_CHECK(pages.held(std::min(lowest, start), start + n), "the cache does not hold the pages this step reads");
    const bool tree = visible.numel() > 0;
    TORCH_CHECK(!tree || (visible.scalar_type() == torch::kUInt8 && visible.is_contiguous() && visible.size(0) == n &&
                          visible.size(1) == n),
                "visible: contiguous uint8 [n, n]");
    TORCH_CHECK(!tree || (positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                          positions.numel() == n),
                "positions: contiguous int64 [n]");
    auto out = torch::empty_like(q);
    pybind11::gil_scoped_release no_gil;
    const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < kv_heads; ++h) {
            store_kv(kind, pages.at(0, h, start + i), kp + (i * kv_heads + h) * dim, dim);
            store_kv(kind, pages.at(1, h, start + i), vp + (i * kv_heads + h) * dim, dim);
        }
    if (n == 0) return out;
    std::vector<int64_t> position(n);  // of each new key and query in the text
    for (int64_t i = 0; i < n; ++i) position[i] = tree ? positions.data_ptr<int64_t>()[i] : start + i;
    const uint8_t* seen = tree ? visible.data_ptr<uint8_t>() : nullptr;
    const float* qp = q.data_ptr<float>();
    float* op = out.data_ptr<float>();
    if (kind == 0) attend<0>(qp, op, pages, n, heads, start, window, (float)scale, seen, position);
    else if (kind == 1) attend<1>(qp, op, pages, n, heads, start, window, (float)scale, seen, position);
    else attend<2>(qp, op, pages, n, heads, start, window, (float)scale, seen, position);
    return out;
}

// A tree's accepted path: the keys and values at `sources` (ascending cache indices) move to target, target + 1, ...,
// in every layer's pages (each source at or after its target, so moving in order overwrites nothing still to move).
void move_positions(torch::Tensor tables, int64_t kind, int64_t page, int64_t kv_heads, int64_t dim,
                    torch::Tensor sources, int64_t target) {
    TORCH_CHECK(sources.scalar_type() == torch::kInt64 && sources.is_contiguous() && sources.dim() == 1,
                "sources: int64 [m]");
    TORCH_CHECK(target >= 0, "the path's first position is not negative");
    const int64_t m = sources.numel(), *from = sources.data_ptr<int64_t>();
    for (int64_t r = 0; r < m; ++r)
        TORCH_CHECK(from[r] >= target + r && (r == 0 || from[r] > from[r - 1]),
                    "sources ascend, each at or after its target");
    for (int64_t layer = 0; layer < tables.size(0); ++layer) {
        const Pages pages = pages_of(tables, layer, kind, page, kv_heads, dim);
        TORCH_CHECK(m == 0 || pages.held(target, from[m - 1] + 1), "the cache does not hold the positions to move");
        for (int64_t r = 0; r < m; ++r)
            if (from[r] != target + r)
                for (int64_t part = 0; part < 2; ++part)
                    for (int64_t h = 0; h < kv_heads; ++h)
                        std::memcpy(pages.at(part, h, target + r), pages.at(part, h, from[r]), dim * pages.bytes);
    }
}

// act(gate) * up for rows [n, 2f] (gate: a row's first f values, up: its last f); act = SiLU (kind 0) or GELU's tanh
// form (kind 1). Every value by the same vector code, a row's tail through a mask, so a value does not depend on how
// many rows are computed together or on the threads that share them (torch's own activations take other paths at
// slice ends).
torch::Tensor gated(torch::Tensor gate_up, int64_t kind) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous() &&
                    gate_up.size(1) % 2 == 0,
                "gate_up: contiguous float32 [n, 2f]");
    TORCH_CHECK(kind == 0 || kind == 1, "the activation is SiLU (0) or GELU (1)");
    const int64_t n = gate_up.size(0), f = gate_up.size(1) / 2;
    auto out = torch::empty({n, f}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;
    const float* xp = gate_up.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const vf one = v_set1_ps(1.f), half = v_set1_ps(0.5f), two = v_set1_ps(2.f);
    const vf root = v_set1_ps(0.7978845608028654f), cubic = v_set1_ps(0.044715f);
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
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
    return out;
}

// x * rsqrt(mean(x^2) + eps) * w over the last dimension, each row alone in one order (float32).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && w.scalar_type() == torch::kFloat32 &&
                    w.is_contiguous(),
                "contiguous float32 tensors");
    const int64_t dim = w.numel();
    TORCH_CHECK(dim > 0 && dim % 16 == 0 && x.dim() >= 1 && x.size(-1) == dim,
                "the norm's width must be a multiple of 16 and match x");
    const int64_t rows = x.numel() / dim;
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    float* op = out.data_ptr<float>();
    for (int64_t r = 0; r < rows; ++r) {
        const float* row = xp + r * dim;
        vf acc = v_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16) {
            const vf v = v_loadu_ps(row + d);
            acc = v_add_ps(acc, v_mul_ps(v, v));
        }
        const vf inv = v_set1_ps(1.f / std::sqrt(v_reduce_add_ps(acc) / (float)dim + (float)eps));
        for (int64_t d = 0; d < dim; d += 16)
            v_storeu_ps(op + r * dim + d, v_mul_ps(v_mul_ps(v_loadu_ps(row + d), inv), v_loadu_ps(wp + d)));
    }
    return out;
}
"""


class Packed(torch.nn.Module, abc.ABC):
    """A linear layer's weights in one of the native formats, for ``linear``."""

    format: str  # "int8" or "int4"
    in_features: int
    out_features: int
    packed: torch.Tensor  # the weights' integers, block-major (every format's main buffer)

    @abc.abstractmethod
    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        """``rows @ W.T`` [n, outputs padded to a block] by the compiled kernels."""

    @abc.abstractmethod
    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        """The kernel's numbers [n, out_features] from float64 products of the same integers (a test oracle; slow)."""

    @property
    def nbytes(self) -> int:
        """Bytes one product reads from memory (every buffer)."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def state(self) -> dict:
        """The packed buffers and sizes (``restore`` rebuilds the layer from them without quantizing again)."""
        return {"format": self.format, "in": self.in_features, "out": self.out_features} | dict(self.named_buffers())

    @staticmethod
    def restore(state: dict) -> Packed:
        layer = FORMATS[state["format"]].__new__(FORMATS[state["format"]])
        torch.nn.Module.__init__(layer)
        layer.in_features, layer.out_features = state["in"], state["out"]
        for name, value in state.items():
            if isinstance(value, torch.Tensor):
                layer.register_buffer(name, value)
        layer.restored()
        return layer

    def restored(self) -> None:
        """Set what the buffers imply (after ``restore``)."""


# Weight rows quantized at a time (a multiple of BLOCK): a layer's temporaries stay small, whatever its size.
CHUNK = 4096


class _Packer(Packed):
    """Packs a weight matrix in chunks of outputs into block-major buffers allocated once (memory: the result, plus
    one chunk's float32 temporaries)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        if weight.dim() != 2 or 0 in weight.shape:
            raise ValueError(
                f"an {self.format} layer's weight must be a non-empty matrix, not of shape {tuple(weight.shape)}"
            )
        self.out_features, self.in_features = weight.shape
        self.check_width(self.in_features)
        blocks = -(-self.out_features // BLOCK)
        buffers: dict[str, torch.Tensor] = {}
        for start in range(0, self.out_features, CHUNK):
            chunk = weight[start : start + CHUNK].detach().float()
            if not bool(torch.isfinite(chunk).all()):
                raise ValueError(
                    f"an {self.format} layer's weight holds NaN or infinite values: the model file is damaged"
                )
            pad = -len(chunk) % BLOCK  # zero outputs up to a whole block, cut off again by linear()
            for name, part in self.pack(torch.nn.functional.pad(chunk, (0, 0, 0, pad))).items():
                if name not in buffers:
                    buffers[name] = torch.empty((blocks, *part.shape[1:]), dtype=part.dtype)
                buffers[name][start // BLOCK : start // BLOCK + len(part)] = part
        for name, buffer in buffers.items():
            self.register_buffer(name, buffer)
        self.restored()

    @abc.abstractmethod
    def check_width(self, width: int) -> None:
        """Raise a ValueError if the format cannot hold layers of ``width`` inputs."""

    @abc.abstractmethod
    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """The buffers [blocks, ...] of float32 weight rows (a whole number of blocks)."""


class PackedInt8(_Packer):
    """int8 weights in VNNI blocks, a scale per output, int32 sums per group (activations: int8 per 128 inputs)."""

    format = "int8"

    def check_width(self, width: int) -> None:
        if not any(width % g == 0 for g in (GROUP, 64, 32)):
            raise ValueError(f"int8 layers need an input width that is a multiple of 32, not {width}")

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        width, group = rows.shape[1], next(g for g in (GROUP, 64, 32) if rows.shape[1] % g == 0)
        w8, scale = quantize_rows(rows)
        scale = torch.where(rows.abs().amax(dim=1) == 0, torch.ones_like(scale), scale)  # padding rows: scale 1
        blocks = len(rows) // BLOCK
        sums = w8.reshape(blocks, BLOCK, width // group, group).sum(dim=3, dtype=torch.int32)
        return {
            "packed": w8.reshape(blocks, BLOCK, width // 4, 4).transpose(1, 2),
            "scale": scale.reshape(blocks, BLOCK),
            "group_sums": sums.transpose(1, 2),
        }

    def restored(self) -> None:
        self.group = self.in_features // self.group_sums.shape[1]

    def unpacked(self, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """int8 weight rows [start, stop) as [rows, in_features]."""
        blocks = self.packed[start // BLOCK : -(-(stop or self.packed.shape[0] * BLOCK) // BLOCK)]
        rows = blocks.transpose(1, 2).reshape(-1, self.in_features)
        return rows[start % BLOCK : start % BLOCK + (stop or rows.shape[0]) - start]

    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel.int8_linear(rows, self.packed, self.scale, self.group_sums, self.group)

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        q, q_scale = quantize_rows(rows, self.group)
        sums = _group_sums(q, self.unpacked(0, self.out_features), self.group)  # [groups, n, out]
        acc = torch.zeros(len(rows), self.out_features)
        for g in range(len(sums)):
            acc = acc + sums[g] * q_scale[:, g : g + 1]
        return acc * self.scale.reshape(-1)[None, : self.out_features]


INT4_GROUP = 32  # weights per scale in the int4 format (and activations per scale with it)


class PackedInt4(_Packer):
    """4-bit weights (as llama.cpp's Q4_1: per 32 inputs of an output, a float16 step d and minimum m, w = d u + m with
    u in [0, 15]), multiplied with int8 activations (one scale per 32 inputs) by integer dot products. The minimum makes
    a group's grid fit its range; weights dequantized from a 4-bit GGUF (Q4_K's steps and minima) fit it closely."""

    format = "int4"

    def check_width(self, width: int) -> None:
        if width % INT4_GROUP:
            raise ValueError(f"int4 layers need an input width that is a multiple of {INT4_GROUP}, not {width}")

    def pack(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        u, step, least = quantize_int4(rows)
        blocks, groups = len(rows) // BLOCK, rows.shape[1] // INT4_GROUP
        # [block, output, group, vector t, nibble (low: quad 2t, high: 2t + 1), input]
        u = u.reshape(blocks, BLOCK, groups, 4, 2, 4)
        nibbles = u[:, :, :, :, 0] | (u[:, :, :, :, 1] << 4)  # [block, output, group, t, input]

        def per_block(values: torch.Tensor) -> torch.Tensor:
            return values.to(torch.float16).reshape(blocks, BLOCK, groups).transpose(1, 2)

        return {
            "packed": nibbles.permute(0, 2, 3, 1, 4).reshape(blocks, groups, 256),
            "steps": per_block(step),
            "minima": per_block(least),
        }

    def unpacked(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The integers u [out, in] (uint8) and the steps and minima [out, in / 32] (float32)."""
        blocks, groups = self.packed.shape[:2]
        v = self.packed.reshape(blocks, groups, 4, BLOCK, 4).permute(0, 3, 1, 2, 4)  # [block, output, group, t, input]
        u = torch.stack([v & 0x0F, v >> 4], dim=4).reshape(blocks * BLOCK, self.in_features)

        def per_output(values: torch.Tensor) -> torch.Tensor:
            return values.transpose(1, 2).reshape(blocks * BLOCK, groups).float()[: self.out_features]

        return u[: self.out_features], per_output(self.steps), per_output(self.minima)

    def dequantized(self) -> torch.Tensor:
        """The weights the layer multiplies by, d u + m, float32 [out, in]."""
        u, step, least = self.unpacked()
        groups = u.reshape(self.out_features, -1, INT4_GROUP).float()
        return (groups * step[:, :, None] + least[:, :, None]).reshape(self.out_features, self.in_features)

    def product(self, kernel, rows: torch.Tensor) -> torch.Tensor:
        return kernel.int4_linear(rows, self.packed, self.steps, self.minima)

    def reference(self, rows: torch.Tensor) -> torch.Tensor:
        q, q_scale = quantize_rows(rows, INT4_GROUP)
        q_sum = q.reshape(len(rows), -1, INT4_GROUP).sum(dim=2, dtype=torch.int32).float()
        u, step, least = self.unpacked()
        sums = _group_sums(q, u, INT4_GROUP)  # [groups, n, out]
        acc = torch.zeros(len(rows), self.out_features)
        for g in range(len(sums)):
            dot = sums[g] * step[None, :, g] + least[None, :, g] * q_sum[:, g : g + 1]
            acc = acc + dot * q_scale[:, g : g + 1]
        return acc


FORMATS: dict[str, type[Packed]] = {"int8": PackedInt8, "int4": PackedInt4}


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per group of 32 inputs of an output: integers u in [0, 15] (uint8 [out, in]) and the step d and minimum m
    (float32 [out, in / 32], rounded to float16) of w = d u + m: m the group's least value, d its range / 15."""
    groups = weight.float().reshape(weight.shape[0], -1, INT4_GROUP)
    least, top = groups.amin(dim=2), groups.amax(dim=2)
    least16, step16 = least.to(torch.float16), ((top - least) / 15).to(torch.float16)
    if not bool(torch.isfinite(least16).all() and torch.isfinite(step16).all()):
        raise ValueError("an int4 layer's weights exceed float16's range (65504): use --native-format int8")
    least, step = least16.float(), step16.float()
    safe = torch.where(step == 0, torch.ones_like(step), step)
    u = torch.round((groups - least[:, :, None]) / safe[:, :, None]).clamp(0, 15).to(torch.uint8).reshape(weight.shape)
    return u, step, least


def _group_sums(q: torch.Tensor, w: torch.Tensor, group: int) -> torch.Tensor:
    """Exact integer sums per group, [groups, n, out], from float64 products of int8 activations and weights."""
    q64 = q.double().reshape(len(q), -1, group)
    pieces = []
    for start in range(0, len(w), FALLBACK_ROWS):  # a slice of the weights at a time, not a float64 copy of all
        w64 = w[start : start + FALLBACK_ROWS].double().reshape(-1, q64.shape[1], group)
        pieces.append(torch.einsum("ngc,ogc->gno", q64, w64).float())
    return torch.cat(pieces, dim=2)


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 values and float32 scales (symmetric: largest magnitude 127), one per row or per ``group`` of its inputs."""
    x = x.float()
    groups = x.reshape(x.shape[0], -1, group or x.shape[1])
    scale = groups.abs().amax(dim=2).clamp(min=1e-8) / 127
    q = torch.round(groups / scale[:, :, None]).clamp(-127, 127).to(torch.int8).reshape(x.shape)
    return q, scale if group else scale[:, 0]


def linear(x: torch.Tensor, weights: Packed) -> torch.Tensor:
    """``x @ W.T`` in float32 with packed weights and int8 activations (see the module's docstring), for x [..., in]."""
    if x.shape[-1] != weights.in_features:
        raise ValueError(
            f"an {weights.format} layer of {weights.in_features} inputs got activations of width {x.shape[-1]}"
        )
    rows = x.reshape(-1, weights.in_features).float().contiguous()
    kernel = compiled() if rows.device.type == "cpu" else None
    if kernel is not None:
        _on_cpu(weights.packed)  # its other buffers live where it does
        out = _call(weights.product, kernel, rows)[:, : weights.out_features]
    else:
        if not bool(torch.isfinite(rows).all()):
            raise ValueError(NON_FINITE)
        out = weights.reference(rows.cpu()).to(rows.device)
    return out.reshape(*x.shape[:-1], weights.out_features)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: PagedCache,
    layer: int,
    start: int,
    window: int,
    scale: float,
    visible: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of q [n, heads, dim] over ``layer``'s cached keys and values and the new ones k, v [n, kv_heads, dim],
    which are written into the cache at start..start+n-1 first; window 0 = all keys.

    ``visible`` None: the new positions are a chain (start..start+n-1); a bool [n, n] mask: a tree, node i seeing
    the new nodes j where it is True (itself and its ancestors), at ``positions[i]`` in the text (start + its depth).
    """
    kernel = compiled()
    if kernel is None:
        raise RuntimeError("the attention kernel is not built on this machine")
    _on_cpu(q, k, v)
    if k.shape[1:] != (cache.kv_heads, cache.head_dim) or v.shape != k.shape:
        raise ValueError(
            f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit the cache's pages "
            f"([n, {cache.kv_heads}, {cache.head_dim}])"
        )
    chain = visible is None  # the kernel reads empty tensors as a chain
    mask = torch.empty(0, dtype=torch.uint8) if chain else visible.to(torch.uint8).contiguous()
    where = torch.empty(0, dtype=torch.long) if chain else positions.to(torch.long).contiguous()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _call(kernel.attention, q, k, v, cache.tables, layer, cache.kind, PAGE, start, window, scale, mask, where)


PAGE = 256  # positions per page of a PagedCache (a power of two)
CACHE_DTYPES = {"float32": 0, "bfloat16": 1, "float16": 2}  # the kernel's codes for the cache's element types


class PagedCache:
    """Keys and values of one sequence, per layer in pages of PAGE positions ([2, kv heads, PAGE, head dim]: keys, then
    values) of ``dtype``, written and read by :func:`attention`. Growing adds pages and copies nothing; a layer with a
    sliding window releases the pages more than one page behind its window, so it holds at most window // PAGE + 3
    pages besides those of the step being written (a truncation may go back up to a page; further back the cache says
    it cannot).
    """

    def __init__(self, windows: tuple[int, ...], kv_heads: int, head_dim: int, dtype: str = "float32") -> None:
        if dtype not in CACHE_DTYPES:
            raise ConfigError(f"unknown KV cache type '{dtype}': use one of {', '.join(CACHE_DTYPES)}")
        self.windows, self.kv_heads, self.head_dim, self.dtype = windows, kv_heads, head_dim, dtype
        self.kind = CACHE_DTYPES[dtype]
        self.length = 0
        self.pages: list[list[torch.Tensor | None]] = [[] for _ in windows]
        self.tables = torch.zeros(len(windows), 4, dtype=torch.long)  # each page's address, 0 where none is held
        self._swept = 0  # the length up to which windowed layers have released pages

    @property
    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return sum(page.nbytes for pages in self.pages for page in pages if page is not None)

    def reserve(self, length: int) -> None:
        """Hold the pages for positions up to ``length`` (written next), after releasing those no window reads again."""
        if self.length >= self._swept + PAGE:
            self._release()
        wanted = -(-length // PAGE)
        if wanted > self.tables.shape[1]:
            tables = torch.zeros(len(self.windows), max(wanted, 2 * self.tables.shape[1]), dtype=torch.long)
            tables[:, : self.tables.shape[1]] = self.tables
            self.tables = tables
        first = self.length // PAGE  # pages below hold written positions (or were released)
        for layer, pages in enumerate(self.pages):
            pages.extend([None] * (wanted - len(pages)))
            for index in range(first, wanted):
                if pages[index] is None:
                    size = (2, self.kv_heads, PAGE, self.head_dim)
                    page = pages[index] = torch.empty(size, dtype=getattr(torch, self.dtype))
                    self.tables[layer, index] = page.data_ptr()

    def truncate(self, length: int, branch: list[int] | None = None) -> None:
        """Keep the first ``length`` positions; with ``branch`` (ascending cache indices, a tree's accepted path) the
        last len(branch) of them are the states at those indices."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of {self.length} positions to {length}")
        if branch and (
            len(branch) > length or branch != sorted(set(branch)) or branch[-1] >= self.length or branch[0] < 0
        ):
            raise ValueError(
                f"a tree path {branch} cannot end a cache of {length} positions: its cached positions ascend, "
                f"below {self.length}"
            )
        for layer, window in enumerate(self.windows):
            lowest = max(0, length - window + 1) if window and length else length
            if any(page is None for page in self.pages[layer][lowest // PAGE : -(-length // PAGE)]):
                raise ValueError(
                    f"the sliding-window cache no longer holds position {lowest}: truncate at most {PAGE} positions "
                    f"behind the last step, or reset and run the text again"
                )
        if branch:
            kernel = compiled()
            sources = torch.tensor(branch, dtype=torch.long)
            move = kernel.move_positions
            _call(move, self.tables, self.kind, PAGE, self.kv_heads, self.head_dim, sources, length - len(branch))
        self.length = length
        self._swept = min(self._swept, length)

    def _release(self) -> None:
        for layer, window in enumerate(self.windows):
            if window:
                below = max(0, self.length - window + 1 - PAGE) // PAGE  # pages wholly before the window, less one page
                for index in range(min(below, len(self.pages[layer]))):
                    self.pages[layer][index] = None
                    self.tables[layer, index] = 0
        self._swept = self.length


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x * rsqrt(mean(x**2) + eps) * weight`` over the last dimension, float32, each row alone."""
    kernel = compiled()
    if kernel is None:
        raise RuntimeError("the norm kernel is not built on this machine")
    _on_cpu(x, weight)
    return _call(kernel.rms_norm, x.contiguous(), weight, eps)


def gated(gate_up: torch.Tensor, gelu: bool) -> torch.Tensor:
    """``act(gate) * up`` for rows [n, 2f] (gate first): SiLU, or GELU's tanh form; each value alone, whatever the rows
    or threads (a float32 approximation of its own, within a few units in the last place of torch's)."""
    kernel = compiled()
    if kernel is None:
        raise RuntimeError("the activation kernel is not built on this machine")
    _on_cpu(gate_up)
    return _call(kernel.gated, gate_up.contiguous(), 1 if gelu else 0)


NON_FINITE = (
    "a native layer got NaN or infinite activations (the model's numbers overflowed on this input, or its weights are "
    "damaged): the native format cannot represent them; try --backend transformers"
)


def _on_cpu(*tensors: torch.Tensor) -> None:
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(
            "the native kernels compute on the CPU: pass CPU tensors (elsewhere use --backend transformers)"
        )


def _call(function, *args):
    """A kernel call whose own checks (shapes, types, finite activations) fail as a ValueError naming the problem."""
    try:
        return function(*args)
    except RuntimeError as exc:  # a failed TORCH_CHECK: its message is the first line
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise ValueError(NON_FINITE if "NaN or infinite" in message else f"native kernel: {message}") from None


def vnni_available() -> bool:
    """Whether this CPU has AVX-512 VNNI (which the AVX-512 and AMX builds need)."""
    return "avx512_vnni" in cpu_flags()


# The kernels' builds, fastest first: the CPU flags each needs and the compiler's. One source; the same bits on each.
VARIANTS = {
    "amx": (
        ("avx512f", "avx512bw", "avx512_vnni", "f16c", "amx_tile", "amx_int8"),
        ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c", "-mamx-tile", "-mamx-int8"],
    ),
    "avx512": (("avx512f", "avx512bw", "avx512_vnni", "f16c"), ["-mavx512f", "-mavx512bw", "-mavx512vnni", "-mf16c"]),
    "avx2-vnni": (("avx2", "fma", "f16c", "avx_vnni"), ["-mavx2", "-mfma", "-mf16c", "-mavxvnni"]),
    "avx2": (("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
    "neon": (("asimd", "asimddp"), ["-march=armv8.2-a+dotprod"]),  # ARM with SDOT (compiled for, not run, here)
}
FORCE = "SPECDEC_KERNELS"  # environment variable: a variant to build instead of the fastest this CPU runs


def variant() -> str | None:
    """The kernels' build for this CPU: $SPECDEC_KERNELS if set (and the CPU runs it), else the fastest it runs."""
    flags = cpu_flags()
    forced = os.environ.get(FORCE)
    if forced:
        if forced not in VARIANTS or not set(VARIANTS[forced][0]) <= flags:
            runs = [name for name, (needs, _) in VARIANTS.items() if set(needs) <= flags]
            log.warning(
                "%s=%s is not a kernel build this CPU runs (%s): ignored", FORCE, forced, ", ".join(runs) or "none"
            )
        else:
            return forced
    return next((name for name, (needs, _) in VARIANTS.items() if set(needs) <= flags), None)


def module_name(name: str) -> str:
    return BUILD if name == "avx512" else f"{BUILD}_{name.replace('-', '_')}"


BUILD_WAIT_S = 600  # longest wait for another process's build of the kernels


class KernelBuildError(RuntimeError):
    """The kernels could not be built here; the message names the cause (the compiler's own error) and the fix."""


def build_folder(name: str | None = None) -> Path:
    """Where a build of the kernels is compiled and cached: one folder per kernel version, build, torch and Python."""
    from specdec.models.registry import cache_root

    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return (
        cache_root()
        / "kernels"
        / f"{module_name(name or variant() or 'avx512')}-torch{torch.__version__.split('+')[0]}-{python}"
    )


def is_built(name: str | None = None) -> bool:
    name = name or variant() or "avx512"
    return (build_folder(name) / f"{module_name(name)}.so").exists()


def compiled():
    """The compiled kernels, or None (``linear`` then takes its exact float64 path) where this machine cannot run or
    build them."""
    return _load()[0]


def build_name() -> str:
    """The kernels' build in use (its module's name: version and variant, and whether the AMX build's tiles run), or
    the float64 reference where none runs."""
    module = compiled()
    if module is None:
        return "float64 reference"
    return module.__name__ + ("" if not module.__name__.endswith("_amx") or module.tiles_in_use() else " (no tiles)")


def kernels_problem() -> str | None:
    """Why the kernels are not available here (no AVX2 or ARM SDOT, or the build's error), or None."""
    return _load()[1]


@functools.cache
def _load():
    first = variant()
    if first is None:
        return None, "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM)"
    runs = [name for name, (needs, _) in VARIANTS.items() if set(needs) <= cpu_flags()]
    failures = []
    for name in [first] + runs[runs.index(first) + 1 :]:  # a build the compiler refuses gives way to a plainer one
        try:
            return build(name=name), None
        except KernelBuildError as exc:  # unwritable cache, no compiler, a compile error
            failures.append(f"{name}: {exc}")
            log.warning("specdec's %s kernels could not be built (%s): trying a plainer build", name, exc)
    log.warning(
        "specdec's CPU kernels are not available, so native layers use their exact float64 reference: %s", failures[0]
    )
    return None, f"the kernels' build failed: {'; '.join(failures)}"


def build(wait_s: float = BUILD_WAIT_S, name: str | None = None):
    """Compile (first use: under a minute, said on stderr) or load a build of the kernels (``name``: a key of
    ``VARIANTS``; by default this CPU's), one process at a time.

    torch marks a build in progress with a ``lock`` file and waits, without limit, while it exists; a build killed
    midway leaves it behind. Builds here also hold an OS lock on ``specdec.lock``, which dies with its process: holding
    it, any ``lock`` file left is stale and removed; a live build is waited for at most ``wait_s`` seconds.
    """
    from torch.utils.cpp_extension import load_inline

    name = name or variant()
    if name is None:
        raise KernelBuildError(
            "this CPU lacks AVX2, FMA and F16C (x86) or SDOT (ARM): the native kernels cannot run here"
        )
    folder = build_folder(name)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        guard = open(folder / "specdec.lock", "a+")
    except OSError as exc:
        raise KernelBuildError(f"the kernels' folder {folder} is not writable ({exc}): set SPECDEC_CACHE") from None
    with guard:
        if _hold(guard, folder, wait_s):
            stale = folder / "lock"
            if stale.exists():
                log.warning("removing %s, left by a kernel build that was stopped midway", stale)
                stale.unlink()
        if not is_built(name):
            log.warning(
                "compiling specdec's CPU kernels (%s) for this machine, once (under a minute; cached in %s)",
                name,
                folder,
            )
        try:
            return load_inline(
                module_name(name),
                cpp_sources=SOURCE,
                functions=[
                    "int8_linear",
                    "int4_linear",
                    "attention",
                    "move_positions",
                    "rms_norm",
                    "gated",
                    "tiles_in_use",
                ],
                extra_cflags=["-O3", *VARIANTS[name][1], "-ffp-contract=off", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(folder),
            )
        except (RuntimeError, OSError, ImportError) as exc:  # no compiler, no ninja, a compile error
            raise KernelBuildError(compiler_error(str(exc))) from None


def _hold(guard, folder: Path, wait_s: float) -> bool:
    """Take the build's OS lock (and write this process's id in its file), waiting at most ``wait_s`` seconds for the
    process that holds it; False where this system has no such locks (torch's own lock file is then all there is)."""
    try:
        import fcntl
    except ImportError:
        return False
    deadline = time.monotonic() + wait_s
    waiting = False
    while True:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
            guard.seek(0)
            guard.truncate()
            guard.write(str(os.getpid()))
            guard.flush()
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                guard.seek(0)
                holder = guard.read().strip() or "another process"
                raise KernelBuildError(
                    f"process {holder} has been building the kernels in {folder} for over {wait_s:.0f} s: wait for it, "
                    f"or stop it and run again"
                ) from None
            if not waiting:
                log.warning("waiting for another process to finish building specdec's CPU kernels in %s", folder)
                waiting = True
            time.sleep(0.2)


def compiler_error(message: str, lines: int = 12) -> str:
    """The informative part of a failed build's output: the compiler's error lines (else its last lines), one string."""
    text = [line.rstrip() for line in message.splitlines() if line.strip()]
    errors = [line for line in text if "error" in line.lower() and not line.startswith("Error building extension")]
    shown = (errors or text[-lines:])[:lines]
    return " | ".join(shown) if shown else message
