// A bare program that runs every kernel of kernels.h on fixed pseudo-random inputs and writes the results' bytes to
// stdout, so that builds for different instruction sets (and ARM, under qemu-user) can be compared bit for bit
// without torch. Built by tests/test_kernel_harness.py with each build's flags: linear.cpp, attention.cpp and
// elementwise.cpp beside this file, no SPECDEC_TORCH (one thread).
//
// `harness int8|int4 ROWS INPUTS OUTPUTS CALLS` instead times one linear layer's shape (one thread): microseconds per
// call on stdout, for benchmarks/kernel_steps.py and for instruction counts under valgrind --tool=callgrind.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernels.h"
#include "simd.h"

using namespace specdec;

static uint64_t state = 0x9E3779B97F4A7C15ull;
static uint32_t next() {  // xorshift64*
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return (uint32_t)((state * 0x2545F4914F6CDD1Dull) >> 32);
}
static float uniform() { return (float)(next() >> 8) / 16777216.f * 2.f - 1.f; }  // [-1, 1), exact in float32
static void emit(const float* p, size_t count) { fwrite(p, sizeof(float), count, stdout); }

static void linear_int8(int64_t n, int64_t k, int64_t group, int64_t blocks) {
    std::vector<int8_t> w(blocks * k * 16);
    for (auto& x : w) x = (int8_t)((int)(next() % 255) - 127);
    std::vector<float> scale(blocks * 16), x(n * k), out(n * blocks * 16);
    for (auto& s : scale) s = (1.f + uniform()) / 256.f;
    for (auto& v : x) v = uniform() * 4.f;
    x[0] = 40.f;  // an outlier spoils only its group
    std::vector<int32_t> sums(blocks * (k / group) * 16, 0);  // [blocks][groups][16]
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t i = 0; i < k; ++i)
            for (int64_t o = 0; o < 16; ++o)
                sums[(b * (k / group) + i / group) * 16 + o] += w[((b * (k / 4) + i / 4) * 16 + o) * 4 + i % 4];
    if (!int8_linear(x.data(), n, k, w.data(), scale.data(), sums.data(), group, blocks, out.data())) std::abort();
    emit(out.data(), out.size());
    // each row's argmax among all but the last 3 outputs (as padding would be), found without writing the outputs:
    // the first index of the largest of those just written
    const int64_t outs = blocks * 16, valid = outs - 3;
    std::vector<int64_t> index(n);
    if (!int8_linear_argmax(x.data(), n, k, w.data(), scale.data(), sums.data(), group, blocks, valid, index.data()))
        std::abort();
    std::vector<float> found(n);
    for (int64_t i = 0; i < n; ++i) {
        const float* row = out.data() + i * outs;
        if (index[i] != std::max_element(row, row + valid) - row) std::abort();
        found[i] = (float)index[i];
    }
    emit(found.data(), found.size());
}

static void linear_int4(int64_t n, int64_t k, int64_t blocks) {
    std::vector<uint8_t> w(blocks * (k / 32) * 256);
    for (auto& x : w) x = (uint8_t)next();
    std::vector<uint16_t> steps(blocks * (k / 32) * 16), minima(steps.size());
    for (auto& s : steps) s = to_half((1.f + uniform()) / 64.f);
    for (auto& m : minima) m = to_half(-(1.f + uniform()) / 8.f);
    std::vector<float> x(n * k), out(n * blocks * 16);
    for (auto& v : x) v = uniform() * 3.f;
    if (!int4_linear(x.data(), n, k, w.data(), steps.data(), minima.data(), blocks, out.data())) std::abort();
    emit(out.data(), out.size());
}

static void extremes() {  // every weight and activation at its largest size: int16 sums at their bound
    const int64_t n = 2, k = 256, blocks = 2;
    std::vector<uint8_t> w4(blocks * (k / 32) * 256, 0xFF);  // u = 15 everywhere
    std::vector<uint16_t> steps(blocks * (k / 32) * 16, to_half(1.f / 64.f)), minima(steps.size(), to_half(-0.25f));
    std::vector<float> x(n * k), out(n * blocks * 16);
    for (int64_t i = 0; i < k; ++i) x[i] = 1.f, x[k + i] = -1.f;  // q = 127 and q = -127
    if (!int4_linear(x.data(), n, k, w4.data(), steps.data(), minima.data(), blocks, out.data())) std::abort();
    emit(out.data(), out.size());
    std::vector<int8_t> w8(blocks * k * 16);
    for (size_t i = 0; i < w8.size(); ++i) w8[i] = (int8_t)(i % 3 == 0 ? -127 : 127);
    std::vector<float> scale(blocks * 16, 1.f / 256.f);
    std::vector<int32_t> sums(blocks * (k / 128) * 16, 0);
    for (int64_t b = 0; b < blocks; ++b)
        for (int64_t i = 0; i < k; ++i)
            for (int64_t o = 0; o < 16; ++o)
                sums[(b * (k / 128) + i / 128) * 16 + o] += w8[((b * (k / 4) + i / 4) * 16 + o) * 4 + i % 4];
    if (!int8_linear(x.data(), n, k, w8.data(), scale.data(), sums.data(), 128, blocks, out.data())) std::abort();
    emit(out.data(), out.size());
}

