// The plain-C interface between the SSD operator glue (ssd.cpp, which sees the LibTorch
// stable ABI) and the per-ISA kernels (ssd_kernel_*.cpp, which see nothing of torch: they
// are compiled for different instruction sets, so they share no inline code with the rest).
#pragma once

#include <cstdint>

namespace ssmops_cpu {

// Runs fn(ctx, begin, end) over [0, n) on the torch thread pool.
using SsdRangeFn = void (*)(void* ctx, int64_t begin, int64_t end);
using SsdParallelFor = void (*)(int64_t n, SsdRangeFn fn, void* ctx);

// Every pointer is float32 and contiguous in the operator's layout. The glue has already
// applied dt's bias, softplus and clamp (dtv) and split every chunk into segments: a
// segment never crosses a change of seq_idx nor the end of a cu_seqlens sequence, so
// inside a segment the scan is plain (no masks) and its start state is either the state
// after the previous token or zero (`seg_reset`).
struct SsdArgs {
  int64_t batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks;
  bool D_per_channel;  // D is (nheads, headdim), else (nheads,)
  const float *x, *dtv, *A, *B, *C, *D, *z;  // D, z may be null; dtv: (batch, seqlen, nheads)
  const float* initial_states;               // may be null (zeros)
  // segments of chunk c of row b: starts seg_start[seg_offset[b*nchunks+c] .. seg_offset[..+1]),
  // token offsets inside the chunk, increasing, the first 0; seg_reset the same indices.
  const int64_t *seg_offset, *seg_start;
  const uint8_t* seg_reset;
  // varlen (batch 1): the last token of each sequence, non-decreasing; entries < 0 are
  // handled by the glue (the state before token 0).
  int64_t nseq;
  const int64_t* varlen_end;
  SsdParallelFor parallel_for;
  int64_t nthreads;  // workers the kernels split (batch, head) items over

  // forward outputs: out (batch, seqlen, nheads, headdim) before the cast to x's dtype
  float *out, *chunk_states, *final_states, *varlen_states;  // varlen_states may be null
  float* ungated;  // may be null: out before the silu(z) gate (keep_ungated)

  // backward: dout is the gradient of out; dfinal_states, dvarlen_states may be null
  const float *dout, *chunk_states_in, *dfinal_states, *dvarlen_states;
  float *dx, *ddtv, *dB, *dC, *dz;  // ddtv: gradient w.r.t. dtv; dz null without z
  float *dA_part;                   // (batch, nheads): summed over batch by the glue
  float *dD_part;                   // (batch, nheads, headdim) sum of dy * x; null without D
  float* dinitial_states;           // may be null
};

// One entry point per instruction set; all compute the same thing. They return 0, or
// 1 when a scratch allocation failed.
int ssd_fwd_generic(const SsdArgs& a);
int ssd_bwd_generic(const SsdArgs& a);
#if defined(__x86_64__)
int ssd_fwd_avx2(const SsdArgs& a);
int ssd_bwd_avx2(const SsdArgs& a);
#endif

}  // namespace ssmops_cpu
