// The kernels for torch: each checks its tensors' shapes and types (a failed check is a one-line error the Python side
// turns into a ValueError), releases the GIL (the server's event loop runs while a step computes) and calls kernels.h.
#include <torch/extension.h>

#include "kernels.h"

static const char* NON_FINITE = "NaN or infinite activations";

static void check_int8(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& w_scale,
                       const torch::Tensor& gsum, int64_t group) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
                "x: contiguous float32 [n, k]");
    TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kInt8 && packed.is_contiguous(),
                "packed int8 weights");
    const int64_t k = x.size(1), outs = packed.size(0) * 16;
    TORCH_CHECK(packed.size(1) * 4 == k && packed.size(2) == 16 && packed.size(3) == 4,
                "weights packed for another shape");
    TORCH_CHECK(group > 0 && group % 16 == 0 && k % group == 0,
                "the group must be a multiple of 16 that divides the width");
    TORCH_CHECK(w_scale.scalar_type() == torch::kFloat32 && w_scale.numel() == outs && w_scale.is_contiguous(),
                "one float32 scale per output");
    TORCH_CHECK(gsum.scalar_type() == torch::kInt32 && gsum.numel() == outs * (k / group) && gsum.is_contiguous(),
                "int32 group sums");
}

torch::Tensor int8_linear_argmax(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor gsum,
                                 int64_t group, int64_t valid) {
    check_int8(x, packed, w_scale, gsum, group);
    const int64_t n = x.size(0), k = x.size(1), blocks = packed.size(0);
    TORCH_CHECK(valid > 0 && valid <= blocks * 16, "the outputs that count: 1 to the packed outputs");
    auto index = torch::empty({n}, torch::kInt64);
    pybind11::gil_scoped_release no_gil;
    TORCH_CHECK(specdec::int8_linear_argmax(x.data_ptr<float>(), n, k, packed.data_ptr<int8_t>(),
                                            w_scale.data_ptr<float>(), gsum.data_ptr<int32_t>(), group, blocks, valid,
                                            index.data_ptr<int64_t>()),
                NON_FINITE);
    return index;
}

torch::Tensor int8_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor w_scale, torch::Tensor gsum,
                          int64_t group) {
    check_int8(x, packed, w_scale, gsum, group);
    const int64_t n = x.size(0), k = x.size(1), blocks = packed.size(0), outs = blocks * 16;
    auto y = torch::empty({n, outs}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;
    TORCH_CHECK(specdec::int8_linear(x.data_ptr<float>(), n, k, packed.data_ptr<int8_t>(), w_scale.data_ptr<float>(),
                                     gsum.data_ptr<int32_t>(), group, blocks, y.data_ptr<float>()),
                NON_FINITE);
    return y;
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
    pybind11::gil_scoped_release no_gil;
    TORCH_CHECK(specdec::int4_linear(x.data_ptr<float>(), n, k, packed.data_ptr<uint8_t>(),
                                     (const uint16_t*)steps.data_ptr<at::Half>(),
                                     (const uint16_t*)minima.data_ptr<at::Half>(), blocks, y.data_ptr<float>()),
                NON_FINITE);
    return y;
}

static specdec::Pages pages_of(torch::Tensor tables, int64_t layer, int64_t kind, int64_t page, int64_t kv_heads,
                               int64_t dim) {
    TORCH_CHECK(tables.dim() == 2 && tables.scalar_type() == torch::kInt64 && tables.is_contiguous() && layer >= 0 &&
                    layer < tables.size(0), "tables: contiguous int64 [layers, pages]");
    TORCH_CHECK(kind >= 0 && kind <= 2 && page > 0 && (page & (page - 1)) == 0, "cache kind 0, 1 or 2, pages of 2^k");
    return specdec::make_pages(tables.data_ptr<int64_t>() + layer * tables.size(1), tables.size(1), kind, page,
                               kv_heads, dim);
}

// q: [n, heads, dim]; k, v: the n new positions' keys and values [n, kv heads, dim], written first into the layer's
// pages at start..start+n-1. `visible` empty: a chain; else uint8 [n, n], a tree at `positions` (int64 [n]).
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
    const specdec::Pages pages = pages_of(tables, layer, kind, page, kv_heads, dim);
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
    specdec::attention(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), pages, n, heads, start, window,
                       (float)scale, tree ? visible.data_ptr<uint8_t>() : nullptr,
                       tree ? positions.data_ptr<int64_t>() : nullptr, out.data_ptr<float>());
    return out;
}

