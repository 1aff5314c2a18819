"""Every Triton launch re-run with its programs in reversed and in shuffled order: same outputs.

On a GPU the programs of one launch run in no fixed order (and concurrently); the interpreter runs
them one after another in row-major order. A kernel whose program reads what another program of
the *same* launch writes (a race on a GPU) gives, in the interpreter, the answer of that one order.
Here the interpreter's grid walk is permuted (reversed, and a seeded shuffle per launch), so such a
dependence changes the outputs. Each op runs under the interpreter's own plan and under
``plan_as_gpu`` (the H100's plan: vocabulary chunks, split reductions, many small programs), where
the multi-program merges are exercised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import random

import pytest
import torch
import triton
import triton.language as tl

import specdec_kernels as sk
from specdec_kernels._interpreter import plan_as_gpu

from ._inputs import make_problem
from ._trees import make_tree_problem, tree_parents

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="permutes the Triton interpreter's grid walk")

ORDERS = ["reversed", "shuffled"]
SHUFFLE_SEED = 20240613  # any fixed value: a failure must reproduce


@contextlib.contextmanager
def program_order(order: str):
    """Run every interpreted launch's programs in `order` ("in_order", "reversed", "shuffled");
    yields a list of the grids launched (to check that multi-program launches happened)."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    set_dim, set_idx = builder.set_grid_dim, builder.set_grid_idx
    state: dict = {}
    grids: list[tuple[int, int, int]] = []
    rng = random.Random(SHUFFLE_SEED)

    def grid_dim(nx, ny, nz):
        ids = list(itertools.product(range(nx), range(ny), range(nz)))
        if order == "reversed":
            ids.reverse()
        elif order == "shuffled":
            rng.shuffle(ids)
        state["ids"], state["dims"] = ids, (nx, ny, nz)
        grids.append((nx, ny, nz))
        set_dim(nx, ny, nz)

    def grid_idx(x, y, z):
        # the interpreter walks x, y, z in row-major order: its k-th program runs as ids[k]
        _, ny, nz = state["dims"]
        set_idx(*state["ids"][(x * ny + y) * nz + z])

    builder.set_grid_dim, builder.set_grid_idx = grid_dim, grid_idx
    try:
        yield grids
    finally:
        del builder.set_grid_dim, builder.set_grid_idx  # the class's methods again


def _outputs(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    fields = (getattr(result, f.name) for f in dataclasses.fields(result))
    return [t for t in fields if t is not None]  # the logprob fields are None unless asked for


def _check_orders(call, gpu_plan: bool):
    """call() under every program order: bitwise-identical outputs; under the GPU's plan some
    launch must have more than one program (else the check proves nothing)."""
    results = {}
    for order in ["in_order", *ORDERS]:
        plan = plan_as_gpu(132) if gpu_plan else contextlib.nullcontext()
        with plan, program_order(order) as grids:
            results[order] = [t.clone() for t in _outputs(call())]
    assert grids, "no Triton launch ran"
    if gpu_plan:
        assert max(x * y * z for x, y, z in grids) > 1, grids
    for order in ORDERS:
        for got, want in zip(results[order], results["in_order"], strict=True):
            assert torch.equal(got, want), f"{order}: {got} != {want}"


@triton.jit
def _ticket_kernel(counter_ptr, out_ptr, NY: tl.constexpr):
    pid = tl.program_id(0) * NY + tl.program_id(1)
    tl.store(out_ptr + pid, tl.atomic_add(counter_ptr, 1))


@pytest.mark.parametrize("order", ["in_order", *ORDERS])
def test_the_fixture_permutes_the_programs(order):
    """The order programs take a ticket in is the order the fixture promised (and every program runs once)."""
    nx, ny = 3, 5
    counter, out = torch.zeros(1, dtype=torch.int32), torch.full((nx * ny,), -1, dtype=torch.int32)
    with program_order(order) as grids:
        _ticket_kernel[(nx, ny)](counter, out, NY=ny)
    assert grids == [(nx, ny, 1)]
    ran = torch.argsort(out).tolist()  # program ids in the order they ran
    assert sorted(ran) == list(range(nx * ny))
    if order == "in_order":
        assert ran == list(range(nx * ny))
    elif order == "reversed":
        assert ran == list(range(nx * ny))[::-1]
    else:
        assert ran != list(range(nx * ny)) and ran != list(range(nx * ny))[::-1]


def _filters(B, device="cpu"):
    return dict(
        temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 0.9][:B]),
        top_k=torch.tensor([0, 5, 20, 0, 3][:B]),
        top_p=torch.tensor([0.9, 1.0, 0.8, 1.0, 0.95][:B]),
    )


# Every case under the GPU's plan (many programs per reduction: where a race would show); the
# interpreter's plan (fewer, larger programs) for one case per op, to keep CI's slow stage short.
# (Each case runs three orders; the slow stage of CI is the budget.) Every draft mode ragged, the padded
# layout once; every tree method with draft logits, the other draft kinds once each.
_MODES = ["greedy", "logits", "probs", "ngram", "target_probs"]
_VERIFY_CASES = [(m, "ragged", True) for m in _MODES] + [("logits", "padded", True)]
_VERIFY_CASES += [("logits", "ragged", False), ("probs", "padded", False)]
_TREE_CASES = [(meth, "logits", True) for meth in ["kseq", "rrs", "rrs_wor"]]
_TREE_CASES += [("rrs", "probs", True), ("kseq", "onehot", True), ("rrs_wor", "onehot", True)]
_TREE_CASES += [("kseq", "logits", False), ("rrs_wor", "probs", False)]


