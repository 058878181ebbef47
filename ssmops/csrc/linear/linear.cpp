// The weight-only linear operator's CPU kernel (`weight_only_linear`), on LibTorch's stable ABI
// only. The schema is in ../library.cpp; the Python checks in ssmops/ops/linear/checks.py say
// the same things in the same words.
#include <algorithm>
#include <vector>

#include "../common/checks.h"
#include "../common/isa.h"
#include "linear.h"

namespace ssmops_cpu {
namespace {

constexpr const char* kOp = "weight_only_linear";

using RowsKernel = void (*)(const LinearArgs&, int64_t, int64_t);

// The AVX-512 build also uses AVX512-VNNI (linear_kernel_avx512.cpp), which some AVX-512 CPUs lack
// (Skylake-SP): those take the AVX2 build.
Isa linear_isa() {
  const Isa isa = selected_isa();
#if defined(__x86_64__)
  if (isa == Isa::kAvx512 && !__builtin_cpu_supports("avx512vnni")) return Isa::kAvx2;
#endif
  return isa;
}

// One row of x with weights narrower than float32 (int8, bf16, f16) goes through the AVX2 build on
// an AVX-512 CPU too. Measured on a Zen 4, one thread streaming weights from memory against a plain
// sum over the same bytes: the AVX2 build reads int8 at ~0.9-1.0 of the sum's rate and bf16 at
// ~0.95-1.0, the AVX-512 build at ~0.5-0.65 and ~0.7 (fp32 alike in both, ~0.75-0.8), whatever its
// tile's rows (1-12), so that two threads could not go past ~38 GB/s with int8 weights. Mamba-130m's
// compiled int8 token, both alternating in one process at ~31 GB/s: ~4-13% faster, bf16 ~1-4%. With
// more rows of x the AVX-512 build's multiply-adds (VNNI for int8) are the faster.
RowsKernel rows_kernel(const LinearArgs& a) {
  static const Isa isa = linear_isa();
  static const RowsKernel kernel = SSMOPS_ISA_KERNEL(isa, linear_rows);  // fixed for the process
  static const RowsKernel narrow_one_row = isa == Isa::kAvx512 ? SSMOPS_ISA_KERNEL(Isa::kAvx2, linear_rows) : kernel;
  return a.M == 1 && a.kind != WeightKind::kFloat32 ? narrow_one_row : kernel;
}

// For int8 weights, x rounded to int16 per row (linear_params.h), into one buffer per thread:
// decoding allocates nothing a call.
thread_local std::vector<int16_t> x_int16;
thread_local std::vector<float> x_scale;

void round_to_int16(const float* x, int64_t M, int64_t K) {
  using Round = void (*)(const float*, int64_t, int64_t, int16_t*, float*);
  static const Round round_rows = SSMOPS_ISA_KERNEL(linear_isa(), linear_round_int16);  // fixed for the process
  x_int16.resize(static_cast<size_t>(M * K));
  x_scale.resize(static_cast<size_t>(M));
  round_rows(x, M, K, x_int16.data(), x_scale.data());
}

}  // namespace

WeightKind weight_kind(ST t) {
  switch (t) {
    case ST::Float:
      return WeightKind::kFloat32;
    case ST::BFloat16:
      return WeightKind::kBFloat16;
    case ST::Half:
      return WeightKind::kFloat16;
    default:
      return WeightKind::kInt8;
  }
}

StreamedLinear::StreamedLinear(const float* x, int64_t M, const Tensor& weight, const float* scale,
                               const float* bias, float* y) {
  const WeightKind kind = weight_kind(weight.scalar_type());
  const int64_t N = weight.size(0), K = weight.size(1);
  if (kind == WeightKind::kInt8 && K > 0) round_to_int16(x, M, K);
  args_ = LinearArgs{x,
                     kind == WeightKind::kInt8 ? x_int16.data() : nullptr,
                     kind == WeightKind::kInt8 ? x_scale.data() : nullptr,
                     weight.const_data_ptr(),
                     kind,
                     scale,
                     bias,
                     y,
                     M,
                     N,
                     K};
  const int64_t task_bytes = kTaskRows * std::max<int64_t>(K, 1) * static_cast<int64_t>(weight.element_size());
  chunk_ = std::max<int64_t>(1, 65536 / task_bytes);
}

void StreamedLinear::rows(int64_t n_begin, int64_t n_end) const {
  if (args_.K == 0) {  // empty sums: the bias (the kernels size their prefetch by a row's bytes)
    for (int64_t m = 0; m < args_.M; ++m)
      for (int64_t n = n_begin; n < n_end; ++n) args_.y[m * args_.N + n] = args_.bias ? args_.bias[n] : 0.0f;
    return;
  }
  rows_kernel(args_)(args_, n_begin, n_end);
}

int64_t StreamedLinear::grain() const {
  return std::max<int64_t>(1, 32768 / (kTaskRows * std::max<int64_t>(args_.K, 1)));
}

void StreamedLinear::run() const {
  parallel_shares(tasks(), grain(), chunk(), [&](int64_t begin, int64_t end) {
    rows(begin * kTaskRows, std::min(end * kTaskRows, args_.N));
  });
}

namespace {

void check_inputs(const Tensor& x, const Tensor& weight, const OptTensor& weight_scale, const OptTensor& bias) {
  const ST xt = x.scalar_type();
  check_dtype_of(kOp, "x", x, {ST::Float, ST::Half, ST::BFloat16});
  STD_TORCH_CHECK(x.dim() >= 1, kOp, ": x must have shape (..., in_features), got ", shape_of(x));
  STD_TORCH_CHECK(x.is_cpu(), kOp, ": x must be a CPU tensor");
  check_dtype_of(kOp, "weight", weight, {ST::Float, ST::Half, ST::BFloat16, ST::Char});
  const int64_t K = x.size(x.dim() - 1);
  STD_TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K, kOp,
                  ": weight must have shape (out_features, in_features) with in_features=", K,
                  " (x's last size), got ", shape_of(weight));
  STD_TORCH_CHECK(weight.is_cpu(), kOp, ": weight must be on cpu like x, got another device");
  const int64_t N = weight.size(0);
  if (weight.scalar_type() == ST::Char) {
    STD_TORCH_CHECK(weight_scale.has_value(), kOp,
                    ": an int8 weight needs weight_scale, its float32 scale per output feature, shape (", N, ",)");
    check_tensor_of(kOp, "weight_scale", *weight_scale, {ST::Float}, {N}, "weight");
  } else {
    STD_TORCH_CHECK(!weight_scale.has_value(), kOp, ": weight_scale is for int8 weights only; weight has dtype ",
                    dtype_name(weight.scalar_type()));
  }
  if (bias) {
    if (xt == ST::Float)
      check_tensor_of(kOp, "bias", *bias, {ST::Float}, {N}, "weight");
    else
      check_tensor_of(kOp, "bias", *bias, {ST::Float, xt}, {N}, "weight");
  }
}

Tensor weight_only_linear(Tensor x, Tensor weight, OptTensor weight_scale, OptTensor bias) {
  check_inputs(x, weight, weight_scale, bias);
  const ST xt = x.scalar_type();
  const int64_t K = weight.size(1), N = weight.size(0);
  std::vector<int64_t> out_shape;
  int64_t M = 1;  // rows of x: its leading dimensions (with K = 0 too: each row's output is the bias)
  for (int64_t i = 0; i + 1 < x.dim(); ++i) {
    out_shape.push_back(x.size(i));
    M *= x.size(i);
  }
  out_shape.push_back(N);
  // decoding calls this ~100 times a token: no dispatcher round trip that the inputs do not need
  Tensor x2 = x.dim() == 2 ? x : torch::stable::reshape(x, {M, K});
  if (xt != ST::Float) x2 = torch::stable::to(x2, ST::Float);
  x2 = contig(x2);
  Tensor y, scale = weight_scale ? contig(*weight_scale) : x2;
  Tensor bias32 = !bias ? x2 : bias->scalar_type() == ST::Float ? contig(*bias) : as_f32(*bias);
  if (M > 0 && M <= kMaxStreamedRows) {
    y = empty_like_shape(x, out_shape, ST::Float);
    const float* scale_p = weight_scale ? scale.const_data_ptr<float>() : nullptr;
    const float* bias_p = bias ? bias32.const_data_ptr<float>() : nullptr;
    StreamedLinear(x2.const_data_ptr<float>(), M, contig(weight), scale_p, bias_p, y.mutable_data_ptr<float>()).run();
  } else {
    Tensor w32 = torch::stable::to(weight, ST::Float);  // int8: the scale is applied to y below
    y = contig(torch::stable::matmul(x2, torch::stable::transpose(w32, 0, 1)));
    if (weight_scale || bias) {
      float* yp = y.mutable_data_ptr<float>();
      const float* sp = weight_scale ? scale.const_data_ptr<float>() : nullptr;
      const float* bp = bias ? bias32.const_data_ptr<float>() : nullptr;
      torch::stable::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin * N; i < end * N; ++i) {
          const int64_t n = i % N;
          yp[i] = (sp ? yp[i] * sp[n] : yp[i]) + (bp ? bp[n] : 0.0f);
        }
      });
    }
  }
  if (y.dim() != static_cast<int64_t>(out_shape.size())) y = torch::stable::reshape(y, out_shape);
  return xt == ST::Float ? y : torch::stable::to(y, xt);
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) { m.impl("weight_only_linear", TORCH_BOX(&ssmops_cpu::weight_only_linear)); }
