// The kernels' interface on plain arrays (bindings.cpp wraps it for torch; harness.cpp calls it bare, as the ARM
// test does under qemu). Each kernel's result for a position depends only on that position's inputs: not on how many
// positions are computed together, the threads, or the instruction set of the build.
#pragma once
#include <cstdint>

namespace specdec {

constexpr int64_t INT4_GROUP = 32;  // inputs per step and minimum of an int4 layer (and per int8 activation scale)

// Packed int8 weights: [blocks][k / 4][16 outputs][4 inputs]; one float32 scale per output; int32 sums of each
// output's weights per group of `group` inputs, [blocks][k / group][16]. Activations are int8 per group of a row's
// inputs. out: [n][blocks * 16]. False if x holds NaN or infinity.
bool int8_linear(const float* x, int64_t n, int64_t k, const int8_t* packed, const float* scale, const int32_t* sums,
                 int64_t group, int64_t blocks, float* out);

// The argmax of each row of int8_linear's output among its first `valid` outputs (the first index of the largest
// value), without writing the outputs: index [n]. False if x holds NaN or infinity.
bool int8_linear_argmax(const float* x, int64_t n, int64_t k, const int8_t* packed, const float* scale,
                        const int32_t* sums, int64_t group, int64_t blocks, int64_t valid, int64_t* index);

// Packed int4 weights: [blocks][k / 32][4 vectors][16 outputs][4 bytes] (low nibbles: one quad of inputs, high: the
// next), float16 steps and minima [blocks][k / 32][16] (w = step u + minimum). out: [n][blocks * 16]. False if x
// holds NaN or infinity.
bool int4_linear(const float* x, int64_t n, int64_t k, const uint8_t* packed, const uint16_t* steps,
                 const uint16_t* minima, int64_t blocks, float* out);

// Whether int8 products of 2 positions or more run in AMX tiles here (the AMX build, where Linux grants their state).
bool tiles_in_use();

// A layer's KV pages: `table[p]` is the address of page p, [2][kv heads][page][dim] (keys, then values) of `kind`
// (0 float32, 1 bfloat16, 2 float16), or 0 where the page is not held.
struct Pages {
    const int64_t* table;
    int64_t count, page, kv_heads, dim, kind, bytes, shift;  // pages in the table, positions per page (2^shift)
    char* at(int64_t part, int64_t head, int64_t index) const {
        return (char*)table[index >> shift] + ((part * kv_heads + head) * page + (index & (page - 1))) * dim * bytes;
    }
    bool held(int64_t from, int64_t to) const {  // every page of positions from..to-1
        for (int64_t p = from / page; p < (to + page - 1) / page; ++p)
            if (p >= count || table[p] == 0) return false;
        return true;
    }
};
Pages make_pages(const int64_t* table, int64_t count, int64_t kind, int64_t page, int64_t kv_heads, int64_t dim);

// Writes the n new keys and values (k, v: [n][kv heads][dim]) at start..start+n-1, then attends q [n][heads][dim]
// over the visible keys into out. visible == nullptr: a chain (position start + i sees keys from the window's first
// to start + i); else a tree: visible [n][n] (itself and its ancestors) at positions[i] in the text.
void attention(const float* q, const float* k, const float* v, const Pages& pages, int64_t n, int64_t heads,
               int64_t start, int64_t window, float scale, const uint8_t* visible, const int64_t* positions,
               float* out);

// The keys and values at `sources` (ascending, each at or after its target) move to target, target + 1, ...
void move_positions(const Pages& pages, const int64_t* sources, int64_t m, int64_t target);

// act(gate) * up for rows [n][2f] (gate first): SiLU (kind 0) or GELU's tanh form (kind 1). out: [n][f].
void gated(const float* gate_up, int64_t n, int64_t f, int64_t kind, float* out);

// -inf where a grammar's packed token mask (bit t % 32 of word t / 32) forbids, in each row's first `width` logits.
void forbid(float* logits, int64_t rows, int64_t stride, int64_t width, const int32_t* bits, int64_t words);

// x cos + rotate_half(x) sin for x [n][heads][dim] (dim even), cos and sin [n][dim]: rotary position embedding.
void rope(const float* x, int64_t n, int64_t heads, int64_t dim, const float* cos, const float* sin, float* out);

// x * rsqrt(mean(x^2) + eps) * w per row of dim values (dim a multiple of 16).
void rms_norm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out);

}  // namespace specdec
