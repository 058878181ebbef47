// The selective scan for complex A (mamba_ssm's complex mode), forward and backward.
//
// Scalar code, one (batch, channel) row at a time and one 2048-step chunk at a time: the
// row's inputs for the chunk are first converted to float32 / complex scratch (so the loops
// over time and state see no dtypes), then the recurrence runs over the chunk. The layouts
// of the complex tensors are in scan_params.h. The real scan's kernels (scan_kernel.h)
// vectorise over channels; this one is plain C++ built with baseline flags, so it may use libm.
//
//   h_t = exp(dt_t A) h_{t-1} + dt_t u_t B_t ;   y_t = 2 Re(sum_n h_t[n] C_t[n]) + D u_t
//
// Gradients of complex values are PyTorch's (dL/d(re) + i dL/d(im) for a real loss L): the
// gradient of a factor of a product is the product's gradient times the conjugate of the
// other factor.
#include <cmath>
#include <cstdint>
#include <cstdlib>

#include "scan_dtypes.h"
#include "scan_params.h"

namespace ssmops_cpu {
namespace {

struct cf {
  float re, im;
};
inline cf operator+(cf a, cf b) { return {a.re + b.re, a.im + b.im}; }
inline cf& operator+=(cf& a, cf b) { return a = a + b; }
inline cf operator*(cf a, cf b) { return {a.re * b.re - a.im * b.im, a.re * b.im + a.im * b.re}; }
inline cf operator*(float s, cf a) { return {s * a.re, s * a.im}; }
inline cf conj(cf a) { return {a.re, -a.im}; }
inline cf cexp(cf a) {
  const float m = std::exp(a.re);
  return {m * std::cos(a.im), m * std::sin(a.im)};
}
// element i of a complex tensor seen as (re, im) float pairs
inline cf ldc(const float* p, int64_t i) { return {p[2 * i], p[2 * i + 1]}; }
inline void stc(float* p, int64_t i, cf v) {
  p[2 * i] = v.re;
  p[2 * i + 1] = v.im;
}
inline void addc(float* p, int64_t i, cf v) { stc(p, i, ldc(p, i) + v); }

// softplus as torch computes it (beta 1, threshold 20)
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }
inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }
inline int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
inline int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }
inline int64_t num_chunks(int64_t seqlen) { return (seqlen + kChunkLen - 1) / kChunkLen; }

struct Row {  // one (batch, channel) row
  int64_t b, d, g, r;  // g: its B/C group; r = b * dim + d
};

inline Row make_row(const ScanArgs& a, int64_t r) {
  const int64_t b = r / a.dim, d = r % a.dim;
  return {b, d, d / (a.dim / a.groups), r};
}

// Per-thread scratch for one row's chunk of T <= clen steps.
struct Scratch {
  float *u, *dtraw, *dt, *z, *dout, *y, *du, *ddt, *dz;  // (clen)
  cf *A, *B, *C;                                         // A: (N); B, C: (clen, N) when variable, else (N)
  cf *H, *E;          // H: the states, (clen + 1, N) from the chunk's start (forward: (1, N)); E: decays
  cf *carry, *dA, *dBc, *dCc;  // (N): the backward's state gradient and per-row sums
  void* mem = nullptr;

  bool alloc(int64_t N, int64_t clen, bool backward) {
    float** by_t[] = {&u, &dtraw, &dt, &z, &dout, &y, &du, &ddt, &dz};
    const int64_t cfs = N + 2 * clen * N + (backward ? (clen + 1) * N + clen * N + 4 * N : N);
    mem = std::malloc(9 * clen * sizeof(float) + cfs * sizeof(cf));
    if (!mem) return false;
    float* p = static_cast<float*>(mem);
    for (float** f : by_t) *f = p, p += clen;
    cf* q = reinterpret_cast<cf*>(p);
    auto take = [&q](int64_t n) {
      cf* r = q;
      q += n;
      return r;
    };
    A = take(N);
    B = take(clen * N);
    C = take(clen * N);
    H = take(backward ? (clen + 1) * N : N);
    if (backward) {
      E = take(clen * N);
      carry = take(N), dA = take(N), dBc = take(N), dCc = take(N);
    }
    return true;
  }
  ~Scratch() { std::free(mem); }
};

