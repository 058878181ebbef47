// What state_update.cpp hands the decoding step's row kernel (one build per instruction set).
#pragma once

#include <cstdint>

namespace ssmops_cpu {

// `rows` float32 state rows of n values, row r at h + r * n, sharing B and C, each advanced in place
// by one token:
//   h[k] = h[k] * decay_k + dtx[r] * B[k],   decay_k = exp(dt[r] * A[r * n + k]), or decay[r] when A is null,
// and y[r] = sum_k h[k] * C[k], summed as 16 partial sums (k mod 16) folded in a fixed tree: the same
// order in every build. Mamba-1 has an A row per channel; Mamba-2 one decay per head. Rows go
// through one call so that one row's exps and sums overlap the next's.
using AdvanceRowsFn = void(float* h, int64_t rows, int64_t n, const float* A, const float* dt, const float* decay,
                           const float* dtx, const float* B, const float* C, float* y);
using AdvanceRows = AdvanceRowsFn*;
AdvanceRowsFn advance_rows_generic, advance_rows_avx2, advance_rows_avx512;

// out[i] = f(in[i]), out may be in: -exp (Mamba-1's A from its parameter A_log), softplus (dt) and
// silu (the gate, the conv's output)
using MapFn = void(const float* in, float* out, int64_t n);
MapFn neg_exp_generic, neg_exp_avx2, neg_exp_avx512;
MapFn softplus_generic, softplus_avx2, softplus_avx512;
MapFn silu_generic, silu_avx2, silu_avx512;

}  // namespace ssmops_cpu
