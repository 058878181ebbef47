"""The launchers' kernels compiled for a GPU target ahead of time, on a machine without one.

Triton compiles for a named target (`GPUTarget`) without its driver, and its wheel carries
NVIDIA's `cuobjdump`. This records the launches the families' launchers (`<family>/triton.py`) make for given
inputs (their argument dtypes, tile sizes and warps) instead of running them, compiles each
one as Triton's launcher would, and reads off the result: registers, spills and, for
NVIDIA, the instructions of the innermost loop. tests/test_triton.py checks the kernels
with it; benchmarks/triton_static.py estimates their speed from it. (A tool of the tests and the
benchmarks, outside the package: it patches the package's launch site.)
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import subprocess
import tempfile
from typing import Iterator

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile

from ssmops.ops import _triton
from ssmops.ops.selective_scan import triton as scan_triton
from ssmops.ops.ssd import triton as ssd_triton

TARGETS = {"sm90": ("cuda", 90, 32), "sm80": ("cuda", 80, 32), "gfx942": ("hip", "gfx942", 64)}
_POINTER_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.int32: "*i32",
                  torch.int64: "*i64"}


@contextlib.contextmanager
def recorded_launches() -> Iterator[list]:
    """Within it, the launchers append (kernel, args, meta) to the list it yields, launching nothing."""
    launches: list = []
    launch = _triton.launch
    _triton.launch = lambda kernel, grid, args, meta: launches.append((kernel, args, meta))
    try:
        yield launches
    finally:
        _triton.launch = launch


def record_scan(fwd_args: tuple, **knobs) -> list:
    """The forward and backward launches for the arguments of `ssmops::selective_scan_fwd` (CPU
    tensors will do), with the launchers' default knobs but those given (e.g. BACKWARD_ATOMIC=True: the
    backward's dB/dC added atomically)."""
    knobs = scan_triton.TUNER.defaults() | knobs
    with recorded_launches() as launches:
        out, x, out_z, last = scan_triton.selective_scan_fwd(*fwd_args, knobs)
        scan_triton.selective_scan_bwd(*fwd_args[:9], torch.ones_like(out), x, torch.ones_like(last), fwd_args[9],
                                       knobs)
    return launches


def record_ssd(fwd_args: tuple) -> list:
    """The forward and backward launches for the arguments of `ssmops::ssd_scan_fwd` (CPU tensors will
    do), as autograd makes them (the output before the gate kept), the backward given every cotangent the
    forward's outputs can have."""
    with recorded_launches() as launches:
        out, final, states, varlen, ungated = ssd_triton.ssd_fwd(*fwd_args, True)
        ssd_triton.ssd_bwd(*fwd_args, torch.ones_like(out), states, torch.ones_like(final),
                           torch.ones_like(varlen) if fwd_args[10] is not None else None,
                           ungated if ungated.numel() else None)
    return launches


def compile_launch(kernel, args: tuple, meta: dict, target: str):
    """Compiles one recorded launch for TARGETS[target] as Triton's launcher would: an int equal
    to 1 becomes a constant, and pointers and ints divisible by 16 are marked so (which lets
    loads be vectorized)."""
    constants = dict(meta)
    options = {k: constants.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in constants}
    signature, attrs = {name: "constexpr" for name in constants}, {}
    for i, (name, arg) in enumerate(zip(kernel.arg_names, args)):
        if isinstance(arg, torch.Tensor):
            signature[name], aligned = _POINTER_TYPES[arg.dtype], arg.data_ptr() % 16 == 0
        elif isinstance(arg, float):
            signature[name], aligned = "fp32", False
        elif arg == 1:
            signature[name], constants[name], aligned = "constexpr", 1, False
        else:
            signature[name], aligned = ("i32" if -(2**31) <= arg < 2**31 else "i64"), arg % 16 == 0
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    if sorted(signature) != sorted(kernel.arg_names):
        raise ValueError(f"the launch of {kernel.__name__} does not fill its arguments")
    signature = {name: signature[name] for name in kernel.arg_names}
    return compile(ASTSource(kernel, signature, constants, attrs), target=GPUTarget(*TARGETS[target]),
                   options=options)


class _TargetDriver:
    """Stands in for Triton's active driver where torch asks it only for the target to compile for."""

    def __init__(self, target: str):
        self.target = GPUTarget(*TARGETS[target])

    def get_current_target(self) -> GPUTarget:
        return self.target


def written_arguments(kernel, args: tuple, meta: dict, target: str = "sm90") -> list[str]:
    """The arguments of one recorded launch that torch finds the kernel writes (its analysis of the
    kernel's TTIR for TARGETS[target]): the tensors that torch.compile and AOTInductor copy before the
    launch, and that AOTAutograd takes as mutated inputs of a graph."""
    from torch._higher_order_ops.triton_kernel_wrap import get_mutated_tensors, kernel_side_table

    constants = {name: value for name, value in meta.items() if name in kernel.arg_names}
    driver = triton.runtime.driver
    active = driver._active  # (None where no driver was asked for yet; a machine without a GPU has none)
    driver.set_active(_TargetDriver(target))
    try:
        return get_mutated_tensors(kernel_side_table.add_kernel(kernel), kernel_side_table.add_constant_args(constants),
                                   dict(zip(kernel.arg_names, args)), {})
    finally:
        driver._active = active


