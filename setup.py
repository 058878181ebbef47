"""Builds ssmops/_C*.so, the C++ operator library, against LibTorch's stable ABI.

The library has no Python entry point: Python loads it with torch.ops.load_library
and a C++ program dlopens the same file. TORCH_TARGET_VERSION pins the stable API to
torch 2.10, so one build loads in every later torch. The extension is optional: if
it fails to compile the package still installs and runs on the `default` backend.
"""

import os
from pathlib import Path

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

# SSMOPS_SANITIZE=1 builds with AddressSanitizer and UndefinedBehaviorSanitizer (`make sanitize`).
SANITIZE = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined", "-fno-omit-frame-pointer", "-g"]
sanitize = os.environ.get("SSMOPS_SANITIZE") == "1"

setup(
    ext_modules=[
        CppExtension(
            "ssmops._C",
            # library.cpp: every schema; csrc/<family>/: that family's checks, kernels and CPU
            # registrations (a kernel_<isa>.cpp per instruction set, picked at run time).
            sources=sorted(str(p) for p in Path("ssmops/csrc").rglob("*.cpp")),
            depends=sorted(str(p) for p in Path("ssmops/csrc").rglob("*.h")),
            py_limited_api=True,
            optional=True,
            extra_link_args=SANITIZE if sanitize else [],
            # -g0: no debug information (Python's own CFLAGS ask for -g) unless sanitizing: it took a
            # quarter of the build's compile time and a release build does not ship it.
            extra_compile_args=(SANITIZE if sanitize else ["-g0"]) + [
                "-O1" if sanitize else "-O3",
                "-std=c++17",
                # -std=c++17 turns FMA contraction off; the kernels want it (no -ffast-math:
                # the NaN/inf handling and the fp16/bf16 rounding must stay exact).
                "-ffp-contract=fast",
                "-fno-math-errno",
                "-fvisibility=hidden",
                "-DTORCH_TARGET_VERSION=0x020a000000000000",
            ],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
    options={"bdist_wheel": {"py_limited_api": "cp39"}},
)
