// state_update_kernel.h for AVX2 + FMA. Chosen at run time only on CPUs that have them.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")
#define SU_W 8
#define SU_ISA avx2
#include "state_update_kernel.h"
#pragma GCC pop_options
#endif
