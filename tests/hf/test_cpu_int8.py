"""specdec_kernels.hf.cpu_int8: int8 linear layers for CPU drafts, both kernels (the native one,
csrc/int8_linear.cpp, and fbgemm's). The layer equals an exact emulation of its arithmetic; an int8
draft keeps greedy identity and the sampled law, also when the rows of one draft forward share their
input scale (fbgemm, a batch of different prompts). The native kernel's own cases (every row count,
both code paths, packing, threads) are in test_cpu_int8_native.py."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from specdec_kernels.hf import cpu_int8, speculative_generate  # noqa: E402
from specdec_kernels.hf.cpu_int8 import (  # noqa: E402
    Int8Linear,
    _fbgemm_available,
    int8_linear_available,
    native_int8_available,
    use_int8_linears,
)
from specdec_kernels.hf.cpu_linear import OneDnnLinear, onednn_linear_available  # noqa: E402
from specdec_kernels.hf.draft_vocab import DraftVocab  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402
from .test_generate import PAD, _greedy_reference, _near_copy, _ragged_prompts, _two_token_distribution  # noqa: E402

pytestmark = pytest.mark.skipif(not int8_linear_available(), reason="no int8 kernel here")

KERNELS = [
    pytest.param("native", marks=pytest.mark.skipif(not native_int8_available(), reason="no native CPU build")),
    pytest.param("fbgemm", marks=pytest.mark.skipif(not _fbgemm_available(), reason="no fbgemm int8 linear")),
]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    """Every Int8Linear made in the test (use_int8_linears, from_linear) uses this kernel."""
    monkeypatch.setattr(
        cpu_int8, "_pick_kernel", lambda asked, pick=cpu_int8._pick_kernel: pick(asked or request.param)
    )
    return request.param


def _quantised_rows(rows: torch.Tensor, per_row: bool, levels: int = 255) -> tuple[torch.Tensor, torch.Tensor]:
    """(q - zero [R, K] float64, scale [R, 1] float64): unsigned integers 0..levels with a zero point,
    the range widened to hold 0, scale (max - min) / levels, zero round(-min / scale); per row (native,
    in fp32 as the kernel computes it: q = round(x * (1 / scale)) + zero) or over all rows (fbgemm:
    levels 127 where it reduces the range)."""
    if per_row:
        x = rows.float()
        lo, hi = x.amin(1, keepdim=True).clamp_max(0), x.amax(1, keepdim=True).clamp_min(0)
        scale = (hi - lo) / levels
        inv = torch.where(hi > lo, 1 / torch.where(hi > lo, scale, 1.0), 0.0)
        zero = torch.round(-lo * inv).clamp(0, levels)
        q = (torch.round(x * inv) + zero).clamp(0, levels) - zero
        return q.double(), scale.double()
    lo, hi = min(float(rows.min()), 0.0), max(float(rows.max()), 0.0)
    scale = (hi - lo) / levels if hi > lo else 1.0
    zero = min(levels, max(0, round(-lo / scale))) if hi > lo else 0
    q = torch.clamp(torch.round(rows.double() / scale) + zero, 0, levels) - zero
    return q, torch.full((rows.shape[0], 1), scale, dtype=torch.float64)


def _emulated(layer: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's arithmetic in float64: int8 weights (round(W / s_row)), the input quantised to
    uint8 (:func:`_quantised_rows`), exact integer sums, scaled back, plus the bias."""
    rows = x.reshape(-1, layer.in_features)
    scales = layer.scales.double()
    q_w = torch.round(layer.weight.double() / scales[:, None])
    q_x, scale = _quantised_rows(rows, per_row=layer.kernel == "native", levels=127 if layer.reduce_range else 255)
    y = (q_x @ q_w.T) * scale * scales
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_layer_equals_its_emulation_and_stays_near_the_original(kernel, dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(48, 37, bias=bias).to(dtype).requires_grad_(False)
    layer = Int8Linear.from_linear(linear)
    assert layer.kernel == kernel
    wide = torch.randn(3, 5, 96).to(dtype)
    # a 3-D input, a strided view of one, a single row, a shifted and scaled one, no rows at all
    for x in (wide[..., :48], wide[..., ::2], wide[0, :1, :48], 7 * wide[1, :2, :48] + 3, wide[:, :0, :48]):
        got = layer(x)
        assert got.shape == (*x.shape[:-1], 37) and got.dtype == dtype
        if x.numel() == 0:
            continue
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
        torch.testing.assert_close(got.double(), _emulated(layer, x), atol=tol * float(got.abs().max()), rtol=tol)
        original = linear(x).double()
        assert float((got.double() - original).norm() / original.norm()) < 0.03  # int8's error, not a bug's


def test_weight_reads_back_within_half_a_step_and_a_onednn_layer_quantises_alike(kernel):
    torch.manual_seed(1)
    linear = nn.Linear(20, 9).requires_grad_(False)
    layer = Int8Linear.from_linear(linear)
    step = linear.weight.abs().amax(dim=1, keepdim=True) / 127
    assert float(((layer.weight - linear.weight) / step).abs().max()) <= 0.5 + 1e-5
    assert float((layer.weight.abs().amax(dim=1) - linear.weight.abs().amax(dim=1)).abs().max()) < 1e-6
    if onednn_linear_available():
        x = torch.randn(4, 20)
        assert torch.equal(Int8Linear.from_linear(OneDnnLinear.from_linear(linear))(x), layer(x))


def test_wrong_width_and_bad_layers_are_clear_errors(kernel, monkeypatch):
    layer = Int8Linear.from_linear(nn.Linear(8, 4))
    with pytest.raises(ValueError, match="expected 8"):
        layer(torch.randn(2, 9))
    with pytest.raises(ValueError, match="fp32/bf16"):
        Int8Linear.from_linear(nn.Linear(8, 4).half())
    with pytest.raises(ValueError, match="name parts"):
        use_int8_linears(nn.Sequential(nn.Linear(8, 4)), keep="down_proj")
    with pytest.raises(ValueError, match="kernel must be"):
        Int8Linear.from_linear(nn.Linear(8, 4), kernel="onednn")
    monkeypatch.setattr(cpu_int8, "int8_linear_available", lambda: False)
    with pytest.raises(ValueError, match="no int8 kernel"):
        use_int8_linears(nn.Sequential(nn.Linear(8, 4)))


def test_use_int8_linears_swaps_every_linear_but_the_kept_names(kernel):
    model = tiny_model("llama", seed=1)
    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    kept = [n for n in linears if "down_proj" in n]
    assert kept and len(kept) < len(linears)
    quantized = copy.deepcopy(model)
    assert use_int8_linears(quantized, keep=("down_proj",)) == len(linears) - len(kept)
    types = {n: type(m) for n, m in quantized.named_modules()}
    assert all(types[n] is (nn.Linear if n in kept else Int8Linear) for n in linears)
    ids = torch.tensor([[5, 9, 11, 3]])
    with torch.no_grad():
        a, b = model(ids).logits, quantized(ids).logits
    seven_bit = any(getattr(m, "reduce_range", False) for m in quantized.modules())  # fbgemm without VNNI
    assert float((a - b).norm() / a.norm()) < (0.1 if seven_bit else 0.05)
    assert use_int8_linears(quantized) == len(kept)  # the rest, on a second call


def _int8_copy(model):
    quantized = copy.deepcopy(model)
    use_int8_linears(quantized)
    return quantized


@pytest.mark.parametrize(
    "kw",
    [dict(num_draft_tokens=4), dict(draft_tree="dynamic", num_draft_tokens=8, tree_width=3, method="rrs_wor")],
    ids=["chain", "tree"],
)
def test_greedy_with_an_int8_draft_equals_generate(kernel, kw):
    """Batch 3, ragged: the draft's rows share one input scale per forward; the output is the target's."""
    target = tiny_model("llama", seed=1)
    draft = _int8_copy(_near_copy(target, 0.3, seed=5))
    ids, mask = _ragged_prompts()
    out = speculative_generate(
        target, draft, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=[], pad_token_id=PAD, **kw
    )
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    assert out.stats.acceptance_rate > 0.2  # the int8 draft still proposes the target's tokens (tree: per node)


def test_an_int8_output_layer_can_be_restricted_to_a_draft_vocab(kernel):
    draft = _int8_copy(tiny_model("llama", seed=2))
    out = draft.get_output_embeddings()
    assert isinstance(out, Int8Linear)
    kept = [0, 1, 4, 9, 30, 64, 96]
    head = DraftVocab(kept).head_for(draft)
    assert isinstance(head.kept, Int8Linear) and head.kept.kernel == kernel
    x = torch.randn(2, 3, out.in_features)
    # the kept rows' int8 values and scales are the original's, so the outputs are too (the input
    # scale is the same: it depends on x only)
    torch.testing.assert_close(head(x)[..., kept], out(x)[..., kept], rtol=1e-6, atol=1e-6)


def test_sampled_output_follows_the_target_with_rows_that_share_an_input_scale(kernel):
    """Chi-square (alpha 1e-6) on the first two tokens (V = 6: 36 cells) of 2 x 1500 requests at
    T = 1, chain and dynamic tree, with an int8 draft and two different prompts interleaved in one
    batch (fbgemm: each draft forward quantises all its rows with one scale, so a row's q depends on
    the other prompt's rows; native: per row). Each prompt's pairs are tested against its own target law.

    Power, asserted below: the test rejects with probability > 0.99 the draft's own law (a verifier
    that accepts every draft) for each prompt."""
    V, n = 6, 1500
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)
    draft = _int8_copy(tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1))
    prompts = ([3, 4, 5, 0], [1, 1, 2, 5])
    laws = [_two_token_distribution(target, p, 1.0) for p in prompts]
    for prompt, law in zip(prompts, laws):
        assert chi_square_power(law.flatten(), _two_token_distribution(draft, prompt, 1.0).flatten(), n) > 0.99
    batch = torch.tensor([prompts[k % 2] for k in range(2 * n)])
    for kw in (dict(num_draft_tokens=2), dict(draft_tree="dynamic", num_draft_tokens=4, tree_width=2)):
        out = speculative_generate(
            target, draft, batch, max_new_tokens=2, seed=1, eos_token_id=[], temperature=1.0, **kw
        )  # fmt: skip
        pairs = out.sequences[:, len(prompts[0]) :]
        assert 0.05 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
        for k, law in enumerate(laws):
            mine = pairs[k::2]
            assert chi_square_pvalue(mine[:, 0] * V + mine[:, 1], law.flatten()) > ALPHA


