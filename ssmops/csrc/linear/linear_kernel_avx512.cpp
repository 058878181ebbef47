// linear_kernel.h for AVX-512 (F, DQ, BW, VL, VNNI). Chosen at run time only on CPUs that have them
// (linear.cpp: an AVX-512 CPU without VNNI takes the AVX2 build).
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c,bmi,bmi2,popcnt")
#define LIN_W 16
#define LIN_REGS 32
#define LIN_ISA avx512
#include "linear_kernel.h"
#pragma GCC pop_options
#endif
