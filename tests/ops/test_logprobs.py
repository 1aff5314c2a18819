"""return_logprobs=True / num_logprobs=n of sk.verify, sk.verify_tree and sk.verify_multi: equal
to the reference (reference/logprobs.py: log_softmax of the processed rows at the emitted ids),
after every backend, in every layout; the top-n equal to torch.topk of the processed rows."""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._tree_args import check_tree_args
from specdec_kernels._validation import check_verify_call
from specdec_kernels.ops.logprobs import top_n
from specdec_kernels.reference.logprobs import chain_rows, logprobs_reference, processed_log_probs, tree_rows

from ._inputs import flattened_problem, make_problem
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip

TOL = 1e-5


def _expected_chain(target, drafts, draft, n, **kw):
    args = check_verify_call(
        target, drafts, draft, None, kw.get("temperature", 1.0), kw.get("top_k", 0), kw.get("top_p", 1.0),
        kw.get("num_draft_tokens"), 0, cu_num_draft_tokens=kw.get("cu_num_draft_tokens"),
        max_num_draft_tokens=kw.get("max_num_draft_tokens"), top_p_ties=kw.get("top_p_ties", "keep"),
    )  # fmt: skip
    return args


def _check(out, ref, n):
    assert out.logprobs.dtype == torch.float32 and out.logprobs.shape == out.tokens.shape
    assert torch.equal(torch.isnan(out.logprobs), out.tokens < 0) or bool(out.nonfinite.any())
    torch.testing.assert_close(out.logprobs, ref["logprobs"], atol=TOL, rtol=0, equal_nan=True)
    if n == 0:
        assert out.top_logprob_ids is None and out.top_logprobs is None
        return
    assert out.top_logprob_ids.shape == (*out.tokens.shape, n) and out.top_logprob_ids.dtype == torch.int64
    assert torch.equal(out.top_logprob_ids, ref["top_logprob_ids"])
    torch.testing.assert_close(out.top_logprobs, ref["top_logprobs"], atol=TOL, rtol=0, equal_nan=True)


def _check_chain(out, target, drafts, draft, n, **kw):
    args = _expected_chain(target, drafts, draft, n, **kw)
    rows = chain_rows(args, out.tokens)
    _check(out, logprobs_reference(args, args.target_logits, out.tokens, rows, n), n)
    return args, rows


def _check_tree(out, args, n):
    rows = tree_rows(args, out.tokens, out.num_accepted)
    _check(out, logprobs_reference(args, args.target, out.tokens, rows, n), n)


# ---- chain: settings on the vectorized backend, then every backend


SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=0.8, top_p=0.7),
    dict(temperature=1.3, top_k=7, top_p=0.8),
    dict(temperature=0.0, top_k=4, top_p=0.9),  # greedy: scored at temperature 1 with the filters
    dict(temperature=torch.tensor([0.0, 0.9, 0.5, 0.0]), top_k=torch.tensor([0, 3, 10, 2]), top_p=0.85),
]


@pytest.mark.parametrize("setting", SETTINGS, ids=range(len(SETTINGS)))
@pytest.mark.parametrize("n", [0, 3])
def test_chain_settings(setting, n):
    target, drafts, draft = make_problem(4, 4, 48, seed=3)
    kw = dict(setting, num_draft_tokens=torch.tensor([4, 0, 2, 3]))
    out = sk.verify(target, drafts, draft, seed=7, backend="vectorized", return_logprobs=True, num_logprobs=n, **kw)
    _check_chain(out, target, drafts, draft, n, **kw)


@pytest.mark.parametrize("temperature", [torch.tensor([1.0, 0.0, 0.6]), 0.0], ids=["mixed", "greedy"])
@pytest.mark.parametrize("ties", ["keep", "by_index"])
def test_top_p_tie_rules(ties, temperature):
    """Integer logits: tie groups straddle the top-p boundary, so the rules keep different sets
    (also for greedy requests, whose logprobs apply top-p at temperature 1)."""
    gen = torch.Generator().manual_seed(1)
    target = torch.randint(-2, 3, (3, 3, 40), generator=gen).float()
    drafts = torch.randint(0, 40, (3, 2), generator=gen)
    kw = dict(temperature=temperature, top_p=0.5, top_p_ties=ties)
    out = sk.verify(target, drafts, seed=2, backend="vectorized", return_logprobs=True, num_logprobs=20, **kw)
    _check_chain(out, target, drafts, None, 20, **kw)


