// Work split over threads: torch's pool in the Python extension, one thread in the bare harness (harness.cpp).
// No kernel's result depends on how its work is split.
#pragma once
#include <cstdint>
#if defined(SPECDEC_TORCH)
#include <ATen/Parallel.h>
#endif

namespace specdec {
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
#if defined(SPECDEC_TORCH)
    at::parallel_for(begin, end, grain, f);
#else
    (void)grain;
    if (begin < end) f(begin, end);
#endif
}

inline int64_t threads() {
#if defined(SPECDEC_TORCH)
    return at::get_num_threads();
#else
    return 1;
#endif
}
}  // namespace specdec
