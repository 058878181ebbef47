// linear_kernel.h for AVX2 + FMA (+ F16C for float16 weights). Chosen at run time only on CPUs that have them.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,bmi,bmi2,popcnt")
#define LIN_W 8
#define LIN_REGS 16
#define LIN_ISA avx2
#include "linear_kernel.h"
#pragma GCC pop_options
#endif
