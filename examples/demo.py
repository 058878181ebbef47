"""ssmops demo: train a small byte-level Mamba LM on CPU, generate text with it, export it to an
AOTInductor package, run that from C++, and time the scan's backends.

    make demo      (or: .venv/bin/python examples/demo.py [--steps 100] [--out build/demo])

1. Train a Mamba LM (bytes as tokens) on CPython's own documentation text (`pydoc_data.topics`,
   on every Python install) with `torch.compile(fullgraph=True)` on the native CPU backend; a
   held-out slice of the text is scored before and after.
2. Generate from a prompt with the recurrent state (one decoding step per token).
3. Export the trained model with `ssmops.export` as an AOTInductor package, check it against
   eager, and run it in the C++ runner (examples/cpp) when CMake and a compiler are present.
4. Time the scan's backends at one of the model's layers.

The weights (mamba_ssm's layout, so `ssmops generate OUT --prompt ...` reads them) and the
package are left in `--out`.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ssmops
import ssmops.export as sx
from ssmops.models import MambaConfig, MambaLMHeadModel
from ssmops.textgen import ByteTokenizer, TextStreamer

REPO = Path(__file__).resolve().parents[1]
# Sized so that ~100 steps on 2 cores give text that reads as English (measured: held-out loss
# falls from 5.2 to about 1.4 nats/byte) while training takes about 40 s after its compile: windows of
# 128 bytes, which learn as fast per step as 256 did (1.33) at half the work.
DEMO_CONFIG = dict(d_model=192, n_layer=3, vocab_size=256, ssm_cfg={"d_state": 16})
SEQLEN = 128
HELD_OUT = 0.05  # the text's last 5% is never trained on


def load_text() -> tuple[torch.Tensor, torch.Tensor]:
    """CPython's documentation topics as UTF-8 bytes (int64 token ids): (train, held out)."""
    from pydoc_data import topics

    text = "\n\n".join(topics.topics[name] for name in sorted(topics.topics)).encode("utf-8")
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = int(len(data) * (1 - HELD_OUT))
    return data[:split], data[split:]


def build_model(seed: int = 0) -> MambaLMHeadModel:
    """The demo's LM, initialised as mamba_ssm initialises it, from `seed`."""
    torch.manual_seed(seed)
    return MambaLMHeadModel(MambaConfig(**DEMO_CONFIG))


