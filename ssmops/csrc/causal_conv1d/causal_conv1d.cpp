// The causal depthwise conv's CPU operators (causal_conv1d_fwd, _bwd, _update) on LibTorch's stable ABI
// only: argument checks in the words of ssmops/ops/causal_conv1d/checks.py, then plain loops in float32.
// The schemas are in ../library.cpp. x is read through its strides, so a channel-last x (a transposed
// (batch, seqlen, dim) tensor, as Mamba-2's mixer passes xBC) is never copied into the other layout;
// a task is one batch row's block of channels, walked time step by time step, so that either layout
// reads whole cache lines.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../state_update/state_update.h"  // silu_in_place: vectorised for this CPU

namespace ssmops_cpu {
namespace {

const std::vector<ST> kFloatDtypes{ST::Float, ST::Half, ST::BFloat16};
const std::vector<ST> kIndexDtypes{ST::Int, ST::Long};
constexpr int64_t kRowBlock = 64;  // channels of a channel-last backward's task (its dpre: seqlen x 64 floats)

struct ConvDims {
  int64_t batch, dim, seqlen, width;
};

void check_weight(const char* op, const Tensor& weight, int64_t dim) {
  STD_TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim && weight.size(1) >= 1, op,
                  ": weight must have shape (dim, width) with dim=", dim, " and width >= 1, got ", shape_of(weight));
  check_tensor_of(op, "weight", weight, kFloatDtypes, {weight.size(0), weight.size(1)}, "x");
}

void check_x(const char* op, const Tensor& x) {
  STD_TORCH_CHECK(x.dim() == 3, op, ": x must have shape (batch, dim, seqlen), got ", shape_of(x));
  check_dtype_of(op, "x", x, kFloatDtypes);
  STD_TORCH_CHECK(x.is_cpu(), op, ": x must be a CPU tensor");
}

ConvDims check_conv_inputs(const char* op, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                           const OptTensor& seq_idx, const OptTensor& initial_states) {
  check_x(op, x);
  ConvDims d{x.size(0), x.size(1), x.size(2), 0};
  check_weight(op, weight, d.dim);
  d.width = weight.size(1);
  if (bias) check_tensor_of(op, "bias", *bias, kFloatDtypes, {d.dim}, "x");
  if (seq_idx) check_tensor_of(op, "seq_idx", *seq_idx, kIndexDtypes, {d.batch, d.seqlen}, "x");
  if (initial_states)
    check_tensor_of(op, "initial_states", *initial_states, {x.scalar_type()}, {d.batch, d.dim, d.width - 1},
                    "x and weight");
  return d;
}

Tensor f32(const Tensor& t) { return t.scalar_type() == ST::Float ? t : torch::stable::to(t, ST::Float); }
Tensor in_dtype(const Tensor& t, ST dtype) { return dtype == ST::Float ? t : torch::stable::to(t, dtype); }
const float* fptr(const OptTensor& t) { return t ? t->const_data_ptr<float>() : nullptr; }
// an index tensor as contiguous int64
OptTensor as_long(const OptTensor& t) {
  if (!t) return std::nullopt;
  return contig(t->scalar_type() == ST::Long ? *t : torch::stable::to(*t, ST::Long));
}

// A float32 tensor of x's shape in x's layout: channel-last (stride 1 along dim) for a channel-last x,
// else contiguous (schema.empty_like_x).
bool channel_last(const Tensor& x) { return x.stride(2) != 1 && x.stride(1) == 1; }
Tensor empty_like_x(const Tensor& x) {
  if (channel_last(x))
    return torch::stable::transpose(empty_like_shape(x, {x.size(0), x.size(2), x.size(1)}, ST::Float), 1, 2);
  return empty_like_shape(x, {x.size(0), x.size(1), x.size(2)}, ST::Float);
}

struct Strided3 {
  int64_t b, d, t;
  explicit Strided3(const Tensor& t3) : b(t3.stride(0)), d(t3.stride(1)), t(t3.stride(2)) {}
  int64_t at(int64_t i, int64_t c, int64_t j) const { return i * b + c * d + j * t; }
};

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// The stream (initial states, then x) of one batch row and the conv's pre-activation over it.
struct Stream {
  const float* x;
  Strided3 sx;
  const float* init;  // (batch, dim, width - 1) contiguous, or null: zeros
  const int64_t* seq;  // (batch, seqlen) contiguous, or null: one sequence
  const float* w;      // (dim, width) contiguous
  const float* bias;
  int64_t dim, seqlen, width;

