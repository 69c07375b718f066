// Linear layers with packed int8 or int4 weights and int8 activations: exact integer products per group, then float32
// steps in a fixed order. Each block of 16 outputs is read from memory once per call, whatever the number of rows.
#include <mutex>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"
#if defined(__AMX_INT8__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace specdec {

#ifndef AHEAD
#define AHEAD 1  // weights are prefetched this many blocks of 16 outputs ahead of the products
#endif
static_assert(ROWS8 >= 1 && ROWS4 >= 1 && AHEAD >= 1, "rows per pass and blocks ahead are positive");

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

// One group's int32 sums for N rows, ROWS8 at a time (the rows whose sums this build keeps in registers beside a
// vector of weights; more would spill to memory on every product). The group's weights stay in L1 between passes.
template <int N>
static inline void group_sums(const uint8_t* qg, int64_t k, const int8_t* wg, int64_t quads, vi* sums,
                              const int8_t* ahead) {
    constexpr int R = N < ROWS8 ? N : ROWS8;
    vi acc[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = v_setzero_si512();
    for (int64_t t = 0; t < quads; ++t) {
        if (ahead) __builtin_prefetch(ahead + t * 64);  // a line of a later block (a prefetch never faults)
        const vi w = v_loadu_si512((const void*)(wg + t * 64));
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            int32_t a4;
            std::memcpy(&a4, qg + i * k + t * 4, 4);
            acc[i] = v_dot_int8(acc[i], v_set1_epi32(a4), w);
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) sums[i] = acc[i];
    if constexpr (N > R) group_sums<N - R>(qg + R * k, k, wg, quads, sums + R, nullptr);
}

// One block of 16 outputs for N rows: per group, int32 sums, then sum * the row's scale added to a float32 total; at
// the end, the total times the channel's scale. Plain arrays and unrolled loops: g++ then keeps them in registers.
template <int N>
static void tile(const uint8_t* q, const float* qs, const int8_t* wb, const int32_t* gsum, const float* ws, float* out,
                 int64_t k, int64_t group, int64_t outs, const int8_t* next) {
    const int64_t groups = k / group, quads = group / 4;
    vf total[N];
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) total[i] = v_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        vi sums[N];
        group_sums<N>(q + g * group, k, wb + g * group * 16, quads, sums, next ? next + g * group * 16 : nullptr);
        const vi corr = v_mullo_epi32(v_loadu_si512((const void*)(gsum + g * 16)), v_set1_epi32(OFFSET));
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) {
            const vf sum = v_cvtepi32_ps(v_sub_epi32(sums[i], corr));
            total[i] = v_add_ps(total[i], v_mul_ps(sum, v_set1_ps(qs[i * groups + g])));
        }
    }
    const vf scale = v_loadu_ps(ws);
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) v_storeu_ps(out + i * outs, v_mul_ps(total[i], scale));
}

// Where a block's 16 outputs for each row go: into the output matrix [n][outs], or (argmax) into a scratch of one
// block per row, from which each row's running maximum is kept; per range of blocks, then merged, so that no logit is
// written to memory. The maximum is the first index of the largest value, NaN counting as the largest (torch.max's),
// whatever the split into ranges.
struct Best {
    float value = 0.f;
    int64_t index = -1;
    bool beaten_by(float v, int64_t i) const {
        if (index < 0) return true;
        if (std::isnan(value)) return std::isnan(v) && i < index;
        return std::isnan(v) || v > value || (v == value && i < index);
    }
};

struct Sink {
    bool argmax;
    float* out = nullptr;  // the output matrix (not argmax)
    int64_t n, outs = 0, valid = 0;  // rows, the matrix's width; argmax: outputs that count (the rest is padding)
    std::vector<Best> best;
    std::mutex merging;
    Sink(float* out, int64_t n, int64_t outs) : argmax(false), out(out), n(n), outs(outs) {}
    Sink(int64_t n, int64_t valid) : argmax(true), n(n), valid(valid), best(n) {}

