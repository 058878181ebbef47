"""Decoding on CPU against the memory's read bandwidth: the Mamba LM's token loop with fp32, bf16 and
int8 weights, against transformers' PyTorch path and llama.cpp with the same weights.

    python benchmarks/decode.py [--family mamba1|mamba2] [--threads 2] [--quick] [--no-compile]
                                [--no-llama-cpp]

A decoding token reads every weight once, so its time is bounded below by (weight bytes read per
token) / (read bandwidth). The script measures the bandwidth in the same run, with `torch.sum` over
512 MiB (which reads at the memory's speed: a hand-written AVX2 loop read 28.5 GB/s where it read 28.0
on the machine this was written on), two ways, and prints the share of each bound:

* sustained: the sums timed exactly as the tokens are (below), taking turns with them: N sums of
  512 MiB, the fastest of `--repeats` runs less the fastest single sum, over N - 1. This is the rate
  of a "token" that does nothing but read its bytes, under the same noise and the same statistic, and
  the share the goals are read against. On a shared machine the bandwidth moves within seconds
  (single sums of the same bytes took 26-38 ms within a minute on a 2-vCPU Zen 3), so a bound set by
  the fastest single sum asks a token's average over N tokens to match the machine's best moment;
* peak: the fastest single sum (of five, before and after every turn) in those minutes, what this
  script printed before: the share of it is lower, by as much as the machine's noise.

For each weight format (`MambaLMHeadModel.convert_weights`) and batch size, the formats taking turns
so that the same minutes weigh on each:

* decode tokens/s per sequence: greedy generation of N new tokens after a 16-token prompt (ssmops,
  batch > 1: prompts of 16, 15, 14, ... tokens, decoded together, each at its own position), timed as
  (fastest time for N tokens - fastest time for 1 token) / (N - 1), so prefill is excluded (the
  prompts are short so that the prefill's noise, which the difference keeps, stays small); "eager"
  is `generate(...)`, "compiled" `generate(..., cg=True)` (one graph per token; compiled once before
  timing). A Mamba-1 model on CPU decodes through its own step either way (its layers in one operator
  call a token, `MambaLMHeadModel.decoding_step`), so its two rows time the same path; Mamba-2's
  eager rows step layer by layer;
* its share of each bound: tokens/s * weight bytes per token / bandwidth;
* prefill tokens/s (512-token prompt, batch 1);

and transformers' `MambaForCausalLM` / `Mamba2ForCausalLM` (random weights, converted to ssmops
with `from_hf`, so both run the same function) with fp32 weights. For Mamba-1, llama.cpp at batch 1
(llama-cpp-python as published, built for this CPU into build/peers on the first run: a compiler
and cmake, ~12 minutes on 2 cores): the same weights written as its GGUF file in f32 and in its
8-bit q8_0 (32 weights and a float16 scale a block), its logits for a prompt compared with ssmops'
first, its decoding timed as ssmops' is (greedy: a llama_decode and an argmax a token). Then a
profile of one fp32 token as `generate(..., cg=True)` runs it: where its time goes.

Model: mamba-130m's shape (d_model 768, 24 layers, d_state 16, vocab 50280, tied embeddings), or
with --family mamba2 mamba2-130m's (d_state 128, headdim 64); --quick: d_model 256, 4 layers.
Needs transformers (a test-only dependency of ssmops).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import read_bandwidth, seconds, time_call  # noqa: E402
from models import build  # noqa: E402
from ssmops.models import InferenceParams, MambaLMHeadModel  # noqa: E402
from ssmops.models.generation import COMPILED_STEP_LIMIT, token_step  # noqa: E402


def weight_bytes_per_token(model: MambaLMHeadModel) -> int:
    """Bytes a decoding token reads: every parameter and buffer once (a tied head is the embedding,
    read whole by the head), but an untied embedding only for its one row per sequence."""
    embedding = model.backbone.embedding.weight
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen or (t is embedding and model.lm_head.weight is not embedding):
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


def decode_rates(generators: dict, prompt, new_tokens: int, repeats: int, probe: torch.Tensor):
    """Tokens per second per sequence of each generator, prefill excluded, and the read bandwidth in
    the same minutes, (peak, sustained) in bytes/s. A rate is the fastest of `repeats` generations of
    new_tokens less the fastest of 1 (medians of 2 let the prefill's noise through). The difference
    keeps the prefill's noise, so the prompts are short: 8 prompts of ~60 tokens prefilled one by one
    moved by ~0.6 s between runs here, as much as 32 tokens take, and once gave a bf16 batch-8 rate of
    3.3x its bound. The generators take turns, and with them a reader of `probe` that sums it once a
    "token", timed the same way: its rate times the probe's bytes is the sustained bandwidth. The peak
    is the most that read_bandwidth measured before and after each turn: a shared machine's moved
    between 35 and 62 GB/s from one minute to the next here, so formats timed minutes apart were not
    comparable."""
    reader = "(read bandwidth)"
    generators = {**generators, reader: lambda ids, n: [probe.sum() for _ in range(n)]}
    for generate in generators.values():
        generate(prompt, new_tokens)
    t_one = {name: [] for name in generators}
    t_many = {name: [] for name in generators}
    peak = read_bandwidth(probe)
    for _ in range(repeats):
        for name, generate in generators.items():
            t_one[name].append(seconds(lambda: generate(prompt, 1)))
            t_many[name].append(seconds(lambda: generate(prompt, new_tokens)))
            peak = max(peak, read_bandwidth(probe))
    rates = {name: (new_tokens - 1) / max(min(t_many[name]) - min(t_one[name]), 1e-9) for name in generators}
    sustained = rates.pop(reader) * probe.numel() * probe.element_size()
    return rates, (peak, sustained)


class LlamaCppGenerator:
    """Greedy decoding with llama.cpp (llama-cpp-python's `Llama`, `threads` threads): each token is one
    `eval` (llama_decode) and the argmax of its logits, as llama.cpp's own simple example decodes."""

    def __init__(self, llama_cpp, path: Path, threads: int, n_ctx: int):
        self.llm = llama_cpp.Llama(str(path), n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def last_logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.n_vocab,))

    def prefill(self, ids: torch.Tensor) -> None:
        self.llm.reset()
        self.llm.eval(ids.flatten().tolist())

    def __call__(self, ids: torch.Tensor, new_tokens: int) -> list[int]:
        self.prefill(ids)
        out = []
        for i in range(new_tokens):
            out.append(int(self.last_logits().argmax()))
            if i + 1 < new_tokens:
                self.llm.eval(out[-1:])
        return out


def llama_cpp_generators(model: MambaLMHeadModel, prompt: torch.Tensor, long_prompt: torch.Tensor,
                         new_tokens: int, threads: int, repeats: int) -> dict:
    """{format: (generator, weight bytes per token, prefill tokens/s)} for llama.cpp's f32 and q8_0
    with the weights of `model` (fp32), after checking that its f32 logits for `prompt` are ssmops' and
    that its greedy tokens are the same (printed)."""
    import peers

    llama_cpp, gguf = peers.llama_cpp(), peers.gguf()
    folder = peers.PEERS_DIR / "gguf"
    folder.mkdir(parents=True, exist_ok=True)
    n_ctx = max(long_prompt.shape[1], prompt.shape[1] + new_tokens) + 8
    out = {}
    for weights in ("f32", "q8_0"):
        path = folder / f"mamba1-{model.config.d_model}x{model.config.n_layer}-{weights}.gguf"
        weight_bytes = peers.write_gguf(gguf, model, path, weights)
        generate = LlamaCppGenerator(llama_cpp, path, threads, n_ctx)
        prefill = long_prompt.shape[1] / time_call(lambda: generate.prefill(long_prompt), repeats)
        out[weights] = generate, weight_bytes, prefill
    f32 = out["f32"][0]
    f32.prefill(prompt)
    ours = model(prompt, num_last_tokens=1).logits[0, -1].numpy()
    ours_tokens = model.generate(prompt, max_length=prompt.shape[1] + new_tokens)[0, prompt.shape[1]:].tolist()
    print(f"  llama.cpp f32 against ssmops fp32: largest logit difference {np.abs(f32.last_logits() - ours).max():.2e} "
          f"(logits up to {np.abs(ours).max():.2f}); greedy tokens "
          f"{'the same' if f32(prompt, new_tokens) == ours_tokens else 'DIFFERENT'}")
    return out


# the operators that read the weights (the GEMVs, and Mamba-1's fused mixer step around its own)
WEIGHT_READERS = ("ssmops::weight_only_linear", "ssmops::mamba_step", "ssmops::mamba_layers_step")


def profile_token(model, prompt, bandwidth: float, tokens: int = 8, top: int = 8) -> None:
    """Where a decoding token's time goes, the token as generate(cg=True) runs those after its first."""
    from torch.profiler import ProfilerActivity, profile

    batch, prompt_len = prompt.shape
    params = InferenceParams(max_seqlen=prompt_len + tokens + 1, max_batch_size=batch)
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_LIMIT):
        model(prompt, inference_params=params, num_last_tokens=1)
        step, compiled = token_step(model, params.key_value_memory_dict, batch, prompt.device, cg=True)
        positions = torch.full((batch,), prompt_len)
        token = prompt[:, -1:]
        step(token, positions)  # compiled already; its guards checked on this one
        stance = torch.compiler.set_stance(skip_guard_eval_unsafe=True) if compiled else contextlib.nullcontext()
        t0 = time.perf_counter()
        with stance, profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(tokens):
                step(token, positions)
        wall = (time.perf_counter() - t0) / tokens
    events = [e for e in prof.key_averages() if not e.key.startswith(("Torch-Compiled Region", "CompiledFunction"))]
    events.sort(key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events) / tokens / 1e3
    how = "the compiled graph" if compiled else "MambaLMHeadModel.decoding_step"
    print(f"  one fp32 token ({how}): {wall * 1e3:.2f} ms under the profiler, {total:.2f} ms of it in operators "
          "and kernels; the largest:")
    for e in events[:top]:
        ms = e.self_cpu_time_total / tokens / 1e3
        print(f"    {e.key[:48]:48s} {ms:7.2f} ms  {100 * ms / total:5.1f}%  ({e.count // tokens} calls)")
    readers = sum(e.self_cpu_time_total for e in events if e.key in WEIGHT_READERS) / tokens / 1e3
    weight_bytes = weight_bytes_per_token(model)
    print(f"  {', '.join(WEIGHT_READERS)} read the {weight_bytes / 1e6:.1f} MB of weights in {readers:.2f} ms "
          f"({weight_bytes / readers / 1e6:.1f} GB/s, {weight_bytes / readers / 1e6 / (bandwidth / 1e9):.0%} of the "
          f"{bandwidth / 1e9:.1f} GB/s measured); everything else: {total - readers:.2f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", choices=["mamba1", "mamba2"], default="mamba1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a smaller model, fewer tokens")
    parser.add_argument("--no-compile", action="store_true", help="eager decoding only (no compiled rows)")
    parser.add_argument("--batches", default="1,8", help="batch sizes to decode (comma-separated)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs after a warm-up (fastest)")
    parser.add_argument("--no-llama-cpp", action="store_true",
                        help="skip llama.cpp's rows (Mamba-1 only; its first run builds llama-cpp-python, minutes)")
    args = parser.parse_args()
    with_llama_cpp = args.family == "mamba1" and not args.no_llama_cpp
    torch.set_num_threads(args.threads)
    try:
        import transformers
    except ImportError:
        sys.exit("benchmarks/decode.py compares with transformers: pip install transformers")
    hf, fp32_model, _ = build(args.family, args.quick)
    state = fp32_model.state_dict()
    batches = [int(b) for b in args.batches.split(",")]
    new_tokens, prompt_len, prefill_len = (12, 8, 128) if args.quick else (33, 16, 512)
    gen = torch.Generator().manual_seed(0)
    bandwidth_probe = torch.ones((128 if args.quick else 512) * 2**20 // 4)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} threads, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"read bandwidth, measured now: {read_bandwidth(bandwidth_probe) / 1e9:.1f} GB/s "
          "(the GB/s column below: measured around each group of rows timed together)")
    cfg = fp32_model.config
    print(f"model: {cfg.ssm_cfg.get('layer', 'Mamba1')}, d_model {cfg.d_model}, {cfg.n_layer} layers, vocab "
          f"{cfg.vocab_size}; decode: {new_tokens - 1} tokens after a {prompt_len}-token prompt (greedy); "
          f"prefill: {prefill_len} tokens, batch 1")
    print("\n  GB/s: the read bandwidth in the minutes of the row, sustained (timed as the tokens are) / peak "
          "(the fastest single sum); bound: the tokens/s that reading a token's weights at the sustained rate "
          "allows; of bound: decode tok/s as a share of the sustained / the peak bound")
    print(f"  {'':28s} {'batch':>5s} {'MB/token':>9s} {'GB/s':>9s} {'bound tok/s':>11s} {'decode tok/s':>12s} "
          f"{'of bound':>9s} {'prefill tok/s':>13s}")

    def row(name, weight_bytes, batch, rate, bandwidth, prefill=None):
        """Prints a row; returns (tokens/s, share of the sustained bound, share of the peak bound)."""
        peak, sustained = bandwidth
        of_sustained, of_peak = rate * weight_bytes / sustained, rate * weight_bytes / peak
        pre = f"{prefill:13.1f}" if prefill is not None else f"{'':13s}"
        print(f"  {name:28s} {batch:5d} {weight_bytes / 1e6:9.1f} {sustained / 1e9:4.1f}/{peak / 1e9:4.1f} "
              f"{sustained / weight_bytes:11.1f} {rate:12.1f} {100 * of_sustained:3.0f}%/{100 * of_peak:3.0f}% {pre}",
              flush=True)
        return rate, of_sustained, of_peak

    long_prompt = torch.randint(0, cfg.vocab_size, (1, prefill_len), generator=gen)
    results = {}
    with torch.inference_mode():
        hf_bytes = weight_bytes_per_token(fp32_model)
        for batch in batches:
            prompt = torch.randint(0, cfg.vocab_size, (batch, prompt_len), generator=gen)

            def hf_generate(ids, n):
                return hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

            prefill = None
            if batch == batches[0]:
                prefill = prefill_len / time_call(lambda: hf(long_prompt, use_cache=True, logits_to_keep=1),
                                                  args.repeats)
            rates, bandwidth = decode_rates({"hf": hf_generate}, prompt, new_tokens, args.repeats, bandwidth_probe)
            results["transformers", batch] = row("transformers (fp32)", hf_bytes, batch, rates["hf"], bandwidth,
                                                 prefill)
        llama = {}
        if with_llama_cpp:
            llama = llama_cpp_generators(fp32_model, torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=gen),
                                         long_prompt, new_tokens, args.threads, args.repeats)
        models, prefills = {}, {}
        for weights in ("fp32", "bf16", "int8"):
            model = models[weights] = MambaLMHeadModel(cfg).eval()
            model.load_state_dict(state)
            model.convert_weights(weights)
            prefills[weights] = prefill_len / time_call(
                lambda: model(long_prompt, inference_params=InferenceParams(prefill_len + 1, 1), num_last_tokens=1),
                args.repeats)
        for batch in batches:
            # several prompts at once, each with its own length (prefilled one by one)
            prompt = [torch.randint(0, cfg.vocab_size, (prompt_len - i % (prompt_len // 2),), generator=gen)
                      for i in range(batch)]
            for cg in (False,) if args.no_compile else (False, True):
                generators = {
                    weights: lambda ids, n, model=model, cg=cg: model.generate(ids, max_length=prompt_len + n, cg=cg)
                    for weights, model in models.items()}
                # llama.cpp takes turns with ssmops' fastest rows at batch 1, so that the same minutes weigh on both
                with_llama = batch == 1 and (cg or args.no_compile)
                if with_llama:
                    generators.update({f"llama.cpp {weights}": lambda ids, n, generate=generate: generate(ids[0], n)
                                       for weights, (generate, _, _) in llama.items()})
                rates, bandwidth = decode_rates(generators, prompt, new_tokens, args.repeats, bandwidth_probe)
                for weights, model in models.items():
                    results[weights, cg, batch] = row(f"ssmops {weights} {'compiled' if cg else 'eager'}",
                                                      weight_bytes_per_token(model), batch, rates[weights], bandwidth,
                                                      prefills[weights] if batch == batches[0] and not cg else None)
                for weights, (_, weight_bytes, prefill) in llama.items() if with_llama else ():
                    results["llama.cpp", weights] = row(f"llama.cpp {weights}", weight_bytes, batch,
                                                        rates[f"llama.cpp {weights}"], bandwidth, prefill)
        fp32_model = models["fp32"]
    b = batches[0]
    cg = not args.no_compile
    rate = {key: value[0] for key, value in results.items()}
    fp32, fp32_of_sustained, fp32_of_peak = results["fp32", cg, b]
    print(f"\nbatch {b}, {'compiled' if cg else 'eager'}: fp32 {100 * fp32_of_sustained:.0f}% of its sustained bound "
          f"({100 * fp32_of_peak:.0f}% of its peak bound), {fp32 / rate['transformers', b]:.2f}x transformers; "
          f"bf16 {rate['bf16', cg, b] / fp32:.2f}x fp32; int8 {rate['int8', cg, b] / fp32:.2f}x fp32 "
          "(goals at batch 1: fp32 >= 80% of its bound, int8 >= 2.5x fp32)")
    if ("llama.cpp", "f32") in results:
        _, llama_of_sustained, llama_of_peak = results["llama.cpp", "f32"]
        print(f"batch 1: llama.cpp f32 {rate['llama.cpp', 'f32'] / rate['fp32', cg, 1]:.2f}x ssmops fp32's tokens/s "
              f"({100 * llama_of_sustained:.0f}% of its sustained bound, {100 * llama_of_peak:.0f}% of its peak), "
              f"q8_0 {rate['llama.cpp', 'q8_0'] / rate['int8', cg, 1]:.2f}x ssmops int8's")
    for batch in batches[1:]:
        print(f"batch {batch}: tokens/s per sequence {rate['fp32', cg, batch] / fp32:.2f}x batch {b}'s (fp32), "
              f"{rate['int8', cg, batch] / rate['int8', cg, b]:.2f}x (int8)")
    if cg:
        profile_token(fp32_model, torch.randint(0, cfg.vocab_size, (b, prompt_len), generator=gen),
                      read_bandwidth(bandwidth_probe))


if __name__ == "__main__":
    main()