  float at(int64_t b, int64_t c, int64_t j) const {  // stream entry j (x_t is entry t + width - 1)
    const int64_t h = width - 1;
    if (j >= h) return x[sx.at(b, c, j - h)];
    return init ? init[(b * dim + c) * h + j] : 0.0f;
  }
  int64_t seq_of(int64_t b, int64_t j) const {  // the initial states are in token 0's sequence
    return seq[b * seqlen + std::max<int64_t>(j - (width - 1), 0)];
  }
  bool same(int64_t b, int64_t j, int64_t k) const { return !seq || seq_of(b, j) == seq_of(b, k); }
  float pre(int64_t b, int64_t c, int64_t t) const {
    float acc = bias ? bias[c] : 0.0f;
    const float* wc = w + c * width;
    for (int64_t k = 0; k < width; ++k)
      if (same(b, t + k, t + width - 1)) acc += wc[k] * at(b, c, t + k);
    return acc;
  }
};

// The inputs as float32 (x in its own strides) and the stream over them.
struct Prepared {
  Tensor x32, w32;
  OptTensor bias32, seq64, init32;
  Stream s;

  Prepared(const ConvDims& d, const Tensor& x, const Tensor& weight, const OptTensor& bias, const OptTensor& seq_idx,
           const OptTensor& initial_states)
      : x32(f32(x)),
        w32(contig(f32(weight))),
        bias32(bias ? OptTensor(contig(f32(*bias))) : std::nullopt),
        seq64(as_long(seq_idx)),
        init32(initial_states ? OptTensor(contig(f32(*initial_states))) : std::nullopt),
        s{x32.const_data_ptr<float>(), Strided3(x32), fptr(init32),
          seq64 ? seq64->const_data_ptr<int64_t>() : nullptr, w32.const_data_ptr<float>(), fptr(bias32),
          d.dim, d.seqlen, d.width} {}
};

// weight (dim, width) as (width, dim): each tap's weights contiguous over channels.
std::vector<float> taps_of(const Stream& s) {
  std::vector<float> weight_t(static_cast<size_t>(s.width * s.dim));
  for (int64_t c = 0; c < s.dim; ++c)
    for (int64_t k = 0; k < s.width; ++k) weight_t[k * s.dim + c] = s.w[c * s.width + k];
  return weight_t;
}

// The forward's two fast layouts, past the first width - 1 tokens (those read the initial states: Stream::pre).
// Channel-last x and out: a row of channels [c0, c1) per token, each tap one multiply-add over the row
// (weight_t: (width, dim), a tap's weights contiguous; a tap outside the token's sequence is skipped whole).
void forward_row(const Stream& s, const float* weight_t, float* __restrict row, int64_t b, int64_t t, int64_t c0,
                 int64_t c1) {
  const int64_t h = s.width - 1;
  if (t < h) {
    for (int64_t c = c0; c < c1; ++c) row[c] = s.pre(b, c, t);
    return;
  }
  for (int64_t c = c0; c < c1; ++c) row[c] = s.bias ? s.bias[c] : 0.0f;
  for (int64_t k = 0; k < s.width; ++k) {
    if (!s.same(b, t + k, t + h)) continue;
    const float* __restrict xr = s.x + s.sx.at(b, 0, t + k - h);
    const float* __restrict wk = weight_t + k * s.dim;
    for (int64_t c = c0; c < c1; ++c) row[c] += wk[c] * xr[c];
  }
}

// Channel-first x and out: one channel's time series, each tap one multiply-add over time.
void forward_series(const Stream& s, float* __restrict out, int64_t b, int64_t c) {
  const int64_t h = s.width - 1, T = s.seqlen;
  const float* __restrict xr = s.x + s.sx.at(b, c, 0);
  const int64_t* __restrict seq = s.seq ? s.seq + b * T : nullptr;
  for (int64_t t = 0; t < std::min(h, T); ++t) out[t] = s.pre(b, c, t);
  for (int64_t t = h; t < T; ++t) out[t] = s.bias ? s.bias[c] : 0.0f;
  for (int64_t k = 0; k < s.width; ++k) {
    const float wk = s.w[c * s.width + k];
    const int64_t shift = k - h;
    if (seq == nullptr)
      for (int64_t t = h; t < T; ++t) out[t] += wk * xr[t + shift];
    else
      for (int64_t t = h; t < T; ++t) out[t] += seq[t + shift] == seq[t] ? wk * xr[t + shift] : 0.0f;
  }
}

std::tuple<Tensor, Tensor> causal_conv1d_fwd(Tensor x, Tensor weight, OptTensor bias, OptTensor seq_idx,
                                             OptTensor initial_states, bool silu_on) {
  const char* op = "causal_conv1d_fwd";
  const ConvDims d = check_conv_inputs(op, x, weight, bias, seq_idx, initial_states);
  const Prepared p(d, x, weight, bias, seq_idx, initial_states);
  const Stream& s = p.s;
  const int64_t h = d.width - 1, T = d.seqlen;
  Tensor out = empty_like_x(x);
  Tensor final_states = empty_like_shape(x, {d.batch, d.dim, h}, ST::Float);
  float* o = out.mutable_data_ptr<float>();
  float* fin = final_states.mutable_data_ptr<float>();
  const Strided3 so(out);
  if (so.d == 1 && s.sx.d == 1) {  // channel-last: a task is a token's row of channels
    const std::vector<float> weight_t = taps_of(s);
    torch::stable::parallel_for(0, d.batch * T, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* row = o + so.at(i / T, 0, i % T);
        forward_row(s, weight_t.data(), row, i / T, i % T, 0, d.dim);
        if (silu_on) silu_in_place(row, d.dim);
      }
    });
  } else if (so.t == 1 && s.sx.t == 1) {  // channel-first: a task is a channel's series
    torch::stable::parallel_for(0, d.batch * d.dim, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        float* series = o + so.at(i / d.dim, i % d.dim, 0);
        forward_series(s, series, i / d.dim, i % d.dim);
        if (silu_on) silu_in_place(series, T);
      }
    });
  } else {  // any other strides: element by element
    torch::stable::parallel_for(0, d.batch * d.dim, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i)
        for (int64_t t = 0; t < T; ++t) {
          const float v = s.pre(i / d.dim, i % d.dim, t);
          o[so.at(i / d.dim, i % d.dim, t)] = silu_on ? silu(v) : v;
        }
    });
  }
  for (int64_t b = 0; b < d.batch; ++b)
    for (int64_t c = 0; c < d.dim; ++c)
      for (int64_t j = 0; j < h; ++j)  // stream entry seqlen + j; the last token is entry seqlen + h - 1
        fin[(b * d.dim + c) * h + j] = s.same(b, T + j, T + h - 1) ? s.at(b, c, T + j) : 0.0f;
  return {in_dtype(out, x.scalar_type()), in_dtype(final_states, x.scalar_type())};
}

