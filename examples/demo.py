"""ssmops demo: the selective scan on every backend, then a Mamba language model that
generates, exports to an AOTInductor package and runs it.

    make demo      (or: .venv/bin/python examples/demo.py [--model CHECKPOINT_DIR] [--prompt TEXT])

1. One Mamba-sized scan on each backend this machine has: forward and forward+backward
   time, and the largest error against the reference implementation.
2. A Mamba LM (random weights and a byte-level vocabulary unless `--model` names a
   mamba_ssm or transformers checkpoint folder) generates from a prompt with the
   recurrent state, is packaged with AOTInductor, and the package is run; a table
   compares eager, torch.compile and the package on the same prompt.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import ssmops
import ssmops.export as sx
from ssmops.models import MambaConfig, MambaLMHeadModel


def scan_inputs(batch: int, dim: int, seqlen: int, dstate: int) -> dict:
    """A Mamba-130M mixer's scan: variable B/C, D, z gating, delta_bias, softplus."""
    g = torch.Generator().manual_seed(0)
    return dict(
        u=torch.randn(batch, dim, seqlen, generator=g),
        delta=torch.randn(batch, dim, seqlen, generator=g) * 0.5 - 2.0,
        A=-torch.arange(1, dstate + 1, dtype=torch.float32).repeat(dim, 1),
        B=torch.randn(batch, dstate, seqlen, generator=g),
        C=torch.randn(batch, dstate, seqlen, generator=g),
        D=torch.ones(dim),
        z=torch.randn(batch, dim, seqlen, generator=g),
        delta_bias=torch.rand(dim, generator=g) * 0.1,
        delta_softplus=True,
    )


def timed(fn):
    t0 = time.perf_counter()
    result = fn()
    return time.perf_counter() - t0, result


def forward_backward(fn, kw: dict):
    leaves = {k: v.detach().requires_grad_() for k, v in kw.items() if isinstance(v, torch.Tensor)}
    y = fn(**{**kw, **leaves})
    y.square().mean().backward()
    return y.detach(), {k: v.grad for k, v in leaves.items()}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def demo_operator(args) -> None:
    kw = scan_inputs(1, 1536, args.seqlen, 16)
    print(f"\n== 1. the operator: batch 1, dim 1536, seqlen {args.seqlen}, dstate 16, fp32 "
          "(variable B/C, D, z, delta_bias, softplus)")
    print("backends:", ", ".join(f"{k}: {v}" for k, v in ssmops.available_backends().items()))
    t_ref, (y_ref, g_ref) = timed(lambda: forward_backward(ssmops.selective_scan_ref, kw))
    print(f"reference (a Python step per timestep): forward+backward {t_ref * 1e3:.0f} ms")
    print(f"{'backend':10s} {'forward':>10s} {'fwd+bwd':>10s} {'vs ref':>8s} {'err out':>9s} {'err grads':>10s}")
    for name, status in ssmops.available_backends().items():
        if status != "available":
            continue
        with ssmops.use_backend(name):
            forward_backward(ssmops.selective_scan_fn, kw)  # warm-up
            with torch.no_grad():
                t_fwd, _ = timed(lambda: ssmops.selective_scan_fn(**kw))
            t_all, (y, grads) = timed(lambda: forward_backward(ssmops.selective_scan_fn, kw))
        err_grads = max(rel_err(grads[k], g_ref[k]) for k in grads)
        print(f"{name:10s} {t_fwd * 1e3:8.1f} ms {t_all * 1e3:8.1f} ms {t_ref / t_all:7.1f}x "
              f"{rel_err(y, y_ref):9.1e} {err_grads:10.1e}")
    print("(errors: max |backend - reference| / max |reference|, output and every gradient)")


