// The portable build of ssd_kernel.h: baseline flags (SSE2 on x86-64, NEON on aarch64).
#define SSD_W 4
#define SSD_ISA generic
#include "ssd_kernel.h"