@pytest.mark.slow
@pytest.mark.parametrize("mode, layout, gpu_plan", _VERIFY_CASES)
def test_verify(mode, layout, gpu_plan):
    B, G, V = 4, 3, 1100  # V of five 256-entry blocks: the GPU plan splits it into chunks
    target, tokens, draft = make_problem(B, G, V, seed=3)
    kw: dict = dict(_filters(B), seed=torch.arange(B) * 7 + 1, backend="triton")
    if mode == "greedy":
        kw.update(draft_logits=draft, temperature=0.0)
    elif mode == "logits":
        kw.update(draft_logits=draft)
    elif mode == "probs":
        kw.update(draft_probs=torch.softmax(draft, -1))
    elif mode == "target_probs":
        kw.update(draft_probs=torch.softmax(draft, -1), temperature=1.0, top_k=0, top_p=1.0)
        kw["target_probs"], target = torch.softmax(target, -1), None
    if layout == "ragged":
        kw["num_draft_tokens"] = torch.tensor([3, 0, 1, 2])
    _check_orders(lambda: sk.verify(target, tokens, **kw), gpu_plan)


@pytest.mark.slow
@pytest.mark.parametrize("method, mode, gpu_plan", _TREE_CASES)
def test_verify_tree(method, mode, gpu_plan):
    B, N, V = 4, 8, 1100
    num_nodes = torch.tensor([8, 0, 5, 1])
    target, tokens, parents, draft = make_tree_problem(
        B, N, V, seed=9, without_replacement=method == "rrs_wor", num_nodes=num_nodes
    )
    kw: dict = dict(_filters(B), method=method, num_nodes=num_nodes, seed=torch.arange(B) + 11, backend="triton")
    if mode == "logits":
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    _check_orders(lambda: sk.verify_tree(target, tokens, parents, **kw), gpu_plan)


@pytest.mark.slow
@pytest.mark.parametrize("method, gpu_plan", [("kseq", True), ("rrs", True), ("rrs_wor", True), ("rrs", False)])
def test_verify_multi(method, gpu_plan):
    B, K, G, V = 3, 2, 3, 1100
    target, tokens, draft = make_problem(B * K, G, V, seed=5)
    target, tokens, draft = target.reshape(B, K, G + 1, V), tokens.reshape(B, K, G), draft.reshape(B, K, G, V)
    # chains sharing a first draft merge in the tree (without replacement siblings must differ)
    tokens[:, 1, 0] = (tokens[:, 0, 0] + (method == "rrs_wor")) % V
    kw: dict = dict(_filters(B), method=method, draft_logits=draft, seed=torch.arange(B) + 3, backend="triton")
    _check_orders(lambda: sk.verify_multi(target, tokens, **kw), gpu_plan)


@pytest.mark.slow
@pytest.mark.parametrize("gpu_plan", [False, True], ids=["interpreter_plan", "gpu_plan"])
@pytest.mark.parametrize("splits", [None, 3])
def test_tree_attention(splits, gpu_plan):
    gen = torch.Generator().manual_seed(1)
    B, Hq, Hkv, N, D = 2, 8, 2, 6, 64
    prefix = torch.tensor([1000, 37])  # the GPU plan splits the long prefix
    S = int((prefix + N).max()) + 3
    q = torch.randn(B, Hq, N, D, generator=gen)
    k = torch.randn(B, Hkv, S, D, generator=gen)
    v = torch.randn(B, Hkv, S, D, generator=gen)
    parents = torch.stack([tree_parents("random", N, gen) for _ in range(B)])
    num_nodes = torch.tensor([6, 4])
    kw = {} if splits is None else {"_num_splits": splits}
    _check_orders(lambda: sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes, **kw), gpu_plan)


@pytest.mark.slow
@pytest.mark.parametrize("gpu_plan", [False, True], ids=["interpreter_plan", "gpu_plan"])
def test_tree_metadata(gpu_plan):
    gen = torch.Generator().manual_seed(2)
    B, N = 40, 12  # 16 requests per program in the GPU's plan: three programs
    parents = torch.stack([tree_parents("random", N, gen) for _ in range(B)])
    num_nodes = torch.randint(0, N + 1, (B,), generator=gen)
    _check_orders(lambda: sk.tree_metadata(parents, num_nodes, backend="triton"), gpu_plan)


@triton.jit
def _racy_prefix_kernel(x_ptr):
    """Program i reads what program i - 1 of the same launch writes: correct only in order."""
    i = tl.program_id(0)
    previous = tl.load(x_ptr + i - 1, mask=i > 0, other=0)
    tl.store(x_ptr + i, previous + 1)


def test_a_racy_kernel_is_caught():
    """The check fails for a kernel with a dependence between the programs of one launch."""

    def call():
        x = torch.zeros(6, dtype=torch.int32)
        _racy_prefix_kernel[(6,)](x)
        return x

    with pytest.raises(AssertionError, match="reversed"):
        _check_orders(call, gpu_plan=False)
