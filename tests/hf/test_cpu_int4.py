"""specdec_kernels.hf.cpu_int4: int4 linear layers for CPU drafts (csrc/int4_linear.cpp). The layer
equals an exact float64 emulation of its arithmetic (both the AVX-512 VNNI path and the portable one);
an int4 draft keeps greedy identity and the sampled law."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")

from specdec_kernels.hf import cpu_int4, speculative_generate  # noqa: E402
from specdec_kernels.hf.cpu_int4 import (  # noqa: E402
    INT4_GROUP,
    Int4Linear,
    dequantize_int4,
    int4_linear_available,
    pack_int4,
    use_int4_linears,
)
from specdec_kernels.hf.draft_vocab import DraftVocab  # noqa: E402

from .._threads import under_threads  # noqa: E402
from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402
from .test_generate import PAD, _greedy_reference, _near_copy, _ragged_prompts, _two_token_distribution  # noqa: E402

pytestmark = pytest.mark.skipif(not int4_linear_available(), reason="the native CPU build does not load here")


def _emulated(layer: Int4Linear, x: torch.Tensor) -> torch.Tensor:
    """The layer's arithmetic: the input quantised per row and group of 32 as the kernel does it in
    fp32 (q = round-half-even(x * (127 / amax)), scale amax / 127), then exact products in float64 with
    the int4 weight (dequantize_int4), plus the bias."""
    groups = x.reshape(-1, layer.in_features).float().reshape(-1, layer.in_features // 32, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, 0.0)  # fp32, as the kernel
    q = torch.round(groups * inv).clamp(-127, 127).double() * (amax / 127).double()
    y = q.reshape(-1, layer.in_features) @ layer.weight.double().T
    if layer.bias is not None:
        y = y + layer.bias.double()
    return y.reshape(*x.shape[:-1], layer.out_features)


@pytest.mark.parametrize("out_features, in_features", [(1, 128), (37, 256), (130, 640), (9, 32), (5, 96), (66, 320)])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
def test_layer_equals_its_emulation(simd_path, out_features, in_features, rows):
    """Every row count the kernel specialises (1-8 rows a pass, 4 or 2 output rows at a time and
    the remainder one by one), odd output widths, input widths with a short last block (1-3 groups
    of 32 past the last 128: read under a mask)."""
    torch.manual_seed(rows)
    layer = Int4Linear.from_linear(nn.Linear(in_features, out_features).requires_grad_(False))
    x = torch.randn(rows, in_features) * torch.logspace(-2, 2, in_features)  # groups of very different scales
    got = layer(x)
    want = _emulated(layer, x)
    torch.testing.assert_close(got.double(), want, atol=2e-6 * float(want.abs().max()), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_views_dtypes_and_empty_inputs(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(128, 19, bias=bias).to(dtype).requires_grad_(False)
    layer = Int4Linear.from_linear(linear)
    wide = torch.randn(3, 5, 256).to(dtype)
    for x in (wide[..., :128], wide[..., ::2], wide[0, :1, :128], 7 * wide[1, :2, :128] + 3, wide[:, :0, :128]):
        got = layer(x)
        assert got.shape == (*x.shape[:-1], 19) and got.dtype == dtype
        if x.numel() == 0:
            continue
        tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: the output's rounding
        torch.testing.assert_close(got.double(), _emulated(layer, x), atol=tol * float(got.abs().max()), rtol=tol)
        original = linear(x).double()
        assert float((got.double() - original).norm() / original.norm()) < 0.15  # int4's error, not a bug's


def test_the_two_paths_agree_and_rows_do_not_depend_on_each_other(monkeypatch):
    """Per-row activation scales: a row's output is the same alone or beside other rows."""
    torch.manual_seed(2)
    layer = Int4Linear.from_linear(nn.Linear(384, 70))
    x = torch.randn(6, 384)
    x[3] *= 1e3
    batch = layer(x)
    for r in range(6):
        torch.testing.assert_close(layer(x[r : r + 1])[0], batch[r], rtol=0, atol=0)
    monkeypatch.setenv("SPECDEC_CPU_SIMD", "0")
    torch.testing.assert_close(layer(x), batch, rtol=1e-5, atol=1e-5 * float(batch.abs().max()))


