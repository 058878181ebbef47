// The portable build of scan_kernel.h: baseline flags (SSE2 on x86-64, NEON on aarch64).
#define SSM_W 4
#define SSM_NT 4
#define SSM_ISA generic
#include "scan_kernel.h"
