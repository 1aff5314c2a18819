"""method="block" in the CPU build (backend="cpu", csrc/verify_cpu.cpp block_decide).

Block verification (``reference/block.py``) on the row statistics of the token rule's row pass,
token for token against the reference (backend="torch") and the vectorized backend: every draft
mode, odd vocabularies (1, 33, 257: the AVX2 loops' scalar tails), ragged drafts, the flattened
layout, grammar masks (random, one-token and all-false rows), top-k / top-p (both tie rules),
fp32 / bf16 / fp16 logits, strided views, vocabulary chunks, the scalar path (SPECDEC_CPU_SIMD=0),
zero sizes, native return_logprobs; then the paper's known answer (11/9 accepted drafts per step
against the token rule's 10/9) and a chi-square of the first two emitted tokens (about 1 s each).
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels.ops import csrc

from ._block_cases import (
    flattened_case,
    mixed_sampling,
    nonfinite_case,
    strided_views_case,
    token_bitmask_case,
    top_p_ties_case,
    zero_sizes_case,
)
from ._inputs import make_problem, pack_bitmask
from .conftest import cpu_core_or_skip
from .test_block_verify import check_joint_law
from .test_block_verify import test_block_accepts_eleven_ninths_token_ten_ninths as paper_known_answer
from .test_cpu_native_mask import _draft_kw, _same


@pytest.fixture(autouse=True)
def _core():
    cpu_core_or_skip()


@pytest.fixture(params=["1", "0"], ids=["simd", "scalar"])
def simd(request, monkeypatch):
    monkeypatch.setenv("SPECDEC_CPU_SIMD", request.param)  # read by the core per call
    return request.param


def _three_ways(target, tokens, draft_kw: dict, num_chunks=None, vectorized=True, **kw):
    """backend="cpu", asserted equal to the reference and (unless told not to) to vectorized."""
    kw = dict(method="block", **kw)
    with _dispatch.launch_overrides(num_chunks=num_chunks):
        cpu = sk.verify(target, tokens, backend="cpu", **draft_kw, **kw)
    _same(cpu, sk.verify(target, tokens, backend="torch", **draft_kw, **kw), "cpu vs reference")
    if vectorized:
        _same(cpu, sk.verify(target, tokens, backend="vectorized", **draft_kw, **kw), "cpu vs vectorized")
    return cpu


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("V", [1, 33, 257])
def test_block_matches_the_reference_and_vectorized(mode, V, simd):
    B, G = 40, 4
    target, tokens, draft = make_problem(B, G, V, seed=V, closeness=0.4)
    gen = torch.Generator().manual_seed(V + 1)
    n = torch.randint(0, G + 1, (B,), generator=gen)
    cpu = _three_ways(target, tokens, _draft_kw(mode, draft), num_draft_tokens=n, **mixed_sampling(B, gen))
    if V > 1:  # the inputs reach the interesting cases: 0 < tau < n and tau = n
        assert bool((cpu.num_accepted > 0).any()) and bool((cpu.num_accepted.long() < n).any())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["logits", "probs"])
def test_block_logit_dtypes(dtype, mode):
    B, G, V = 24, 3, 257
    target, tokens, draft = make_problem(B, G, V, seed=3, dtype=dtype, closeness=0.3)
    gen = torch.Generator().manual_seed(4)
    _three_ways(target, tokens, _draft_kw(mode, draft), **mixed_sampling(B, gen))


@pytest.mark.parametrize("num_chunks", [2, 5])
def test_block_vocabulary_chunks(num_chunks):
    """The race of row tau split over chunks (each chunk reads tau, w_tau from block_decide)."""
    B, G, V = 16, 4, 1000
    target, tokens, draft = make_problem(B, G, V, seed=9, closeness=0.3)
    gen = torch.Generator().manual_seed(10)
    kw = dict(temperature=0.8, seed=torch.randint(0, 2**62, (B,), generator=gen))
    _three_ways(target, tokens, dict(draft_logits=draft), num_chunks=num_chunks, **kw)


def test_block_top_p_ties_by_index():
    top_p_ties_case(_three_ways)


def test_block_flattened_layout():
    flattened_case("cpu", ("torch", "vectorized"))


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
def test_block_native_token_bitmask(mode, simd):
    token_bitmask_case(_three_ways, mode)


def test_block_nonfinite_logits_and_placeholders():
    nonfinite_case(_three_ways)


def test_block_strided_views():
    strided_views_case(_three_ways, "cpu")


def test_block_zero_sizes():
    zero_sizes_case(_three_ways)


@pytest.mark.parametrize("num_logprobs", [0, 3])
def test_block_return_logprobs(num_logprobs):
    """return_logprobs alone: filled by the core from its row statistics (no post-pass); with top-n
    the post-pass. Equal to the vectorized backend's post-pass."""
    B, G, V = 16, 4, 300
    target, tokens, draft = make_problem(B, G, V, seed=61, closeness=0.3)
    gen = torch.Generator().manual_seed(62)
    kw = dict(method="block", return_logprobs=True, num_logprobs=num_logprobs, **mixed_sampling(B, gen))
    cpu = sk.verify(target, tokens, draft, backend="cpu", **kw)
    vec = sk.verify(target, tokens, draft, backend="vectorized", **kw)
    _same(cpu, vec, "logprobs call")
    torch.testing.assert_close(cpu.logprobs, vec.logprobs, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert bool(cpu.logprobs[cpu.tokens >= 0].isfinite().all())
    if num_logprobs:
        assert torch.equal(cpu.top_logprob_ids, vec.top_logprob_ids)


def test_block_auto_runs_the_cpu_build(monkeypatch):
    """backend="auto" on CPU tensors: the CPU build's block verification (no masked copy)."""
    monkeypatch.setattr(_dispatch, "_CPU_AUTO", None)  # undo conftest's auto -> triton
    calls = []
    real = csrc.verify_chain_cpu

    def spy(args, *a, **k):
        calls.append(k.get("method"))
        assert args.token_bitmask is not None  # the mask goes into the core
        return real(args, *a, **k)

    monkeypatch.setattr(csrc, "verify_chain_cpu", spy)
    target, tokens, draft = make_problem(6, 3, 40, seed=71)
    mask = pack_bitmask(torch.ones(6, 4, 40, dtype=torch.bool))
    kw = dict(temperature=0.8, seed=72, method="block", token_bitmask=mask)
    out = sk.verify(target, tokens, draft, backend="auto", **kw)
    assert calls == ["block"]
    _same(out, sk.verify(target, tokens, draft, backend="torch", **kw), "auto vs reference")


def test_block_accepts_eleven_ninths_on_the_cpu_build():
    """The paper's example (V = {a, b}, target (1/3, 2/3), draft (2/3, 1/3), G = 2) at 40,000
    requests through backend="cpu": block's mean accepted length within 4 standard errors of 11/9,
    the token rule's of 10/9, each far from the other's (test_block_verify's check)."""
    paper_known_answer("cpu")


def test_block_joint_law_of_the_first_two_tokens_on_the_cpu_build():
    """Random context-free rows (V = 5, G = 3), 40,000 requests through backend="cpu": the first two
    emitted tokens (the second drawn from the target where a step emitted one) follow p x p
    (chi-square at ALPHA over 25 cells). Power: the same statistic on the same drafts rejects the
    variant that draws row tau's residual without its weight w_tau (max(p - q, 0)), run by the
    vectorized rule (test_block_verify's check); and it rejects the CPU build's own output when
    the draft logits it is given are not those the drafts were sampled from (uniform q)."""
    from ._stats import ALPHA

    pvalue, (target, drafts, draft), kw = check_joint_law("cpu")
    assert pvalue(sk.verify(target, drafts, torch.zeros_like(draft), backend="cpu", **kw)) < ALPHA
