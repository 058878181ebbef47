// The decoding step's CPU operators (selective_state_update, multihead_state_update), on
// LibTorch's stable ABI only. The schemas are in ../library.cpp.
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

#include "../common/checks.h"
#include "../common/isa.h"
#include "state_update.h"

namespace ssmops_cpu {
namespace {

float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }  // torch's threshold

// This CPU's builds of the row kernel and the elementwise maps, chosen once for the process. softplus
// and silu at SSE width (they were built here, for the baseline) held a Mamba-1 layer's state update
// (mamba-130m's shape, 2 threads) at ~119 us for batch 8 and ~20-24 for batch 1; ~76 and ~15 us now.
struct StepKernels {
  AdvanceRows advance;
  MapFn *neg_exp, *softplus, *silu;
};
const StepKernels& kernels() {
  static const StepKernels chosen = [] {
    const Isa isa = selected_isa();
    return StepKernels{SSMOPS_ISA_KERNEL(isa, advance_rows), SSMOPS_ISA_KERNEL(isa, neg_exp),
                       SSMOPS_ISA_KERNEL(isa, softplus), SSMOPS_ISA_KERNEL(isa, silu)};
  }();
  return chosen;
}

}  // namespace

void silu_in_place(float* v, int64_t n) { kernels().silu(v, v, n); }

void neg_exp(const float* in, float* out, int64_t n) { kernels().neg_exp(in, out, n); }

void SelectiveStep::rows(int64_t begin, int64_t end) const {
  const int64_t per_group = dim / groups;
  const StepKernels& k = kernels();
  // runs of up to kStepRowBlock rows that share a batch row and a group (so B and C): their channels
  // are contiguous, so that each elementwise loop below is a plain vector loop
  for (int64_t row = begin; row < end;) {
    const int64_t b = row / dim, c = row % dim, g = c / per_group;
    const int64_t n = std::min({kStepRowBlock, end - row, (g + 1) * per_group - c});
    float delta[kStepRowBlock], dtx[kStepRowBlock], gate[kStepRowBlock], acc[kStepRowBlock];
    const float* xs = x + row;
    for (int64_t i = 0; i < n; ++i) delta[i] = dt[row + i] + (dt_bias ? dt_bias[c + i] : 0.0f);
    if (softplus) k.softplus(delta, delta, n);
    for (int64_t i = 0; i < n; ++i) dtx[i] = delta[i] * xs[i];
    if (z) k.silu(z + b * z_stride + c, gate, n);
    k.advance(h + row * dstate, n, dstate, A + c * dstate, delta, nullptr, dtx, B + b * bc_stride + g * dstate,
              C + b * bc_stride + g * dstate, acc);
    for (int64_t i = 0; i < n; ++i) {
      const float out = D ? acc[i] + D[c + i] * xs[i] : acc[i];
      y[row + i] = z ? out * gate[i] : out;
    }
    row += n;
  }
}

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
  const SelectiveStep step{dim,
                           dstate,
                           groups,
                           groups * dstate,
                           dim,
                           dt_softplus,
                           h.mutable_data_ptr<float>(),
                           x32.const_data_ptr<float>(),
                           dt32.const_data_ptr<float>(),
                           A32.const_data_ptr<float>(),
                           B32.const_data_ptr<float>(),
                           C32.const_data_ptr<float>(),
                           D32 ? D32->const_data_ptr<float>() : nullptr,
                           z32 ? z32->const_data_ptr<float>() : nullptr,
                           bias32 ? bias32->const_data_ptr<float>() : nullptr,
                           y.mutable_data_ptr<float>()};
  torch::stable::parallel_for(0, batch * dim, kStepRowBlock,
                              [&](int64_t begin, int64_t end) { step.rows(begin, end); });
  if (h.data_ptr() != state.data_ptr()) torch::stable::copy_(state, h);
  return xt == ST::Float ? y : torch::stable::to(y, xt);
}

// --- multihead_state_update: Mamba-2's layout, a cache of states in any float dtype ----
// Latency-bound (one token): x, B, C, z and a per-element A are taken as contiguous float32 copies,
// dt, D, dt_bias and a per-head A are read through their strides, the state is read and written in
// place in its own dtype through its strides, and a head whose dt, A and dt_bias are tied over
// headdim (given per head, or expanded over headdim with stride 0) takes one exp per head instead of
// one per (channel, state).

const std::vector<ST> kFloats = {ST::Float, ST::Half, ST::BFloat16};

