// The instruction set the CPU kernels run on: the best this CPU has, or SSMOPS_CPU_ISA's choice.
#pragma once

#include <torch/csrc/stable/library.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace ssmops_cpu {

enum class Isa { kGeneric, kAvx2, kAvx512 };

inline const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return "avx512";
    case Isa::kAvx2:
      return "avx2";
    default:
      return "generic";
  }
}

inline Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("fma"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
  return Isa::kGeneric;
}

// SSMOPS_CPU_ISA=avx512|avx2|generic (or scalar) forces a path, e.g. to test each one;
// asking for one this CPU lacks is an error rather than a crash.
inline Isa selected_isa() {
  const Isa best = best_isa();
  const char* env = std::getenv("SSMOPS_CPU_ISA");
  if (env == nullptr || *env == '\0' || std::strcmp(env, "auto") == 0) return best;
  const std::string want(env);
  Isa isa;
  if (want == "avx512")
    isa = Isa::kAvx512;
  else if (want == "avx2")
    isa = Isa::kAvx2;
  else if (want == "generic" || want == "scalar")
    isa = Isa::kGeneric;
  else
    STD_TORCH_CHECK(false, "SSMOPS_CPU_ISA must be auto, avx512, avx2 or generic, got '", want, "'");
  STD_TORCH_CHECK(static_cast<int>(isa) <= static_cast<int>(best), "SSMOPS_CPU_ISA=", want,
                  " but this CPU supports at most ", isa_name(best));
  return isa;
}

// One kernel among a family's builds name_generic, name_avx2 and name_avx512 (the AVX builds
// exist on x86-64 only): SSMOPS_ISA_KERNEL(isa, scan_fwd).
template <class Kernel>
Kernel kernel_for(Isa isa, Kernel generic, Kernel avx2, Kernel avx512) {
  return isa == Isa::kAvx512 ? avx512 : isa == Isa::kAvx2 ? avx2 : generic;
}
#if defined(__x86_64__)
#define SSMOPS_ISA_KERNEL(isa, name) ::ssmops_cpu::kernel_for(isa, name##_generic, name##_avx2, name##_avx512)
#else
#define SSMOPS_ISA_KERNEL(isa, name) name##_generic
#endif

}  // namespace ssmops_cpu
