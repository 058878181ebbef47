// The SSD chunked scan's CPU kernels (Mamba-2), written once with GCC vector extensions and
// compiled once per instruction set by ssd_kernel_{generic,avx2}.cpp, which define
//   SSD_W    lanes per vector,
//   SSD_ISA  the suffix of the entry points (ssd_fwd_<isa>, ssd_bwd_<isa>).
//
// The algorithm (per batch row b, head h, chunk of Q tokens, dt*A summed into cs):
//   y_i    = sum_{j<=i} (C_i.B_j) exp(cs_i - cs_j) dt_j x_j  +  exp(cs_i) h_prev C_i
//   h_end  = exp(cs_last) h_prev + sum_j exp(cs_last - cs_j) dt_j x_j B_j^T
// Everything heavy is a GEMM on packed panels through one register-blocked micro-kernel
// (MR x NR tile, broadcast A, vector B); the exponentials and masks are fused into the
// packing, so nothing of size (Q, Q) per head outlives a chunk. Per chunk:
//   phase A  (batch, group, token panels):  C.B^T once per group, shared by its heads;
//   phase B  (batch, head):                 outputs and the next state, segment by segment;
//   phase C  (backward; batch, group, rows): the heads' C.B^T gradients summed, then dB, dC.
// Work is split over whole items and every sum runs in a fixed order, so the bits do not
// depend on the thread count.
//
// Everything here has internal linkage and uses no library inline code (no STL, no libm
// wrappers), so nothing compiled for AVX2 can be merged into a caller on another CPU.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "ssd_params.h"

#define SSD_CAT2(a, b) a##b
#define SSD_CAT(a, b) SSD_CAT2(a, b)

namespace ssmops_cpu {
namespace {

constexpr int W = SSD_W;
constexpr int MR = 6;      // micro-tile rows: 6 x (2 vectors) accumulators fit 16 registers
constexpr int NR = 2 * W;  // micro-tile columns
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));

// A broadcast (not vf{} + s: adding zero is no identity for -0.0, so it would cost an add).
inline vf bc(float s) {
#if SSD_W == 16
  return vf{s, s, s, s, s, s, s, s, s, s, s, s, s, s, s, s};
#elif SSD_W == 8
  return vf{s, s, s, s, s, s, s, s};
#else
  return vf{s, s, s, s};
#endif
}
inline vf ld(const float* p) {
  vf v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}
inline vf ld_(const float* p) { return ld(p); }  // for lambdas that name a local `ld`
inline void st(float* p, vf v) { __builtin_memcpy(p, &v, sizeof v); }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
inline int64_t rup(int64_t a, int64_t b) { return cdiv(a, b) * b; }
inline float hsum(vf v) {
  float s = 0.0f;
  for (int l = 0; l < W; ++l) s += v[l];
  return s;
}

// exp: x = n ln2 + r with |r| <= ln2/2, exp(r) by a degree-6 Taylor polynomial (error below
// float's half ulp on that range), times 2^n built in the exponent bits. Below -87.3 the
// result is 0 (no denormals), above 88.7 inf; NaN stays NaN.
inline vf vexp(vf x) {
  const vf lo = bc(-87.3f), hi = bc(88.7f);
  vf xc = x < lo ? lo : x;
  xc = xc > hi ? hi : xc;
  const vf round = bc(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf nf = xc * bc(1.4426950408889634f) + round;
  vi n = (vi)nf - (vi)round;
  nf = nf - round;
  vf r = xc - nf * bc(0.693145751953125f);  // ln2 split in a part exact in float and a rest
  r = r - nf * bc(1.428606765330187e-6f);
  vf p = bc(1.0f / 720.0f);
  p = p * r + bc(1.0f / 120.0f);
  p = p * r + bc(1.0f / 24.0f);
  p = p * r + bc(1.0f / 6.0f);
  p = p * r + bc(0.5f);
  p = p * r + bc(1.0f);
  p = p * r + bc(1.0f);
  vf res = p * (vf)((n + 127) << 23);
  res = x < lo ? bc(0.0f) : res;
  res = x > hi ? bc(__builtin_inff()) : res;
  return x != x ? x : res;
}
// The scalar twin, through the vector code so that a tail element rounds like the rest.
inline float sexp(float x) { return vexp(bc(x))[0]; }
inline vf vsigmoid(vf z) { return bc(1.0f) / (bc(1.0f) + vexp(-z)); }

// --- GEMM on packed panels -------------------------------------------------------------
// A (M x K) is packed in row panels of MR rows: element (i, k) at A[(i/MR)*pa + k*MR + i%MR];
// B (K x N) in column panels of NR columns: element (k, j) at B[(j/NR)*pb + k*NR + j%NR].
// Rows / columns past M / N are zero in the panels.

// The lanes' indices 0 .. W-1.
inline vi lanes() {
  vi v;
  for (int l = 0; l < W; ++l) v[l] = l;
  return v;
}

// tile (MR x NR, row-major) = sum over K of a panel times b panel. From row kt of the b panel on
// (kt < K: a causal triangle), column v takes row k only where k - kt <= v: the product is selected,
// not multiplied by the zeros packed above the diagonal, so that a NaN or inf in the a panel's
// column k (a later token's dt x) does not reach the columns before it (0 * NaN = NaN).
__attribute__((noinline)) void micro(int64_t K, int64_t kt, const float* __restrict a, const float* __restrict b,
                                     float* __restrict tile) {
  vf c0[MR], c1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) c0[r] = c1[r] = bc(0.0f);
  for (int64_t k = 0; k < kt; ++k) {
    const vf b0 = ld(b), b1 = ld(b + W);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const vf ar = bc(a[r]);
      c0[r] += ar * b0;
      c1[r] += ar * b1;
    }
    a += MR;
    b += NR;
  }
  const vi lane0 = lanes(), lane1 = lane0 + W;
  for (int64_t k = kt; k < K; ++k) {
    const vf b0 = ld(b), b1 = ld(b + W);
    const vi d = vi{} + static_cast<int32_t>(k - kt);
    const vi keep0 = lane0 >= d, keep1 = lane1 >= d;
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const vf ar = bc(a[r]);
      c0[r] = keep0 ? c0[r] + ar * b0 : c0[r];
      c1[r] = keep1 ? c1[r] + ar * b1 : c1[r];
    }
    a += MR;
    b += NR;
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    st(tile + r * NR, c0[r]);
    st(tile + r * NR + W, c1[r]);
  }
}