def test_the_shape_models_count_an_int8_layers_bytes(kernel):
    """The timing-free cost estimates read the bytes a forward streams: an int8 layer's weight is a
    byte a weight plus an fp32 scale a row (its packed weight is not a parameter); the native
    kernel's panels pad rows to 16 and inputs to 4 and add an int32 row sum."""
    from specdec_kernels.hf.draft_length import _streamed, draft_cost_estimate

    model = tiny_model("llama", seed=3)
    quantized = _int8_copy(model)
    layers = [m for m in quantized.modules() if isinstance(m, Int8Linear)]
    (b_fp32, w_fp32), (b_int8, w_int8) = _streamed(model), _streamed(quantized)
    assert w_int8 == w_fp32
    linear_weights = sum(m.in_features * m.out_features for m in layers)
    if kernel == "native":
        padded = sum(-(-m.in_features // 4) * 4 * -(-m.out_features // 16) * 16 for m in layers)
        rows = sum(-(-m.out_features // 16) * 16 for m in layers)
        assert b_fp32 - b_int8 == 4 * linear_weights - padded - 8 * rows
    else:
        rows = sum(m.out_features for m in layers)
        assert b_fp32 - b_int8 == 3 * linear_weights - 4 * rows
    assert draft_cost_estimate(model, quantized) < draft_cost_estimate(model, model)
