// 16-lane vectors on AVX-512: one register each (see simd.h for the contract every build keeps).
#pragma once
#include <immintrin.h>
#include <cstdint>
typedef uint32_t vmask;
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
#ifndef ROWS8
#define ROWS8 12  // rows whose int32 sums stay in registers (32 of them) in the int8 kernel
#endif
#ifndef ROWS4
#define ROWS4 8  // the same in the int4 kernel
#endif
static inline __m256 v_halves(vf x) {
    return _mm256_add_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)), _mm512_castps512_ps256(x));
}
static inline vf v_load_bf16(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
