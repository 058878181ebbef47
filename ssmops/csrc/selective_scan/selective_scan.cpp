// The selective scan's CPU operators: argument checks, the choice of kernel and the CPU
// registrations, on LibTorch's stable ABI only (no c10/at/torch C++ symbols, no Python).
// The kernels themselves are in scan_kernel.h, compiled once per instruction set; this
// file picks one at run time. The schemas are in ../library.cpp.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "../common/checks.h"
#include "../common/isa.h"
#include "scan_params.h"

namespace ssmops_cpu {
namespace {

// --- argument checks -------------------------------------------------------------------

int dtype_code(ST t) {
  return t == ST::Half ? kFloat16 : t == ST::BFloat16 ? kBFloat16 : kFloat32;
}

struct Dims {
  int64_t batch, dim, seqlen, dstate, groups;
  bool B_variable, C_variable, complex_A;
};

// B or C: (dim, dstate), (batch, dstate, seqlen) or (batch, groups, dstate, seqlen).
// Returns its group count, 0 when constant. With complex A (mamba_ssm's complex mode) a
// constant B/C is complex64 and a variable one has 2 * seqlen steps: (re, im) pairs.
int64_t check_bc(const char* name, const Tensor& M, const Dims& d, ST u_dtype) {
  check_cpu(name, M);
  const int64_t time = d.complex_A ? 2 * d.seqlen : d.seqlen;
  const std::string time_name = d.complex_A ? "2 * seqlen" : "seqlen";
  const std::string layouts = "(dim, dstate)=" + shape_str({d.dim, d.dstate}) + ", (batch, dstate, " + time_name +
                              ")=" + shape_str({d.batch, d.dstate, time}) + " or (batch, groups, dstate, " +
                              time_name + ") with groups dividing dim=" + std::to_string(d.dim) +
                              (d.complex_A ? " (re, im interleaved along time, as A is complex)" : "");
  int64_t groups = 0;
  std::vector<int64_t> expected;
  if (M.dim() == 2) {
    expected = {d.dim, d.dstate};
  } else if (M.dim() == 3) {
    expected = {d.batch, d.dstate, time};
    groups = 1;
  } else if (M.dim() == 4) {
    groups = M.size(1);
    STD_TORCH_CHECK(groups >= 1 && d.dim % groups == 0, "selective_scan: ", name, " has ", groups,
                    " groups, which does not divide dim=", d.dim);
    expected = {d.batch, groups, d.dstate, time};
  } else {
    STD_TORCH_CHECK(false, "selective_scan: ", name, " must have shape ", layouts, ", got rank ", M.dim(),
                    " ", shape_of(M));
  }
  if (!same_shape(M, expected)) {
    // Only dstate differs: A sets dstate, so name both.
    const int64_t axis = M.dim() == 2 ? 1 : M.dim() - 2;
    std::vector<int64_t> with_its_dstate = expected;
    with_its_dstate[axis] = M.size(axis);
    STD_TORCH_CHECK(!same_shape(M, with_its_dstate), "selective_scan: ", name, " has dstate ", M.size(axis),
                    " but A has dstate ", d.dstate, ": A is (dim, dstate)=", shape_str({d.dim, d.dstate}), ", ",
                    name, " is ", shape_of(M));
    STD_TORCH_CHECK(false, "selective_scan: ", name, " must have shape ", layouts, ", got ", shape_of(M));
  }
  const ST t = M.scalar_type();
  if (d.complex_A && groups == 0) {
    STD_TORCH_CHECK(t == ST::ComplexFloat, "selective_scan: ", name,
                    " must have dtype complex64 (a constant B/C is complex when A is), got ", dtype_name(t));
  } else {
    STD_TORCH_CHECK(t == ST::Float || t == u_dtype, "selective_scan: ", name, " must have dtype float32 or ",
                    dtype_name(u_dtype), " (u's dtype)",
                    d.complex_A ? " (a variable B/C holds re/im pairs when A is complex)" : "", ", got ",
                    dtype_name(t));
  }
  return groups;
}

Dims check_inputs(const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& B, const Tensor& C,
                  const OptTensor& D, const OptTensor& z, const OptTensor& delta_bias,
                  const OptTensor& initial_state) {
  check_cpu("u", u);
  STD_TORCH_CHECK(u.dim() == 3, "selective_scan: u must have shape (batch, dim, seqlen), got ", shape_of(u));
  const ST dt = u.scalar_type();
  STD_TORCH_CHECK(dt == ST::Float || dt == ST::Half || dt == ST::BFloat16,
                  "selective_scan: u must have dtype float32, float16 or bfloat16, got ", dtype_name(dt));
  Dims d{u.size(0), u.size(1), u.size(2), 0, 1, false, false, false};
  STD_TORCH_CHECK(d.seqlen >= 1, "selective_scan: u must have seqlen >= 1, got shape ", shape_of(u));
  check_tensor("delta", delta, {d.batch, d.dim, d.seqlen}, dt);
  check_cpu("A", A);
  STD_TORCH_CHECK(A.dim() == 2 && A.size(0) == d.dim, "selective_scan: A must have shape (dim, dstate) with dim=",
                  d.dim, ", got ", shape_of(A));
  d.dstate = A.size(1);
  STD_TORCH_CHECK(d.dstate >= 1 && d.dstate <= kMaxDstate, "selective_scan: A must have 1 <= dstate <= ",
                  kMaxDstate, ", got dstate=", d.dstate);
  STD_TORCH_CHECK(A.scalar_type() == ST::Float || A.scalar_type() == ST::ComplexFloat,
                  "selective_scan: A must have dtype float32 or complex64, got ", dtype_name(A.scalar_type()));
  d.complex_A = A.scalar_type() == ST::ComplexFloat;
  const int64_t gB = check_bc("B", B, d, dt), gC = check_bc("C", C, d, dt);
  STD_TORCH_CHECK(!(gB && gC && gB != gC), "selective_scan: B has ", gB, " groups but C has ", gC,
                  "; they must agree");
  d.B_variable = gB > 0;
  d.C_variable = gC > 0;
  d.groups = gB > gC ? gB : (gC > 0 ? gC : 1);
  if (D) check_tensor("D", *D, {d.dim}, ST::Float);
  if (delta_bias) check_tensor("delta_bias", *delta_bias, {d.dim}, ST::Float);
  if (z) check_tensor("z", *z, {d.batch, d.dim, d.seqlen}, dt);
  if (initial_state) check_tensor("initial_state", *initial_state, {d.batch, d.dim, d.dstate}, A.scalar_type());
  return d;
}

// --- glue --------------------------------------------------------------------------------

void parallel_for_torch(int64_t n, RangeFn fn, void* ctx) {
  torch::stable::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { fn(ctx, begin, end); });
}

const float* fptr(const OptTensor& t) { return t ? t->const_data_ptr<float>() : nullptr; }

// A tensor of A's dtype (float32, or complex64 read as (re, im) float pairs).
const float* state_ptr(const Tensor& t) { return static_cast<const float*>(t.const_data_ptr()); }
const float* state_ptr(const OptTensor& t) { return t ? state_ptr(*t) : nullptr; }
float* mutable_state_ptr(const Tensor& t) { return static_cast<float*>(t.mutable_data_ptr()); }


// Fills the inputs shared by forward and backward; the tensors must outlive the call.
ScanArgs make_args(const Dims& d, const Tensor& u, const Tensor& delta, const Tensor& A, const Tensor& B,
                   const Tensor& C, const OptTensor& D, const OptTensor& z, const OptTensor& delta_bias,
                   const OptTensor& initial_state, bool delta_softplus) {
  ScanArgs a{};
  a.batch = d.batch;
  a.dim = d.dim;
  a.seqlen = d.seqlen;
  a.dstate = d.dstate;
  a.groups = d.groups;
  a.B_variable = d.B_variable;
  a.C_variable = d.C_variable;
  a.delta_softplus = delta_softplus;
  a.complex_A = d.complex_A;
  a.dtype_in = dtype_code(u.scalar_type());
  a.dtype_B = dtype_code(B.scalar_type());
  a.dtype_C = dtype_code(C.scalar_type());
  a.u = u.const_data_ptr();
  a.delta = delta.const_data_ptr();
  a.z = z ? z->const_data_ptr() : nullptr;
  a.B = B.const_data_ptr();
  a.C = C.const_data_ptr();
  a.A = state_ptr(A);
  a.D = fptr(D);
  a.delta_bias = fptr(delta_bias);
  a.initial_state = state_ptr(initial_state);
  a.parallel_for = parallel_for_torch;
  return a;
}

using FwdKernel = int (*)(const ScanArgs&);

// Complex A has one scalar kernel; the real scan one per instruction set.
FwdKernel fwd_kernel(Isa isa, bool complex_A) {
  return complex_A ? scan_fwd_complex : SSMOPS_ISA_KERNEL(isa, scan_fwd);
}

FwdKernel bwd_kernel(Isa isa, bool complex_A) {
  return complex_A ? scan_bwd_complex : SSMOPS_ISA_KERNEL(isa, scan_bwd);
}

int64_t num_chunks(int64_t seqlen) { return (seqlen + kChunkLen - 1) / kChunkLen; }

// --- the operators -----------------------------------------------------------------------

std::tuple<Tensor, Tensor, Tensor, Tensor> selective_scan_fwd(
    Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, OptTensor D, OptTensor z, OptTensor delta_bias,
    OptTensor initial_state, bool delta_softplus) {
  const Dims d = check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state);
  u = contig(u), delta = contig(delta), A = contig(A), B = contig(B), C = contig(C);
  D = contig(D), z = contig(z), delta_bias = contig(delta_bias), initial_state = contig(initial_state);
  const ST dt = u.scalar_type(), state = A.scalar_type();
  Tensor out = empty_like_shape(u, {d.batch, d.dim, d.seqlen}, dt);
  // mamba_ssm's (batch, dim, n_chunks, 2 * dstate), flattened over its last two dims; A's dtype
  Tensor x = empty_like_shape(u, {d.batch, d.dim, num_chunks(d.seqlen) * 2 * d.dstate}, state);
  Tensor out_z = empty_like_shape(u, z ? std::vector<int64_t>{d.batch, d.dim, d.seqlen} : std::vector<int64_t>{0}, dt);
  Tensor last_state = empty_like_shape(u, {d.batch, d.dim, d.dstate}, state);

