"""transformers' own Mamba models, their path against ssmops' mixers (`ssmops.enable_transformers`).

    python benchmarks/transformers_integration.py [--family mamba|mamba2|all] [--shape 130m|small]
        [--prompt 512] [--tokens 32] [--threads 1]

One MambaForCausalLM and one Mamba2ForCausalLM with random weights (built from a config, nothing
downloaded), fp32, batch 1, CPU, inference mode. `--shape 130m` (default) is the shape of
state-spaces/mamba-130m-hf and mamba2-130m: d_model 768, 24 layers, vocab 50280; Mamba-1 d_state 16;
Mamba-2 d_state 128, headdim 64, 24 heads, one group, chunk 256. `--shape small` is d_model 256,
4 layers, vocab 1024 (Mamba-2 d_state 64, headdim 32, chunk 256), for a quick look.
The same model instance is timed twice: as transformers builds it (its
pure-PyTorch path when mamba_ssm / causal_conv1d are not installed) and after
`ssmops.integrations.transformers.to_ssmops(model)`. Measured:

* prefill tokens/s: one forward over the prompt that fills the cache (`use_cache=True`), with the
  logits of its last position only (`logits_to_keep=1`), as `generate`'s prefill computes them: the
  output head over all 512 positions (a 512 x 768 x 50280 product, ~45% of ssmops' Mamba-1 prefill
  at 130m) is the same work on either path and no part of a prefill's use;
* decode tokens/s: `generate` of N greedy tokens after the prompt, timed by a streamer from the
  first new token to the last (N - 1 tokens): prefill is excluded, generate's own per-token work
  included (a difference of two generate timings left the prefill's noise in it, as large as the
  decoding of 32 tokens on transformers' path);
* step/s: the model's forward on one token with the prompt's cache, N times (the mixers'
  decoding step without generate around it).

On a machine whose cores are shared, `--threads 1` gives steadier numbers: an OpenMP region
over 2 threads waits for a descheduled thread (a (512, 16) exp took 7.6 ms instead of 0.03 ms).
With one thread, `--clock cpu` times the process's CPU time instead of the wall clock: what the
work took, without the time other processes held the core (memory stalls still count).

Prints each speed and the ratio ssmops / transformers.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import time_call  # noqa: E402
from ssmops.integrations.transformers import from_ssmops, to_ssmops  # noqa: E402

SHAPES = {  # name -> (d_model, layers, vocab, Mamba-1 d_state, Mamba-2 (d_state, headdim))
    "130m": (768, 24, 50280, 16, (128, 64)),
    "small": (256, 4, 1024, 16, (64, 32)),
}


def build(family: str, shape: str):
    import transformers

    d_model, layers, vocab, d_state, (d_state2, headdim) = SHAPES[shape]
    common = dict(vocab_size=vocab, hidden_size=d_model, num_hidden_layers=layers, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    if family == "mamba":
        return transformers.MambaForCausalLM(transformers.MambaConfig(state_size=d_state, expand=2, **common)).eval()
    config = transformers.Mamba2Config(state_size=d_state2, expand=2, num_heads=2 * d_model // headdim,
                                       head_dim=headdim, n_groups=1, chunk_size=256, **common)
    return transformers.Mamba2ForCausalLM(config).eval()


class _TokenClock:
    """A `generate` streamer that only reads the clock: generate calls `put` with the prompt, then
    with each new token, so the times between the first and the last token are the decoding alone."""

    def __init__(self, clock):
        self.clock, self.times = clock, []

    def put(self, value) -> None:
        self.times.append(self.clock())

    def end(self) -> None:
        pass


def measure(model, prompt: torch.Tensor, tokens: int, repeats: int, clock) -> tuple[float, float, float]:
    """(prefill tokens/s, decode tokens/s through `generate`, one-token forward steps/s)."""
    mask = torch.ones_like(prompt)
    prefill = time_call(lambda: model(prompt, attention_mask=mask, use_cache=True, logits_to_keep=1), repeats, clock)

    def decode_seconds() -> float:
        streamer = _TokenClock(clock)
        model.generate(prompt, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                       streamer=streamer)
        return streamer.times[-1] - streamer.times[1]  # from the first new token (after prefill) to the last

    decode_seconds()  # warm-up
    decode = statistics.median(decode_seconds() for _ in range(repeats))
    cache = model(prompt, attention_mask=mask, use_cache=True).cache
    token = prompt[:, -1:]

    def steps():
        for _ in range(tokens):
            model(token, cache=cache, use_cache=True)

    return prompt.shape[1] / prefill, (tokens - 1) / decode, tokens / time_call(steps, repeats, clock)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=("mamba", "mamba2", "all"), default="all")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="130m")
    parser.add_argument("--prompt", type=int, default=512, help="prompt length (prefill)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens timed for decoding")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall clock, or this process's CPU time (with --threads 1 on shared cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    families = ("mamba", "mamba2") if args.family == "all" else (args.family,)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    prompt = torch.randint(1, SHAPES[args.shape][2], (1, args.prompt), generator=torch.Generator().manual_seed(0))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; shape {args.shape}; batch 1, "
          f"prompt {args.prompt}, {args.tokens} new tokens, fp32, {args.clock} clock\n")
    print(f"{'model':<20}{'':>10}{'transformers':>15}{'ssmops':>12}{'ratio':>8}")
    for family in families:
        model = build(family, args.shape)
        with torch.inference_mode():
            theirs = measure(from_ssmops(model), prompt, args.tokens, args.repeats, clock)
            ours = measure(to_ssmops(model), prompt, args.tokens, args.repeats, clock)
        name = type(model).__name__
        for label, t, o in zip(("prefill", "decode", "step"), theirs, ours):
            print(f"{name:<20}{label:>10}{t:>11.0f} t/s{o:>8.0f} t/s{o / t:>7.2f}x")
            name = ""


if __name__ == "__main__":
    main()
