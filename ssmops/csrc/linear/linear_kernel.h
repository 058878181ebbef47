// The weight-only linear kernel for a few rows of x (decoding: one token per sequence),
// written once with GCC vector extensions and compiled per instruction set by
// linear_kernel_{generic,avx2,avx512}.cpp, which define LIN_W (lanes per vector), LIN_REGS (vector
// registers) and LIN_ISA (the entry point's suffix).
//
// Decoding reads every weight once per token and does 2 flops per weight per row of x, so
// the speed is the weights' read bandwidth: the kernel streams a tile of weight rows at a time,
// widening bf16/f16 to float32 (int8 to int16) in registers, and keeps those rows in L1 while it
// multiplies them with up to kXRows rows of x at once (more rows: another pass over the
// same cached weight rows). No STL and no libm, as in scan_kernel.h; x86 intrinsics only where
// the file's target allows them.


#include <cstdint>
#if defined(__x86_64__) && LIN_W > 4
#include <immintrin.h>
#endif

#include "../common/vmath.h"
#include "linear_params.h"

#define LIN_CAT2(a, b) a##b
#define LIN_CAT(a, b) LIN_CAT2(a, b)

namespace ssmops_cpu {
namespace {

constexpr int W = LIN_W;
constexpr bool kFewRegisters = LIN_REGS == 16;  // 16 vector registers (SSE, AVX2), else 32 (AVX-512)
// Independent accumulation chains a tile keeps in flight: with fewer, the FMA latency bounds the
// speed (4 chains held int8 weights to ~8 Gweights/s on one thread).
constexpr int kChains = kFewRegisters ? 8 : 16;
// Rows of x per pass over a tile, and weight rows per tile (a divisor of kTaskRows): xr * R
// accumulators and R weight vectors in registers. Measured here (weights streamed from memory,
// against a plain sum over the same bytes in the same run): with one row of x, float32 weights
// stream at ~0.95 of the sum's rate 8 rows a tile against ~0.85 with 4, and int8 weights at ~0.77
// one row a tile against ~0.58 with 4. With 8 rows of x and 16 registers, float weights do ~1.25x
// the multiply-adds per second 4 rows of x by 3 weight rows as 2 by 4; int8 weights, 2 by 4. With
// 32 registers, float32 weights and one row of x, 12 rows a tile made mamba-130m's compiled fp32
// token ~3% faster than 8 at ~55-60 GB/s (both alternating in one process; bf16: no gain).
template <WeightKind kind>
constexpr int kXRows = kFewRegisters && kind == WeightKind::kInt8 ? 2 : 4;
template <WeightKind kind>
constexpr int kOneRowTileRows = kind == WeightKind::kInt8 ? 1 : kind == WeightKind::kFloat32 && !kFewRegisters ? 12 : 8;
template <WeightKind kind, int xr>
constexpr int kTileRows = xr == 1 ? kOneRowTileRows<kind> : kXRows<kind> == 4 && kFewRegisters ? 3 : 4;
// How far ahead to prefetch (at least one tile), and into L2 rather than L1 (prefetcht1): on a
// Zen 3, 4 KiB ahead gave int8 weights ~1.8x the single-thread speed of no prefetch; on a Zen 4, one
// thread streaming weights from memory, prefetching into L2 16 KiB ahead instead of into L1 4 KiB
// ahead took fp32 in_proj (3072 x 768) from ~520 to ~390 us, bf16 from ~375 to ~190, int8 from ~96 to
// ~90 (AVX-512 and AVX2 builds alike): L1's few fill buffers held the stream back.
// Not for float32 weights with one row of x in the AVX2 build: on a Zen 3 (2 threads, ~20-30 GB/s)
// its tiles of 8 rows (24 KiB at mamba-130m's in_proj) stream faster on the hardware prefetcher
// alone. A compiled mamba-130m fp32 token, both alternating in one process: ~2-13% faster without
// (medians of the rounds' ratios 1.015-1.127 in five runs, faster in 7-15 of 12-16 rounds; a
// mamba2-130m one ~1%), where int8 and bf16 tokens were ~12% and ~25% slower without, and a
// batch-8 fp32 token ~20% slower.
constexpr int64_t kAheadBytes = 16384;
constexpr int kPrefetchLocality = 2;  // __builtin_prefetch's: 2 is prefetcht1 on x86
template <WeightKind kind>
constexpr bool kOneRowPrefetch = !(kind == WeightKind::kFloat32 && W == 8);  // W == 8: the AVX2 build
typedef float vf __attribute__((vector_size(W * 4)));
typedef uint16_t vu16 __attribute__((vector_size(W * 2)));
typedef uint32_t vu32 __attribute__((vector_size(W * 4)));
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

// A vector of float32 / bf16 / f16 weights widened to float32 (int8: load_w_int16 below). On x86
// with AVX2 / AVX-512 the widening is one instruction (GCC's generic vector conversions would go
// element by element).
template <WeightKind kind>
inline vf load_w(const void* w, int64_t i) {
  vf v;
  if constexpr (kind == WeightKind::kFloat32) {
    __builtin_memcpy(&v, static_cast<const float*>(w) + i, sizeof v);
#if defined(__x86_64__) && LIN_W == 8
  } else if constexpr (kind == WeightKind::kBFloat16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i));
    v = (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    v = (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + i)));
#elif defined(__x86_64__) && LIN_W == 16
  } else if constexpr (kind == WeightKind::kBFloat16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i));
    v = (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    v = (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + i)));
