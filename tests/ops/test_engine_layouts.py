"""The layouts and inputs engines already hold (issue: engine-ready).

* the flattened ragged layout (``cu_num_draft_tokens``): identical to the padded call, every mode
  and backend, read in place by the Triton kernels;
* ``target_probs`` (FlashInfer's callers) and ``logits_scaled`` (vLLM's temperature-divided logits):
  identical to the equivalent raw-logit call.
"""

import pytest
import torch

import specdec_kernels as sk

BACKENDS = ["torch", "cpu", "vectorized", "triton"]
MODES = ["logits", "probs", "none"]


def _ragged(B=4, G=4, V=111, counts=(4, 0, 2, 3), seed=0):
    """A padded batch and the same batch flattened the way engines hold it."""
    g = torch.Generator().manual_seed(seed)
    n = torch.tensor(counts[:B])
    target = torch.randn(B, G + 1, V, generator=g) * 2
    draft = target[:, :G] + torch.randn(B, G, V, generator=g)  # a draft close enough to accept some
    tokens = torch.distributions.Categorical(logits=draft).sample()
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    flat = {
        "target": torch.cat([target[b, : n[b] + 1] for b in range(B)]),
        "draft": torch.cat([draft[b, : n[b]] for b in range(B)]),
        "tokens": torch.cat([tokens[b, : n[b]] for b in range(B)]),
    }
    return target, draft, tokens, n, cu, flat


def _draft_kwargs(mode, draft):
    if mode == "logits":
        return {"draft_logits": draft}
    if mode == "probs":
        return {"draft_probs": torch.softmax(draft, -1)}
    return {}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (0.8, 0, 1.0), (1.0, 20, 0.9)])
def test_flattened_equals_padded(backend, mode, temperature, top_k, top_p):
    target, draft, tokens, n, cu, flat = _ragged()
    common = dict(temperature=temperature, top_k=top_k, top_p=top_p, backend=backend)
    for seed in (1, 2, 3):
        padded = sk.verify(target, tokens, num_draft_tokens=n, seed=seed, **_draft_kwargs(mode, draft), **common)
        flattened = sk.verify(
            flat["target"],
            flat["tokens"],
            cu_num_draft_tokens=cu,
            seed=seed,
            **_draft_kwargs(mode, flat["draft"]),
            **common,
        )
        assert torch.equal(padded.tokens, flattened.tokens)
        assert torch.equal(padded.num_accepted, flattened.num_accepted)
        assert torch.equal(padded.nonfinite, flattened.nonfinite)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flattened_strided_rows_and_int32_offsets(backend):
    """Rows that are a strided view (a slice of wider logits), int32 offsets, a given G, int32 out."""
    target, draft, tokens, n, cu, flat = _ragged(counts=(1, 3, 0, 2))
    wide = torch.randn(flat["target"].shape[0], 150)
    wide[:, 7 : 7 + 111] = flat["target"]
    rows = wide[:, 7 : 7 + 111]
    assert not rows.is_contiguous()
    out = sk.verify(
        rows,
        flat["tokens"].to(torch.int32),
        flat["draft"],
        cu_num_draft_tokens=cu.to(torch.int32),
        max_num_draft_tokens=4,
        temperature=0.9,
        seed=7,
        backend=backend,
        out_dtype=torch.int32,
    )
    ref = sk.verify(target, tokens, draft, num_draft_tokens=n, temperature=0.9, seed=7, backend="torch")
    assert out.tokens.dtype == torch.int32 and out.tokens.shape == (4, 5)
    assert torch.equal(out.tokens.long(), ref.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flattened_without_any_draft(backend):
    """N = 0: every request only samples its bonus row (G = 0 unless max_num_draft_tokens says more)."""
    B, V = 3, 50
    target = torch.randn(B, V)
    cu = torch.zeros(B + 1, dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.int64)
    out = sk.verify(target, empty, cu_num_draft_tokens=cu, temperature=0.0, backend=backend)
    assert out.tokens.tolist() == target.argmax(-1)[:, None].tolist()
    wide = sk.verify(target, empty, cu_num_draft_tokens=cu, max_num_draft_tokens=2, temperature=0.0, backend=backend)
    assert wide.tokens[:, 0].tolist() == target.argmax(-1).tolist() and bool((wide.tokens[:, 1:] == -1).all())


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda kw: kw.update(cu_num_draft_tokens=torch.tensor([1, 2, 4, 6, 9])), "start at 0"),
        (lambda kw: kw.update(cu_num_draft_tokens=torch.tensor([0, 4, 3, 6, 9])), "never decrease"),
        (lambda kw: kw.update(target_logits=kw["target_logits"][:-1]), "N \\+ B"),
        (lambda kw: kw.update(max_num_draft_tokens=2), "max_num_draft_tokens = 2"),
        (lambda kw: kw.update(num_draft_tokens=torch.tensor([1, 1, 1, 1])), "not both"),
        (lambda kw: kw.update(draft_logits=torch.randn(8, 111)), "draft_logits must have shape"),
        (lambda kw: kw.update(draft_tokens=torch.full((9,), 111)), "draft_tokens must be in"),
    ],
)
def test_flattened_bad_input(change, message):
    _, _, _, _, cu, flat = _ragged()
    kw = dict(target_logits=flat["target"], draft_tokens=flat["tokens"], cu_num_draft_tokens=cu)
    change(kw)
    with pytest.raises(ValueError, match=message):
        sk.verify(**kw, backend="torch")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_target_probs_equal_the_logit_call(backend, mode):
    target, draft, tokens, n, _, _ = _ragged()
    probs = torch.softmax(target, -1)
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 10, 0.8)]:
        common = dict(temperature=temperature, top_k=top_k, top_p=top_p, num_draft_tokens=n, seed=11)
        kw = dict(common, backend=backend, **_draft_kwargs(mode, draft))
        ref = sk.verify(torch.log_softmax(target, -1), tokens, **kw)
        out = sk.verify(None, tokens, target_probs=probs, **kw)
        assert torch.equal(out.tokens, ref.tokens), (temperature, top_k, top_p)


def test_target_probs_bad_entries_flag_the_request():
    target, draft, tokens, n, _, _ = _ragged()
    probs = torch.softmax(target, -1)
    probs[1, 0, 3] = float("nan")
    probs[2, :, 5] = -0.1
    out = sk.verify(None, tokens, draft, target_probs=probs, temperature=1.0, seed=3, backend="torch")
    assert out.nonfinite.tolist() == [False, True, True, False]
    with pytest.raises(ValueError, match="not both"):
        sk.verify(target, tokens, target_probs=probs)
    with pytest.raises(TypeError, match="target_logits or target_probs"):
        sk.verify(None, tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_scaled_equal_raw_logits_with_temperature(backend):
    target, draft, tokens, n, _, _ = _ragged()
    T = torch.tensor([0.7, 0.0, 1.3, 0.5])
    scale = torch.where(T > 0, T, torch.ones_like(T))[:, None, None]
    common = dict(num_draft_tokens=n, seed=5, top_k=30, top_p=0.9, backend=backend)
    raw = sk.verify(target, tokens, draft, temperature=T, **common)
    scaled = sk.verify(target / scale, tokens, draft / scale, temperature=T, logits_scaled=True, **common)
    assert torch.equal(raw.tokens, scaled.tokens)
    with pytest.raises(ValueError, match="temperature"):
        sk.verify(target, tokens, temperature=float("nan"), logits_scaled=True)