static void attend(int64_t kind, int64_t window, bool tree) {
    const int64_t kv_heads = 2, heads = 8, dim = 64, page = 16, start = 37, n = 5, pages = 3;
    const int64_t bytes = kind == 0 ? 4 : 2;
    std::vector<std::vector<char>> memory(pages, std::vector<char>(2 * kv_heads * page * dim * bytes));
    std::vector<int64_t> table(pages);
    for (int64_t p = 0; p < pages; ++p) table[p] = (int64_t)memory[p].data();
    const Pages at = make_pages(table.data(), pages, kind, page, kv_heads, dim);
    std::vector<float> kv(start * kv_heads * dim), out(n * heads * dim);
    for (int part = 0; part < 2; ++part) {  // the cached positions, written as a prefill would
        for (auto& v : kv) v = uniform();
        std::vector<float> q(start * heads * dim, 0.f), scratch(start * heads * dim);
        if (part == 0) {
            std::vector<float> values(kv.size());
            for (auto& v : values) v = uniform();
            attention(q.data(), kv.data(), values.data(), at, start, heads, 0, window, 0.125f, nullptr, nullptr,
                      scratch.data());
        }
    }
    std::vector<float> q(n * heads * dim), k(n * kv_heads * dim), v(n * kv_heads * dim);
    for (auto& x : q) x = uniform();
    for (auto& x : k) x = uniform();
    for (auto& x : v) x = uniform();
    const uint8_t visible[n * n] = {1, 0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 1, 0, 1, 0, 1, 0, 1};
    const int64_t positions[n] = {start, start + 1, start + 1, start + 2, start + 2};
    attention(q.data(), k.data(), v.data(), at, n, heads, start, window, 0.125f, tree ? visible : nullptr,
              tree ? positions : nullptr, out.data());
    emit(out.data(), out.size());
}

static void elementwise() {
    const int64_t n = 3, f = 40, dim = 48;
    std::vector<float> x(n * 2 * f), out(n * f), w(dim), y(n * dim);
    for (auto& v : x) v = uniform() * 6.f;
    for (int64_t kind = 0; kind < 2; ++kind) {
        gated(x.data(), n, f, kind, out.data());
        emit(out.data(), out.size());
    }
    for (auto& v : w) v = 1.f + uniform();
    rms_norm(x.data(), n, dim, w.data(), 1e-6f, y.data());
    emit(y.data(), y.size());
    const int64_t heads = 2, half = 40;  // a head of 80: halves that are not a whole number of vectors
    std::vector<float> q(n * heads * 2 * half), cs(n * 2 * half), sn(cs.size()), rotated(q.size());
    for (auto& v : q) v = uniform() * 3.f;
    for (auto& v : cs) v = uniform();
    for (auto& v : sn) v = uniform();
    rope(q.data(), n, heads, 2 * half, cs.data(), sn.data(), rotated.data());
    emit(rotated.data(), rotated.size());
}

static int time_linear(const char* format, int64_t n, int64_t k, int64_t outputs, int64_t calls) {
    const bool int4 = std::strcmp(format, "int4") == 0;
    if ((!int4 && std::strcmp(format, "int8") != 0) || n < 1 || k % 128 != 0 || outputs % 16 != 0 || calls < 1) {
        std::fprintf(stderr, "usage: harness int8|int4 ROWS INPUTS(a multiple of 128) OUTPUTS(of 16) CALLS\n");
        return 2;
    }
    const int64_t blocks = outputs / 16, group = 128;
    std::vector<uint8_t> w(int4 ? blocks * (k / 32) * 256 : blocks * k * 16);
    for (auto& x : w) x = (uint8_t)(int4 ? next() : next() % 255);
    std::vector<uint16_t> steps(blocks * (k / 32) * 16, to_half(1.f / 64.f)), minima(steps.size(), to_half(-0.1f));
    std::vector<float> scale(outputs, 1.f / 256.f), x(n * k), out(n * outputs);
    std::vector<int32_t> sums(blocks * (k / group) * 16, 0);
    for (auto& v : x) v = uniform();
    const auto start = std::chrono::steady_clock::now();
    for (int64_t c = 0; c < calls; ++c) {
        const bool ok = int4 ? int4_linear(x.data(), n, k, w.data(), steps.data(), minima.data(), blocks, out.data())
                             : int8_linear(x.data(), n, k, (const int8_t*)w.data(), scale.data(), sums.data(), group,
                                           blocks, out.data());
        if (!ok) std::abort();
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("%.3f\n", 1e6 * seconds / (double)calls);
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 6) return time_linear(argv[1], std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]),
                                      std::atoll(argv[5]));
    for (int64_t n : {1, 2, 3, 9, 13, 17, 35}) {
        linear_int8(n, 256, 128, 3);
        linear_int8(n, 96, 32, 2);
        linear_int4(n, 128, 3);
    }
    for (int64_t kind = 0; kind < 3; ++kind)
        for (int64_t window : {0, 8})
            for (bool tree : {false, true}) attend(kind, window, tree);
    elementwise();
    extremes();
    return 0;
}
