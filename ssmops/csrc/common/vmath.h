// exp, softplus, sigmoid and the lanes' sum for GCC float vectors of any width (`vf`, with `vi` its
// int32 vector): the scan kernels', the decoding step's and the GEMV's. Internal linkage, so that
// each file compiles its own copy for its own instruction set and none reaches a caller built for
// another.
#pragma once

namespace ssmops_cpu {
namespace {

// exp: Cody-Waite + degree-5 polynomial (cephes expf, ~1 ulp).
template <class vf, class vi>
inline vf vexp_of(vf x) {
  const vf hi = (vf{} + 88.3762626647949f), lo = (vf{} + -87.3365447504019f);
  const vf magic = (vf{} + 12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  vf fx = xc * (vf{} + 1.44269504088896341f) + magic;
  vi n = (vi)fx - (vi)magic;
  fx = fx - magic;
  vf r = xc - fx * (vf{} + 0.693359375f);
  r = r - fx * (vf{} + -2.12194440e-4f);
  vf p = (vf{} + 1.9875691500E-4f);
  p = p * r + (vf{} + 1.3981999507E-3f);
  p = p * r + (vf{} + 8.3334519073E-3f);
  p = p * r + (vf{} + 4.1665795894E-2f);
  p = p * r + (vf{} + 1.6666665459E-1f);
  p = p * r + (vf{} + 5.0000001201E-1f);
  p = p * (r * r) + r + (vf{} + 1.0f);
  vf scale = (vf)((n + 127) << 23);
  vf res = p * scale;
  res = x < lo ? (vf{} + 0.0f) : res;
  res = x > hi ? (vf{} + __builtin_inff()) : res;
  return res;
}

// log for finite w >= 1 (cephes logf, ~1 ulp): only ever called on 1 + exp(x).
template <class vf, class vi>
inline vf vlog_ge1_of(vf w) {
  vi bits = (vi)w;
  vi e = (bits >> 23) - 126;
  vf m = (vf)((bits & 0x007fffff) | 0x3f000000);  // w = m * 2^e, m in [0.5, 1)
  vi small = m < (vf{} + 0.707106781186547524f);
  e = small ? e - 1 : e;
  m = small ? m + m - (vf{} + 1.0f) : m - (vf{} + 1.0f);
  vf z = m * m;
  vf y = (vf{} + 7.0376836292E-2f);
  y = y * m + (vf{} + -1.1514610310E-1f);
  y = y * m + (vf{} + 1.1676998740E-1f);
  y = y * m + (vf{} + -1.2420140846E-1f);
  y = y * m + (vf{} + 1.4249322787E-1f);
  y = y * m + (vf{} + -1.6668057665E-1f);
  y = y * m + (vf{} + 2.0000714765E-1f);
  y = y * m + (vf{} + -2.4999993993E-1f);
  y = y * m + (vf{} + 3.3333331174E-1f);
  y = y * m * z;
  vf fe = __builtin_convertvector(e, vf);
  y = y + fe * (vf{} + -2.12194440e-4f);
  y = y - (vf{} + 0.5f) * z;
  return m + y + fe * (vf{} + 0.693359375f);
}

// softplus as torch computes it (beta 1, threshold 20): x > 20 ? x : log1p(exp(x)), and NaN for NaN.
template <class vf, class vi>
inline vf vsoftplus_of(vf x) {
  const vf one = vf{} + 1.0f, twenty = vf{} + 20.0f;
  vf e = vexp_of<vf, vi>(x < twenty ? x : twenty);
  vf w = one + e;
  // log1p(e) = log(w) * e / (w - 1) recovers the bits of e lost in 1 + e
  vf den = w - one;
  vf l1p = vlog_ge1_of<vf, vi>(w) * e / (den == vf{} ? one : den);
  l1p = den == vf{} ? e : l1p;
  return x <= twenty ? l1p : x;  // (a NaN fails the test: it stays NaN, where l1p would be softplus(20))
}

// The lanes' sum as a halving tree, the upper half onto the lower until one lane is left: a fixed
// order per width, a few instructions where adding the lanes in turn is a chain of W dependent adds.
template <class vf>
inline float vsum_of(vf v) {
  if constexpr (sizeof(vf) == 64) {
    return vsum_of(__builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                   __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15));
  } else if constexpr (sizeof(vf) == 32) {
    return vsum_of(__builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7));
  } else {
    static_assert(sizeof(vf) == 16, "4, 8 or 16 float lanes");
    v += __builtin_shufflevector(v, v, 2, 3, 0, 1);
    return v[0] + v[1];
  }
}

// vsum_of of each of 16 vectors of 16 lanes, out[i] the sum of v[i]: every level of the tree adds the
// halves of two vectors in one, so the sums come out of the same adds in the same order (bitwise),
// ~1 add and 2 shuffles a vector where one alone took 4 of each and an extract. A Mamba-1 layer's
// state update (mamba-130m's shape, batch 8): ~131-137 -> ~118-123 us.
template <class vf>
inline void vsums16_of(const vf* v, float* out) {
  static_assert(sizeof(vf) == 64, "16 float lanes");
  vf t8[8], t4[4], t2[2];
  for (int i = 0; i < 8; ++i)  // vectors 2i and 2i + 1: lanes l + 8 onto l
    t8[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
            __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30,
                                    31);
  for (int i = 0; i < 4; ++i)  // vectors 4i .. 4i + 3, 8 lanes each: l + 4 onto l
    t4[i] = __builtin_shufflevector(t8[2 * i], t8[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                    27) +
            __builtin_shufflevector(t8[2 * i], t8[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                    31);
  for (int i = 0; i < 2; ++i)  // vectors 8i .. 8i + 7, 4 lanes each: l + 2 onto l
    t2[i] = __builtin_shufflevector(t4[2 * i], t4[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28,
                                    29) +
            __builtin_shufflevector(t4[2 * i], t4[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30,
                                    31);
  // vectors 0 .. 15, 2 lanes each: lane 1 onto lane 0
  const vf sums = __builtin_shufflevector(t2[0], t2[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
                  __builtin_shufflevector(t2[0], t2[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
  __builtin_memcpy(out, &sums, sizeof sums);
}

template <class vf, class vi>
inline vf vsigmoid_of(vf x) {
  return (vf{} + 1.0f) / ((vf{} + 1.0f) + vexp_of<vf, vi>(-x));
}

}  // namespace
}  // namespace ssmops_cpu