def test_matches_plain_log_softmax():
    """Temperature T, no filters: log_softmax(logits / T) at the emitted ids, independently of the reference."""
    target, drafts, draft = make_problem(3, 3, 32, seed=4)
    out = sk.verify(target, drafts, draft, temperature=0.6, seed=1, backend="vectorized", return_logprobs=True)
    want = torch.log_softmax(target.double() / 0.6, -1).gather(2, out.tokens.clamp(min=0)[..., None])[..., 0]
    emitted = out.tokens >= 0
    torch.testing.assert_close(out.logprobs[emitted], want[emitted].float(), atol=TOL, rtol=0)
    assert torch.isnan(out.logprobs[~emitted]).all()


def test_top_n_is_topk_of_processed_rows():
    target, drafts, draft = make_problem(3, 3, 64, seed=5)
    kw = dict(temperature=0.9, top_k=12, top_p=0.95)
    out = sk.verify(target, drafts, draft, seed=3, backend="vectorized", return_logprobs=True, num_logprobs=5, **kw)
    for b, d in (out.tokens >= 0).nonzero().tolist():
        lp = processed_log_probs(target[b, d], 0.9, 12, 0.95)
        values, ids = torch.topk(lp, 5)
        assert torch.equal(out.top_logprob_ids[b, d], ids)
        torch.testing.assert_close(out.top_logprobs[b, d], values.float(), atol=TOL, rtol=0)