#else
  } else if constexpr (kind == WeightKind::kBFloat16) {  // bf16 is the high half of a float32
    vu16 h;
    __builtin_memcpy(&h, static_cast<const uint16_t*>(w) + i, sizeof h);
    v = (vf)(__builtin_convertvector(h, vu32) << 16);
  } else {
    vh h;
    __builtin_memcpy(&h, static_cast<const _Float16*>(w) + i, sizeof h);
    v = __builtin_convertvector(h, vf);
#endif
  }
  return v;
}

// int8 weights meet x rounded to int16 (linear.cpp): a step is 2W weights widened to int16 and
// multiplied pairwise with 2W x's into W int32 lanes (one vpmaddwd), ~2x the float path's weights
// per instruction. |x_int16| <= 32767 and |w| <= 128, so a lane's 2 products a step, kIntBlock / W
// a block, stay below 2^31; each block's sum is then added in float32.
typedef int16_t vi16x2 __attribute__((vector_size(W * 4)));
typedef int8_t vi8x2 __attribute__((vector_size(W * 2)));
constexpr int64_t kIntBlock = 1024;

inline vi16x2 load_w_int16(const int8_t* w) {
#if defined(__x86_64__) && LIN_W == 8
  return (vi16x2)_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
#elif defined(__x86_64__) && LIN_W == 16
  return (vi16x2)_mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
#else
  vi8x2 q;
  __builtin_memcpy(&q, w, sizeof q);
  return __builtin_convertvector(q, vi16x2);
#endif
}

// lane l: w[2l] * x[2l] + w[2l+1] * x[2l+1], exact in int32
inline vi32 madd(vi16x2 w, vi16x2 x) {
#if defined(__x86_64__) && LIN_W == 8
  return (vi32)_mm256_madd_epi16((__m256i)w, (__m256i)x);
#elif defined(__x86_64__) && LIN_W == 16
  return (vi32)_mm512_madd_epi16((__m512i)w, (__m512i)x);
#else
  static_assert(W == 4, "the portable build has 4 lanes");
  const vi32 we = __builtin_convertvector(__builtin_shufflevector(w, w, 0, 2, 4, 6), vi32);
  const vi32 wo = __builtin_convertvector(__builtin_shufflevector(w, w, 1, 3, 5, 7), vi32);
  const vi32 xe = __builtin_convertvector(__builtin_shufflevector(x, x, 0, 2, 4, 6), vi32);
  const vi32 xo = __builtin_convertvector(__builtin_shufflevector(x, x, 1, 3, 5, 7), vi32);
  return we * xe + wo * xo;
#endif
}

// How a tile multiplies: float32 x against weights widened to float32, W weights a step, FMA into
// float32 lanes, the whole row one block ...
template <WeightKind kind>
struct Arith {
  using Acc = vf;
  using Wide = vf;
  using X = float;
  static constexpr int64_t kStep = W;
  static const X* x(const LinearArgs& a) { return a.x; }
  static int64_t block(int64_t K) { return K; }
  static Wide weights(const void* w, int64_t i) { return load_w<kind>(w, i); }
  static Wide xs(const X* x) {
    vf v;
    __builtin_memcpy(&v, x, sizeof v);
    return v;
  }
  static Acc mul(Wide w, Wide x) { return w * x; }
  static Acc mul_add(Acc acc, Wide w, Wide x) { return acc + w * x; }
  static vf to_float(Acc acc) { return acc; }
};