// For every tile (i0, j0): the k-range kr(i0, j0) -> [kb, ke) (kb == ke gives a zero tile: the
// caller's zero blocks of a triangular operand; kb > ke: a tile nobody reads, left unwritten),
// with a causal triangle from kt on where kt < ke (see micro), then out(i0, j0, rows, cols, tile).
// The B panel stays in L1 across the row panels.
struct KRange {
  int64_t kb, ke;
  int64_t kt = INT64_MAX;
};
template <class KR, class Out>
inline void gemm(int64_t M, int64_t N, const float* A, int64_t pa, const float* B, int64_t pb, KR kr, Out out) {
  alignas(64) float tile[MR * NR];
  for (int64_t j0 = 0; j0 < N; j0 += NR) {
    const float* bp = B + (j0 / NR) * pb;
    for (int64_t i0 = 0; i0 < M; i0 += MR) {
      const KRange r = kr(i0, j0);
      if (r.kb > r.ke) continue;
      if (r.ke > r.kb) {
        micro(r.ke - r.kb, imin(r.kt, r.ke) - r.kb, A + (i0 / MR) * pa + r.kb * MR, bp + r.kb * NR, tile);
      } else {
        for (int t = 0; t < MR * NR; ++t) tile[t] = 0.0f;
      }
      out(i0, j0, imin(MR, M - i0), imin(NR, N - j0), tile);
    }
  }
}

inline KRange all_k(int64_t K) {
  return KRange{0, K};
}

// Tile writers: C(i, j) at c[i*rs + j*cs], stored or added.
struct Store {
  float* c;
  int64_t rs;
  bool add;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const float* tile) const {
    for (int64_t r = 0; r < m; ++r) {
      float* row = c + (i0 + r) * rs + j0;
      const float* t = tile + r * NR;
      if (n == NR) {
        if (add)
          for (int v = 0; v < NR; v += W) st(row + v, ld(row + v) + ld(t + v));
        else
          for (int v = 0; v < NR; v += W) st(row + v, ld(t + v));
      } else {
        for (int64_t v = 0; v < n; ++v) row[v] = add ? row[v] + t[v] : t[v];
      }
    }
  }
};
struct StoreT {  // C(i, j) at c[j*cs + i]: a transposed result
  float* c;
  int64_t cs;
  bool add;
  void operator()(int64_t i0, int64_t j0, int64_t m, int64_t n, const float* tile) const {
    for (int64_t v = 0; v < n; ++v) {
      float* col = c + (j0 + v) * cs + i0;
      if (add)
        for (int64_t r = 0; r < m; ++r) col[r] += tile[r * NR + v];
      else if (m == MR)
        for (int r = 0; r < MR; ++r) col[r] = tile[r * NR + v];
      else
        for (int64_t r = 0; r < m; ++r) col[r] = tile[r * NR + v];
    }
  }
};

// Packs rows: dst panel element (k, q) = src(k)[q] * scale(k) for q < N (zero after), R = MR or NR
// columns per panel, panel stride ps. src(k) must have N readable floats.
template <int R, class Src, class Scale>
inline void pack_rows(int64_t K, int64_t N, float* dst, int64_t ps, Src src, Scale scale) {
  for (int64_t k = 0; k < K; ++k) {
    const float* s = src(k);
    const float f = scale(k);
    for (int64_t q0 = 0; q0 < N; q0 += R) {
      float* d = dst + (q0 / R) * ps + k * R;
      const int64_t n = imin(R, N - q0);
      if (n == R && R % W == 0) {
        for (int v = 0; v < R; v += W) st(d + v, ld(s + q0 + v) * bc(f));
      } else if (n == R) {
        for (int v = 0; v < R; ++v) d[v] = s[q0 + v] * f;
      } else {
        for (int64_t v = 0; v < n; ++v) d[v] = s[q0 + v] * f;
        for (int64_t v = n; v < R; ++v) d[v] = 0.0f;
      }
    }
  }
}
// Packs by element: dst panel element (k, q) = f(k, q) for q < N (zero after). k runs inner:
// the callers' sources are rows of q with k contiguous (a transposing pack).
template <int R, class F>
inline void pack_gather(int64_t K, int64_t N, float* dst, int64_t ps, F f) {
  for (int64_t q0 = 0; q0 < N; q0 += R) {
    float* d = dst + (q0 / R) * ps;
    const int64_t n = imin(R, N - q0);
    for (int64_t v = 0; v < R; ++v)
      if (v < n)
        for (int64_t k = 0; k < K; ++k) d[k * R + v] = f(k, q0 + v);
      else
        for (int64_t k = 0; k < K; ++k) d[k * R + v] = 0.0f;
  }
}
inline float one(int64_t) { return 1.0f; }

// --- scratch -----------------------------------------------------------------------------

struct Arena {  // bump allocator over one malloc; every block 64-byte aligned
  char* base = nullptr;
  size_t used = 0, cap = 0;
  float* get(int64_t n) {
    float* p = reinterpret_cast<float*>(base + used);
    used += static_cast<size_t>(rup(n * 4, 64));
    if (used > cap) __builtin_trap();  // a sizing bug: stop rather than write past the block
    return p;
  }
};

// Runs fn(item) for items [0, n) over at most `workers` workers, each with its own scratch of
// `per_worker` bytes (zeroed). Workers claim items one at a time from a shared counter, so a
// worker whose core is taken by another process holds up at most one item; an item's result
// never depends on which worker ran it, so the bits stay the same.
template <class F>
int run_items(const SsdArgs& a, int64_t n, size_t per_worker, F fn) {
  struct Ctx {
    int64_t n, next;
    size_t per_worker;
    char* mem;
    F* fn;
  };
  per_worker = static_cast<size_t>(rup(static_cast<int64_t>(per_worker), 64));
  const int64_t workers = imax(1, imin(a.nthreads, n));
  char* mem = static_cast<char*>(std::calloc(static_cast<size_t>(workers) * per_worker + 64, 1));
  if (!mem) return 1;
  char* aligned = mem + ((64 - reinterpret_cast<uintptr_t>(mem) % 64) % 64);
  Ctx ctx{n, 0, per_worker, aligned, &fn};
  a.parallel_for(
      workers,
      [](void* p, int64_t wb, int64_t we) {
        Ctx& c = *static_cast<Ctx*>(p);
        for (int64_t w = wb; w < we; ++w) {
          Arena arena{c.mem + w * c.per_worker, 0, c.per_worker};
          for (;;) {
            const int64_t item = __atomic_fetch_add(&c.next, 1, __ATOMIC_RELAXED);
            if (item >= c.n) break;
            arena.used = 0;
            (*c.fn)(item, arena);
          }
        }
      },
      &ctx);
  std::free(mem);
  return 0;
}

// --- shapes and per-chunk group data -----------------------------------------------------

struct Geo {
  int64_t b, L, H, P, G, N, Q, nc, Qp, hpg;
  explicit Geo(const SsdArgs& a)
      : b(a.batch), L(a.seqlen), H(a.nheads), P(a.headdim), G(a.ngroups), N(a.dstate), Q(a.chunk),
        nc(a.nchunks), Qp(rup(a.chunk, NR) + NR), hpg(a.nheads / a.ngroups) {}
  int64_t PNp() const { return rup(N, NR); }  // dstate padded to column panels
};

