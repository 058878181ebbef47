// The SSD chunked scan's CPU operators (Mamba-2): argument checks, the dt pre-processing and
// its gradient, the split of chunks into segments, and the CPU registrations, on LibTorch's
// stable ABI only. The kernels are in ssd_kernel.h, compiled once per instruction set; the
// schemas are in ../library.cpp (as ssmops/ops/ssd/schema.py declares them).
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/isa.h"
#include "ssd_params.h"

namespace ssmops_cpu {
namespace {

const std::vector<ST> kFloatDtypes{ST::Float, ST::Half, ST::BFloat16};

struct SsdDims {
  int64_t batch, seqlen, nheads, headdim, ngroups, dstate, nseq, chunk, nchunks;
};

std::string list_str(const std::vector<int64_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

// The rules of ssmops/ops/ssd/checks.py (check_ssd_inputs and check_sequence_values), with
// its words; the value checks read seq_idx and cu_seqlens, so bad values never reach a kernel.
SsdDims check_inputs(const char* op, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
                     const Tensor& C, const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
                     const OptTensor& initial_states, const OptTensor& seq_idx, const OptTensor& cu_seqlens,
                     int64_t chunk_size, const std::vector<double>& dt_limit) {
  STD_TORCH_CHECK(x.dim() == 4, op, ": x must have shape (batch, seqlen, nheads, headdim), got ", shape_of(x));
  check_dtype_of(op, "x", x, kFloatDtypes);
  STD_TORCH_CHECK(x.is_cpu(), op, ": x must be a CPU tensor");
  SsdDims d{x.size(0), x.size(1), x.size(2), x.size(3), 0, 0, 0, chunk_size, 0};
  STD_TORCH_CHECK(d.seqlen >= 1, op, ": x must have seqlen >= 1, got shape ", shape_of(x));
  STD_TORCH_CHECK(chunk_size >= 1, op, ": chunk_size must be an int >= 1, got ", chunk_size);
  const bool limit_ok = dt_limit.empty() || (dt_limit.size() == 2 && dt_limit[0] <= dt_limit[1]);
  if (!limit_ok) {
    std::string lim = "(";
    for (size_t i = 0; i < dt_limit.size(); ++i) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%s%g", i ? ", " : "", dt_limit[i]);
      lim += buf;
    }
    STD_TORCH_CHECK(false, op, ": dt_limit must be (low, high) with low <= high, got ", lim,
                    dt_limit.size() == 1 ? ",)" : ")");
  }
  d.nchunks = (d.seqlen + chunk_size - 1) / chunk_size;
  check_tensor_of(op, "dt", dt, kFloatDtypes, {d.batch, d.seqlen, d.nheads}, "x");
  check_tensor_of(op, "A", A, {ST::Float}, {d.nheads}, "x");
  STD_TORCH_CHECK(B.dim() == 4 && B.size(0) == d.batch && B.size(1) == d.seqlen, op,
                  ": B must have shape (batch, seqlen, ngroups, dstate) with (batch, seqlen)=(", d.batch, ", ",
                  d.seqlen, "), got ", shape_of(B));
  d.ngroups = B.size(2);
  d.dstate = B.size(3);
  STD_TORCH_CHECK(d.ngroups >= 1 && d.nheads % d.ngroups == 0, op, ": B has ngroups=", d.ngroups,
                  ", which does not divide nheads=", d.nheads);
  STD_TORCH_CHECK(d.dstate >= 1, op, ": B must have dstate >= 1, got shape ", shape_of(B));
  const std::vector<int64_t> bc_shape{d.batch, d.seqlen, d.ngroups, d.dstate};
  check_tensor_of(op, "B", B, kFloatDtypes, bc_shape, "x");
  check_tensor_of(op, "C", C, kFloatDtypes, bc_shape, "B");
  if (D)
    check_tensor_of(op, "D", *D, kFloatDtypes,
                    D->dim() == 2 ? std::vector<int64_t>{d.nheads, d.headdim} : std::vector<int64_t>{d.nheads}, "x");
  if (z) check_tensor_of(op, "z", *z, kFloatDtypes, {d.batch, d.seqlen, d.nheads, d.headdim}, "x");
  if (dt_bias) check_tensor_of(op, "dt_bias", *dt_bias, kFloatDtypes, {d.nheads}, "x");
  if (initial_states)
    check_tensor_of(op, "initial_states", *initial_states, kFloatDtypes, {d.batch, d.nheads, d.headdim, d.dstate},
                    "x and B");
  if (seq_idx) check_tensor_of(op, "seq_idx", *seq_idx, {ST::Int}, {d.batch, d.seqlen}, "x");
  if (cu_seqlens) {
    STD_TORCH_CHECK(seq_idx.has_value(), op,
                    ": cu_seqlens needs seq_idx too (the sequence of each token), got seq_idx=None");
    STD_TORCH_CHECK(d.batch == 1, op, ": cu_seqlens needs x with batch 1 (the sequences packed along seqlen), got batch=",
                    d.batch);
    STD_TORCH_CHECK(cu_seqlens->dim() == 1 && cu_seqlens->size(0) >= 2, op,
                    ": cu_seqlens must have shape (nseq + 1,) with nseq >= 1, got ", shape_of(*cu_seqlens));
    check_dtype_of(op, "cu_seqlens", *cu_seqlens, {ST::Int, ST::Long});
    STD_TORCH_CHECK(cu_seqlens->is_cpu(), op, ": cu_seqlens must be on cpu like x, got another device");
    d.nseq = cu_seqlens->size(0) - 1;
  }
  // values
  if (seq_idx && d.seqlen > 1) {
    const Tensor s = contig(*seq_idx);
    const int32_t* p = s.const_data_ptr<int32_t>();
    for (int64_t b = 0; b < d.batch; ++b)
      for (int64_t t = 1; t < d.seqlen; ++t)
        STD_TORCH_CHECK(p[b * d.seqlen + t] >= p[b * d.seqlen + t - 1], op,
                        ": seq_idx must be non-decreasing along seqlen (sequences packed one after another)");
  }
  return d;
}

// cu_seqlens as int64, after checking it rises from 0 to seqlen.
std::vector<int64_t> read_cu_seqlens(const char* op, const Tensor& cu, int64_t seqlen) {
  const Tensor c = contig(cu);
  std::vector<int64_t> v(c.size(0));
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = c.scalar_type() == ST::Int ? c.const_data_ptr<int32_t>()[i] : c.const_data_ptr<int64_t>()[i];
  bool ok = v.front() == 0 && v.back() == seqlen;
  for (size_t i = 1; i < v.size(); ++i) ok = ok && v[i] >= v[i - 1];
  STD_TORCH_CHECK(ok, op, ": cu_seqlens must rise from 0 to seqlen=", seqlen, ", got ", list_str(v));
  return v;
}

// --- dt: bias, softplus, clamp (and the chain rule back through them) --------------------

float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

// Where dt_limit leaves v as it is. A bound of float32's largest magnitude is an infinite one (the
// operators' convention: no infinity in an exported graph), so it binds no infinite v.
bool unclamped(float v, float lo, float hi) {
  constexpr float kMax = std::numeric_limits<float>::max();
  return (v >= lo || lo == -kMax) && (v <= hi || hi == kMax);
}

// dtv = clamp(softplus(dt + bias)) in float32, (batch, seqlen, nheads).
Tensor process_dt(const Tensor& dt32, const OptTensor& bias32, bool softplus_on, const std::vector<double>& lim,
                  const SsdDims& d) {
  Tensor out = empty_like_shape(dt32, {d.batch, d.seqlen, d.nheads}, ST::Float);
  const float* p = dt32.const_data_ptr<float>();
  const float* bias = bias32 ? bias32->const_data_ptr<float>() : nullptr;
  float* o = out.mutable_data_ptr<float>();
  const int64_t n = d.batch * d.seqlen * d.nheads;
  for (int64_t i = 0; i < n; ++i) {
    float v = p[i] + (bias ? bias[i % d.nheads] : 0.0f);
    if (softplus_on) v = softplus(v);
    if (lim.size() == 2) {
      const float lo = static_cast<float>(lim[0]), hi = static_cast<float>(lim[1]);
      if (!unclamped(v, lo, hi) && !std::isnan(v)) v = v < lo ? lo : hi;
    }
    o[i] = v;
  }
  return out;
}

// --- segments ----------------------------------------------------------------------------

// Every chunk is cut where seq_idx changes and after the last token of each cu_seqlens
// sequence; a segment restarts from zero where seq_idx changes (the initial state counts as
// sequence 0).
struct Segments {
  std::vector<int64_t> offset, start;
  std::vector<uint8_t> reset;
};

Segments make_segments(const SsdDims& d, const OptTensor& seq_idx, const std::vector<int64_t>& varlen_end) {
  Segments s;
  std::vector<uint8_t> cut_after(d.seqlen, 0);
  for (int64_t e : varlen_end)
    if (e >= 0) cut_after[e] = 1;
  const Tensor sq = seq_idx ? contig(*seq_idx) : Tensor();
  const int32_t* q = seq_idx ? sq.const_data_ptr<int32_t>() : nullptr;
  for (int64_t b = 0; b < d.batch; ++b) {
    const int32_t* row = q ? q + b * d.seqlen : nullptr;
    for (int64_t c = 0; c < d.nchunks; ++c) {
      s.offset.push_back(static_cast<int64_t>(s.start.size()));
      const int64_t t0 = c * d.chunk, t1 = std::min(d.seqlen, t0 + d.chunk);
      for (int64_t t = t0; t < t1; ++t) {
        const bool changes = row && (t == 0 ? row[0] != 0 : row[t] != row[t - 1]);
        if (t == t0 || changes || cut_after[t - 1]) {
          s.start.push_back(t - t0);
          s.reset.push_back(changes ? 1 : 0);
        }
      }
    }
  }
  s.offset.push_back(static_cast<int64_t>(s.start.size()));
  return s;
}

// --- glue --------------------------------------------------------------------------------

void parallel_for_torch(int64_t n, SsdRangeFn fn, void* ctx) {
  torch::stable::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { fn(ctx, begin, end); });
}

using Kernel = int (*)(const SsdArgs&);
Kernel pick(bool bwd) {
#if defined(__x86_64__)
  if (selected_isa() != Isa::kGeneric) return bwd ? ssd_bwd_avx2 : ssd_fwd_avx2;
#endif
  return bwd ? ssd_bwd_generic : ssd_fwd_generic;
}

const float* fptr(const OptTensor& t) { return t ? t->const_data_ptr<float>() : nullptr; }
OptTensor f32(const OptTensor& t) { return t ? OptTensor(as_f32(*t)) : std::nullopt; }

std::vector<int64_t> shape_vec(const Tensor& t) {
  std::vector<int64_t> s;
  for (int64_t i = 0; i < t.dim(); ++i) s.push_back(t.size(i));
  return s;
}

// Inputs as float32 contiguous tensors, kept alive while the kernel runs.
struct Prepared {
  SsdDims d;
  Tensor x, dtv, A, B, C;
  OptTensor D, z, init;
  std::vector<int64_t> varlen_end;
  Segments segs;
  SsdArgs args{};
};

void prepare(Prepared& p, const char* op, const Tensor& x, const Tensor& dt, const Tensor& A, const Tensor& B,
             const Tensor& C, const OptTensor& D, const OptTensor& z, const OptTensor& dt_bias,
             const OptTensor& initial_states, const OptTensor& seq_idx, const OptTensor& cu_seqlens,
             int64_t chunk_size, bool dt_softplus, const std::vector<double>& dt_limit) {
  p.d = check_inputs(op, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_limit);
  if (cu_seqlens) {
    const std::vector<int64_t> cu = read_cu_seqlens(op, *cu_seqlens, p.d.seqlen);
    for (size_t i = 1; i < cu.size(); ++i) p.varlen_end.push_back(cu[i] - 1);
  }
  p.x = as_f32(x);
  p.dtv = process_dt(as_f32(dt), f32(dt_bias), dt_softplus, dt_limit, p.d);
  p.A = contig(A);
  p.B = as_f32(B);
  p.C = as_f32(C);
  p.D = f32(D);
  p.z = f32(z);
  p.init = f32(initial_states);
  p.segs = make_segments(p.d, seq_idx, p.varlen_end);
  SsdArgs& a = p.args;
  a.batch = p.d.batch;
  a.seqlen = p.d.seqlen;
  a.nheads = p.d.nheads;
  a.headdim = p.d.headdim;
  a.ngroups = p.d.ngroups;
  a.dstate = p.d.dstate;
  a.chunk = p.d.chunk;
  a.nchunks = p.d.nchunks;
  a.D_per_channel = D && D->dim() == 2;
  a.x = p.x.const_data_ptr<float>();
  a.dtv = p.dtv.const_data_ptr<float>();
  a.A = p.A.const_data_ptr<float>();
  a.B = p.B.const_data_ptr<float>();
  a.C = p.C.const_data_ptr<float>();
  a.D = fptr(p.D);
  a.z = fptr(p.z);
  a.initial_states = fptr(p.init);
  a.seg_offset = p.segs.offset.data();
  a.seg_start = p.segs.start.data();
  a.seg_reset = p.segs.reset.data();
  a.nseq = static_cast<int64_t>(p.varlen_end.size());
  a.varlen_end = p.varlen_end.data();
  a.parallel_for = parallel_for_torch;
  a.nthreads = static_cast<int64_t>(torch::stable::get_num_threads());
}

// A float32 result in `dtype`: itself, or a converted copy.
Tensor in_dtype(const Tensor& t, ST dtype) { return dtype == ST::Float ? t : torch::stable::to(t, dtype); }

// --- the operators -----------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> ssd_scan_fwd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C,
                                                                OptTensor D, OptTensor z, OptTensor dt_bias,
                                                                OptTensor initial_states, OptTensor seq_idx,
                                                                OptTensor cu_seqlens, int64_t chunk_size,
                                                                bool dt_softplus, std::vector<double> dt_limit,
                                                                bool keep_ungated) {
  Prepared p;
  prepare(p, "ssd_scan_fwd", x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size,
          dt_softplus, dt_limit);
  const SsdDims& d = p.d;
  const int64_t PN = d.headdim * d.dstate;
  Tensor out = empty_like_shape(x, {d.batch, d.seqlen, d.nheads, d.headdim}, ST::Float);
  Tensor final_states = empty_like_shape(x, {d.batch, d.nheads, d.headdim, d.dstate}, ST::Float);
  Tensor chunk_states = empty_like_shape(x, {d.batch, d.nchunks * d.nheads, d.headdim, d.dstate}, ST::Float);
  Tensor varlen_states = empty_like_shape(
      x, cu_seqlens ? std::vector<int64_t>{d.nseq, d.nheads, d.headdim, d.dstate} : std::vector<int64_t>{0},
      ST::Float);
  const bool keeps_ungated = z && keep_ungated;
  Tensor ungated = empty_like_shape(x, keeps_ungated ? shape_vec(x) : std::vector<int64_t>{0}, ST::Float);
  SsdArgs& a = p.args;
  a.out = out.mutable_data_ptr<float>();
  a.ungated = keeps_ungated ? ungated.mutable_data_ptr<float>() : nullptr;
  a.final_states = final_states.mutable_data_ptr<float>();
  a.chunk_states = chunk_states.mutable_data_ptr<float>();
  a.varlen_states = cu_seqlens ? varlen_states.mutable_data_ptr<float>() : nullptr;
  STD_TORCH_CHECK(pick(false)(a) == 0, "ssd_scan_fwd: out of memory for scratch");
  // a sequence that ends before token 0 (cu_seqlens[i + 1] == 0) keeps the state before it
  for (int64_t i = 0; i < a.nseq; ++i)
    if (p.varlen_end[i] < 0)
      for (int64_t h = 0; h < d.nheads; ++h)
        for (int64_t q = 0; q < PN; ++q)
          a.varlen_states[(i * d.nheads + h) * PN + q] = a.initial_states ? a.initial_states[h * PN + q] : 0.0f;
  return {in_dtype(out, x.scalar_type()), final_states, chunk_states, varlen_states,
          in_dtype(ungated, x.scalar_type())};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ssd_scan_bwd(
    Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, OptTensor D, OptTensor z, OptTensor dt_bias,
    OptTensor initial_states, OptTensor seq_idx, OptTensor cu_seqlens, int64_t chunk_size, bool dt_softplus,
    std::vector<double> dt_limit, Tensor dout, Tensor chunk_states, OptTensor dfinal_states,
    OptTensor dvarlen_states, OptTensor ungated) {
  const char* op = "ssd_scan_bwd";
  Prepared p;
  prepare(p, op, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, cu_seqlens, chunk_size, dt_softplus,
          dt_limit);
  const SsdDims& d = p.d;
  const int64_t PN = d.headdim * d.dstate, H = d.nheads;
  check_tensor_of(op, "dout", dout, kFloatDtypes, {d.batch, d.seqlen, d.nheads, d.headdim}, "x");
  check_tensor_of(op, "chunk_states", chunk_states, {ST::Float}, {d.batch, d.nchunks * d.nheads, d.headdim, d.dstate},
                  "x");
  if (dfinal_states)
    check_tensor_of(op, "dfinal_states", *dfinal_states, {ST::Float}, {d.batch, d.nheads, d.headdim, d.dstate}, "x");
  if (dvarlen_states)
    check_tensor_of(op, "dvarlen_states", *dvarlen_states, {ST::Float}, {d.nseq, d.nheads, d.headdim, d.dstate}, "x");
  // (checked, not read: the kernels recompute each chunk, dz's output before the gate with it)
  if (ungated) {
    STD_TORCH_CHECK(z.has_value(), op, ": ungated (the output before the gate) was given without z");
    check_tensor_of(op, "ungated", *ungated, kFloatDtypes, {d.batch, d.seqlen, d.nheads, d.headdim}, "x");
  }
  const Tensor dout32 = as_f32(dout), cs32 = contig(chunk_states);
  const OptTensor dfin32 = contig(dfinal_states), dvar32 = cu_seqlens ? contig(dvarlen_states) : std::nullopt;

  const std::vector<int64_t> xs = shape_vec(x), none{0};
  Tensor dx = empty_like_shape(x, xs, ST::Float);
  Tensor ddtv = empty_like_shape(x, {d.batch, d.seqlen, d.nheads}, ST::Float);
  Tensor dB = empty_like_shape(x, shape_vec(B), ST::Float);
  Tensor dC = empty_like_shape(x, shape_vec(C), ST::Float);
  Tensor dz = empty_like_shape(x, z ? xs : none, ST::Float);
  Tensor dA_part = empty_like_shape(x, {d.batch, H}, ST::Float);
  Tensor dD_part = empty_like_shape(x, D ? std::vector<int64_t>{d.batch, H, d.headdim} : none, ST::Float);
  Tensor dinit = empty_like_shape(x, {d.batch, H, d.headdim, d.dstate}, ST::Float);
  SsdArgs& a = p.args;
  a.dout = dout32.const_data_ptr<float>();
  a.chunk_states_in = cs32.const_data_ptr<float>();
  a.dfinal_states = fptr(dfin32);
  a.dvarlen_states = fptr(dvar32);
  a.dx = dx.mutable_data_ptr<float>();
  a.ddtv = ddtv.mutable_data_ptr<float>();
  a.dB = dB.mutable_data_ptr<float>();
  a.dC = dC.mutable_data_ptr<float>();
  a.dz = z ? dz.mutable_data_ptr<float>() : nullptr;
  a.dA_part = dA_part.mutable_data_ptr<float>();
  a.dD_part = D ? dD_part.mutable_data_ptr<float>() : nullptr;
  a.dinitial_states = dinit.mutable_data_ptr<float>();
  STD_TORCH_CHECK(pick(true)(a) == 0, "ssd_scan_bwd: out of memory for scratch");

  // a sequence that ends before token 0 read the initial state
  float* di = a.dinitial_states;
  for (int64_t i = 0; i < a.nseq; ++i)
    if (p.varlen_end[i] < 0 && a.dvarlen_states)
      for (int64_t q = 0; q < H * PN; ++q) di[q] += a.dvarlen_states[i * H * PN + q];

  // dt's chain rule: d dtv / d dt is 0 where the clamp bit, softplus' = sigmoid below 20.
  const Tensor dt32 = as_f32(dt);
  const OptTensor bias32 = f32(dt_bias);
  const float* dtp = dt32.const_data_ptr<float>();
  const float* bias = fptr(bias32);
  float* g = ddtv.mutable_data_ptr<float>();
  std::vector<double> dbias(H, 0.0);  // a sum over batch * seqlen terms, in a fixed order
  for (int64_t i = 0; i < d.batch * d.seqlen * H; ++i) {
    const float v = dtp[i] + (bias ? bias[i % H] : 0.0f);
    float grad = g[i];
    const float s = dt_softplus ? softplus(v) : v;
    if (dt_limit.size() == 2 && !unclamped(s, static_cast<float>(dt_limit[0]), static_cast<float>(dt_limit[1])))
      grad = 0.0f;
    if (dt_softplus && v <= 20.0f) grad *= 1.0f / (1.0f + std::exp(-v));
    g[i] = grad;
    dbias[i % H] += grad;
  }
  Tensor dA = empty_like_shape(x, {H}, ST::Float);
  float* dAp = dA.mutable_data_ptr<float>();
  for (int64_t h = 0; h < H; ++h) {
    float s = 0.0f;
    for (int64_t b = 0; b < d.batch; ++b) s += a.dA_part[b * H + h];
    dAp[h] = s;
  }
  Tensor dD = empty_like_shape(x, D ? shape_vec(*D) : none, ST::Float);
  if (D) {
    float* o = dD.mutable_data_ptr<float>();
    const bool per_channel = D->dim() == 2;
    for (int64_t h = 0; h < H; ++h) {
      if (!per_channel) o[h] = 0.0f;
      for (int64_t pch = 0; pch < d.headdim; ++pch) {
        float s = 0.0f;
        for (int64_t b = 0; b < d.batch; ++b) s += a.dD_part[(b * H + h) * d.headdim + pch];
        if (per_channel) o[h * d.headdim + pch] = s; else o[h] += s;
      }
    }
  }
  Tensor ddt_bias = empty_like_shape(x, dt_bias ? std::vector<int64_t>{H} : none, ST::Float);
  if (dt_bias)
    for (int64_t h = 0; h < H; ++h) ddt_bias.mutable_data_ptr<float>()[h] = static_cast<float>(dbias[h]);
  auto like = [&](const Tensor& grad, const OptTensor& input) {
    return input ? in_dtype(grad, input->scalar_type()) : grad;
  };
  return {in_dtype(dx, x.scalar_type()),
          in_dtype(ddtv, dt.scalar_type()),
          dA,
          in_dtype(dB, B.scalar_type()),
          in_dtype(dC, C.scalar_type()),
          like(dD, D),
          like(dz, z),
          like(ddt_bias, dt_bias),
          initial_states ? in_dtype(dinit, initial_states->scalar_type()) : empty_like_shape(x, none, ST::Float)};
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("ssd_scan_fwd", TORCH_BOX(&ssmops_cpu::ssd_scan_fwd));
  m.impl("ssd_scan_bwd", TORCH_BOX(&ssmops_cpu::ssd_scan_bwd));
}
