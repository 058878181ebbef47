// The fused decoding step of Mamba blocks on LibTorch's stable ABI only: `mamba_step`, one mixer,
// and `mamba_layers_step`, a stack of pre-norm blocks (the residual add and RMSNorm, then the
// mixer, for every layer). The schemas are in ../library.cpp; the Python checks in
// ssmops/ops/mamba_step/checks.py say the same things in the same words.
//
// Why one operator: unfused, a layer's step is ~7 operator calls and graph kernels, each a trip
// through the dispatcher or a wake-up of the threads. That overhead alone (24 layers of d_model 64)
// cost ~1.04 ms a compiled token and ~4.6 ms an eager one; as one call a layer, ~0.66 and ~2.9. Here
// a layer is four parallel regions, one per projection, with the conv's window done by the threads
// that produced its inputs and the state update by those that produce dt; the intermediates live in
// one buffer per calling thread. Between layers a token also paid ~30-50 us of dispatch and graph
// code at mamba-130m's shape (the call path evicted by the streamed weights, docs/limits.md);
// `mamba_layers_step` keeps the whole stack in one call.
#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "../common/checks.h"
#include "../linear/linear.h"
#include "../state_update/state_update.h"

namespace ssmops_cpu {
namespace {

const std::vector<ST> kF32 = {ST::Float};
const std::vector<ST> kWeightDtypes = {ST::Float, ST::Half, ST::BFloat16, ST::Char};

// `op` opens every message: "mamba_step", or "mamba_layers_step: layer 3" for one of its layers.
void check_2d(const std::string& op, const char* name, const Tensor& t, const char* layout,
              const std::vector<ST>& dtypes) {
  check_dtype_of(op.c_str(), name, t, dtypes);
  STD_TORCH_CHECK(t.dim() == 2, op, ": ", name, " must have shape ", layout, ", got ", shape_of(t));
}

void check_f32(const std::string& op, const char* name, const Tensor& t, const std::vector<int64_t>& shape,
               const char* sizes_from) {
  check_tensor_of(op.c_str(), name, t, kF32, shape, sizes_from);
}

// A projection's weight (out_features, in_features) in a weight format, its scale (int8 only) and bias.
void check_linear(const std::string& op, const std::string& name, const Tensor& weight, const OptTensor& scale,
                  const OptTensor& bias, int64_t in_features, int64_t out_features, const char* sizes_from) {
  const std::string w = name + "_weight", s = name + "_scale", b = name + "_bias";
  check_tensor_of(op.c_str(), w.c_str(), weight, kWeightDtypes, {out_features, in_features}, sizes_from);
  if (weight.scalar_type() == ST::Char) {
    STD_TORCH_CHECK(scale.has_value(), op, ": an int8 ", w, " needs ", s,
                    ", its float32 scale per output feature, shape (", out_features, ",)");
    check_f32(op, s.c_str(), *scale, {out_features}, w.c_str());
  } else {
    STD_TORCH_CHECK(!scale.has_value(), op, ": ", s, " is for int8 weights only; ", w, " has dtype ",
                    dtype_name(weight.scalar_type()));
  }
  if (bias) check_f32(op, b.c_str(), *bias, {out_features}, w.c_str());
}

const float* ptr(const OptTensor& t) { return t ? t->const_data_ptr<float>() : nullptr; }

// One Mamba-1 mixer's parameters, in the operators' order.
struct Mixer {
  Tensor in_w;
  OptTensor in_s, in_b;
  Tensor conv_w;
  OptTensor conv_b;
  Tensor x_w;
  OptTensor x_s;
  Tensor dt_w;
  OptTensor dt_s, dt_b;
  Tensor A_log;
  OptTensor D;
  Tensor out_w;
  OptTensor out_s, out_b;