// A and a constant B/C of the row's channel.
void load_params(const ScanArgs& a, const Row& row, Scratch& s) {
  const int64_t N = a.dstate;
  for (int64_t n = 0; n < N; ++n) {
    s.A[n] = ldc(a.A, row.d * N + n);
    if (!a.B_variable) s.B[n] = ldc(static_cast<const float*>(a.B), row.d * N + n);
    if (!a.C_variable) s.C[n] = ldc(static_cast<const float*>(a.C), row.d * N + n);
  }
}

// dst[t * N + n] = step t0 + t of a variable B/C, (batch, groups, N, 2 * seqlen) real pairs.
void load_pairs(cf* dst, const void* M, int dtype, const ScanArgs& a, const Row& row, int64_t t0, int64_t T) {
  const int64_t N = a.dstate;
  SSM_DTYPE_SWITCH(dtype, DT, {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t base = ((row.b * a.groups + row.g) * N + n) * 2 * a.seqlen + 2 * t0;
      for (int64_t t = 0; t < T; ++t) dst[t * N + n] = {get<DT>(M, base + 2 * t), get<DT>(M, base + 2 * t + 1)};
    }
  });
}

// The row's steps [t0, t0 + T): u, dt (after bias and softplus), z, dout, variable B/C.
void load_chunk(const ScanArgs& a, const Row& row, Scratch& s, int64_t t0, int64_t T, bool backward) {
  const int64_t base = row.r * a.seqlen + t0;
  const float bias = a.delta_bias ? a.delta_bias[row.d] : 0.0f;
  SSM_DTYPE_SWITCH(a.dtype_in, DT, {
    for (int64_t t = 0; t < T; ++t) {
      s.u[t] = get<DT>(a.u, base + t);
      s.dtraw[t] = get<DT>(a.delta, base + t) + bias;
      s.dt[t] = a.delta_softplus ? softplus(s.dtraw[t]) : s.dtraw[t];
      if (a.z) s.z[t] = get<DT>(a.z, base + t);
      if (backward) s.dout[t] = get<DT>(a.dout, base + t);
    }
  });
  if (a.B_variable) load_pairs(s.B, a.B, a.dtype_B, a, row, t0, T);
  if (a.C_variable) load_pairs(s.C, a.C, a.dtype_C, a, row, t0, T);
}

void store_row(void* dst, int dtype, const float* src, int64_t base, int64_t T) {
  SSM_DTYPE_SWITCH(dtype, DT, {
    for (int64_t t = 0; t < T; ++t) put<DT>(dst, base + t, src[t]);
  });
}

// The state at the start of chunk c: the saved one, or the initial state.
cf chunk_start_state(const ScanArgs& a, const Row& row, int64_t c, int64_t n) {
  const int64_t N = a.dstate;
  if (c > 0) return ldc(a.scan_intermediates, (row.r * num_chunks(a.seqlen) + c - 1) * 2 * N + 2 * n + 1);
  return a.initial_state ? ldc(a.initial_state, row.r * N + n) : cf{0.0f, 0.0f};
}

// Runs the recurrence over T steps from the states H[0..N), writing y (before the gate);
// with E, keeps every state (H[(t + 1) * N + n]) and decay (E[t * N + n]), else only the last.
void scan_chunk(const ScanArgs& a, const Row& row, Scratch& s, int64_t T, cf* E) {
  const int64_t N = a.dstate;
  const float D = a.D ? a.D[row.d] : 0.0f;
  for (int64_t t = 0; t < T; ++t) {
    const float dt = s.dt[t], dtu = dt * s.u[t];
    const cf* Bt = a.B_variable ? s.B + t * N : s.B;
    const cf* Ct = a.C_variable ? s.C + t * N : s.C;
    const cf* prev = E ? s.H + t * N : s.H;
    cf* next = E ? s.H + (t + 1) * N : s.H;
    cf acc{0.0f, 0.0f};
    for (int64_t n = 0; n < N; ++n) {
      const cf e = cexp(dt * s.A[n]);
      next[n] = e * prev[n] + dtu * Bt[n];
      acc += next[n] * Ct[n];
      if (E) E[t * N + n] = e;
    }
    s.y[t] = 2.0f * acc.re + D * s.u[t];
  }
}

