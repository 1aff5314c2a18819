"""The native fp32 linear of CPU models (csrc/f32_linear.cpp, hf/cpu_f32.py): the layer equals an
emulation of its arithmetic bit for bit (each output: fused multiply-adds over the inputs in order,
then the bias) on every row count and panel remainder it specialises, on both code paths; a row's
result never depends on the call's other rows or the thread count; packing layout; non-finite and
zero-size inputs; clear errors; and a swapped model keeps greedy identity with ``generate``."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from specdec_kernels.hf.cpu_f32 import (  # noqa: E402
    F32_PANEL,
    NativeLinear,
    native_linear_available,
    pack_f32,
    unpack_f32,
    use_native_linears,
)
from specdec_kernels.hf.cpu_linear import (  # noqa: E402
    CPU_LINEARS,
    OneDnnLinear,
    _onednn_bf16,
    onednn_linear_available,
    use_cpu_linears,
)
from specdec_kernels.ops.csrc import cpu_backend_ready  # noqa: E402

from .._threads import under_threads  # noqa: E402

pytestmark = pytest.mark.skipif(not cpu_backend_ready(), reason="the native CPU build does not load here")


def _layer(in_features: int, out_features: int, bias: bool = True) -> NativeLinear:
    linear = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    return NativeLinear.from_linear(linear)


def _emulated(layer: NativeLinear, x: torch.Tensor) -> torch.Tensor:
    """acc = 0; acc = fma(w[n, k], x[m, k], acc) for k in order; acc + b[n]: each fp32 x fp32 product is
    exact in float64 and so is its sum with an fp32 accumulator of these magnitudes, so rounding the
    float64 sum to fp32 is the fused multiply-add's one rounding."""
    w = layer.weight.double()
    acc = torch.zeros(x.shape[0], layer.out_features, dtype=torch.float32)
    for k in range(layer.in_features):
        acc = (acc.double() + x[:, k : k + 1].double() * w[None, :, k]).float()
    return acc + layer.bias if layer.bias is not None else acc


@pytest.mark.parametrize("out_features, in_features", [(1, 1), (15, 7), (16, 64), (17, 33), (70, 130), (100, 3)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 13, 25])
def test_layer_equals_its_emulation(simd_path, out_features, in_features, rows):
    """Every row count the kernel specialises (up to 12 rows a pass; 4 panels of 16 output rows at a
    time up to 6 rows, 3 up to 9, else 2, tails 2 and 1 panels; prefetching past 4 rows; 13 and 25
    rows: balanced passes), output widths that end inside a panel; bit for bit."""
    torch.manual_seed(rows * 7 + in_features)
    layer = _layer(in_features, out_features, bias=out_features % 2 == 0)
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, in_features)  # inputs of very different scales
    assert torch.equal(layer(x), _emulated(layer, x))


def test_agrees_with_nn_linear_on_views_and_shapes():
    torch.manual_seed(0)
    linear = nn.Linear(48, 37)
    fast = NativeLinear.from_linear(linear)
    wide = torch.randn(3, 5, 96)
    for x in (wide[..., :48], wide[..., ::2], wide[0, :1, :48], wide[:, :0, :48]):  # views, one row, no rows
        got = fast(x)
        assert got.shape == linear(x).shape and got.dtype == torch.float32
        torch.testing.assert_close(got, linear(x), atol=1e-5, rtol=1e-5)


def test_rows_do_not_depend_on_each_other_threads_or_the_path(monkeypatch):
    """One order of sums whatever the call: each row alone equals its row of a 14-row call (two
    passes), 2 threads equal 1, and the portable loop equals the AVX-512 path."""
    torch.manual_seed(2)
    layer = _layer(384, 203)
    x = torch.randn(14, 384)
    x[3] *= 1e3
    batch = layer(x)
    for r in range(14):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r])
    one, two = under_threads(lambda: layer(x), 1, 2)
    assert torch.equal(one, batch) and torch.equal(two, batch)
    monkeypatch.setenv("SPECDEC_CPU_SIMD", "0")
    assert torch.equal(layer(x), batch)


def test_packing_layout_and_round_trip():
    """Panel p is [K][16]: for input k the weights of rows 16 p .. 16 p + 15; rows past N are zero."""
    N, K = 20, 3
    w = torch.arange(N * K, dtype=torch.float32).reshape(N, K)
    packed = pack_f32(w)
    assert packed.shape == (2, K * F32_PANEL) and packed.is_contiguous()
    panels = packed.reshape(2, K, F32_PANEL)
    assert torch.equal(panels[0, 1], w[:16, 1]) and torch.equal(panels[1, 2, :4], w[16:, 2])
    assert panels[1, :, 4:].eq(0).all()
    assert torch.equal(unpack_f32(packed, N, K), w)
    # (the weight read back and non-finite inputs: test_cpu_linear.py, for both packed kinds)


