// Argument checks and tensor helpers shared by every family's CPU operators, on the stable
// ABI only. Every check names the operator, the argument, what it got and what was expected.
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace ssmops_cpu {

using torch::stable::Tensor;
using OptTensor = std::optional<Tensor>;
using ST = torch::headeronly::ScalarType;

constexpr int64_t kMaxDstate = 256;

inline std::string shape_of(const Tensor& t) {
  std::string s = "(";
  for (int64_t i = 0; i < t.dim(); ++i) {
    if (i) s += ", ";
    s += std::to_string(t.size(i));
  }
  return s + (t.dim() == 1 ? ",)" : ")");
}

inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "(";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + (shape.size() == 1 ? ",)" : ")");
}

inline const char* dtype_name(ST t) {
  switch (t) {
    case ST::Float:
      return "float32";
    case ST::Half:
      return "float16";
    case ST::BFloat16:
      return "bfloat16";
    case ST::Double:
      return "float64";
    case ST::ComplexFloat:
      return "complex64";
    case ST::ComplexDouble:
      return "complex128";
    case ST::Int:
      return "int32";
    case ST::Long:
      return "int64";
    default:
      return "an unsupported dtype";
  }
}

inline bool same_shape(const Tensor& t, const std::vector<int64_t>& shape) {
  if (t.dim() != static_cast<int64_t>(shape.size())) return false;
  for (size_t i = 0; i < shape.size(); ++i)
    if (t.size(i) != shape[i]) return false;
  return true;
}

inline void check_cpu(const char* name, const Tensor& t) {
  STD_TORCH_CHECK(t.is_cpu(), "selective_scan (cpu): ", name, " must be a CPU tensor");
}

inline void check_tensor(const char* name, const Tensor& t, const std::vector<int64_t>& shape, ST dtype) {
  check_cpu(name, t);
  STD_TORCH_CHECK(same_shape(t, shape), "selective_scan: ", name, " must have shape ", shape_str(shape),
                  ", got ", shape_of(t));
  STD_TORCH_CHECK(t.scalar_type() == dtype, "selective_scan: ", name, " must have dtype ",
                  dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
}

// The same checks for operators that name themselves (`op`: "ssd_scan_fwd", ...), in the order
// and words of the Python checks (ssmops/ops/_checks.py): dtype, then shape, then device.
inline std::string dtypes_str(const std::vector<ST>& dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i) s += (i ? " or " : "") + std::string(dtype_name(dtypes[i]));
  return s;
}

inline void check_dtype_of(const char* op, const char* name, const Tensor& t, const std::vector<ST>& dtypes) {
  bool ok = false;
  for (ST d : dtypes) ok = ok || t.scalar_type() == d;
  STD_TORCH_CHECK(ok, op, ": ", name, " must have dtype ", dtypes_str(dtypes), ", got ", dtype_name(t.scalar_type()));
}

inline void check_tensor_of(const char* op, const char* name, const Tensor& t, const std::vector<ST>& dtypes,
                            const std::vector<int64_t>& shape, const char* like) {
  check_dtype_of(op, name, t, dtypes);
  STD_TORCH_CHECK(same_shape(t, shape), op, ": ", name, " must have shape ", shape_str(shape), ", got ",
                  shape_of(t), " (its sizes follow ", like, ")");
  STD_TORCH_CHECK(t.is_cpu(), op, ": ", name, " must be on cpu like ", like, ", got another device");
}

// (asks the dispatcher only when t is strided: a decoding step makes ~100 calls per token)
inline Tensor contig(const Tensor& t) { return t.is_contiguous() ? t : torch::stable::contiguous(t); }
inline OptTensor contig(const OptTensor& t) { return t ? OptTensor(contig(*t)) : std::nullopt; }

inline Tensor empty_like_shape(const Tensor& like, const std::vector<int64_t>& shape, ST dtype) {
  return torch::stable::new_empty(like, shape, dtype);
}

// float32 already: no call (stable `to` goes through the dispatcher by name, ~1 us; a decoding
// step makes ~7 of these per layer per token)
inline Tensor as_f32(const Tensor& t) {
  return contig(t.scalar_type() == ST::Float ? t : torch::stable::to(t, ST::Float));
}

}  // namespace ssmops_cpu