// dt, A, D and dt_bias: per (head, channel) when `per_channel` has its rank, else per head.
void check_per_head(const char* name, const Tensor& t, const std::vector<int64_t>& per_channel,
                    const std::vector<int64_t>& per_head, const std::vector<ST>& dtypes) {
  const bool channels = t.dim() == static_cast<int64_t>(per_channel.size());
  check_tensor_of("multihead_state_update", name, t, dtypes, channels ? per_channel : per_head, "x");
}

void check_float(const char* name, const Tensor& t, const std::vector<int64_t>& shape) {
  check_tensor_of("multihead_state_update", name, t, kFloats, shape, "x");
}

// dt (batch, nheads[, headdim]), D and dt_bias (nheads[, headdim]) as the kernel reads them: float32
// through their strides, so that a per-head value expanded over headdim with stride 0 (as mamba_ssm's
// Mamba2 passes them) is read in place: the front end hands it on as it is, and nothing is copied
struct HeadValues {
  Tensor values;  // the argument itself when float32, else its float32 copy
  const float* data;
  int64_t batch, head, channel;  // strides; channel is 0 in a per-head form
  bool tied;  // one value per head: the per-head form, or the per-channel one with headdim's stride 0
  float at(int64_t b, int64_t h, int64_t i) const { return data[b * batch + h * head + i * channel]; }
};

HeadValues head_values(const Tensor& t, bool batched) {
  Tensor f = t.scalar_type() == ST::Float ? t : torch::stable::to(t, ST::Float);
  const int64_t lead = batched ? 1 : 0;  // dimensions before nheads
  const bool channels = t.dim() == lead + 2;
  const float* data = f.const_data_ptr<float>();
  return HeadValues{f, data, batched ? f.stride(0) : 0, f.stride(lead), channels ? f.stride(lead + 1) : 0,
                    !channels || t.stride(lead + 1) == 0};
}

struct MultiheadArgs {
  int64_t batch, nheads, headdim, dstate, ngroups;
  bool A_tied, softplus;
  HeadValues dt;
  std::optional<HeadValues> D, bias;
  const float *x, *A, *B, *C, *z;  // z may be null; A: contiguous, or tied: a value per head, A_head apart
  int64_t A_head;
  const int64_t* rows;  // the state row of each batch row, -1 for padding
  float* y;
};

// dt of batch row b, head h, channel i: plus dt_bias, through softplus
float step_size(const MultiheadArgs& a, int64_t b, int64_t h, int64_t i) {
  float dt = a.dt.at(b, h, i);
  if (a.bias) dt += a.bias->at(0, h, i);
  return a.softplus ? softplus(dt) : dt;
}