// --- forward --------------------------------------------------------------------------

void fwd_row(const ScanArgs& a, const Row& row, Scratch& s) {
  const int64_t N = a.dstate, L = a.seqlen, nchunks = num_chunks(L);
  load_params(a, row, s);
  for (int64_t n = 0; n < N; ++n) s.H[n] = chunk_start_state(a, row, 0, n);
  float dtsum = 0.0f;
  for (int64_t c = 0; c < nchunks; ++c) {
    const int64_t t0 = c * kChunkLen, T = imin(kChunkLen, L - t0);
    load_chunk(a, row, s, t0, T, false);
    scan_chunk(a, row, s, T, nullptr);
    store_row(a.out, a.dtype_in, s.y, row.r * L + t0, T);
    if (a.z) {
      for (int64_t t = 0; t < T; ++t) s.dz[t] = s.y[t] * s.z[t] * sigmoid(s.z[t]);
      store_row(a.out_z, a.dtype_in, s.dz, row.r * L + t0, T);
    }
    for (int64_t t = 0; t < T; ++t) dtsum += s.dt[t];
    // mamba_ssm's layout: cumulative decay since t=0 (even) and state (odd) at the chunk's end
    float* x = a.scan_intermediates + (row.r * nchunks + c) * 2 * N * 2;
    for (int64_t n = 0; n < N; ++n) {
      stc(x, 2 * n, cexp(dtsum * s.A[n]));
      stc(x, 2 * n + 1, s.H[n]);
    }
  }
  for (int64_t n = 0; n < N; ++n) stc(a.last_state, row.r * N + n, s.H[n]);
}

int fwd(const ScanArgs& a) {
  int failed = 0;
  par(a, a.batch * a.dim, [&](int64_t begin, int64_t end) {
    Scratch s;
    if (!s.alloc(a.dstate, imin(a.seqlen, kChunkLen), false)) {
      __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
      return;
    }
    for (int64_t r = begin; r < end; ++r) fwd_row(a, make_row(a, r), s);
  });
  return failed;
}

// --- backward -------------------------------------------------------------------------

struct BwdShared {
  int64_t P;                           // slots per (batch, group) for the variable dB/dC sums
  float* carry;                        // (batch, dim, N) complex: gradient reaching the chunk's last state
  float *dA_rows, *dB_rows, *dC_rows;  // (batch, dim, N) complex per-row partials
  float *dD_rows, *dbias_rows;         // (batch, dim)
  float *slotB, *slotC;                // (batch * groups * P, chunk, N) complex partial sums
};

