// 16-lane vectors on ARM NEON: four registers each (see simd.h for the contract every build keeps).
#pragma once
#include <arm_neon.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
typedef uint32_t vmask;
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
#ifndef ROWS8
#define ROWS8 5  // rows whose int32 sums (4 registers each) stay in the 32 registers in the int8 kernel
#endif
#ifndef ROWS4
#define ROWS4 4  // the same in the int4 kernel
#endif
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
