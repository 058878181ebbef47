// The selective-scan kernels, written once with GCC vector extensions and compiled
// once per instruction set by scan_kernel_{generic,avx2,avx512}.cpp, which define
//   SSM_W    lanes per vector (channels processed together),
//   SSM_NT   states kept in registers per pass over a block of timesteps,
//   SSM_ISA  the suffix of the two entry points (scan_fwd_<isa>, scan_bwd_<isa>).
//
// Layout of the work: a vector holds SSM_W consecutive channels of one (batch, group),
// so a variable B_t / C_t is one scalar broadcast to every lane and no horizontal sum
// is needed for y. The state (dstate vectors) is walked in tiles of SSM_NT that stay
// in registers across a block of timesteps; the block's u, dt, y live in small
// (T, W) scratch arrays transposed from/to the (batch, dim, seqlen) tensors.
//
// Everything here has internal linkage and uses no library inline code (no STL, no
// libm), so nothing compiled for AVX-512 can be merged into a caller on another CPU.
#include <cstdint>
#include <cstdlib>

#include "../common/vmath.h"
#include "scan_dtypes.h"
#include "scan_params.h"

#define SSM_CAT2(a, b) a##b
#define SSM_CAT(a, b) SSM_CAT2(a, b)

namespace ssmops_cpu {
namespace {

constexpr int W = SSM_W;
constexpr int NT = SSM_NT;
constexpr int kBlock = 64;  // timesteps per block; divides kChunkLen
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

inline vf bc(float s) { return vf{} + s; }
inline vf ld(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline void st(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// --- vector math ---------------------------------------------------------------

inline vf vexp(vf x) { return vexp_of<vf, vi>(x); }

inline vf vsoftplus(vf x) { return vsoftplus_of<vf, vi>(x); }
inline vf vsigmoid(vf x) { return vsigmoid_of<vf, vi>(x); }

// Lane sums of K vectors at once, stored to dst[0..K): pairs of vectors are folded
// into one (each half holding the pairwise sums of one of them) until one vector is
// left, then that vector is folded onto itself; ~3 shuffles+adds per sum instead of ~8.
template <int... I>
struct LaneSeq {};
template <int N>
using make_lanes = LaneSeq<__integer_pack(N)...>;

template <int... I>
inline vf fold_pair(vf a, vf b, LaneSeq<I...>) {
  constexpr int H = W / 2;
  return __builtin_shufflevector(a, b, (I < H ? 2 * I : 2 * (I - H) + W)...) +
         __builtin_shufflevector(a, b, (I < H ? 2 * I + 1 : 2 * (I - H) + W + 1)...);
}

template <int K>
inline void lane_sums(float* dst, const vf* p) {
  constexpr int P = K <= 1 ? 1 : K <= 2 ? 2 : K <= 4 ? 4 : K <= 8 ? 8 : 16;
  static_assert(P <= W, "tile wider than a vector");
  vf v[P];
  for (int k = 0; k < P; ++k) v[k] = k < K ? p[k] : vf{};
  for (int n = P; n > 1; n /= 2)
    for (int k = 0; k < n / 2; ++k) v[k] = fold_pair(v[2 * k], v[2 * k + 1], make_lanes<W>{});
  for (int g = W / P; g > 1; g /= 2) v[0] = fold_pair(v[0], v[0], make_lanes<W>{});
  float out[W];
  st(out, v[0]);
  for (int k = 0; k < K; ++k) dst[k] = out[k];
}

// --- moving data between tensors and (T, W) / (T, dstate) scratch --------------------

// dst[t * W + l] = src[row[l] + t] for the nl live lanes, zeros in the others.
inline void gather_rows(float* dst, const void* src, int dt, const int64_t* row, int nl, int T) {
  SSM_DTYPE_SWITCH(dt, DT, {
    for (int l = 0; l < nl; ++l)
      for (int t = 0; t < T; ++t) dst[t * W + l] = get<DT>(src, row[l] + t);
  });
  for (int l = nl; l < W; ++l)
    for (int t = 0; t < T; ++t) dst[t * W + l] = 0.0f;
}

inline void scatter_rows(void* dst, int dt, const float* src, const int64_t* row, int nl, int T) {
  SSM_DTYPE_SWITCH(dt, DT, {
    for (int l = 0; l < nl; ++l)
      for (int t = 0; t < T; ++t) put<DT>(dst, row[l] + t, src[t * W + l]);
  });
}

// dst[t * NS + n] = M[base + n * seqlen + t]: a variable B/C block, time-major.
inline void transpose_bc(float* dst, const void* M, int dt, int64_t base, int64_t seqlen, int NS, int T) {
  SSM_DTYPE_SWITCH(dt, DT, {
    for (int n = 0; n < NS; ++n)
      for (int t = 0; t < T; ++t) dst[t * NS + n] = get<DT>(M, base + n * seqlen + t);
  });
}

// --- the recurrence over one block, one tile of K states at a time -------------------

struct FwdTile {
  int T, NS;
  float* h;           // (NS, W) state, updated in place
  const float* Av;    // (NS, W)
  const float* Bsrc;  // (T, NS) when variable, else (NS, W)
  const float* Csrc;
  const float *dt, *dtu;  // (T, W)
  float* y;               // (T, W), accumulated
  float *H, *E;           // REC: H[(t + 1) * NS * W] = h_t, E[t * NS * W] = exp(dt_t A)
};

template <int K, bool VB, bool VC, bool WY, bool REC>
void fwd_tile(const FwdTile& c, int n0) {
  const int NS = c.NS;
  vf hv[K], av[K];
  for (int k = 0; k < K; ++k) {
    hv[k] = ld(c.h + (n0 + k) * W);
    av[k] = ld(c.Av + (n0 + k) * W);
  }
  for (int t = 0; t < c.T; ++t) {
    const vf d = ld(c.dt + t * W), du = ld(c.dtu + t * W);
    vf yv = WY ? ld(c.y + t * W) : vf{};
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) {
      const int n = n0 + k;
      const vf e = vexp(d * av[k]);
      const vf bk = VB ? bc(c.Bsrc[t * NS + n]) : ld(c.Bsrc + n * W);
      hv[k] = e * hv[k] + du * bk;
      if (WY) {
        const vf ck = VC ? bc(c.Csrc[t * NS + n]) : ld(c.Csrc + n * W);
        yv += hv[k] * ck;
      }
      if (REC) {
        st(c.H + ((int64_t)(t + 1) * NS + n) * W, hv[k]);
        st(c.E + ((int64_t)t * NS + n) * W, e);
      }
    }
    if (WY) st(c.y + t * W, yv);
  }
  for (int k = 0; k < K; ++k) st(c.h + (n0 + k) * W, hv[k]);
}

template <int K, bool VB, bool VC, bool WY, bool REC>
void fwd_tail(const FwdTile& c, int n0, int r) {
  if constexpr (K >= 1) {
    if (r == K)
      fwd_tile<K, VB, VC, WY, REC>(c, n0);
    else
      fwd_tail<K - 1, VB, VC, WY, REC>(c, n0, r);
  }
}

template <bool VB, bool VC, bool WY, bool REC>
void fwd_block(const FwdTile& c) {
  int n0 = 0;
  for (; n0 + NT <= c.NS; n0 += NT) fwd_tile<NT, VB, VC, WY, REC>(c, n0);
  if (n0 < c.NS) fwd_tail<NT - 1, VB, VC, WY, REC>(c, n0, c.NS - n0);
}

using FwdFn = void (*)(const FwdTile&);
inline FwdFn pick_fwd(bool vb, bool vc, bool wy, bool rec) {
#define SSM_F(a, b, c, d) fwd_block<a, b, c, d>
  static const FwdFn table[16] = {
      SSM_F(false, false, false, false), SSM_F(false, false, false, true),
      SSM_F(false, false, true, false),  SSM_F(false, false, true, true),
      SSM_F(false, true, false, false),  SSM_F(false, true, false, true),
      SSM_F(false, true, true, false),   SSM_F(false, true, true, true),
      SSM_F(true, false, false, false),  SSM_F(true, false, false, true),
      SSM_F(true, false, true, false),   SSM_F(true, false, true, true),
      SSM_F(true, true, false, false),   SSM_F(true, true, false, true),
      SSM_F(true, true, true, false),    SSM_F(true, true, true, true)};
#undef SSM_F
  return table[vb * 8 + vc * 4 + wy * 2 + rec];
}

// The reverse walk over one block: gh_t = dy_t C_t + exp(dt_{t+1} A) gh_{t+1}.
struct BwdTile {
  int T, NS;
  const float *Av, *Bsrc, *Csrc, *dt, *dtu, *dy, *H, *E;
  float* carry;             // (NS, W): exp(dt_{t+1} A) gh_{t+1}, updated in place
  float* dA;                // (NS, W) accumulated
  float *dB, *dC;           // variable: (T, NS) lane sums written; constant: (NS, W) accumulated
  float *ddt_acc, *ddtu_acc;  // (T, W) accumulated over the state
};

template <int K, bool VB, bool VC>
void bwd_tile(const BwdTile& c, int n0) {
  const int NS = c.NS;
  vf carry[K], dA[K], dBc[K], dCc[K], av[K];
  for (int k = 0; k < K; ++k) {
    const int n = n0 + k;
    carry[k] = ld(c.carry + n * W);
    dA[k] = ld(c.dA + n * W);
    av[k] = ld(c.Av + n * W);
    if (!VB) dBc[k] = ld(c.dB + n * W);
    if (!VC) dCc[k] = ld(c.dC + n * W);
  }
  for (int t = c.T - 1; t >= 0; --t) {
    const vf d = ld(c.dt + t * W), du = ld(c.dtu + t * W), dy = ld(c.dy + t * W);
    vf accq = ld(c.ddt_acc + t * W), accb = ld(c.ddtu_acc + t * W);
    const float* Ht = c.H + (int64_t)(t + 1) * NS * W;
    const float* Hp = c.H + (int64_t)t * NS * W;
    const float* Et = c.E + (int64_t)t * NS * W;
    vf pB[K], pC[K];  // per-lane terms of the variable dB_t / dC_t, summed below
#pragma GCC unroll 16
    for (int k = 0; k < K; ++k) {
      const int n = n0 + k;
      const vf ck = VC ? bc(c.Csrc[t * NS + n]) : ld(c.Csrc + n * W);
      const vf bk = VB ? bc(c.Bsrc[t * NS + n]) : ld(c.Bsrc + n * W);
      const vf gh = carry[k] + dy * ck;
      const vf hk = ld(Ht + n * W);
      if (VC)
        pC[k] = hk * dy;
      else
        dCc[k] += hk * dy;
      if (VB)
        pB[k] = gh * du;
      else
        dBc[k] += gh * du;
      accb += gh * bk;
      const vf e = ld(Et + n * W);
      const vf q = gh * e * ld(Hp + n * W);
      dA[k] += q * d;
      accq += q * av[k];
      carry[k] = e * gh;
    }
    if (VB) lane_sums<K>(c.dB + t * NS + n0, pB);
    if (VC) lane_sums<K>(c.dC + t * NS + n0, pC);
    st(c.ddt_acc + t * W, accq);
    st(c.ddtu_acc + t * W, accb);
  }
  for (int k = 0; k < K; ++k) {
    const int n = n0 + k;
    st(c.carry + n * W, carry[k]);
    st(c.dA + n * W, dA[k]);
    if (!VB) st(c.dB + n * W, dBc[k]);
    if (!VC) st(c.dC + n * W, dCc[k]);
  }
}

template <int K, bool VB, bool VC>
void bwd_tail(const BwdTile& c, int n0, int r) {
  if constexpr (K >= 1) {
    if (r == K)
      bwd_tile<K, VB, VC>(c, n0);
    else
      bwd_tail<K - 1, VB, VC>(c, n0, r);
  }
}

template <bool VB, bool VC>
void bwd_block(const BwdTile& c) {
  int n0 = 0;
  for (; n0 + NT <= c.NS; n0 += NT) bwd_tile<NT, VB, VC>(c, n0);
  if (n0 < c.NS) bwd_tail<NT - 1, VB, VC>(c, n0, c.NS - n0);
}

using BwdFn = void (*)(const BwdTile&);
inline BwdFn pick_bwd(bool vb, bool vc) {
  static const BwdFn table[4] = {bwd_block<false, false>, bwd_block<false, true>,
                                 bwd_block<true, false>, bwd_block<true, true>};
  return table[vb * 2 + vc];
}

// --- per-thread scratch and the channels of one vector -------------------------------

struct Scratch {
  float *u, *dtraw, *dt, *dtu, *y, *z, *dout, *dy, *o1, *o2, *o3;  // (T, W)
  float *Bt, *Ct, *dBp, *dCp;                                       // (T, NS)
  float *h, *Av, *Bc, *Cc, *carry, *dA, *dBc, *dCc;                 // (NS, W)
  float *H, *E;                                                     // ((T + 1) * NS, W)
  float* hs;                                                        // (chunk / T + 1) * NS * W
  float *Dv, *biasv, *dtsum, *dD, *dbias;                           // (W)
  void* mem;

  bool alloc(int NS, bool backward) {
    const int64_t tw = kBlock * W, tn = (int64_t)kBlock * NS, nw = (int64_t)NS * W;
    int64_t total = 11 * tw + 4 * tn + 8 * nw + 5 * W;
    if (backward) total += 2 * (kBlock + 1) * nw + (kChunkLen / kBlock + 1) * nw;
    mem = std::malloc(total * sizeof(float) + 64);
    if (!mem) return false;
    float* p = static_cast<float*>(mem);
    auto take = [&p](int64_t n) {
      float* q = p;
      p += n;
      return q;
    };
    float** by_t[] = {&u, &dtraw, &dt, &dtu, &y, &z, &dout, &dy, &o1, &o2, &o3};
    float** by_tn[] = {&Bt, &Ct, &dBp, &dCp};
    float** by_nw[] = {&h, &Av, &Bc, &Cc, &carry, &dA, &dBc, &dCc};
    float** by_w[] = {&Dv, &biasv, &dtsum, &dD, &dbias};
    for (float** f : by_t) *f = take(tw);
    for (float** f : by_tn) *f = take(tn);
    for (float** f : by_nw) *f = take(nw);
    for (float** f : by_w) *f = take(W);
    if (backward) {
      H = take((kBlock + 1) * nw);
      E = take((kBlock + 1) * nw);
      hs = take((kChunkLen / kBlock + 1) * nw);
    }
    return true;
  }
  ~Scratch() { std::free(mem); }
};

struct Vec {  // SSM_W consecutive channels of one (batch, group)
  int64_t b, g, ch0;
  int nl;
  int64_t row[W];  // element offset of each live lane's (batch, channel) row in (batch, dim, seqlen)
};

inline Vec make_vec(const ScanArgs& a, int64_t b, int64_t g, int64_t j) {
  const int64_t dg = a.dim / a.groups;
  Vec v;
  v.b = b;
  v.g = g;
  v.ch0 = g * dg + j * W;
  v.nl = (int)imin(W, dg - j * W);
  for (int l = 0; l < W; ++l) v.row[l] = (b * a.dim + v.ch0 + (l < v.nl ? l : 0)) * a.seqlen;
  return v;
}

// Per-vector constants: A, constant B/C, D and delta_bias, lane-major.
inline void load_params(const ScanArgs& a, const Vec& v, Scratch& s) {
  const int NS = (int)a.dstate;
  for (int n = 0; n < NS; ++n)
    for (int l = 0; l < W; ++l) {
      const bool live = l < v.nl;
      const int64_t i = (v.ch0 + l) * NS + n;
      s.Av[n * W + l] = live ? a.A[i] : 0.0f;
      if (!a.B_variable) SSM_DTYPE_SWITCH(a.dtype_B, DT, s.Bc[n * W + l] = live ? get<DT>(a.B, i) : 0.0f);
      if (!a.C_variable) SSM_DTYPE_SWITCH(a.dtype_C, DT, s.Cc[n * W + l] = live ? get<DT>(a.C, i) : 0.0f);
    }
  for (int l = 0; l < W; ++l) {
    const bool live = l < v.nl;
    s.Dv[l] = live && a.D ? a.D[v.ch0 + l] : 0.0f;
    s.biasv[l] = live && a.delta_bias ? a.delta_bias[v.ch0 + l] : 0.0f;
  }
}

// Loads timesteps [t0, t0 + T) of the vector's inputs: u, dt (after bias and softplus),
// dt * u, the B/C blocks, and z / dout when asked.
inline void load_block(const ScanArgs& a, const Vec& v, Scratch& s, int64_t t0, int T, bool with_z,
                       bool with_dout) {
  const int NS = (int)a.dstate;
  int64_t row[W];
  for (int l = 0; l < W; ++l) row[l] = v.row[l] + t0;
  gather_rows(s.u, a.u, a.dtype_in, row, v.nl, T);
  gather_rows(s.dtraw, a.delta, a.dtype_in, row, v.nl, T);
  const vf bias = ld(s.biasv);
  for (int t = 0; t < T; ++t) {
    const vf x = ld(s.dtraw + t * W) + bias;
    const vf d = a.delta_softplus ? vsoftplus(x) : x;
    st(s.dtraw + t * W, x);
    st(s.dt + t * W, d);
    st(s.dtu + t * W, d * ld(s.u + t * W));
  }
  if (a.B_variable)
    transpose_bc(s.Bt, a.B, a.dtype_B, ((v.b * a.groups + v.g) * NS) * a.seqlen + t0, a.seqlen, NS, T);
  if (a.C_variable)
    transpose_bc(s.Ct, a.C, a.dtype_C, ((v.b * a.groups + v.g) * NS) * a.seqlen + t0, a.seqlen, NS, T);
  if (with_z && a.z) gather_rows(s.z, a.z, a.dtype_in, row, v.nl, T);
  if (with_dout) gather_rows(s.dout, a.dout, a.dtype_in, row, v.nl, T);
}

inline int64_t num_chunks(int64_t seqlen) { return (seqlen + kChunkLen - 1) / kChunkLen; }

// --- forward --------------------------------------------------------------------------

void fwd_vec(const ScanArgs& a, const Vec& v, Scratch& s) {
  const int NS = (int)a.dstate;
  const int64_t L = a.seqlen, nchunks = num_chunks(L);
  load_params(a, v, s);
  for (int n = 0; n < NS; ++n)
    for (int l = 0; l < W; ++l)
      s.h[n * W + l] = (a.initial_state && l < v.nl) ? a.initial_state[(v.row[l] / L) * NS + n] : 0.0f;
  st(s.dtsum, bc(0.0f));
  const FwdFn scan = pick_fwd(a.B_variable, a.C_variable, true, false);
  const vf Dv = ld(s.Dv);
  for (int64_t t0 = 0; t0 < L; t0 += kBlock) {
    const int T = (int)imin(kBlock, L - t0);
    load_block(a, v, s, t0, T, true, false);
    vf dtsum = ld(s.dtsum);
    for (int t = 0; t < T; ++t) {
      dtsum += ld(s.dt + t * W);
      st(s.y + t * W, bc(0.0f));
    }
    st(s.dtsum, dtsum);
    FwdTile c{T, NS, s.h, s.Av, a.B_variable ? s.Bt : s.Bc, a.C_variable ? s.Ct : s.Cc,
              s.dt, s.dtu, s.y, nullptr, nullptr};
    scan(c);
    for (int t = 0; t < T; ++t) {
      const vf y = ld(s.y + t * W) + Dv * ld(s.u + t * W);
      st(s.y + t * W, y);
      if (a.z) {
        const vf z = ld(s.z + t * W);
        st(s.o1 + t * W, y * z * vsigmoid(z));
      }
    }
    int64_t row[W];
    for (int l = 0; l < W; ++l) row[l] = v.row[l] + t0;
    scatter_rows(a.out, a.dtype_in, s.y, row, v.nl, T);
    if (a.z) scatter_rows(a.out_z, a.dtype_in, s.o1, row, v.nl, T);
    const int64_t t1 = t0 + T;
    if (t1 % kChunkLen == 0 || t1 == L) {
      const int64_t chunk = (t1 - 1) / kChunkLen;
      for (int n = 0; n < NS; ++n) {
        float decay[W];
        st(decay, vexp(dtsum * ld(s.Av + n * W)));
        for (int l = 0; l < v.nl; ++l) {
          float* x = a.scan_intermediates + ((v.row[l] / L) * nchunks + chunk) * 2 * NS;
          x[2 * n] = decay[l];
          x[2 * n + 1] = s.h[n * W + l];
        }
      }
    }
  }
  for (int l = 0; l < v.nl; ++l)
    for (int n = 0; n < NS; ++n) a.last_state[(v.row[l] / L) * NS + n] = s.h[n * W + l];
}

int fwd(const ScanArgs& a) {
  const int64_t dg = a.dim / a.groups, J = (dg + W - 1) / W;
  const int64_t units = a.batch * a.groups * J;
  int failed = 0;
  par(a, units, [&](int64_t begin, int64_t end) {
    Scratch s;
    if (!s.alloc((int)a.dstate, false)) {
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      return;
    }
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / (a.groups * J), g = (i / J) % a.groups, j = i % J;
      fwd_vec(a, make_vec(a, b, g, j), s);
    }
  });
  return failed;
}

// --- backward -------------------------------------------------------------------------

struct BwdShared {
  int64_t J, P;  // vectors per group; slots per (batch, group) for variable dB/dC sums
  float *carry;  // (batch, dim, NS): gradient reaching the chunk's last state from after it
  float *dA_rows, *dB_rows, *dC_rows;  // (batch, dim, NS) per-row partials
  float *dD_rows, *dbias_rows;         // (batch, dim)
  float *slotB, *slotC;                // (batch * groups * P, chunk, NS) partial lane sums
};

// One vector's backward over chunk [c0, c1): recompute the block-start states from
// the chunk-start state, then walk the blocks in reverse, recomputing each block's
// states and decays from its start.
void bwd_vec_chunk(const ScanArgs& a, const BwdShared& sh, const Vec& v, Scratch& s, int64_t c,
                   float* slotB, float* slotC) {
  const int NS = (int)a.dstate;
  const int64_t L = a.seqlen, nchunks = num_chunks(L);
  const int64_t c0 = c * kChunkLen, c1 = imin(L, c0 + kChunkLen);
  const int64_t nw = (int64_t)NS * W;
  load_params(a, v, s);
  for (int n = 0; n < NS; ++n)
    for (int l = 0; l < W; ++l) {
      const bool live = l < v.nl;
      const int64_t r = v.row[l] / L;
      float h0 = 0.0f;
      if (live && c > 0)
        h0 = a.scan_intermediates[(r * nchunks + c - 1) * 2 * NS + 2 * n + 1];
      else if (live && a.initial_state)
        h0 = a.initial_state[r * NS + n];
      s.h[n * W + l] = h0;
      s.carry[n * W + l] = live ? sh.carry[r * NS + n] : 0.0f;
      s.dA[n * W + l] = 0.0f;
      s.dBc[n * W + l] = 0.0f;
      s.dCc[n * W + l] = 0.0f;
    }
  vf dD = bc(0.0f), dbias = bc(0.0f);
  const bool VB = a.B_variable, VC = a.C_variable;
  const int nblocks = (int)((c1 - c0 + kBlock - 1) / kBlock);
  const FwdFn states = pick_fwd(VB, VC, false, false);
  const FwdFn record = pick_fwd(VB, VC, a.z != nullptr, true);
  const BwdFn reverse = pick_bwd(VB, VC);
  for (int blk = 0; blk < nblocks; ++blk) {
    const int64_t t0 = c0 + (int64_t)blk * kBlock;
    const int T = (int)imin(kBlock, c1 - t0);
    __builtin_memcpy(s.hs + blk * nw, s.h, nw * sizeof(float));
    if (blk == nblocks - 1) break;  // the last block's end state is never needed
    load_block(a, v, s, t0, T, false, false);
    FwdTile fc{T, NS, s.h, s.Av, VB ? s.Bt : s.Bc, VC ? s.Ct : s.Cc, s.dt, s.dtu, nullptr, nullptr,
               nullptr};
    states(fc);
  }
  const vf Dv = ld(s.Dv);
  for (int blk = nblocks - 1; blk >= 0; --blk) {
    const int64_t t0 = c0 + (int64_t)blk * kBlock;
    const int T = (int)imin(kBlock, c1 - t0);
    load_block(a, v, s, t0, T, true, true);
    __builtin_memcpy(s.H, s.hs + blk * nw, nw * sizeof(float));
    __builtin_memcpy(s.h, s.hs + blk * nw, nw * sizeof(float));
    for (int t = 0; t < T; ++t) {
      st(s.y + t * W, bc(0.0f));
      st(s.o1 + t * W, bc(0.0f));
      st(s.o2 + t * W, bc(0.0f));
    }
    FwdTile fc{T, NS, s.h, s.Av, VB ? s.Bt : s.Bc, VC ? s.Ct : s.Cc, s.dt, s.dtu, s.y, s.H, s.E};
    record(fc);
    for (int t = 0; t < T; ++t) {  // dy = d out / d y; dz
      const vf g = ld(s.dout + t * W);
      if (a.z) {
        const vf z = ld(s.z + t * W), y = ld(s.y + t * W) + Dv * ld(s.u + t * W);
        const vf sig = vsigmoid(z), silu = z * sig;
        st(s.o3 + t * W, g * y * (sig + silu * (bc(1.0f) - sig)));
        st(s.dy + t * W, g * silu);
      } else {
        st(s.dy + t * W, g);
      }
    }
    BwdTile bcx{T, NS, s.Av, VB ? s.Bt : s.Bc, VC ? s.Ct : s.Cc, s.dt, s.dtu, s.dy, s.H, s.E,
                s.carry, s.dA, VB ? s.dBp : s.dBc, VC ? s.dCp : s.dCc, s.o1, s.o2};
    reverse(bcx);
    for (int t = 0; t < T; ++t) {
      const vf u = ld(s.u + t * W), dy = ld(s.dy + t * W), ddtu = ld(s.o2 + t * W);
      vf ddt = ld(s.o1 + t * W) + ddtu * u;
      st(s.o2 + t * W, ddtu * ld(s.dt + t * W) + Dv * dy);  // du
      dD += dy * u;
      if (a.delta_softplus) ddt = ddt * vsigmoid(ld(s.dtraw + t * W));
      dbias += ddt;
      st(s.o1 + t * W, ddt);
    }
    int64_t row[W];
    for (int l = 0; l < W; ++l) row[l] = v.row[l] + t0;
    scatter_rows(a.du, a.dtype_in, s.o2, row, v.nl, T);
    scatter_rows(a.ddelta, a.dtype_in, s.o1, row, v.nl, T);
    if (a.z) scatter_rows(a.dz, a.dtype_in, s.o3, row, v.nl, T);
    const int64_t off = (t0 - c0) * NS;
    if (VB)
      for (int64_t i = 0; i < (int64_t)T * NS; ++i) slotB[off + i] += s.dBp[i];
    if (VC)
      for (int64_t i = 0; i < (int64_t)T * NS; ++i) slotC[off + i] += s.dCp[i];
  }
  // Per-row results: each row belongs to exactly one vector, so these are race-free
  // and accumulate over the chunks in a fixed (reverse) order.
  float dDl[W], dbl[W];
  st(dDl, dD);
  st(dbl, dbias);
  for (int l = 0; l < v.nl; ++l) {
    const int64_t r = v.row[l] / L;
    for (int n = 0; n < NS; ++n) {
      sh.carry[r * NS + n] = s.carry[n * W + l];
      sh.dA_rows[r * NS + n] += s.dA[n * W + l];
      if (!VB) sh.dB_rows[r * NS + n] += s.dBc[n * W + l];
      if (!VC) sh.dC_rows[r * NS + n] += s.dCc[n * W + l];
    }
    sh.dD_rows[r] += dDl[l];
    sh.dbias_rows[r] += dbl[l];
  }
}

// dM[b, g, n, t] = sum over slots p (in order) of slot[b, g, p][t - c0][n].
void reduce_slots(const ScanArgs& a, const BwdShared& sh, const float* slots, void* dM, int dtype,
                  int64_t c0, int64_t c1) {
  const int64_t NS = a.dstate, rows = a.batch * a.groups * NS, clen = imin(a.seqlen, kChunkLen);
  par(a, rows, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bg = r / NS, n = r % NS;
      SSM_DTYPE_SWITCH(dtype, DT, {
        for (int64_t t = c0; t < c1; ++t) {
          float acc = 0.0f;
          for (int64_t p = 0; p < sh.P; ++p) acc += slots[((bg * sh.P + p) * clen + (t - c0)) * NS + n];
          put<DT>(dM, r * a.seqlen + t, acc);
        }
      });
    }
  });
}

