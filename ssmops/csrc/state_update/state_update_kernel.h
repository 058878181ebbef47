// The decoding step's row kernel, written once with GCC vector extensions and compiled per
// instruction set by state_update_kernel_{generic,avx2,avx512}.cpp, which define SU_W (lanes per
// vector) and SU_ISA (the entry point's suffix). A token's step is ~25K (Mamba-1) to ~200K
// (Mamba-2) state values per layer, each read, decayed (Mamba-1: one exp each) and written once:
// at SSE width the exps were most of a Mamba-1 step's time.
//
// No STL and no libm, as in scan_kernel.h, so nothing built for AVX2 can be merged into a caller
// on another CPU.
#include <cstdint>

#include "../common/vmath.h"
#include "state_update_params.h"

#define SU_CAT2(a, b) a##b
#define SU_CAT(a, b) SU_CAT2(a, b)

namespace ssmops_cpu {
namespace {

constexpr int W = SU_W;
constexpr int kLanes = 16;  // partial sums of the dot product, whatever W is
constexpr int kVecs = kLanes / W;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf ld(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }

}  // namespace

float SU_CAT(advance_row_, SU_ISA)(float* h, int64_t n, const float* A, float dt, float decay, float dtx,
                                   const float* B, const float* C) {
  const vf vdt = vf{} + dt, vdecay = vf{} + decay, vdtx = vf{} + dtx;
  vf acc[kVecs] = {};
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    for (int v = 0; v < kVecs; ++v) {
      const int64_t i = k + v * W;
      const vf d = A ? vexp_of<vf, vi>(ld(A + i) * vdt) : vdecay;
      const vf hv = ld(h + i) * d + vdtx * ld(B + i);
      st(h + i, hv);
      acc[v] += hv * ld(C + i);
    }
  }
  float lanes[kLanes];
  __builtin_memcpy(lanes, acc, sizeof lanes);
  for (; k < n; ++k) {  // the last n % 16, through the vector exp so that they round like the rest
    const float d = A ? vexp_of<vf, vi>(vf{} + dt * A[k])[0] : decay;
    h[k] = h[k] * d + dtx * B[k];
    lanes[k % kLanes] += h[k] * C[k];
  }
  // a fixed tree (lane l + w onto lane l), 4 adds deep rather than 16 in a chain
  for (int w = kLanes / 2; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

}  // namespace ssmops_cpu
