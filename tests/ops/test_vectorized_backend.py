"""backend="vectorized": chain verification as batched PyTorch ops, what auto runs on CPU tensors
when the CPU build cannot be compiled; and tree / multi-draft verification the same way.

Token for token against the reference (the specification) over modes, dtypes, vocabularies, ragged
drafts, per-request filters, ties, non-finite inputs, placeholders and strided views; trees and
K chains over every method and draft mode, ragged, filtered, non-finite; its Philox is
bit-identical to the reference's; with the compiler hidden auto picks it, says so once, and gives
the reference's tokens (in this process, and in a fresh one with CXX pointing nowhere).
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels.ops import _cuda_ext
from specdec_kernels.ops.vectorized.chain import philox, race_noise_at, race_noise_dense
from specdec_kernels.reference import verify_multi_reference, verify_reference, verify_tree_reference
from specdec_kernels.reference.philox import philox4x32
from specdec_kernels.reference.sampling import race_uniforms

from ._inputs import make_problem
from ._trees import make_tree_problem

MODES = ["greedy", "logits", "probs", "ngram"]
FIELDS = ("tokens", "num_accepted", "nonfinite")
FILTERS = {
    "none": {},
    "top_k": {"top_k": 7},
    "top_p": {"top_p": 0.8},
    "both": {"top_k": 50, "top_p": 0.9},
}


def _same(out, ref, fields=FIELDS):
    for name in fields:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def _kwargs(mode, draft, B, temperature=0.8):
    kw = {"seed": torch.arange(B, dtype=torch.int64) * 31 + 7}
    if mode == "greedy":
        return dict(kw, draft_logits=draft, temperature=0.0)
    if mode == "logits":
        return dict(kw, draft_logits=draft, temperature=temperature)
    if mode == "probs":
        return dict(kw, draft_probs=torch.softmax(draft.float() / temperature, -1), temperature=temperature)
    return dict(kw, temperature=1.2)


def _both(target, tokens, **kw):
    return sk.verify(target, tokens, **kw, backend="vectorized"), verify_reference(target, tokens, **kw)


def test_philox_is_bit_identical_to_the_reference():
    rng = np.random.default_rng(0)
    seed = rng.integers(-(2**63), 2**63 - 1, 4096, dtype=np.int64)
    counters = [rng.integers(0, 2**32, 4096, dtype=np.int64) for _ in range(3)]
    want = philox4x32(seed, *counters, 0)
    got = philox(torch.from_numpy(seed), *(torch.from_numpy(c) for c in counters))
    for w, g in zip(want, got, strict=True):
        assert np.array_equal(w.astype(np.int64), g.numpy())
    seeds, V = torch.tensor([3, -(2**62), 2**40 + 5]), 37
    rows, purposes = torch.tensor([0, 4, 63]), torch.tensor([1, 2, 1])
    dense = race_noise_dense(seeds, rows, purposes, V)
    for r in range(3):
        u = torch.from_numpy(race_uniforms(int(seeds[r]), V, int(rows[r]), int(purposes[r]))).double()
        assert torch.equal(dense[r], torch.log(-torch.log(u)))
        x = torch.arange(V)
        at = race_noise_at(seeds[r].expand(V), x, rows[r].expand(V), purposes[r].expand(V))
        assert torch.equal(at, dense[r])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V, G", [(111, 0), (111, 3), (1000, 5)])
@pytest.mark.parametrize("mode", MODES)
def test_chain_matches_reference(mode, V, G, dtype):
    B = 6
    target, tokens, draft = make_problem(B, G, V, dtype=dtype, seed=V + G)
    if G > 0:  # accept often enough that every path runs
        tokens = torch.where(torch.rand(B, G) < 0.7, target[:, :G].float().argmax(-1), tokens)
    kw = _kwargs(mode, draft, B)
    kw["num_draft_tokens"] = torch.randint(0, G + 1, (B,))
    for filters in FILTERS.values():
        _same(*_both(target, tokens, **kw, **filters))


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
def test_per_request_parameters_match_reference(mode):
    B, G, V = 6, 4, 1000
    target, tokens, draft = make_problem(B, G, V, seed=2)
    kw = _kwargs(mode, draft, B)
    kw.update(
        temperature=torch.tensor([0.0, 0.5, 1.0, 1.5, 0.9, 0.7]),
        top_k=torch.tensor([0, 5, 50, 0, 999, 1]),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.5, 0.2, 1.0]),
        num_draft_tokens=torch.tensor([4, 0, 2, 4, 3, 1]),
    )
    if mode == "probs":
        kw["draft_probs"] = torch.softmax(draft.float(), -1)
    _same(*_both(target, tokens, **kw))


@pytest.mark.parametrize("mode", MODES)
def test_ties_follow_the_reference(mode):
    """Logits on a coarse grid: argmax ties (lowest index), top-k and top-p boundaries inside runs
    of equal values (all of them kept)."""
    B, G, V = 6, 4, 300
    g = torch.Generator().manual_seed(5)
    target = torch.randint(0, 6, (B, G + 1, V), generator=g).float() * 0.5
    draft = torch.randint(0, 6, (B, G, V), generator=g).float() * 0.5
    tokens = torch.where(torch.rand(B, G, generator=g) < 0.5, target[:, :G].argmax(-1), torch.randint(0, V, (B, G)))
    kw = _kwargs(mode, draft, B)
    for filters in ({"top_k": 3}, {"top_k": 40}, {"top_p": 0.3}, {"top_k": 100, "top_p": 0.6}, {}):
        _same(*_both(target, tokens, **kw, **filters))


def test_nonfinite_inputs_match_reference():
    B, G, V = 6, 3, 200
    target, tokens, draft = make_problem(B, G, V, seed=8)
    tokens = torch.where(torch.rand(B, G) < 0.6, target[:, :G].argmax(-1), tokens)
    target[0, 0, 5] = float("nan")
    target[1, 2, :] = float("-inf")  # nothing finite in a row
    target[2, 1, 7] = float("inf")
    target[3, 3, 9] = float("nan")  # the bonus row
    draft[4, 0, 3] = float("nan")
    draft[5, 2, 11] = float("inf")
    probs = torch.softmax(draft.float(), -1)
    probs[0, 1, 2] = -0.5
    probs[1, 0, 4] = float("nan")
    for t in (0.0, 0.7, torch.tensor([0.0, 0.7, 1.0, 0.0, 0.9, 1.3])):
        for kw in ({"draft_logits": draft}, {"draft_probs": probs}, {}):
            vec, ref = _both(target, tokens, **kw, temperature=t, top_p=0.95, seed=torch.arange(B) + 3)
            _same(vec, ref)
            assert vec.nonfinite.any()


@pytest.mark.parametrize("mode", MODES)
def test_placeholder_ids_match_reference(mode):
    B, G, V = 5, 4, 120
    target, tokens, draft = make_problem(B, G, V, seed=9)
    tokens = torch.where(torch.rand(B, G) < 0.7, target[:, :G].argmax(-1), tokens)
    tokens[0, 1] = -1
    tokens[2, 0] = V + 3
    tokens[3, 3] = -1
    kw = _kwargs(mode, draft, B)
    _same(*_both(target, tokens, **kw, validate=False))


def test_layouts_views_and_out_dtype():
    """Strided views of every argument, the flattened ragged layout and int32 ids give the same
    tokens as the plain padded call (and the reference)."""
    B, G, V = 4, 3, 150
    target, tokens, draft = make_problem(B, G, V, seed=10)
    n = torch.tensor([3, 0, 2, 1])
    kw = dict(temperature=0.9, top_k=30, seed=torch.tensor([1, 2, 3, 4]), num_draft_tokens=n)
    plain, ref = _both(target, tokens, draft_logits=draft, **kw)
    _same(plain, ref)

    def strided(t):
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
        wide[..., ::2] = t
        return wide[..., ::2]

    views = {k: strided(v) for k, v in kw.items() if isinstance(v, torch.Tensor)}
    out = sk.verify(strided(target), strided(tokens), strided(draft), **{**kw, **views}, backend="vectorized")
    _same(out, plain)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])
    flat_t = torch.cat([target[b, : n[b] + 1] for b in range(B)])
    flat_d = torch.cat([draft[b, : n[b]] for b in range(B)])
    flat_x = torch.cat([tokens[b, : n[b]] for b in range(B)])
    flat_kw = {k: v for k, v in kw.items() if k != "num_draft_tokens"}
    out = sk.verify(flat_t, flat_x, flat_d, cu_num_draft_tokens=cu, **flat_kw, backend="vectorized")
    _same(out, plain)
    narrow = sk.verify(target, tokens, draft, **kw, backend="vectorized", out_dtype=torch.int32)
    assert narrow.tokens.dtype == torch.int32 and torch.equal(narrow.tokens.long(), plain.tokens)


@pytest.mark.parametrize("B, G, V", [(0, 3, 50), (3, 0, 50), (3, 2, 1)])
def test_degenerate_shapes(B, G, V):
    target, tokens, draft = make_problem(B, G, V, seed=11)
    for t in (0.0, 0.9):
        _same(*_both(target, tokens, draft_logits=draft, temperature=t, top_p=0.5, seed=4))


TREE_FIELDS = ("tokens", "num_accepted", "accepted_nodes", "nonfinite")
TREE_MODES = ["greedy", "logits", "probs", "onehot"]


def _tree_kwargs(mode, draft, temperature=1.0):
    if mode == "greedy":
        return {"draft_logits": draft, "temperature": 0.0}
    if mode == "logits":
        return {"draft_logits": draft, "temperature": temperature}
    if mode == "probs":
        return {"draft_probs": torch.softmax(draft.float() / temperature, -1), "temperature": temperature}
    return {"temperature": temperature}


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("mode", TREE_MODES)
def test_tree_matches_reference(method, mode):
    B, N, V = 4, 9, 300
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=len(method) + len(mode), without_replacement=True)
    for filters in ({}, {"top_k": 40}, {"top_p": 0.8}):
        kw = {"seed": torch.arange(B) + 11, "method": method, "num_nodes": torch.tensor([9, 4, 0, 7])}
        kw.update(_tree_kwargs(mode, draft, 0.9), **filters)
        ref = verify_tree_reference(target, tokens, parents, **kw)
        _same(sk.verify_tree(target, tokens, parents, **kw, backend="vectorized"), ref, TREE_FIELDS)


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("mode", TREE_MODES)
def test_multi_matches_reference(method, mode):
    """K chains with shared prefixes (merged with multiplicity) and repeated siblings (rrs_wor
    unchecked: a repeated token is rejected)."""
    B, K, G, V = 3, 3, 3, 200
    g = torch.Generator().manual_seed(len(method) * 7 + len(mode))
    target = torch.randn(B, K, G + 1, V, generator=g) * 2
    draft = target[:, :, :G] + torch.randn(B, K, G, V, generator=g)
    tokens = torch.where(torch.rand(B, K, G, generator=g) < 0.5, target[:, :, :G].argmax(-1), draft.argmax(-1))
    tokens[:, 1, :2] = tokens[:, 0, :2]  # chains 0 and 1 share a prefix
    kw = dict(_tree_kwargs(mode, draft, 0.8), seed=torch.arange(B) + 5, method=method, validate=False)
    ref = verify_multi_reference(target, tokens, **kw)
    _same(sk.verify_multi(target, tokens, **kw, backend="vectorized"), ref, TREE_FIELDS)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_dtypes_per_request_parameters_and_out_dtype(dtype):
    B, N, V = 5, 8, 150
    target, tokens, parents, draft = make_tree_problem(B, N, V, dtype=dtype, seed=3)
    kw = dict(
        draft_logits=draft,
        temperature=torch.tensor([0.0, 0.6, 1.0, 1.4, 0.9]),
        top_k=torch.tensor([0, 10, 0, 149, 3]),
        top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0]),
        seed=torch.arange(B) * 3,
        num_nodes=torch.tensor([8, 1, 5, 0, 6]),
    )
    ref = verify_tree_reference(target, tokens, parents, **kw)
    out = sk.verify_tree(target, tokens, parents, **kw, backend="vectorized", out_dtype=torch.int32)
    assert out.tokens.dtype == torch.int32 and out.accepted_nodes.dtype == torch.int32
    _same(out, ref, ("num_accepted", "nonfinite"))
    assert torch.equal(out.tokens.long(), ref.tokens) and torch.equal(out.accepted_nodes.long(), ref.accepted_nodes)


@pytest.mark.parametrize("mode", TREE_MODES)
def test_tree_nonfinite_and_placeholders_match_reference(mode):
    B, N, V = 4, 8, 120
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=13)
    target[0, 0, 3] = float("nan")  # the root row
    target[1, :, :] = float("-inf")  # nothing finite anywhere
    target[2, 2, 5] = float("inf")
    draft[3, :, 7] = float("nan")
    tokens[2, 1] = -1  # placeholders: no candidates
    tokens[3, 0] = V + 2
    for method in ("kseq", "rrs"):
        kw = dict(_tree_kwargs(mode, draft, 0.9), seed=torch.arange(B), method=method, validate=False)
        if mode == "probs":
            kw["draft_probs"][0, 2, 4] = -1.0
        ref = verify_tree_reference(target, tokens, parents, **kw)
        out = sk.verify_tree(target, tokens, parents, **kw, backend="vectorized")
        _same(out, ref, TREE_FIELDS)
        assert out.nonfinite.any()


def _hide_the_compiler(monkeypatch):
    monkeypatch.setattr(_dispatch, "_CPU_AUTO", None)
    monkeypatch.setattr(_cuda_ext, "_cpu_core", None)
    monkeypatch.setattr(_cuda_ext, "_CPU_FAILURE", "building the CPU backend failed: no C++ compiler (test)")
    monkeypatch.setattr(_dispatch, "launch_verify", lambda *a, **k: pytest.fail("entered the interpreter"))
    monkeypatch.setattr(_dispatch, "reference_verify", lambda *a, **k: pytest.fail("ran the reference loops"))
    monkeypatch.setattr(_dispatch, "reference_tree", lambda *a, **k: pytest.fail("ran the reference loops"))
    monkeypatch.setattr(_dispatch, "launch_tree", lambda *a, **k: pytest.fail("entered the interpreter"))


def test_auto_without_a_compiler_is_vectorized_and_says_so_once(monkeypatch):
    _hide_the_compiler(monkeypatch)
    target, tokens, draft = make_problem(3, 3, 64, seed=4)
    kw = dict(temperature=0.9, top_p=0.9, seed=3)
    with pytest.warns(RuntimeWarning, match="uses 'vectorized'.*no C\\+\\+ compiler") as record:
        out = sk.verify(target, tokens, draft, **kw)
    assert len([w for w in record if issubclass(w.category, RuntimeWarning)]) == 1
    _same(out, verify_reference(target, tokens, draft, **kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        _same(sk.verify(target, tokens, draft, **kw), out)
        tree = make_tree_problem(2, 5, 64, seed=2)
        _same(sk.verify_tree(*tree, seed=1), verify_tree_reference(*tree, seed=1), TREE_FIELDS)
    assert _dispatch.cpu_auto_backend() == "vectorized"


SUBPROCESS = """
import warnings, torch
import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels.reference import verify_reference
g = torch.Generator().manual_seed(0)
target = torch.randn(3, 4, 90, generator=g)
draft = torch.randn(3, 3, 90, generator=g)
tokens = torch.randint(0, 90, (3, 3), generator=g)
kw = dict(temperature=0.8, top_k=20, seed=torch.tensor([1, 2, 3]))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = sk.verify(target, tokens, draft, **kw)
    again = sk.verify(target, tokens, draft, **kw)
ref = verify_reference(target, tokens, draft, **kw)
said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
assert len(said) == 1 and "uses 'vectorized'" in said[0], said
assert _dispatch.cpu_auto_backend() == "vectorized"
assert torch.equal(out.tokens, ref.tokens) and torch.equal(again.tokens, ref.tokens)
print("OK", said[0])
"""


def test_auto_in_a_process_whose_compiler_is_missing(tmp_path):
    """A fresh process with CXX pointing nowhere and an empty build directory: the CPU build fails
    for real, auto says so once and gives the reference's tokens."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), SPECDEC_BUILD_DIR=str(tmp_path / "build"))
    env.pop("SPECDEC_NO_JIT", None)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", SUBPROCESS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("OK"), done.stdout
