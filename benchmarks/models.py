"""The Mamba language model on ssmops against transformers' MambaForCausalLM, same weights.

    python benchmarks/models.py [--threads 2] [--quick]

A 130M-shaped model (d_model 768, 24 layers, vocab 50280, random weights; --quick: d_model
256, 4 layers) is built with transformers and converted with
`MambaLMHeadModel.from_hf`. fp32, batch 1, inference mode. Measured:

* prefill tokens/s: one forward over the prompt that also fills the decoding cache
  (ours: the scan operator with its last state; transformers: its own path, which on
  CPU without mamba_ssm kernels is its sequential scan);
* decode tokens/s: greedy generation of N new tokens after that prompt, timed as
  (time for N tokens - time for 1 token) / (N - 1), so prefill is excluded;
  ours is one `selective_state_update` per layer per token.

Needs transformers (a test-only dependency of ssmops). Speeds are printed as measured,
with ratios ours / transformers.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ssmops  # noqa: E402
from _common import time_call  # noqa: E402
from ssmops.models import InferenceParams, MambaLMHeadModel  # noqa: E402


def build(quick: bool):
    import transformers

    shape = dict(hidden_size=256, num_hidden_layers=4) if quick else dict(hidden_size=768, num_hidden_layers=24)
    config = transformers.MambaConfig(vocab_size=50280, state_size=16, expand=2, conv_kernel=4, **shape)
    torch.manual_seed(0)
    hf = transformers.MambaForCausalLM(config).eval()
    ours = MambaLMHeadModel.from_hf(hf).eval()
    return hf, ours


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smaller model and shorter prompts")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after a warm-up (median)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        hf, ours = build(args.quick)
    except ImportError:
        sys.exit("benchmarks/models.py compares with transformers: pip install transformers")
    import transformers

    n_params = sum(p.numel() for p in ours.parameters())
    prompt_len = 128 if args.quick else 256
    new_tokens = 16 if args.quick else 32
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; ssmops backends: "
          f"{', '.join(k for k, v in ssmops.available_backends().items() if v == 'available')}")
    print(f"model: d_model {ours.config.d_model}, {ours.config.n_layer} layers, vocab {ours.config.vocab_size}, "
          f"{n_params / 1e6:.0f}M parameters, fp32, batch 1")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50280, (1, prompt_len), generator=gen)

    def ours_prefill(ids):
        params = InferenceParams(max_seqlen=ids.shape[1] + 1, max_batch_size=1)
        return ours(ids, inference_params=params, num_last_tokens=1).logits

    def hf_prefill(ids):
        return hf(ids, use_cache=True, logits_to_keep=1).logits

    def ours_generate(ids, n):
        return ours.generate(ids, max_length=ids.shape[1] + n)

    def hf_generate(ids, n):
        return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    with torch.inference_mode():
        # same weights, same function: check before timing
        ours_logits, hf_logits = ours_prefill(prompt[:, :32]), hf_prefill(prompt[:, :32])
        err = (ours_logits.float() - hf_logits.float()).abs().max().item()
        scale = hf_logits.float().abs().max().item()
        print(f"same weights, 32-token prompt: max |logits difference| {err:.2e} (max |logit| {scale:.1f})")

        rows = {}
        contenders = (("ssmops", ours_prefill, ours_generate), ("transformers", hf_prefill, hf_generate))
        for name, prefill, generate in contenders:
            t_prefill = time_call(lambda: prefill(prompt), args.repeats)
            t_one = time_call(lambda: generate(prompt, 1), args.repeats)
            t_many = time_call(lambda: generate(prompt, new_tokens), args.repeats)
            rows[name] = (prompt_len / t_prefill, (new_tokens - 1) / max(t_many - t_one, 1e-9))
        short = prompt[:, :16]
        t_one = time_call(lambda: ours_generate(short, 1), args.repeats)
        t_many = time_call(lambda: ours_generate(short, new_tokens), args.repeats)
        ours_short_decode = (new_tokens - 1) / max(t_many - t_one, 1e-9)

    print(f"\nprefill: {prompt_len}-token prompt; decode: {new_tokens} new tokens after it (greedy)")
    print(f"  {'':14s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
    for name, (pre, dec) in rows.items():
        print(f"  {name:14s} {pre:14.1f} {dec:13.1f}")
    (op, od), (hp, hd) = rows["ssmops"], rows["transformers"]
    print(f"  {'ratio':14s} {op / hp:13.2f}x {od / hd:12.2f}x   (ssmops / transformers)")
    print(f"\nssmops decode after a 16-token prompt: {ours_short_decode:.1f} tok/s (after {prompt_len}: {od:.1f}); "
          "the decode step does not read the prompt, so a gap here is timing noise (see the load average)")


if __name__ == "__main__":
    main()
