// The streamed weight-only linear layer (few rows of x, each weight row read once), for the
// operators whose kernels chain several layers: `weight_only_linear` itself and the fused
// decoding step of a Mamba block (../mamba_step/).
#pragma once

#include "../common/checks.h"
#include "../common/parallel.h"
#include "linear_params.h"

namespace ssmops_cpu {

// Up to this many rows of x, each weight row is read once for all of them (decoding).
constexpr int64_t kMaxStreamedRows = 16;

WeightKind weight_kind(ST t);

// y (M, N) = x (M, K) @ weight.T, times scale (int8), plus bias, all float32 and contiguous. Any M
// is right; beyond kMaxStreamedRows aten's matmul is faster (weight_only_linear switches there). For
// int8 weights x is rounded to int16 into a buffer of the calling thread, valid until its next
// StreamedLinear: make one, run it, then make the next.
class StreamedLinear {
 public:
  StreamedLinear(const float* x, int64_t M, const Tensor& weight, const float* scale, const float* bias, float* y);
  // output features [n_begin, n_end) for every row of x (tiles start at n_begin)
  void rows(int64_t n_begin, int64_t n_end) const;
  // the whole layer, its tasks of kTaskRows features spread over the threads
  void run() const;
  // parallel_for's grain over tasks: at least ~32K weights a thread, so a small layer stays on one
  int64_t grain() const;
  int64_t tasks() const { return (args_.N + kTaskRows - 1) / kTaskRows; }
  // parallel_shares' chunk: tasks of at least ~64 KiB of weights
  int64_t chunk() const { return chunk_; }

 private:
  LinearArgs args_;
  int64_t chunk_;
};

}  // namespace ssmops_cpu
