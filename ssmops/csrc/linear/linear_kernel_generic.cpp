// The portable build of linear_kernel.h: baseline flags (SSE2 on x86-64, NEON on aarch64).
#define LIN_W 4
#define LIN_REGS 16
#define LIN_ISA generic
#include "linear_kernel.h"
