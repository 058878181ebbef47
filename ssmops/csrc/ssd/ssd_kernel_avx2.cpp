// ssd_kernel.h for AVX2 + FMA (also serves AVX-512 CPUs). Chosen at run time only on CPUs that have them.
#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,bmi,bmi2,popcnt")
#define SSD_W 8
#define SSD_ISA avx2
#include "ssd_kernel.h"
#pragma GCC pop_options
#endif
