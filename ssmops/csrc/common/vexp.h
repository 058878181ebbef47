// exp for GCC float vectors of any width (Cody-Waite + degree-5 polynomial, cephes expf, ~1 ulp):
// the scan kernels' and the decoding step's. Internal linkage, so that each file compiles its
// own copy for its own instruction set and none reaches a caller built for another.
#pragma once

namespace ssmops_cpu {
namespace {

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

}  // namespace
}  // namespace ssmops_cpu