BACKENDS = ["triton", "cpu", "vectorized", "torch", "auto"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_chain_every_backend(backend):
    if backend == "cpu":
        cpu_core_or_skip()
    target, drafts, draft = make_problem(3, 3, 40, seed=6)
    kw = dict(temperature=torch.tensor([0.8, 0.0, 1.2]), top_k=6, top_p=0.9, num_draft_tokens=torch.tensor([3, 1, 2]))
    out = sk.verify(target, drafts, draft, seed=5, backend=backend, return_logprobs=True, num_logprobs=4, **kw)
    plain = sk.verify(target, drafts, draft, seed=5, backend=backend, **kw)
    assert torch.equal(out.tokens, plain.tokens) and plain.logprobs is None and plain.top_logprobs is None
    _check_chain(out, target, drafts, draft, 4, **kw)


@pytest.mark.parametrize("backend", ["triton", "vectorized", "torch"])
def test_flattened_layout(backend):
    cu, rows, ids, draft = flattened_problem(40, seed=8)
    kw = dict(temperature=0.7, top_k=9, cu_num_draft_tokens=cu, max_num_draft_tokens=4)
    out = sk.verify(rows, ids, draft, seed=4, backend=backend, return_logprobs=True, num_logprobs=2, **kw)
    assert out.tokens.shape == (3, 5)
    _check_chain(out, rows, ids, draft, 2, **kw)


@pytest.mark.parametrize("backend", ["triton", "vectorized", "torch"])
def test_block_method(backend):
    target, drafts, draft = make_problem(4, 3, 32, seed=9, closeness=0.2)
    kw = dict(temperature=0.9, top_p=0.9)
    out = sk.verify(
        target, drafts, draft, seed=1, method="block", backend=backend, return_logprobs=True, num_logprobs=2, **kw
    )
    _check_chain(out, target, drafts, draft, 2, **kw)


def test_grammar_mask_matches_the_reference():
    """With token_bitmask= a disallowed token is -inf before processing: the reference's allowed mask."""
    from specdec_kernels._bitmask import pack

    target, drafts, draft = make_problem(3, 2, 30, seed=10)
    gen = torch.Generator().manual_seed(0)
    allowed = torch.rand(target.shape, generator=gen) < 0.6
    kw = dict(temperature=0.8, top_k=8)
    got = sk.verify(target, drafts, draft, seed=2, backend="vectorized", token_bitmask=pack(allowed),
                    return_logprobs=True, num_logprobs=3, **kw)  # fmt: skip
    args = _expected_chain(target, drafts, draft, 3, **kw)
    ref = logprobs_reference(args, args.target_logits, got.tokens, chain_rows(args, got.tokens), 3, allowed=allowed)
    _check(got, ref, 3)
    assert bool((got.top_logprob_ids == -1).any() | allowed.all())  # masked rows hold fewer entries


@pytest.mark.parametrize("backend", ["vectorized", "cpu"])
def test_token_bitmask_scores_the_masked_rows(backend):
    """With token_bitmask= the logprobs are those of the masked, processed rows: the same numbers as a
    call on rows masked by hand (-inf at the disallowed tokens) without the mask."""
    if backend == "cpu":
        cpu_core_or_skip()
    from specdec_kernels._bitmask import pack

    target, drafts, draft = make_problem(3, 3, 70, seed=13)
    gen = torch.Generator().manual_seed(1)
    allowed = torch.rand(target.shape, generator=gen) < 0.5
    allowed.scatter_(2, torch.nn.functional.pad(drafts, (0, 1))[..., None], True)  # the drafts stay allowed
    kw = dict(temperature=0.8, top_k=20, seed=4, backend=backend, return_logprobs=True, num_logprobs=3)
    got = sk.verify(target, drafts, draft, token_bitmask=pack(allowed), **kw)
    by_hand = sk.verify(target.masked_fill(~allowed, float("-inf")), drafts,
                        draft.masked_fill(~allowed[:, :-1], float("-inf")), **kw)  # fmt: skip
    assert torch.equal(got.tokens, by_hand.tokens)
    torch.testing.assert_close(got.logprobs, by_hand.logprobs, equal_nan=True)
    assert torch.equal(got.top_logprob_ids, by_hand.top_logprob_ids)
    assert not torch.equal(got.logprobs.nan_to_num(), sk.verify(target, drafts, draft, **kw).logprobs.nan_to_num())


def test_nonfinite_row_is_nan():
    target, drafts, draft = make_problem(2, 2, 16, seed=11)
    target[0, 0] = float("nan")  # nothing finite where request 0 emits
    out = sk.verify(target, drafts, draft, temperature=0.0, backend="vectorized", return_logprobs=True, num_logprobs=2)
    assert bool(out.nonfinite[0]) and int(out.num_accepted[0]) == 0
    assert torch.isnan(out.logprobs[0]).all() and (out.top_logprob_ids[0] == -1).all()
    _check_chain(out, target, drafts, draft, 2, temperature=0.0)


def test_out_dtype_keeps_logprobs():
    target, drafts, draft = make_problem(2, 2, 16, seed=12)
    out = sk.verify(target, drafts, draft, seed=1, backend="vectorized", out_dtype=torch.int32, return_logprobs=True)
    assert out.tokens.dtype == torch.int32 and out.logprobs is not None


# ---- trees and multi-draft


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("backend", ["vectorized", "torch", "triton"])
def test_tree(method, backend):
    """V = 6: sibling duplicates are common, so the walk's row (the first node spelling the prefix)
    and the accepted node's row differ."""
    wor = method == "rrs_wor"
    target, tokens, parents, draft = make_tree_problem(4, 6, 6, seed=13, without_replacement=wor)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 1.1, 0.7]), top_k=4, top_p=0.95)
    out = sk.verify_tree(
        target, tokens, parents, draft, seed=3, method=method, backend=backend, return_logprobs=True, num_logprobs=3,
        **kw,
    )  # fmt: skip
    args = check_tree_args(target, tokens, parents, draft, None, *kw.values(), 3, None, method, None)
    _check_tree(out, args, 3)
    if method != "rrs_wor":  # this seed reaches a duplicate sibling: a row other than the accepted node's
        rows = tree_rows(args, out.tokens, out.num_accepted)
        nodes = out.accepted_nodes.tolist()
        assert any(r[2] - 1 != nodes[b][d - 1] for b, path in enumerate(rows) for d, r in enumerate(path) if d)


@pytest.mark.parametrize("backend", ["vectorized", "cpu", "triton"])
def test_multi(backend):
    if backend == "cpu":
        cpu_core_or_skip()
    gen = torch.Generator().manual_seed(14)
    B, K, G, V = 3, 3, 3, 5
    target = torch.randn(B, K, G + 1, V, generator=gen)
    drafts = torch.randint(0, V, (B, K, G), generator=gen)
    draft = torch.randn(B, K, G, V, generator=gen)
    out = sk.verify_multi(
        target, drafts, draft, temperature=1.0, seed=5, backend=backend, return_logprobs=True, num_logprobs=2
    )
    args = check_tree_args(target, drafts, None, draft, None, 1.0, 0, 1.0, 5, None, "kseq", None, multi=True)
    _check_tree(out, args, 2)


