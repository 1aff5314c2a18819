"""return_logprobs=True without top-n on chains, computed by the kernels themselves, no post-pass
over the rows: the CPU build (backend="cpu": the core writes them from its row statistics,
csrc/verify_core.h emitted_logprobs) and the Triton kernels (backend="triton": the finalize kernel
reads each emitted position's row record, ops/triton/chain.py ``_emitted_logprobs``). Equal, within
1e-5, to the post-pass (ops/logprobs.py) on the same output and to the reference
(reference/logprobs.py), in every setting; the post-pass is made to raise to show it no longer runs.
(Trees and verify_multi on the CPU build: test_native_logprobs.py.)"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._bitmask import pack
from specdec_kernels._validation import check_verify_call
from specdec_kernels.ops import logprobs as post_pass
from specdec_kernels.reference.logprobs import chain_rows, logprobs_reference

from ._inputs import flattened_problem, make_problem
from .conftest import cpu_core_or_skip

TOL = 1e-5  # absolute, float32: the bound between the native values and the post-pass
# The Triton kernels run in the interpreter here: vocabularies of at most this many entries.
INTERPRETED_V = 300


@pytest.fixture(params=["cpu", "triton"])
def backend(request):
    """The backends with native chain logprobs."""
    if request.param == "cpu":
        cpu_core_or_skip()
    return request.param


def _vocab(backend: str, V: int) -> int:
    """V, or a small odd one for the interpreted Triton kernels."""
    return V if backend == "cpu" or V <= INTERPRETED_V else 131


def _native_and_expected(monkeypatch, target, drafts, draft, *, backend, probs=False, mask=None, **kw):
    """(native output, the post-pass's logprobs on it, the reference's) for one call."""
    call = dict(kw, seed=kw.get("seed", 5), backend=backend, token_bitmask=mask)
    if probs:
        call["draft_probs"] = draft
        draft = None
    out = sk.verify(target, drafts, draft, return_logprobs=True, **call)
    monkeypatch.undo()  # the post-pass back, for the expected values
    args = check_verify_call(
        target, drafts, draft, call.get("draft_probs"), kw.get("temperature", 1.0), kw.get("top_k", 0),
        kw.get("top_p", 1.0), kw.get("num_draft_tokens"), 0, cu_num_draft_tokens=kw.get("cu_num_draft_tokens"),
        max_num_draft_tokens=kw.get("max_num_draft_tokens"), top_p_ties=kw.get("top_p_ties", "keep"),
        token_bitmask=mask,
    )  # fmt: skip
    after = post_pass.chain_logprobs(args, replace(out, logprobs=None), 0).logprobs
    allowed = allowed_of(mask, args.target_logits.shape)
    ref = logprobs_reference(args, args.target_logits, out.tokens, chain_rows(args, out.tokens), 0, allowed)
    return out, after, ref["logprobs"]


def allowed_of(mask, shape):
    """The reference's allowed mask (bool, ``shape``: the target's) of token_bitmask words: bit x of
    each row's words; None without a mask."""
    if mask is None:
        return None
    bits = (mask[..., :, None] >> torch.arange(32)) & 1
    return bits.flatten(-2)[..., : shape[-1]].bool().reshape(shape)


def _check(out, after, ref):
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == out.tokens.shape
    assert torch.equal(torch.isnan(out.logprobs), torch.isnan(after))
    torch.testing.assert_close(out.logprobs, after, atol=TOL, rtol=0, equal_nan=True)
    torch.testing.assert_close(out.logprobs, ref, atol=TOL, rtol=0, equal_nan=True)


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.3, top_k=7, top_p=0.8),
    dict(temperature=0.0),  # greedy: scored at temperature 1 (log_softmax of the raw row)
    dict(temperature=0.0, top_k=4, top_p=0.9),  # greedy with filters: at temperature 1 with them
    dict(temperature=torch.tensor([0.0, 0.9, 0.5, 0.0]), top_k=torch.tensor([0, 3, 10, 2]), top_p=0.85),
    dict(temperature=torch.tensor([0.6, 0.0, 1.1, 2.0]), top_p=torch.tensor([1.0, 0.5, 0.9, 0.3])),
]


@pytest.mark.parametrize("V", [37, 1005])
@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
@pytest.mark.parametrize("setting", SETTINGS, ids=range(len(SETTINGS)))
def test_native_equals_post_pass(no_post_pass, backend, setting, mode, V):
    if backend == "triton" and V > INTERPRETED_V:
        pytest.skip("the interpreted Triton kernels: V = 37 here, split vocabularies in test_vocab_chunks_and_dtypes")
    target, drafts, draft = make_problem(4, 4, V, seed=V + len(mode), closeness=0.3)
    if mode == "probs":
        draft = torch.softmax(draft, -1)
    kw = dict(setting, num_draft_tokens=torch.tensor([4, 0, 2, 3]), backend=backend)
    out, after, ref = _native_and_expected(
        no_post_pass, target, drafts, None if mode == "none" else draft, probs=mode == "probs", **kw
    )
    _check(out, after, ref)