template <class T>
void multihead_step(const MultiheadArgs& a, T* state, const int64_t* st) {
  const int64_t p = a.headdim, n = a.dstate, per_group = a.nheads / a.ngroups;
  // a thread takes >= ~32K states. A model's token finds its states cold (the weights' stream evicted
  // them), and a thread streams them at ~34 GB/s: at mamba2-130m's shape (196K states a layer, 24
  // layers) one thread a layer held a compiled token at ~13.4 ms (fp32) and ~5.4 (int8) where two
  // take ~13.0 and ~5.1, alternating in one process. Warm in cache (benchmarks/ssd.py's repeated
  // step), a second thread costs more than it saves below ~256K states.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (p * n));
  const AdvanceRows advance = kernels().advance;
  // float32 state rows of a head, each dstate values one after the other, advance in place in one call
  const bool in_place = std::is_same<T, float>::value && st[3] == 1 && st[2] == n;
  torch::stable::parallel_for(0, a.batch * a.nheads, grain, [&](int64_t begin, int64_t end) {
    // other states: one row at a time in float32 scratch, so that the kernel runs over contiguous floats
    std::vector<float> row(n), dts(p), decays(p), dtxs(p), acc(p);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / a.nheads, h = bh % a.nheads;
      float* yrow = a.y + bh * p;
      const int64_t cache_row = a.rows[b];
      if (cache_row < 0) {  // padding: no state to advance
        for (int64_t i = 0; i < p; ++i) yrow[i] = 0.0f;
        continue;
      }
      const float* Bg = a.B + (b * a.ngroups + h / per_group) * n;
      const float* Cg = a.C + (b * a.ngroups + h / per_group) * n;
      T* hs = state + cache_row * st[0] + h * st[1];
      // dt, and with A the decay, once per head where they are tied over headdim
      const bool head_dt = a.dt.tied && (!a.bias || a.bias->tied);
      const float A_h = a.A_tied ? a.A[h * a.A_head] : 0.0f;
      const float dt_head = head_dt ? step_size(a, b, h, 0) : 0.0f;
      const float decay_head = head_dt && a.A_tied ? std::exp(dt_head * A_h) : 0.0f;
      for (int64_t i = 0; i < p; ++i) {
        dts[i] = head_dt ? dt_head : step_size(a, b, h, i);
        dtxs[i] = dts[i] * a.x[bh * p + i];
        decays[i] = !a.A_tied ? 0.0f : head_dt ? decay_head : std::exp(dts[i] * A_h);
      }
      const float* Ahead = a.A_tied ? nullptr : a.A + h * a.A_head;
      if (in_place) {
        advance(reinterpret_cast<float*>(hs), p, n, Ahead, dts.data(), decays.data(), dtxs.data(), Bg, Cg, acc.data());
      } else {
        for (int64_t i = 0; i < p; ++i) {
          T* hrow = hs + i * st[2];
          for (int64_t k = 0; k < n; ++k) row[k] = static_cast<float>(hrow[k * st[3]]);
          advance(row.data(), 1, n, Ahead ? Ahead + i * n : nullptr, dts.data() + i, decays.data() + i,
                  dtxs.data() + i, Bg, Cg, acc.data() + i);
          for (int64_t k = 0; k < n; ++k) hrow[k * st[3]] = static_cast<T>(row[k]);
        }
      }
      for (int64_t i = 0; i < p; ++i) {
        const float xv = a.x[bh * p + i];
        float out = a.D ? acc[i] + a.D->at(0, h, i) * xv : acc[i];
        if (a.z) {
          const float zv = a.z[bh * p + i];
          out *= zv / (1.0f + std::exp(-zv));
        }
        yrow[i] = out;
      }
    }
  });
}

