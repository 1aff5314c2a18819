"""method="block" in the Triton chain kernels (backend="triton", ``ops/triton/block.py``).

Block verification (``reference/block.py``) in the accept kernel's two block launches (residual
masses of the candidate rows, then tau and the race of row tau), token for token against the CPU
build (backend="cpu") and the vectorized backend under the same seeds: every draft mode, odd
vocabularies, ragged drafts, the flattened layout, grammar masks, top-k / top-p (both tie rules),
strided views, vocabulary chunks (the masses summed over chunks), zero sizes, greedy rows, native
return_logprobs; then the paper's known answer (11/9 accepted drafts per step against the token
rule's 10/9). Here the kernels run in Triton's interpreter (small vocabularies and batches).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch

from . import _block_cases as cases
from ._inputs import make_problem, pack_bitmask
from ._stats import INTERPRETER_EQUALITY_SAMPLES, triton_interpreted
from .conftest import cpu_core_or_skip
from .test_block_verify import _paper_rows, check_joint_law
from .test_cpu_native_mask import _allowed, _draft_kw, _same


def _three_ways(target, tokens, draft_kw: dict, num_chunks=None, reference=False, **kw):
    """backend="triton", asserted equal to the CPU build and the vectorized backend (and, when
    asked, the reference)."""
    kw = dict(method="block", **kw)
    with _dispatch.launch_overrides(num_chunks=num_chunks):
        tri = sk.verify(target, tokens, backend="triton", **draft_kw, **kw)
    cpu_core_or_skip()
    _same(tri, sk.verify(target, tokens, backend="cpu", **draft_kw, **kw), "triton vs cpu")
    _same(tri, sk.verify(target, tokens, backend="vectorized", **draft_kw, **kw), "triton vs vectorized")
    if reference:
        _same(tri, sk.verify(target, tokens, backend="torch", **draft_kw, **kw), "triton vs reference")
    return tri


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("V", [1, 1000])
def test_triton_block_matches_the_cpu_build_and_vectorized(mode, V):
    B, G = 20, 4
    target, tokens, draft = make_problem(B, G, V, seed=V, closeness=0.1, scale=3.0)
    gen = torch.Generator().manual_seed(V + 1)
    n = torch.randint(0, G + 1, (B,), generator=gen)
    if mode == "ngram":  # one-hot drafts: the target's argmax at most positions (accepted w.p. p(x))
        tokens = torch.where(torch.rand(B, G, generator=gen) < 0.8, target[:, :G].argmax(-1), tokens)
    tri = _three_ways(target, tokens, _draft_kw(mode, draft), num_draft_tokens=n, **cases.mixed_sampling(B, gen))
    if V > 1:  # the inputs reach the interesting cases: 0 < tau < n and tau = n
        assert bool((tri.num_accepted > 0).any()) and bool((tri.num_accepted.long() < n).any())


def test_triton_block_odd_vocabulary_bf16_and_the_reference():
    B, G, V = 6, 3, 4097
    target, tokens, draft = make_problem(B, G, V, seed=7, closeness=0.1, scale=1.0, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(8)
    _three_ways(target, tokens, dict(draft_logits=draft), reference=True, **cases.mixed_sampling(B, gen))


@pytest.mark.parametrize("num_chunks", [2, 3])
def test_triton_block_vocabulary_chunks(num_chunks):
    """Residual masses and the race of row tau split over chunks (each chunk sums its part of r_i;
    every chunk program of the race launch sums them all into the same tau)."""
    B, G, V = 12, 4, 300
    target, tokens, draft = make_problem(B, G, V, seed=9, closeness=0.1, scale=1.0)
    gen = torch.Generator().manual_seed(10)
    kw = dict(temperature=0.8, seed=torch.randint(0, 2**62, (B,), generator=gen))
    tri = _three_ways(target, tokens, dict(draft_logits=draft), num_chunks=num_chunks, **kw)
    assert bool(((tri.num_accepted > 0) & (tri.num_accepted < G)).any())


def test_triton_block_top_p_ties_both_rules():
    cases.top_p_ties_case(_three_ways)


def test_triton_block_flattened_layout():
    """Read in place: equal to the CPU build on the same call and to the padded call."""
    cpu_core_or_skip()
    cases.flattened_case("triton", ("cpu",))


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
def test_triton_block_native_token_bitmask(mode):
    """Read by the kernels (no masked copy), equal to the CPU build's native words."""
    cases.token_bitmask_case(_three_ways, mode)


def test_triton_block_nonfinite_logits_and_placeholders():
    cases.nonfinite_case(_three_ways)


def test_triton_block_strided_views():
    cases.strided_views_case(_three_ways, "triton")


def test_triton_block_zero_sizes():
    cases.zero_sizes_case(_three_ways)