// What phase A leaves for one (batch, group) and the current chunk.
struct GroupChunk {
  float* CBt;    // (Q, Qp): CBt[j][i] = B_j . C_i for i >= j (other entries unused)
  float* Ct;     // (N, Qp): C transposed
  float* Bt;     // (N, Qp): B transposed (backward)
  float* Bpack;  // B (Q x N) as a packed B operand: panel stride Q*NR
  float* Cpack;  // C likewise (backward)
};
struct GroupBufs {
  float* mem = nullptr;
  int64_t per = 0;
  GroupChunk at(const Geo& g, int64_t bg) const {
    float* p = mem + bg * per;
    const int64_t qq = g.Q * g.Qp, nq = g.N * g.Qp, pk = g.PNp() * g.Q;
    return GroupChunk{p, p + qq, p + qq + nq, p + qq + 2 * nq, p + qq + 2 * nq + pk};
  }
  static int64_t size(const Geo& g) { return g.Q * g.Qp + 2 * g.N * g.Qp + 2 * g.PNp() * g.Q + 64; }
};

inline const float* row_of(const float* M, const Geo& g, int64_t b, int64_t t, int64_t grp) {
  return M + ((b * g.L + t) * g.G + grp) * g.N;
}

// Phase A for chunk c: item (b, grp, pair) handles the token panels `pair` and np-1-pair (so
// the triangle's work is even across items).
int phase_a(const SsdArgs& a, const Geo& g, const GroupBufs& gb, int64_t c, bool bwd) {
  const int64_t t0 = c * g.Q, Tc = imin(g.Q, g.L - t0);
  const int64_t np = cdiv(Tc, NR), npair = cdiv(np, 2);
  const size_t scratch = static_cast<size_t>(rup(Tc, MR) * g.N + NR * g.N) * 4 + 256;
  return run_items(a, g.b * g.G * npair, scratch, [&](int64_t item, Arena& ar) {
    const int64_t pair = item % npair, bg = item / npair, b = bg / g.G, grp = bg % g.G;
    const GroupChunk gc = gb.at(g, bg);
    float* Apk = ar.get(rup(Tc, MR) * g.N);
    float* Bpk = ar.get(NR * g.N);
    for (int64_t which = 0; which < 2; ++which) {
      const int64_t panel = which == 0 ? pair : np - 1 - pair;
      if (which == 1 && panel == pair) break;
      const int64_t i0 = panel * NR, i1 = imin(Tc, i0 + NR);
      // CBt[:i1, i0:i1] = B[:i1] . C[i0:i1]^T
      pack_gather<MR>(g.N, i1, Apk, g.N * MR,
                      [&](int64_t k, int64_t j) { return row_of(a.B, g, b, t0 + j, grp)[k]; });
      pack_gather<NR>(g.N, i1 - i0, Bpk, g.N * NR,
                      [&](int64_t k, int64_t i) { return row_of(a.C, g, b, t0 + i0 + i, grp)[k]; });
      gemm(i1, i1 - i0, Apk, g.N * MR, Bpk, g.N * NR, [&](int64_t, int64_t) { return all_k(g.N); },
           Store{gc.CBt + i0, g.Qp, false});
      for (int64_t i = i0; i < i1; ++i) {
        const float* Ci = row_of(a.C, g, b, t0 + i, grp);
        const float* Bi = row_of(a.B, g, b, t0 + i, grp);
        for (int64_t k = 0; k < g.N; ++k) gc.Ct[k * g.Qp + i] = Ci[k];
        if (bwd)
          for (int64_t k = 0; k < g.N; ++k) gc.Bt[k * g.Qp + i] = Bi[k];
      }
      // rows i0..i1 of the packed B (and C) operands
      pack_rows<NR>(i1 - i0, g.N, gc.Bpack + i0 * NR, g.Q * NR,
                    [&](int64_t k) { return row_of(a.B, g, b, t0 + i0 + k, grp); }, one);
      if (bwd)
        pack_rows<NR>(i1 - i0, g.N, gc.Cpack + i0 * NR, g.Q * NR,
                      [&](int64_t k) { return row_of(a.C, g, b, t0 + i0 + k, grp); }, one);
    }
  });
}

// --- one segment, forward ------------------------------------------------------------------

struct Seg {
  int64_t b, h, grp, t0, s0, T;  // chunk start t0; tokens t0+s0 .. t0+s0+T
  const float* h_prev;           // null when the segment starts from zero
};

// dt, cs (cumulative dt*A from the segment start) and e = exp(cs), padded with zeros to a
// whole number of panels.
struct SegScalars {
  float *dt, *cs, *e;
  bool mono;  // cs never rises (every dt*A <= 0, no NaN): see Decay
};
__attribute__((noinline)) SegScalars seg_scalars(const SsdArgs& a, const Geo& g, const Seg& s, Arena& ar) {
  const int64_t Tp = rup(s.T, NR) + NR;
  SegScalars r{ar.get(Tp), ar.get(Tp), ar.get(Tp), true};
  const float Ah = a.A[s.h];
  float acc = 0.0f;
  for (int64_t j = 0; j < Tp; ++j) {
    const bool in = j < s.T;
    r.dt[j] = in ? a.dtv[(s.b * g.L + s.t0 + s.s0 + j) * g.H + s.h] : 0.0f;
    const float step = r.dt[j] * Ah;
    r.mono = r.mono && step <= 0.0f;
    acc += step;
    r.cs[j] = in ? acc : 0.0f;
  }
  for (int64_t j = 0; j < Tp; j += W) st(r.e + j, vexp(ld(r.cs + j)));
  return r;
}

inline const float* xrow(const float* X, const Geo& g, int64_t b, int64_t t, int64_t h) {
  return X + ((b * g.L + t) * g.H + h) * g.P;
}

// The decay mask of a segment, one column panel (NR outputs i0..i0+NR) at a time:
// at(j, v) = exp(cs_i - cs_j) for i = i0+v.. (a vector), 0 where i < j or i >= T.
// When cs never rises, a row j below the panel's diagonal block takes it as
// exp(cs_i - cs_i0) * exp(cs_i0 - cs_j): both factors <= 1, so no overflow, and the panel
// costs NR + i0 exponentials instead of NR * i0 (the product differs from the direct
// exponential by rounding only; it is 0 only where the direct one is below 1e-38).
struct Decay {
  const SegScalars& sc;
  int64_t T, i0 = 0;
  float* f;        // f[j] = exp(cs_i0 - cs_j), j < i0
  vf gv[NR / W]{};  // exp(cs_i - cs_i0), 0 past T
  vi iv[NR / W]{};  // the lanes' i
  Decay(const SegScalars& s, int64_t T_, Arena& ar) : sc(s), T(T_), f(ar.get(rup(T_, W) + W)) {}
  void panel(int64_t p0) {
    i0 = p0;
    const vi Tv = vi{} + static_cast<int32_t>(T);
    for (int q = 0; q < NR / W; ++q) {
      for (int l = 0; l < W; ++l) iv[q][l] = static_cast<int32_t>(i0 + q * W + l);
      gv[q] = iv[q] < Tv ? vexp(ld(sc.cs + i0 + q * W) - bc(sc.cs[i0])) : bc(0.0f);
    }
    if (sc.mono)
      for (int64_t j = 0; j < i0; j += W) st(f + j, vexp(bc(sc.cs[i0]) - ld(sc.cs + j)));
  }
  // the lanes of the panel's columns v.. that row j reaches: i >= j, i < T
  vi reach(int64_t j, int v) const {
    const vi jv = vi{} + static_cast<int32_t>(j), Tv = vi{} + static_cast<int32_t>(T);
    return (iv[v / W] >= jv) & (iv[v / W] < Tv);
  }
  vf at(int64_t j, int v) const {
    if (sc.mono && j < i0) return gv[v / W] * bc(f[j]);
    return reach(j, v) ? vexp(ld(sc.cs + i0 + v) - bc(sc.cs[j])) : bc(0.0f);
  }
};

