"""Run time of a Mamba-style model on CPU: eager vs torch.compile vs an AOTInductor package.

    python benchmarks/deploy.py [--threads 2] [--layers 4] [--dim 256] [--seqlen 1024]

The package is built here with ssmops.export and loaded with aoti_load_package; its
ratio to eager is what issue "Deployment" asks for (>= 1.0 means no slower).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssmops  # noqa: E402
import ssmops.export as sx  # noqa: E402
from _common import time_call  # noqa: E402


class MixerLayer(nn.Module):
    """A Mamba-like mixer without the conv: projections, a selective scan, gating, residual."""

    def __init__(self, d_model: int, expand: int = 2, dstate: int = 16):
        super().__init__()
        d_inner, self.dstate = expand * d_model, dstate
        self.norm = nn.LayerNorm(d_model)
        self.in_proj = nn.Linear(d_model, 2 * d_inner, bias=False)
        self.x_proj = nn.Linear(d_inner, 2 * dstate + d_inner, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, dstate + 1).float()).repeat(d_inner, 1))
        self.D = nn.Parameter(torch.ones(d_inner))
        self.dt_bias = nn.Parameter(torch.full((d_inner,), -3.0))
        self.out_proj = nn.Linear(d_inner, d_model, bias=False)

    def forward(self, x):  # (batch, seqlen, d_model)
        xz = self.in_proj(self.norm(x)).transpose(1, 2)
        u, z = xz.chunk(2, dim=1)
        dt, B, C = self.x_proj(u.transpose(1, 2)).split([u.shape[1], self.dstate, self.dstate], dim=-1)
        y = ssmops.selective_scan_fn(u, dt.transpose(1, 2), -torch.exp(self.A_log), B.transpose(1, 2),
                                     C.transpose(1, 2), self.D, z, self.dt_bias, delta_softplus=True)
        return x + self.out_proj(y.transpose(1, 2))


def time_forward(fn, x) -> float:
    with torch.no_grad():
        fn(x)
        return time_call(lambda: fn(x), repeats=10)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = nn.Sequential(*[MixerLayer(args.dim) for _ in range(args.layers)]).eval()
    x = torch.randn(args.batch, args.seqlen, args.dim)
    print(f"{args.layers} mixer layers, d_model {args.dim}, batch {args.batch}, seqlen {args.seqlen}, "
          f"{args.threads} threads, cpu backend: {ssmops.available_backends()['cpu']}")
    results = {"eager": time_forward(model, x)}
    compiled = torch.compile(model, dynamic=True)
    results["torch.compile"] = time_forward(compiled, x)
    with tempfile.TemporaryDirectory() as tmp:
        ep = sx.export_program(model, (torch.randn(args.batch, 64, args.dim),))
        runner = torch._inductor.aoti_load_package(str(sx.aoti_package(ep, Path(tmp) / "model.pt2")))
        with torch.no_grad():
            torch.testing.assert_close(runner(x), model(x), rtol=1e-4, atol=1e-4)
        results["AOTInductor package"] = time_forward(runner, x)
    for name, t in results.items():
        print(f"  {name:20s} {t * 1e3:8.2f} ms   {results['eager'] / t:5.2f}x eager's speed")


if __name__ == "__main__":
    main()