@pytest.mark.parametrize("backend", ["torch", "triton", "vectorized", "cpu"])
def test_tree_ragged_nodes(backend):
    """Ragged trees whose padding nodes (past num_nodes) hold arbitrary parents, as engines leave them."""
    if backend == "cpu":
        cpu_core_or_skip()
    num_nodes = torch.tensor([6, 0, 3])
    target, tokens, parents, draft = make_tree_problem(3, 6, 8, seed=15, num_nodes=num_nodes)
    parents[1, :] = torch.tensor([5, 7, -9, 2, 4, 100])  # request 1 has no nodes: every parent is padding
    parents[2, 3:] = torch.tensor([3, 99, -5])
    out = sk.verify_tree(
        target, tokens, parents, draft, num_nodes=num_nodes, temperature=0.8, seed=2, backend=backend,
        return_logprobs=True, num_logprobs=1,
    )  # fmt: skip
    args = check_tree_args(target, tokens, parents, draft, None, 0.8, 0, 1.0, 2, num_nodes, "kseq", None)
    _check_tree(out, args, 1)


# ---- zero sizes


def test_zero_sizes():
    V = 8
    out = sk.verify(torch.randn(0, 3, V), torch.zeros(0, 2, dtype=torch.int64), return_logprobs=True, num_logprobs=2)
    assert out.logprobs.shape == (0, 3) and out.top_logprob_ids.shape == (0, 3, 2)
    target = torch.randn(2, 1, V)
    out = sk.verify(target, torch.zeros(2, 0, dtype=torch.int64), seed=1, backend="vectorized", return_logprobs=True)
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(target[:, 0], -1).gather(1, out.tokens)[:, 0])
    out = sk.verify_tree(
        torch.randn(0, 3, V), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2, dtype=torch.int64),
        return_logprobs=True, num_logprobs=1,
    )  # fmt: skip
    assert out.logprobs.shape == out.tokens.shape
    target = torch.randn(2, 2, 1, V)
    out = sk.verify_multi(target, torch.zeros(2, 2, 0, dtype=torch.int64), seed=1, backend="vectorized",
                          return_logprobs=True)  # fmt: skip
    torch.testing.assert_close(out.logprobs[:, 0], torch.log_softmax(target[:, 0, 0], -1).gather(1, out.tokens)[:, 0])


# ---- top-n selection and bad options


def test_top_n_ties_by_lower_index():
    x = torch.tensor([[1.0, 3.0, 3.0, 3.0, 2.0, 3.0], [float("-inf")] * 5 + [0.0]])
    vals, ids = top_n(x, 3)
    assert ids[0].tolist() == [1, 2, 3] and vals[0].tolist() == [3.0, 3.0, 3.0]
    assert ids[1, 0] == 5
    vals, ids = top_n(x, 8)  # wider than V: padded
    assert vals.shape == (2, 8) and bool((vals[:, 6:] == float("-inf")).all())


def test_top_n_equals_stable_sort():
    """Random rows with many ties and -inf entries: top_n is the head of a stable descending sort."""
    gen = torch.Generator().manual_seed(19)
    for _ in range(200):
        V, n = int(torch.randint(1, 30, (1,), generator=gen)), int(torch.randint(1, 21, (1,), generator=gen))
        x = torch.randint(-3, 3, (3, V), generator=gen).float()
        x[torch.rand(3, V, generator=gen) < 0.2] = float("-inf")
        vals, ids = top_n(x, n)
        want_vals, want_ids = torch.sort(x, descending=True, stable=True)
        k = min(n, V)
        finite = want_vals[:, :k] > float("-inf")
        assert torch.equal(vals[:, :k], want_vals[:, :k]) and bool((vals[:, k:] == float("-inf")).all())
        assert torch.equal(ids[:, :k][finite], want_ids[:, :k][finite])