// Y^T (P x T) = [h_prev | (dt x)^T] . [(e C)^T ; M^T],  M^T[j][i] = (B_j.C_i) exp(cs_i - cs_j), i >= j,
// written transposed into y rows (token-major, stride H*P).
__attribute__((noinline)) void seg_y(const SsdArgs& a, const Geo& g, const Seg& s, const SegScalars& sc, const GroupChunk& gc, float* y,
           int64_t y_stride, Arena& ar) {
  const int64_t T = s.T, koff = s.h_prev ? g.N : 0, K = koff + T;
  float* Ap = ar.get(rup(g.P, MR) * K);
  float* Bp = ar.get(rup(T, NR) * K);
  const int64_t tg = s.t0 + s.s0;
  if (s.h_prev)
    pack_gather<MR>(g.N, g.P, Ap, K * MR, [&](int64_t k, int64_t p) { return s.h_prev[p * g.N + k]; });
  pack_rows<MR>(T, g.P, Ap + koff * MR, K * MR, [&](int64_t j) { return xrow(a.x, g, s.b, tg + j, s.h); },
                [&](int64_t j) { return sc.dt[j]; });
  if (s.h_prev)
    for (int64_t k = 0; k < g.N; ++k) {
      const float* ct = gc.Ct + k * g.Qp + s.s0;
      for (int64_t i0 = 0; i0 < T; i0 += NR) {
        float* d = Bp + (i0 / NR) * K * NR + k * NR;
        for (int v = 0; v < NR; v += W) {  // columns past T make outputs that are never stored
          const vf e = ld(sc.e + i0 + v);
          st(d + v, ld(ct + i0 + v) * e);
        }
      }
    }
  Decay dec(sc, T, ar);
  for (int64_t i0 = 0; i0 < T; i0 += NR) {
    dec.panel(i0);
    float* panel = Bp + (i0 / NR) * K * NR;
    for (int64_t j = 0; j < imin(T, i0 + NR); ++j) {
      const float* cb = gc.CBt + (s.s0 + j) * g.Qp + s.s0 + i0;
      float* d = panel + (koff + j) * NR;
      for (int v = 0; v < NR; v += W) st(d + v, ld(cb + v) * dec.at(j, v));
    }
  }
  gemm(g.P, T, Ap, K * MR, Bp, K * NR,
       [&](int64_t, int64_t j0) { return KRange{0, koff + imin(T, j0 + NR), koff + j0}; },
       StoreT{y, y_stride, false});
}

// h_end = exp(cs_last) h_prev + (w x)^T B over the segment, w_j = exp(cs_last - cs_j) dt_j.
__attribute__((noinline)) void seg_state(const SsdArgs& a, const Geo& g, const Seg& s, const SegScalars& sc, const GroupChunk& gc,
               float* h_end, Arena& ar) {
  const int64_t T = s.T, PN = g.P * g.N;
  const float cl = sc.cs[T - 1];
  float* w = ar.get(rup(T, W));
  for (int64_t j = 0; j < T; j += W) st(w + j, vexp(bc(cl) - ld(sc.cs + j)) * ld(sc.dt + j));
  float* Ap = ar.get(rup(g.P, MR) * T);
  pack_rows<MR>(T, g.P, Ap, T * MR, [&](int64_t j) { return xrow(a.x, g, s.b, s.t0 + s.s0 + j, s.h); },
                [&](int64_t j) { return w[j]; });
  if (s.h_prev) {
    const float el = sc.e[T - 1];
    for (int64_t q = 0; q < PN; ++q) h_end[q] = el * s.h_prev[q];
  } else {
    for (int64_t q = 0; q < PN; ++q) h_end[q] = 0.0f;
  }
  gemm(g.P, g.N, Ap, T * MR, gc.Bpack + s.s0 * NR, g.Q * NR, [&](int64_t, int64_t) { return all_k(T); },
       Store{h_end, g.N, true});
}

// y += D x, then (kept in a.ungated where asked) y *= silu(z), over rows [tg, tg+T) of head h.
__attribute__((noinline)) void skip_and_gate(const SsdArgs& a, const Geo& g, int64_t b, int64_t h, int64_t tg, int64_t T, float* yrows) {
  const int64_t P = g.P;
  for (int64_t i = 0; i < T; ++i) {
    float* y = yrows + i * g.H * P;
    const float* x = xrow(a.x, g, b, tg + i, h);
    const float* z = a.z ? xrow(a.z, g, b, tg + i, h) : nullptr;
    float* u = a.ungated ? a.ungated + (y - a.out) : nullptr;
    int64_t p = 0;
    for (; p + W <= P; p += W) {
      vf v = ld(y + p);
      if (a.D) v += (a.D_per_channel ? ld(a.D + h * P + p) : bc(a.D[h])) * ld(x + p);
      if (u) st(u + p, v);
      if (z) v *= ld(z + p) * vsigmoid(ld(z + p));
      st(y + p, v);
    }
    for (; p < P; ++p) {
      float v = y[p];
      if (a.D) v += (a.D_per_channel ? a.D[h * P + p] : a.D[h]) * x[p];
      if (u) u[p] = v;
      if (z) v *= z[p] * vsigmoid(bc(z[p]))[0];
      y[p] = v;
    }
  }
}

inline float* state_at(float* base, const Geo& g, int64_t b, int64_t c, int64_t h) {
  return base + ((b * g.nc + c) * g.H + h) * g.P * g.N;
}

// Sequences of cu_seqlens that end at token t: [lo, hi) of varlen_end (non-decreasing).
inline void varlen_range(const SsdArgs& a, int64_t t, int64_t& lo, int64_t& hi) {
  int64_t l = 0, r = a.nseq;
  while (l < r) {
    const int64_t m = (l + r) / 2;
    if (a.varlen_end[m] < t) l = m + 1; else r = m;
  }
  lo = l;
  r = a.nseq;
  while (l < r) {
    const int64_t m = (l + r) / 2;
    if (a.varlen_end[m] <= t) l = m + 1; else r = m;
  }
  hi = l;
}

size_t seg_scratch_bytes(const Geo& g) {
  const int64_t Q = g.Q, K = g.N + Q;
  const int64_t floats = 4 * (rup(Q, NR) + NR) + rup(g.P, MR) * K + rup(Q, NR) * K + rup(Q, W) +
                         rup(g.P, MR) * Q + 2 * g.P * g.N + 64 * 16;
  return static_cast<size_t>(floats) * 4;
}

// --- forward -------------------------------------------------------------------------------

