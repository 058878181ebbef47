"""Text in, text out for a Mamba LM checkpoint: tokenizers, a streaming printer, and `ssmops generate`.

    ssmops generate CHECKPOINT_DIR --prompt "The for statement" --max-new-tokens 200 --top-k 10

The directory is any layout `MambaLMHeadModel.from_pretrained` reads. Its tokenizer is
transformers' (read with transformers when the directory has `tokenizer_config.json` or
`tokenizer.json` and transformers is installed); otherwise token ids are bytes (0-255).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Protocol, TextIO

import torch

TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json")


class Tokenizer(Protocol):
    """What generation needs of a tokenizer; `eos_token_id` (or None) ends generation."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids 0-255: the tokenizer of byte-level models (the demo's)."""

    eos_token_id = None

    def __len__(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class _Transformers:
    """A transformers tokenizer as a Tokenizer; special tokens (an end of text) are not printed."""

    def __init__(self, tokenizer):
        self.tokenizer, self.eos_token_id = tokenizer, tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def __len__(self) -> int:
        return len(self.tokenizer)


class GenerateError(ValueError):
    """A checkpoint, tokenizer or argument that generation cannot use; the message says which and why."""


def load_tokenizer(checkpoint_dir: str | Path) -> tuple[Tokenizer, str]:
    """The directory's transformers tokenizer, or ByteTokenizer, and a line saying which and why."""
    path = Path(checkpoint_dir)
    found = [name for name in TOKENIZER_FILES if (path / name).is_file()]
    if not found:
        return ByteTokenizer(), f"no tokenizer files in {path}: token ids are bytes (0-255)"
    try:
        import transformers
    except ImportError:
        return ByteTokenizer(), (f"{path} has {found[0]} but transformers is not installed "
                                 "(pip install transformers): token ids are bytes (0-255) instead")
    try:
        if "tokenizer_config.json" in found:
            tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        else:  # a bare tokenizer.json (the `tokenizers` library's file) needs no config to be read
            tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    except Exception as err:  # noqa: BLE001 - transformers and its Rust tokenizers raise many kinds
        first = (str(err).strip().splitlines() or [""])[0]
        raise GenerateError(f"cannot read the tokenizer in {path}: {type(err).__name__}: {first}") from err
    return _Transformers(tokenizer), f"tokenizer: transformers' {type(tokenizer).__name__} from {path / found[0]}"


class TextStreamer:
    """Prints generated text as tokens arrive (the transformers streamer protocol: `put`, `end`)
    and times them. The first `put` is the prompt. The whole continuation is decoded each time, so
    that a character split over several tokens (a multi-byte UTF-8 character in bytes) is printed
    once it is complete."""

    def __init__(self, tokenizer: Tokenizer, out: TextIO | None = None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.printed = ""
        self.started: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None

    def put(self, tokens: torch.Tensor) -> None:
        if self.started is None:
            self.started = time.perf_counter()
            return
        now = time.perf_counter()
        self.first_token_at = self.first_token_at or now
        self.ids.extend(int(t) for t in tokens.reshape(-1))
        text = self.tokenizer.decode(self.ids).rstrip("\ufffd")  # an unfinished character waits
        if text.startswith(self.printed):
            self.out.write(text[len(self.printed):])
            self.out.flush()
            self.printed = text

    def end(self) -> None:
        self.finished_at = time.perf_counter()
        text = self.tokenizer.decode(self.ids)
        self.out.write(text[len(self.printed):] + "\n")
        self.out.flush()
        self.printed = text

    def rates(self) -> tuple[float, float]:
        """(tokens/s over the whole call, prompt included; tokens/s of the recurrent steps alone)."""
        if self.finished_at is None or not self.ids:
            raise RuntimeError("rates() is read after generation has ended")
        overall = len(self.ids) / (self.finished_at - self.started)
        steps = len(self.ids) - 1  # the first token comes from the prompt's forward
        decode_time = self.finished_at - self.first_token_at
        return overall, (steps / decode_time if steps and decode_time > 0 else overall)


def load_checkpoint(checkpoint_dir: str | Path, weights: str | None = None):
    """`MambaLMHeadModel.from_pretrained(checkpoint_dir, weights=weights)` in eval mode, with every
    failure as one GenerateError line that names the directory."""
    from .models import MambaLMHeadModel

    path = Path(checkpoint_dir)
    if not path.is_dir():
        raise GenerateError(f"checkpoint_dir {str(path)!r} is not a directory")
    if not (path / "config.json").is_file():
        raise GenerateError(f"{path} has no config.json: expected mamba_ssm's layout (config.json + "
                              "pytorch_model.bin or model.safetensors) or transformers' MambaForCausalLM layout")
    try:
        return MambaLMHeadModel.from_pretrained(path, weights=weights).eval()
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError) as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise GenerateError(f"cannot load {path}: {type(err).__name__}: {first}") from err


def generate_command(args: argparse.Namespace, out: TextIO | None = None, log: TextIO | None = None) -> int:
    """`ssmops generate`: streams the continuation to `out` (stdout), notes and tokens/s to `log` (stderr)."""
    out, log = out or sys.stdout, log or sys.stderr
    model = load_checkpoint(args.checkpoint_dir, args.weights)
    tokenizer, note = load_tokenizer(args.checkpoint_dir)
    print(note, file=log)
    vocab = model.config.vocab_size
    if isinstance(tokenizer, ByteTokenizer) and vocab < 256:
        raise GenerateError(f"{args.checkpoint_dir}: no usable tokenizer, and its vocabulary of {vocab} "
                            "is too small for bytes (256)")
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise GenerateError("--prompt encodes to no tokens: give some text")
    if max(prompt) >= vocab:
        raise GenerateError(f"--prompt has token id {max(prompt)}, outside the model's vocabulary of {vocab}")
    if args.top_k < 0:
        raise GenerateError(f"--top-k must be >= 0, got {args.top_k}")
    if args.top_k != 1 and args.temperature <= 0:
        raise GenerateError(f"--temperature must be > 0 when sampling (--top-k {args.top_k}), got {args.temperature}")
    if args.seed is not None:
        torch.manual_seed(args.seed)
    streamer = TextStreamer(tokenizer, out)
    out.write(args.prompt)
    out.flush()
    ids = torch.tensor([prompt], dtype=torch.long)
    model.generate(
        ids, max_length=len(prompt) + args.max_new_tokens, top_k=args.top_k, top_p=args.top_p,
        temperature=args.temperature, streamer=streamer, eos_token_id=tokenizer.eos_token_id,
        # logits cut to what the tokenizer can decode (bytes: 256) and to the unpadded vocabulary
        vocab_size=min(vocab, len(tokenizer)), cg=args.compile,
    )
    overall, steps = streamer.rates()
    print(f"[{len(streamer.ids)} tokens after a {len(prompt)}-token prompt: {overall:.1f} tokens/s "
          f"({steps:.1f} tokens/s per recurrent step)]", file=log)
    return 0


def add_generate_parser(sub) -> None:
    """The `generate` subcommand's arguments (sampling as in `MambaLMHeadModel.generate`)."""
    gen = sub.add_parser("generate", help="generate text from a Mamba LM checkpoint directory, streaming it")
    gen.add_argument("checkpoint_dir", help="mamba_ssm's (config.json + pytorch_model.bin / model.safetensors) "
                     "or transformers' MambaForCausalLM directory")
    gen.add_argument("--prompt", required=True, help="the text to continue")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=100)
    gen.add_argument("--temperature", type=float, default=1.0, help="of the sampling (with --top-k != 1)")
    gen.add_argument("--top-k", type=int, default=1, help="1: greedy (the default); 0: the whole vocabulary")
    gen.add_argument("--top-p", type=float, default=0.0, help="nucleus sampling when in (0, 1)")
    gen.add_argument("--seed", type=int, help="seeds the sampling, for a repeatable continuation")
    add_weights_argument(gen)
    gen.add_argument("--compile", action="store_true",
                     help="compile the one-token step into one graph first (faster tokens after a one-off compile; "
                          "a Mamba-1 LM on CPU needs none: its layers are one operator call a token either way)")


def add_weights_argument(parser) -> None:
    from .modules.linear import WEIGHT_FORMATS

    parser.add_argument("--weights", choices=list(WEIGHT_FORMATS), default=None,
                        help="store the linear layers' weights in this format (default: the checkpoint's dtype)")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
