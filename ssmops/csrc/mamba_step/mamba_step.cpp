// The fused decoding step of a Mamba block's mixer (`mamba_step`), on LibTorch's stable ABI only.
// The schema is in ../library.cpp; the Python checks in ssmops/ops/mamba_step/checks.py say the
// same things in the same words.
//
// Why one operator: unfused, a layer's step is ~7 operator calls and graph kernels, each a trip
// through the dispatcher or a wake-up of the threads. That overhead alone (24 layers of d_model 64)
// cost ~1.04 ms a compiled token and ~4.6 ms an eager one; as one call a layer, ~0.66 and ~2.9. Here
// a layer is four parallel regions, one per projection, with the conv's window done by the threads
// that produced its inputs and the state update by those that produce dt; the intermediates live in
// one buffer per calling thread.
#include <algorithm>
#include <vector>

#include "../common/checks.h"
#include "../linear/linear.h"
#include "../state_update/state_update.h"

namespace ssmops_cpu {
namespace {

constexpr const char* kOp = "mamba_step";
const std::vector<ST> kF32 = {ST::Float};
const std::vector<ST> kWeightDtypes = {ST::Float, ST::Half, ST::BFloat16, ST::Char};

void check_2d(const char* name, const Tensor& t, const char* layout, const std::vector<ST>& dtypes) {
  check_dtype_of(kOp, name, t, dtypes);
  STD_TORCH_CHECK(t.dim() == 2, kOp, ": ", name, " must have shape ", layout, ", got ", shape_of(t));
}

void check_f32(const char* name, const Tensor& t, const std::vector<int64_t>& shape, const char* sizes_from) {
  check_tensor_of(kOp, name, t, kF32, shape, sizes_from);
}

// A projection's weight (out_features, in_features) in a weight format, its scale (int8 only) and bias.
void check_linear(const std::string& name, const Tensor& weight, const OptTensor& scale, const OptTensor& bias,
                  int64_t in_features, int64_t out_features, const char* sizes_from) {
  const std::string w = name + "_weight", s = name + "_scale", b = name + "_bias";
  check_tensor_of(kOp, w.c_str(), weight, kWeightDtypes, {out_features, in_features}, sizes_from);
  if (weight.scalar_type() == ST::Char) {
    STD_TORCH_CHECK(scale.has_value(), kOp, ": an int8 ", w, " needs ", s,
                    ", its float32 scale per output feature, shape (", out_features, ",)");
    check_f32(s.c_str(), *scale, {out_features}, w.c_str());
  } else {
    STD_TORCH_CHECK(!scale.has_value(), kOp, ": ", s, " is for int8 weights only; ", w, " has dtype ",
                    dtype_name(weight.scalar_type()));
  }
  if (bias) check_f32(b.c_str(), *bias, {out_features}, w.c_str());
}

const float* ptr(const OptTensor& t) { return t ? t->const_data_ptr<float>() : nullptr; }

// The conv's step over channels [c0, c1) of one sequence: each channel's window (d_conv values,
// oldest first) shifts by one and takes x, and out = bias + window . weight, summed oldest first.
// kConv is d_conv when known at compile time (4, Mamba's), else 0. Through restrict pointers a
// channel's stores cannot alias the next one's loads, so channels overlap: one thread's share of
// mamba-130m's layer at batch 8 took ~27 us, ~18 now (batch 1: ~4, ~3); the same sums (bitwise).
template <int kConv>
void conv_step(float* __restrict window, const float* __restrict weight, const float* __restrict bias,
               const float* __restrict x, float* __restrict out, int64_t c0, int64_t c1, int64_t d_conv) {
  const int64_t n = kConv ? kConv : d_conv;
  for (int64_t c = c0; c < c1; ++c) {
    float* w = window + c * n;
    const float* cw = weight + c * n;
    float acc = bias ? bias[c] : 0.0f;
    for (int64_t k = 0; k + 1 < n; ++k) {
      const float v = w[k + 1];
      w[k] = v;
      acc += v * cw[k];
    }
    w[n - 1] = x[c];
    out[c] = acc + x[c] * cw[n - 1];
  }
}

// One layer's intermediates, float32, reused from call to call (decoding allocates nothing a token).
thread_local std::vector<float> scratch;

Tensor mamba_step(Tensor hidden_states, Tensor conv_state, Tensor ssm_state, Tensor in_proj_weight,
                  OptTensor in_proj_scale, OptTensor in_proj_bias, Tensor conv_weight, OptTensor conv_bias,
                  Tensor x_proj_weight, OptTensor x_proj_scale, Tensor dt_proj_weight, OptTensor dt_proj_scale,
                  OptTensor dt_proj_bias, Tensor A_log, OptTensor D, Tensor out_proj_weight, OptTensor out_proj_scale,
                  OptTensor out_proj_bias) {
  check_2d("hidden_states", hidden_states, "(batch, d_model)", kF32);
  STD_TORCH_CHECK(hidden_states.is_cpu(), kOp, ": hidden_states must be a CPU tensor");
  const int64_t batch = hidden_states.size(0), d_model = hidden_states.size(1);
  check_2d("in_proj_weight", in_proj_weight, "(2 * d_inner, d_model)", kWeightDtypes);
  STD_TORCH_CHECK(in_proj_weight.size(0) % 2 == 0 && in_proj_weight.size(0) > 0, kOp,
                  ": in_proj_weight must have shape (2 * d_inner, d_model) with d_inner >= 1, got ",
                  shape_of(in_proj_weight));
  const int64_t d_inner = in_proj_weight.size(0) / 2;
  check_linear("in_proj", in_proj_weight, in_proj_scale, in_proj_bias, d_model, 2 * d_inner, "hidden_states");
  check_2d("A_log", A_log, "(d_inner, d_state)", kF32);
  const int64_t d_state = A_log.size(1);
  STD_TORCH_CHECK(d_state >= 1 && d_state <= kMaxDstate, kOp, ": A_log must have 1 <= d_state <= ", kMaxDstate,
                  ", got d_state=", d_state);
  check_f32("A_log", A_log, {d_inner, d_state}, "in_proj_weight");
  check_2d("conv_weight", conv_weight, "(d_inner, d_conv)", kF32);
  const int64_t d_conv = conv_weight.size(1);
  STD_TORCH_CHECK(d_conv >= 1, kOp, ": conv_weight must have shape (d_inner, d_conv) with d_conv >= 1, got ",
                  shape_of(conv_weight));
  check_f32("conv_weight", conv_weight, {d_inner, d_conv}, "in_proj_weight");
  if (conv_bias) check_f32("conv_bias", *conv_bias, {d_inner}, "in_proj_weight");
  check_f32("conv_state", conv_state, {batch, d_inner, d_conv}, "hidden_states, in_proj_weight and conv_weight");
  check_f32("ssm_state", ssm_state, {batch, d_inner, d_state}, "hidden_states, in_proj_weight and A_log");
  check_2d("x_proj_weight", x_proj_weight, "(dt_rank + 2 * d_state, d_inner)", kWeightDtypes);
  const int64_t dt_rank = x_proj_weight.size(0) - 2 * d_state;
  STD_TORCH_CHECK(dt_rank >= 1, kOp, ": x_proj_weight must have shape (dt_rank + 2 * d_state, d_inner) with d_state=",
                  d_state, " and dt_rank >= 1, got ", shape_of(x_proj_weight));
  check_linear("x_proj", x_proj_weight, x_proj_scale, std::nullopt, d_inner, dt_rank + 2 * d_state,
               "in_proj_weight and A_log");
  check_linear("dt_proj", dt_proj_weight, dt_proj_scale, dt_proj_bias, dt_rank, d_inner,
               "in_proj_weight and x_proj_weight");
  if (D) check_f32("D", *D, {d_inner}, "in_proj_weight");
  check_2d("out_proj_weight", out_proj_weight, "(out_features, in_features)", kWeightDtypes);
  const int64_t out_features = out_proj_weight.size(0);
  check_linear("out_proj", out_proj_weight, out_proj_scale, out_proj_bias, d_inner, out_features, "in_proj_weight");

  // float32 inputs; strided ones (and the states) through contiguous copies
  const Tensor hidden = contig(hidden_states), in_w = contig(in_proj_weight), x_w = contig(x_proj_weight);
  const Tensor dt_w = contig(dt_proj_weight), out_w = contig(out_proj_weight), conv_w = contig(conv_weight);
  const Tensor A_log32 = contig(A_log);
  const OptTensor in_s = contig(in_proj_scale), in_b = contig(in_proj_bias), conv_b = contig(conv_bias);
  const OptTensor x_s = contig(x_proj_scale), dt_s = contig(dt_proj_scale), dt_b = contig(dt_proj_bias);
  const OptTensor D32 = contig(D), out_s = contig(out_proj_scale), out_b = contig(out_proj_bias);
  Tensor window = contig(conv_state), h = contig(ssm_state);
  Tensor out = empty_like_shape(hidden_states, {batch, out_features}, ST::Float);

  const int64_t M = batch, R = dt_rank + 2 * d_state;
  scratch.resize(static_cast<size_t>(M * (2 * d_inner + d_inner + R + dt_rank + d_inner + d_inner) +
                                     d_inner * d_state));
  float* xz = scratch.data();       // (M, 2 * d_inner): in_proj's output, x then z
  float* xc = xz + M * 2 * d_inner;  // (M, d_inner): the conv's output
  float* x_dbl = xc + M * d_inner;   // (M, R): dt, B, C
  float* dt_in = x_dbl + M * R;      // (M, dt_rank): dt_proj's input, contiguous
  float* dt = dt_in + M * dt_rank;   // (M, d_inner)
  float* y = dt + M * d_inner;       // (M, d_inner): the state update's output
  float* A = y + M * d_inner;        // (d_inner, d_state): -exp(A_log)

  // in_proj, and the conv over each channel right after the thread computed its x: a thread takes
  // the rows of x and of z of the same channels, so that each has its share of the conv
  const float* cw = conv_w.const_data_ptr<float>();
  const float* cb = ptr(conv_b);
  float* win = window.mutable_data_ptr<float>();
  const StreamedLinear in_proj(hidden.const_data_ptr<float>(), M, in_w, ptr(in_s), ptr(in_b), xz);
  const int64_t channel_tasks = (d_inner + kTaskRows - 1) / kTaskRows;
  parallel_shares(channel_tasks, in_proj.grain(), in_proj.chunk(), [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kTaskRows, c1 = std::min(end * kTaskRows, d_inner);
    in_proj.rows(c0, c1);
    for (int64_t m = 0; m < M; ++m) {
      float* window_m = win + m * d_inner * d_conv;
      const float* x_m = xz + m * 2 * d_inner;
      if (d_conv == 4)
        conv_step<4>(window_m, cw, cb, x_m, xc + m * d_inner, c0, c1, d_conv);
      else
        conv_step<0>(window_m, cw, cb, x_m, xc + m * d_inner, c0, c1, d_conv);
      silu_in_place(xc + m * d_inner + c0, c1 - c0);
    }
    in_proj.rows(d_inner + c0, d_inner + c1);
  });

  StreamedLinear(xc, M, x_w, ptr(x_s), nullptr, x_dbl).run();
  for (int64_t m = 0; m < M; ++m) std::copy(x_dbl + m * R, x_dbl + m * R + dt_rank, dt_in + m * dt_rank);

  // dt_proj, and the state update of each channel by the thread that computed its dt
  const SelectiveStep step{d_inner, d_state, 1, R, 2 * d_inner, true, h.mutable_data_ptr<float>(), xc, dt,
                           A, x_dbl + dt_rank, x_dbl + dt_rank + d_state, ptr(D32),
                           xz + d_inner, ptr(dt_b), y};
  const StreamedLinear dt_proj(dt_in, M, dt_w, ptr(dt_s), nullptr, dt);
  torch::stable::parallel_for(0, dt_proj.tasks(), 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kTaskRows, c1 = std::min(end * kTaskRows, d_inner);
    dt_proj.rows(c0, c1);
    neg_exp(A_log32.const_data_ptr<float>() + c0 * d_state, A + c0 * d_state, (c1 - c0) * d_state);
    for (int64_t m = 0; m < M; ++m) step.rows(m * d_inner + c0, m * d_inner + c1);
  });

  StreamedLinear(y, M, out_w, ptr(out_s), ptr(out_b), out.mutable_data_ptr<float>()).run();

  if (window.data_ptr() != conv_state.data_ptr()) torch::stable::copy_(conv_state, window);
  if (h.data_ptr() != ssm_state.data_ptr()) torch::stable::copy_(ssm_state, h);
  return out;
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) { m.impl("mamba_step", TORCH_BOX(&ssmops_cpu::mamba_step)); }