def _cuobjdump(compiled, flag: str) -> str:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def resource_usage(compiled) -> dict:
    """Registers per thread and bytes spilled to memory."""
    if "amdgcn" in compiled.asm:
        text = compiled.asm["amdgcn"]

        def field(key: str) -> int:
            return int(re.search(rf"\.{key}:\s+(\d+)", text).group(1))

        # spilled scalar registers go to vector registers, not memory: only vector spills count
        return dict(regs=field("vgpr_count"), spills=field("vgpr_spill_count"))
    usage = _cuobjdump(compiled, "--dump-resource-usage")
    regs, stack, local = re.search(r"REG:(\d+) STACK:(\d+) .*LOCAL:(\d+)", usage).groups()
    return dict(regs=int(regs), spills=int(stack) + int(local))


def sass_instructions(compiled) -> list:
    """An NVIDIA kernel's SASS instructions, (address, text) each, predicate included."""
    instructions = []
    for line in _cuobjdump(compiled, "-sass").splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            instructions.append((int(m.group(1), 16), m.group(2)))
    return instructions


def opcode(instruction: str) -> str:
    """A SASS instruction's operation without its predicate and modifiers: `@P0 LDG.E.128 R4, ...` -> `LDG`."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def load_use_distances(compiled, loop: dict) -> list:
    """For each global load (LDG) in a loop of loop_nest's, the instructions from it to the first one in the
    loop's span that reads a register it loads (a load used only on a later trip is left out): how much
    of a load's latency a warp's own work can cover, to be multiplied by the warps that share a scheduler."""
    span = sass_instructions(compiled)[loop["start"]:loop["end"] + 1]
    distances = []
    for i, (_, text) in enumerate(span):
        load = re.match(r"(?:@!?U?P\w+\s+)?LDG\S*?(?:\.(64|128))?\s+R(\d+),", text)
        if not load:
            continue
        first = int(load.group(2))
        loaded = {f"R{first + k}" for k in range({"64": 2, "128": 4}.get(load.group(1), 1))}
        for j in range(i + 1, len(span)):
            operands = re.sub(r"^(?:@!?U?P\w+\s+)?\S+\s*", "", span[j][1]).split(",")
            read = operands if opcode(span[j][1]).startswith(("ST", "RED", "ATOM")) else operands[1:]
            if loaded & set(re.findall(r"\bR\d+\b", ",".join(read))):
                distances.append(j - i)
                break
    return distances


def loop_nest(compiled) -> list:
    """The loops of an NVIDIA kernel's SASS (backward-branching spans), each a dict: start and end
    (instruction indices), `inside` (the index of the loop it sits in directly, or None) and `own` (the
    opcode counts of its span less the loops inside it: what one trip issues besides their trips)."""
    instructions = sass_instructions(compiled)
    index = {address: i for i, (address, _) in enumerate(instructions)}
    spans = set()
    for i, (address, text) in enumerate(instructions):
        target = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            spans.add((index[int(target.group(1), 16)], i))
    loops = [dict(start=a, end=b) for a, b in sorted(spans, key=lambda span: (span[0], -span[1]))]
    for loop in loops:
        around = [j for j, other in enumerate(loops) if other is not loop and other["start"] <= loop["start"]
                  and loop["end"] <= other["end"]]
        loop["inside"] = max(around, key=lambda j: loops[j]["start"], default=None)
    for i, loop in enumerate(loops):
        body = set(range(loop["start"], loop["end"] + 1))
        for other in loops:
            if other["inside"] == i:
                body -= set(range(other["start"], other["end"] + 1))
        loop["own"] = collections.Counter(opcode(instructions[k][1]) for k in body)
    return loops


def gemm_loop(compiled) -> dict | None:
    """The tensor-core loop of an NVIDIA kernel (of loop_nest's): the shortest loop with an MMA (HMMA or HGMMA)
    of its own, or None."""
    return min((loop for loop in loop_nest(compiled) if loop["own"]["HMMA"] + loop["own"]["HGMMA"]),
               key=lambda loop: loop["end"] - loop["start"], default=None)


def sass_opcodes(compiled) -> collections.Counter:
    """Opcode counts of an NVIDIA kernel's whole SASS (static, not weighted by loop trips): which
    tensor-core instruction it uses (HGMMA, Hopper's warpgroup MMA, or HMMA, the warp-level mma.sync)."""
    return collections.Counter(opcode(text) for _, text in sass_instructions(compiled))