@pytest.mark.parametrize("num_chunks", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_chunks_and_dtypes(no_post_pass, backend, num_chunks, dtype):
    """Rows split into vocabulary chunks (their (m, z) merged; Triton: blocks of 32) and 16-bit logits."""
    target, drafts, draft = make_problem(3, 3, _vocab(backend, 1005), seed=2, dtype=dtype)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 0.6]), top_k=50, top_p=0.95, backend=backend)
    with _dispatch.launch_overrides(num_chunks=num_chunks, block_v=32 if backend == "triton" else None):
        out, after, ref = _native_and_expected(no_post_pass, target, drafts, draft, **kw)
    _check(out, after, ref)


@pytest.mark.parametrize("temperature", [torch.tensor([1.0, 0.0, 0.6]), 0.0, 0.8], ids=["mixed", "greedy", "sampled"])
@pytest.mark.parametrize("ties", ["keep", "by_index"])
def test_top_p_tie_rules(no_post_pass, backend, ties, temperature):
    """Integer logits: tie groups straddle the top-p boundary (greedy rows apply top-p at T = 1 with
    the call's tie rule, also when the tokens themselves need no threshold)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(-2, 3, (3, 3, 40), generator=gen).float()
    drafts = torch.randint(0, 40, (3, 2), generator=gen)
    kw = dict(temperature=temperature, top_p=0.5, top_p_ties=ties, backend=backend)
    out, after, ref = _native_and_expected(no_post_pass, target, drafts, None, **kw)
    _check(out, after, ref)
    assert bool((out.logprobs == float("-inf")).any() | ~torch.isinf(out.logprobs).any())


@pytest.mark.parametrize("masked", [False, True])
def test_flattened_layout(no_post_pass, backend, masked):
    cu, rows, ids, draft = flattened_problem(37, seed=8)
    mask = pack(torch.rand(rows.shape, generator=torch.Generator().manual_seed(2)) < 0.6) if masked else None
    kw = dict(temperature=torch.tensor([0.7, 0.0, 1.0]), top_k=9, top_p=0.9, backend=backend, mask=mask)
    out, after, ref = _native_and_expected(
        no_post_pass, rows, ids, draft, cu_num_draft_tokens=cu, max_num_draft_tokens=4, **kw
    )
    assert out.tokens.shape == (3, 5)
    _check(out, after, ref)


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_token_bitmask(no_post_pass, backend, temperature):
    """Disallowed tokens read -inf before processing; a draft outside the mask is -inf-scored only
    if emitted (never: it is rejected), and a row with nothing allowed is NaN."""
    target, drafts, draft = make_problem(3, 3, 70, seed=13)
    allowed = torch.rand(target.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    allowed[2, 0] = False  # request 2's first row allows nothing: NaN there
    kw = dict(mask=pack(allowed), temperature=temperature, top_k=20, backend=backend)
    out, after, ref = _native_and_expected(no_post_pass, target, drafts, draft, **kw)
    _check(out, after, ref)
    assert torch.isnan(out.logprobs[2, 0])


def test_nonfinite_rows(no_post_pass, backend):
    """A row without a finite logit is NaN; NaN / +inf entries of a row read as -inf."""
    target, drafts, draft = make_problem(3, 2, 37, seed=11)
    target[0, 0] = float("nan")
    target[1, :, :5] = float("inf")
    target[2, :, 3] = float("nan")
    kw = dict(temperature=0.9, top_p=0.9, backend=backend)
    out, after, ref = _native_and_expected(no_post_pass, target, drafts, draft, **kw)
    assert bool(out.nonfinite.all()) and torch.isnan(out.logprobs[0]).all()
    _check(out, after, ref)


def test_zero_sizes(no_post_pass, backend):
    call = dict(backend=backend, return_logprobs=True)
    out = sk.verify(torch.randn(0, 3, 37), torch.zeros(0, 2, dtype=torch.int64), **call)
    assert out.logprobs.shape == (0, 3) and out.logprobs.dtype == torch.float32
    target = torch.randn(2, 1, 37)
    out = sk.verify(target, torch.zeros(2, 0, dtype=torch.int64), seed=1, **call)
    want = torch.log_softmax(target[:, 0].double(), -1).gather(1, out.tokens)[:, 0].float()
    torch.testing.assert_close(out.logprobs[:, 0], want, atol=TOL, rtol=0)
    out = sk.verify(torch.randn(2, 3, 1), torch.zeros(2, 2, dtype=torch.int64), **call)
    assert torch.equal(out.logprobs, torch.zeros(2, 3)) and torch.equal(out.tokens, torch.zeros(2, 3).long())


def test_top_n_and_plain_calls_unchanged(backend):
    """num_logprobs > 0 stays on the post-pass; a call without logprobs gets none; the tokens of a
    logprobs call are those of a plain call (greedy rows' extra statistics change nothing)."""
    target, drafts, draft = make_problem(3, 3, _vocab(backend, 1005), seed=6)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.2]), top_k=6, top_p=0.9, seed=5, backend=backend)
    plain = sk.verify(target, drafts, draft, **kw)
    native = sk.verify(target, drafts, draft, return_logprobs=True, **kw)
    top = sk.verify(target, drafts, draft, return_logprobs=True, num_logprobs=2, **kw)
    assert plain.logprobs is None and native.top_logprobs is None and top.top_logprobs is not None
    assert torch.equal(plain.tokens, native.tokens) and torch.equal(plain.tokens, top.tokens)
    assert torch.equal(plain.num_accepted, native.num_accepted) and torch.equal(plain.nonfinite, native.nonfinite)
    torch.testing.assert_close(native.logprobs, top.logprobs, atol=TOL, rtol=0, equal_nan=True)