@pytest.mark.parametrize(
    "kw, exc",
    [
        (dict(return_logprobs=True, num_logprobs=-1), ValueError),
        (dict(return_logprobs=True, num_logprobs=21), ValueError),
        (dict(return_logprobs=True, num_logprobs=2.0), TypeError),
        (dict(return_logprobs=True, num_logprobs=True), TypeError),
        (dict(num_logprobs=3), ValueError),
        (dict(return_logprobs=1), TypeError),
    ],
)
@pytest.mark.parametrize("op", ["verify", "verify_tree", "verify_multi"])
def test_bad_options(kw, exc, op):
    target, drafts, draft = make_problem(1, 2, 8)
    name = "return_logprobs" if "num_logprobs" not in kw else "num_logprobs"
    with pytest.raises(exc, match=name):
        if op == "verify":
            sk.verify(target, drafts, draft, **kw)
        elif op == "verify_tree":
            sk.verify_tree(target, drafts, torch.tensor([[-1, 0]]), draft, **kw)
        else:
            sk.verify_multi(target[:, None], drafts[:, None], draft[:, None], **kw)


@pytest.mark.parametrize("op", ["verify", "verify_tree", "verify_multi"])
def test_one_rank_process_group(one_rank_group, op):
    """process_group= with the whole vocabulary on one rank: the unsharded call's logprobs (the
    shard collectives are exercised over 2-4 ranks in test_vocab_parallel.py)."""
    target, drafts, draft = make_problem(3, 3, 40, seed=16)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 0.7]), top_k=torch.tensor([0, 5, 300]), top_p=0.9, seed=4)
    kw.update(return_logprobs=True, num_logprobs=4)
    if op == "verify":
        call = lambda **more: sk.verify(target, drafts, draft, **kw, **more)  # noqa: E731
    elif op == "verify_tree":
        parents = torch.tensor([[-1, 0, 0]] * 3)
        call = lambda **more: sk.verify_tree(target, drafts, parents, draft, **kw, **more)  # noqa: E731
    else:
        call = lambda **more: sk.verify_multi(target[:, None], drafts[:, None], draft[:, None], **kw, **more)  # noqa: E731
    got, want = call(process_group=one_rank_group), call(backend="torch")
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.top_logprob_ids, want.top_logprob_ids)
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=TOL, rtol=0, equal_nan=True)
    torch.testing.assert_close(got.top_logprobs, want.top_logprobs, atol=TOL, rtol=0, equal_nan=True)


@pytest.mark.parametrize("fullgraph", [False, True])
def test_inside_torch_compile(fullgraph):
    """The verification is the custom op in the graph; the post-pass runs eagerly after a graph
    break (compiler.disable), which fullgraph=True refuses by name."""
    target, drafts, draft = make_problem(3, 3, 32, seed=17)
    parents = torch.tensor([[-1, 0, 0]] * 3)
    kw = dict(temperature=0.8, top_k=6, seed=torch.arange(3), validate=False, backend="vectorized")
    kw.update(return_logprobs=True, num_logprobs=2)

    def step(t, x, q):
        chain = sk.verify(t, x, q, **kw)
        tree = sk.verify_tree(t, x, parents, q, max_depth=2, **kw)
        return chain.tokens, chain.logprobs, chain.top_logprob_ids, tree.tokens, tree.logprobs

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)
    if fullgraph:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="chain_logprobs"):
            compiled(target, drafts, draft)
        return
    got = compiled(target, drafts, draft)
    for g, w in zip(got, step(target, drafts, draft), strict=True):
        torch.testing.assert_close(g, w, atol=TOL, rtol=0, equal_nan=True)


def test_one_rank_by_index_greedy_refused(one_rank_group):
    """Greedy logprobs apply top-p (at temperature 1): the by_index rule, which shards lack, raises."""
    target, drafts, draft = make_problem(2, 2, 16, seed=18)
    kw = dict(temperature=0.0, top_p=0.5, top_p_ties="by_index", process_group=one_rank_group)
    assert sk.verify(target, drafts, draft, **kw).logprobs is None  # without logprobs the rule changes nothing
    with pytest.raises(ValueError, match="by_index"):
        sk.verify(target, drafts, draft, **kw, return_logprobs=True)


def test_refused_during_cuda_graph_capture(monkeypatch):
    from specdec_kernels.ops import logprobs

    monkeypatch.setattr(logprobs, "_capturing", lambda device: True)
    target, drafts, draft = make_problem(1, 2, 8)
    with pytest.raises(ValueError, match="CUDA graph"):
        sk.verify(target, drafts, draft, backend="vectorized", return_logprobs=True)
