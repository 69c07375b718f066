// 16-lane vectors on AVX2: two registers each (see simd.h for the contract every build keeps).
#pragma once
#include <immintrin.h>
#include <algorithm>
#include <cstdint>
typedef uint32_t vmask;
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
#ifndef ROWS8
#define ROWS8 6  // rows whose int32 sums (2 registers each) stay in the 16 registers in the int8 kernel
#endif
#ifndef ROWS4
#define ROWS4 4  // the same in the int4 kernel
#endif
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
// A group's int4 products (8 vpmaddubsw per lane pair: 32 inputs) add up in int16 before one widening: each pair of
// products is at most 2 * 15 * 127 in size, so 8 of them stay below 2^15 (exact, no saturation). Half the multiplies.
static_assert(specdec::INT4_GROUP / 4 * 2 * 15 * 127 < 32768, "int4 group sums would overflow int16");
#define INT16_PARTS
typedef vi vpart;
static inline vpart v_part_zero() { return v_setzero_si512(); }
static inline vpart v_part_dot_int4(vpart p, vi u, vi a) {
    return {_mm256_add_epi16(p.lo, _mm256_maddubs_epi16(u.lo, a.lo)),
            _mm256_add_epi16(p.hi, _mm256_maddubs_epi16(u.hi, a.hi))};
}
static inline vi v_part_sums(vpart p) {
    const __m256i ones = _mm256_set1_epi16(1);
    return {_mm256_madd_epi16(p.lo, ones), _mm256_madd_epi16(p.hi, ones)};
}
#ifndef ROWS8
#define ROWS8 5  // rows whose int32 sums (2 registers each) stay in the 16 registers in the int8 kernel
#endif
#ifndef ROWS4
#define ROWS4 3  // rows whose int16 sums (2 registers each) stay in registers beside the unpacked weights
#endif
#endif
static inline __m256 v_halves(vf x) { return _mm256_add_ps(x.hi, x.lo); }
static inline vf v_load_bf16(const uint16_t* p) {
    return {_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16)),
            _mm256_castsi256_ps(
                _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(p + 8))), 16))};
}
