"""The registry: loads the native library, registers every family's kernels per device, and
selects backends.

For each family of `ssmops.ops.FAMILIES` it defines the schemas the C++ library did not,
registers the fake kernels, the autograd formulas, the `default` kernels (every device)
and, where Triton can run, the Triton operators and kernels (GPU devices). Families never
import this module; the package's `__init__` imports it first.

By default the dispatcher picks a backend by device: the native `cpu` library for
CPU tensors when it is loaded, `triton` for CUDA/ROCm/XPU when Triton is installed,
`default` (pure PyTorch) everywhere else. Two ways to choose explicitly:

* `SSMOPS_BACKEND=default|cpu|triton` in the environment, read once at import: it
  decides what is registered for CPU tensors, so it holds for eager, torch.compile
  and torch.export alike (`default` leaves the native library unloaded; `triton`
  routes CPU tensors to the Triton kernels, for `TRITON_INTERPRET=1` testing).
* `with ssmops.use_backend(name):` for the current thread, in eager mode: every
  ssmops operator called inside runs on that backend, and so does the backward of a
  forward run inside, wherever the backward is called.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import threading
import warnings
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _native
from .ops import FAMILIES
from .ops._family import GPU_DEVICES, Family, Operator, traced

BACKEND_NAMES = ("default", "cpu", "triton")
ENV_VAR = "SSMOPS_BACKEND"


class NativeLibraryWarning(UserWarning):
    """The C++ operator library could not be loaded; CPU tensors use the `default` backend."""


def env_backend() -> str | None:
    name = os.environ.get(ENV_VAR) or None
    if name is not None and name not in BACKEND_NAMES:
        raise ValueError(f"{ENV_VAR} must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    return name


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# backend name -> None when usable, else the reason it is not
_unavailable: dict[str, str | None] = {"default": None}
# backend name -> {operator name: kernel}, what `use_backend` routes to
_kernels: dict[str, dict] = {"default": {}, "cpu": {}, "triton": {}}


def available_backends() -> dict[str, str]:
    """Each backend's status: 'available' or the reason it cannot run here."""
    return {name: _unavailable.get(name) or "available" for name in BACKEND_NAMES}


# --- loading ---------------------------------------------------------------------------


def _load_native() -> None:
    """Loads the C++ library unless SSMOPS_BACKEND asks for another CPU backend."""
    choice = env_backend()
    if choice in ("default", "triton"):
        _unavailable["cpu"] = f"not loaded because {ENV_VAR}={choice}"
        return
    reason = _native.load()
    _unavailable["cpu"] = reason
    if reason is None:
        return
    if choice == "cpu":
        raise ImportError(f"{ENV_VAR}=cpu but the native library failed to load: {reason}")
    warnings.warn(
        f"ssmops: the native CPU library is not available ({reason}); "
        "CPU tensors run on the pure-PyTorch 'default' backend.",
        NativeLibraryWarning,
        stacklevel=4,
    )


def _gpu_present() -> bool:
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or bool(xpu is not None and xpu.is_available())


def _triton_unavailable() -> str | None:
    """Why the Triton backend cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "No module named 'triton' (pip install 'ssmops[triton]')"
    if not (_gpu_present() or interpreting()):
        return "Triton runs CPU tensors only under TRITON_INTERPRET=1"
    try:
        import triton  # noqa: F401
    except ImportError as err:
        return f"Triton failed to import: {err}"
    return None


# --- registration ----------------------------------------------------------------------


def _on_backend_of_forward(autograd):
    """Wraps a family's (backward, setup_context) so that the backward runs on the backend its
    forward ran on (the `use_backend` in force at the forward)."""

    def wrapped(bwd_op):
        backward, setup_context = autograd(bwd_op)

        def setup(ctx, inputs, output):
            setup_context(ctx, inputs, output)
            ctx.backend = selected_backend()

        def run_backward(ctx, *grads):
            with use_backend(ctx.backend):
                return backward(ctx, *grads)

        return run_backward, setup

    return wrapped


def _register(op: Operator, lib: torch.library.Library) -> None:
    qualname = f"ssmops::{op.name}"
    torch.library.register_fake(qualname, op.fake, lib=lib)
    # `default` serves every device without a kernel of its own (the C++ library registered CPU's)
    torch.library.register_kernel(qualname, None, op.default, lib=lib)
    _kernels["default"][op.name] = op.default
    if op.autograd is not None:
        backward, setup_context = _on_backend_of_forward(op.autograd)(getattr(torch.ops.ssmops, op.backward).default)
        torch.library.register_autograd(qualname, backward, setup_context=setup_context, lib=lib)


def _register_triton(family: Family, lib: torch.library.Library) -> None:
    """The family's Triton operators get the main operators' fakes (an interpreted kernel must
    not run on fake tensors, and seqlen must stay symbolic) and autograd (a compiled backward
    graph then holds the Triton backward kernels too); the launchers become the main
    operators' GPU kernels (and CPU's under SSMOPS_BACKEND=triton, for the interpreter)."""
    from .ops import _triton

    module = importlib.import_module(family.triton)
    devices = list(GPU_DEVICES) + (["cpu"] if env_backend() == "triton" else [])
    for op in family.operators:
        if op.name not in module.TRITON_OPS:  # served by `default` on GPUs until it has a kernel
            continue
        triton_op = module.TRITON_OPS[op.name]
        triton_op.register_fake(op.fake)
        if op.autograd is not None:
            backward, setup_context = _on_backend_of_forward(op.autograd)(module.TRITON_OPS[op.backward])
            triton_op.register_autograd(backward, setup_context=setup_context)
        _triton.keep_opaque_on_cpu(triton_op)
        torch.library.register_kernel(f"ssmops::{op.name}", devices, module.KERNELS[op.name], lib=lib)
        _kernels["triton"][op.name] = module.KERNELS[op.name]
        _triton_ops[op.name] = getattr(torch.ops.ssmops, f"{op.name}_triton").default


_triton_ops: dict[str, object] = {}
_load_native()
_lib = torch.library.Library("ssmops", "FRAGMENT")  # kept alive for the process
_operators = [op for family in FAMILIES for op in family.operators]
for _op in _operators:  # every schema first: an autograd formula names another operator
    if hasattr(torch.ops.ssmops, _op.name):  # the C++ library defined it and registered its CPU kernel
        _kernels["cpu"][_op.name] = _native.kernel(_op.name)
    else:
        _lib.define(_op.schema)
for _op in _operators:
    _register(_op, _lib)
_main_ops = {op.name: getattr(torch.ops.ssmops, op.name).default for op in _operators}  # what operator_for returns


def load_triton() -> str | None:
    """Registers the families' Triton kernels where Triton can run (once); returns why it cannot, or None."""
    if _unavailable.get("triton", "") is None:
        return None
    _unavailable["triton"] = _triton_unavailable()
    if _unavailable["triton"] is None:
        for family in FAMILIES:
            if family.triton is not None:
                _register_triton(family, _lib)
    return _unavailable["triton"]


