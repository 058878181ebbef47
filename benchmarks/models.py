"""Mamba language models on ssmops against transformers' PyTorch path, same weights.

    python benchmarks/models.py [--family mamba1|mamba2|all] [--threads 2] [--quick] [--profile] [--no-compile]

Two 130M-shaped models with random weights, built with transformers and converted with
`MambaLMHeadModel.from_hf` (--quick: d_model 256, 4 layers):

* Mamba-1, mamba-130m's shape: MambaForCausalLM, d_model 768, 24 layers, d_state 16,
  vocab 50280, 256-token prompt;
* Mamba-2, mamba2-130m's shape: Mamba2ForCausalLM, d_model 768, 24 layers, d_state 128,
  headdim 64, expand 2, 1 group, chunk 256, vocab 50280, 512-token prompt.

fp32, batch 1, inference mode. Measured:

* prefill tokens/s: one forward over the prompt that also fills the decoding cache
  (ours: the scan operator with its last state; transformers: its own path, which on
  CPU without mamba_ssm kernels is its pure-PyTorch scan);
* decode tokens/s: greedy generation of N new tokens after that prompt, timed as
  (time for N tokens - time for 1 token) / (N - 1), so prefill is excluded;
  ours is one decoding step per layer per token, eager, and with `cg=True` (the whole step one
  compiled graph, compiled before timing).

`--profile` adds, for each model, where one ssmops decoding token's time goes (torch.profiler,
the operators with the most self time over 8 tokens).

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


def build(family: str, quick: bool):
    """(transformers model, ssmops model, prompt length) for one family, same weights."""
    import transformers

    shape = dict(hidden_size=256, num_hidden_layers=4) if quick else dict(hidden_size=768, num_hidden_layers=24)
    torch.manual_seed(0)
    if family == "mamba1":
        config = transformers.MambaConfig(vocab_size=50280, state_size=16, expand=2, conv_kernel=4, **shape)
        hf, prompt_len = transformers.MambaForCausalLM(config), 256
    else:
        config = transformers.Mamba2Config(
            vocab_size=50280, state_size=128, expand=2, head_dim=64, num_heads=2 * shape["hidden_size"] // 64,
            n_groups=1, chunk_size=256, conv_kernel=4, tie_word_embeddings=True, **shape)
        hf, prompt_len = transformers.Mamba2ForCausalLM(config), 512
    hf.eval().generation_config.eos_token_id = None  # decode the full length, as ours does
    return hf, MambaLMHeadModel.from_hf(hf).eval(), prompt_len // 2 if quick else prompt_len


def profile_decode(model, prompt, tokens: int = 8, top: int = 8) -> None:
    """Where a decoding token's time goes: the operators with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    params = InferenceParams(max_seqlen=prompt.shape[1] + tokens + 1, max_batch_size=1)
    model(prompt, inference_params=params, num_last_tokens=1)
    params.seqlen_offset = prompt.shape[1]
    token = prompt[:, -1:]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(tokens):
            model(token, inference_params=params)
            params.seqlen_offset += 1
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    print(f"  one decoding token: {total / tokens / 1e3:.2f} ms of operator self time; the largest shares:")
    for e in events[:top]:
        ms, share = e.self_cpu_time_total / tokens / 1e3, 100 * e.self_cpu_time_total / total
        print(f"    {e.key:40s} {ms:7.2f} ms  {share:5.1f}%  ({e.count // tokens} calls)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["mamba1", "mamba2", "all"], default="all")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="smaller models and shorter prompts")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after a warm-up (median)")
    parser.add_argument("--profile", action="store_true", help="profile ssmops' decoding token")
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled step (cg=True)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks/models.py compares with transformers: pip install transformers")
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; ssmops backends: "
          f"{', '.join(k for k, v in ssmops.available_backends().items() if v == 'available')}")
    for family in ("mamba1", "mamba2") if args.family == "all" else (args.family,):
        compare(family, args)


def compare(family: str, args) -> None:
    hf, ours, prompt_len = build(family, args.quick)
    n_params = sum(p.numel() for p in ours.parameters())
    new_tokens = 16 if args.quick else 32
    mixer = ours.config.ssm_cfg.get("layer", "Mamba1")
    print(f"\n== {mixer}: d_model {ours.config.d_model}, {ours.config.n_layer} layers, vocab "
          f"{ours.config.vocab_size}, {n_params / 1e6:.0f}M parameters, fp32, batch 1")
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 50280, (1, prompt_len), generator=gen)

    def ours_prefill(ids):
        params = InferenceParams(max_seqlen=ids.shape[1] + 1, max_batch_size=1)
        return ours(ids, inference_params=params, num_last_tokens=1).logits

    def hf_prefill(ids):
        return hf(ids, use_cache=True, logits_to_keep=1).logits

    def ours_generate(ids, n, cg=False):
        return ours.generate(ids, max_length=ids.shape[1] + n, cg=cg)

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
        if not args.no_compile:
            ours_generate(prompt, 2, cg=True)  # compiles the step
            t_one = time_call(lambda: ours_generate(prompt, 1, cg=True), args.repeats)
            t_many = time_call(lambda: ours_generate(prompt, new_tokens, cg=True), args.repeats)
            compiled_decode = (new_tokens - 1) / max(t_many - t_one, 1e-9)
        short = prompt[:, :16]
        t_one = time_call(lambda: ours_generate(short, 1), args.repeats)
        t_many = time_call(lambda: ours_generate(short, new_tokens), args.repeats)
        ours_short_decode = (new_tokens - 1) / max(t_many - t_one, 1e-9)

        print(f"prefill: {prompt_len}-token prompt; decode: {new_tokens} new tokens after it (greedy)")
        print(f"  {'':14s} {'prefill tok/s':>14s} {'decode tok/s':>13s}")
        for name, (pre, dec) in rows.items():
            print(f"  {name:14s} {pre:14.1f} {dec:13.1f}")
        (op, od), (hp, hd) = rows["ssmops"], rows["transformers"]
        print(f"  {'ratio':14s} {op / hp:13.2f}x {od / hd:12.2f}x   (ssmops / transformers)")
        if not args.no_compile:
            print(f"ssmops decode with cg=True (the step as one compiled graph): {compiled_decode:.1f} tok/s, "
                  f"{compiled_decode / hd:.2f}x transformers")
        print(f"ssmops decode after a 16-token prompt: {ours_short_decode:.1f} tok/s (after {prompt_len}: {od:.1f}); "
              "the decode step does not read the prompt, so a gap here is timing noise (see the load average)")
        if args.profile:
            profile_decode(ours, prompt)


if __name__ == "__main__":
    main()