// A tree's accepted path: the keys and values at `sources` (ascending cache indices) move to target, target + 1, ...,
// in every layer's pages.
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
        const specdec::Pages pages = pages_of(tables, layer, kind, page, kv_heads, dim);
        TORCH_CHECK(m == 0 || pages.held(target, from[m - 1] + 1), "the cache does not hold the positions to move");
        specdec::move_positions(pages, from, m, target);
    }
}

torch::Tensor gated(torch::Tensor gate_up, int64_t kind) {
    TORCH_CHECK(gate_up.dim() == 2 && gate_up.scalar_type() == torch::kFloat32 && gate_up.is_contiguous() &&
                    gate_up.size(1) % 2 == 0,
                "gate_up: contiguous float32 [n, 2f]");
    TORCH_CHECK(kind == 0 || kind == 1, "the activation is SiLU (0) or GELU (1)");
    const int64_t n = gate_up.size(0), f = gate_up.size(1) / 2;
    auto out = torch::empty({n, f}, torch::kFloat32);
    pybind11::gil_scoped_release no_gil;
    specdec::gated(gate_up.data_ptr<float>(), n, f, kind, out.data_ptr<float>());
    return out;
}

torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
    TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.size(2) % 2 == 0,
                "x: contiguous float32 [n, heads, dim], dim even");
    const int64_t n = x.size(0), heads = x.size(1), dim = x.size(2);
    for (const auto& t : {cos, sin})
        TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.is_contiguous() && t.dim() == 3 && t.size(0) == n &&
                        t.size(1) == 1 && t.size(2) == dim,
                    "cos and sin: contiguous float32 [n, 1, dim]");
    auto out = torch::empty_like(x);
    pybind11::gil_scoped_release no_gil;
    specdec::rope(x.data_ptr<float>(), n, heads, dim, cos.data_ptr<float>(), sin.data_ptr<float>(),
                  out.data_ptr<float>());
    return out;
}

void forbid(torch::Tensor logits, torch::Tensor bits, int64_t width) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.stride(1) == 1,
                "logits: float32 [rows, V], each row contiguous");
    TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == torch::kInt32 && bits.is_contiguous() &&
                    bits.size(0) == logits.size(0),
                "bits: contiguous int32 [rows, words], a row of words per row of logits");
    TORCH_CHECK(width >= 0 && width <= logits.size(1) && width <= 32 * bits.size(1),
                "width: at most the logits' columns and the mask's bits");
    pybind11::gil_scoped_release no_gil;
    specdec::forbid(logits.data_ptr<float>(), logits.size(0), logits.stride(0), width, bits.data_ptr<int32_t>(),
                    bits.size(1));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.is_contiguous() && w.scalar_type() == torch::kFloat32 &&
                    w.is_contiguous(),
                "contiguous float32 tensors");
    const int64_t dim = w.numel();
    TORCH_CHECK(dim > 0 && dim % 16 == 0 && x.dim() >= 1 && x.size(-1) == dim,
                "the norm's width must be a multiple of 16 and match x");
    auto out = torch::empty_like(x);
    specdec::rms_norm(x.data_ptr<float>(), x.numel() / dim, dim, w.data_ptr<float>(), (float)eps,
                      out.data_ptr<float>());
    return out;
}

bool tiles_in_use() { return specdec::tiles_in_use(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.def("int8_linear", &int8_linear, "x @ W.T with packed int8 weights");
    m.def("int8_linear_argmax", &int8_linear_argmax, "the argmax of each row of x @ W.T, without writing the products");
    m.def("int4_linear", &int4_linear, "x @ W.T with packed int4 weights");
    m.def("attention", &attention, "attention over a paged KV cache");
    m.def("move_positions", &move_positions, "move a tree path's keys and values");
    m.def("rms_norm", &rms_norm, "RMS norm, each row alone");
    m.def("rope", &rope, "rotary position embedding");
    m.def("forbid", &forbid, "-inf where a packed bit mask forbids, in place");
    m.def("gated", &gated, "act(gate) * up");
    m.def("tiles_in_use", &tiles_in_use, "whether AMX tiles run here");
}
