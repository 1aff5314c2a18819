"""Property-based tests of sk.verify (hypothesis): random valid inputs - random batch, draft length,
odd vocabularies, modes, ragged drafts, filters and non-contiguous views of every tensor - must give

* token ids in [0, V), then -1 padding after the emitted token, and num_accepted <= n_b;
* the same tokens for the same seed (replay), and the same tokens in every backend (CPU build ==
  reference == vectorized PyTorch; Triton on fewer examples: the interpreter is slow);
* tokens of the other requests unchanged when one request's logits turn NaN.
"""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import specdec_kernels as sk
from specdec_kernels.ops import csrc

MODES = ["greedy", "ngram", "logits", "probs"]


def _strided(t: torch.Tensor, how: int) -> torch.Tensor:
    """`t`'s values as a non-contiguous view: 0 as is, 1 a slice of a wider tensor, 2 a transpose of
    a transposed copy, 3 every other element of a doubled last dimension."""
    if how == 1:
        wide = torch.zeros(*t.shape[:-1], t.shape[-1] + 3, dtype=t.dtype)
        wide[..., 1 : 1 + t.shape[-1]] = t
        return wide[..., 1 : 1 + t.shape[-1]]
    if how == 2 and t.dim() >= 2:
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if how == 3:
        doubled = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        doubled[..., ::2] = t
        return doubled[..., ::2]
    return t


@st.composite
def problems(draw):
    B = draw(st.integers(0, 4))
    G = draw(st.integers(1, 4))
    V = draw(st.sampled_from([2, 7, 111, 300]))
    mode = draw(st.sampled_from(MODES))
    seed = draw(st.integers(0, 2**40))
    gen = torch.Generator().manual_seed(seed)
    scale = draw(st.sampled_from([0.5, 3.0]))
    target = torch.randn(B, G + 1, V, generator=gen) * scale
    tokens = torch.randint(0, V, (B, G), generator=gen)
    kw = {}
    if mode == "logits":
        kw["draft_logits"] = torch.randn(B, G, V, generator=gen) * scale
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(torch.randn(B, G, V, generator=gen) * scale, -1)
    kw["temperature"] = 0.0 if mode == "greedy" else draw(st.sampled_from([0.3, 1.0, 2.0]))
    if mode != "greedy" and draw(st.booleans()):
        kw["top_k"] = draw(st.integers(0, V + 2))
        kw["top_p"] = draw(st.sampled_from([1.0, 0.9, 0.3]))
    if draw(st.booleans()):
        kw["num_draft_tokens"] = torch.randint(0, G + 1, (B,), generator=gen)
    kw["seed"] = torch.randint(0, 2**40, (B,), generator=gen)
    how = draw(st.integers(0, 3))
    tensors = {"target_logits": _strided(target, how), "draft_tokens": _strided(tokens, draw(st.integers(0, 3)))}
    for name in ("draft_logits", "draft_probs", "num_draft_tokens", "seed"):
        if name in kw:
            kw[name] = _strided(kw[name], how)
    return B, G, V, tensors, kw


def _check_invariants(out, B, G, V, kw):
    n = kw.get("num_draft_tokens", torch.full((B,), G))
    assert out.tokens.shape == (B, G + 1)
    assert bool((out.num_accepted >= 0).all()) and bool((out.num_accepted <= n).all())
    for b in range(B):
        a = int(out.num_accepted[b])
        row = out.tokens[b]
        assert bool(((row[: a + 1] >= 0) & (row[: a + 1] < V)).all()), row
        assert bool((row[a + 1 :] == -1).all()), row


def _same(x, y):
    assert torch.equal(x.tokens, y.tokens) and torch.equal(x.num_accepted, y.num_accepted)
    assert torch.equal(x.nonfinite, y.nonfinite)


def _cpu_or_skip():
    if not csrc.cpu_backend_ready():
        pytest.skip("the CPU build is not available")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_invariants_replay_and_backends_agree(problem):
    _cpu_or_skip()
    B, G, V, tensors, kw = problem
    out = sk.verify(**tensors, **kw, backend="cpu")
    _check_invariants(out, B, G, V, kw)
    _same(out, sk.verify(**tensors, **kw, backend="cpu"))  # same seed, same tokens
    _same(out, sk.verify(**tensors, **kw, backend="torch"))  # the specification
    contiguous = {k: v.contiguous() for k, v in tensors.items()}
    _same(out, sk.verify(**contiguous, **{k: (v.contiguous() if torch.is_tensor(v) else v) for k, v in kw.items()}))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_vectorized_agrees_with_the_reference(problem):
    B, G, V, tensors, kw = problem
    out = sk.verify(**tensors, **kw, backend="vectorized")
    _check_invariants(out, B, G, V, kw)
    _same(out, sk.verify(**tensors, **kw, backend="torch"))


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_triton_agrees(problem):
    _cpu_or_skip()
    _B, _G, _V, tensors, kw = problem
    _same(sk.verify(**tensors, **kw, backend="triton"), sk.verify(**tensors, **kw, backend="cpu"))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_a_nan_request_never_changes_the_others(problem):
    _cpu_or_skip()
    B, G, V, tensors, kw = problem
    if B < 2:
        return
    before = sk.verify(**tensors, **kw, backend="cpu")
    poisoned = dict(tensors, target_logits=tensors["target_logits"].clone())
    poisoned["target_logits"][0] = float("nan")
    after = sk.verify(**poisoned, **kw, backend="cpu")
    assert bool(after.nonfinite[0])
    assert torch.equal(after.tokens[1:], before.tokens[1:]) and torch.equal(after.nonfinite[1:], before.nonfinite[1:])


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_invariants_many_examples(problem):
    _cpu_or_skip()
    B, G, V, tensors, kw = problem
    out = sk.verify(**tensors, **kw, backend="cpu")
    _check_invariants(out, B, G, V, kw)
    _same(out, sk.verify(**tensors, **kw, backend="torch"))
    _same(out, sk.verify(**tensors, **kw, backend="vectorized"))