def test_triton_block_greedy_is_the_token_rule():
    """Greedy requests (scalar T = 0, and greedy rows among sampled ones): the argmax chain."""
    B, G, V = 10, 4, 50
    target, tokens, draft = make_problem(B, G, V, seed=61, closeness=0.1, scale=1.0)
    tokens[:, :2] = target[:, :2].argmax(-1)  # accepted greedy prefixes
    for t in (0.0, torch.tensor([0.0, 0.9] * 5)):
        kw = dict(temperature=t, seed=3)
        block = sk.verify(target, tokens, draft, backend="triton", method="block", **kw)
        token = sk.verify(target, tokens, draft, backend="triton", **kw)
        greedy = torch.as_tensor(t).expand(B) == 0
        assert torch.equal(block.tokens[greedy], token.tokens[greedy])
        assert bool((block.num_accepted[greedy] >= 2).all())


@pytest.mark.parametrize("num_chunks", [None, 2])
def test_triton_block_native_logprobs_equal_the_post_pass(num_chunks, monkeypatch):
    """return_logprobs alone: written by the finalize kernel from the row records (the post-pass
    made to raise), equal to the post-pass on the vectorized backend's output (the same tokens)."""
    B, G, V = 10, 4, 300
    target, tokens, draft = make_problem(B, G, V, seed=61, closeness=0.1, scale=1.0)
    gen = torch.Generator().manual_seed(62)
    kw = dict(method="block", return_logprobs=True, **cases.mixed_sampling(B, gen))
    mask = pack_bitmask(_allowed((B, G + 1), V, gen, tokens))
    for extra in ({}, dict(token_bitmask=mask)):
        vec = sk.verify(target, tokens, draft, backend="vectorized", **kw, **extra)
        with monkeypatch.context() as m, _dispatch.launch_overrides(num_chunks=num_chunks):
            from specdec_kernels.ops import logprobs as post_pass

            m.setattr(post_pass, "_fill", lambda *a, **k: pytest.fail("the logprobs post-pass ran"))
            tri = sk.verify(target, tokens, draft, backend="triton", **kw, **extra)
        _same(tri, vec, "logprobs call")
        torch.testing.assert_close(tri.logprobs, vec.logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
        if not extra:  # (a mask row allowing nothing has no law: NaN there)
            assert bool(tri.logprobs[tri.tokens >= 0].isfinite().all())


def test_triton_block_auto_and_the_value_errors(monkeypatch):
    """backend="auto" where it means Triton (CUDA tensors; here conftest points auto at Triton on
    CPU tensors) runs the Triton block launches; an unknown method raises."""
    calls = []
    real = _dispatch.launch_verify

    def spy(args, *a, **k):
        calls.append(k.get("method"))
        return real(args, *a, **k)

    monkeypatch.setattr(_dispatch, "launch_verify", spy)
    target, drafts, draft = _paper_rows(4)
    out = sk.verify(target, drafts, draft, temperature=1.0, seed=1, method="block", backend="auto")
    assert calls == ["block"]
    _same(out, sk.verify(target, drafts, draft, temperature=1.0, seed=1, method="block", backend="triton"), "auto")
    with pytest.raises(ValueError, match="method must be one of"):
        sk.verify(target, drafts, draft, method="blocks", backend="triton")


def test_triton_block_accepts_eleven_ninths_token_ten_ninths():
    """The paper's example (V = {a, b}, target (1/3, 2/3), draft (2/3, 1/3), G = 2): block's mean
    accepted length within 4 standard errors of 11/9, the token rule's of 10/9, each more than 4
    standard errors from the other's, at 6,000 requests (about 2 s in the interpreter: se ~ 0.01,
    the two answers 0.11 apart; the CPU build runs 40,000, test_cpu_block.py)."""
    B = 6_000
    target, drafts, draft = _paper_rows(B)
    seeds = torch.arange(B, dtype=torch.int64) * 7 + 3
    for method, want, other in (("block", 11 / 9, 10 / 9), ("token", 10 / 9, 11 / 9)):
        out = sk.verify(target, drafts, draft, temperature=1.0, seed=seeds, method=method, backend="triton")
        a = out.num_accepted.double()
        se = float(a.std()) / B**0.5
        assert abs(float(a.mean()) - want) < 4 * se and abs(float(a.mean()) - other) > 4 * se, (method, a.mean())


def test_triton_block_joint_law_of_the_first_two_tokens():
    """Random context-free rows (V = 5, G = 3), 40,000 requests: the first two emitted tokens follow
    p x p (test_block_verify's chi-square; its power: the unweighted residual of row tau fails).
    On a GPU through backend="triton" itself; in the interpreter (40,000 requests would take about
    20 s) its stand-in (``_stats.interpreted_stand_in``'s pattern): the statistic on the CPU build,
    and the same call's first INTERPRETER_EQUALITY_SAMPLES requests token for token equal to it."""
    if not triton_interpreted("triton"):
        check_joint_law("triton", device="cuda")
        return
    cpu_core_or_skip()
    _pvalue, (target, drafts, draft), kw = check_joint_law("cpu")
    n = INTERPRETER_EQUALITY_SAMPLES
    call = dict(kw, seed=kw["seed"][:n])
    tri = sk.verify(target[:n], drafts[:n], draft[:n], backend="triton", **call)
    _same(tri, sk.verify(target[:n], drafts[:n], draft[:n], backend="cpu", **call), "triton vs cpu")
    assert bool((tri.num_accepted > 0).any()) and bool((tri.num_accepted < 3).any())