int bwd(const ScanArgs& a) {
  const int64_t NS = a.dstate, L = a.seqlen, nchunks = num_chunks(L);
  const int64_t dg = a.dim / a.groups, J = (dg + W - 1) / W, BG = a.batch * a.groups;
  const int64_t clen = imin(L, kChunkLen);
  const bool VB = a.B_variable, VC = a.C_variable;
  BwdShared sh;
  sh.J = J;
  // Slots depend on the shapes only (never on the thread count), so every sum is
  // formed in the same order on every run.
  if (!VB && !VC) {
    sh.P = J;
  } else {
    const int64_t per_slot = clen * NS * (VB + VC) * (int64_t)sizeof(float);
    sh.P = imax(1, imin(imin(J, (64 + BG - 1) / BG), (int64_t(64) << 20) / imax(1, BG * per_slot)));
  }
  const int64_t rows = a.batch * a.dim;
  const int64_t n_carry = a.dinitial_state ? 0 : rows * NS;
  const int64_t n_slot = BG * sh.P * clen * NS;
  const int64_t total = n_carry + 3 * rows * NS + 2 * rows + (VB ? n_slot : 0) + (VC ? n_slot : 0);
  float* mem = static_cast<float*>(std::calloc(total, sizeof(float)));
  if (!mem) return 1;
  float* p = mem;
  sh.carry = a.dinitial_state ? a.dinitial_state : p;
  p += n_carry;
  sh.dA_rows = p, p += rows * NS;
  sh.dB_rows = p, p += rows * NS;
  sh.dC_rows = p, p += rows * NS;
  sh.dD_rows = p, p += rows;
  sh.dbias_rows = p, p += rows;
  sh.slotB = VB ? p : nullptr, p += VB ? n_slot : 0;
  sh.slotC = VC ? p : nullptr, p += VC ? n_slot : 0;
  for (int64_t i = 0; i < rows * NS; ++i) sh.carry[i] = a.dlast_state ? a.dlast_state[i] : 0.0f;

  int failed = 0;
  for (int64_t c = nchunks - 1; c >= 0; --c) {
    const int64_t c0 = c * kChunkLen, c1 = imin(L, c0 + kChunkLen);
    par(a, BG * sh.P, [&](int64_t begin, int64_t end) {
      Scratch s;
      if (!s.alloc((int)NS, true)) {
        __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        return;
      }
      for (int64_t i = begin; i < end; ++i) {
        const int64_t bg = i / sh.P, slot = i % sh.P;
        float* sB = VB ? sh.slotB + i * clen * NS : nullptr;
        float* sC = VC ? sh.slotC + i * clen * NS : nullptr;
        if (sB) __builtin_memset(sB, 0, (c1 - c0) * NS * sizeof(float));
        if (sC) __builtin_memset(sC, 0, (c1 - c0) * NS * sizeof(float));
        for (int64_t j = slot * J / sh.P; j < (slot + 1) * J / sh.P; ++j)
          bwd_vec_chunk(a, sh, make_vec(a, bg / a.groups, bg % a.groups, j), s, c, sB, sC);
      }
    });
    if (failed) break;
    if (VB) reduce_slots(a, sh, sh.slotB, a.dB, a.dtype_B, c0, c1);
    if (VC) reduce_slots(a, sh, sh.slotC, a.dC, a.dtype_C, c0, c1);
  }
  if (!failed) {
    // Sums over the batch, in batch order.
    for (int64_t d = 0; d < a.dim; ++d) {
      for (int64_t n = 0; n < NS; ++n) {
        float sA = 0.0f, sB = 0.0f, sC = 0.0f;
        for (int64_t b = 0; b < a.batch; ++b) {
          const int64_t i = (b * a.dim + d) * NS + n;
          sA += sh.dA_rows[i];
          sB += sh.dB_rows[i];
          sC += sh.dC_rows[i];
        }
        a.dA[d * NS + n] = sA;
        if (!VB) SSM_DTYPE_SWITCH(a.dtype_B, DT, put<DT>(a.dB, d * NS + n, sB));
        if (!VC) SSM_DTYPE_SWITCH(a.dtype_C, DT, put<DT>(a.dC, d * NS + n, sC));
      }
      reduce_channel_sums(a, sh.dD_rows, sh.dbias_rows, d);
    }
  }
  std::free(mem);
  return failed;
}

}  // namespace

int SSM_CAT(scan_fwd_, SSM_ISA)(const ScanArgs& a) { return fwd(a); }
int SSM_CAT(scan_bwd_, SSM_ISA)(const ScanArgs& a) { return bwd(a); }

}  // namespace ssmops_cpu