@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")
def test_zero_sized_layers_and_inputs():
    """No inputs: the outputs are the bias; no outputs or no rows: empty results."""
    no_inputs = _layer(0, 5)
    assert torch.equal(no_inputs(torch.randn(3, 0)), no_inputs.bias.detach().expand(3, 5))
    assert torch.equal(_layer(0, 5, bias=False)(torch.randn(2, 0)), torch.zeros(2, 5))
    assert _layer(7, 0)(torch.randn(2, 7)).shape == (2, 0)
    assert _layer(7, 3)(torch.randn(4, 0, 7)).shape == (4, 0, 3)


def test_bad_layers_and_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="CPU fp32 weight"):
        NativeLinear.from_linear(nn.Linear(8, 4).to(torch.bfloat16))
    fast = _layer(8, 4)
    with pytest.raises(ValueError, match="expected 8"):
        fast(torch.randn(2, 9))
    with pytest.raises(ValueError, match="fp32 on the CPU"):
        fast(torch.randn(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cpu linear kind"):
        use_cpu_linears(nn.Linear(2, 2), "mkl")


def test_the_kernel_checks_its_arguments():
    from specdec_kernels.ops.csrc import load_cpu_core

    fast = _layer(8, 4)
    with pytest.raises(RuntimeError, match="wp must be"):
        load_cpu_core().f32_linear(torch.randn(2, 8), fast.packed[:, :-1].contiguous(), None, 4)
    with pytest.raises(RuntimeError, match="bias must be"):
        load_cpu_core().f32_linear(torch.randn(2, 8), fast.packed, torch.zeros(3), 4)


# (greedy identity after the swap: test_cpu_linear.py, for both packed kinds)


@pytest.mark.skipif(not (native_linear_available() and onednn_linear_available()), reason="needs both kernels")
def test_cpu_linear_kinds():
    """native: fp32 layers on the native kernel, the others on oneDNN; onednn: all on oneDNN; torch: none.
    The command line and the benches offer exactly these kinds."""
    bf16 = torch.bfloat16
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(bf16), nn.Linear(8, 8, bias=False).to(bf16))
    model.append(nn.Linear(8, 8).half())
    model.append(nn.Linear(8, 8, device="meta"))  # not on the CPU: left alone by every kind
    bf16_layers = 2 if _onednn_bf16() else 0  # oneDNN's bf16 linear needs AVX-512 (or AVX-NE-CONVERT)
    assert use_cpu_linears(copy.deepcopy(model), "torch") == (0, 0)
    assert use_cpu_linears(copy.deepcopy(model), "onednn") == (0, 1 + bf16_layers)
    swapped = copy.deepcopy(model)
    assert use_cpu_linears(swapped, "native") == (1, bf16_layers)
    bf16_kind = OneDnnLinear if bf16_layers else nn.Linear
    assert [type(m) for m in swapped] == [NativeLinear, bf16_kind, bf16_kind, nn.Linear, nn.Linear]
    import sys
    from pathlib import Path

    from specdec_kernels.cli.parser import build_parser

    bench = Path(__file__).resolve().parents[2] / "bench"
    sys.path.insert(0, str(bench))
    try:
        import bench_e2e
        import bench_forward_rows
    finally:
        sys.path.remove(str(bench))
    args = ["generate", "--target", "t", "--prompt", "p", "--cpu-linear"]
    assert build_parser().parse_args(args[:-1]).cpu_linear == "native"  # the fastest, measured side by side
    for kind in CPU_LINEARS:
        assert build_parser().parse_args([*args, kind]).cpu_linear == kind
        assert bench_forward_rows.parse_args(["--smoke", "--cpu-linear", kind]).cpu_linear == [kind]
        assert bench_e2e.parse_args(["--smoke", "--cpu-linear", kind]).cpu_linear == [kind]


def test_a_native_draft_can_still_be_quantised():
    """use_int8_linears takes NativeLinear layers as it takes nn.Linear ones (their unpacked weight)."""
    from specdec_kernels.hf.cpu_int8 import Int8Linear, use_int8_linears

    model = nn.Sequential(nn.Linear(16, 24), nn.ReLU(), nn.Linear(24, 8))
    if use_native_linears(model) == 0:
        pytest.skip("no AVX-512 path here (the swap is a no-op)")
    assert use_int8_linears(model) == 2
    assert [type(m) for m in model] == [Int8Linear, nn.ReLU, Int8Linear]