// The backward of channel-last x, dout and dx for channels [c0, c1) over every batch row, so that the task owns
// their dweight and dbias: dpre = dout * silu'(pre) per token row, then dweight and dbias from it, then each
// stream entry's gradient from the outputs that read it (and the final states); rows of channels throughout.
struct RowsBackward {
  const Stream& s;
  const float* weight_t;
  const float* g;  // dout, stride 1 along channels
  Strided3 sg;
  const float* dfin;  // (batch, dim, width - 1) contiguous, or null
  float* dx;
  Strided3 sdx;
  float *dinit, *dweight, *dbias;  // dinit and dbias may be null
  bool silu_on;

  void run(int64_t batch, int64_t c0, int64_t c1) const {
    const int64_t n = c1 - c0, h = s.width - 1, W = s.width, T = s.seqlen;
    std::vector<float> dpre(static_cast<size_t>(T * n)), pre(n), e(n), acc(n);
    std::vector<float> dw(static_cast<size_t>(W * n), 0.0f), db(n, 0.0f);  // dw: (width, block)
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t t = 0; t < T; ++t) {
        float* __restrict dr = dpre.data() + t * n;
        const float* __restrict gr = g + sg.at(b, c0, t);
        if (silu_on) {  // silu'(p) = sig (1 + p (1 - sig)), sig = 1 / (1 + exp(-p))
          forward_row(s, weight_t, pre.data() - c0, b, t, c0, c1);
          for (int64_t i = 0; i < n; ++i) e[i] = -pre[i];
          neg_exp(e.data(), e.data(), n);  // -exp(-p)
          for (int64_t i = 0; i < n; ++i) {
            const float sig = 1.0f / (1.0f - e[i]);
            dr[i] = gr[i] * sig * (1.0f + pre[i] * (1.0f - sig));
          }
        } else {
          for (int64_t i = 0; i < n; ++i) dr[i] = gr[i];
        }
        for (int64_t i = 0; i < n; ++i) db[i] += dr[i];
        for (int64_t k = 0; k < W; ++k) {
          if (!s.same(b, t + k, t + h)) continue;
          float* __restrict dwk = dw.data() + k * n;
          if (t + k >= h) {
            const float* __restrict xr = s.x + s.sx.at(b, c0, t + k - h);
            for (int64_t i = 0; i < n; ++i) dwk[i] += dr[i] * xr[i];
          } else {
            for (int64_t i = 0; i < n; ++i) dwk[i] += dr[i] * s.at(b, c0 + i, t + k);
          }
        }
      }
      for (int64_t j = 0; j < T + h; ++j) {  // stream entry j: input time j - h
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t k = std::max<int64_t>(0, j - T + 1); k < W && k <= j; ++k) {
          if (!s.same(b, j, j - k + h)) continue;
          const float* __restrict dr = dpre.data() + (j - k) * n;
          const float* __restrict wk = weight_t + k * s.dim + c0;
          for (int64_t i = 0; i < n; ++i) acc[i] += wk[i] * dr[i];
        }
        if (dfin && j >= T && s.same(b, j, T + h - 1))
          for (int64_t i = 0; i < n; ++i) acc[i] += dfin[(b * s.dim + c0 + i) * h + j - T];
        if (j >= h) {
          float* __restrict out = dx + sdx.at(b, c0, j - h);
          for (int64_t i = 0; i < n; ++i) out[i] = acc[i];
        } else if (dinit) {
          for (int64_t i = 0; i < n; ++i) dinit[(b * s.dim + c0 + i) * h + j] = acc[i];
        }
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      for (int64_t k = 0; k < W; ++k) dweight[(c0 + i) * W + k] = dw[k * n + i];
      if (dbias) dbias[c0 + i] = db[i];
    }
  }
};

