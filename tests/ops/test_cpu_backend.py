"""backend="cpu": the csrc core compiled for the host with OpenMP, and what auto does on CPU tensors.

Token for token against the reference (the specification) over modes, dtypes, ragged drafts,
per-request filters and trees; independent of the thread count and of the vocab split; auto on CPU
tensors picks it and never enters Triton's interpreter; without a compiler auto falls back to the
vectorised PyTorch path (tests/ops/test_vectorized_backend.py) and says so once.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels.ops import csrc
from specdec_kernels.reference import verify_multi_reference, verify_reference, verify_tree_reference

from ._inputs import make_problem
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip

MODES = ["greedy", "logits", "probs", "ngram"]


@pytest.fixture(scope="module", autouse=True)
def cpu_build():
    return cpu_core_or_skip()  # no C++ toolchain: skipped (the fallback tests still run elsewhere)


def _same(out, ref, fields=("tokens", "num_accepted", "nonfinite")):
    for name in fields:
        assert torch.equal(getattr(out, name), getattr(ref, name)), name


def _kwargs(mode, draft, B):
    kw = {"seed": torch.arange(B, dtype=torch.int64) * 31 + 7}
    if mode == "greedy":
        return dict(kw, draft_logits=draft, temperature=0.0)
    if mode == "logits":
        return dict(kw, draft_logits=draft, temperature=0.8)
    if mode == "probs":
        return dict(kw, draft_probs=torch.softmax(draft.float() / 0.8, -1), temperature=0.8)
    return dict(kw, temperature=1.2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("V, G", [(111, 0), (1000, 5), (32000, 3)])
@pytest.mark.parametrize("mode", MODES)
def test_chain_matches_reference(mode, V, G, dtype):
    B = 5 if V < 32000 else 2
    target, tokens, draft = make_problem(B, G, V, dtype=dtype, seed=V + G)
    if G > 0:  # accept often enough that every path runs
        tokens = torch.where(torch.rand(B, G) < 0.7, target[:, :G].float().argmax(-1), tokens)
    kw = _kwargs(mode, draft, B)
    kw["num_draft_tokens"] = torch.randint(0, G + 1, (B,))
    _same(sk.verify(target, tokens, **kw, backend="cpu"), verify_reference(target, tokens, **kw))


@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
def test_per_request_filters_match_reference(mode):
    B, G, V = 6, 4, 1000
    target, tokens, draft = make_problem(B, G, V, seed=2)
    kw = _kwargs(mode, draft, B)
    kw.update(
        temperature=torch.tensor([0.0, 0.5, 1.0, 1.5, 0.9, 0.7]),
        top_k=torch.tensor([0, 5, 50, 0, 999, 1]),
        top_p=torch.tensor([1.0, 0.9, 1.0, 0.5, 0.2, 1.0]),
    )
    if mode == "probs":
        kw["draft_probs"] = torch.softmax(draft.float(), -1)
    _same(sk.verify(target, tokens, **kw, backend="cpu"), verify_reference(target, tokens, **kw))


def test_threads_and_vocab_split_do_not_change_tokens():
    B, G, V = 2, 4, 32000
    target, tokens, draft = make_problem(B, G, V, seed=9)
    kw = dict(draft_logits=draft, temperature=0.9, top_p=0.95, seed=torch.tensor([3, 4]))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = sk.verify(target, tokens, **kw, backend="cpu")
        torch.set_num_threads(2)
        two = sk.verify(target, tokens, **kw, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    _same(one, two)
    for chunks in (2, 5):
        with _dispatch.launch_overrides(num_chunks=chunks):
            _same(sk.verify(target, tokens, **kw, backend="cpu"), one)


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("mode", ["greedy", "logits", "probs", "onehot"])
def test_tree_matches_reference(method, mode):
    B, N, V = 4, 9, 500
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=len(method) + len(mode), without_replacement=True)
    kw = {"seed": torch.arange(B) + 11, "method": method, "num_nodes": torch.tensor([9, 4, 0, 7])}
    if mode == "greedy":
        kw.update(draft_logits=draft, temperature=0.0)
    elif mode == "logits":
        kw.update(draft_logits=draft, top_k=40)
    elif mode == "probs":
        kw.update(draft_probs=torch.softmax(draft.float(), -1))
    fields = ("tokens", "num_accepted", "accepted_nodes", "nonfinite")
    ref = verify_tree_reference(target, tokens, parents, **kw)
    _same(sk.verify_tree(target, tokens, parents, **kw, backend="cpu"), ref, fields)


def test_multi_matches_reference():
    B, K, G, V = 3, 3, 3, 300
    target = torch.randn(B, K, G + 1, V)
    draft = torch.randn(B, K, G, V)
    tokens = torch.randint(0, V, (B, K, G))
    kw = dict(draft_logits=draft, temperature=0.7, seed=torch.arange(B), method="kseq")
    fields = ("tokens", "num_accepted", "accepted_nodes", "nonfinite")
    _same(sk.verify_multi(target, tokens, **kw, backend="cpu"), verify_multi_reference(target, tokens, **kw), fields)


def test_auto_on_cpu_is_the_cpu_backend_never_the_interpreter(monkeypatch):
    monkeypatch.setattr(_dispatch, "_CPU_AUTO", None)  # undo the kernel tests' override

    def no_triton(*args, **kwargs):
        raise AssertionError("auto on CPU entered the Triton launcher")

    monkeypatch.setattr(_dispatch, "launch_verify", no_triton)
    monkeypatch.setattr(_dispatch, "launch_tree", no_triton)
    target, tokens, draft = make_problem(3, 2, 100, seed=1)
    out = sk.verify(target, tokens, draft, temperature=0.7, seed=5)
    _same(out, sk.verify(target, tokens, draft, temperature=0.7, seed=5, backend="cpu"))
    assert _dispatch.cpu_auto_backend() == "cpu"
    t, x, p, d = make_tree_problem(2, 5, 100, seed=2)
    sk.verify_tree(t, x, p, d, seed=1)


def test_auto_falls_back_to_the_vectorized_path_without_a_compiler(monkeypatch):
    monkeypatch.setattr(_dispatch, "_CPU_AUTO", None)
    monkeypatch.setattr(csrc, "_cpu_core", None)
    monkeypatch.setattr(csrc, "_CPU_FAILURE", "building the CPU backend failed: no C++ compiler (test)")
    monkeypatch.setattr(_dispatch, "launch_verify", lambda *a, **k: pytest.fail("entered the interpreter"))
    target, tokens, draft = make_problem(2, 3, 64, seed=4)
    with pytest.warns(RuntimeWarning, match="no C\\+\\+ compiler"):
        out = sk.verify(target, tokens, draft, temperature=0.9, seed=3)
    _same(out, verify_reference(target, tokens, draft, temperature=0.9, seed=3))
    assert _dispatch.cpu_auto_backend() == "vectorized"
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        sk.verify(target, tokens, draft, seed=3, backend="cpu")


def test_cpu_backend_rejects_other_devices():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA tensor")
    target, tokens, draft = make_problem(2, 3, 64, seed=4, device="cuda")
    with pytest.raises(RuntimeError, match="needs CPU tensors"):
        sk.verify(target, tokens, draft, backend="cpu")
