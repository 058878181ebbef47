// The weight-only linear kernel for a few rows of x (decoding: one token per sequence),
// written once with GCC vector extensions and compiled per instruction set by
// linear_kernel_{generic,avx2,avx512}.cpp, which define LIN_W (lanes per vector) and
// LIN_ISA (the entry point's suffix).
//
// Decoding reads every weight once per token and does 2 flops per weight per row of x, so
// the speed is the weights' read bandwidth: the kernel streams kRows weight rows at a time,
// widening bf16/f16/int8 to float32 in registers, and keeps those rows in L1 while it
// multiplies them with up to kXRows rows of x at once (more rows: another pass over the
// same cached weight rows). No STL and no libm, as in scan_kernel.h; x86 intrinsics only where
// the file's target allows them.


#include <cstdint>
#if defined(__x86_64__) && LIN_W > 4
#include <immintrin.h>
#endif

#include "linear_params.h"

#define LIN_CAT2(a, b) a##b
#define LIN_CAT(a, b) LIN_CAT2(a, b)

namespace ssmops_cpu {
namespace {

constexpr int W = LIN_W;
constexpr int kRows = 4;        // weight rows per tile: kRows * kXRows accumulators in registers,
constexpr int kXRows = LIN_XR;  // rows of x per pass over a tile (2 with 16 vector registers, 4 with 32)
// How far ahead to prefetch (at least one tile): measured here, 4 KiB gave int8 weights ~1.8x the
// single-thread speed of no prefetch, and longer distances gave nothing more.
constexpr int64_t kAheadBytes = 4096;
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));
typedef uint32_t vu32 __attribute__((vector_size(W * 4)));
typedef int8_t vi8 __attribute__((vector_size(W)));
typedef int32_t vi32 __attribute__((vector_size(W * 4)));
typedef _Float16 vh __attribute__((vector_size(W * 2)));

template <WeightKind kind>
struct WeightType {
  using type = float;
};
template <>
struct WeightType<WeightKind::kBFloat16> {
  using type = uint16_t;
};
template <>
struct WeightType<WeightKind::kFloat16> {
  using type = uint16_t;
};
template <>
struct WeightType<WeightKind::kInt8> {
  using type = int8_t;
};
template <WeightKind kind>
using WeightT = typename WeightType<kind>::type;

// A vector of weights widened to float32. On x86 with AVX2 / AVX-512 the widening is one
// instruction (GCC's generic vector conversions would go element by element).
template <WeightKind kind>
inline vf load_w(const void* w, int64_t i) {
  vf v;
  if constexpr (kind == WeightKind::kFloat32) {
    __builtin_memcpy(&v, static_cast<const float*>(w) + i, sizeof v);
#if defined(__x86_64__) && LIN_W == 8
  } else if constexpr (kind == WeightKind::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    v = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else if constexpr (kind == WeightKind::kFloat16) {
    v = (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
  } else {
    v = (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i))));
#elif defined(__x86_64__) && LIN_W == 16
  } else if constexpr (kind == WeightKind::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    v = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else if constexpr (kind == WeightKind::kFloat16) {
    v = (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i)));
  } else {
    v = (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + i))));
#else
  } else if constexpr (kind == WeightKind::kBFloat16) {  // bf16 is the high half of a float32
    vu16 h;
    __builtin_memcpy(&h, static_cast<const uint16_t*>(w) + i, sizeof h);
    v = (vf)(__builtin_convertvector(h, vu32) << 16);
  } else if constexpr (kind == WeightKind::kFloat16) {
    vh h;
    __builtin_memcpy(&h, static_cast<const _Float16*>(w) + i, sizeof h);
    v = __builtin_convertvector(h, vf);
  } else {
    vi8 q;
    __builtin_memcpy(&q, static_cast<const int8_t*>(w) + i, sizeof q);
    v = __builtin_convertvector(__builtin_convertvector(q, vi32), vf);
#endif
  }
  return v;
}

template <WeightKind kind>
inline float load_w1(const void* w, int64_t i) {
  if constexpr (kind == WeightKind::kFloat32) {
    return static_cast<const float*>(w)[i];
  } else if constexpr (kind == WeightKind::kBFloat16) {
    const uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(w)[i]) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
  } else if constexpr (kind == WeightKind::kFloat16) {
    return static_cast<float>(static_cast<const _Float16*>(w)[i]);
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[i]);
  }
}

