// The portable build of state_update_kernel.h: baseline flags (SSE2 on x86-64, NEON on aarch64).
#define SU_W 4
#define SU_ISA generic
#include "state_update_kernel.h"
