// The ssmops operator library: the schemas of every operator, in one place. Each family's
// CPU kernels register themselves (csrc/<family>/); nothing here or there needs Python.
#include "common/isa.h"

// The instruction set the kernels run on in this process ("avx512", "avx2" or
// "generic"), for benchmarks and diagnostics: a plain C symbol, read with ctypes, so
// that the operator set stays the schemas below.
extern "C" __attribute__((visibility("default"))) const char* ssmops_cpu_isa(void) {
  try {
    return ssmops_cpu::isa_name(ssmops_cpu::selected_isa());
  } catch (...) {
    return "invalid SSMOPS_CPU_ISA";
  }
}

// Every schema of every family, exactly as the families declare them in Python
// (ssmops/ops/<family>/schema.py; tests compare them), so a Python-free process has them too.
STABLE_TORCH_LIBRARY(ssmops, m) {
  m.def(
      "selective_scan_fwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor? z, Tensor? delta_bias, Tensor? initial_state, bool delta_softplus) -> "
      "(Tensor out, Tensor scan_intermediates, Tensor out_z, Tensor last_state)");
  m.def(
      "selective_scan_bwd(Tensor u, Tensor delta, Tensor A, Tensor B, Tensor C, Tensor? D, "
      "Tensor? z, Tensor? delta_bias, Tensor? initial_state, Tensor dout, "
      "Tensor scan_intermediates, Tensor? dlast_state, bool delta_softplus) -> "
      "(Tensor du, Tensor ddelta, Tensor dA, Tensor dB, Tensor dC, Tensor dD, "
      "Tensor ddelta_bias, Tensor dz, Tensor dinitial_state)");
  m.def(
      "selective_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, "
      "Tensor C, Tensor? D, Tensor? z, Tensor? dt_bias, bool dt_softplus) -> Tensor");
  m.def(
      "multihead_state_update(Tensor(a!) state, Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, "
      "Tensor? D, Tensor? z, Tensor? dt_bias, Tensor? state_batch_indices, bool dt_softplus) -> Tensor");
  m.def(
      "ssd_scan_fwd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
      "Tensor? dt_bias, Tensor? initial_states, Tensor? seq_idx, Tensor? cu_seqlens, int "
      "chunk_size, bool dt_softplus, float[] dt_limit, bool keep_ungated=False) -> (Tensor out, "
      "Tensor final_states, Tensor chunk_states, Tensor varlen_states, Tensor ungated)");
  m.def(
      "ssd_scan_bwd(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor? D, Tensor? z, "
      "Tensor? dt_bias, Tensor? initial_states, Tensor? seq_idx, Tensor? cu_seqlens, int "
      "chunk_size, bool dt_softplus, float[] dt_limit, Tensor dout, Tensor chunk_states, "
      "Tensor? dfinal_states, Tensor? dvarlen_states, Tensor? ungated=None) -> (Tensor dx, Tensor ddt, "
      "Tensor dA, Tensor dB, Tensor dC, Tensor dD, Tensor dz, Tensor ddt_bias, Tensor dinitial_states)");
  m.def("weight_only_linear(Tensor x, Tensor weight, Tensor? weight_scale, Tensor? bias) -> Tensor");
  m.def(
      "mamba_step(Tensor hidden_states, Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor in_proj_weight, "
      "Tensor? in_proj_scale, Tensor? in_proj_bias, Tensor conv_weight, Tensor? conv_bias, Tensor x_proj_weight, "
      "Tensor? x_proj_scale, Tensor dt_proj_weight, Tensor? dt_proj_scale, Tensor? dt_proj_bias, Tensor A_log, "
      "Tensor? D, Tensor out_proj_weight, Tensor? out_proj_scale, Tensor? out_proj_bias) -> Tensor");
  m.def(
      "mamba_layers_step(Tensor hidden_states, Tensor? residual, Tensor(a!)[] conv_states, Tensor(b!)[] ssm_states, "
      "Tensor[] norm_weight, float norm_eps, Tensor[] in_proj_weight, Tensor?[] in_proj_scale, Tensor?[] in_proj_bias, "
      "Tensor[] conv_weight, Tensor?[] conv_bias, Tensor[] x_proj_weight, Tensor?[] x_proj_scale, "
      "Tensor[] dt_proj_weight, Tensor?[] dt_proj_scale, Tensor?[] dt_proj_bias, Tensor[] A_log, Tensor?[] D, "
      "Tensor[] out_proj_weight, Tensor?[] out_proj_scale, Tensor?[] out_proj_bias, Tensor? final_norm_weight=None) "
      "-> (Tensor, Tensor)");
  m.def(
      "causal_conv1d_fwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx, Tensor? initial_states, "
      "bool silu) -> (Tensor out, Tensor final_states)");
  m.def(
      "causal_conv1d_bwd(Tensor x, Tensor weight, Tensor? bias, Tensor? seq_idx, Tensor? initial_states, "
      "Tensor dout, Tensor? dfinal_states, bool silu) -> (Tensor dx, Tensor dweight, Tensor dbias, "
      "Tensor dinitial_states)");
  m.def(
      "causal_conv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, Tensor? cache_seqlens, "
      "Tensor? conv_state_indices, bool silu) -> Tensor");
}