// ... and int8 weights against int16 x, 2W weights a step, kIntBlock weights a block.
template <>
struct Arith<WeightKind::kInt8> {
  using Acc = vi32;
  using Wide = vi16x2;
  using X = int16_t;
  static constexpr int64_t kStep = 2 * W;
  static const X* x(const LinearArgs& a) { return a.x_int16; }
  static int64_t block(int64_t) { return kIntBlock; }
  static Wide weights(const void* w, int64_t i) { return load_w_int16(static_cast<const int8_t*>(w) + i); }
  static Wide xs(const X* x) {
    Wide v;
    __builtin_memcpy(&v, x, sizeof v);
    return v;
  }
  static Acc mul(Wide w, Wide x) { return madd(w, x); }
  // AVX512-VNNI does both in one instruction (vpdpwssd): ~1.2x the multiply-adds a second with 8 rows
  // of x on a Zen 4, where the weights are in cache
  static Acc mul_add(Acc acc, Wide w, Wide x) {
#if defined(__x86_64__) && LIN_W == 16
    return (vi32)_mm512_dpwssd_epi32((__m512i)acc, (__m512i)w, (__m512i)x);
#else
    return acc + madd(w, x);
#endif
  }
  // each lane (< 2^31) rounded to float32 (a relative 2^-24, far below x's rounding to int16)
  static vf to_float(Acc acc) { return __builtin_convertvector(acc, vf); }
};

// The last step of a row whose length is not a multiple of kStep: its n weights (and x's) in a
// zero-padded vector, so that the row ends with one more vector step rather than n scalar ones.
// `bytes` < sizeof(part): with AVX-512 one masked load (a copy of a variable length was a call to
// memcpy a weight row, which kept dt_proj's 48-weight int8 rows at a third of AVX2's speed).
template <class T, int n>
inline void load_part(T (&part)[n], const T* src, int64_t bytes) {
#if defined(__x86_64__) && LIN_W == 16
  static_assert(sizeof(part) == 64 || sizeof(part) == 32, "a part is one AVX-512 or AVX2 register");
  if constexpr (sizeof(part) == 64)
    _mm512_storeu_si512(part, _mm512_maskz_loadu_epi8(_cvtu64_mask64((1ull << bytes) - 1), src));
  else
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(part),
                        _mm256_maskz_loadu_epi8(static_cast<__mmask32>((1u << bytes) - 1), src));
#else
  for (int i = 0; i < n; ++i) part[i] = T();
  __builtin_memcpy(part, src, bytes);
#endif
}
template <WeightKind kind>
inline typename Arith<kind>::Wide weights_part(const void* w, int64_t i, int64_t n) {
  WeightT<kind> part[Arith<kind>::kStep];
  load_part(part, static_cast<const WeightT<kind>*>(w) + i, n * sizeof(WeightT<kind>));
  return Arith<kind>::weights(part, 0);
}
template <WeightKind kind>
inline typename Arith<kind>::Wide xs_part(const typename Arith<kind>::X* x, int64_t n) {
  typename Arith<kind>::X part[Arith<kind>::kStep];
  load_part(part, x, n * sizeof(part[0]));
  return Arith<kind>::xs(part);
}