// t (batch, dim, n) with stride 1 along dim: t itself, or a channel-last copy.
Tensor rows_layout(const Tensor& t) {
  return t.stride(1) == 1 ? t : torch::stable::transpose(contig(torch::stable::transpose(t, 1, 2)), 1, 2);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> causal_conv1d_bwd(Tensor x, Tensor weight, OptTensor bias,
                                                             OptTensor seq_idx, OptTensor initial_states, Tensor dout,
                                                             OptTensor dfinal_states, bool silu_on) {
  const char* op = "causal_conv1d_bwd";
  const ConvDims d = check_conv_inputs(op, x, weight, bias, seq_idx, initial_states);
  check_tensor_of(op, "dout", dout, {x.scalar_type()}, {d.batch, d.dim, d.seqlen}, "x");
  if (dfinal_states)
    check_tensor_of(op, "dfinal_states", *dfinal_states, {x.scalar_type()}, {d.batch, d.dim, d.width - 1},
                    "x and weight");
  // The kernel works on rows of channels: a channel-first x, dout or dx goes through a channel-last copy
  // (Mamba's mixers pass channel-last ones: no copy there).
  const Prepared p(d, rows_layout(f32(x)), weight, bias, seq_idx, initial_states);
  const Stream& s = p.s;
  const Tensor g = rows_layout(f32(dout));
  const OptTensor dfin32 = dfinal_states ? OptTensor(contig(f32(*dfinal_states))) : std::nullopt;
  const int64_t h = d.width - 1;
  const std::vector<int64_t> none{0};
  Tensor dx = empty_like_x(x);
  Tensor dx_rows = dx.stride(1) == 1 ? dx : torch::stable::transpose(empty_like_shape(x, {d.batch, d.seqlen, d.dim}, ST::Float), 1, 2);
  Tensor dweight = empty_like_shape(x, {d.dim, d.width}, ST::Float);
  Tensor dbias = empty_like_shape(x, bias ? std::vector<int64_t>{d.dim} : none, ST::Float);
  Tensor dinit = empty_like_shape(x, initial_states ? std::vector<int64_t>{d.batch, d.dim, h} : none, ST::Float);
  const std::vector<float> weight_t = taps_of(s);
  const RowsBackward rows{s, weight_t.data(), g.const_data_ptr<float>(), Strided3(g), fptr(dfin32),
                          dx_rows.mutable_data_ptr<float>(), Strided3(dx_rows),
                          initial_states ? dinit.mutable_data_ptr<float>() : nullptr,
                          dweight.mutable_data_ptr<float>(), bias ? dbias.mutable_data_ptr<float>() : nullptr,
                          silu_on};
  torch::stable::parallel_for(0, (d.dim + kRowBlock - 1) / kRowBlock, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task)
      rows.run(d.batch, task * kRowBlock, std::min((task + 1) * kRowBlock, d.dim));
  });
  if (dx_rows.data_ptr() != dx.data_ptr()) torch::stable::copy_(dx, dx_rows);
  return {in_dtype(dx, x.scalar_type()), in_dtype(dweight, weight.scalar_type()),
          bias ? in_dtype(dbias, bias->scalar_type()) : in_dtype(dbias, x.scalar_type()),
          in_dtype(dinit, x.scalar_type())};
}