Tensor multihead_state_update(Tensor state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, OptTensor D,
                              OptTensor z, OptTensor dt_bias, OptTensor state_batch_indices, bool dt_softplus) {
  check_cpu("x", x);
  // Mamba-1's layout (x (batch, dim), state (cache_size, dim, dstate), A (dim, dstate), B/C (batch, dstate)
  // or (batch, ngroups, dstate), z (batch, dim)): a channel is a head of headdim 1, read in place, so that
  // the front end passes a cache without building views per call
  const bool channels_as_heads = x.dim() == 2;
  STD_TORCH_CHECK(x.dim() == 3 || channels_as_heads,
                  "multihead_state_update: x must have shape (batch, nheads, headdim) or (batch, dim), got ",
                  shape_of(x));
  const int64_t batch = x.size(0), nheads = x.size(1), headdim = channels_as_heads ? 1 : x.size(2);
  const std::vector<int64_t> per_token = channels_as_heads ? std::vector<int64_t>{batch, nheads}
                                                           : std::vector<int64_t>{batch, nheads, headdim};
  check_float("x", x, per_token);
  check_cpu("state", state);
  STD_TORCH_CHECK(channels_as_heads ? state.dim() == 3 && state.size(1) == nheads
                                    : state.dim() == 4 && state.size(1) == nheads && state.size(2) == headdim,
                  "multihead_state_update: state must have shape ",
                  channels_as_heads ? "(cache_size, dim, dstate) with dim=("
                                    : "(cache_size, nheads, headdim, dstate) with (nheads, headdim)=(",
                  nheads, channels_as_heads ? "" : ", ", channels_as_heads ? "" : std::to_string(headdim), "), got ",
                  shape_of(state));
  const int64_t cache = state.size(0), dstate = state.size(state.dim() - 1);
  check_float("state", state, channels_as_heads ? std::vector<int64_t>{cache, nheads, dstate}
                                                : std::vector<int64_t>{cache, nheads, headdim, dstate});
  check_per_head("dt", dt, {batch, nheads, headdim}, {batch, nheads}, kFloats);
  if (channels_as_heads) {
    check_tensor_of("multihead_state_update", "A", A, {ST::Float}, {nheads, dstate}, "x");
  } else {
    check_per_head("A", A, {nheads, headdim, dstate}, {nheads}, {ST::Float});
  }
  const bool bc_flat = channels_as_heads && B.dim() == 2;  // one group
  STD_TORCH_CHECK((B.dim() == 3 || bc_flat) && B.size(0) == batch && B.size(B.dim() - 1) == dstate,
                  "multihead_state_update: B must have shape (batch, ngroups, dstate) with (batch, dstate)=(",
                  batch, ", ", dstate, "), got ", shape_of(B));
  const int64_t ngroups = bc_flat ? 1 : B.size(1);
  STD_TORCH_CHECK(ngroups >= 1 && nheads % ngroups == 0, "multihead_state_update: B has ngroups=", ngroups,
                  ", which does not divide nheads=", nheads);
  const std::vector<int64_t> bc_shape = bc_flat ? std::vector<int64_t>{batch, dstate}
                                                : std::vector<int64_t>{batch, ngroups, dstate};
  check_float("B", B, bc_shape);
  check_float("C", C, bc_shape);
  if (D) check_per_head("D", *D, {nheads, headdim}, {nheads}, kFloats);
  if (dt_bias) check_per_head("dt_bias", *dt_bias, {nheads, headdim}, {nheads}, kFloats);
  if (z) check_float("z", *z, per_token);

  std::vector<int64_t> rows(batch);
  if (state_batch_indices) {
    const Tensor& idx = *state_batch_indices;
    check_cpu("state_batch_indices", idx);
    STD_TORCH_CHECK(same_shape(idx, {batch}) && (idx.scalar_type() == ST::Int || idx.scalar_type() == ST::Long),
                    "multihead_state_update: state_batch_indices must have shape ", shape_str({batch}),
                    " and dtype int32 or int64, got ", shape_of(idx), " ", dtype_name(idx.scalar_type()));
    const Tensor idx64 = contig(torch::stable::to(idx, ST::Long));
    const int64_t* ip = idx64.const_data_ptr<int64_t>();
    for (int64_t b = 0; b < batch; ++b) {
      STD_TORCH_CHECK(ip[b] < cache, "multihead_state_update: state_batch_indices must be < the state's cache size ",
                      cache, ", got ", ip[b], " at row ", b);
      rows[b] = ip[b] < 0 ? -1 : ip[b];
    }
  } else {
    STD_TORCH_CHECK(cache == batch, "multihead_state_update: state must have batch ", batch,
                    " like x (or give state_batch_indices), got ", shape_of(state));
    for (int64_t b = 0; b < batch; ++b) rows[b] = b;
  }

  // A tied over headdim and dstate: read a value per head in place (not a copy of the expansion)
  const bool A_tied = A.dim() == 1 || (!channels_as_heads && A.stride(1) == 0 && A.stride(2) == 0);
  const Tensor x32 = as_f32(x), A32 = A_tied ? A : contig(A), B32 = as_f32(B), C32 = as_f32(C);
  OptTensor z32;
  if (z) z32 = as_f32(*z);
  Tensor y = empty_like_shape(x, per_token, ST::Float);
  MultiheadArgs a{batch, nheads, headdim, dstate, ngroups, A_tied, dt_softplus, head_values(dt, true),
                  D ? std::optional<HeadValues>(head_values(*D, false)) : std::nullopt,
                  dt_bias ? std::optional<HeadValues>(head_values(*dt_bias, false)) : std::nullopt,
                  x32.const_data_ptr<float>(), A32.const_data_ptr<float>(), B32.const_data_ptr<float>(),
                  C32.const_data_ptr<float>(), z32 ? z32->const_data_ptr<float>() : nullptr, A32.stride(0),
                  rows.data(), y.mutable_data_ptr<float>()};
  const int64_t strides[4] = {state.stride(0), state.stride(1), channels_as_heads ? dstate : state.stride(2),
                              state.stride(state.dim() - 1)};
  switch (state.scalar_type()) {
    case ST::Half:
      multihead_step(a, static_cast<c10::Half*>(state.mutable_data_ptr()), strides);
      break;
    case ST::BFloat16:
      multihead_step(a, static_cast<c10::BFloat16*>(state.mutable_data_ptr()), strides);
      break;
    default:
      multihead_step(a, state.mutable_data_ptr<float>(), strides);
  }
  return x.scalar_type() == ST::Float ? y : torch::stable::to(y, x.scalar_type());
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("selective_state_update", TORCH_BOX(&ssmops_cpu::selective_state_update));
  m.impl("multihead_state_update", TORCH_BOX(&ssmops_cpu::multihead_state_update));
}