def next_byte_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of predicting tokens[:, 1:] from tokens[:, :-1]."""
    logits = model(tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@torch.no_grad()
def held_out_loss(model: nn.Module, held_out: torch.Tensor, seqlen: int = SEQLEN) -> float:
    """Mean next-byte loss over the whole held-out slice, cut into rows of seqlen + 1 bytes."""
    was_training = model.training
    model.eval()
    rows = held_out[: len(held_out) // (seqlen + 1) * (seqlen + 1)].view(-1, seqlen + 1)
    loss = next_byte_loss(model, rows).item()
    model.train(was_training)
    return loss


def train(
    model: MambaLMHeadModel,
    data: torch.Tensor,
    steps: int,
    batch: int = 16,
    seqlen: int = SEQLEN,
    lr: float = 3e-3,
    seed: int = 0,
    compile: bool = True,
    on_step: Callable[[int, float], None] | None = None,
) -> None:
    """AdamW on random windows of `data`, with a short warm-up then a cosine decay of the learning
    rate; `on_step(step, loss)` after each step. `compile` runs the loss (forward and backward)
    as one `torch.compile(fullgraph=True)` graph."""
    if steps < 1 or batch < 1 or seqlen < 2:
        raise ValueError(f"steps, batch and seqlen must be >= 1, 1, 2; got {steps}, {batch}, {seqlen}")
    model.train()
    loss_fn = torch.compile(next_byte_loss, fullgraph=True) if compile else next_byte_loss
    # weight decay on matrices only: not on norms, biases, D or the SSM's A_log, as mamba_ssm's recipes do
    decays = {name: p.dim() >= 2 and not name.endswith("A_log") for name, p in model.named_parameters()}
    groups = [{"params": [p for name, p in model.named_parameters() if decays[name] == decay],
               "weight_decay": 0.1 if decay else 0.0} for decay in (True, False)]
    opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seqlen + 1)
    warmup = max(1, steps // 10)
    for step in range(steps):
        for group in opt.param_groups:  # the step-size schedule: linear warm-up, then cosine to 0
            group["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        starts = torch.randint(0, len(data) - seqlen - 1, (batch,), generator=gen)
        loss = loss_fn(model, data[starts[:, None] + offsets])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if on_step is not None:
            on_step(step, loss.item())
    model.eval()


# --- what the demo prints ------------------------------------------------------------------------


# On a terminal the bars and timers redraw one line; in a log, a bar prints a line every fifth of
# the way and a timer only its total.
LIVE = sys.stdout.isatty()


def bar(done: int, total: int, width: int = 24) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "." * (width - filled) + "]"


class Ticker:
    """Prints `what ... N s` and keeps N current, for a step with no progress to count (a compile).
    A context manager; `stop()` ends it early (once)."""

    def __init__(self, what: str):
        self.what, self.done = what, threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def _tick(self) -> None:
        while not self.done.wait(1.0):
            print(f"\r  {self.what} ... {time.perf_counter() - self.t0:.0f} s", end="", flush=True)

    def __enter__(self) -> "Ticker":
        self.t0 = time.perf_counter()
        print(f"  {self.what} ...", end="", flush=True)
        if LIVE:
            self.thread.start()
        return self

    def stop(self) -> None:
        if not self.done.is_set():
            self.done.set()
            elapsed = f"{time.perf_counter() - self.t0:.0f} s"
            if LIVE:
                self.thread.join()
                print(f"\r  {self.what} ... {elapsed}", flush=True)
            else:
                print(f" {elapsed}", flush=True)

    def __exit__(self, *exc) -> None:
        self.stop()


CPP_BUILD = REPO / "build" / "cpp"  # where the C++ runner is built (tests/conftest.py's `cpp_runner` too)


def cpp_build_commands() -> list[list[str]]:
    """CMake's configure and build of examples/cpp into CPP_BUILD, as the README gives them."""
    return [["cmake", "-S", str(REPO / "examples" / "cpp"), "-B", str(CPP_BUILD), "-DCMAKE_BUILD_TYPE=Release",
             f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}"],
            ["cmake", "--build", str(CPP_BUILD)]]


def start_cpp_build() -> tuple[subprocess.Popen | None, str]:
    """Configures and builds examples/cpp in build/cpp in the background (one job by default, so that
    it takes one core from the compile that runs meanwhile, not both), or says why it cannot."""
    if ssmops.available_backends()["cpu"] != "available":
        return None, f"not run: it loads the operator library, which is not here ({ssmops.available_backends()['cpu']})"
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    if missing:
        return None, f"not run: {' and '.join(missing)} not found on PATH (the package is still checked in Python)"
    script = " && ".join(subprocess.list2cmdline(command) for command in cpp_build_commands())
    env = {"CMAKE_BUILD_PARALLEL_LEVEL": "1", **os.environ}  # one job unless the caller says otherwise
    CPP_BUILD.mkdir(parents=True, exist_ok=True)
    with open(CPP_BUILD / "demo-build.log", "w") as log:  # a file, not a pipe that could fill and stall the build
        proc = subprocess.Popen(["sh", "-c", script], stdout=log, stderr=subprocess.STDOUT, env=env)
    return proc, str(CPP_BUILD / "ssmops_run")


