// scan_kernel.h for AVX2 + FMA. Chosen at run time only on CPUs that have them.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")
#define SSM_W 8
#define SSM_NT 4
#define SSM_ISA avx2
#include "scan_kernel.h"
#pragma GCC pop_options
#endif