int ssd_fwd(const SsdArgs& a) {
  const Geo g(a);
  const int64_t PN = g.P * g.N;
  GroupBufs gb;
  gb.per = GroupBufs::size(g);
  gb.mem = static_cast<float*>(std::calloc(static_cast<size_t>(g.b * g.G * gb.per), 4));
  if (!gb.mem) return 1;
  for (int64_t b = 0; b < g.b; ++b)
    for (int64_t h = 0; h < g.H; ++h) {
      float* s0 = state_at(a.chunk_states, g, b, 0, h);
      for (int64_t q = 0; q < PN; ++q) s0[q] = a.initial_states ? a.initial_states[(b * g.H + h) * PN + q] : 0.0f;
    }
  int err = 0;
  for (int64_t c = 0; c < g.nc && !err; ++c) {
    err = phase_a(a, g, gb, c, false);
    if (err) break;
    const int64_t t0 = c * g.Q, Tc = imin(g.Q, g.L - t0);
    err = run_items(a, g.b * g.H, seg_scratch_bytes(g) + 2 * PN * 4 + 256, [&](int64_t item, Arena& ar) {
      const int64_t b = item / g.H, h = item % g.H, grp = h / g.hpg;
      const GroupChunk gc = gb.at(g, b * g.G + grp);
      float* hbuf[2] = {ar.get(PN), ar.get(PN)};
      const int64_t sb = a.seg_offset[b * g.nc + c], se = a.seg_offset[b * g.nc + c + 1];
      const float* h_cur = state_at(a.chunk_states, g, b, c, h);
      const size_t mark = ar.used;
      for (int64_t si = sb; si < se; ++si) {
        ar.used = mark;
        const int64_t s0 = a.seg_start[si], s1 = si + 1 < se ? a.seg_start[si + 1] : Tc;
        const Seg s{b, h, grp, t0, s0, s1 - s0, a.seg_reset[si] ? nullptr : h_cur};
        float* h_end = si + 1 < se ? hbuf[(si - sb) % 2]
                       : c + 1 < g.nc ? state_at(a.chunk_states, g, b, c + 1, h)
                                      : a.final_states + (b * g.H + h) * PN;
        const SegScalars sc = seg_scalars(a, g, s, ar);
        float* yrows = a.out + ((b * g.L + t0 + s0) * g.H + h) * g.P;
        seg_y(a, g, s, sc, gc, yrows, g.H * g.P, ar);
        skip_and_gate(a, g, b, h, t0 + s0, s.T, yrows);
        seg_state(a, g, s, sc, gc, h_end, ar);
        if (a.varlen_states) {
          int64_t lo, hi;
          varlen_range(a, t0 + s1 - 1, lo, hi);
          for (int64_t i = lo; i < hi; ++i) std::memcpy(a.varlen_states + (i * g.H + h) * PN, h_end, PN * 4);
        }
        h_cur = h_end;
      }
    });
  }
  std::free(gb.mem);
  return err;
}

// --- one segment, backward ---------------------------------------------------------------
// Given dh (the gradient of the segment's end state) and dout, it writes the segment's rows of
// dx, ddtv, dz, its head's share of dC, dB (dCh, dBh: C rows, B rows) and of the C.B^T
// gradient (dCB, rows of the chunk), adds to dA and dD, and turns dh into the gradient of
// the segment's start state. With G = (B_j.C_i) exp(cs_i - cs_j), M = G dt_j, dP = dy_i.x_j:
//   dx_j  = sum_i M_ij dy_i + w_j dh B_j + D dy_j                 (w_j = exp(cs_l - cs_j) dt_j)
//   dCB   = dP exp(cs_i - cs_j) dt_j ;  ddt_j gets sum_i dP G and exp(cs_l - cs_j) x_j.dh B_j
//   dcs   from every exp(.), then da = reverse cumsum of dcs, ddt += A da, dA += dt da
//   dh_prev = exp(cs_l) dh + sum_i e_i dy_i C_i^T ;  dC_i += e_i h_prev^T dy_i ;  dB_j += w_j dh^T x_j
struct HeadGrads {
  float *dCB, *dCh, *dBh;  // this (batch, head)'s rows for the chunk: (Q, Qp), (Q, N), (Q, N)
};

