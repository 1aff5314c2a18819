"""backend="cuda" reads token_bitmask and writes return_logprobs itself (issue 25): the CUDA kernels
run the csrc programs with the mask words (ChainParams::mask) instead of on a masked copy of the
rows, and score the emitted tokens from their row statistics (csrc/verify_logprobs.h, the
logprobs kernel of csrc/verify_cuda.cu) instead of the logprobs post-pass (ops/logprobs.py).

Without a GPU:
* the "cuda" path of the dispatch (``_dispatch.run_verify`` / ``run_tree`` -> ``ops/csrc``
  ``verify_chain`` / ``verify_tree`` -> the binding) runs end to end on CPU tensors with the CPU build
  standing in for the CUDA extension, the masked copies (``apply_chain_mask`` / ``apply_tree_mask``)
  and the post-pass's row gather made to raise: the path asks the binding for the mask and the
  logprobs, and returns what backend="cpu" returns. (Before issue 25 it masked a copy.) Also
  method="block" (csrc/verify_block.h), which backend="cuda" refused before.
* the CUDA kernels' own statistics of greedy rows (``greedy_normaliser_program``: the radix-select
  threshold at temperature 1 and a program-wide sum, not the CPU build's selection) run by the CPU
  build (the binding's logprobs mode 2): equal, within TOL, to the CPU build's logprobs.
With a GPU (``@pytest.mark.gpu``): backend="cuda" against backend="cpu" on the same inputs, chains
(vocabulary chunks, dtypes, draft modes, flattened layout, method="block"), trees and verify_multi,
with and without masks: the same tokens, counts, flags and nodes, logprobs within GPU_TOL; and a CUDA
graph replays a masked call with logprobs.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._bitmask import pack
from specdec_kernels._tree_args import check_tree_args
from specdec_kernels._validation import check_verify_call
from specdec_kernels.ops import csrc

from ._inputs import flattened_problem, make_problem
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip
from .test_cpu_logprobs import SETTINGS, TOL

# backend="cuda" against the CPU build: float32 sums over a thread block against the CPU build's
# double sums (z, and with top-p the fixed-point mass of the radix select) move a logprob by ~1e-6.
GPU_TOL = 5e-5
TREE_SETTINGS = [  # the CUDA build has no top_p_ties="by_index" (greedy calls with it: the post-pass)
    dict(temperature=torch.tensor([0.9, 0.0, 1.1]), top_k=4, top_p=0.95),
    dict(temperature=0.0),
    dict(temperature=0.0, top_k=3, top_p=0.8),
    dict(temperature=0.7, top_p=0.6),
]
CHAIN_FIELDS = ("tokens", "num_accepted", "nonfinite")
TREE_FIELDS = ("tokens", "num_accepted", "accepted_nodes", "nonfinite")


def _same(a, b, fields, tol: float):
    for name in fields:
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name
    assert a.logprobs is not None and b.logprobs is not None
    torch.testing.assert_close(a.logprobs.cpu(), b.logprobs.cpu(), atol=tol, rtol=0, equal_nan=True)


def _mask(shape: tuple, seed: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """token_bitmask words of a random allow-mask over target rows ``shape`` (about 60% allowed;
    draft tokens allowed at the rows they are verified at where ``tokens`` [*, G] is given)."""
    allowed = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < 0.6
    if tokens is not None and tokens.shape[-1] > 0:
        allowed[..., : tokens.shape[-1], :].scatter_(-1, tokens.cpu()[..., None], True)
    return pack(allowed)


def _on(device, kw: dict) -> dict:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def _cuda_equals_cpu(op, inputs: tuple, kw: dict, fields: tuple):
    """op(*inputs, **kw) with backend="cuda" (tensors moved to the GPU) against backend="cpu"."""
    want = op(*inputs, backend="cpu", **kw)
    got = op(*(None if t is None else t.cuda() for t in inputs), backend="cuda", **_on("cuda", kw))
    _same(got, want, fields, GPU_TOL)


# ---- without a GPU: the "cuda" path on the CPU build


@pytest.fixture
def cpu_as_cuda(no_post_pass):
    """backend="cuda"'s Python path with the CPU build as its extension, on CPU tensors; the masked
    copies and the post-pass raise."""
    core = cpu_core_or_skip()
    monkeypatch = no_post_pass

    def refuse(*args, **kwargs):
        raise AssertionError("the cuda path masked a copy of the rows")

    monkeypatch.setattr(csrc, "_require_cuda_tensors", lambda device: None)
    monkeypatch.setattr(csrc, "load_cuda_extension", lambda verbose=False: core)
    monkeypatch.setattr(_dispatch, "apply_chain_mask", refuse)
    monkeypatch.setattr(_dispatch, "apply_tree_mask", refuse)
    return monkeypatch


@pytest.mark.parametrize("setting", SETTINGS[3:7], ids=range(4))
@pytest.mark.parametrize("layout", ["padded", "flattened"])
def test_cuda_path_passes_mask_and_logprobs(cpu_as_cuda, setting, layout):
    if layout == "padded":
        target, drafts, draft = make_problem(4, 3, 301, seed=4)
        kw = dict(setting, token_bitmask=_mask(target.shape, 1, drafts))
    else:
        cu, target, drafts, draft = flattened_problem(301, seed=4)
        n = 3
        setting = {k: v[:n] if isinstance(v, torch.Tensor) else v for k, v in setting.items()}
        kw = dict(setting, token_bitmask=_mask(target.shape, 1), cu_num_draft_tokens=cu, max_num_draft_tokens=4)
    kw.update(seed=9, return_logprobs=True)
    got = sk.verify(target, drafts, draft, backend="cuda", **kw)
    cpu_as_cuda.undo()
    _same(got, sk.verify(target, drafts, draft, backend="cpu", **kw), CHAIN_FIELDS, 0.0)


@pytest.mark.parametrize("op", ["tree", "multi"])
@pytest.mark.parametrize("setting", TREE_SETTINGS, ids=range(len(TREE_SETTINGS)))
def test_cuda_tree_path_passes_mask_and_logprobs(cpu_as_cuda, setting, op):
    if op == "tree":
        target, tokens, parents, draft = make_tree_problem(3, 7, 301, seed=5)
        inputs, run = (target, tokens, parents, draft), sk.verify_tree
    else:
        target, tokens, draft = make_problem(6, 3, 301, seed=5)
        target, tokens, draft = target.view(3, 2, 4, 301), tokens.view(3, 2, 3), draft.view(3, 2, 3, 301)
        inputs, run = (target, tokens, draft), sk.verify_multi
    kw = dict(setting, seed=4, return_logprobs=True, token_bitmask=_mask(target.shape, 2))
    got = run(*inputs, backend="cuda", **kw)
    cpu_as_cuda.undo()
    _same(got, run(*inputs, backend="cpu", **kw), TREE_FIELDS, 0.0)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
def test_cuda_path_runs_block_verification(cpu_as_cuda, mode, masked):
    """method="block" on backend="cuda" (csrc/verify_block.h; before: a ValueError)."""
    target, drafts, draft = make_problem(5, 4, 301, seed=9, closeness=0.2)
    dk = {"logits": dict(draft_logits=draft), "probs": dict(draft_probs=torch.softmax(draft, -1))}.get(mode, {})
    kw = dict(dk, temperature=torch.tensor([0.9, 0.0, 1.2, 0.7, 1.0]), top_k=40, seed=3, method="block")
    kw.update(return_logprobs=True, token_bitmask=_mask(target.shape, 9, drafts) if masked else None)
    got = sk.verify(target, drafts, backend="cuda", **kw)
    cpu_as_cuda.undo()
    _same(got, sk.verify(target, drafts, backend="cpu", **kw), CHAIN_FIELDS, 0.0)


def test_cuda_path_leaves_by_index_logprobs_to_the_post_pass(monkeypatch):
    """A greedy call with top_p_ties="by_index" (which the CUDA build does not implement): the kernels
    are not asked for logprobs, the post-pass scores them (as backend="cpu" does natively)."""
    core = cpu_core_or_skip()
    asked = []

    def run_chain(ext, args, num_chunks=None, threads=None, logprobs=False, block=False):
        asked.append(logprobs)
        return real(ext, args, num_chunks, threads, logprobs, block)

    real = csrc.run_chain
    monkeypatch.setattr(csrc, "_require_cuda_tensors", lambda device: None)
    monkeypatch.setattr(csrc, "load_cuda_extension", lambda verbose=False: core)
    monkeypatch.setattr(csrc, "run_chain", run_chain)
    target, drafts, draft = make_problem(3, 3, 301, seed=6)
    kw = dict(temperature=0.0, top_p=0.5, top_p_ties="by_index", seed=1, return_logprobs=True)
    got = sk.verify(target, drafts, draft, backend="cuda", **kw)
    assert asked == [False]
    monkeypatch.undo()
    _same(got, sk.verify(target, drafts, draft, backend="cpu", **kw), CHAIN_FIELDS, TOL)


# ---- without a GPU: the CUDA kernels' statistics of greedy rows, run by the CPU build

GREEDY_SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=0.0, top_k=5),
    dict(temperature=0.0, top_p=0.7),
    dict(temperature=0.0, top_k=3000, top_p=0.9),  # top-p over more survivors than the candidate slots
    dict(temperature=torch.tensor([0.0, 0.9, 0.0, 0.5]), top_k=torch.tensor([0, 3, 9, 0]), top_p=0.85),
]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("setting", GREEDY_SETTINGS, ids=range(len(GREEDY_SETTINGS)))
def test_gpu_greedy_statistics_on_the_cpu(setting, dtype, masked):
    core = cpu_core_or_skip()
    target, drafts, draft = make_problem(4, 3, 5003, seed=7, dtype=dtype)
    mask = _mask(target.shape, 3, drafts) if masked else None
    T, k, p = setting["temperature"], setting.get("top_k", 0), setting.get("top_p", 1.0)
    args = check_verify_call(target, drafts, draft, None, T, k, p, None, 5, token_bitmask=mask)
    native = csrc.run_chain(core, args, logprobs=True)
    programs = csrc.run_chain(core, args, logprobs=csrc.LOGPROBS_GPU_PROGRAMS)
    _same(programs, native, CHAIN_FIELDS, TOL)
    tree = check_tree_args(
        target.view(2, 2, 4, 5003), drafts.view(2, 2, 3), None, draft.view(2, 2, 3, 5003), None,
        T if not isinstance(T, torch.Tensor) else T[:2], k if not isinstance(k, torch.Tensor) else k[:2], p, 5,
        None, "kseq", None, multi=True, token_bitmask=None if mask is None else mask.view(2, 2, 4, -1),
    )  # fmt: skip
    native = csrc.run_tree(core, tree, logprobs=True)
    _same(csrc.run_tree(core, tree, logprobs=csrc.LOGPROBS_GPU_PROGRAMS), native, TREE_FIELDS, TOL)


def test_gpu_statistics_mode_is_cpu_only():
    core = cpu_core_or_skip()
    target, drafts, draft = make_problem(2, 2, 40)
    args = check_verify_call(target, drafts, draft, None, 0.0, 0, 1.0, None, 5)
    with pytest.raises(RuntimeError, match="logprobs must be 0, 1 or 2"):
        csrc.run_chain(core, args, logprobs=3)


# ---- with a GPU: backend="cuda" against the CPU build


def _cuda_ready():
    try:
        csrc.load_cuda_extension()
    except RuntimeError as exc:
        pytest.skip(f"CUDA extension unavailable: {str(exc)[:300]}")
    cpu_core_or_skip()


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
@pytest.mark.parametrize("setting", SETTINGS, ids=range(len(SETTINGS)))
def test_cuda_chain_equals_cpu_build(no_post_pass, setting, mode, dtype, masked):
    _cuda_ready()
    target, drafts, draft = make_problem(4, 4, 32003, seed=len(mode), dtype=dtype, closeness=0.3)
    dk = {"logits": dict(draft_logits=draft), "probs": dict(draft_probs=torch.softmax(draft.float(), -1))}
    kw = dict(setting, **dk.get(mode, {}), seed=torch.tensor([3, 1, 4, 1]), return_logprobs=True)
    kw.update(
        num_draft_tokens=torch.tensor([4, 0, 2, 3]), token_bitmask=_mask(target.shape, 4, drafts) if masked else None
    )
    for chunks in (None, 1, 3):
        with _dispatch.launch_overrides(num_chunks=chunks):
            _cuda_equals_cpu(sk.verify, (target, drafts), kw, CHAIN_FIELDS)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_flattened_equals_cpu_build(no_post_pass, masked):
    _cuda_ready()
    cu, rows, ids, draft = flattened_problem(1003, seed=8)
    kw = dict(temperature=torch.tensor([0.7, 0.0, 1.0]), top_k=9, top_p=0.9, seed=2, return_logprobs=True)
    kw.update(cu_num_draft_tokens=cu, max_num_draft_tokens=4, token_bitmask=_mask(rows.shape, 5) if masked else None)
    _cuda_equals_cpu(sk.verify, (rows, ids, draft), kw, CHAIN_FIELDS)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("setting", TREE_SETTINGS, ids=range(len(TREE_SETTINGS)))
def test_cuda_tree_and_multi_equal_cpu_build(no_post_pass, setting, method, masked):
    _cuda_ready()
    V = 32003
    target, tokens, parents, draft = make_tree_problem(3, 8, V, seed=6, without_replacement=method == "rrs_wor")
    kw = dict(setting, seed=torch.tensor([5, 6, 7]), method=method, return_logprobs=True)
    kw["token_bitmask"] = _mask(target.shape, 6) if masked else None
    _cuda_equals_cpu(sk.verify_tree, (target, tokens, parents, draft), kw, TREE_FIELDS)
    t4, x4, d4 = make_problem(6, 3, V, seed=7)
    t4, x4, d4 = t4.view(3, 2, 4, V), x4.view(3, 2, 3), d4.view(3, 2, 3, V)
    kw.update(method="rrs" if method == "rrs_wor" else method, token_bitmask=_mask(t4.shape, 7) if masked else None)
    _cuda_equals_cpu(sk.verify_multi, (t4, x4, d4), kw, TREE_FIELDS)


@pytest.mark.gpu
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_block_equals_cpu_build(no_post_pass, dtype, mode, masked):
    """method="block": tau and w_tau by the block program on the GPU (double residual mass summed over
    a thread block), then the race of row tau; the same tokens as the CPU build."""
    _cuda_ready()
    B, G, V = 16, 5, 32003
    for seed in range(3):
        target, drafts, draft = make_problem(B, G, V, seed=seed, dtype=dtype, closeness=0.2)
        dk = {"logits": dict(draft_logits=draft), "probs": dict(draft_probs=torch.softmax(draft.float(), -1))}
        kw = dict(dk.get(mode, {}), temperature=torch.linspace(0.0, 1.5, B), top_k=torch.arange(B) * 7, seed=seed)
        kw.update(
            method="block", return_logprobs=True, token_bitmask=_mask(target.shape, seed, drafts) if masked else None
        )
        for chunks in (None, 3):
            with _dispatch.launch_overrides(num_chunks=chunks):
                _cuda_equals_cpu(sk.verify, (target, drafts), kw, CHAIN_FIELDS)


@pytest.mark.gpu
def test_cuda_graph_replays_a_masked_call_with_logprobs():
    """Native masks and logprobs need no host synchronisation: the call is capturable, and a replay
    reads the mask words and seeds written in place since the capture."""
    _cuda_ready()
    target, tokens, draft = make_problem(8, 4, 32000, dtype=torch.bfloat16, device="cuda")
    mask = _mask(target.shape, 8, tokens).cuda()
    kw = dict(temperature=torch.tensor([0.8, 0.0] * 4, device="cuda"), top_k=50, token_bitmask=mask)
    kw.update(seed=torch.arange(8, device="cuda"), return_logprobs=True, backend="cuda", validate=False)
    sk.verify(target, tokens, draft, **kw)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sk.verify(target, tokens, draft, **kw)
    for seed in range(3):
        mask.copy_(_mask(target.shape, seed, tokens))
        kw["seed"].add_(100)
        graph.replay()
        _same(captured, sk.verify(target, tokens, draft, **kw), CHAIN_FIELDS, 0.0)
