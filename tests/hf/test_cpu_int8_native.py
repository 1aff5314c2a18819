"""The native int8 kernel of CPU drafts (csrc/int8_linear.cpp, hf/cpu_int8.py kernel="native"): the
layer equals a float64 emulation of its arithmetic on every row count and panel remainder it
specialises, on both code paths; packing layout; rows independent of each other; non-finite inputs;
threads; clear errors. The draft-level tests (greedy identity, chi-square) run for both kernels in
test_cpu_int8.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from specdec_kernels.hf.cpu_int8 import (
    INT8_MAX_K,
    INT8_PANEL,
    Int8Linear,
    native_int8_available,
    pack_int8,
    unpack_int8,
)

from .._threads import under_threads
from .test_cpu_int8 import _emulated

pytestmark = pytest.mark.skipif(not native_int8_available(), reason="the native CPU build does not load here")


def _layer(in_features: int, out_features: int, bias: bool = True) -> Int8Linear:
    linear = nn.Linear(in_features, out_features, bias=bias).requires_grad_(False)
    return Int8Linear.from_linear(linear, kernel="native")


@pytest.mark.parametrize(
    "out_features, in_features",
    [(1, 4), (37, 50), (130, 96), (16, 3), (64, 257), (81, 640), (70, 1031)],
)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_layer_equals_its_emulation(simd_path, out_features, in_features, rows):
    """Every row count the kernel specialises (1-8 rows a pass), both panel plans (up to 1,024 padded
    inputs one panel of 16 output rows at a time; longer panels 4 or 2 at a time, the remainder one at
    a time: 1,031 inputs), output widths that end inside a panel, input widths that end inside a group
    of 4 (padded with zeros)."""
    torch.manual_seed(rows)
    layer = _layer(in_features, out_features)
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, in_features)  # inputs of very different scales
    x[0] += 3.0  # a row whose range does not straddle 0 much (the zero point near 0)
    got = layer(x)
    want = _emulated(layer, x)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * float(want.abs().max()), rtol=1e-5)


def test_rows_do_not_depend_on_each_other_and_the_two_paths_agree(monkeypatch):
    """Per-row input scales: a row's output is the same alone or beside other rows (fbgemm's is not)."""
    torch.manual_seed(2)
    layer = _layer(384, 70)
    x = torch.randn(6, 384)
    x[3] *= 1e3
    batch = layer(x)
    for r in range(6):
        assert torch.equal(layer(x[r : r + 1])[0], batch[r])
    for path in ("avx2", "0"):  # AVX2 (where AVX-512 VNNI ran above) and the portable loop
        monkeypatch.setenv("SPECDEC_CPU_SIMD", path)
        assert torch.equal(layer(x), batch)  # the same int32 sums and the same fp32 scaling


def test_packing_layout_and_round_trip():
    """Panel p holds rows 16 p .. 16 p + 15: its vector q holds inputs 4 q .. 4 q + 3 of each row, row
    by row; rows past N and inputs past K are zero; wsum is each row's sum of q."""
    N, K = 20, 10
    w = torch.arange(N * K, dtype=torch.float32).reshape(N, K) - 90.0
    wq, sw, wsum = pack_int8(w)
    P, Kp = 2, 12
    assert wq.shape == (P, Kp * INT8_PANEL) and wq.dtype == torch.int8
    assert sw.shape == wsum.shape == (P * INT8_PANEL,) and wsum.dtype == torch.int32
    q = torch.round(w / sw[:N, None]).clamp(-127, 127).to(torch.int8)
    panels = wq.reshape(P, Kp // 4, INT8_PANEL, 4)
    assert torch.equal(panels[0, 1, 3], q[3, 4:8])  # panel 0, inputs 4-7 of row 3
    assert torch.equal(panels[1, 2, 2, :2], q[18, 8:10]) and panels[1, 2, 2, 2:].eq(0).all()  # K padding
    assert panels[1, :, 4:].eq(0).all() and sw[N:].eq(0).all() and wsum[N:].eq(0).all()  # row padding
    assert torch.equal(wsum[:N], q.int().sum(1).int())
    assert torch.equal(unpack_int8(wq, N, K), q)
    torch.manual_seed(3)
    w = torch.randn(33, 70)
    back = unpack_int8(pack_int8(w)[0], 33, 70).float() * pack_int8(w)[1][:33, None]
    step = w.abs().amax(1, keepdim=True) / 127
    assert float(((back - w) / step).abs().max()) <= 0.5 + 1e-4


def test_non_finite_inputs_give_nan_rows_and_zero_rows_give_the_bias():
    layer = _layer(128, 8)
    x = torch.randn(4, 128)
    x[1, 5] = float("nan")
    x[2, 100] = float("inf")
    x[3] = 0.0
    y = layer(x)
    assert bool(torch.isfinite(y[0]).all()) and bool(y[1:3].isnan().all())
    torch.testing.assert_close(y[3], layer.bias.float(), rtol=0, atol=0)


def test_zero_sized_layers_and_inputs():
    """No inputs: the outputs are the bias; no outputs or no rows: empty results."""
    no_inputs = _layer(0, 5)
    torch.testing.assert_close(no_inputs(torch.randn(3, 0)), no_inputs.bias.float().expand(3, 5), rtol=0, atol=0)
    assert _layer(7, 0)(torch.randn(2, 7)).shape == (2, 0)
    assert _layer(7, 3)(torch.randn(4, 0, 7)).shape == (4, 0, 3)


def test_bad_layers_and_inputs_are_clear_errors():
    bad = nn.Linear(8, 4)
    bad.weight.data[0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or infinite"):
        Int8Linear.from_linear(bad, kernel="native")
    with pytest.raises(ValueError, match=f"<= {INT8_MAX_K} inputs"):
        Int8Linear.from_linear(nn.Linear(INT8_MAX_K + 1, 1), kernel="native")


def test_the_kernel_checks_its_arguments():
    from specdec_kernels.ops.csrc import load_cpu_core

    layer = _layer(8, 4)
    with pytest.raises(RuntimeError, match="wq must be"):
        load_cpu_core().w8a8_linear(torch.randn(2, 12), layer.wq, layer.sw, layer.wsum, None, 4)


def test_threads_split_the_panels_without_changing_them():
    """at::parallel_for splits the panels: each output is computed by one thread in the same order,
    so 2 threads give the same bits as 1."""
    torch.manual_seed(5)
    layer = _layer(320, 203)
    x = torch.randn(3, 320)
    one, two = under_threads(lambda: layer(x), 1, 2)
    assert torch.equal(one, two)