__attribute__((noinline)) void seg_bwd(const SsdArgs& a, const Geo& g, const Seg& s, const SegScalars& sc,
                                       const GroupChunk& gc, float* dh, const HeadGrads& hg, int64_t Tc,
                                       Arena& ar) {
  const int64_t T = s.T, P = g.P, N = g.N, tg = s.t0 + s.s0, Tp = rup(T, NR) + NR;
  const float el = sc.e[T - 1], cl = sc.cs[T - 1], Ah = a.A[s.h];
  float* dy = ar.get(T * P);
  float* dxs = ar.get(T * P);
  float* ddt = ar.get(Tp);
  float* dcs = ar.get(Tp);
  for (int64_t j = 0; j < Tp; ++j) ddt[j] = dcs[j] = 0.0f;
  float dcl = 0.0f;

  // dy = dout * silu(z); dz needs y before the gate, recomputed
  if (a.z) {
    const size_t mark = ar.used;
    float* ypre = ar.get(T * P);
    seg_y(a, g, s, sc, gc, ypre, P, ar);
    for (int64_t i = 0; i < T; ++i) {
      const float* x = xrow(a.x, g, s.b, tg + i, s.h);
      const float* z = xrow(a.z, g, s.b, tg + i, s.h);
      const float* go = xrow(a.dout, g, s.b, tg + i, s.h);
      float* dz = a.dz + ((s.b * g.L + tg + i) * g.H + s.h) * P;
      float* yp = ypre + i * P;
      float* d = dy + i * P;
      int64_t p = 0;
      for (; p + W <= P; p += W) {  // dz = dout y silu'(z), dy = dout silu(z)
        vf y = ld(yp + p);
        if (a.D) y += (a.D_per_channel ? ld(a.D + s.h * P + p) : bc(a.D[s.h])) * ld(x + p);
        const vf zv = ld(z + p), sg = vsigmoid(zv), gv = ld(go + p);
        st(dz + p, gv * y * sg * (bc(1.0f) + zv * (bc(1.0f) - sg)));
        st(d + p, gv * zv * sg);
      }
      for (; p < P; ++p) {
        float y = yp[p];
        if (a.D) y += (a.D_per_channel ? a.D[s.h * P + p] : a.D[s.h]) * x[p];
        const float sg = vsigmoid(bc(z[p]))[0];
        dz[p] = go[p] * y * sg * (1.0f + z[p] * (1.0f - sg));
        d[p] = go[p] * z[p] * sg;
      }
    }
    ar.used = mark;
  } else {
    for (int64_t i = 0; i < T; ++i) std::memcpy(dy + i * P, xrow(a.dout, g, s.b, tg + i, s.h), P * 4);
  }
  float* dDp = a.dD_part ? a.dD_part + (s.b * g.H + s.h) * P : nullptr;
  for (int64_t i = 0; i < T; ++i) {
    const float* x = xrow(a.x, g, s.b, tg + i, s.h);
    const float* d = dy + i * P;
    float* o = dxs + i * P;
    int64_t p = 0;
    for (; p + W <= P; p += W) {
      const vf Dv = a.D ? (a.D_per_channel ? ld(a.D + s.h * P + p) : bc(a.D[s.h])) : bc(0.0f);
      st(o + p, Dv * ld(d + p));
      if (dDp) st(dDp + p, ld(dDp + p) + ld(d + p) * ld(x + p));
    }
    for (; p < P; ++p) {
      const float Dp = a.D ? (a.D_per_channel ? a.D[s.h * P + p] : a.D[s.h]) : 0.0f;
      o[p] = Dp * d[p];
      if (dDp) dDp[p] += d[p] * x[p];
    }
  }

  // dPt[j][i] = x_j . dy_i (i >= j blocks only)
  const int64_t ldP = rup(T, NR);
  float* dPt = ar.get(rup(T, MR) * ldP);
  {
    const size_t mark = ar.used;
    float* Ax = ar.get(rup(T, MR) * P);
    float* Bd = ar.get(rup(T, NR) * P);
    pack_gather<MR>(P, T, Ax, P * MR, [&](int64_t k, int64_t j) { return xrow(a.x, g, s.b, tg + j, s.h)[k]; });
    pack_gather<NR>(P, T, Bd, P * NR, [&](int64_t k, int64_t i) { return dy[i * P + k]; });
    gemm(T, T, Ax, P * MR, Bd, P * NR,
         [&](int64_t j0, int64_t i0) { return j0 < i0 + NR ? all_k(P) : KRange{1, 0}; }, Store{dPt, ldP, false});
    ar.used = mark;
  }

  // the quadratic part, one column panel at a time: dCB rows, ddt, dcs, and M^T packed as
  // the A operand of dx (element (j, k=i) at Adx[(j/MR)*T*MR + i*MR + j%MR]).
  float* Adx = ar.get(rup(T, MR) * T);
  {
    Decay dec(sc, T, ar);
    // The panels below write row j of dCB from its diagonal panel to the segment's end; the
    // readers (sum_heads, phase_c) read a row from its diagonal on, so only the columns of
    // later segments need zeros. Adx's row panel j0 is read from k = j0: zero [j0, panel).
    for (int64_t j = 0; j < T; ++j) {
      float* d = hg.dCB + (s.s0 + j) * g.Qp;
      const int64_t first = (j / NR) * NR;
      for (int64_t i = s.s0 + rup(T, NR); i < Tc; ++i) d[i] = 0.0f;
      for (int64_t i = (j / MR) * MR; i < imin(first, T); ++i) Adx[(j / MR) * T * MR + i * MR + j % MR] = 0.0f;
    }
    float* accd = ar.get(rup(T, W));
    float* accr = ar.get(rup(T, W));
    for (int64_t j = 0; j < T; ++j) accd[j] = accr[j] = 0.0f;
    for (int64_t i0 = 0; i0 < T; i0 += NR) {
      dec.panel(i0);
      for (int64_t j = 0; j < imin(T, i0 + NR); ++j) {
        const float* cb = gc.CBt + (s.s0 + j) * g.Qp + s.s0 + i0;
        const float* pr = dPt + j * ldP + i0;
        float* dcb = hg.dCB + (s.s0 + j) * g.Qp + s.s0 + i0;
        float* ad = Adx + (j / MR) * T * MR + j % MR;
        const vf dtj = bc(sc.dt[j]);
        vf sd = bc(0.0f), sr = bc(0.0f);
        for (int v = 0; v < NR; v += W) {
          // (the lanes row j does not reach are selected out: past T they read the next segment's C.B^T,
          // which may hold a NaN, and dPt's scratch, never written; a product with a 0 decay would carry it)
          const vi in = dec.reach(j, v);
          const vf E = dec.at(j, v), G = in ? ld(cb + v) * E : bc(0.0f), Pv = in ? ld(pr + v) : bc(0.0f);
          st(dcb + v, Pv * E * dtj);
          const vf PG = Pv * G, R = PG * dtj;
          sd += PG;
          sr += R;
          st(dcs + i0 + v, ld(dcs + i0 + v) + R);
          const vf Mv = G * dtj;
          float* adv = ad + (i0 + v) * MR;
          if (i0 + v + W <= T) {
            for (int l = 0; l < W; ++l) adv[l * MR] = Mv[l];
          } else {
            for (int l = 0; l < W; ++l)
              if (i0 + v + l < T) adv[l * MR] = Mv[l];
          }
        }
        accd[j] += hsum(sd);
        accr[j] += hsum(sr);
      }
    }
    for (int64_t j = 0; j < T; ++j) {
      ddt[j] += accd[j];
      dcs[j] -= accr[j];
    }
  }
  // dx += M^T dy
  {
    const size_t mark = ar.used;
    float* Bd = ar.get(rup(P, NR) * T);
    pack_rows<NR>(T, P, Bd, T * NR, [&](int64_t i) { return dy + i * P; }, one);
    gemm(T, P, Adx, T * MR, Bd, T * NR, [&](int64_t j0, int64_t) { return KRange{j0, T}; }, Store{dxs, P, true});
    ar.used = mark;
  }
  // the end state's terms: u_j = dh B_j
  float* w1 = ar.get(rup(T, W));  // exp(cs_l - cs_j)
  float* w = ar.get(rup(T, W));   // times dt_j
  for (int64_t j = 0; j < T; j += W) {
    const vf e = vexp(bc(cl) - ld(sc.cs + j));
    st(w1 + j, e);
    st(w + j, e * ld(sc.dt + j));
  }
  {
    const size_t mark = ar.used;
    float* U = ar.get(T * P);
    float* Au = ar.get(rup(T, MR) * N);
    float* Bu = ar.get(rup(P, NR) * N);
    pack_rows<MR>(N, T, Au, N * MR, [&](int64_t k) { return gc.Bt + k * g.Qp + s.s0; }, one);
    pack_gather<NR>(N, P, Bu, N * NR, [&](int64_t k, int64_t p) { return dh[p * N + k]; });
    gemm(T, P, Au, N * MR, Bu, N * NR, [&](int64_t, int64_t) { return all_k(N); }, Store{U, P, false});
    for (int64_t j = 0; j < T; ++j) {
      const float* x = xrow(a.x, g, s.b, tg + j, s.h);
      const float* u = U + j * P;
      float* o = dxs + j * P;
      vf acc = bc(0.0f);
      int64_t p = 0;
      for (; p + W <= P; p += W) {
        st(o + p, ld(o + p) + bc(w[j]) * ld(u + p));
        acc += ld(x + p) * ld(u + p);
      }
      float dw = hsum(acc);
      for (; p < P; ++p) {
        o[p] += w[j] * u[p];
        dw += x[p] * u[p];
      }
      ddt[j] += w1[j] * dw;
      dcl += w[j] * dw;
      dcs[j] -= w[j] * dw;
    }
    // dBh_j = w_j dh^T x_j
    float* Aw = ar.get(rup(T, MR) * P);
    float* Bh = ar.get(rup(N, NR) * P);
    pack_gather<MR>(P, T, Aw, P * MR, [&](int64_t k, int64_t j) { return xrow(a.x, g, s.b, tg + j, s.h)[k] * w[j]; });
    pack_rows<NR>(P, N, Bh, P * NR, [&](int64_t k) { return dh + k * N; }, one);
    gemm(T, N, Aw, P * MR, Bh, P * NR, [&](int64_t, int64_t) { return all_k(P); },
         Store{hg.dBh + s.s0 * N, N, false});
    ar.used = mark;
  }
  // the start state's terms
  if (s.h_prev) {
    const size_t mark = ar.used;
    float* V = ar.get(T * N);
    float* Av = ar.get(rup(T, MR) * P);
    float* Bv = ar.get(rup(N, NR) * P);
    pack_gather<MR>(P, T, Av, P * MR, [&](int64_t k, int64_t i) { return dy[i * P + k]; });
    pack_rows<NR>(P, N, Bv, P * NR, [&](int64_t k) { return s.h_prev + k * N; }, one);
    gemm(T, N, Av, P * MR, Bv, P * NR, [&](int64_t, int64_t) { return all_k(P); }, Store{V, N, false});
    for (int64_t i = 0; i < T; ++i) {
      const float* Ci = row_of(a.C, g, s.b, tg + i, s.grp);
      float* dc = hg.dCh + (s.s0 + i) * N;
      const float* vr = V + i * N;
      vf acc = bc(0.0f);
      int64_t n = 0;
      for (; n + W <= N; n += W) {
        st(dc + n, bc(sc.e[i]) * ld(vr + n));
        acc += ld(Ci + n) * ld(vr + n);
      }
      float de = hsum(acc);
      for (; n < N; ++n) {
        dc[n] = sc.e[i] * vr[n];
        de += Ci[n] * vr[n];
      }
      dcs[i] += sc.e[i] * de;
    }
    float dot = 0.0f;
    for (int64_t q = 0; q < P * N; ++q) dot += dh[q] * s.h_prev[q];
    dcl += el * dot;
    // dh <- exp(cs_l) dh + dy^T (e C)
    float* Ad = ar.get(rup(P, MR) * T);
    float* Bc = ar.get(rup(N, NR) * T);
    pack_rows<MR>(T, P, Ad, T * MR, [&](int64_t i) { return dy + i * P; }, one);
    pack_rows<NR>(T, N, Bc, T * NR, [&](int64_t i) { return row_of(a.C, g, s.b, tg + i, s.grp); },
                  [&](int64_t i) { return sc.e[i]; });
    for (int64_t q = 0; q < P * N; ++q) dh[q] *= el;
    gemm(P, N, Ad, T * MR, Bc, T * NR, [&](int64_t, int64_t) { return all_k(T); }, Store{dh, N, true});
    ar.used = mark;
  } else {
    for (int64_t i = 0; i < T; ++i)
      for (int64_t n = 0; n < N; ++n) hg.dCh[(s.s0 + i) * N + n] = 0.0f;
    for (int64_t q = 0; q < P * N; ++q) dh[q] = 0.0f;
  }
  // cs = cumsum(dt A): da = reverse cumsum of dcs
  dcs[T - 1] += dcl;
  float acc = 0.0f, dAh = 0.0f;
  for (int64_t j = T - 1; j >= 0; --j) {
    acc += dcs[j];
    ddt[j] += Ah * acc;
    dAh += sc.dt[j] * acc;
  }
  a.dA_part[s.b * g.H + s.h] += dAh;
  for (int64_t j = 0; j < T; ++j) {
    a.ddtv[(s.b * g.L + tg + j) * g.H + s.h] = ddt[j];
    std::memcpy(a.dx + ((s.b * g.L + tg + j) * g.H + s.h) * P, dxs + j * P, P * 4);
  }
}

