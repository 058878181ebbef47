// What state_update.cpp hands the decoding step's row kernel (one build per instruction set).
#pragma once

#include <cstdint>

namespace ssmops_cpu {

// One float32 state row of n values, contiguous, advanced in place by one token:
//   h[k] = h[k] * decay_k + dtx * B[k],   decay_k = exp(dt * A[k]), or `decay` when A is null,
// and returns sum_k h[k] * C[k], summed as 16 partial sums (k mod 16) folded in a fixed tree: the
// same order in every build. Mamba-1 has an A row per channel; Mamba-2 one decay per head.
using AdvanceRowFn = float(float* h, int64_t n, const float* A, float dt, float decay, float dtx, const float* B,
                           const float* C);
using AdvanceRow = AdvanceRowFn*;
AdvanceRowFn advance_row_generic, advance_row_avx2, advance_row_avx512;

}  // namespace ssmops_cpu