// y[m0:m0+xr, n:n+R] (rows past n_end are computed from a repeated row and dropped).
template <WeightKind kind, int xr, int R>
inline void tile(const LinearArgs& a, int64_t n, int64_t n_end, int64_t m0, int64_t rows_ahead) {
  using A = Arith<kind>;
  const typename A::X* x = A::x(a);
  const int64_t K = a.K;
  int64_t row[R];
  for (int r = 0; r < R; ++r) row[r] = (n + r < n_end ? n + r : n_end - 1) * K;
  // The R rows are R * K contiguous weights, a stream too short for the hardware
  // prefetcher to catch (768 bytes a row in int8): prefetch kAheadBytes ahead (whole tiles), R
  // lines per line of a row read here, so that those rows are in cache when their tile starts. The
  // lines go in memory order, not row by row as the tile reads them: one stream rather than R, 3 KB
  // apart in fp32 (mamba-130m's compiled fp32 token, both orders alternating in one process, at ~35
  // and at ~60 GB/s: ~2-8% faster, ~5% in the median of ABBA rounds; bf16 within the noise; int8 with
  // one row of x has one row a tile, the same addresses either way).
  constexpr int64_t kLine = 64 / sizeof(WeightT<kind>);
  const char* ahead = static_cast<const char*>(a.weight) + (n + rows_ahead) * K * sizeof(WeightT<kind>);
  // U accumulators per (row of x, weight row) over interleaved k-steps: kChains in all
  constexpr int U = kChains / (xr * R) > 1 ? kChains / (xr * R) : 1;
  float sum[xr][R] = {};
  const int64_t k_vec = K - K % A::kStep;
  for (int64_t k0 = 0; k0 < k_vec; k0 += A::block(K)) {
    const int64_t k1 = k_vec - k0 < A::block(K) ? k_vec : k0 + A::block(K);
    typename A::Acc acc[xr][R][U] = {};
    auto step = [&](int64_t k, int u) {
      if (rows_ahead > 0 && k % kLine == 0)
        for (int r = 0; r < R; ++r) __builtin_prefetch(ahead + (k / kLine * R + r) * 64, 0, kPrefetchLocality);
      typename A::Wide w[R];
      for (int r = 0; r < R; ++r) w[r] = A::weights(a.weight, row[r] + k);
      for (int m = 0; m < xr; ++m) {
        const typename A::Wide xv = A::xs(x + (m0 + m) * K + k);
        for (int r = 0; r < R; ++r) acc[m][r][u] = A::mul_add(acc[m][r][u], w[r], xv);
      }
    };
    const int64_t k_unrolled = k1 - (k1 - k0) % (A::kStep * U);
    int64_t k = k0;
    // Unrolled so that acc[..][u] stay in registers: as a loop (GCC did not unroll it once the step
    // held the prefetch) each step loaded and stored its accumulator, ~2x slower (docs/limits.md).
    for (; k < k_unrolled; k += A::kStep * U)
#pragma GCC unroll 16
      for (int u = 0; u < U; ++u) step(k + u * A::kStep, u);
    for (; k < k1; k += A::kStep) step(k, 0);
    for (int m = 0; m < xr; ++m)
      for (int r = 0; r < R; ++r)
        for (int u = 1; u < U; ++u) acc[m][r][0] += acc[m][r][u];
    if constexpr (W == 16 && xr * R == 16 && U == 1) {
      // 16 outputs a tile (several rows of x): their lane sums 16 at once, the same adds (bitwise).
      // 8 rows of x, 2 threads, weights in cache, old and new alternating: in_proj's 3072 x 768 int8
      // ~125 -> ~117 us, fp32 ~234 -> ~225; out_proj's 768 x 1536 int8 ~58 -> ~54
      vf wide[16];
      for (int m = 0; m < xr; ++m)
        for (int r = 0; r < R; ++r) wide[m * R + r] = A::to_float(acc[m][r][0]);
      float sums[16];
      vsums16_of(wide, sums);
      for (int m = 0; m < xr; ++m)
        for (int r = 0; r < R; ++r) sum[m][r] += sums[m * R + r];
    } else {
      for (int m = 0; m < xr; ++m)
        for (int r = 0; r < R; ++r) sum[m][r] += vsum_of(A::to_float(acc[m][r][0]));
    }
  }
  if (k_vec < K) {
    typename A::Wide w[R];
    for (int r = 0; r < R; ++r) w[r] = weights_part<kind>(a.weight, row[r] + k_vec, K - k_vec);
    for (int m = 0; m < xr; ++m) {
      const typename A::Wide xv = xs_part<kind>(x + (m0 + m) * K + k_vec, K - k_vec);
      for (int r = 0; r < R; ++r) sum[m][r] += vsum_of(A::to_float(A::mul(w[r], xv)));
    }
  }
  for (int m = 0; m < xr; ++m)
    for (int r = 0; r < R && n + r < n_end; ++r) {
      float s = sum[m][r];
      if constexpr (kind == WeightKind::kInt8) s *= a.x_scale[m0 + m] * a.scale[n + r];
      if (a.bias) s += a.bias[n + r];
      a.y[(m0 + m) * a.N + n + r] = s;
    }
}

// The last `left` (< kXRows) rows of x: the tile for exactly that many.
template <WeightKind kind, int xr, int R>
inline void last_rows(const LinearArgs& a, int64_t n, int64_t n_end, int64_t m, int64_t left, int64_t rows_ahead) {
  if constexpr (xr > 0) {
    if (left == xr)
      tile<kind, xr, R>(a, n, n_end, m, rows_ahead);
    else
      last_rows<kind, xr - 1, R>(a, n, n_end, m, left, rows_ahead);
  }
}