size_t seg_bwd_scratch_bytes(const Geo& g) {
  const int64_t Q = g.Q, P = g.P, N = g.N, Qn = rup(Q, NR) + NR, Qm = rup(Q, MR) + MR;
  const int64_t persistent = 2 * Q * P + Qm * Qn + Qm * Q + 16 * Qn;  // + the segment's scalars
  const int64_t ystage = Q * P + rup(P, MR) * (N + Q) + Qn * (N + Q) + 5 * Qn;
  const int64_t stages = Qm * P + Qn * P + Qn + 2 * Qn + rup(P, NR) * Q + Q * P + Qm * N + rup(P, NR) * N +
                         Qm * P + rup(N, NR) * P + Q * N + Qm * P + rup(N, NR) * P + rup(P, MR) * Q +
                         rup(N, NR) * Q;
  return static_cast<size_t>(persistent + ystage + stages + 64 * 40) * 4;
}

// Sums each group's heads into its first head's rows, in head order (a fixed order, whatever
// the threads): dCB (the C.B^T gradient), dCh and dBh. Items are (batch, group, 16 rows).
int sum_heads(const SsdArgs& a, const Geo& g, float* dCB, float* dCh, float* dBh, int64_t c) {
  if (g.hpg == 1) return 0;
  const int64_t Tc = imin(g.Q, g.L - c * g.Q), nb = cdiv(Tc, 16), N = g.N;
  return run_items(a, g.b * g.G * nb, 64, [&](int64_t item, Arena&) {
    const int64_t q = item % nb, bg = item / nb, b = bg / g.G, h0 = (bg % g.G) * g.hpg;
    auto add_rows = [&](float* base, int64_t ld, int64_t width, bool upper) {
      for (int64_t j = q * 16; j < imin(Tc, q * 16 + 16); ++j) {
        float* dst = base + ((b * g.H + h0) * g.Q + j) * ld;
        for (int64_t h = h0 + 1; h < h0 + g.hpg; ++h) {
          const float* src = base + ((b * g.H + h) * g.Q + j) * ld;
          int64_t i = upper ? j : 0;  // dCB: its rows from the diagonal on
          for (; i + W <= width; i += W) st(dst + i, ld_(dst + i) + ld_(src + i));
          for (; i < width; ++i) dst[i] += src[i];
        }
      }
    };
    add_rows(dCB, g.Qp, Tc, true);
    add_rows(dCh, N, N, false);
    add_rows(dBh, N, N, false);
  });
}

