"""The weight-only linear layer of decoding (`weight_only_linear`): every backend against the
reference, for every weight format and both of the CPU kernel's paths (rows of x streamed against
each weight row, and the matmul beyond 16 rows); the checks; compile and export.

The reference (`ssmops/ops/linear/reference.py`) is checked against torch's own linear layer on
the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ssmops
from conftest import assert_close, assert_within_int16_rounding, backend_params
from ssmops.modules.linear import Linear, quantize_int8
from ssmops.ops.linear.reference import weight_only_linear_ref

WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)


def linear_inputs(rows, in_features, out_features, weight_dtype, x_dtype=torch.float32, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=gen).to(x_dtype)
    w = torch.randn(out_features, in_features, generator=gen) / in_features**0.5
    scale = None
    if weight_dtype == torch.int8:
        w, scale = quantize_int8(w)
    else:
        w = w.to(weight_dtype)
    b = torch.randn(out_features, generator=gen) if bias else None
    return x, w, scale, b


# rows: 1 (a decoding token), 3 and 5 (partial tiles of x rows), 16 (the last streamed size), 17 and
# 40 (the matmul path); in_features with and without a vector tail, short rows (tiled 8 at a time with
# one row of x) and long ones, and past one block of int8 sums (1024); out_features not a multiple of
# a tile's rows, and past one task's rows (24)
# (8, 1100, 13): tiles of 4 rows of x by 4 weight rows, summed 16 at once, over two int8 blocks and a
# partial last tile
SHAPES = [(1, 64, 8), (1, 37, 11), (1, 300, 50), (1, 1100, 30), (2, 1100, 5), (3, 96, 13), (5, 200, 7),
          (8, 1100, 13), (16, 33, 30), (17, 37, 11), (40, 64, 9)]


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_backend_matches_reference(backend, weight_dtype, shape):
    x, w, scale, b = linear_inputs(*shape, weight_dtype)
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(x, w, scale, b)
    expected = weight_only_linear_ref(x, w, scale, b)
    if backend == "cpu" and weight_dtype == torch.int8 and shape[0] <= 16:
        assert_within_int16_rounding(y, expected, x, w, scale)
    else:
        assert_close(y, expected, 1e-5, "y")


@pytest.mark.parametrize("backend", backend_params(names=("cpu",)))
@pytest.mark.parametrize("in_features", [1024, 2100, 4500])
def test_int8_extreme_values_do_not_overflow(backend, in_features):
    """Every x at the row's largest |x| against weights of -128: the integer products at their
    largest, summed in blocks of 1024 (past in_features 4096 a single int32 sum would overflow)."""
    x = torch.full((2, in_features), 3.0)
    x[1, ::2] = -3.0
    w = torch.full((5, in_features), -128, dtype=torch.int8)
    scale = torch.rand(5) + 0.5
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(x, w, scale)
    assert_close(y, weight_only_linear_ref(x, w, scale), 1e-6, "y")


@pytest.mark.parametrize("backend", backend_params(names=("cpu",)))
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("at", [5, 38], ids=["vectors", "tail"])  # 40 = 2 x 16 lanes + a tail of 8
def test_int8_row_of_x_with_nan_or_inf_gives_nans_in_its_row_only(backend, bad, at):
    x, w, scale, b = linear_inputs(4, 40, 9, torch.int8)
    x[1, at] = bad
    x[3] = 0.0
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(x, w, scale, b)
    assert bool(y[1].isnan().all()), "a row of x with a NaN or an infinity must give NaNs"
    assert torch.equal(y[3], b), "a row of zeros gives the bias"
    rest = torch.tensor([0, 2])
    assert_within_int16_rounding(y[rest], weight_only_linear_ref(x[rest], w, scale, b), x[rest], w, scale)


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("rows", [2, 20])
def test_low_precision_activations(backend, x_dtype, rows):
    x, w, scale, b = linear_inputs(rows, 48, 10, x_dtype if x_dtype == torch.bfloat16 else torch.int8, x_dtype)
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(x, w, scale, b.to(x_dtype))
    assert_close(y, weight_only_linear_ref(x, w, scale, b.to(x_dtype)), 1e-2, "y")


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_leading_dims_strided_x_and_no_bias(backend):
    x, w, _, _ = linear_inputs(6, 24, 5, torch.float32, bias=False)
    x3 = x.reshape(2, 3, 24).transpose(0, 1)  # (3, 2, 24), not contiguous
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(x3, w)
    assert y.shape == (3, 2, 5)
    assert_close(y, weight_only_linear_ref(x3, w), 1e-5, "y")


@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
@pytest.mark.parametrize("weight_dtype", WEIGHT_DTYPES, ids=str)
@pytest.mark.parametrize("rows", [(3,), (20, 2)], ids=["streamed", "matmul"])
def test_no_in_features_gives_the_bias(backend, weight_dtype, rows):
    # empty sums: each row of x is the bias, above 16 rows (aten's matmul) as below (the streamed kernel)
    w, b = torch.empty(5, 0, dtype=weight_dtype), torch.randn(5)
    scale = torch.rand(5) if weight_dtype == torch.int8 else None
    with ssmops.use_backend(backend):
        y = ssmops.weight_only_linear(torch.randn(*rows, 0), w, scale, b)
    assert torch.equal(y, b.expand(*rows, 5))


def test_reference_is_torch_linear_on_the_dequantized_weight():
    x, w, scale, b = linear_inputs(4, 32, 6, torch.int8)
    expected = F.linear(x.double(), w.double() * scale.double()[:, None], b.double()).float()
    torch.testing.assert_close(weight_only_linear_ref(x, w, scale, b), expected)


def test_int8_quantization_is_per_row_and_exact_on_representable_weights():
    w = torch.randn(5, 40)
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.shape == (5,)
    assert (q.abs().amax(dim=1) == 127).all()  # each row's largest weight maps to 127
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()
    q2, scale2 = quantize_int8(q.float() * scale[:, None])  # already on the grid: nothing lost
    assert torch.equal(q2, q)


def test_opcheck():
    for dtype in WEIGHT_DTYPES:
        for rows in (2, 20):
            torch.library.opcheck(torch.ops.ssmops.weight_only_linear.default, linear_inputs(rows, 16, 6, dtype))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: (a[0].double(), *a[1:]), TypeError, "x must have dtype"),
        (lambda a: (a[0], a[1].to(torch.int32), *a[2:]), TypeError, "weight must have dtype"),
        (lambda a: (a[0], a[1][:, :-1], *a[2:]), ValueError, r"weight must have shape \(out_features, in_features\)"),
        (lambda a: (a[0], a[1], None, a[3]), ValueError, "an int8 weight needs weight_scale"),
        (lambda a: (a[0], a[1], a[2][:-1], a[3]), ValueError, "weight_scale must have shape"),
        (lambda a: (a[0], a[1].float(), a[2], a[3]), ValueError, "weight_scale is for int8 weights only"),
        (lambda a: (*a[:3], a[3][:-1]), ValueError, "bias must have shape"),
    ],
)
@pytest.mark.parametrize("backend", backend_params(names=("default", "cpu")))
def test_errors_name_the_argument(backend, change, error, match):
    args = change(linear_inputs(2, 16, 6, torch.int8))
    with ssmops.use_backend(backend), pytest.raises(error, match=match):
        ssmops.weight_only_linear(*args)
    if backend == "cpu":  # the C++ kernel says the same without the Python checks
        with pytest.raises(RuntimeError, match=match):
            torch.ops.ssmops.weight_only_linear(*args)


@pytest.mark.parametrize("weights", ["fp32", "bf16", "int8"])
def test_linear_module_compiles_and_exports(weights):
    layer = Linear(24, 10)
    layer.convert_weight(weights)
    x = torch.randn(3, 24)
    with torch.no_grad():
        expected = layer(x)
        torch.testing.assert_close(torch.compile(layer, fullgraph=True)(x), expected)
        ep = torch.export.export(layer, (x,))
    assert "weight_only_linear" in str(ep.graph)
    torch.testing.assert_close(ep.module()(x), expected)


def test_linear_module_trains_through_aten_and_infers_through_the_operator():
    layer = Linear(8, 4)
    x = torch.randn(2, 8, requires_grad=True)
    layer(x).sum().backward()  # gradients: F.linear
    assert layer.weight.grad is not None and x.grad is not None
    with torch.no_grad():
        expected = F.linear(x, layer.weight, layer.bias)
        torch.testing.assert_close(layer(x), expected)
        layer.convert_weight("int8")
        assert layer.weight.dtype == torch.int8 and layer.compute_dtype == torch.float32
        torch.testing.assert_close(layer(x), expected, atol=0.02, rtol=0.02)
    with pytest.raises(ValueError, match="weights must be one of"):
        layer.convert_weight("int4")


@pytest.mark.parametrize("backend", backend_params(names=("cpu",)))
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.int8], ids=str)
def test_bitwise_across_thread_counts(backend, weight_dtype):
    """Threads that finish their share of the rows take the rest of the others' (the CPU kernel's
    `parallel_shares`): with more threads than cores they are descheduled at random, so the rows
    change hands from call to call. Every output row is computed once, by one thread, the same way:
    1, 2 and 7 threads give the serial result bit for bit, call after call."""
    x, w, scale, b = linear_inputs(1, 64, 24 * 200 + 5, weight_dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        serial = ssmops.weight_only_linear(x, w, scale, b)
        for n in (2, 7):
            torch.set_num_threads(n)
            for _ in range(20):
                assert torch.equal(ssmops.weight_only_linear(x, w, scale, b), serial)
    finally:
        torch.set_num_threads(threads)
    assert_close(serial, weight_only_linear_ref(x, w, scale, b), 1e-5 if weight_dtype == torch.float32 else 1e-3, "y")
