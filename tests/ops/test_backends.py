"""backend= on verify / verify_tree / verify_multi, and the torch.library custom ops.

CPU: triton (interpreter) and torch (reference) agree token for token, auto = triton, bad names
raise, cuda raises a RuntimeError that says how to build; the custom ops pass torch.library.opcheck
and run inside torch.compile (aot_eager: dynamo + the fake implementations). GPU: cuda and auto
against the reference, CUDA-graph capture of the cuda backend, torch.compile(mode="reduce-overhead").
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._validation import check_verify_args

from ._inputs import make_problem
from ._trees import make_tree_problem

HAS_CUDA = torch.cuda.is_available()


def _same(a, b, names=("tokens", "num_accepted", "nonfinite")):
    for name in names:
        assert torch.equal(getattr(a, name).cpu(), getattr(b, name).cpu()), name


TREE_FIELDS = ("tokens", "num_accepted", "accepted_nodes", "nonfinite")


@pytest.mark.parametrize("mode", ["greedy", "logits", "probs", "ngram"])
def test_verify_torch_and_triton_backends_agree(mode, device):
    B, G, V = 5, 3, 200
    target, tokens, draft = make_problem(B, G, V, device=device, seed=4)
    kw = {
        "greedy": {"draft_logits": draft, "temperature": 0.0},
        "logits": {"draft_logits": draft, "top_p": 0.9},
        "probs": {"draft_probs": torch.softmax(draft, -1)},
        "ngram": {"top_k": 30},
    }[mode]
    seeds = torch.arange(B, device=device) + 100
    outs = {name: sk.verify(target, tokens, **kw, seed=seeds, backend=name) for name in ("triton", "torch", "auto")}
    _same(outs["triton"], outs["torch"])
    _same(outs["auto"], outs["triton"])


@pytest.mark.parametrize("method", ["kseq", "rrs"])
def test_tree_and_multi_backends_agree(method, device):
    target, tokens, parents, draft = make_tree_problem(3, 6, 64, device=device, seed=2)
    seeds = torch.arange(3, device=device)
    a = sk.verify_tree(target, tokens, parents, draft, seed=seeds, method=method, backend="triton")
    b = sk.verify_tree(target, tokens, parents, draft, seed=seeds, method=method, backend="torch")
    _same(a, b, TREE_FIELDS)
    t4, x4, d4 = make_problem(6, 3, 64, device=device, seed=5)
    t4, x4, d4 = t4.reshape(3, 2, 4, 64), x4.reshape(3, 2, 3), d4.reshape(3, 2, 3, 64)
    a = sk.verify_multi(t4, x4, d4, seed=seeds, method=method, backend="triton")
    b = sk.verify_multi(t4, x4, d4, seed=seeds, method=method, backend="torch")
    _same(a, b, TREE_FIELDS)


def test_bad_backend_names():
    target, tokens, draft = make_problem(2, 2, 20)
    with pytest.raises(ValueError, match="backend must be one of"):
        sk.verify(target, tokens, draft, backend="cudnn")
    with pytest.raises(TypeError, match="backend must be a str"):
        sk.verify(target, tokens, draft, backend=None)
    t, x, p, d = make_tree_problem(1, 3, 20)
    with pytest.raises(ValueError, match="backend must be one of"):
        sk.verify_tree(t, x, p, d, backend="Triton")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_cuda_backend_without_gpu_says_how_to_build():
    target, tokens, draft = make_problem(2, 2, 20)
    with pytest.raises(RuntimeError, match="SPECDEC_BUILD_CUDA=1"):
        sk.verify(target, tokens, draft, backend="cuda")


@pytest.mark.skipif(HAS_CUDA, reason="checks the no-GPU error")
def test_cuda_backend_for_trees_without_gpu_says_how_to_build():
    t, x, p, d = make_tree_problem(1, 3, 20)
    with pytest.raises(RuntimeError, match="SPECDEC_BUILD_CUDA=1"):
        sk.verify_tree(t, x, p, d, backend="cuda")
    t4, x4, d4 = make_problem(2, 2, 20)
    with pytest.raises(RuntimeError, match="SPECDEC_BUILD_CUDA=1"):
        sk.verify_multi(t4[None], x4[None], d4[None], backend="cuda")


def test_auto_on_cpu_is_triton():
    calls = []
    chosen = _dispatch.resolve("auto", torch.device("cpu"), ("k",), {"triton": lambda: calls.append(1), "cuda": None})
    assert chosen == "triton" and not calls  # nothing measured on CPU
    assert _dispatch.resolve("torch", torch.device("cpu"), ("k",), {"triton": None}) == "torch"


def test_shape_classes_bucket_sizes():
    t1, x1, d1 = make_problem(5, 3, 1000)
    t2, x2, d2 = make_problem(7, 3, 900)
    t3, x3, d3 = make_problem(9, 3, 1000)

    def key(t, x, d):
        return _dispatch.chain_shape_class(check_verify_args(t, x, d, None, 1.0, 0, 1.0, None, 1))

    assert key(t1, x1, d1) == key(t2, x2, d2)  # B 5 and 7 -> 8, V 1000 and 900 -> 1024
    assert key(t1, x1, d1) != key(t3, x3, d3)  # B 9 -> 16


# ------------------------------------------------------------------------------------------
# torch.library


def _op_args(device, per_request=True, flat=False):
    B, G, V = 3, 2, 16
    target, tokens, draft = make_problem(B, G, V, device=device, seed=1)
    args = check_verify_args(
        target,
        tokens,
        draft,
        None,
        torch.full((B,), 0.8, device=device) if per_request else 0.8,
        0,
        torch.full((B,), 0.9, device=device) if per_request else 1.0,
        None,
        torch.arange(B, device=device) if per_request else 7,
    )
    tensors, scalars, seed_t, seed = args.sampling.op_args()
    if not flat:
        return (target, tokens, draft, 1, tensors, scalars, seed_t, seed, None, None, 0, "triton")
    # the flattened layout of the same batch: every request drafted G tokens
    cu = torch.arange(0, (B + 1) * G, G, device=device)
    n = torch.full((B,), G, device=device)
    return (
        target.reshape(-1, V),
        tokens.reshape(-1),
        draft.reshape(-1, V),
        1,
        tensors,
        scalars,
        seed_t,
        seed,
        n,
        cu,
        G,
        "triton",
    )


@pytest.mark.parametrize("per_request,flat", [(True, False), (False, False), (True, True)])
def test_verify_chain_op_passes_opcheck(per_request, flat, device):
    torch.library.opcheck(
        torch.ops.specdec.verify_chain.default,
        _op_args(device, per_request, flat),
        test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"),
    )


def test_verify_tree_op_passes_opcheck(device):
    t, x, p, d = make_tree_problem(2, 4, 16, device=device, seed=3)
    args = (
        t[:, None],
        x[:, None],
        p,
        d[:, None],
        1,
        [None, None, None],
        [0.9, 0.0, 1.0],
        torch.arange(2, device=device),
        0,
        None,
        "rrs",
        4,
        "triton",
    )
    torch.library.opcheck(torch.ops.specdec.verify_tree.default, args, test_utils=("test_schema", "test_faketensor"))


def test_verify_inside_torch_compile(device):
    """dynamo traces sk.verify into one custom-op node (fake impl for shapes), no graph break."""
    B, G, V = 4, 3, 64
    target, tokens, draft = make_problem(B, G, V, device=device, seed=6)
    seeds = torch.arange(B, device=device) * 7
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.5], device=device)

    def step(logits, toks, dl, seed):
        out = sk.verify(logits * 1.0, toks, dl, temperature=temperature, top_p=0.95, seed=seed, validate=False)
        return out.tokens + 0, out.num_accepted, out.nonfinite

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    got = compiled(target, tokens, draft, seeds)
    want = sk.verify(target, tokens, draft, temperature=temperature, top_p=0.95, seed=seeds)
    assert (
        torch.equal(got[0], want.tokens)
        and torch.equal(got[1], want.num_accepted)
        and torch.equal(got[2], want.nonfinite)
    )


def test_verify_tree_inside_torch_compile(device):
    t, x, p, d = make_tree_problem(2, 5, 32, device=device, seed=8)
    seeds = torch.arange(2, device=device)

    def step(t, x, p, d, s):
        out = sk.verify_tree(t, x, p, d, seed=s, max_depth=5, validate=False, method="kseq")
        return out.tokens, out.accepted_nodes

    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(t, x, p, d, seeds)
    want = sk.verify_tree(t, x, p, d, seed=seeds, max_depth=5, validate=False, method="kseq")
    assert torch.equal(got[0], want.tokens) and torch.equal(got[1], want.accepted_nodes)


# ------------------------------------------------------------------------------------------
# GPU


def _cuda_ready():
    from specdec_kernels.ops import csrc

    try:
        csrc.load_cuda_extension()
    except RuntimeError as exc:
        pytest.skip(f"CUDA extension unavailable: {str(exc)[:300]}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["greedy", "logits", "probs", "ngram", "filtered"])
@pytest.mark.parametrize("B, G, V", [(6, 4, 1000), (1, 5, 128256), (64, 3, 32000)])
def test_cuda_backend_matches_triton_and_reference(dtype, mode, B, G, V):
    _cuda_ready()
    from specdec_kernels.reference import verify_reference

    target, tokens, draft = make_problem(B, G, V, dtype=dtype, device="cuda", seed=B + V)
    kw = {
        "greedy": {"draft_logits": draft, "temperature": 0.0},
        "logits": {"draft_logits": draft},
        "probs": {"draft_probs": torch.softmax(draft.float(), -1)},
        "ngram": {},
        "filtered": {"draft_logits": draft, "top_k": 50, "top_p": torch.full((B,), 0.9, device="cuda")},
    }[mode]
    seeds = torch.arange(B, device="cuda") * 31 + 5
    cuda_out = sk.verify(target, tokens, **kw, seed=seeds, backend="cuda")
    _same(cuda_out, sk.verify(target, tokens, **kw, seed=seeds, backend="triton"))
    if B * (G + 1) * V <= 2_000_000:
        _same(cuda_out, verify_reference(target, tokens, **kw, seed=seeds))
    for chunks in (1, 3, 16):
        with _dispatch.launch_overrides(num_chunks=chunks):
            _same(sk.verify(target, tokens, **kw, seed=seeds, backend="cuda"), cuda_out)
    _same(sk.verify(target, tokens, **kw, seed=seeds, backend="auto"), cuda_out)


@pytest.mark.gpu
@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("mode", ["greedy", "logits", "probs", "onehot"])
@pytest.mark.parametrize("B, N, V", [(4, 8, 1000), (2, 16, 32000)])
def test_cuda_tree_backend_matches_triton_and_reference(method, mode, B, N, V):
    _cuda_ready()
    target, tokens, parents, draft = make_tree_problem(
        B, N, V, device="cuda", seed=N + V, without_replacement=method == "rrs_wor"
    )
    kw = {
        "greedy": {"draft_logits": draft, "temperature": 0.0},
        "logits": {"draft_logits": draft, "top_p": 0.95},
        "probs": {"draft_probs": torch.softmax(draft.float(), -1)},
        "onehot": {},
    }[mode]
    kw.update(seed=torch.arange(B, device="cuda") * 3 + 1, method=method)
    out = sk.verify_tree(target, tokens, parents, **kw, backend="cuda")
    _same(out, sk.verify_tree(target, tokens, parents, **kw, backend="triton"), TREE_FIELDS)
    _same(out, sk.verify_tree(target, tokens, parents, **kw, backend="torch"), TREE_FIELDS)
    t4, x4, d4 = make_problem(B * 2, 3, V, device="cuda", seed=V)
    t4, x4, d4 = t4.reshape(B, 2, 4, V), x4.reshape(B, 2, 3), d4.reshape(B, 2, 3, V)
    mkw = dict(draft_logits=d4, seed=kw["seed"], method="rrs" if method == "rrs_wor" else method)
    _same(sk.verify_multi(t4, x4, **mkw, backend="cuda"), sk.verify_multi(t4, x4, **mkw, backend="triton"), TREE_FIELDS)


@pytest.mark.gpu
def test_cuda_backend_graph_capture_replays_exactly():
    _cuda_ready()
    B, G, V = 8, 4, 32000
    target, tokens, draft = make_problem(B, G, V, dtype=torch.bfloat16, device="cuda")
    seeds = torch.arange(B, device="cuda", dtype=torch.int64)
    kw = dict(temperature=torch.full((B,), 0.8, device="cuda"), backend="cuda", validate=False)
    eager = sk.verify(target, tokens, draft, seed=seeds, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sk.verify(target, tokens, draft, seed=seeds, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tokens, eager.tokens)
    seeds += 1000
    graph.replay()
    assert torch.equal(captured.tokens, sk.verify(target, tokens, draft, seed=seeds, **kw).tokens)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_torch_compile_reduce_overhead(backend):
    if backend == "cuda":
        _cuda_ready()
    B, G, V = 4, 3, 4096
    target, tokens, draft = make_problem(B, G, V, device="cuda", seed=3)
    seeds = torch.arange(B, device="cuda")

    def step(t, x, d, s):
        out = sk.verify(t, x, d, temperature=0.9, seed=s, validate=False, backend=backend)
        return out.tokens, out.num_accepted

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    for _ in range(3):
        got = compiled(target, tokens, draft, seeds)
    want = sk.verify(target, tokens, draft, temperature=0.9, seed=seeds, backend=backend)
    assert torch.equal(got[0], want.tokens)
