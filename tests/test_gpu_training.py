"""Training and export on a GPU: each front end a Mamba model trains through, and a Mamba, Mamba-2 and
hybrid LM, compiled with `torch.compile(fullgraph=True, dynamic=True)` (forward and backward, then another
seqlen on the same graph) and exported with a dynamic seqlen, against eager on the same device.

The CPU runs these paths in tests/test_compile_export.py, test_models.py and test_models_mamba2.py;
here they run on CUDA, where the Triton kernels are what torch.compile traces into (`make gpu-check`).
SSMOPS_TEST_DEVICE=cpu runs this module on the CPU (a check of the tests themselves).
"""

from __future__ import annotations

import os

import pytest
import torch

import ssmops
from conftest import rel_err
from ssmops.models import MambaLMHeadModel
from test_models import tiny_config
from test_models_mamba2 import HYBRID, mamba2_config

DEVICE = os.environ.get("SSMOPS_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")


def _randn(*shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, device=DEVICE) * scale).to(dtype).requires_grad_()


def _mamba_inner(seqlen: int) -> tuple:
    d_model, d_inner, dstate, dt_rank = 16, 32, 8, 2
    args = (_randn(2, 2 * d_inner, seqlen), _randn(d_inner, 4, scale=0.3), _randn(d_inner, scale=0.1),
            _randn(dt_rank + 2 * dstate, d_inner, scale=0.2), _randn(d_inner, dt_rank, scale=0.3),
            _randn(d_model, d_inner, scale=0.2), None, _randn(d_inner, dstate), None, None,
            _randn(d_inner), _randn(d_inner, scale=0.1))
    with torch.no_grad():
        args[7].copy_(-torch.rand(d_inner, dstate, device=DEVICE) - 0.1)
    return args


def mamba_inner(*args):
    return ssmops.mamba_inner_fn(*args, delta_softplus=True)


def _split_conv(seqlen: int) -> tuple:
    nheads, headdim, ngroups, dstate = 4, 8, 2, 8
    d_inner = nheads * headdim
    width = 2 * d_inner + 2 * ngroups * dstate + nheads
    conv_dim = d_inner + 2 * ngroups * dstate
    return (_randn(2, seqlen, width), _randn(conv_dim, 4, scale=0.3), _randn(conv_dim, scale=0.1),
            _randn(nheads, scale=0.1), (-torch.rand(nheads, device=DEVICE) - 0.5).requires_grad_(),
            _randn(nheads), _randn(d_inner, scale=0.2))


def split_conv(zxbcdt, conv_w, conv_b, dt_bias, A, D, rmsnorm_w):
    return ssmops.mamba_split_conv1d_scan_combined(zxbcdt, conv_w, conv_b, dt_bias, A, D, 16, headdim=8,
                                                   ngroups=2, rmsnorm_weight=rmsnorm_w, norm_before_gate=False)


def _ssd(seqlen: int) -> tuple:
    return (_randn(2, seqlen, 4, 8), _randn(2, seqlen, 4, scale=0.5), (-torch.rand(4, device=DEVICE) - 0.5),
            _randn(2, seqlen, 2, 16), _randn(2, seqlen, 2, 16), _randn(4), _randn(2, seqlen, 4, 8),
            _randn(4, scale=0.1))


def ssd(x, dt, A, B, C, D, z, dt_bias):
    return ssmops.mamba_chunk_scan_combined(x, dt, A, B, C, 16, D=D, z=z, dt_bias=dt_bias, dt_softplus=True)


def _scan(seqlen: int) -> tuple:
    args = (_randn(2, 16, seqlen), _randn(2, 16, seqlen, scale=0.5), _randn(16, 8), _randn(2, 2, 8, seqlen),
            _randn(2, 2, 8, seqlen), _randn(16), _randn(2, 16, seqlen), _randn(16, scale=0.1))
    with torch.no_grad():
        args[2].copy_(-torch.rand(16, 8, device=DEVICE) - 0.1)
    return args


def scan(u, delta, A, B, C, D, z, delta_bias):
    return ssmops.selective_scan_fn(u, delta, A, B, C, D, z, delta_bias, delta_softplus=True)


FUNCTIONS = {"selective_scan_fn": (scan, _scan), "mamba_chunk_scan_combined": (ssd, _ssd),
             "mamba_inner_fn": (mamba_inner, _mamba_inner),
             "mamba_split_conv1d_scan_combined": (split_conv, _split_conv)}


def _grads(fn, args):
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    out = fn(*args)
    return out.detach(), torch.autograd.grad((out.float() ** 2).sum(), leaves)


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_front_end_compiles_fullgraph_dynamic_forward_and_backward(name):
    fn, make_args = FUNCTIONS[name]
    torch.manual_seed(0)
    compiled = torch.compile(fn, fullgraph=True, dynamic=True)
    for seqlen in (40, 77):  # the second reuses the graph
        args = make_args(seqlen)
        out, grads = _grads(compiled, args)
        expected, expected_grads = _grads(fn, args)
        assert rel_err(out, expected) < 1e-4, name
        for g, e in zip(grads, expected_grads):
            assert rel_err(g, e) < 1e-4, name


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_front_end_exports_with_dynamic_seqlen(name, tmp_path):
    fn, make_args = FUNCTIONS[name]
    torch.manual_seed(0)

    class Module(torch.nn.Module):
        def forward(self, *args):
            return fn(*args)

    args = make_args(40)
    seqlen = torch.export.Dim("seqlen", min=2, max=4096)
    axis = {"mamba_chunk_scan_combined": 1, "mamba_split_conv1d_scan_combined": 1}.get(name, -1)

    def dims(a):
        if not isinstance(a, torch.Tensor) or a.dim() < 3:
            return None
        return {a.dim() - 1 if axis == -1 else axis: seqlen}

    with torch.no_grad():
        ep = torch.export.export(Module(), args, dynamic_shapes=(tuple(dims(a) for a in args),))  # (forward's *args)
    torch.export.save(ep, tmp_path / "fn.pt2")
    loaded = torch.export.load(tmp_path / "fn.pt2").module()
    other = make_args(77)
    with torch.no_grad():
        assert rel_err(loaded(*other), fn(*other)) < 1e-5, name


LMS = {"mamba": lambda: tiny_config(ssm_cfg={"d_state": 8}), "mamba2": mamba2_config,
       "hybrid": lambda: mamba2_config(**HYBRID)}


@pytest.mark.parametrize("name", list(LMS))
def test_lm_train_step_compiles_and_exports(name):
    torch.manual_seed(0)
    model = MambaLMHeadModel(LMS[name]()).to(DEVICE)
    compiled = torch.compile(model, fullgraph=True, dynamic=True)
    for seqlen in (24, 37):
        ids = torch.randint(0, 61, (2, seqlen), device=DEVICE)
        grads = []
        for forward in (compiled, model):
            model.zero_grad()
            loss = forward(ids).logits.float().square().mean()
            loss.backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for g, e in zip(*grads):
            assert rel_err(g, e) < 1e-3, name
    import ssmops.export as sx

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids).logits

    ids = torch.randint(0, 61, (2, 9), device=DEVICE)
    ep = sx.export_program(Logits().eval(), (ids,))
    other = torch.randint(0, 61, (2, 17), device=DEVICE)
    with torch.no_grad():
        assert rel_err(ep.module()(other), model(other).logits) < 1e-4, name