    struct Range {  // one thread's blocks; merge() once they are done
        Sink& sink;
        std::vector<float> scratch;
        std::vector<Best> mine;
        explicit Range(Sink& s) : sink(s), scratch(s.argmax ? s.n * 16 : 0), mine(s.argmax ? s.n : 0) {}
        float* at(int64_t row, int64_t block) {
            return sink.argmax ? scratch.data() + row * 16 : sink.out + row * sink.outs + block * 16;
        }
        int64_t stride() const { return sink.argmax ? 16 : sink.outs; }
        void done(int64_t block) {  // the block's outputs are in the scratch: each row's maximum so far
            if (!sink.argmax) return;
            const int64_t count = std::min<int64_t>(16, sink.valid - block * 16);
            for (int64_t i = 0; i < sink.n; ++i) {
                // most blocks hold nothing above the row's best so far (NaN is not below it): passed over at once
                const float* row = scratch.data() + i * 16;
                if (count == 16 && mine[i].index >= 0 && !v_not_below(v_loadu_ps(row), v_set1_ps(mine[i].value)))
                    continue;
                for (int64_t j = 0; j < count; ++j) {
                    if (mine[i].beaten_by(row[j], block * 16 + j)) mine[i] = Best{row[j], block * 16 + j};
                }
            }
        }
        void merge() {
            if (!sink.argmax) return;
            std::lock_guard<std::mutex> lock(sink.merging);
            for (int64_t i = 0; i < sink.n; ++i)
                if (mine[i].index >= 0 && sink.best[i].beaten_by(mine[i].value, mine[i].index)) sink.best[i] = mine[i];
        }
    };
};

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
                       Sink& sink, int64_t n, int64_t k, int64_t group, int64_t blocks) {
    const int64_t groups = k / group, full = n / 16 * 16;
    parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        amx_configure((int)std::max<int64_t>(1, n - full));
        Sink::Range range(sink);
        for (int64_t b = begin; b < end; ++b) {  // a block's weights stay in L1 for all the rows
            const int8_t* wb = w + b * 16 * k;
            for (int64_t r = 0; r < full; r += 16)
                amx_block(qp + r * k, qsp + r * groups, wb, gs + b * groups * 16, ws + b * 16, range.at(r, b), 16,
                          false, k, group, range.stride());
            if (full < n)
                amx_block(qp + full * k, qsp + full * groups, wb, gs + b * groups * 16, ws + b * 16,
                          range.at(full, b), n - full, true, k, group, range.stride());
            range.done(b);
        }
        range.merge();
        _tile_release();
    });
}
// Whether int8 layers of 2 positions or more multiply in AMX tiles here: the AMX build, where Linux grants their state.
bool tiles_in_use() { return amx_ready(); }
#else
bool tiles_in_use() { return false; }
#endif
#define AMX_MIN_ROWS 2  // one row reads every weight for one product: VNNI keeps up with memory there

static bool int8_product(const float* x, int64_t n, int64_t k, const int8_t* w, const float* ws, const int32_t* gs,
                         int64_t group, int64_t blocks, Sink& sink) {
    std::vector<uint8_t> q(n * k);
    std::vector<float> qs(n * (k / group));
    if (!quantize(x, n, k, group, q.data(), qs.data())) return false;
    const uint8_t* qp = q.data();
    const float* qsp = qs.data();
#if defined(__AMX_INT8__)
    if (n >= AMX_MIN_ROWS && group % 64 == 0 && amx_ready()) {
        amx_linear(qp, qsp, w, gs, ws, sink, n, k, group, blocks);
        return true;
    }
#endif
    const int64_t groups = k / group;
    parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        Sink::Range range(sink);
        for (int64_t b = begin; b < end; ++b) {
            for (int64_t r = 0; r < n; r += 12) {  // a block's weights stay in L1 for every 12 rows after the first
                const int8_t* next = r == 0 && b + AHEAD < end ? w + (b + AHEAD) * 16 * k : nullptr;
                auto args = std::make_tuple(qp + r * k, qsp + r * groups, w + b * 16 * k, gs + b * groups * 16,
                                            ws + b * 16, range.at(r, b), k, group, range.stride(), next);
                switch (std::min<int64_t>(12, n - r)) {
#define CASE(N) case N: std::apply(tile<N>, args); break;
                    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8) CASE(9) CASE(10) CASE(11) CASE(12)
#undef CASE
                }
            }
            range.done(b);
        }
        range.merge();
    });
    return true;
}

bool int8_linear(const float* x, int64_t n, int64_t k, const int8_t* w, const float* ws, const int32_t* gs,
                 int64_t group, int64_t blocks, float* out) {
    Sink sink(out, n, blocks * 16);
    return int8_product(x, n, k, w, ws, gs, group, blocks, sink);
}

bool int8_linear_argmax(const float* x, int64_t n, int64_t k, const int8_t* w, const float* ws, const int32_t* gs,
                        int64_t group, int64_t blocks, int64_t valid, int64_t* index) {
    Sink sink(n, valid);
    if (!int8_product(x, n, k, w, ws, gs, group, blocks, sink)) return false;
    for (int64_t i = 0; i < n; ++i) index[i] = sink.best[i].index;
    return true;
}

// Activations for int4 layers: per row and group of 32, scale = max(|x|, 1e-8) / 127, q = clamp(round(x / scale),
// -127, 127) as signed bytes, and the group's sum of q as a float (exact; a weight is d u + m, so
// dot(q, w) = d dot(q, u) + m sum(q)).
static bool quantize_signed(const float* x, int64_t n, int64_t k, int8_t* q, float* scales, float* sums) {
    const int64_t groups = k / INT4_GROUP;
    const vf lo = v_set1_ps(-127.f), hi = v_set1_ps(127.f), inf = v_set1_ps(INFINITY);
    vmask bad = 0;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < groups; ++g) {
            const float* src = x + i * k + g * INT4_GROUP;
            const vf a = v_loadu_ps(src), b = v_loadu_ps(src + 16);
            bad |= v_not_below(v_abs_ps(a), inf) | v_not_below(v_abs_ps(b), inf);
            const float scale = std::max(v_reduce_max_ps(v_max_ps(v_abs_ps(a), v_abs_ps(b))), 1e-8f) / 127.f;
            scales[i * groups + g] = scale;
            const vf divisor = v_set1_ps(scale);
            const vi qa = v_cvtps_epi32(v_min_ps(hi, v_max_ps(lo, v_round_ps(v_div_ps(a, divisor)))));
            const vi qb = v_cvtps_epi32(v_min_ps(hi, v_max_ps(lo, v_round_ps(v_div_ps(b, divisor)))));
            v_store_epi8(q + i * k + g * INT4_GROUP, qa);
            v_store_epi8(q + i * k + g * INT4_GROUP + 16, qb);
            sums[i * groups + g] = (float)v_reduce_add_epi32(v_add_epi32(qa, qb));
        }
    return bad == 0;
}