// One row's backward over chunk c: recompute the chunk's states and decays from its start,
// then walk it in reverse. g_t = 2 dy_t conj(C_t) + conj(exp(dt_{t+1} A)) g_{t+1} is the
// gradient reaching h_t.
void bwd_row_chunk(const ScanArgs& a, const BwdShared& sh, const Row& row, Scratch& s, int64_t c,
                   float* slotB, float* slotC) {
  const int64_t N = a.dstate, L = a.seqlen;
  const int64_t t0 = c * kChunkLen, T = imin(kChunkLen, L - t0);
  load_params(a, row, s);
  load_chunk(a, row, s, t0, T, true);
  for (int64_t n = 0; n < N; ++n) {
    s.H[n] = chunk_start_state(a, row, c, n);
    s.carry[n] = ldc(sh.carry, row.r * N + n);
    s.dA[n] = s.dBc[n] = s.dCc[n] = cf{0.0f, 0.0f};
  }
  scan_chunk(a, row, s, T, s.E);
  const float D = a.D ? a.D[row.d] : 0.0f;
  float dD = 0.0f, dbias = 0.0f;
  for (int64_t t = T - 1; t >= 0; --t) {
    float dy = s.dout[t];
    if (a.z) {
      const float sig = sigmoid(s.z[t]), silu = s.z[t] * sig;
      s.dz[t] = dy * s.y[t] * (sig + silu * (1.0f - sig));
      dy *= silu;
    }
    const float dt = s.dt[t], u = s.u[t], dtu = dt * u, dys = 2.0f * dy;  // dys: d loss / d <h_t, C_t>
    const cf* Bt = a.B_variable ? s.B + t * N : s.B;
    const cf* Ct = a.C_variable ? s.C + t * N : s.C;
    float ddt = 0.0f, ddtu = 0.0f;  // d loss / d dt through the decay, d loss / d (dt u)
    for (int64_t n = 0; n < N; ++n) {
      const cf g = s.carry[n] + dys * conj(Ct[n]);
      const cf dC = dys * conj(s.H[(t + 1) * N + n]), dB = dtu * g;
      if (a.C_variable)
        addc(slotC, t * N + n, dC);
      else
        s.dCc[n] += dC;
      if (a.B_variable)
        addc(slotB, t * N + n, dB);
      else
        s.dBc[n] += dB;
      ddtu += (conj(Bt[n]) * g).re;
      const cf decay_c = conj(s.E[t * N + n]);
      const cf q = g * decay_c * conj(s.H[t * N + n]);  // d loss / d (dt A)
      s.dA[n] += dt * q;
      ddt += (q * conj(s.A[n])).re;
      s.carry[n] = decay_c * g;
    }
    ddt += ddtu * u;
    s.du[t] = ddtu * dt + D * dy;
    dD += dy * u;
    if (a.delta_softplus) ddt *= sigmoid(s.dtraw[t]);
    s.ddt[t] = ddt;
    dbias += ddt;
  }
  const int64_t base = row.r * L + t0;
  store_row(a.du, a.dtype_in, s.du, base, T);
  store_row(a.ddelta, a.dtype_in, s.ddt, base, T);
  if (a.z) store_row(a.dz, a.dtype_in, s.dz, base, T);
  // Per-row results: each row is walked by one thread, chunk after chunk in reverse order.
  for (int64_t n = 0; n < N; ++n) {
    const int64_t i = row.r * N + n;
    stc(sh.carry, i, s.carry[n]);
    addc(sh.dA_rows, i, s.dA[n]);
    if (!a.B_variable) addc(sh.dB_rows, i, s.dBc[n]);
    if (!a.C_variable) addc(sh.dC_rows, i, s.dCc[n]);
  }
  sh.dD_rows[row.r] += dD;
  sh.dbias_rows[row.r] += dbias;
}

// dM[b, g, n, 2 t + (0, 1)] = (re, im) of the sum over slots p (in order) of slot[b, g, p][t - t0][n].
void reduce_slots(const ScanArgs& a, const BwdShared& sh, const float* slots, void* dM, int dtype, int64_t t0,
                  int64_t t1) {
  const int64_t N = a.dstate, clen = imin(a.seqlen, kChunkLen);
  par(a, a.batch * a.groups * N, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t bg = r / N, n = r % N;
      SSM_DTYPE_SWITCH(dtype, DT, {
        for (int64_t t = t0; t < t1; ++t) {
          cf acc{0.0f, 0.0f};
          for (int64_t p = 0; p < sh.P; ++p) acc += ldc(slots, ((bg * sh.P + p) * clen + (t - t0)) * N + n);
          put<DT>(dM, r * 2 * a.seqlen + 2 * t, acc.re);
          put<DT>(dM, r * 2 * a.seqlen + 2 * t + 1, acc.im);
        }
      });
    }
  });
}