  ScanArgs a = make_args(d, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus);
  a.out = out.mutable_data_ptr();
  a.out_z = z ? out_z.mutable_data_ptr() : nullptr;
  a.scan_intermediates = mutable_state_ptr(x);
  a.last_state = mutable_state_ptr(last_state);
  STD_TORCH_CHECK(fwd_kernel(selected_isa(), d.complex_A)(a) == 0, "selective_scan_fwd: out of memory for scratch");
  return {out, x, out_z, last_state};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> selective_scan_bwd(
    Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, OptTensor D, OptTensor z, OptTensor delta_bias,
    OptTensor initial_state, Tensor dout, Tensor scan_intermediates, OptTensor dlast_state,
    bool delta_softplus) {
  const Dims d = check_inputs(u, delta, A, B, C, D, z, delta_bias, initial_state);
  const ST dt = u.scalar_type(), state = A.scalar_type();
  check_tensor("dout", dout, {d.batch, d.dim, d.seqlen}, dt);
  check_tensor("scan_intermediates", scan_intermediates,
               {d.batch, d.dim, num_chunks(d.seqlen) * 2 * d.dstate}, state);
  if (dlast_state) check_tensor("dlast_state", *dlast_state, {d.batch, d.dim, d.dstate}, state);
  u = contig(u), delta = contig(delta), A = contig(A), B = contig(B), C = contig(C);
  D = contig(D), z = contig(z), delta_bias = contig(delta_bias), initial_state = contig(initial_state);
  dout = contig(dout), scan_intermediates = contig(scan_intermediates), dlast_state = contig(dlast_state);

  const std::vector<int64_t> bdl{d.batch, d.dim, d.seqlen}, none{0};
  auto shape = [](const Tensor& t) {
    std::vector<int64_t> s;
    for (int64_t i = 0; i < t.dim(); ++i) s.push_back(t.size(i));
    return s;
  };
  Tensor du = empty_like_shape(u, bdl, dt);
  Tensor ddelta = empty_like_shape(u, bdl, dt);
  Tensor dA = empty_like_shape(u, {d.dim, d.dstate}, state);
  Tensor dB = empty_like_shape(u, shape(B), B.scalar_type());
  Tensor dC = empty_like_shape(u, shape(C), C.scalar_type());
  Tensor dD = empty_like_shape(u, D ? std::vector<int64_t>{d.dim} : none, ST::Float);
  Tensor ddelta_bias = empty_like_shape(u, delta_bias ? std::vector<int64_t>{d.dim} : none, ST::Float);
  Tensor dz = empty_like_shape(u, z ? bdl : none, dt);
  Tensor dinit = empty_like_shape(u, initial_state ? std::vector<int64_t>{d.batch, d.dim, d.dstate} : none,
                                  initial_state ? state : ST::Float);

  ScanArgs a = make_args(d, u, delta, A, B, C, D, z, delta_bias, initial_state, delta_softplus);
  a.dout = dout.const_data_ptr();
  a.scan_intermediates = const_cast<float*>(state_ptr(scan_intermediates));
  a.dlast_state = state_ptr(dlast_state);
  a.du = du.mutable_data_ptr();
  a.ddelta = ddelta.mutable_data_ptr();
  a.dz = z ? dz.mutable_data_ptr() : nullptr;
  a.dA = mutable_state_ptr(dA);
  a.dB = dB.mutable_data_ptr();
  a.dC = dC.mutable_data_ptr();
  a.dD = D ? dD.mutable_data_ptr<float>() : nullptr;
  a.ddelta_bias = delta_bias ? ddelta_bias.mutable_data_ptr<float>() : nullptr;
  a.dinitial_state = initial_state ? mutable_state_ptr(dinit) : nullptr;
  STD_TORCH_CHECK(bwd_kernel(selected_isa(), d.complex_A)(a) == 0, "selective_scan_bwd: out of memory for scratch");
  return {du, ddelta, dA, dB, dC, dD, ddelta_bias, dz, dinit};
}

}  // namespace
}  // namespace ssmops_cpu

STABLE_TORCH_LIBRARY_IMPL(ssmops, CPU, m) {
  m.impl("selective_scan_fwd", TORCH_BOX(&ssmops_cpu::selective_scan_fwd));
  m.impl("selective_scan_bwd", TORCH_BOX(&ssmops_cpu::selective_scan_bwd));
}
