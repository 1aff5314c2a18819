"""specdec_kernels.hf.cpu_linear: oneDNN linear layers agree with nn.Linear and keep greedy identity."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.cpu_linear import (  # noqa: E402
    OneDnnLinear,
    _onednn_bf16,
    onednn_linear_available,
    use_onednn_linears,
)

from ._models import tiny_model  # noqa: E402

pytestmark = pytest.mark.skipif(not onednn_linear_available(), reason="this PyTorch build has no oneDNN")

PAD = 2
# oneDNN's bf16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT (not on an AVX2-only CPU)
NO_BF16 = pytest.mark.skipif(not _onednn_bf16(), reason="oneDNN has no bf16 linear on this CPU")


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-4), pytest.param(torch.bfloat16, 0.1, marks=NO_BF16)])
@pytest.mark.parametrize("bias", [True, False])
def test_matches_nn_linear(dtype, atol, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 37, bias=bias).to(dtype)
    fast = OneDnnLinear.from_linear(linear)
    wide = torch.randn(3, 5, 96).to(dtype)
    # a 3-D input, a strided view of one, a single row and no rows at all
    for x in (wide[..., :48], wide[..., ::2], wide[0, :1, :48], wide[:, :0, :48]):
        expected = linear(x).float()
        got = fast(x)
        assert got.shape == expected.shape and got.dtype == dtype
        torch.testing.assert_close(got.float(), expected, atol=atol, rtol=atol)


def _packed_kinds():
    """OneDnnLinear, and cpu_f32.NativeLinear where the native CPU build loads."""
    from specdec_kernels.hf.cpu_f32 import NativeLinear
    from specdec_kernels.ops.csrc import cpu_backend_ready

    native = pytest.mark.skipif(not cpu_backend_ready(), reason="the native CPU build does not load here")
    return [OneDnnLinear, pytest.param(NativeLinear, marks=native, id="NativeLinear")]


@pytest.mark.parametrize("kind", _packed_kinds())
def test_weight_reads_back_the_original(kind):
    linear = nn.Linear(12, 5)
    fast = kind.from_linear(linear)
    assert torch.equal(fast.weight, linear.weight.detach()) and fast.bias is linear.bias


@pytest.mark.parametrize("kind", _packed_kinds())
def test_nan_inf_and_subnormal_inputs_match_nn_linear(kind):
    """A NaN or inf in a row reaches that row's outputs as nn.Linear's do; subnormals are kept."""
    torch.manual_seed(1)
    linear = nn.Linear(16, 8)
    fast = kind.from_linear(linear)
    x = torch.randn(4, 16)
    x[0, 3], x[1, 5], x[2] = float("nan"), float("inf"), 1e-40
    torch.testing.assert_close(fast(x), linear(x), equal_nan=True, atol=1e-5, rtol=1e-5)
    assert torch.isnan(fast(x)[0]).all() and torch.isfinite(fast(x)[3]).all()


def test_wrong_width_is_a_clear_error():
    fast = OneDnnLinear.from_linear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="expected 8"):
        fast(torch.randn(2, 9))


def test_models_it_cannot_speed_up_are_left_alone():
    model = nn.Sequential(nn.Linear(8, 8).half(), nn.ReLU())
    assert use_onednn_linears(model) == 0
    assert type(model[0]) is nn.Linear


def _swaps():
    """use_onednn_linears, and cpu_f32.use_native_linears where it has its AVX-512 path."""
    from specdec_kernels.hf.cpu_f32 import native_linear_available, use_native_linears

    native = pytest.mark.skipif(not native_linear_available(), reason="no AVX-512 path here (a no-op swap)")
    return [use_onednn_linears, pytest.param(use_native_linears, marks=native, id="use_native_linears")]


@pytest.mark.parametrize("swap", _swaps())
def test_greedy_identity_after_the_swap(swap):
    """Every nn.Linear is swapped (the output layer included) and speculative_generate still equals
    target.generate token for token when both run the swapped models."""
    target = tiny_model("qwen2", seed=3)  # qwen2: q/k/v projections with biases
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * p.std() * torch.randn_like(p))
    ids = torch.randint(3, 97, (2, 6), generator=torch.Generator().manual_seed(0))
    logits_before = target(ids).logits
    n_linear = sum(type(m) is nn.Linear for m in target.modules())
    assert swap(target) == n_linear > 0
    swap(draft)
    assert not any(type(m) is nn.Linear for m in target.modules())
    torch.testing.assert_close(target(ids).logits, logits_before, atol=1e-4, rtol=1e-4)
    expected = target.generate(input_ids=ids, max_new_tokens=12, do_sample=False, pad_token_id=PAD)
    out = speculative_generate(
        target,
        draft,
        ids,
        max_new_tokens=12,
        num_draft_tokens=4,
        eos_token_id=[],
        pad_token_id=PAD,
        adaptive_draft=False,  # drafts every step (the policy may take target-only steps for this weak draft)
    )
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=NO_BF16)])
def test_short_inputs_are_padded_and_agree(dtype, monkeypatch):
    """1 to MIN_ROWS - 1 rows run oneDNN on MIN_ROWS rows (its short-input kernels are slow, and a bf16
    one with a bias is a reference path); the real rows' outputs are those of nn.Linear, any leading shape."""
    from specdec_kernels.hf import cpu_linear

    torch.manual_seed(2)
    linear = nn.Linear(40, 23).to(dtype)
    fast = OneDnnLinear.from_linear(linear)
    seen = []
    monkeypatch.setattr(OneDnnLinear, "_linear", lambda self, x: seen.append(x.shape[0]) or linear(x))
    atol = 1e-4 if dtype == torch.float32 else 0.1
    for shape in [(1, 40), (1, 1, 40), (2, 1, 40), (3, 40), (1, 4, 40), (2, 3, 40)]:
        x = torch.randn(shape).to(dtype)
        seen.clear()
        got = fast(x)
        rows = x.numel() // 40
        assert got.shape == (*shape[:-1], 23)
        assert seen == ([cpu_linear.MIN_ROWS] if rows < cpu_linear.MIN_ROWS else [shape[0]])
        torch.testing.assert_close(got.float(), linear(x).float(), atol=atol, rtol=atol)


def test_bf16_layers_where_onednn_has_no_bf16_linear_are_left_or_refused(monkeypatch):
    """On a CPU without oneDNN's bf16 linear (AVX2 only) the swap leaves bf16 layers as they are and
    from_linear says why, instead of oneDNN's error from inside its weight reorder."""
    from specdec_kernels.hf import cpu_linear

    monkeypatch.setattr(cpu_linear, "_onednn_bf16", lambda: False)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16))
    assert use_onednn_linears(model) == 1
    assert [type(m) for m in model] == [OneDnnLinear, nn.Linear]
    with pytest.raises(ValueError, match="no bf16 linear on this CPU"):
        OneDnnLinear.from_linear(nn.Linear(8, 8).to(torch.bfloat16))