// Phase C for chunk c: item (b, grp, row panel) turns the group's summed gradients into
//   dC_i = dCh_i + sum_{j<=i} dCB_ji B_j,   dB_j = dBh_j + sum_{i>=j} dCB_ji C_i,
// the sums over i's (j's) own segment: dCB is 0 between segments (their link is the state), and
// the B and C rows of another sequence may hold a NaN or inf, which a product with 0 would carry in.
// A panel's rows are taken segment by segment.
int phase_c(const SsdArgs& a, const Geo& g, const GroupBufs& gb, const float* dCB, const float* dCh,
            const float* dBh, int64_t c) {
  const int64_t t0 = c * g.Q, Tc = imin(g.Q, g.L - t0), np = cdiv(Tc, MR), N = g.N;
  const size_t scratch = static_cast<size_t>(MR * Tc + MR * N + 64) * 4 + 256;
  return run_items(a, g.b * g.G * np, scratch, [&](int64_t item, Arena& ar) {
    const int64_t q = item % np, bg = item / np, b = bg / g.G, grp = bg % g.G;
    const GroupChunk gc = gb.at(g, bg);
    const int64_t hb = b * g.H + grp * g.hpg;  // the group's first head
    const int64_t sb = a.seg_offset[b * g.nc + c], se = a.seg_offset[b * g.nc + c + 1];
    const float* cb = dCB + hb * g.Q * g.Qp;
    float* Ap = ar.get(MR * Tc);
    float* tile = ar.get(MR * N);
    int64_t k_seg = sb;  // the segment of row i0
    for (int64_t i0 = q * MR; i0 < imin(q * MR + MR, Tc);) {
      while (k_seg + 1 < se && a.seg_start[k_seg + 1] <= i0) ++k_seg;
      const int64_t s0 = a.seg_start[k_seg], s1 = k_seg + 1 < se ? a.seg_start[k_seg + 1] : Tc;
      const int64_t m = imin(imin(q * MR + MR, Tc), s1) - i0;
      for (int which = 0; which < 2; ++which) {
        // dC: A(r, k=j) = dCB[j][i0+r], s0 <= j <= i0+r;  dB: A(r, k=i) = dCB[i0+r][i], i0+r <= i < s1
        const int64_t kb = which == 0 ? s0 : i0, ke = which == 0 ? i0 + m : s1;
        for (int64_t k = kb; k < ke; ++k)
          for (int r = 0; r < MR; ++r)
            Ap[(k - kb) * MR + r] = r >= m                ? 0.0f  // below the diagonal: zero (not stored)
                                    : which == 0 ? (k <= i0 + r ? cb[k * g.Qp + i0 + r] : 0.0f)
                                                 : (k >= i0 + r ? cb[(i0 + r) * g.Qp + k] : 0.0f);
        const float* Bp = (which == 0 ? gc.Bpack : gc.Cpack) + kb * NR;
        gemm(m, N, Ap, (ke - kb) * MR, Bp, g.Q * NR, [&](int64_t, int64_t) { return all_k(ke - kb); },
             Store{tile, N, false});
        const float* part = (which == 0 ? dCh : dBh) + (hb * g.Q + i0) * N;
        float* dst = which == 0 ? a.dC : a.dB;
        for (int64_t r = 0; r < m; ++r) {
          float* o = dst + ((b * g.L + t0 + i0 + r) * g.G + grp) * N;
          for (int64_t n = 0; n < N; ++n) o[n] = tile[r * N + n] + part[r * N + n];
        }
      }
      i0 += m;
    }
  });
}

// --- backward ------------------------------------------------------------------------------
// Chunks in reverse, carrying dh (the gradient of the state before the chunk that follows);
// the start states of a chunk's later segments are recomputed from its saved chunk state.
int ssd_bwd(const SsdArgs& a) {
  const Geo g(a);
  const int64_t PN = g.P * g.N, BH = g.b * g.H;
  int64_t max_segs = 1;
  for (int64_t q = 0; q < g.b * g.nc; ++q) max_segs = imax(max_segs, a.seg_offset[q + 1] - a.seg_offset[q]);
  GroupBufs gb;
  gb.per = GroupBufs::size(g);
  const size_t n_group = static_cast<size_t>(g.b * g.G * gb.per);
  const size_t n_dcb = static_cast<size_t>(BH * g.Q * g.Qp), n_rows = static_cast<size_t>(BH * g.Q * g.N);
  float* mem = static_cast<float*>(std::calloc(n_group + n_dcb + 2 * n_rows + BH * PN, 4));
  if (!mem) return 1;
  gb.mem = mem;
  float* dCB = mem + n_group;
  float* dCh = dCB + n_dcb;
  float* dBh = dCh + n_rows;
  float* dhs = dBh + n_rows;
  for (int64_t q = 0; q < BH * PN; ++q) dhs[q] = a.dfinal_states ? a.dfinal_states[q] : 0.0f;
  for (int64_t q = 0; q < BH; ++q) a.dA_part[q] = 0.0f;
  if (a.dD_part)
    for (int64_t q = 0; q < BH * g.P; ++q) a.dD_part[q] = 0.0f;
  const size_t per_worker = seg_bwd_scratch_bytes(g) + static_cast<size_t>(max_segs * PN + 64) * 4;
  int err = 0;
  for (int64_t c = g.nc - 1; c >= 0 && !err; --c) {
    err = phase_a(a, g, gb, c, true);
    if (err) break;
    const int64_t t0 = c * g.Q, Tc = imin(g.Q, g.L - t0);
    err = run_items(a, BH, per_worker, [&](int64_t item, Arena& ar) {
      const int64_t b = item / g.H, h = item % g.H, grp = h / g.hpg;
      const GroupChunk gc = gb.at(g, b * g.G + grp);
      const int64_t sb = a.seg_offset[b * g.nc + c], se = a.seg_offset[b * g.nc + c + 1], ns = se - sb;
      float* hist = ar.get(imax(ns - 1, 1) * PN);  // end states of all segments but the last
      const size_t mark = ar.used;
      auto seg = [&](int64_t k) {
        const int64_t s0 = a.seg_start[sb + k], s1 = k + 1 < ns ? a.seg_start[sb + k + 1] : Tc;
        const float* hp = k == 0 ? a.chunk_states_in + ((b * g.nc + c) * g.H + h) * PN : hist + (k - 1) * PN;
        return Seg{b, h, grp, t0, s0, s1 - s0, a.seg_reset[sb + k] ? nullptr : hp};
      };
      for (int64_t k = 0; k + 1 < ns; ++k) {
        ar.used = mark;
        const Seg s = seg(k);
        const SegScalars sc = seg_scalars(a, g, s, ar);
        seg_state(a, g, s, sc, gc, hist + k * PN, ar);
      }
      float* dh = dhs + item * PN;
      const HeadGrads hg{dCB + item * g.Q * g.Qp, dCh + item * g.Q * g.N, dBh + item * g.Q * g.N};
      for (int64_t k = ns - 1; k >= 0; --k) {
        ar.used = mark;
        const Seg s = seg(k);
        if (a.dvarlen_states) {
          int64_t lo, hi;
          varlen_range(a, t0 + s.s0 + s.T - 1, lo, hi);
          for (int64_t i = lo; i < hi; ++i)
            for (int64_t q = 0; q < PN; ++q) dh[q] += a.dvarlen_states[(i * g.H + h) * PN + q];
        }
        const SegScalars sc = seg_scalars(a, g, s, ar);
        seg_bwd(a, g, s, sc, gc, dh, hg, Tc, ar);
      }
      if (c == 0) std::memcpy(a.dinitial_states + item * PN, dh, PN * 4);
    });
    if (!err) err = sum_heads(a, g, dCB, dCh, dBh, c);
    if (!err) err = phase_c(a, g, gb, dCB, dCh, dBh, c);
  }
  std::free(mem);
  return err;
}

}  // namespace

int SSD_CAT(ssd_fwd_, SSD_ISA)(const SsdArgs& a) { return ssd_fwd(a); }
int SSD_CAT(ssd_bwd_, SSD_ISA)(const SsdArgs& a) { return ssd_bwd(a); }

}  // namespace ssmops_cpu
