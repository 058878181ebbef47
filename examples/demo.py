"""ssmops demo: one Mamba-sized selective scan on every backend this machine has.

    make demo            (or: .venv/bin/python examples/demo.py [--seqlen N] [--threads N])

For each backend it prints the forward and forward+backward time and the largest
error against the reference implementation, relative to the reference's magnitude.
"""

from __future__ import annotations

import argparse
import time

import torch

import ssmops


def make_inputs(batch: int, dim: int, seqlen: int, dstate: int, dtype: torch.dtype) -> dict:
    """A Mamba-130M mixer's scan: variable B/C, D, z gating, delta_bias, softplus."""
    g = torch.Generator().manual_seed(0)
    return dict(
        u=torch.randn(batch, dim, seqlen, generator=g).to(dtype),
        delta=(torch.randn(batch, dim, seqlen, generator=g) * 0.5 - 2.0).to(dtype),
        A=-torch.arange(1, dstate + 1, dtype=torch.float32).repeat(dim, 1),
        B=torch.randn(batch, dstate, seqlen, generator=g).to(dtype),
        C=torch.randn(batch, dstate, seqlen, generator=g).to(dtype),
        D=torch.ones(dim),
        z=torch.randn(batch, dim, seqlen, generator=g).to(dtype),
        delta_bias=torch.rand(dim, generator=g) * 0.1,
        delta_softplus=True,
    )


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def forward_backward(fn, kw: dict):
    leaves = {k: v.detach().requires_grad_() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    y = fn(**{**kw, **leaves})
    y.float().square().mean().backward()
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--dim", type=int, default=1536)
    parser.add_argument("--seqlen", type=int, default=1024)
    parser.add_argument("--dstate", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kw = make_inputs(args.batch, args.dim, args.seqlen, args.dstate, getattr(torch, args.dtype))
    print(f"ssmops demo: torch {torch.__version__}, {args.threads} threads")
    print(f"selective scan: batch {args.batch}, dim {args.dim}, seqlen {args.seqlen}, dstate {args.dstate}, "
          f"{args.dtype}, variable B/C, D, z, delta_bias, softplus")
    print("backends:", ", ".join(f"{k}: {v}" for k, v in ssmops.available_backends().items()))

    t_ref, (y_ref, g_ref) = timed(lambda: forward_backward(ssmops.selective_scan_ref, kw))
    print(f"\nreference (a Python step per timestep): forward+backward {t_ref * 1e3:.0f} ms")
    print(f"\n{'backend':10s} {'forward':>10s} {'fwd+bwd':>10s} {'speed-up':>9s} {'err out':>9s} {'err grads':>10s}")
    for name, status in ssmops.available_backends().items():
        if status != "available":
            continue
        with ssmops.use_backend(name):
            forward_backward(ssmops.selective_scan_fn, kw)  # warm-up
            with torch.no_grad():
                t_fwd, _ = timed(lambda: ssmops.selective_scan_fn(**kw))
            t_all, (y, grads) = timed(lambda: forward_backward(ssmops.selective_scan_fn, kw))
        err_grads = max(rel_err(grads[k], g_ref[k]) for k in grads)
        print(f"{name:10s} {t_fwd * 1e3:8.1f} ms {t_all * 1e3:8.1f} ms {t_ref / t_all:8.1f}x "
              f"{rel_err(y, y_ref):9.1e} {err_grads:10.1e}")
    print("\nerrors are max |backend - reference| / max |reference| over the output and every gradient")


if __name__ == "__main__":
    main()