if load_triton() is not None and env_backend() == "triton":
    raise ImportError(f"{ENV_VAR}=triton but the Triton backend cannot run: {_unavailable['triton']}")


# --- selection -------------------------------------------------------------------------


def operator_for(name: str, t: torch.Tensor):
    """The operator a front end calls for `ssmops::{name}` on t's device: the one way a backend is chosen.

    Where the Triton backend serves t's device natively, its twin `ssmops::{name}_triton` (the same
    launcher, registered as a `torch.library.triton_op`, so that torch.compile and AOTInductor trace into
    its kernels instead of calling an opaque operator); everywhere else, and under an explicit
    `use_backend` in eager mode, the operator itself, whose dispatcher picks the backend by device.
    """
    op = _triton_ops.get(name)
    if op is None or t.device.type not in GPU_DEVICES:
        return _main_ops[name]
    if not torch.compiler.is_compiling() and selected_backend() not in (None, "triton"):
        return _main_ops[name]  # an explicit `use_backend` wins in eager mode
    return op


# what an eager call may pass straight to a Triton launcher: plain tensors (a subclass may dispatch itself)
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _direct_launcher(name: str, x: torch.Tensor, tensors: tuple):
    """The Triton launcher of `ssmops::{name}` (the operator's signature) when an eager call may run it itself,
    else None (the call then goes through the operator).

    Eager, on a GPU, the dispatcher's route to a Triton kernel is torch's custom-operator layers in Python,
    ~100 us a call for the decoding step (most of it torch._library.utils.fill_defaults, run by the
    in-place update's version bump: benchmarks/decode_overhead.py), ten times the kernel. A direct call is
    what that route ends in when it adds nothing: x on a GPU, `tensors` (the call's arguments; None and
    non-tensors are skipped) all plain, nothing tracing (Dynamo, fake or functional tensors, `use_backend`:
    `traced`), and no autograd asked for (grad mode off, or no tensor requiring grad). The caller bumps the
    version of what it mutates outside inference mode, as the dispatcher would."""
    kernel = _kernels["triton"].get(name)
    if kernel is None or x.device.type not in GPU_DEVICES or traced():
        return None
    for t in tensors:
        if t is not None and type(t) not in _PLAIN_TENSORS and isinstance(t, torch.Tensor):
            return None
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*tensors):
        return None
    return kernel


def call_step(name: str, x: torch.Tensor, tensors: tuple, flags: tuple, updated: torch.Tensor):
    """A decoding step's operator `ssmops::{name}(*tensors, *flags)`, which updates `updated` in place, called as
    its front end should: the Triton launcher itself where `_direct_launcher` allows it (bumping `updated`'s
    version outside inference mode, as the operator's in-place update would), else `operator_for`'s operator."""
    direct = _direct_launcher(name, x, tensors)
    if direct is None:
        return operator_for(name, x)(*tensors, *flags)
    if not torch.is_inference_mode_enabled():
        torch._C._increment_version((updated,))  # (a tensor alone would be iterated: a bump a row)
    return direct(*tensors, *flags)


def kernels(name: str) -> dict:
    reason = _unavailable.get(name)
    if reason:
        raise RuntimeError(f"ssmops backend {name!r} is not available: {reason}")
    return _kernels[name]


class _BackendMode(TorchDispatchMode):
    """Sends ssmops operators to one backend's kernels; lets everything else through, higher-order operators too
    (torch.cond; wrap_triton's launch, which a Triton kernel takes under the mode when it is still on the stack:
    as in a CUDA backward run inside the block, on torch 2.11)."""

    supports_higher_order_operators = True

    def __init__(self, name: str):
        super().__init__()
        self.kernels = {getattr(torch.ops.ssmops, op).default: fn for op, fn in kernels(name).items()}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return self.kernels.get(func, func)(*args, **(kwargs or {}))


_selected = threading.local()


def selected_backend() -> str | None:
    """The backend chosen by the innermost `use_backend` of this thread, if any."""
    stack = getattr(_selected, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def use_backend(name: str | None) -> Iterator[None]:
    """Runs every ssmops operator called inside the block (eager mode) on backend `name`
    (None: no override)."""
    if name is None:
        yield
        return
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    stack = _selected.__dict__.setdefault("stack", [])
    with _BackendMode(name):
        stack.append(name)
        try:
            yield
        finally:
            stack.pop()