// Weight rows [n_begin, n_end) against every row of x, R weight rows a tile, prefetched or not.
template <WeightKind kind, int R>
void sweep(const LinearArgs& a, int64_t n_begin, int64_t n_end, bool prefetch = true) {
  // the prefetch distance in weight rows: whole tiles, at least one, at least kAheadBytes (0: none)
  const int64_t tile_bytes = R * a.K * static_cast<int64_t>(sizeof(WeightT<kind>));
  const int64_t rows_ahead =
      prefetch ? R * (tile_bytes >= kAheadBytes ? 1 : (kAheadBytes + tile_bytes - 1) / tile_bytes) : 0;
  for (int64_t n = n_begin; n < n_end; n += R) {
    int64_t m = 0;
    for (; m + kXRows<kind> <= a.M; m += kXRows<kind>) tile<kind, kXRows<kind>, R>(a, n, n_end, m, rows_ahead);
    last_rows<kind, kXRows<kind> - 1, R>(a, n, n_end, m, a.M - m, rows_ahead);
  }
}

template <WeightKind kind>
void rows(const LinearArgs& a, int64_t n_begin, int64_t n_end) {
  // Rows of fewer steps than a tile's accumulators (dt_proj's 48 weights) fill them only 8 rows a
  // tile: with one row a tile, folding 16 accumulators cost more than the row's multiply-adds.
  if (a.M == 1 && a.K < kChains * Arith<kind>::kStep) return sweep<kind, 8>(a, n_begin, n_end);
  if (a.M == 1) return sweep<kind, kTileRows<kind, 1>>(a, n_begin, n_end, kOneRowPrefetch<kind>);
  sweep<kind, kTileRows<kind, 2>>(a, n_begin, n_end);
}

// x * to_int rounded half away from zero, as int16 (|x * to_int| <= kXInt16Max + rounding)
template <class V, class F>
inline auto round_half_away(V v, F to_int) {
  return v >= 0.0f ? v * to_int + 0.5f : v * to_int - 0.5f;
}

}  // namespace

void LIN_CAT(linear_round_int16_, LIN_ISA)(const float* x, int64_t M, int64_t K, int16_t* x_int16, float* x_scale) {
  typedef int16_t vi16 __attribute__((vector_size(W * 2)));
  constexpr uint32_t kAbs = 0x7fffffffu, kInf = 0x7f800000u;  // float32 bits: |x|, and >= kInf is inf or NaN
  const int64_t k_vec = K - K % W;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    int16_t* qm = x_int16 + m * K;
    vu32 largest_bits = {}, bad = {};  // |x|'s bits order like |x| for finite floats
    for (int64_t k = 0; k < k_vec; k += W) {
      vu32 bits;
      __builtin_memcpy(&bits, xm + k, sizeof bits);
      bits &= kAbs;
      bad |= bits >= kInf;
      largest_bits = bits > largest_bits ? bits : largest_bits;
    }
    uint32_t largest_u = 0;
    bool finite = true;
    for (int l = 0; l < W; ++l) {
      largest_u = largest_bits[l] > largest_u ? largest_bits[l] : largest_u;
      finite = finite && bad[l] == 0;
    }
    for (int64_t k = k_vec; k < K; ++k) {
      uint32_t bits;
      __builtin_memcpy(&bits, xm + k, sizeof bits);
      bits &= kAbs;
      finite = finite && bits < kInf;
      largest_u = bits > largest_u ? bits : largest_u;
    }
    float largest;
    __builtin_memcpy(&largest, &largest_u, sizeof largest);
    if (!finite || largest == 0.0f) {
      for (int64_t k = 0; k < K; ++k) qm[k] = 0;
      x_scale[m] = finite ? 0.0f : __builtin_nanf("");
      continue;
    }
    const float to_int = kXInt16Max / largest;
    for (int64_t k = 0; k < k_vec; k += W) {
      vf v;
      __builtin_memcpy(&v, xm + k, sizeof v);
      const vi16 q = __builtin_convertvector(__builtin_convertvector(round_half_away(v, to_int), vi32), vi16);
      __builtin_memcpy(qm + k, &q, sizeof q);
    }
    for (int64_t k = k_vec; k < K; ++k) qm[k] = static_cast<int16_t>(round_half_away(xm[k], to_int));
    x_scale[m] = largest / kXInt16Max;
  }
}

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
