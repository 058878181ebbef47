"""What every family's Triton backend shares: the one launch site, the operators' functionalization
on CPU tensors, and the JIT helpers of more than one kernel. Imports Triton: only a family's
`triton.py` (imported by the registry where Triton can run) imports this.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake
from torch.library import wrap_triton

from ._family import GPU_DEVICES, traced

LOG2E = tl.constexpr(1.4426950408889634)  # a JIT function reads only constexpr globals
LN2 = tl.constexpr(0.6931471805599453)
# Under TRITON_INTERPRET=1 (read at import, as Triton does) tl.dot mistakes bfloat16 operands for
# integers (Triton 3.9): kernels then multiply 16-bit operands as float32, which is exact.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes"))


def launch(kernel, grid: tuple, args: tuple, meta: dict) -> None:
    """Launches a GPU kernel: directly in eager mode, through `wrap_triton` while something traces (torch.compile,
    export, make_fx: `traced`), so that the tracer records the launch itself; under the interpreter, directly;
    refuses CPU tensors otherwise. (The one place kernels are launched: benchmarks/triton_aot.py's
    `recorded_launches` replaces it to compile the exact launches for GPU targets ahead of time, without a GPU;
    call it as `_triton.launch`.)"""
    if INTERPRETED:  # nothing traces an interpreted kernel (keep_opaque_on_cpu), and torch <= 2.11's
        kernel[grid](*args, **meta)  # wrap_triton takes JIT functions only
        return
    first = args[0]
    if first.device.type not in GPU_DEVICES:
        # (SSMOPS_BACKEND=triton or use_backend("triton") with CPU tensors on a machine with a GPU)
        raise ValueError(
            f"ssmops' Triton kernels take GPU tensors (CUDA, ROCm or XPU), but {kernel.fn.__name__}'s "
            f"{kernel.arg_names[0].removesuffix('_ptr')} is on {first.device}: move the inputs to the GPU, or run "
            "CPU tensors on the cpu or default backend, or under Triton's interpreter (TRITON_INTERPRET=1 set "
            "before Python starts)")
    if traced():  # (maxnreg, a ptxas option, is not among the launch options torch carries into a graph: a
        # traced launch leaves the registers to ptxas)
        wrap_triton(kernel)[grid](*args, **{name: value for name, value in meta.items() if name != "maxnreg"})
    else:  # wrap_triton's eager launch goes through a higher-order operator: ~1 ms a launch (torch's own note)
        kernel[grid](*args, **meta)


def contiguous_when_traced(*tensors: Tensor | None) -> tuple:
    """The tensors a kernel reads, as a traced launch must pass them. A launch passes the strides it sees
    as numbers; under a tracer those are the fake tensors', and Inductor keeps an input's stride order but
    not always its exact strides (a Mamba-1 LM compiled on an H100 read a view in another layout:
    docs/limits.md). So under a tracer a non-contiguous input is copied first; eager launches read the
    real strides and copy nothing. (`clone`, as `contiguous` refuses fake CUDA tensors in CPU-only torch. An
    eager call skips the test of each tensor: is_fake costs ~3.5 us a tensor, and a launcher passes up to 10.)"""
    if not traced():
        return tensors
    return tuple(t.clone(memory_format=torch.contiguous_format)
                 if t is not None and is_fake(t) and not t.is_contiguous() else t for t in tensors)


_plans: dict = {}  # (plan maker, the arguments' signature) -> plan; see cached_plan
PLAN_CACHE_SIZE = 512  # signatures kept: a decoding loop has one per layer layout and batch size


class LaunchPlan(NamedTuple):
    """A decoding step's launch worked out from the arguments' sizes, strides, dtypes and devices: its grid,
    the kernel's integer arguments after the pointers, its constexprs, and the output's shape."""

    grid: tuple
    numbers: tuple
    meta: dict
    out_shape: tuple


def cached_plan(make, tensors: tuple, *flags):
    """make(*tensors, *flags): a launch worked out from the arguments' sizes, strides, dtypes and devices (its
    checks, tiles, grid, stride arguments), computed once per such signature and reused. A decoding step's
    kernel takes microseconds at batch 1, and its checks and arithmetic in Python as many again; reading the
    signature costs a fraction. Bad arguments raise every call (nothing is cached for them). While something
    traces, the sizes may be symbolic: worked out every call, as Inductor keeps what the trace records."""
    if traced():
        return make(*tensors, *flags)
    try:
        key = (make, *flags, *[None if t is None else (t.shape, t.stride(), t.dtype, t.device) for t in tensors])
    except AttributeError:  # not a tensor: make's checks say which
        return make(*tensors, *flags)
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= PLAN_CACHE_SIZE:
            _plans.clear()
        plan = _plans[key] = make(*tensors, *flags)
    return plan


NO_CAP = 1 << 30  # pow2_tile's `hi` where a tile takes a whole dimension


def cdiv(n, d: int):
    """ceil(n / d) of an int or a symbolic size. (triton.cdiv is a JIT function: ~3.4 us a call from Python,
    several a launcher's call.)"""
    return -(-n // d)


def pow2_tile(n, lo: int, hi: int) -> int:
    """The smallest power of two >= n, within [lo, hi]: a tile size. By comparisons, so that a symbolic n
    (torch.compile's dynamic seqlen) gives a plain int under a guard, where triton.next_power_of_2's
    bit operations would leave a sympy expression in the compiled code."""
    tile = lo
    while tile < hi and tile < n:
        tile *= 2
    return tile


def output(shape: tuple, dtype: torch.dtype, device: torch.device, zero: bool = False) -> Tensor:
    """A buffer for a kernel to write: 1-D, of the elements of a contiguous `shape`, which the launcher
    views as `shape` once the kernel has run. (Inductor copies each tensor a Triton kernel writes
    with its strides; torch 2.10-2.11 trace that copy of a tensor with a size-1 dimension ahead of a
    dynamic one, e.g. batch 1 at a dynamic seqlen, into two graphs of different lengths and fail,
    pytorch#181735. A 1-D buffer has no such dimension.)"""
    make = torch.zeros if zero else torch.empty
    return make(math.prod(shape), dtype=dtype, device=device)


def keep_opaque_on_cpu(op_def) -> None:
    """Under the interpreter the kernels cannot be traced (they are Python, not JIT functions),
    so for CPU tensors the functionalization rule keeps the operator whole instead of
    decomposing it into kernel launches; GPU tensors keep triton_op's decomposition."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    decompose = op_def._torch_dispatch_fns[FunctionalTensorMode]

    def rule(mode, op, types, args, kwargs):
        if isinstance(args[0], Tensor) and args[0].device.type not in GPU_DEVICES:
            return mode.__torch_dispatch__(op, types, args, kwargs)
        return decompose(mode, op, types, args, kwargs)

    op_def.register_torch_dispatch(FunctionalTensorMode, rule)


@triton.jit
def exp(x):
    # e^x as exp2(x log2(e)): a multiply and one ex2 (5 instructions on sm_90 for tl.exp, whose lowering also
    # rescales inputs whose results are subnormal; those flush to 0 here, beside float32's smallest normal)
    return tl.exp2(x * LOG2E)


@triton.jit
def positive_reciprocal(x):
    # 1 / x for x > 0 as rsqrt(x)^2, within 3 ulp (the approximate rsqrt's 2^-22.9 twice, and a rounding): two
    # instructions on sm_90, where `/` takes eight (a reciprocal and its range checks). +inf gives 0, NaN NaN.
    r = tl.math.rsqrt(x)
    return r * r


@triton.jit
def sigmoid(x):
    # 1 / (1 + e^-x) through `exp`: 9 instructions on sm_90, 12 for tl.sigmoid. (Through positive_reciprocal, 5,
    # but the Mamba-1 scans' compiles under Triton 3.6 then spilled inside their loops over time.)
    return 1.0 / (1.0 + exp(-x))


@triton.jit
def softplus(x):
    # torch.nn.functional.softplus with its default threshold of 20, as max(x, 0) + log1p(v), v = e^-|x| <= 1, and
    # log1p(v) = 2 atanh(s) = 2 s (1 + s^2/3 + s^4/5 + ...) with s = v / (2 + v) <= 1/3: seven terms leave less
    # than float32's rounding. ~18 instructions on sm_90, where log1p(exp(x)) through tl.log's polynomial and a
    # division correcting 1 + v's rounding took ~40, a share of a Mamba-1 scan's steps
    v = exp(-tl.abs(x))
    s = v * positive_reciprocal(2.0 + v)
    s2 = s * s
    series = 1.0 + s2 * (1 / 3 + s2 * (1 / 5 + s2 * (1 / 7 + s2 * (1 / 9 + s2 * (1 / 11 + s2 * (1 / 13))))))
    return tl.where(x <= 20.0, tl.maximum(x, 0.0) + 2.0 * s * series, x)
