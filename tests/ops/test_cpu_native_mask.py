"""token_bitmask= applied natively by the CPU build's row pass (backend="cpu").

The CPU build reads the int32 words itself (csrc ``token_allowed`` / ``mask_run`` / AVX2 ``mask8``)
instead of running on the masked copy of ``_bitmask`` that the other backends get. Every call here
runs three ways, which must return the same tokens, counts, flags and nodes:

* native: ``sk.verify(..., backend="cpu")`` (the mask goes into the core);
* masked copy: the CPU build on ``_bitmask.apply_chain_mask`` / ``apply_tree_mask`` rows (the path
  before the native mask; the same arithmetic on the same values, so equal for every seed);
* the reference (``backend="torch"``), which masks by its own rule.

Vocabularies that are not multiples of 32 (the last word partial) and wide enough for the AVX2
loops (32 entries a step) and vocabulary chunks; rows allowing one token, only a token of the last
partial word, nothing, everything; non-contiguous masks; garbage bits past V.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._bitmask import apply_chain_mask, apply_tree_mask
from specdec_kernels._tree_args import check_tree_args
from specdec_kernels._validation import check_verify_call
from specdec_kernels.ops import csrc

from ._inputs import make_problem, pack_bitmask
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip
from .test_token_bitmask import _params as bitmask_params

VOCABS = (37, 1005)  # one full word + 5; 31 full words + 13 (AVX2 steps of 32 and a scalar tail)
PARAMS = ("greedy", "sampled", "filters", "per_request", "by_index")  # test_token_bitmask's, and the tie rule


@pytest.fixture(autouse=True)
def _core():
    cpu_core_or_skip()


def _params(name: str, B: int) -> dict:
    if name == "by_index":
        return dict(temperature=1.1, top_p=0.6, top_p_ties="by_index", seed=11)
    return bitmask_params(name, B)


def _allowed(lead: tuple, V: int, gen: torch.Generator, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """bool [*lead, V]: per-row densities from 5% to 95%, draft tokens allowed at most of their rows
    (tokens [*lead[:-1], G]), and the special rows: one allowed token, only the last token of the
    partial last word, nothing, everything."""
    density = torch.rand(*lead, 1, generator=gen) * 0.9 + 0.05
    allowed = torch.rand(*lead, V, generator=gen) < density
    if tokens is not None and tokens.shape[-1] > 0:
        G = tokens.shape[-1]
        keep = torch.rand(tokens.shape, generator=gen) < 0.8
        rows = allowed[..., :G, :]
        rows.scatter_(-1, tokens[..., None].clamp(0, V - 1), keep[..., None] | rows.gather(-1, tokens[..., None]))
    flat = allowed.view(-1, V)
    specials = [(1, [V // 2]), (3, [V - 1]), (5, []), (6, list(range(V)))]
    for row, tokens_allowed in specials:
        if row < flat.shape[0]:
            flat[row] = False
            flat[row, tokens_allowed] = True
    return allowed


def _same(a, b, what: str) -> None:
    for field in ("tokens", "num_accepted", "nonfinite", "accepted_nodes"):
        if hasattr(a, field):
            assert torch.equal(getattr(a, field), getattr(b, field)), f"{what}: {field}\n{a}\n{b}"


def _draft_kw(mode: str, draft: torch.Tensor) -> dict:
    if mode == "logits":
        return dict(draft_logits=draft)
    if mode == "probs":
        return dict(draft_probs=torch.softmax(draft.float(), -1).to(draft.dtype))
    return {}


def _chain_three_ways(target, tokens, draft_kw: dict, kw: dict, num_chunks=None, check_reference=True):
    """The native CPU call, asserted equal to the masked-copy CPU call and to the reference."""
    with _dispatch.launch_overrides(num_chunks=num_chunks):
        native = sk.verify(target, tokens, backend="cpu", **draft_kw, **kw)
    call = dict(kw)
    args = check_verify_call(
        target, tokens, draft_kw.get("draft_logits"), draft_kw.get("draft_probs"), call.pop("temperature", 1.0),
        call.pop("top_k", 0), call.pop("top_p", 1.0), call.pop("num_draft_tokens", None), call.pop("seed", None),
        **call,
    )  # fmt: skip
    _same(native, csrc.verify_chain_cpu(apply_chain_mask(args).padded(), num_chunks), "native vs masked copy")
    if check_reference:
        _same(native, sk.verify(target, tokens, backend="torch", **draft_kw, **kw), "native vs reference")
    return native


@pytest.mark.parametrize("simd", ["1", "0"])
@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("params", PARAMS)
def test_chain_native_mask_equals_masked_copy_and_reference(monkeypatch, simd, mode, params):
    monkeypatch.setenv("SPECDEC_CPU_SIMD", simd)
    B, G = 8, 3
    for V in VOCABS:
        target, tokens, draft = make_problem(B, G, V, seed=V + len(mode) + len(params))
        if params == "by_index":  # ties at the top-p boundary: the by-index cut reads masked rows too
            target, draft = (target * 2).round() / 2, (draft * 2).round() / 2
        allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(V), tokens)
        kw = dict(_params(params, B), token_bitmask=pack_bitmask(allowed))
        kw["num_draft_tokens"] = torch.tensor([3, 2, 0, 3, 1, 3, 3, 2])
        for num_chunks in (None, 3):
            out = _chain_three_ways(target, tokens, _draft_kw(mode, draft), kw, num_chunks)
        if params != "greedy":
            plain = sk.verify(target, tokens, backend="cpu", **_draft_kw(mode, draft), **dict(kw, token_bitmask=None))
            assert not torch.equal(out.tokens, plain.tokens)  # the mask changed something


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_chain_native_mask_half_precision(dtype):
    B, G, V = 6, 4, 1005
    target, tokens, draft = make_problem(B, G, V, seed=3, dtype=dtype)
    allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(4), tokens)
    for params in ("greedy", "sampled", "filters"):
        kw = dict(_params(params, B), token_bitmask=pack_bitmask(allowed))
        _chain_three_ways(target, tokens, dict(draft_logits=draft), kw)


def test_chain_native_mask_many_seeds_wide_vocabulary():
    """V = 4133 (AVX2 race steps and sum blocks over masked words), 24 seeds, drafts from the
    masked draft so that most are accepted and every row is reached."""
    B, G, V = 4, 4, 4133
    target, _, draft = make_problem(B, G, V, seed=9)
    allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(2))
    allowed[..., :2] = True  # no empty rows here: the walk goes on
    masked_draft = torch.where(allowed[:, :G], draft, float("-inf"))
    gen = torch.Generator().manual_seed(1)
    tokens = torch.multinomial(torch.softmax(masked_draft, -1).view(-1, V), 1, generator=gen).view(B, G)
    for seed in range(24):
        kw = dict(temperature=1.0, seed=seed, token_bitmask=pack_bitmask(allowed))
        _chain_three_ways(target, tokens, dict(draft_logits=draft), kw, check_reference=seed % 4 == 0)


def test_flattened_layout_native_mask():
    B, G, V = 5, 3, 1005
    n = [3, 0, 2, 3, 1]
    target, tokens, draft = make_problem(B, G, V, seed=4)
    allowed = _allowed((B, G + 1), V, torch.Generator().manual_seed(6), tokens)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 1.2, 0.7, 1.0]), top_k=40, seed=torch.arange(B) + 40)
    f_target = torch.cat([target[b, : n[b] + 1] for b in range(B)])
    f_tokens = torch.cat([tokens[b, : n[b]] for b in range(B)])
    f_draft = torch.cat([draft[b, : n[b]] for b in range(B)])
    f_mask = pack_bitmask(torch.cat([allowed[b, : n[b] + 1] for b in range(B)]))
    cu = torch.tensor([0, *n]).cumsum(0)
    got = _chain_three_ways(
        f_target, f_tokens, dict(draft_logits=f_draft), dict(kw, token_bitmask=f_mask, cu_num_draft_tokens=cu)
    )
    want = sk.verify(target, tokens, draft, backend="cpu", num_draft_tokens=torch.tensor(n),
                     token_bitmask=pack_bitmask(allowed), **kw)  # fmt: skip
    _same(got, want, "flattened vs padded")


def _tree_three_ways(target, tokens, parents, draft_kw: dict, kw: dict, multi: bool = False):
    op = sk.verify_multi if multi else sk.verify_tree
    positional = (target, tokens) if multi else (target, tokens, parents)
    native = op(*positional, backend="cpu", **draft_kw, **kw)
    call = dict(kw)
    args = check_tree_args(
        target, tokens, None if multi else parents, draft_kw.get("draft_logits"), draft_kw.get("draft_probs"),
        call.pop("temperature", 1.0), call.pop("top_k", 0), call.pop("top_p", 1.0), call.pop("seed", None),
        call.pop("num_nodes", None), call.pop("method", "kseq"), call.pop("max_depth", None), multi=multi, **call,
    )  # fmt: skip
    _same(native, csrc.verify_tree_cpu(apply_tree_mask(args)), "tree: native vs masked copy")
    _same(native, op(*positional, backend="torch", **draft_kw, **kw), "tree: native vs reference")
    return native


@pytest.mark.parametrize("simd", ["1", "0"])
@pytest.mark.parametrize(
    "method, mode", [("kseq", "logits"), ("rrs", "probs"), ("rrs_wor", "logits"), ("kseq", "ngram")]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_native_mask(monkeypatch, simd, method, mode, temperature):
    monkeypatch.setenv("SPECDEC_CPU_SIMD", simd)
    B, N = 4, 7
    for V in VOCABS:
        target, tokens, parents, draft = make_tree_problem(B, N, V, seed=V, without_replacement=method == "rrs_wor")
        allowed = torch.rand(B, N + 1, V, generator=torch.Generator().manual_seed(V)) < 0.4
        for b in range(B):  # node i is a candidate at row parents[i] + 1: allow most there
            for i in range(N):
                if (b + i) % 3:
                    allowed[b, int(parents[b, i]) + 1, int(tokens[b, i])] = True
        allowed[1, 0] = False  # request 1: its root allows nothing
        allowed[2, 0] = False
        allowed[2, 0, V - 1] = True  # request 2: only the last token, in the partial word
        kw = dict(method=method, temperature=temperature, top_k=30, seed=torch.arange(B) + 5,
                  token_bitmask=pack_bitmask(allowed))  # fmt: skip
        out = _tree_three_ways(target, tokens, parents, _draft_kw(mode, draft), kw)
        assert int(out.tokens[1, 0]) == 0 and int(out.tokens[2, 0]) == V - 1


@pytest.mark.parametrize("method", ["kseq", "rrs"])
def test_multi_native_mask(method):
    B, K, G, V = 3, 3, 3, 1005
    target, tokens, draft = make_problem(B * K, G, V, seed=12)
    target, tokens, draft = target.view(B, K, G + 1, V), tokens.view(B, K, G), draft.view(B, K, G, V)
    tokens[:, 1, 0] = tokens[:, 0, 0]  # shared prefixes: candidates with multiplicity
    allowed = _allowed((B, K, G + 1), V, torch.Generator().manual_seed(3), tokens)
    for params in ("greedy", "filters"):
        kw = dict(_params(params, B), method=method, token_bitmask=pack_bitmask(allowed))
        _tree_three_ways(target, tokens, None, dict(draft_logits=draft), kw, multi=True)


def test_strided_masks_and_bits_past_the_vocabulary():
    """Masks non-contiguous in every dimension (word dim included) and words with the bits past V
    set read like the contiguous, clean mask, in every layout."""
    B, G, V = 4, 3, 1005
    target, tokens, draft = make_problem(B, G, V, seed=13)
    mask = pack_bitmask(_allowed((B, G + 1), V, torch.Generator().manual_seed(1), tokens))
    wide = torch.zeros(G + 1, B, 2 * mask.shape[-1], dtype=torch.int32)
    wide[..., ::2] = mask.transpose(0, 1)
    strided = wide.transpose(0, 1)[..., ::2]
    assert not strided.is_contiguous() and strided.stride(-1) != 1 and torch.equal(strided, mask)
    dirty = mask.clone()
    dirty[..., -1] |= -(1 << (V % 32))  # every bit past V set (the sign bit included)
    kw = dict(draft_logits=draft, temperature=0.8, top_k=50, seed=torch.arange(B))
    want = sk.verify(target, tokens, backend="cpu", token_bitmask=mask, **kw)
    for other in (strided, dirty):
        _same(sk.verify(target, tokens, backend="cpu", token_bitmask=other, **kw), want, "chain")
    t_target, t_tokens, parents, t_draft = make_tree_problem(2, 5, V, seed=3)
    t_mask = pack_bitmask(torch.rand(2, 6, V, generator=torch.Generator().manual_seed(1)) < 0.6)
    t_strided = torch.zeros(2, 6, 3 * t_mask.shape[-1], dtype=torch.int32)
    t_strided[..., ::3] = t_mask
    tree_kw = dict(draft_logits=t_draft, temperature=0.8, seed=4)
    want = sk.verify_tree(t_target, t_tokens, parents, backend="cpu", token_bitmask=t_mask, **tree_kw)
    got = sk.verify_tree(t_target, t_tokens, parents, backend="cpu", token_bitmask=t_strided[..., ::3], **tree_kw)
    _same(got, want, "tree")
    _same(want, sk.verify_tree(t_target, t_tokens, parents, backend="torch", token_bitmask=t_mask, **tree_kw), "ref")


def test_zero_sizes_native_mask():
    for V in (1, 37):
        W = (V + 31) // 32
        out = sk.verify(torch.zeros(0, 3, V), torch.zeros(0, 2, dtype=torch.int64), backend="cpu",
                        token_bitmask=torch.zeros(0, 3, W, dtype=torch.int32))  # fmt: skip
        assert out.tokens.shape == (0, 3)
        out = sk.verify_multi(torch.zeros(0, 2, 3, V), torch.zeros(0, 2, 2, dtype=torch.int64), backend="cpu",
                              token_bitmask=torch.zeros(0, 2, 3, W, dtype=torch.int32))  # fmt: skip
        assert out.tokens.shape == (0, 3)
        target = torch.randn(2, 1, V)
        allowed = torch.zeros(2, 1, V, dtype=torch.bool)
        allowed[0, 0, V - 1] = True
        mask = pack_bitmask(allowed)
        for temperature in (0.0, 0.7):
            out = _chain_three_ways(target, torch.zeros(2, 0, dtype=torch.int64), {},
                                    dict(temperature=temperature, seed=1, token_bitmask=mask))  # fmt: skip
            assert out.tokens[:, 0].tolist() == [V - 1, 0] and out.nonfinite.tolist() == [False, True]
            out = _tree_three_ways(target, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64),
                                   {}, dict(temperature=temperature, token_bitmask=mask))  # fmt: skip
            assert out.tokens[:, 0].tolist() == [V - 1, 0]
            out = _tree_three_ways(target[:, None], torch.zeros(2, 1, 0, dtype=torch.int64), None, {},
                                   dict(temperature=temperature, token_bitmask=mask[:, None]), multi=True)  # fmt: skip
            assert out.tokens[:, 0].tolist() == [V - 1, 0]


def test_cpu_backend_reads_the_mask_itself(monkeypatch):
    """backend="cpu" (and "auto" resolving to it) makes no masked copy; the other backends do."""
    copies = []
    real_chain, real_tree = _dispatch.apply_chain_mask, _dispatch.apply_tree_mask
    monkeypatch.setattr(_dispatch, "apply_chain_mask", lambda a: copies.append("chain") or real_chain(a))
    monkeypatch.setattr(_dispatch, "apply_tree_mask", lambda a: copies.append("tree") or real_tree(a))
    monkeypatch.setattr(_dispatch, "_CPU_AUTO", "cpu")
    target, tokens, parents, draft = make_tree_problem(2, 4, 37, seed=1)
    mask = pack_bitmask(torch.rand(2, 5, 37, generator=torch.Generator().manual_seed(0)) < 0.5)
    for backend in ("cpu", "auto"):
        sk.verify(target, tokens, draft, backend=backend, temperature=0.9, token_bitmask=mask)
        sk.verify_tree(target, tokens, parents, draft_logits=draft, backend=backend, token_bitmask=mask)
    assert copies == []
    sk.verify(target, tokens, draft, backend="vectorized", temperature=0.9, token_bitmask=mask)
    sk.verify_tree(target, tokens, parents, draft_logits=draft, backend="vectorized", token_bitmask=mask)
    assert copies == ["chain", "tree"]
