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

inline Tensor contig(const Tensor& t) { return torch::stable::contiguous(t); }
inline OptTensor contig(const OptTensor& t) { return t ? OptTensor(contig(*t)) : std::nullopt; }

inline Tensor empty_like_shape(const Tensor& like, const std::vector<int64_t>& shape, ST dtype) {
  return torch::stable::new_empty(like, shape, dtype);
}

inline Tensor as_f32(const Tensor& t) { return contig(torch::stable::to(t, ST::Float)); }

}  // namespace ssmops_cpu
