// Mamba-1's decoding step over rows of (batch, dim), for the operators that run it:
// `selective_state_update` and the fused decoding step of a Mamba block (../mamba_step/).
#pragma once

#include <cstdint>

#include "state_update_params.h"

namespace ssmops_cpu {

// rows whose dt and gate are computed together, vectorised
constexpr int64_t kStepRowBlock = 64;

// All float32; x, dt and y are (batch, dim) and the state h (batch, dim, dstate), contiguous; B and
// C are (groups, dstate) per batch row, bc_stride apart; z (dim,) per batch row, z_stride apart.
// D, z and dt_bias may be null.
struct SelectiveStep {
  int64_t dim, dstate, groups, bc_stride, z_stride;
  bool softplus;
  float* h;
  const float *x, *dt, *A, *B, *C, *D, *z, *dt_bias;
  float* y;

  // rows [begin, end) of the flattened (batch, dim): each state row advanced in place by one token,
  //   dt = softplus(dt + dt_bias), h = exp(dt * A) * h + dt * x * B, y = <h, C> + D * x, times silu(z)
  void rows(int64_t begin, int64_t end) const;
};

// v[i] = v[i] * sigmoid(v[i]), vectorised
void silu_in_place(float* v, int64_t n);

// out[i] = -exp(in[i]) (A from A_log), vectorised for this CPU
void neg_exp(const float* in, float* out, int64_t n);

}  // namespace ssmops_cpu
