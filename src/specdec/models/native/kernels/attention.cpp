// Causal (optionally sliding-window, or tree) attention of new positions over a paged KV cache, whose keys and values
// are float32, bfloat16 or float16 (rounded to nearest even once, when written, and read back as float32, so a key has
// the same bits whichever positions are scored with it).
#include <vector>

#include "kernels.h"
#include "parallel.h"
#include "simd.h"

namespace specdec {

template <int KIND> static inline vf v_load_kv(const char* p) {
    if constexpr (KIND == 0) return v_loadu_ps((const float*)p);
    else if constexpr (KIND == 1) return v_load_bf16((const uint16_t*)p);
    else return v_load_half((const uint16_t*)p);
}

static void store_kv(int64_t kind, char* to, const float* x, int64_t dim) {
    if (kind == 0) std::memcpy(to, x, dim * sizeof(float));
    for (int64_t e = 0; kind == 1 && e < dim; ++e) ((uint16_t*)to)[e] = to_bfloat16(x[e]);
    for (int64_t e = 0; kind == 2 && e < dim; ++e) ((uint16_t*)to)[e] = to_half(x[e]);
}

Pages make_pages(const int64_t* table, int64_t count, int64_t kind, int64_t page, int64_t kv_heads, int64_t dim) {
    int64_t shift = 0;
    while ((int64_t{1} << shift) < page) ++shift;
    return {table, count, page, kv_heads, dim, kind, kind == 0 ? 4 : 2, shift};
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
        std::max<int64_t>(1, (2 * threads() + kv_heads - 1) / kv_heads);  // ~2 a thread
    const int64_t chunk = std::min<int64_t>(64, (queries + per_head - 1) / per_head);  // bounds each task's lists
    const int64_t chunks = (queries + chunk - 1) / chunk;
    parallel_for(0, kv_heads * chunks, 1, [&](int64_t begin, int64_t end) {
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

// Keys are read in cache order, so a tree node's result has the same bits as the same token decoded along its path
// alone.
void attention(const float* qp, const float* kp, const float* vp, const Pages& pages, int64_t n, int64_t heads,
               int64_t start, int64_t window, float scale, const uint8_t* seen, const int64_t* positions, float* op) {
    const int64_t kv_heads = pages.kv_heads, dim = pages.dim;
    for (int64_t i = 0; i < n; ++i)
        for (int64_t h = 0; h < kv_heads; ++h) {
            store_kv(pages.kind, pages.at(0, h, start + i), kp + (i * kv_heads + h) * dim, dim);
            store_kv(pages.kind, pages.at(1, h, start + i), vp + (i * kv_heads + h) * dim, dim);
        }
    if (n == 0) return;
    std::vector<int64_t> position(n);  // of each new key and query in the text
    for (int64_t i = 0; i < n; ++i) position[i] = seen ? positions[i] : start + i;
    if (pages.kind == 0) attend<0>(qp, op, pages, n, heads, start, window, scale, seen, position);
    else if (pages.kind == 1) attend<1>(qp, op, pages, n, heads, start, window, scale, seen, position);
    else attend<2>(qp, op, pages, n, heads, start, window, scale, seen, position);
}

// Each source at or after its target, so moving in order overwrites nothing still to move.
void move_positions(const Pages& pages, const int64_t* from, int64_t m, int64_t target) {
    for (int64_t r = 0; r < m; ++r)
        if (from[r] != target + r)
            for (int64_t part = 0; part < 2; ++part)
                for (int64_t h = 0; h < pages.kv_heads; ++h)
                    std::memcpy(pages.at(part, h, target + r), pages.at(part, h, from[r]), pages.dim * pages.bytes);
}

}  // namespace specdec