class _Progress:
    """A transformers-style streamer: one line with the tokens so far and tokens/s."""

    def __init__(self, total: int):
        self.total, self.count, self.t0 = total, -1, None

    def put(self, tokens: torch.Tensor) -> None:
        if self.t0 is None:  # the prompt
            self.t0, self.count = time.perf_counter(), 0
            return
        self.count += 1
        rate = self.count / (time.perf_counter() - self.t0)
        print(f"\r  generating: {self.count}/{self.total} tokens, {rate:6.1f} tokens/s", end="", flush=True)

    def end(self) -> None:
        print()


class _Logits(nn.Module):
    """The LM as a tensor -> tensor function, for export."""

    def __init__(self, lm: MambaLMHeadModel):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids).logits


def demo_model(args) -> None:
    if args.model:
        lm = MambaLMHeadModel.from_pretrained(args.model).eval()
        source = args.model
    else:
        torch.manual_seed(0)
        lm = MambaLMHeadModel(MambaConfig(d_model=args.d_model, n_layer=args.n_layer, vocab_size=256)).eval()
        source = "random weights"
    cfg = lm.config
    n_params = sum(p.numel() for p in lm.parameters()) / 1e6
    print(f"\n== 2. a Mamba LM ({source}): d_model {cfg.d_model}, {cfg.n_layer} layers, "
          f"vocab {cfg.vocab_size}, {n_params:.1f}M parameters")
    prompt = torch.tensor([list(args.prompt.encode())], dtype=torch.long) % cfg.vocab_size
    total = prompt.shape[1] + args.new_tokens
    with torch.no_grad():
        t_gen, ids = timed(lambda: lm.generate(prompt, max_length=total, top_k=1, streamer=_Progress(args.new_tokens)))
    text = bytes(int(t) % 256 for t in ids[0, prompt.shape[1]:]).decode("utf-8", errors="replace")
    print(f"  prompt {args.prompt!r} -> {text!r}" + ("  (random weights: noise)" if not args.model else ""))
    print(f"  {args.new_tokens} tokens in {t_gen:.2f} s: {args.new_tokens / t_gen:.1f} tokens/s "
          "(recurrent state: the cost per token does not grow with the prompt)")

    model = _Logits(lm).eval()
    x = torch.randint(0, cfg.vocab_size, (1, args.bench_len), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        print("  exporting (seqlen dynamic) and compiling an AOTInductor package ...", end="", flush=True)
        t_pkg, package = timed(lambda: sx.aoti_package(sx.export_program(model, (x[:, :64],)), Path(tmp) / "lm.pt2"))
        print(f" {t_pkg:.0f} s")
        runner = torch._inductor.aoti_load_package(str(package))
        compiled = torch.compile(model, dynamic=True)
        with torch.no_grad():
            expected = model(x)
            err = rel_err(runner(x), expected)
            rows = {}
            for name, fn in (("eager", model), ("torch.compile", compiled), ("AOTInductor package", runner)):
                fn(x)  # warm-up (and compilation)
                rows[name] = min(timed(lambda: fn(x))[0] for _ in range(3))
    print(f"  the package's logits vs eager: relative error {err:.1e}")
    print(f"\n  forward over {args.bench_len} tokens (prefill), best of 3:")
    for name, t in rows.items():
        print(f"    {name:20s} {t * 1e3:8.1f} ms {args.bench_len / t:9.0f} tokens/s {rows['eager'] / t:6.2f}x eager")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqlen", type=int, default=1024, help="seqlen of the operator demo")
    parser.add_argument("--model", help="a mamba_ssm or transformers Mamba checkpoint folder")
    parser.add_argument("--prompt", default="The selective scan is")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--d-model", type=int, default=512, help="of the random-weight model")
    parser.add_argument("--n-layer", type=int, default=8, help="of the random-weight model")
    parser.add_argument("--bench-len", type=int, default=512, help="tokens in the speed comparison")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"ssmops demo: torch {torch.__version__}, {args.threads} threads")
    demo_operator(args)
    demo_model(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
