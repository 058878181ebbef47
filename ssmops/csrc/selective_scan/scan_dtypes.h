// What the selective-scan kernels share: fp16 / bf16 <-> fp32 conversions, reading and writing
// a tensor element of any input dtype, and running a range on the torch thread pool. Included
// by every kernel file, each compiled for its own instruction set: everything here has internal
// linkage (an anonymous namespace) and uses no library inline code, so nothing compiled for
// AVX-512 can be merged into a caller on another CPU.
#pragma once

#include <cstdint>

#include "scan_params.h"

namespace ssmops_cpu {
namespace {

// --- fp16 / bf16 <-> fp32, bit-level (round to nearest even) -------------------------

inline uint32_t fbits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, 4);
  return u;
}
inline float bitsf(uint32_t u) {
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}

inline float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
  if (e == 0) {
    if (m == 0) return bitsf(sign);
    uint32_t exp = 113;  // subnormal: normalise the mantissa
    while (!(m & 0x400u)) {
      m <<= 1;
      --exp;
    }
    return bitsf(sign | (exp << 23) | ((m & 0x3ffu) << 13));
  }
  if (e == 31) return bitsf(sign | 0x7f800000u | (m << 13));
  return bitsf(sign | ((e + 112) << 23) | (m << 13));
}

inline uint16_t float_to_half(float f) {
  uint32_t x = fbits(f);
  uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u);
  if (ax >= 0x477ff000u) return sign | 0x7c00u;  // >= 65520 rounds to inf
  if (ax < 0x38800000u) {                        // below 2^-14: subnormal half or zero
    if (ax <= 0x33000000u) return sign;          // <= 2^-25 rounds to zero (tie to even)
    uint32_t e = ax >> 23, m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t s = 126 - e;  // 14..24
    uint32_t q = m >> s, rem = m & ((1u << s) - 1), half = 1u << (s - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return sign | (uint16_t)q;
  }
  uint32_t r = ax - (112u << 23);
  r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
  return sign | (uint16_t)r;
}

inline float bf16_to_float(uint16_t h) { return bitsf((uint32_t)h << 16); }
inline uint16_t float_to_bf16(float f) {
  uint32_t x = fbits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

template <int DT>
inline float get(const void* p, int64_t i) {
  if constexpr (DT == kFloat32) return static_cast<const float*>(p)[i];
  if constexpr (DT == kFloat16) return half_to_float(static_cast<const uint16_t*>(p)[i]);
  if constexpr (DT == kBFloat16) return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
}
template <int DT>
inline void put(void* p, int64_t i, float v) {
  if constexpr (DT == kFloat32) static_cast<float*>(p)[i] = v;
  if constexpr (DT == kFloat16) static_cast<uint16_t*>(p)[i] = float_to_half(v);
  if constexpr (DT == kBFloat16) static_cast<uint16_t*>(p)[i] = float_to_bf16(v);
}

#define SSM_DTYPE_SWITCH(dt, DT, ...)                    \
  switch (dt) {                                          \
    case kFloat16: {                                     \
      constexpr int DT = kFloat16;                       \
      __VA_ARGS__;                                       \
    } break;                                             \
    case kBFloat16: {                                    \
      constexpr int DT = kBFloat16;                      \
      __VA_ARGS__;                                       \
    } break;                                             \
    default: {                                           \
      constexpr int DT = kFloat32;                       \
      __VA_ARGS__;                                       \
    }                                                    \
  }

template <class F>
void par(const ScanArgs& a, int64_t n, const F& f) {
  a.parallel_for(
      n, [](void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); },
      const_cast<F*>(&f));
}

// dD[d] and ddelta_bias[d] from the backward's per-(batch, channel) partial sums (batch, dim),
// added in batch order so that the result does not depend on the threads.
inline void reduce_channel_sums(const ScanArgs& a, const float* dD_rows, const float* dbias_rows, int64_t d) {
  float sD = 0.0f, sb = 0.0f;
  for (int64_t b = 0; b < a.batch; ++b) {
    sD += dD_rows[b * a.dim + d];
    sb += dbias_rows[b * a.dim + d];
  }
  if (a.dD) a.dD[d] = sD;
  if (a.ddelta_bias) a.ddelta_bias[d] = sb;
}

}  // namespace
}  // namespace ssmops_cpu