// One group's (32 inputs') int32 sums of q u for N rows, ROWS4 at a time (as group_sums). The 256 bytes of weights
// are 4 vectors, each 16 outputs x 4 inputs of one quad in the low nibbles and of the next quad in the high ones.
template <int N>
static inline void group_sums4(const int8_t* qg, int64_t k, const uint8_t* wg, vi* sums, const uint8_t* ahead) {
    constexpr int R = N < ROWS4 ? N : ROWS4;
    const vi low = v_set1_epi8(0x0F);
    vpart acc[R];
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) acc[i] = v_part_zero();
#pragma GCC unroll 4
    for (int t = 0; t < 4; ++t) {
        if (ahead) __builtin_prefetch(ahead + t * 64);
        const vi v = v_loadu_si512((const void*)(wg + t * 64));
        const vi w0 = v_and_si512(v, low), w1 = v_and_si512(v_srli_epi16(v, 4), low);
#pragma GCC unroll 16
        for (int i = 0; i < R; ++i) {
            int32_t a0, a1;
            std::memcpy(&a0, qg + i * k + t * 8, 4);
            std::memcpy(&a1, qg + i * k + t * 8 + 4, 4);
            acc[i] = v_part_dot_int4(acc[i], w0, v_set1_epi32(a0));
            acc[i] = v_part_dot_int4(acc[i], w1, v_set1_epi32(a1));
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < R; ++i) sums[i] = v_part_sums(acc[i]);
    if constexpr (N > R) group_sums4<N - R>(qg + R * k, k, wg, sums + R, nullptr);
}

// One block of 16 outputs of an int4 layer for N rows. Per group of 32 inputs, an int32 sum of q u per row; then
// (sum * d + m * sum(q)) * the row's scale (d, m: the 16 outputs' float16 step and minimum), added to a float32
// total. Each row's steps are the same whatever N is.
template <int N>
static void tile4(const int8_t* q, const float* qs, const float* qsum, const uint8_t* wb, const uint16_t* ws,
                  const uint16_t* wm, float* out, int64_t k, int64_t outs, const uint8_t* next) {
    const int64_t groups = k / INT4_GROUP;
    vf total[N];
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) total[i] = v_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
        vi sums[N];
        group_sums4<N>(q + g * INT4_GROUP, k, wb + g * 256, sums, next ? next + g * 256 : nullptr);
        const vf step = v_load_half(ws + g * 16);
        const vf least = v_load_half(wm + g * 16);
#pragma GCC unroll 16
        for (int i = 0; i < N; ++i) {
            const vf dot = v_add_ps(v_mul_ps(v_cvtepi32_ps(sums[i]), step),
                                    v_mul_ps(least, v_set1_ps(qsum[i * groups + g])));
            total[i] = v_add_ps(total[i], v_mul_ps(dot, v_set1_ps(qs[i * groups + g])));
        }
    }
#pragma GCC unroll 16
    for (int i = 0; i < N; ++i) v_storeu_ps(out + i * outs, total[i]);
}

bool int4_linear(const float* x, int64_t n, int64_t k, const uint8_t* w, const uint16_t* ws, const uint16_t* wm,
                 int64_t blocks, float* out) {
    const int64_t groups = k / INT4_GROUP, outs = blocks * 16;
    std::vector<int8_t> q(n * k);
    std::vector<float> qs(n * groups), qsum(n * groups);
    if (!quantize_signed(x, n, k, q.data(), qs.data(), qsum.data())) return false;
    const int8_t* qp = q.data();
    const float* qsp = qs.data();
    const float* qsump = qsum.data();
    parallel_for(0, blocks, 4, [&](int64_t begin, int64_t end) {
        for (int64_t b = begin; b < end; ++b) {
            for (int64_t r = 0; r < n; r += 8) {
                const uint8_t* next = r == 0 && b + AHEAD < end ? w + (b + AHEAD) * groups * 256 : nullptr;
                auto args = std::make_tuple(qp + r * k, qsp + r * groups, qsump + r * groups, w + b * groups * 256,
                                            ws + b * groups * 16, wm + b * groups * 16, out + r * outs + b * 16,
                                            k, outs, next);
                switch (std::min<int64_t>(8, n - r)) {
#define CASE(N) case N: std::apply(tile4<N>, args); break;
                    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7) CASE(8)
#undef CASE
                }
            }
        }
    });
    return true;
}

}  // namespace specdec
