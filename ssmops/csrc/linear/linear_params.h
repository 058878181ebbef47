// What linear.cpp hands the weight-only linear kernels (one build per instruction set).
#pragma once

#include <cstdint>

namespace ssmops_cpu {

// How the weight (N, K), row-major, is stored; the kernels widen it to float32 as they read it.
enum class WeightKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kInt8 = 3 };

// The operators' unit of work: a multiple of every tile's weight rows.
constexpr int64_t kTaskRows = 24;

// The largest |x_int16|: each row of x is scaled so that its largest |x| becomes this.
constexpr float kXInt16Max = 32767.0f;

struct LinearArgs {
  const float* x;      // (M, K) float32, contiguous
  // int8 weights: x rounded to 16-bit integers, row m ~ x_scale[m] * x_int16[m] (linear.cpp), so that
  // the products are integer multiply-adds, exact and in any order
  const int16_t* x_int16;  // (M, K), or null
  const float* x_scale;    // (M,), or null
  const void* weight;  // (N, K), contiguous, of `kind`
  WeightKind kind;
  const float* scale;  // (N,) per-row scale (int8), or null
  const float* bias;   // (N,), or null
  float* y;            // (M, N) float32
  int64_t M, N, K;
};

// y[:, n_begin:n_end] for every row of x: each weight row is read from memory once, in tiles from
// n_begin.
void linear_rows_generic(const LinearArgs& a, int64_t n_begin, int64_t n_end);
void linear_rows_avx2(const LinearArgs& a, int64_t n_begin, int64_t n_end);
void linear_rows_avx512(const LinearArgs& a, int64_t n_begin, int64_t n_end);

// For int8 weights, each row of x (M, K) as x_scale[m] * x_int16[m], its largest |x| at kXInt16Max: an
// error of at most 2^-16 of that row's largest |x| per element, ~100x below the int8 weight's own
// rounding, for integer multiply-adds in the kernel. A row with a NaN or an infinity gets a NaN scale
// (and zeros), so its outputs are NaN.
void linear_round_int16_generic(const float* x, int64_t M, int64_t K, int16_t* x_int16, float* x_scale);
void linear_round_int16_avx2(const float* x, int64_t M, int64_t K, int16_t* x_int16, float* x_scale);
void linear_round_int16_avx512(const float* x, int64_t M, int64_t K, int16_t* x_int16, float* x_scale);

}  // namespace ssmops_cpu