int bwd(const ScanArgs& a) {
  const int64_t N = a.dstate, L = a.seqlen, nchunks = num_chunks(L), clen = imin(L, kChunkLen);
  const int64_t dg = a.dim / a.groups, BG = a.batch * a.groups, rows = a.batch * a.dim;
  const bool VB = a.B_variable, VC = a.C_variable;
  BwdShared sh;
  // Slots depend on the shapes only (never on the thread count), so every sum is formed in
  // the same order on every run; they cost (B and C variable) 2 * clen * N complex each.
  const int64_t per_slot = clen * N * 2 * (VB + VC) * (int64_t)sizeof(float);
  sh.P = imax(1, imin(imin(dg, (64 + BG - 1) / BG), (int64_t(64) << 20) / imax(1, BG * per_slot)));
  const int64_t n_carry = a.dinitial_state ? 0 : 2 * rows * N;
  const int64_t n_slot = BG * sh.P * clen * N * 2;
  const int64_t total = n_carry + 3 * 2 * rows * N + 2 * rows + (VB ? n_slot : 0) + (VC ? n_slot : 0);
  float* mem = static_cast<float*>(std::calloc(total, sizeof(float)));
  if (!mem) return 1;
  float* p = mem;
  sh.carry = a.dinitial_state ? a.dinitial_state : p;
  p += n_carry;
  sh.dA_rows = p, p += 2 * rows * N;
  sh.dB_rows = p, p += 2 * rows * N;
  sh.dC_rows = p, p += 2 * rows * N;
  sh.dD_rows = p, p += rows;
  sh.dbias_rows = p, p += rows;
  sh.slotB = VB ? p : nullptr, p += VB ? n_slot : 0;
  sh.slotC = VC ? p : nullptr;
  for (int64_t i = 0; i < 2 * rows * N; ++i) sh.carry[i] = a.dlast_state ? a.dlast_state[i] : 0.0f;

  int failed = 0;
  for (int64_t c = nchunks - 1; c >= 0 && !failed; --c) {
    const int64_t t0 = c * kChunkLen, t1 = imin(L, t0 + kChunkLen);
    par(a, BG * sh.P, [&](int64_t begin, int64_t end) {
      Scratch s;
      if (!s.alloc(N, clen, true)) {
        __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
        return;
      }
      for (int64_t i = begin; i < end; ++i) {
        const int64_t bg = i / sh.P, slot = i % sh.P;
        float* sB = VB ? sh.slotB + i * clen * N * 2 : nullptr;
        float* sC = VC ? sh.slotC + i * clen * N * 2 : nullptr;
        if (sB) __builtin_memset(sB, 0, (t1 - t0) * N * 2 * sizeof(float));
        if (sC) __builtin_memset(sC, 0, (t1 - t0) * N * 2 * sizeof(float));
        const int64_t b = bg / a.groups, g = bg % a.groups;
        for (int64_t j = slot * dg / sh.P; j < (slot + 1) * dg / sh.P; ++j)
          bwd_row_chunk(a, sh, make_row(a, b * a.dim + g * dg + j), s, c, sB, sC);
      }
    });
    if (failed) break;
    if (VB) reduce_slots(a, sh, sh.slotB, a.dB, a.dtype_B, t0, t1);
    if (VC) reduce_slots(a, sh, sh.slotC, a.dC, a.dtype_C, t0, t1);
  }
  if (!failed) {
    // Sums over the batch, in batch order.
    for (int64_t d = 0; d < a.dim; ++d) {
      for (int64_t n = 0; n < N; ++n) {
        cf sA{0.0f, 0.0f}, sB{0.0f, 0.0f}, sC{0.0f, 0.0f};
        for (int64_t b = 0; b < a.batch; ++b) {
          const int64_t i = (b * a.dim + d) * N + n;
          sA += ldc(sh.dA_rows, i);
          sB += ldc(sh.dB_rows, i);
          sC += ldc(sh.dC_rows, i);
        }
        stc(a.dA, d * N + n, sA);
        if (!VB) stc(static_cast<float*>(a.dB), d * N + n, sB);
        if (!VC) stc(static_cast<float*>(a.dC), d * N + n, sC);
      }
      reduce_channel_sums(a, sh.dD_rows, sh.dbias_rows, d);
    }
  }
  std::free(mem);
  return failed;
}

}  // namespace

int scan_fwd_complex(const ScanArgs& a) { return fwd(a); }
int scan_bwd_complex(const ScanArgs& a) { return bwd(a); }

}  // namespace ssmops_cpu
