// The plain-C interface between the operator glue (selective_scan.cpp, which sees the
// LibTorch stable ABI) and the per-ISA kernels (scan_kernel_*.cpp, which see nothing
// of torch: they are compiled for different instruction sets, so they must not share
// inline functions with the rest of the library).
#pragma once

#include <cstdint>

namespace ssmops_cpu {

enum DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Runs fn(ctx, begin, end) over [0, n) on the torch thread pool.
using RangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
using ParallelFor = void (*)(int64_t n, RangeFn fn, void* ctx);

// Every tensor is contiguous. B and C are (dim, dstate) when constant, else
// (batch, groups, dstate, seqlen) (a rank-3 B/C counts as one group).
//
// complex_A (mamba_ssm's complex mode): A, a constant B/C, the states (initial_state,
// last_state, scan_intermediates, dlast_state, dinitial_state), dA and a constant dB/dC are
// complex64, read and written through their float pointers as (re, im) pairs; a variable
// B/C (and its gradient) is real with 2 * seqlen steps, each step's (re, im) adjacent.
struct ScanArgs {
  int64_t batch, dim, seqlen, dstate;
  int64_t groups;  // channel groups of the variable B/C, 1 when both are constant
  bool B_variable, C_variable, delta_softplus, complex_A;
  int dtype_in, dtype_B, dtype_C;  // DType of u/delta/z/dout/out, of B, of C
  const void *u, *delta, *z, *B, *C;
  const float *A, *D, *delta_bias, *initial_state;  // D, delta_bias, initial_state may be null
  ParallelFor parallel_for;

  // forward outputs
  void *out, *out_z;                   // out_z null without z
  float *scan_intermediates, *last_state;  // (batch, dim, n_chunks, 2 * dstate) layout

  // backward inputs and outputs
  const void* dout;
  const float *dlast_state;  // may be null
  void *du, *ddelta, *dz;    // dz null without z
  float *dA, *dD, *ddelta_bias, *dinitial_state;  // dD, ddelta_bias, dinitial_state may be null
  void *dB, *dC;             // B's and C's dtype and shape
};

// One entry point per instruction set; all compute the same thing. They return 0, or
// 1 when a scratch allocation failed.
int scan_fwd_generic(const ScanArgs& a);
int scan_bwd_generic(const ScanArgs& a);
// complex_A: one portable, scalar build (scan_kernel_complex.cpp).
int scan_fwd_complex(const ScanArgs& a);
int scan_bwd_complex(const ScanArgs& a);
#if defined(__x86_64__)
int scan_fwd_avx2(const ScanArgs& a);
int scan_bwd_avx2(const ScanArgs& a);
int scan_fwd_avx512(const ScanArgs& a);
int scan_bwd_avx512(const ScanArgs& a);
#endif

constexpr int64_t kChunkLen = 2048;  // scan_intermediates hold one entry per chunk

}  // namespace ssmops_cpu