class _Logits(nn.Module):
    """The LM as a tensor -> tensor function, for export."""

    def __init__(self, lm: MambaLMHeadModel):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids).logits


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def demo_train(args, model: MambaLMHeadModel, train_data: torch.Tensor, held_out: torch.Tensor) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    cfg = model.config
    print(f"\n== 1. train: a byte-level Mamba LM (d_model {cfg.d_model}, {cfg.n_layer} layers, d_state "
          f"{cfg.ssm_cfg['d_state']}, {n_params / 1e6:.2f}M parameters) on CPython's documentation "
          f"(pydoc_data.topics: {len(train_data) / 1e3:.0f} kB to train on, {len(held_out) / 1e3:.0f} kB held out)")
    before = held_out_loss(model, held_out)
    print(f"  held-out loss before: {before:.2f} nats/byte (a uniform guess over 256 bytes: ln 256 = "
          f"{math.log(256):.2f})")
    tokens_per_step = args.batch * SEQLEN
    t0 = time.perf_counter()
    first_step_done = t0  # tokens/s counts the steps after the first, which carries the compile

    def on_step(step: int, loss: float) -> None:
        nonlocal first_step_done
        now = time.perf_counter()
        if step == 0:
            compiling.stop()
            first_step_done = now
            return
        if not LIVE and (step + 1) % max(1, args.steps // 5) and step + 1 != args.steps:
            return
        rate = step * tokens_per_step / (now - first_step_done)
        line = (f"  {bar(step + 1, args.steps)} step {step + 1}/{args.steps}  loss {loss:.3f}  "
                f"{rate:6.0f} tokens/s  elapsed {now - t0:5.1f} s")
        print("\r" + line if LIVE else line, end="" if LIVE else "\n", flush=True)

    what = "step 1, eager" if args.eager else "torch.compile(fullgraph=True) of forward+backward, and step 1"
    with Ticker(what) as compiling:
        train(model, train_data, args.steps, batch=args.batch, on_step=on_step, compile=not args.eager)
    if LIVE:
        print()
    after = held_out_loss(model, held_out)
    print(f"  held-out loss after: {after:.2f} nats/byte ({after / math.log(2):.2f} bits/byte; before "
          f"{before:.2f})")


def demo_generate(args, model: MambaLMHeadModel) -> None:
    print(f"\n== 2. generate: {args.new_tokens} bytes after the prompt, recurrent decoding, "
          f"top-k {args.top_k}, temperature {args.temperature}")
    tokenizer = ByteTokenizer()
    prompt = torch.tensor([tokenizer.encode(args.prompt)])
    streamer = TextStreamer(tokenizer)
    torch.manual_seed(args.seed)
    print("  " + args.prompt, end="", flush=True)
    model.generate(prompt, max_length=prompt.shape[1] + args.new_tokens, top_k=args.top_k,
                   temperature=args.temperature, streamer=streamer)
    overall, steps = streamer.rates()
    print(f"  {len(streamer.ids)} tokens: {overall:.0f} tokens/s with the prompt's forward, {steps:.0f} tokens/s "
          "per recurrent step (its cost does not grow with the text)")


def demo_export(args, model: MambaLMHeadModel, out: Path, cpp: subprocess.Popen | None, runner: str) -> None:
    print("\n== 3. export: ssmops.export -> an AOTInductor package (seqlen dynamic), checked against eager")
    logits = _Logits(model).eval()
    x = torch.randint(0, 256, (1, 300), generator=torch.Generator().manual_seed(1))
    with Ticker("torch.export + AOTInductor compile"), sx.quiet_torch_deprecations():
        package = sx.aoti_package(sx.export_program(logits, (x[:, :64],)), out / "lm_aoti.pt2")
    with torch.no_grad():
        expected = logits(x)
        got = torch._inductor.aoti_load_package(str(package))(x)
    print(f"  {package} ({package.stat().st_size / 2**20:.1f} MiB): logits over {x.shape[1]} tokens vs eager, "
          f"max relative error {rel_err(got, expected):.1e}")
    if cpp is None:
        print(f"  C++ runner {runner}")
        return
    if cpp.poll() is None:
        with Ticker("waiting for the C++ runner's build (examples/cpp, CMake)"):
            cpp.wait()
    if cpp.returncode != 0:
        log = (Path(runner).parent / "demo-build.log").read_text()
        print(f"  C++ runner not run: its build failed (exit {cpp.returncode}):\n" + log[-2000:])
        return
    torch.save([x], out / "inputs.pt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}  # no Python in the process
    run = subprocess.run([runner, "--ops-library", ssmops.library_path(), "--package", str(package), "--inputs",
                          str(out / "inputs.pt"), "--repeat", "3", "--save-outputs", str(out / "cpp_outputs.pt")],
                         capture_output=True, text=True, env=env)
    if run.returncode != 0:
        print(f"  C++ runner failed (exit {run.returncode}): {run.stderr.strip()[-2000:]}")
        return
    (cpp_logits,) = torch.load(out / "cpp_outputs.pt", weights_only=True)
    timing = next((line.strip() for line in run.stdout.splitlines() if "time per run" in line), "")
    print(f"  C++ ({Path(runner).relative_to(REPO)}, libtorch + the ops library, no Python): {timing}; "
          f"vs eager, max relative error {rel_err(cpp_logits, expected):.1e}")


def time_best(fn: Callable[[], object], repeats: int = 3) -> float:
    fn()  # warm-up
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def demo_backends(model: MambaLMHeadModel) -> None:
    mixer = model.backbone.layers[0].mixer
    dim, dstate = mixer.d_inner, mixer.d_state
    b, L = 4, 256  # enough to time, short for `default`'s many passes
    print(f"\n== 4. the scan at one of the model's layers (batch {b}, dim {dim}, seqlen {L}, dstate {dstate}, "
          "variable B/C, D, z, softplus; fp32), best of 3")
    g = torch.Generator().manual_seed(0)
    kw = dict(u=torch.randn(b, dim, L, generator=g), delta=torch.randn(b, dim, L, generator=g) * 0.5 - 2.0,
              A=-torch.arange(1, dstate + 1, dtype=torch.float32).repeat(dim, 1),
              B=torch.randn(b, dstate, L, generator=g), C=torch.randn(b, dstate, L, generator=g),
              D=torch.ones(dim), z=torch.randn(b, dim, L, generator=g), delta_bias=torch.rand(dim, generator=g) * 0.1)
    leaves = {k: v.requires_grad_() for k, v in kw.items()}

    def forward():
        with torch.no_grad():
            ssmops.selective_scan_fn(**kw, delta_softplus=True)

    def forward_backward():
        ssmops.selective_scan_fn(**leaves, delta_softplus=True).sum().backward()

    rows = {}
    for name, status in ssmops.available_backends().items():
        if status == "available":
            with ssmops.use_backend(name):
                rows[name] = (time_best(forward), time_best(forward_backward))
    print(f"  {'backend':10s} {'forward':>10s} {'fwd+bwd':>10s} {'vs default (fwd, fwd+bwd)':>27s}")
    for name, (fwd, both) in rows.items():
        print(f"  {name:10s} {fwd * 1e3:7.1f} ms {both * 1e3:7.1f} ms "
              f"{rows['default'][0] / fwd:12.1f}x {rows['default'][1] / both:6.1f}x")
    missing = [f"{k} ({v})" for k, v in ssmops.available_backends().items() if v != "available"]
    if missing:
        print("  not here: " + "; ".join(missing))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--batch", type=int, default=16, help=f"sequences of {SEQLEN} bytes per step")
    parser.add_argument("--prompt", default="The for statement")
    parser.add_argument("--new-tokens", type=int, default=200)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=REPO / "build" / "demo", help="where the weights and package go")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--eager", action="store_true", help="train without torch.compile")
    args = parser.parse_args()
    t_start = time.perf_counter()
    torch.set_num_threads(args.threads)
    if ssmops.available_backends()["cpu"] != "available":
        print(f"note: the native cpu backend is not here ({ssmops.available_backends()['cpu']}): training on default")
    print(f"ssmops demo: torch {torch.__version__}, {args.threads} threads, backends: "
          + ", ".join(f"{k} {'yes' if v == 'available' else 'no'}" for k, v in ssmops.available_backends().items()))
    cpp, runner = start_cpp_build()  # meanwhile: it is only needed in step 3
    train_data, held_out = load_text()
    model = build_model(args.seed)
    demo_train(args, model, train_data, held_out)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    demo_generate(args, model)
    demo_export(args, model, args.out, cpp, runner)
    demo_backends(model)
    print(f"\ndone in {time.perf_counter() - t_start:.0f} s. In {args.out}: the trained weights (config.json, "
          "pytorch_model.bin) and the AOTInductor package (lm_aoti.pt2). Try:")
    print(f"  ssmops generate {args.out} --prompt 'The if statement' --top-k 10 --temperature 0.7")
    return 0


if __name__ == "__main__":
    sys.exit(main())
