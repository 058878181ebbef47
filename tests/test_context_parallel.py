"""ssmops.distributed against one process, in gloo groups of 2 and 4 CPU processes: context
parallelism (each rank a shard of uneven length, not a chunk multiple: outputs, the states at every
shard's end and every gradient of both scans and the conv; Mamba-1 and Mamba-2 LMs trained a few
steps), DDP and FSDP2 with and without it, and Mamba2's tensor parallelism. Each group runs all its
checks (both backends, every case) in one start of its processes: starting them is the cost."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported on first use of a backend override: once here, not per rank)
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor  # (assert_close imports it under a group: here once, not per rank)
from torch.nn.parallel import DistributedDataParallel

import ssmops
from ssmops import distributed as cp
from ssmops.distributed import parallelize_mamba2
from ssmops.distributed.tensor_parallel import _rank_major_rows
from ssmops import causal_conv1d_fn
from ssmops.models.config_mamba import MambaConfig
from ssmops.models.mixer_seq_simple import MambaLMHeadModel
from ssmops.modules import Mamba2

from conftest import REPO, run_python

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a hang becomes an error in every rank
SHARDS = {2: [9, 14], 4: [5, 7, 3, 8]}  # 23 tokens; chunk size 4: no shard is a chunk multiple but one
CHUNK = 4
TOL = dict(rtol=5e-5, atol=5e-5)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, check) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
    try:
        check(rank, world)
    finally:
        dist.destroy_process_group()


def fork_group(world: int, check) -> None:
    """check(rank, world) in `world` processes of one gloo group, forked from this one: the children inherit
    torch and ssmops imported (a spawned child imports them anew)."""
    mp.start_processes(_worker, args=(world, _free_port(), check), nprocs=world, join=True, start_method="fork")


def run_group(world: int, check) -> None:
    """Runs check(rank, world) in `world` processes of one gloo group, forked by a fresh interpreter; a failure in
    any rank fails the test. Not forked from the test's process: torch refuses autograd in a child forked after
    its parent's autograd engine started device threads, which an earlier test in the same pytest worker may have
    done (tests/test_fake_strides.py's did, under torch 2.11's CUDA build without a GPU)."""
    proc = run_python(f"import test_context_parallel as t; t.fork_group({world}, t.{check.__name__})",
                      cwd=REPO / "tests")
    assert proc.returncode == 0, proc.stderr[-6000:]


def _bounds(world: int, rank: int) -> tuple[int, int]:
    lengths = SHARDS[world]
    start = sum(lengths[:rank])
    return start, start + lengths[rank]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(t.is_floating_point() or t.is_complex())


def _summed_over_group(g: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    g = torch.zeros_like(like) if g is None else g.clone()
    dist.all_reduce(g)
    return g


def check_against_one_process(rank, world, full_fn, cp_fn, inputs, cut, state_flag=None, **kwargs):
    """full_fn on the whole sequence against cp_fn on this rank's shard. `cut(name, t, start, end)`
    shards an input along time (None for a replicated one). The loss weighs the outputs and, with
    `state_flag`, the state at the end of every shard (one process: the final state of the prefix)."""
    gen = torch.Generator().manual_seed(1)
    leaves = {k: _leaf(v) if v is not None else None for k, v in inputs.items()}
    bounds = [_bounds(world, r) for r in range(world)]

    def prefix(end):
        return {k: (c if (c := cut(k, v, 0, end)) is not None else v) if v is not None else None
                for k, v in leaves.items()}

    returned = full_fn(**leaves, **kwargs, **({state_flag: True} if state_flag else {}))
    out = returned[0] if state_flag else returned
    out_weight = torch.randn(out.shape, generator=gen)
    loss = (out * out_weight).sum()
    states, state_weights = [], []
    if state_flag:
        for _, end in bounds:
            state = full_fn(**prefix(end), **kwargs, **{state_flag: True})[1]
            state_weights.append(torch.randn(state.shape, generator=gen, dtype=state.dtype))
            states.append(state.detach())
            loss = loss + (state * state_weights[-1]).real.sum()
    tensors = [k for k, v in leaves.items() if v is not None and v.requires_grad]
    grads = dict(zip(tensors, torch.autograd.grad(loss, [leaves[k] for k in tensors])))

    start, end = bounds[rank]
    shard = {k: None if v is None else _leaf(c if (c := cut(k, v, start, end)) is not None else v)
             for k, v in leaves.items()}
    returned = cp_fn(**shard, **kwargs, **({state_flag: True} if state_flag else {}), group=None)
    out_shard = returned[0] if state_flag else returned
    torch.testing.assert_close(out_shard, cut("out", out, start, end).detach(), **TOL)
    local_loss = (out_shard * cut("out", out_weight, start, end)).sum()
    if state_flag:
        torch.testing.assert_close(returned[1], states[rank], **TOL)
        local_loss = local_loss + (returned[1] * state_weights[rank]).real.sum()
    local_grads = dict(zip(tensors, torch.autograd.grad(local_loss, [shard[k] for k in tensors],
                                                         allow_unused=True)))
    for k in tensors:
        sharded = cut(k, grads[k], start, end)
        if sharded is not None:
            torch.testing.assert_close(local_grads[k], sharded, **TOL, msg=lambda m: f"grad of {k}: {m}")
        else:  # replicated: each rank holds its tokens' part
            torch.testing.assert_close(_summed_over_group(local_grads[k], grads[k]), grads[k], **TOL,
                                       msg=lambda m: f"grad of {k} summed over the group: {m}")


def _randn(gen, *shape):
    return torch.randn(*shape, generator=gen)


def _ssd_inputs(seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, L, h, p, g, n = 2, sum(SHARDS[2]), 4, 3, 2, 5
    return dict(x=_randn(gen, b, L, h, p), dt=_randn(gen, b, L, h) * 0.5, A=-torch.rand(h, generator=gen) - 0.3,
                B=_randn(gen, b, L, g, n), C=_randn(gen, b, L, g, n), D=_randn(gen, h, p), z=_randn(gen, b, L, h, p),
                dt_bias=_randn(gen, h) * 0.3, initial_states=_randn(gen, b, h, p, n))


def _seq_idx(starts: list[int], first_id: int = 0) -> torch.Tensor:
    """(2, 23) ids, row 0 starting new sequences at `starts`, row 1 one sequence throughout."""
    L = sum(SHARDS[2])
    row = torch.zeros(L, dtype=torch.int32)
    for s in starts:
        row[s:] += 1
    return torch.stack([row + first_id, torch.full((L,), first_id, dtype=torch.int32)])


def _cut_ssd(name, t, start, end):
    return None if name in ("A", "D", "dt_bias", "initial_states") else t[:, start:end]


def _check_ssd(rank, world):
    full = ssmops.mamba_chunk_scan_combined
    cases = [
        dict(keep=("D", "z", "dt_bias"), dt_softplus=True),
        dict(keep=("initial_states",), dt_limit=(0.05, 0.9)),
        # boundaries inside shards and on the 2- and 4-rank shard boundaries (9, 12)
        dict(keep=("D", "dt_bias", "initial_states"), dt_softplus=True, seq_idx=_seq_idx([2, 9, 12, 17])),
        dict(keep=("initial_states", "z"), seq_idx=_seq_idx([14], first_id=3)),  # no initial state reaches
    ]
    for backend in ("cpu", "default"):
        with ssmops.use_backend(backend):
            for i, case in enumerate(cases):
                case = dict(case)
                keep = case.pop("keep")
                inputs = {k: v if k in ("x", "dt", "A", "B", "C") or k in keep else None
                          for k, v in _ssd_inputs(i).items()}
                if "seq_idx" in case:
                    inputs["seq_idx"] = case.pop("seq_idx")
                check_against_one_process(rank, world, full, cp.mamba_chunk_scan_combined, inputs, _cut_ssd,
                                          "return_final_states", chunk_size=CHUNK, **case)


def _selective_inputs(seed: int, complex_a: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b, d, n, L, groups = 2, 4, 6, sum(SHARDS[2]), 2
    A = -torch.rand(d, n, generator=gen) - 0.2
    if complex_a:
        A = torch.complex(A, _randn(gen, d, n))
    steps = 2 * L if complex_a else L  # complex mode: a variable B/C has (re, im) per step
    return dict(u=_randn(gen, b, d, L), delta=_randn(gen, b, d, L) * 0.5, A=A,
                B=_randn(gen, b, groups, n, steps), C=_randn(gen, b, groups, n, steps), D=_randn(gen, d),
                z=_randn(gen, b, d, L), delta_bias=_randn(gen, d) * 0.3,
                initial_state=_randn(gen, b, d, n).to(A.dtype) if not complex_a
                else torch.complex(_randn(gen, b, d, n), _randn(gen, b, d, n)))


def _cut_selective(name, t, start, end):
    if name in ("A", "D", "delta_bias", "initial_state"):
        return None
    if name in ("B", "C") and t.shape[-1] == 2 * sum(SHARDS[2]):
        return t[..., 2 * start:2 * end]
    return t[..., start:end]


def _check_selective(rank, world):
    for backend in ("cpu", "default"):
        with ssmops.use_backend(backend):
            for complex_a in (False, True):
                for with_initial in (False, True):
                    inputs = _selective_inputs(int(complex_a), complex_a)
                    if not with_initial:
                        inputs["initial_state"] = None
                    check_against_one_process(rank, world, ssmops.selective_scan_fn, cp.selective_scan_fn, inputs,
                                              _cut_selective, "return_last_state", delta_softplus=True)


def _check_conv(rank, world):
    gen = torch.Generator().manual_seed(5)
    b, d, L = 2, 6, sum(SHARDS[2])
    for seq_idx in (None, _seq_idx([2, 9, 10, 12])):
        inputs = dict(x=_randn(gen, b, d, L), weight=_randn(gen, d, 4), bias=_randn(gen, d), seq_idx=seq_idx)
        check_against_one_process(
            rank, world, causal_conv1d_fn, cp.causal_conv1d, inputs,
            lambda k, t, s, e: None if k in ("weight", "bias") else t[..., s:e], activation="silu")


def _check_errors(rank, world):
    """A bad group fails in every rank with a clear error, not a hang."""
    gen = torch.Generator().manual_seed(0)
    inputs = {k: v[:, :6] if v.dim() > 1 and k != "initial_states" else v for k, v in _ssd_inputs(0).items()}
    if rank == 1:  # rank 1 disagrees on the number of heads
        inputs.update(x=inputs["x"][:, :, :2], dt=inputs["dt"][:, :, :2], A=inputs["A"][:2])
    with pytest.raises(ValueError, match=r"disagree on shapes.*rank 1 has x \(2, seqlen, 2, 3\) float32"):
        cp.mamba_chunk_scan_combined(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], CHUNK)
    inputs = {k: v[:, :6] if v.dim() > 1 and k != "initial_states" else v for k, v in _ssd_inputs(0).items()}
    u = _selective_inputs(0, False)
    if rank == 1:  # an argument only rank 1 gets wrong: rank 1 raises its own error, the others name rank 1
        inputs["dt_bias"], u["delta"] = inputs["dt_bias"].double(), u["delta"][:, :2]
    with pytest.raises((TypeError, ValueError), match="dt_bias" if rank == 1 else "rank 1 of the context-parallel "
                       "group refused its arguments"):
        cp.mamba_chunk_scan_combined(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], CHUNK,
                                     dt_bias=inputs["dt_bias"])
    with pytest.raises(ValueError, match="delta" if rank == 1 else "rank 1 of the context-parallel group refused"):
        cp.selective_scan_fn(u["u"], u["delta"], u["A"], u["B"], u["C"])
    with pytest.raises(ValueError, match=r"disagree on shapes or dtypes.*rank 1 has u \(2, 4, seqlen\) bfloat16"):
        u = _selective_inputs(0, False)
        half = {k: u[k].to(torch.bfloat16) if rank == 1 else u[k] for k in ("u", "delta", "B", "C")}
        cp.selective_scan_fn(half["u"], half["delta"], u["A"], half["B"], half["C"])
    x = _randn(gen, 2, 3, 2 if rank == world - 1 else 5)  # the last shard is shorter than the halo (3)
    with pytest.raises(ValueError, match=rf"seqlen >= 3 \(the conv's halo.*rank {world - 1} of the group has seqlen 2"):
        cp.causal_conv1d(x, _randn(gen, 3, 4))
    config = MambaConfig(d_model=16, n_layer=2, vocab_size=32, ssm_cfg=dict(layer="Mamba2", headdim=8),
                         attn_layer_idx=[1], attn_cfg=dict(num_heads=2))
    with pytest.raises(ValueError, match="layer 1 is attention"):
        MambaLMHeadModel(config, context_parallel_group=dist.group.WORLD)
    block = ssmops.modules.Mamba2(16, headdim=8, context_parallel_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="context_parallel_group runs whole shards: inference_params"):
        block(torch.zeros(1, 5, 16), inference_params=object())


def _tiny_lm(layer: str, **kwargs) -> MambaLMHeadModel:
    torch.manual_seed(0)
    ssm_cfg = dict(layer=layer, d_state=4)
    ssm_cfg.update(dict(headdim=8, chunk_size=CHUNK, ngroups=2) if layer == "Mamba2" else {})
    config = MambaConfig(d_model=16, n_layer=2, vocab_size=32, ssm_cfg=ssm_cfg, d_intermediate=0 if layer == "Mamba2"
                         else 24)
    return MambaLMHeadModel(config, **kwargs)


def _train(model, input_ids, labels, tokens_in_all: int, steps: int, before_step=lambda model: None):
    """SGD steps on the sum of token losses over `tokens_in_all` (the whole sequence's count)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for _ in range(steps):
        logits = model(input_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        (loss / tokens_in_all).backward()
        before_step(model)
        optimizer.step()
        optimizer.zero_grad()
    return model


def _sum_gradients(model):
    for p in model.parameters():
        dist.all_reduce(p.grad)


def _check_lm_training(rank, world):
    """A Mamba-2 LM and a Mamba-1 LM (with an MLP) trained 3 steps with their layers context-parallel
    reach the parameters one process reaches; gradients summed over the group, as DDP would."""
    gen = torch.Generator().manual_seed(3)
    input_ids = torch.randint(0, 32, (2, sum(SHARDS[2]) + 1), generator=gen)
    inputs, labels = input_ids[:, :-1], input_ids[:, 1:]
    start, end = _bounds(world, rank)
    for layer in ("Mamba2", "Mamba1"):
        expected = _train(_tiny_lm(layer), inputs, labels, labels.numel(), steps=3)
        trained = _train(_tiny_lm(layer, context_parallel_group=dist.group.WORLD), inputs[:, start:end],
                         labels[:, start:end], labels.numel(), steps=3, before_step=_sum_gradients)
        initial = _tiny_lm(layer)
        for (name, p), q, p0 in zip(trained.named_parameters(), expected.parameters(), initial.parameters()):
            torch.testing.assert_close(p, q, **TOL, msg=lambda m: f"{layer} LM's {name}: {m}")
            assert not torch.equal(p, p0), f"{layer} LM's {name} did not train"


def _fully_shard(model, mesh):
    for layer in model.backbone.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _check_data_parallel_training(rank, world):
    """The Mamba-2 LM under DDP and under FSDP2 (fully_shard per layer and at the root), both over
    every rank, trained 3 steps reaches one process's parameters: data parallel alone (a batch row
    per rank), and with context parallelism (rows over a "dp" mesh dimension, the sequence over a
    "cp" one of 2)."""
    every_rank = init_device_mesh("cpu", (world,))
    mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "cp"))
    gen = torch.Generator().manual_seed(4)
    wrappers = {"DDP": lambda model: DistributedDataParallel(model), "FSDP2": lambda m: _fully_shard(m, every_rank)}
    for rows, cp_size in ((world, 1), (world // 2, 2)):
        input_ids = torch.randint(0, 32, (rows, sum(SHARDS[2]) + 1), generator=gen)
        inputs, labels = input_ids[:, :-1], input_ids[:, 1:]
        expected = _train(_tiny_lm("Mamba2"), inputs, labels, labels.numel(), steps=3)
        row, start, end, group = rank, 0, inputs.shape[1], None
        if cp_size > 1:
            row, group = mesh.get_local_rank("dp"), mesh["cp"]  # a mesh dimension as the CP group
            start, end = _bounds(2, mesh.get_local_rank("cp"))
        for name, wrap in wrappers.items():
            model = wrap(_tiny_lm("Mamba2", context_parallel_group=group))
            # both average the gradients over their ranks: each rank's loss is its part of the sum, times world
            trained = _train(model, inputs[row:row + 1, start:end], labels[row:row + 1, start:end],
                             labels.numel() / world, steps=3)
            for (param, p), q in zip(trained.named_parameters(), expected.parameters()):
                full = p.full_tensor() if isinstance(p, DTensor) else p
                torch.testing.assert_close(full, q, **TOL, msg=lambda m: f"{name} (dp {rows}, cp {cp_size}) "
                                                                         f"LM's {param}: {m}")


def _single_process_rows(name: str, t: torch.Tensor, block) -> torch.Tensor:
    """A tensor-parallel Mamba2's parameter (or gradient) `name`, whole, in one process's row order."""
    t = t.full_tensor() if isinstance(t, DTensor) else t
    bc, world = block.ngroups * block.d_state, block.tensor_parallel_mesh.size()
    segments = {"in_proj.weight": [block.d_ssm, block.d_ssm, bc, bc, block.nheads],
                "conv1d.weight": [block.d_ssm, bc, bc], "conv1d.bias": [block.d_ssm, bc, bc]}
    if name.split("mixer.")[-1] not in segments:
        return t
    return t[_rank_major_rows([n * world for n in segments[name.split("mixer.")[-1]]], world).argsort()]


def _check_tensor_parallel(rank, world):
    """Mamba2 with its heads split over every rank (parallelize_mamba2): the block's output and every
    gradient, and a Mamba-2 LM's parameters after 3 SGD steps, equal one process's."""
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    kwargs = dict(d_model=16, d_state=4, headdim=4, ngroups=4, chunk_size=CHUNK)  # 8 heads
    expected, block = Mamba2(**kwargs), Mamba2(**kwargs)
    block.load_state_dict(expected.state_dict())
    parallelize_mamba2(block, mesh)
    u = torch.randn(2, 11, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # inference too (the projections' no-grad path is ssmops' own operator)
        torch.testing.assert_close(block(u), expected(u), **TOL)
    out, out_expected = block(u), expected(u)
    torch.testing.assert_close(out, out_expected, **TOL)
    weight = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    (out * weight).sum().backward()
    (out_expected * weight).sum().backward()
    for (name, p), q in zip(block.named_parameters(), expected.parameters()):
        torch.testing.assert_close(_single_process_rows(name, p.grad, block), q.grad, **TOL,
                                   msg=lambda m: f"tensor-parallel Mamba2's grad of {name}: {m}")

    gen = torch.Generator().manual_seed(5)
    input_ids = torch.randint(0, 32, (2, 12), generator=gen)
    inputs, labels = input_ids[:, :-1], input_ids[:, 1:]
    lm = dict(layer="Mamba2", d_state=4, headdim=4, ngroups=4, chunk_size=CHUNK)
    config = MambaConfig(d_model=16, n_layer=2, vocab_size=32, ssm_cfg=lm)
    torch.manual_seed(0)
    expected = _train(MambaLMHeadModel(config), inputs, labels, labels.numel(), steps=3)
    torch.manual_seed(0)
    model = MambaLMHeadModel(config)
    for layer in model.backbone.layers:
        parallelize_mamba2(layer.mixer, mesh)
    trained = _train(model, inputs, labels, labels.numel(), steps=3)  # every rank: the whole batch
    for (name, p), q in zip(trained.named_parameters(), expected.parameters()):
        mixer = trained.get_submodule(name.split(".mixer.")[0] + ".mixer") if ".mixer." in name else None
        whole = _single_process_rows(name, p, mixer) if mixer is not None else p
        torch.testing.assert_close(whole, q, **TOL, msg=lambda m: f"tensor-parallel LM's {name}: {m}")


def _check_tensor_and_context_parallel(rank, world):
    """Mamba2 on a (cp 2, tp world / 2) mesh: each rank its heads of its shard of the sequence; the
    outputs and every gradient (summed over cp) equal one process's."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("cp", "tp"))
    torch.manual_seed(0)
    kwargs = dict(d_model=16, d_state=4, headdim=4, ngroups=4, chunk_size=CHUNK)
    expected, block = Mamba2(**kwargs), Mamba2(**kwargs, context_parallel_group=mesh["cp"])
    block.load_state_dict(expected.state_dict())
    parallelize_mamba2(block, mesh["tp"])
    u = torch.randn(2, sum(SHARDS[2]), 16, generator=torch.Generator().manual_seed(1))
    start, end = _bounds(2, mesh.get_local_rank("cp"))
    out, out_expected = block(u[:, start:end]), expected(u)
    torch.testing.assert_close(out, out_expected[:, start:end], **TOL)
    weight = torch.randn(out_expected.shape, generator=torch.Generator().manual_seed(2))
    (out * weight[:, start:end]).sum().backward()
    (out_expected * weight).sum().backward()
    for (name, p), q in zip(block.named_parameters(), expected.parameters()):
        dist.all_reduce(p.grad.to_local(), group=mesh.get_group("cp"))
        torch.testing.assert_close(_single_process_rows(name, p.grad, block), q.grad, **TOL,
                                   msg=lambda m: f"CP x TP Mamba2's grad of {name}: {m}")


def _check_all(rank, world):
    _check_errors(rank, world)
    _check_conv(rank, world)
    _check_selective(rank, world)
    _check_ssd(rank, world)
    _check_lm_training(rank, world)
    _check_data_parallel_training(rank, world)
    _check_tensor_parallel(rank, world)
    _check_tensor_and_context_parallel(rank, world)


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])  # 4 ranks on 2 cores: ~10 s
def test_parallel_runs_equal_one_process(world):
    run_group(world, _check_all)