def test_packing_layout_and_round_trip():
    """Group w of a row: element i in the low nibble of byte 16 w + i, element 16 + i in its high
    nibble, as q + 8; the weight reads back within half a step of its group."""
    w = torch.zeros(2, 128)
    w[0, :32] = torch.arange(-16, 16) / 2.0  # group 0 of row 0: max |w| = 8, s = 8 / 7
    w[1, 32:64] = 1.0  # group 1 of row 1: all 7
    wq, ws = pack_int4(w)
    assert wq.shape == (2, 64) and wq.dtype == torch.uint8 and ws.shape == (2, 4) and ws.dtype == torch.float16
    s = float(torch.tensor(8 / 7).half())  # the scale as stored
    q = torch.round(w[0, :32] / s).clamp(-8, 7).to(torch.int64) + 8
    assert wq[0, :16].tolist() == (q[:16] | (q[16:] << 4)).tolist()
    assert wq[1, 16:32].tolist() == [0xFF] * 16 and wq[1, :16].tolist() == [0x88] * 16  # 7 + 8 = 15; 0 + 8
    torch.manual_seed(3)
    w = torch.randn(5, 256)
    back = dequantize_int4(*pack_int4(w))
    step = w.reshape(5, -1, 32).abs().amax(-1, keepdim=True) / 7
    assert float(((back - w).reshape(5, -1, 32) / step).abs().max()) <= 0.5 + 2e-3  # fp16 scales round


def test_non_finite_inputs_give_nan_rows_not_a_crash():
    layer = Int4Linear.from_linear(nn.Linear(128, 8))
    x = torch.randn(3, 128)
    x[1, 5] = float("nan")
    x[2, 100] = float("inf")
    y = layer(x)
    assert bool(torch.isfinite(y[0]).all()) and bool(y[1:].isnan().all())