  // the same parameters, strided ones through contiguous copies
  Mixer contiguous() const {
    return {contig(in_w), contig(in_s), contig(in_b), contig(conv_w), contig(conv_b), contig(x_w),
            contig(x_s), contig(dt_w), contig(dt_s), contig(dt_b), contig(A_log), contig(D),
            contig(out_w), contig(out_s), contig(out_b)};
  }
};

struct MixerSizes {
  int64_t d_inner, d_state, d_conv, dt_rank, out_features;
};

// Checks a mixer's parameters and states against `batch` rows of `d_model` features; returns its sizes.
MixerSizes check_mixer(const std::string& op, int64_t batch, int64_t d_model, const Tensor& conv_state,
                       const Tensor& ssm_state, const Mixer& p) {
  check_2d(op, "in_proj_weight", p.in_w, "(2 * d_inner, d_model)", kWeightDtypes);
  STD_TORCH_CHECK(p.in_w.size(0) % 2 == 0 && p.in_w.size(0) > 0, op,
                  ": in_proj_weight must have shape (2 * d_inner, d_model) with d_inner >= 1, got ",
                  shape_of(p.in_w));
  const int64_t d_inner = p.in_w.size(0) / 2;
  check_linear(op, "in_proj", p.in_w, p.in_s, p.in_b, d_model, 2 * d_inner, "hidden_states");
  check_2d(op, "A_log", p.A_log, "(d_inner, d_state)", kF32);
  const int64_t d_state = p.A_log.size(1);
  STD_TORCH_CHECK(d_state >= 1 && d_state <= kMaxDstate, op, ": A_log must have 1 <= d_state <= ", kMaxDstate,
                  ", got d_state=", d_state);
  check_f32(op, "A_log", p.A_log, {d_inner, d_state}, "in_proj_weight");
  check_2d(op, "conv_weight", p.conv_w, "(d_inner, d_conv)", kF32);
  const int64_t d_conv = p.conv_w.size(1);
  STD_TORCH_CHECK(d_conv >= 1, op, ": conv_weight must have shape (d_inner, d_conv) with d_conv >= 1, got ",
                  shape_of(p.conv_w));
  check_f32(op, "conv_weight", p.conv_w, {d_inner, d_conv}, "in_proj_weight");
  if (p.conv_b) check_f32(op, "conv_bias", *p.conv_b, {d_inner}, "in_proj_weight");
  check_f32(op, "conv_state", conv_state, {batch, d_inner, d_conv}, "hidden_states, in_proj_weight and conv_weight");
  check_f32(op, "ssm_state", ssm_state, {batch, d_inner, d_state}, "hidden_states, in_proj_weight and A_log");
  check_2d(op, "x_proj_weight", p.x_w, "(dt_rank + 2 * d_state, d_inner)", kWeightDtypes);
  const int64_t dt_rank = p.x_w.size(0) - 2 * d_state;
  STD_TORCH_CHECK(dt_rank >= 1, op, ": x_proj_weight must have shape (dt_rank + 2 * d_state, d_inner) with d_state=",
                  d_state, " and dt_rank >= 1, got ", shape_of(p.x_w));
  check_linear(op, "x_proj", p.x_w, p.x_s, std::nullopt, d_inner, dt_rank + 2 * d_state, "in_proj_weight and A_log");
  check_linear(op, "dt_proj", p.dt_w, p.dt_s, p.dt_b, dt_rank, d_inner, "in_proj_weight and x_proj_weight");
  if (p.D) check_f32(op, "D", *p.D, {d_inner}, "in_proj_weight");
  check_2d(op, "out_proj_weight", p.out_w, "(out_features, in_features)", kWeightDtypes);
  const int64_t out_features = p.out_w.size(0);
  check_linear(op, "out_proj", p.out_w, p.out_s, p.out_b, d_inner, out_features, "in_proj_weight");
  return {d_inner, d_state, d_conv, dt_rank, out_features};
}

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

// One token of M sequences through a mixer whose parameters are contiguous: hidden (M, d_model) in,
// out (M, out_features); the windows win (M, d_inner, d_conv) and states h (M, d_inner, d_state),
// contiguous, advanced in place. Four parallel regions, one per projection.
void mixer_step(const float* hidden, int64_t M, const Mixer& p, const MixerSizes& n, float* win, float* h,
                float* out) {
  const int64_t d_inner = n.d_inner, d_state = n.d_state, d_conv = n.d_conv, dt_rank = n.dt_rank;
  const int64_t R = dt_rank + 2 * d_state;
  scratch.resize(static_cast<size_t>(M * (2 * d_inner + d_inner + R + dt_rank + d_inner + d_inner) +
                                     d_inner * d_state));
  float* xz = scratch.data();       // (M, 2 * d_inner): in_proj's output, x then z
  float* xc = xz + M * 2 * d_inner;  // (M, d_inner): the conv's output
  float* x_dbl = xc + M * d_inner;   // (M, R): dt, B, C
  float* dt_in = x_dbl + M * R;      // (M, dt_rank): dt_proj's input, contiguous
  float* dt = dt_in + M * dt_rank;   // (M, d_inner)
  float* y = dt + M * d_inner;       // (M, d_inner): the state update's output
  float* A = y + M * d_inner;        // (d_inner, d_state): -exp(A_log)

  // in_proj, and the conv over each channel by the thread that computed its x. Its tasks are the rows
  // of x (each with its channels' conv), then those of z, so that with two threads each streams one
  // half of the weights front to back. A thread that took x's and z's rows of the same channels, one
  // task after the other (each thread its share of the conv), switched between two streams every task:
  // mamba-130m's token on the 2-vCPU Zen 3, both alternating in one process, ~1-4% slower in fp32
  // (faster in 9-11 of 16 rounds) and ~1.5% in int8.
  const float* cw = p.conv_w.const_data_ptr<float>();
  const float* cb = ptr(p.conv_b);
  const StreamedLinear in_proj(hidden, M, p.in_w, ptr(p.in_s), ptr(p.in_b), xz);
  const int64_t channel_tasks = (d_inner + kTaskRows - 1) / kTaskRows;
  parallel_shares(2 * channel_tasks, in_proj.grain(), in_proj.chunk(), [&](int64_t begin, int64_t end) {
    if (begin < channel_tasks) {  // rows of x, then the conv over their channels
      const int64_t c0 = begin * kTaskRows, c1 = std::min(std::min(end, channel_tasks) * kTaskRows, d_inner);
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
    }
    if (end > channel_tasks) {  // rows of z
      const int64_t z0 = std::max(begin - channel_tasks, int64_t{0}) * kTaskRows;
      in_proj.rows(d_inner + z0, d_inner + std::min((end - channel_tasks) * kTaskRows, d_inner));
    }
  });

  StreamedLinear(xc, M, p.x_w, ptr(p.x_s), nullptr, x_dbl).run();
  for (int64_t m = 0; m < M; ++m) std::copy(x_dbl + m * R, x_dbl + m * R + dt_rank, dt_in + m * dt_rank);

  // dt_proj, and the state update of each channel by the thread that computed its dt
  const SelectiveStep step{d_inner, d_state, 1, R, 2 * d_inner, true, h, xc, dt,
                           A, x_dbl + dt_rank, x_dbl + dt_rank + d_state, ptr(p.D),
                           xz + d_inner, ptr(p.dt_b), y};
  const StreamedLinear dt_proj(dt_in, M, p.dt_w, ptr(p.dt_s), nullptr, dt);
  const float* A_log = p.A_log.const_data_ptr<float>();
  torch::stable::parallel_for(0, dt_proj.tasks(), 1, [&](int64_t begin, int64_t end) {
    const int64_t c0 = begin * kTaskRows, c1 = std::min(end * kTaskRows, d_inner);
    dt_proj.rows(c0, c1);
    neg_exp(A_log + c0 * d_state, A + c0 * d_state, (c1 - c0) * d_state);
    for (int64_t m = 0; m < M; ++m) step.rows(m * d_inner + c0, m * d_inner + c1);
  });

  StreamedLinear(y, M, p.out_w, ptr(p.out_s), ptr(p.out_b), out).run();
}

// A state as mixer_step takes it (contiguous), and its write-back when that took a copy.
struct StateBuffer {
  Tensor given, buffer;
  explicit StateBuffer(const Tensor& state) : given(state), buffer(contig(state)) {}
  float* data() { return buffer.mutable_data_ptr<float>(); }
  void write_back() {
    if (buffer.data_ptr() != given.data_ptr()) torch::stable::copy_(given, buffer);
  }
};

Tensor mamba_step(Tensor hidden_states, Tensor conv_state, Tensor ssm_state, Tensor in_proj_weight,
                  OptTensor in_proj_scale, OptTensor in_proj_bias, Tensor conv_weight, OptTensor conv_bias,
                  Tensor x_proj_weight, OptTensor x_proj_scale, Tensor dt_proj_weight, OptTensor dt_proj_scale,
                  OptTensor dt_proj_bias, Tensor A_log, OptTensor D, Tensor out_proj_weight, OptTensor out_proj_scale,
                  OptTensor out_proj_bias) {
  const std::string op = "mamba_step";
  check_2d(op, "hidden_states", hidden_states, "(batch, d_model)", kF32);
  STD_TORCH_CHECK(hidden_states.is_cpu(), op, ": hidden_states must be a CPU tensor");
  const Mixer given{in_proj_weight, in_proj_scale, in_proj_bias, conv_weight, conv_bias, x_proj_weight,
                    x_proj_scale, dt_proj_weight, dt_proj_scale, dt_proj_bias, A_log, D, out_proj_weight,
                    out_proj_scale, out_proj_bias};
  const int64_t batch = hidden_states.size(0);
  const MixerSizes sizes = check_mixer(op, batch, hidden_states.size(1), conv_state, ssm_state, given);

  const Tensor hidden = contig(hidden_states);
  StateBuffer window(conv_state), h(ssm_state);
  Tensor out = empty_like_shape(hidden_states, {batch, sizes.out_features}, ST::Float);
  mixer_step(hidden.const_data_ptr<float>(), batch, given.contiguous(), sizes, window.data(), h.data(),
             out.mutable_data_ptr<float>());
  window.write_back();
  h.write_back();
  return out;
}

template <class T>
void check_list_size(const char* name, const std::vector<T>& list, size_t layers) {
  STD_TORCH_CHECK(list.size() == layers, "mamba_layers_step: ", name, " must hold one entry per layer (", layers,
                  "), got ", list.size());
}

// residual (M, d) += x (M, d), or = x when there is no residual yet; then
// normed = residual / sqrt(mean(residual^2) + eps) * weight, row by row
void add_rms_norm(const float* x, const float* residual_in, float* residual, const float* weight, float eps,
                  int64_t M, int64_t d, float* normed) {
  for (int64_t m = 0; m < M; ++m) {
    const float* x_m = x + m * d;
    const float* in_m = residual_in ? residual_in + m * d : nullptr;
    float* r = residual + m * d;
    double sum_sq = 0.0;
    for (int64_t j = 0; j < d; ++j) {
      r[j] = in_m ? x_m[j] + in_m[j] : x_m[j];
      sum_sq += static_cast<double>(r[j]) * r[j];
    }
    const float rstd = 1.0f / std::sqrt(static_cast<float>(sum_sq / d) + eps);
    for (int64_t j = 0; j < d; ++j) normed[m * d + j] = r[j] * rstd * weight[j];
  }
}

// The normed input of a layer's mixer, reused from call to call.
thread_local std::vector<float> normed_rows;

std::tuple<Tensor, Tensor> mamba_layers_step(
    Tensor hidden_states, OptTensor residual, std::vector<Tensor> conv_states, std::vector<Tensor> ssm_states,
    std::vector<Tensor> norm_weight, double norm_eps, std::vector<Tensor> in_proj_weight,
    std::vector<OptTensor> in_proj_scale, std::vector<OptTensor> in_proj_bias, std::vector<Tensor> conv_weight,
    std::vector<OptTensor> conv_bias, std::vector<Tensor> x_proj_weight, std::vector<OptTensor> x_proj_scale,
    std::vector<Tensor> dt_proj_weight, std::vector<OptTensor> dt_proj_scale, std::vector<OptTensor> dt_proj_bias,
    std::vector<Tensor> A_log, std::vector<OptTensor> D, std::vector<Tensor> out_proj_weight,
    std::vector<OptTensor> out_proj_scale, std::vector<OptTensor> out_proj_bias, OptTensor final_norm_weight) {
  const std::string op = "mamba_layers_step";
  check_2d(op, "hidden_states", hidden_states, "(batch, d_model)", kF32);
  STD_TORCH_CHECK(hidden_states.is_cpu(), op, ": hidden_states must be a CPU tensor");
  const int64_t batch = hidden_states.size(0), d_model = hidden_states.size(1);
  if (residual) check_f32(op, "residual", *residual, {batch, d_model}, "hidden_states");
  if (final_norm_weight) check_f32(op, "final_norm_weight", *final_norm_weight, {d_model}, "hidden_states");
  const size_t layers = norm_weight.size();
  STD_TORCH_CHECK(layers >= 1, op, ": norm_weight must hold one tensor per layer, at least one, got none");
  for (const auto& [name, list] : {std::pair{"conv_states", &conv_states}, {"ssm_states", &ssm_states},
                                   {"in_proj_weight", &in_proj_weight}, {"conv_weight", &conv_weight},
                                   {"x_proj_weight", &x_proj_weight}, {"dt_proj_weight", &dt_proj_weight},
                                   {"A_log", &A_log}, {"out_proj_weight", &out_proj_weight}})
    check_list_size(name, *list, layers);
  for (const auto& [name, list] : {std::pair{"in_proj_scale", &in_proj_scale}, {"in_proj_bias", &in_proj_bias},
                                   {"conv_bias", &conv_bias}, {"x_proj_scale", &x_proj_scale},
                                   {"dt_proj_scale", &dt_proj_scale}, {"dt_proj_bias", &dt_proj_bias}, {"D", &D},
                                   {"out_proj_scale", &out_proj_scale}, {"out_proj_bias", &out_proj_bias}})
    check_list_size(name, *list, layers);

  std::vector<Mixer> mixers;
  std::vector<MixerSizes> sizes;
  for (size_t i = 0; i < layers; ++i) {
    const std::string layer_op = op + ": layer " + std::to_string(i);
    check_f32(layer_op, "norm_weight", norm_weight[i], {d_model}, "hidden_states");
    mixers.push_back({in_proj_weight[i], in_proj_scale[i], in_proj_bias[i], conv_weight[i],
                      conv_bias[i], x_proj_weight[i], x_proj_scale[i], dt_proj_weight[i],
                      dt_proj_scale[i], dt_proj_bias[i], A_log[i], D[i], out_proj_weight[i],
                      out_proj_scale[i], out_proj_bias[i]});
    sizes.push_back(check_mixer(layer_op, batch, d_model, conv_states[i], ssm_states[i], mixers.back()));
    STD_TORCH_CHECK(sizes.back().out_features == d_model, layer_op, ": out_proj_weight must have d_model=", d_model,
                    " output features (the next layer's input), got shape ", shape_of(out_proj_weight[i]));
  }

  const Tensor hidden = contig(hidden_states);
  const OptTensor residual_in = contig(residual);
  Tensor hidden_out = empty_like_shape(hidden_states, {batch, d_model}, ST::Float);
  Tensor residual_out = empty_like_shape(hidden_states, {batch, d_model}, ST::Float);
  float* x = hidden_out.mutable_data_ptr<float>();
  float* r = residual_out.mutable_data_ptr<float>();
  normed_rows.resize(static_cast<size_t>(batch * d_model));
  for (size_t i = 0; i < layers; ++i) {
    const Tensor norm_w = contig(norm_weight[i]);
    add_rms_norm(i ? x : hidden.const_data_ptr<float>(), i ? r : ptr(residual_in), r, norm_w.const_data_ptr<float>(),
                 static_cast<float>(norm_eps), batch, d_model, normed_rows.data());
    StateBuffer window(conv_states[i]), h(ssm_states[i]);
    mixer_step(normed_rows.data(), batch, mixers[i].contiguous(), sizes[i], window.data(), h.data(), x);
    window.write_back();
    h.write_back();
  }
  if (final_norm_weight) {
    // The model's last norm here rather than as two operator calls after the stack: after the
    // streamed weights, aten's add and rms_norm took ~0.35-0.5 ms for one 768-wide row (~0.05 ms
    // warm). Mamba-130m's token on the 2-vCPU Zen 3, both alternating in one process: int8 ~4.8%
    // faster (in 23 of 30 rounds), fp32 ~1.9% (19 of 30). add_rms_norm reads each row of x whole
    // before it writes that row's normed values, so x can take them.
    const Tensor norm_w = contig(*final_norm_weight);
    add_rms_norm(x, r, r, norm_w.const_data_ptr<float>(), static_cast<float>(norm_eps), batch, d_model, x);
  }
  return {hidden_out, residual_out};
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("mamba_step", TORCH_BOX(&ssmops_cpu::mamba_step));
  m.impl("mamba_layers_step", TORCH_BOX(&ssmops_cpu::mamba_layers_step));
}