// In lane order: a tree of lane shuffles measured slower here on int8 weights streamed from memory.
inline float hsum(vf v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// y[m0:m0+xr, n:n+kRows] (rows past n_end are computed from a repeated row and dropped).
template <WeightKind kind, int xr>
inline void tile(const LinearArgs& a, int64_t n, int64_t n_end, int64_t m0, int64_t rows_ahead) {
  const int64_t K = a.K, k_vec = K - K % W;
  int64_t row[kRows];
  for (int r = 0; r < kRows; ++r) row[r] = (n + r < n_end ? n + r : n_end - 1) * K;
  // The kRows rows are kRows * K contiguous weights, a stream too short for the hardware
  // prefetcher to catch (768 bytes a row in int8): prefetch kAheadBytes ahead (whole tiles), one
  // line per row per line read here, so that those rows are in cache when their tile starts.
  constexpr int64_t kLine = 64 / sizeof(WeightT<kind>);
  const char* ahead = static_cast<const char*>(a.weight) + (n + rows_ahead) * K * sizeof(WeightT<kind>);
  // Fewer rows of x leave registers free: U accumulators per (row of x, weight row) over
  // interleaved k-steps, so that kXRows * kRows FMA chains are in flight whatever xr is (with 4
  // chains, the FMA latency bounded int8 weights at ~8 Gweights/s on one thread).
  constexpr int U = kXRows / xr;
  vf acc[xr][kRows][U] = {};
  auto step = [&](int64_t k, int u) {
    if (k % kLine == 0)
      for (int r = 0; r < kRows; ++r) __builtin_prefetch(ahead + (r * K + k) * sizeof(WeightT<kind>));
    vf w[kRows];
    for (int r = 0; r < kRows; ++r) w[r] = load_w<kind>(a.weight, row[r] + k);
    for (int m = 0; m < xr; ++m) {
      vf xv;
      __builtin_memcpy(&xv, a.x + (m0 + m) * K + k, sizeof xv);
      for (int r = 0; r < kRows; ++r) acc[m][r][u] += xv * w[r];
    }
  };
  const int64_t k_unrolled = K - K % (W * U);
  int64_t k = 0;
  for (; k < k_unrolled; k += W * U)
    for (int u = 0; u < U; ++u) step(k + u * W, u);
  for (; k < k_vec; k += W) step(k, 0);
  for (int m = 0; m < xr; ++m)
    for (int r = 0; r < kRows; ++r)
      for (int u = 1; u < U; ++u) acc[m][r][0] += acc[m][r][u];
  for (int m = 0; m < xr; ++m) {
    const float* xm = a.x + (m0 + m) * K;
    for (int r = 0; r < kRows && n + r < n_end; ++r) {
      float s = hsum(acc[m][r][0]);
      for (int64_t k = k_vec; k < K; ++k) s += xm[k] * load_w1<kind>(a.weight, row[r] + k);
      if (a.scale) s *= a.scale[n + r];
      if (a.bias) s += a.bias[n + r];
      a.y[(m0 + m) * a.N + n + r] = s;
    }
  }
}

// The last `left` (< kXRows) rows of x: the tile for exactly that many.
template <WeightKind kind, int xr>
inline void last_rows(const LinearArgs& a, int64_t n, int64_t n_end, int64_t m, int64_t left, int64_t rows_ahead) {
  if constexpr (xr > 0) {
    if (left == xr)
      tile<kind, xr>(a, n, n_end, m, rows_ahead);
    else
      last_rows<kind, xr - 1>(a, n, n_end, m, left, rows_ahead);
  }
}

template <WeightKind kind>
void rows(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  // the prefetch distance in weight rows: whole tiles, at least one, at least kAheadBytes
  const int64_t tile_bytes = kRows * a.K * static_cast<int64_t>(sizeof(WeightT<kind>));
  const int64_t rows_ahead = kRows * (tile_bytes >= kAheadBytes ? 1 : (kAheadBytes + tile_bytes - 1) / tile_bytes);
  for (int64_t n = n_begin; n < n_end; n += kRows) {
    int64_t m = 0;
    for (; m + kXRows <= a.M; m += kXRows) tile<kind, kXRows>(a, n, n_end, m, rows_ahead);
    last_rows<kind, kXRows - 1>(a, n, n_end, m, a.M - m, rows_ahead);
  }
}

}  // namespace

void LIN_CAT(linear_rows_, LIN_ISA)(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  switch (a.kind) {
    case WeightKind::kFloat32:
      return rows<WeightKind::kFloat32>(a, n_begin, n_end);
    case WeightKind::kBFloat16:
      return rows<WeightKind::kBFloat16>(a, n_begin, n_end);
    case WeightKind::kFloat16:
      return rows<WeightKind::kFloat16>(a, n_begin, n_end);
    case WeightKind::kInt8:
      return rows<WeightKind::kInt8>(a, n_begin, n_end);
  }
}

}  // namespace ssmops_cpu