def test_bad_layers_and_inputs_are_clear_errors(monkeypatch):
    layer = Int4Linear.from_linear(nn.Linear(128, 4))
    with pytest.raises(ValueError, match="expected 128"):
        layer(torch.randn(2, 129))
    with pytest.raises(ValueError, match="fp32/bf16"):
        Int4Linear.from_linear(nn.Linear(128, 4).half())
    with pytest.raises(ValueError, match=f"multiple of {INT4_GROUP}"):
        Int4Linear.from_linear(nn.Linear(80, 4))
    bad = nn.Linear(128, 4)
    bad.weight.data[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        Int4Linear.from_linear(bad)
    with pytest.raises(ValueError, match="keep"):
        use_int4_linears(nn.Sequential(nn.Linear(128, 4)), keep="down_proj")
    monkeypatch.setenv("SPECDEC_CPU_SIMD", "0")  # as on a CPU without AVX-512 VNNI: works, and says it is slow
    with pytest.warns(RuntimeWarning, match="no SIMD path"):
        assert use_int4_linears(nn.Sequential(nn.Linear(128, 4))) == 1
    monkeypatch.setattr(cpu_int4, "int4_linear_available", lambda: False)
    with pytest.raises(ValueError, match="native CPU build"):
        use_int4_linears(nn.Sequential(nn.Linear(128, 4)))


def _model(**kw):
    return tiny_model("llama", hidden=128, **kw)  # intermediate 256: every linear takes int4


def _int4_copy(model, keep=()):
    quantized = copy.deepcopy(model)
    use_int4_linears(quantized, keep=keep)
    return quantized


def test_use_int4_linears_swaps_every_wide_enough_linear_but_the_kept_names():
    model = _model(seed=4)
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept = [n for n in linears if "down_proj" in n]
    quantized = copy.deepcopy(model)
    assert use_int4_linears(quantized, keep=("down_proj",)) == len(linears) - len(kept)
    swapped = {n for n, m in quantized.named_modules() if isinstance(m, Int4Linear)}
    assert swapped == set(linears) - set(kept)
    narrow = nn.Sequential(nn.Linear(96, 4), nn.Linear(4, 160), nn.Linear(160, 3))
    assert use_int4_linears(narrow) == 2 and isinstance(narrow[1], nn.Linear)  # an input of 4: left


@pytest.mark.parametrize(
    "kw",
    [dict(num_draft_tokens=4), dict(draft_tree="dynamic", num_draft_tokens=8, tree_width=3, method="rrs_wor")],
    ids=["chain", "tree"],
)
def test_greedy_with_an_int4_draft_equals_generate(kw):
    target = _model(seed=1)
    draft = _int4_copy(_near_copy(target, 0.05, seed=5))  # 128 wide: 0.3 of noise leaves no agreement
    ids, mask = _ragged_prompts()
    out = speculative_generate(
        target, draft, ids, mask, max_new_tokens=12, temperature=0.0, eos_token_id=[], pad_token_id=PAD, **kw
    )
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    assert out.stats.acceptance_rate > 0.2  # the int4 draft still proposes the target's tokens


def test_an_int4_output_layer_can_be_restricted_to_a_draft_vocab():
    draft = _int4_copy(_model(seed=2))
    out = draft.get_output_embeddings()
    assert isinstance(out, Int4Linear)
    kept = [0, 1, 4, 9, 30, 64, 96]
    head = DraftVocab(kept).head_for(draft)
    assert isinstance(head.kept, Int4Linear)
    x = torch.randn(2, 3, out.in_features)
    torch.testing.assert_close(head(x)[..., kept], out(x)[..., kept], rtol=0, atol=0)  # the same int4 rows
    with pytest.raises(ValueError, match="97 >= the draft's output rows"):
        DraftVocab([0, 97]).head_for(draft)


def test_sampled_output_follows_the_target_with_an_int4_draft():
    """Chi-square (alpha 1e-6) on the first two tokens (V = 6: 36 cells) of 1500 requests at T = 1,
    chain and dynamic tree, with an int4 draft. Power, asserted below: > 0.99 against the draft's own
    law (a verifier that accepts every draft)."""
    V, n = 6, 1500
    target = _model(vocab=V, seed=13, init_std=0.1)
    draft = _int4_copy(_model(vocab=V, seed=14, init_std=0.1, layers=1))
    prompt = [3, 4, 5, 0]
    law = _two_token_distribution(target, prompt, 1.0)
    assert chi_square_power(law.flatten(), _two_token_distribution(draft, prompt, 1.0).flatten(), n) > 0.99
    batch = torch.tensor([prompt] * n)
    for kw in (dict(num_draft_tokens=2), dict(draft_tree="dynamic", num_draft_tokens=4, tree_width=2)):
        out = speculative_generate(
            target, draft, batch, max_new_tokens=2, seed=1, eos_token_id=[], temperature=1.0, **kw
        )
        pairs = out.sequences[:, len(prompt) :]
        assert 0.05 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
        assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], law.flatten()) > ALPHA


def test_the_shape_models_count_an_int4_layers_bytes():
    """An int4 layer streams half a byte a weight plus an fp16 scale per 32 (its buffers are not parameters)."""
    from specdec_kernels.hf.draft_length import _streamed, draft_cost_estimate

    model = _model(seed=3)
    quantized = _int4_copy(model)
    layers = [m for m in quantized.modules() if isinstance(m, Int4Linear)]
    (b_fp32, w_fp32), (b_int4, w_int4) = _streamed(model), _streamed(quantized)
    assert w_int4 == w_fp32
    linear_weights = sum(m.in_features * m.out_features for m in layers)
    assert b_fp32 - b_int4 == 4 * linear_weights - linear_weights // 2 - 2 * (linear_weights // 32)
    assert draft_cost_estimate(model, quantized) < draft_cost_estimate(model, model)


def test_threads_split_the_output_rows_without_changing_them():
    """at::parallel_for splits the output rows into tiles: each output is computed by one thread in
    the same order, so 2 threads give the same bits as 1."""
    torch.manual_seed(5)
    layer = Int4Linear.from_linear(nn.Linear(320, 203))
    x = torch.randn(3, 320)
    one, two = under_threads(lambda: layer(x), 1, 2)
    assert torch.equal(one, two)