// One token through a shifted state of one (batch row, channel): out = bias + the taps over the state's last
// width - 1 entries and x, then the state shifted left by one with x appended. kWidth, kLen: width and
// state_len when known at compile time (4 and 4, Mamba's), else 0. Restrict pointers: the state's loads and
// stores need not wait for each other (a decoding step is ~dim of these; ~17 ns each through the general path).
template <int kWidth, int kLen>
inline float shift_in_token(float* __restrict st, const float* __restrict wc, float bias, float xv, int64_t width,
                            int64_t state_len) {
  const int64_t W = kWidth ? kWidth : width, L = kLen ? kLen : state_len, h = W - 1;
  float acc = bias + wc[h] * xv;
  for (int64_t k = 0; k < h; ++k) acc += wc[k] * st[L - h + k];
  for (int64_t j = 0; j + 1 < L; ++j) st[j] = st[j + 1];
  st[L - 1] = xv;
  return acc;
}

Tensor causal_conv1d_update(Tensor x, Tensor conv_state, Tensor weight, OptTensor bias, OptTensor cache_seqlens,
                            OptTensor conv_state_indices, bool silu_on) {
  const char* op = "causal_conv1d_update";
  check_x(op, x);
  const int64_t batch = x.size(0), dim = x.size(1), T = x.size(2);
  check_weight(op, weight, dim);
  const int64_t W = weight.size(1), h = W - 1;
  STD_TORCH_CHECK(conv_state.dim() == 3 && conv_state.size(1) == dim && conv_state.size(2) >= h, op,
                  ": conv_state must have shape (cache_size, dim, state_len) with dim=", dim,
                  " and state_len >= width - 1 = ", h, ", got ", shape_of(conv_state));
  const int64_t cache_size = conv_state.size(0), L = conv_state.size(2);
  STD_TORCH_CHECK(conv_state_indices.has_value() || cache_size == batch, op, ": conv_state must have batch ", batch,
                  " like x (or give conv_state_indices), got ", shape_of(conv_state));
  check_tensor_of(op, "conv_state", conv_state, kFloatDtypes, {cache_size, dim, L}, "x");
  if (bias) check_tensor_of(op, "bias", *bias, kFloatDtypes, {dim}, "x");
  if (cache_seqlens) check_tensor_of(op, "cache_seqlens", *cache_seqlens, kIndexDtypes, {batch}, "x");
  if (conv_state_indices) check_tensor_of(op, "conv_state_indices", *conv_state_indices, kIndexDtypes, {batch}, "x");
  const OptTensor starts = as_long(cache_seqlens), rows = as_long(conv_state_indices);
  const int64_t* start = starts ? starts->const_data_ptr<int64_t>() : nullptr;
  const int64_t* row_of = rows ? rows->const_data_ptr<int64_t>() : nullptr;
  for (int64_t b = 0; row_of && b < batch; ++b)
    STD_TORCH_CHECK(row_of[b] < cache_size, op, ": conv_state_indices must be < the conv_state's cache size ",
                    cache_size, ", got ", row_of[b], " at batch row ", b);

  const Tensor x32 = f32(x), w32 = contig(f32(weight));
  const OptTensor bias32 = bias ? OptTensor(contig(f32(*bias))) : std::nullopt;
  Tensor state = f32(conv_state);  // conv_state itself when float32: updated in place
  Tensor out = empty_like_shape(x, {batch, dim, T}, ST::Float);
  const float* xp = x32.const_data_ptr<float>();
  const float* wp = w32.const_data_ptr<float>();
  const float* bp = fptr(bias32);
  float* sp = state.mutable_data_ptr<float>();
  float* outp = out.mutable_data_ptr<float>();
  const Strided3 sx(x32), ss(state);
  torch::stable::parallel_for(0, batch * dim, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> window(static_cast<size_t>(L + T));  // the stream's entries, oldest first
    // (batch row, channel) advanced together: no division per channel (a decoding step is ~dim of them)
    for (int64_t i = begin, b = begin / dim, c = begin % dim; i < end; ++i, c = c + 1 == dim ? 0 : c + 1,
                 b += c == 0) {
      const int64_t row = row_of ? row_of[b] : b;
      float* o = outp + (b * dim + c) * T;
      if (row < 0) {  // padding: output 0, nothing written
        std::fill(o, o + T, 0.0f);
        continue;
      }
      float* st = sp + row * ss.b + c * ss.d;
      const float* xc = xp + b * sx.b + c * sx.d;
      const float* wc = wp + c * W;
      if (T == 1 && !start && ss.t == 1) {  // one token, a shifted contiguous state: the decoding step
        const float bias_c = bp ? bp[c] : 0.0f;
        o[0] = W == 4 && L == 4 ? shift_in_token<4, 4>(st, wc, bias_c, xc[0], W, L)
                                : shift_in_token<0, 0>(st, wc, bias_c, xc[0], W, L);
        continue;
      }
      // window[L - h + j], j < h: the h entries before token 0; window[L + t]: token t
      const int64_t pos = start ? start[b] : L;  // the stream position of token 0
      auto slot = [&](int64_t p) { return (((p % L) + L) % L) * ss.t; };
      if (start)
        for (int64_t j = 0; j < L; ++j) window[j] = st[slot(pos - L + j)];
      else
        for (int64_t j = 0; j < L; ++j) window[j] = st[j * ss.t];
      for (int64_t t = 0; t < T; ++t) window[L + t] = xc[t * sx.t];
      for (int64_t t = 0; t < T; ++t) {
        float acc = bp ? bp[c] : 0.0f;
        for (int64_t k = 0; k < W; ++k) acc += wc[k] * window[L - h + t + k];
        o[t] = acc;
      }
      if (start)  // the last min(T, L) tokens into their slots
        for (int64_t t = std::max<int64_t>(T - L, 0); t < T; ++t) st[slot(pos + t)] = window[L + t];
      else  // the state keeps the stream's last L entries
        for (int64_t j = 0; j < L; ++j) st[j * ss.t] = window[T + j];
    }
  });
  // (vectorised over the whole output, after the windows: a decoding step's cost was mostly scalar exp;
  // a padding row's 0 stays 0)
  if (silu_on) silu_in_place(outp, batch * dim * T);
  if (conv_state.scalar_type() != ST::Float) torch::stable::copy_(conv_state, state);
  return in_dtype(out, x.scalar_type());
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("causal_conv1d_fwd", TORCH_BOX(&ssmops_cpu::causal_conv1d_fwd));
  m.impl("causal_conv1d_bwd", TORCH_BOX(&ssmops_cpu::causal_conv1d_bwd));
  m.impl("causal_conv1d_update", TORCH_BOX(&ssmops_cpu::causal_conv1d_update));
}
