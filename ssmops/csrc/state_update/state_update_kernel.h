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

// The 16 partial sums to one, lane l + w onto lane l for w = 8, 4, 2, 1: a fixed tree 4 adds deep
// whatever W is, in registers (through memory, the scalar loads of a vector just stored were ~40% of
// a row's time).
inline float fold(const vf* acc) {
  if constexpr (kVecs == 4) return vsum_of((acc[0] + acc[2]) + (acc[1] + acc[3]));
  if constexpr (kVecs == 2) return vsum_of(acc[0] + acc[1]);
  return vsum_of(acc[0]);
}

// Advances row r of `advance_rows` (n values at h + r * n) in place; its 16 partial sums of h * C
// into acc.
inline void advance_row(float* h, int64_t r, int64_t n, const float* A, const float* dt, const float* decay,
                        const float* dtx, const float* B, const float* C, vf (&acc)[kVecs]) {
  h += r * n;
  const float* Ar = A ? A + r * n : nullptr;
  const vf vdt = vf{} + (A ? dt[r] : 0.0f), vdecay = vf{} + (A ? 0.0f : decay[r]), vdtx = vf{} + dtx[r];
  for (int v = 0; v < kVecs; ++v) acc[v] = vf{};
  // 16 values of the row, lane l of vector v onto partial sum v * W + l
  auto step = [&](float* hk, const float* Ak, const float* Bk, const float* Ck) {
    for (int v = 0; v < kVecs; ++v) {
      const vf d = Ak ? vexp_of<vf, vi>(ld(Ak + v * W) * vdt) : vdecay;
      const vf hv = ld(hk + v * W) * d + vdtx * ld(Bk + v * W);
      st(hk + v * W, hv);
      acc[v] += hv * ld(Ck + v * W);
    }
  };
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) step(h + k, Ar ? Ar + k : nullptr, B + k, C + k);
  if (k < n) {  // the last n % 16 as one zero-padded step, so that they round and sum like the rest
    const int64_t tail = static_cast<int64_t>(sizeof(float)) * (n - k);
    float hb[kLanes] = {}, Ab[kLanes] = {}, Bb[kLanes] = {}, Cb[kLanes] = {};
    __builtin_memcpy(hb, h + k, tail);
    if (Ar) __builtin_memcpy(Ab, Ar + k, tail);
    __builtin_memcpy(Bb, B + k, tail);
    __builtin_memcpy(Cb, C + k, tail);
    step(hb, Ar ? Ab : nullptr, Bb, Cb);
    __builtin_memcpy(h + k, hb, tail);
  }
}

// out[i] = f(in[i]), W at a time (out may be in); the last n % W through a zero-padded vector
template <vf (*f)(vf)>
inline void map(const float* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + W <= n; i += W) st(out + i, f(ld(in + i)));
  if (i < n) {
    float part[W] = {};
    __builtin_memcpy(part, in + i, sizeof(float) * (n - i));
    st(part, f(ld(part)));
    __builtin_memcpy(out + i, part, sizeof(float) * (n - i));
  }
}
inline vf neg_exp_of(vf v) { return -vexp_of<vf, vi>(v); }
inline vf softplus_of(vf v) { return vsoftplus_of<vf, vi>(v); }
inline vf silu_of(vf v) { return v * vsigmoid_of<vf, vi>(v); }

}  // namespace

void SU_CAT(neg_exp_, SU_ISA)(const float* in, float* out, int64_t n) { map<neg_exp_of>(in, out, n); }
void SU_CAT(softplus_, SU_ISA)(const float* in, float* out, int64_t n) { map<softplus_of>(in, out, n); }
void SU_CAT(silu_, SU_ISA)(const float* in, float* out, int64_t n) { map<silu_of>(in, out, n); }

void SU_CAT(advance_rows_, SU_ISA)(float* h, int64_t rows, int64_t n, const float* A, const float* dt,
                                    const float* decay, const float* dtx, const float* B, const float* C, float* y) {
  int64_t r = 0;
#if SU_W == 16
  for (; r + kLanes <= rows; r += kLanes) {
    vf acc[kLanes][kVecs];
    for (int i = 0; i < kLanes; ++i) advance_row(h, r + i, n, A, dt, decay, dtx, B, C, acc[i]);
    vsums16_of(&acc[0][0], y + r);  // as fold() of each row, 16 rows' adds a vector
  }
#endif
  for (; r < rows; ++r) {
    vf acc[kVecs];
    advance_row(h, r, n, A, dt, decay, dtx, B, C, acc);
    y[r] = fold(acc);
  }
}

}  // namespace ssmops_cpu
