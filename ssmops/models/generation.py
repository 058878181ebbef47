"""Decoding for the Mamba language model: prefill through the scan, then one recurrent step per token.

Mirrors `mamba_ssm.utils.generation` (InferenceParams, top-k / top-p / min-p sampling,
`decode`): the per-token cost is one decoding step per layer, independent of the prompt length.
With `cg=True` the whole one-token step (every layer and the output projection) runs as one unit
that advances the caches in place: on CUDA (and ROCm) captured in a CUDA graph, as mamba_ssm's
`cg=True` does, elsewhere one `torch.compile` graph. A Mamba-1 LM on CPU needs neither: its layers
are one operator call a token (`MambaLMHeadModel.decoding_step`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings

import torch
from torch import Tensor


@dataclasses.dataclass
class InferenceParams:
    """The decoding cache: `key_value_memory_dict[layer_idx] = (conv_state, ssm_state)`,
    allocated by each Mamba layer on first use; `seqlen_offset` is how many tokens the
    states already hold (0: the next forward is the prompt). The ssm states take the
    weights' dtype, as in mamba_ssm, unless `ssm_state_dtype` says otherwise (e.g. float32
    states for a bfloat16 model)."""

    max_seqlen: int
    max_batch_size: int
    seqlen_offset: int = 0
    batch_size_offset: int = 0
    key_value_memory_dict: dict = dataclasses.field(default_factory=dict)
    lengths_per_sample: Tensor | None = None
    ssm_state_dtype: torch.dtype | None = None

    def reset(self, max_seqlen: int, max_batch_size: int) -> None:
        self.max_seqlen = max_seqlen
        self.max_batch_size = max_batch_size
        self.seqlen_offset = 0
        for states in self.key_value_memory_dict.values():
            for s in states:
                s.zero_()


@dataclasses.dataclass
class GenerationOutput:
    """`sequences`: (batch, prompt + generated) token ids (a list of 1-D tensors for prompts of
    different lengths); `scores`: one (batch, vocab) logits tensor per generated token (when asked for)."""

    sequences: Tensor | list[Tensor]
    scores: tuple[Tensor, ...] | None = None


def _top_p_filter_(logits: Tensor, top_p: float) -> None:
    """Masks (in place, to -inf) the tokens outside the smallest set whose probability
    exceeds top_p."""
    if not 0.0 < top_p < 1.0:
        return
    sorted_logits, sorted_idx = torch.sort(logits, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cum <= (1 - top_p)  # the low tail whose mass is at most 1 - top_p
    remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
    logits.masked_fill_(remove, float("-inf"))


def sample(logits: Tensor, top_k: int = 1, top_p: float = 0.0, min_p: float = 0.0, temperature: float = 1.0) -> Tensor:
    """Next token from logits (batch, vocab): greedy when top_k == 1, else sampling from
    softmax(logits / temperature) restricted to the top_k tokens (0: all), to the top_p
    nucleus and to tokens with probability >= min_p * the largest one."""
    if top_k == 1:
        return logits.argmax(dim=-1)
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 when sampling, got {temperature}")
    if top_k > 0:
        top_k = min(top_k, logits.shape[-1])
        top_logits, indices = torch.topk(logits, top_k, dim=-1)
        top_logits = top_logits / temperature
        _top_p_filter_(top_logits, top_p)
        choice = torch.multinomial(top_logits.softmax(dim=-1), num_samples=1)
        return indices.gather(1, choice).squeeze(1)
    logits = logits / temperature
    if min_p > 0.0:
        probs = logits.softmax(dim=-1)
        threshold = probs.max(dim=-1, keepdim=True).values * min_p
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    _top_p_filter_(logits, top_p)
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1).squeeze(1)


def step_logits(model, memory: dict, input_ids: Tensor, positions: Tensor) -> Tensor:
    """One decoding token of every sequence: input_ids (batch, 1); positions (batch,) int64, the
    number of tokens each sequence already has in the caches; `memory` maps each layer to its
    caches (InferenceParams.key_value_memory_dict), advanced in place. Returns logits (batch, vocab).
    (The caches exist, so nothing is allocated and no max_seqlen is needed.)"""
    params = InferenceParams(max_seqlen=0, max_batch_size=input_ids.shape[0], seqlen_offset=1,
                             key_value_memory_dict=memory, lengths_per_sample=positions)
    return model(input_ids, inference_params=params).logits[:, -1]


# One graph per model, batch size and cache layout is expected: more than dynamo's default of 8.
COMPILED_STEP_LIMIT = 64
_compiled_step_logits: dict[bool, object] = {}


def compiled_step_logits(device: torch.device | str = "cpu"):
    """`step_logits` as one compiled graph per model, batch size and cache size (static shapes;
    compiled on its first call for them, then reused by every later `generate(..., cg=True)`).
    Call it inside `torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_LIMIT)`.

    For a model on the CPU the graph calls its kernels and ssmops' operators from C++ (inductor's
    `cpp_wrapper`): ~3 ms less a token than its Python wrapper at mamba-130m's shape, for a first
    compile about twice as long. `TORCHINDUCTOR_CPP_WRAPPER=0` (or `=1`) in the environment decides
    instead, for every device.

    The graph does not re-check its inputs' and its operators' outputs' sizes (inductor's
    `size_asserts`): the guards check the inputs on a generation's first token, the later tokens
    pass the same model and caches, and the operators' fake kernels are tested against their
    kernels. Those checks cost ~75-165 us a token with 24 layers (d_model 64, 2 threads)."""
    cpp_wrapper = torch.device(device).type == "cpu" and "TORCHINDUCTOR_CPP_WRAPPER" not in os.environ
    if cpp_wrapper not in _compiled_step_logits:
        options = {"size_asserts": False}
        if cpp_wrapper:
            options["cpp_wrapper"] = True
        _compiled_step_logits[cpp_wrapper] = torch.compile(step_logits, fullgraph=True, dynamic=False,
                                                           options=options)
    return _compiled_step_logits[cpp_wrapper]


def cuda_graph_step(step, memory: dict, batch_size: int, device: torch.device):
    """`step(input_ids, positions) -> logits` captured once in a CUDA graph for these caches (mamba_ssm's
    cg=True): a call copies its inputs into the graph's, replays it (every layer's launches, no Python) and
    returns a copy of its logits. Capture needs warm-up runs first (Triton's compiles, cuBLAS's workspace),
    which advance the caches: they are restored after the capture, or after its failure."""
    caches = [t for states in memory.values() for t in states if isinstance(t, Tensor)]
    saved = [t.clone() for t in caches]
    input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
    positions = torch.ones(batch_size, dtype=torch.long, device=device)
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                step(input_ids, positions)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step(input_ids, positions)
    finally:
        for cache, state in zip(caches, saved):
            cache.copy_(state)

    def replay(ids: Tensor, at: Tensor) -> Tensor:
        input_ids.copy_(ids)
        positions.copy_(at)
        graph.replay()
        return logits.clone()  # (the next replay writes the graph's logits again)

    return replay


def token_step(model, memory: dict, batch_size: int, device: torch.device, cg: bool):
    """The step that `decode` runs for each token after the prompt: (input_ids (batch, 1), positions)
    -> logits (batch, vocab), and whether it is the compiled graph. A model that offers a step of
    its own for these caches (`model.decoding_step(memory, batch_size)`: a Mamba-1 LM on CPU, all its
    layers in one operator call) decodes with it whatever `cg` says: it is faster than the compiled
    graph there and compiles nothing. Otherwise, with `cg`, `step_logits` captured in a CUDA graph on
    CUDA (cuda_graph_step; the eager step's time on an H200 was Python's: launches of ~30-50 us each,
    and inductor's graph launches them the same way) and `compiled_step_logits(device)` elsewhere;
    without it `step_logits`."""
    own = getattr(model, "decoding_step", None)
    bound = own(memory, batch_size) if own is not None else None
    if bound is not None:
        return lambda input_ids, positions: bound(input_ids), False
    if cg and torch.device(device).type == "cuda":
        try:
            return cuda_graph_step(lambda input_ids, positions: step_logits(model, memory, input_ids, positions),
                                   memory, batch_size, torch.device(device)), False
        except RuntimeError as err:  # (a step that cannot be captured, e.g. one that reads a value on the host)
            warnings.warn(f"generate(cg=True): the one-token step could not be captured in a CUDA graph "
                          f"({str(err)[:200]}); compiling it instead", stacklevel=3)
    step = compiled_step_logits(device) if cg else step_logits
    return lambda input_ids, positions: step(model, memory, input_ids, positions), cg


def _prefill(model, input_ids: Tensor | list[Tensor], memory: dict, max_length: int) -> Tensor:
    """Runs the prompt(s) through the model, filling `memory`; returns the last logits (batch, vocab).
    Prompts of different lengths go one at a time into their own rows of the caches."""
    if isinstance(input_ids, Tensor):
        params = InferenceParams(max_seqlen=max_length, max_batch_size=input_ids.shape[0],
                                 key_value_memory_dict=memory)
        return model(input_ids, inference_params=params, num_last_tokens=1).logits[:, -1]
    logits = []
    for row, prompt in enumerate(input_ids):
        rows = {layer: tuple(None if s is None else s[row : row + 1] for s in states)
                for layer, states in memory.items()}
        params = InferenceParams(max_seqlen=max_length, max_batch_size=1, key_value_memory_dict=rows)
        logits.append(model(prompt[None], inference_params=params, num_last_tokens=1).logits[:, -1])
    return torch.cat(logits)


@torch.inference_mode()
def decode(
    input_ids: Tensor | list[Tensor],
    model,
    max_length: int,
    top_k: int = 1,
    top_p: float = 0.0,
    min_p: float = 0.0,
    temperature: float = 1.0,
    repetition_penalty: float = 1.0,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    output_scores: bool = False,
    streamer=None,
    ssm_state_dtype: torch.dtype | None = None,
    cg: bool = False,
) -> GenerationOutput:
    """Generates up to `max_length` tokens in all (prompt included).

    The prompt goes through the model once (the scan fills every layer's conv and ssm
    states); each further token is one recurrent step per layer, for every sequence at once.
    `input_ids` is (batch, prompt_len), or a list of 1-D prompts of different lengths: each
    is prefilled into its own row of the caches, then all are decoded together, each at its
    own position, for `max_length - longest prompt` new tokens; `sequences` is then a list.
    `vocab_size` cuts the logits (e.g. to drop the vocabulary padding); with `eos_token_id`,
    a sequence that produced it is padded with it and decoding stops once every sequence has.
    `streamer`, when given, gets `put(tokens)` for the prompt and each new token and
    `end()` at the end (the transformers streamer protocol). The ssm states are kept in the
    weights' dtype unless `ssm_state_dtype` is given (see InferenceParams). With `cg`, each token
    after the prompt is one replay of a CUDA graph captured for this call on CUDA, elsewhere a call of
    `compiled_step_logits(device)` (the first call for a batch size compiles it): no Python per layer,
    no per-token dispatch of dozens of small operators — except where the model has a faster step of
    its own for these caches (`token_step`: a Mamba-1 LM on CPU runs all its layers as one operator
    call a token, with or without `cg`).
    """
    ragged = not isinstance(input_ids, Tensor)
    if ragged:
        input_ids = [torch.as_tensor(p).reshape(-1) for p in input_ids]
        if not input_ids or min(p.numel() for p in input_ids) == 0:
            raise ValueError("input_ids: a list of prompts needs at least one prompt, each of at least one token")
        if streamer is not None:
            raise ValueError("a streamer takes one batch of equal-length prompts, not a list of prompts")
        lengths = [p.numel() for p in input_ids]
        device = input_ids[0].device
    else:
        lengths = [input_ids.shape[1]] * input_ids.shape[0]
        device = input_ids.device
    batch, prompt_len = len(lengths), max(lengths)
    if max_length <= prompt_len:
        return GenerationOutput(input_ids, () if output_scores else None)
    if streamer is not None:
        streamer.put(input_ids.cpu())
    memory = model.allocate_inference_cache(batch, max_length, ssm_state_dtype=ssm_state_dtype)
    logits = _prefill(model, input_ids, memory, max_length)
    # what the repetition penalty has seen: the prompts (right-padded with their first token), then each new token
    seen = input_ids
    if ragged and repetition_penalty != 1.0:
        seen = torch.stack([torch.cat([p, p[:1].expand(prompt_len - p.numel())]) for p in input_ids])
    positions = torch.tensor(lengths, dtype=torch.long, device=device)
    step, compiled = token_step(model, memory, batch, device, cg)
    new_tokens, scores = [], []
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    with contextlib.ExitStack() as stance:
        if compiled:
            stance.enter_context(torch._dynamo.config.patch(recompile_limit=COMPILED_STEP_LIMIT))
        while True:
            if vocab_size is not None:
                logits = logits[:, :vocab_size]
            if repetition_penalty != 1.0:
                picked = logits.gather(1, seen)
                picked = torch.where(picked < 0, picked * repetition_penalty, picked / repetition_penalty)
                logits = logits.scatter(1, seen, picked)
            if output_scores:
                scores.append(logits.clone())
            token = sample(logits, top_k=top_k, top_p=top_p, min_p=min_p, temperature=temperature)
            if eos_token_id is not None:
                token = token.masked_fill(finished, eos_token_id)
                finished |= token == eos_token_id
            new_tokens.append(token.unsqueeze(1))
            if repetition_penalty != 1.0:
                seen = torch.cat([seen, new_tokens[-1]], dim=1)
            if streamer is not None:
                streamer.put(token.cpu())
            if prompt_len + len(new_tokens) >= max_length or (eos_token_id is not None and bool(finished.all())):
                break
            logits = step(new_tokens[-1], positions)
            positions += 1
            if compiled and len(new_tokens) == 1:
                # The first call picked (or compiled) the graph for this model, batch and caches; every
                # later one passes the same objects, so its guards cannot fail: skipping them saves
                # ~0.3 ms a token (of ~8 ms, int8 weights at mamba-130m's shape).
                stance.enter_context(torch.compiler.set_stance(skip_guard_eval_unsafe=True))
    if streamer is not None:
        streamer.end()
    generated = torch.cat(new_tokens, dim=1)
    if ragged:
        sequences = [torch.cat([p, g]) for p, g in zip(input_ids, generated, strict=True)]
    else:
        sequences = torch.cat([input_ids, generated], dim=1)
    return GenerationOutput(sequences, tuple(scores) if output_scores else None)
