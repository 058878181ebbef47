// The decoding step's CPU operator (selective_state_update), on LibTorch's stable ABI only.
// The schema is in ../library.cpp.
#include <cmath>
#include <optional>
#include <vector>

#include "../common/checks.h"

namespace ssmops_cpu {
namespace {

// --- selective_state_update: one decoding step ------------------------------------------
// Tiny work per call (batch * dim * dstate), so a plain loop over float32 copies of the
// inputs; `state` is updated in place (through a contiguous copy when it is strided).

void check_f32_or(const char* name, const Tensor& t, const std::vector<int64_t>& shape, ST x_dtype) {
  check_cpu(name, t);
  STD_TORCH_CHECK(same_shape(t, shape), "selective_state_update: ", name, " must have shape ", shape_str(shape),
                  ", got ", shape_of(t));
  STD_TORCH_CHECK(t.scalar_type() == ST::Float || t.scalar_type() == x_dtype, "selective_state_update: ", name,
                  " must have dtype float32 or ", dtype_name(x_dtype), " (x's dtype), got ",
                  dtype_name(t.scalar_type()));
}

Tensor selective_state_update(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, OptTensor D,
                              OptTensor z, OptTensor dt_bias, bool dt_softplus) {
  check_cpu("x", x);
  STD_TORCH_CHECK(x.dim() == 2, "selective_state_update: x must have shape (batch, dim), got ", shape_of(x));
  const ST xt = x.scalar_type();
  STD_TORCH_CHECK(xt == ST::Float || xt == ST::Half || xt == ST::BFloat16,
                  "selective_state_update: x must have dtype float32, float16 or bfloat16, got ", dtype_name(xt));
  const int64_t batch = x.size(0), dim = x.size(1);
  check_cpu("A", A);
  STD_TORCH_CHECK(A.dim() == 2 && A.size(0) == dim,
                  "selective_state_update: A must have shape (dim, dstate) with dim=", dim, ", got ", shape_of(A));
  const int64_t dstate = A.size(1);
  STD_TORCH_CHECK(dstate >= 1 && dstate <= kMaxDstate, "selective_state_update: A must have 1 <= dstate <= ",
                  kMaxDstate, ", got dstate=", dstate);
  check_tensor("A", A, {dim, dstate}, ST::Float);
  check_tensor("state", state, {batch, dim, dstate}, ST::Float);
  check_tensor("dt", dt, {batch, dim}, xt);
  STD_TORCH_CHECK(B.dim() == 2 || B.dim() == 3, "selective_state_update: B must have shape (batch, dstate) or ",
                  "(batch, groups, dstate), got ", shape_of(B));
  const int64_t groups = B.dim() == 3 ? B.size(1) : 1;
  STD_TORCH_CHECK(groups >= 1 && dim % groups == 0, "selective_state_update: B has ", groups,
                  " groups, which does not divide dim=", dim);
  const std::vector<int64_t> bc_shape = B.dim() == 3 ? std::vector<int64_t>{batch, groups, dstate}
                                                     : std::vector<int64_t>{batch, dstate};
  check_f32_or("B", B, bc_shape, xt);
  check_f32_or("C", C, bc_shape, xt);
  if (D) check_f32_or("D", *D, {dim}, xt);
  if (dt_bias) check_f32_or("dt_bias", *dt_bias, {dim}, xt);
  if (z) check_tensor("z", *z, {batch, dim}, xt);

  Tensor h = contig(state), x32 = as_f32(x), dt32 = as_f32(dt), A32 = contig(A);
  Tensor B32 = as_f32(B), C32 = as_f32(C);
  std::optional<Tensor> D32, z32, bias32;
  if (D) D32 = as_f32(*D);
  if (z) z32 = as_f32(*z);
  if (dt_bias) bias32 = as_f32(*dt_bias);
  Tensor y = empty_like_shape(x, {batch, dim}, ST::Float);
  float* hp = h.mutable_data_ptr<float>();
  float* yp = y.mutable_data_ptr<float>();
  const float *xp = x32.const_data_ptr<float>(), *dtp = dt32.const_data_ptr<float>();
  const float *Ap = A32.const_data_ptr<float>(), *Bp = B32.const_data_ptr<float>();
  const float* Cp = C32.const_data_ptr<float>();
  const float* Dp = D32 ? D32->const_data_ptr<float>() : nullptr;
  const float* zp = z32 ? z32->const_data_ptr<float>() : nullptr;
  const float* biasp = bias32 ? bias32->const_data_ptr<float>() : nullptr;
  const int64_t per_group = dim / groups;
  torch::stable::parallel_for(0, batch * dim, 64, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t b = row / dim, c = row % dim;
      const float* Bg = Bp + (b * groups + c / per_group) * dstate;
      const float* Cg = Cp + (b * groups + c / per_group) * dstate;
      float delta = dtp[row] + (biasp ? biasp[c] : 0.0f);
      if (dt_softplus) delta = delta > 20.0f ? delta : std::log1p(std::exp(delta));  // torch's threshold
      const float xv = xp[row];
      float acc = 0.0f;
      for (int64_t n = 0; n < dstate; ++n) {
        float& hn = hp[row * dstate + n];
        hn = std::exp(delta * Ap[c * dstate + n]) * hn + delta * Bg[n] * xv;
        acc += hn * Cg[n];
      }
      if (Dp) acc += Dp[c] * xv;
      if (zp) acc *= zp[row] / (1.0f + std::exp(-zp[row]));
      yp[row] = acc;
    }
  });
  if (h.data_ptr() != state.data_ptr()) torch::stable::copy_(state, h);
  return xt == ST::Float ? y : torch::stable::to(y, xt);
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("selective_state_update", TORCH_BOX(&ssmops_cpu::selective_state_update));
}
