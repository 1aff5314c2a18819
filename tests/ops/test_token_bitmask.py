"""Grammar token bitmasks (``token_bitmask=``): every backend and layout against the reference.

The reference (backend="torch") applies the mask itself (``reference/sampling.grammar_masked``),
the other backends run on the masked copy of ``_bitmask``: equal tokens check the row mappings
(chain, flattened, tree, multi). Every emitted token must be allowed by the mask of the row it
was emitted from (accepted drafts included); a row whose mask allows nothing is flagged. The masks
are packed by ``_inputs.pack_bitmask``, independently of the package. The statistical test (slow)
is at the end of the file.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _dispatch
from specdec_kernels._validation import check_verify_call
from specdec_kernels.reference.sampling import processed_probs

from ._inputs import make_problem, pack_bitmask
from ._stats import ALPHA, SAMPLED_BACKENDS, backend_device, chi_square_power, chi_square_pvalue
from ._trees import make_tree_problem
from .conftest import cpu_core_or_skip

V = 70  # three words, the last one partial (tokens 64 .. 69)
BACKENDS = ["vectorized", "cpu", "triton"]
PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.9),
    "filters": dict(temperature=0.8, top_k=9, top_p=0.9),
    "per_request": "per_request",
}


def _params(name: str, B: int) -> dict:
    if PARAMS[name] == "per_request":
        cycle = torch.arange(B) % 4
        return dict(
            temperature=torch.tensor([0.0, 0.9, 1.3, 0.6])[cycle],
            top_k=torch.tensor([0, 5, 0, 12])[cycle],
            top_p=torch.tensor([1.0, 0.9, 0.5, 1.0])[cycle],
            seed=torch.arange(B, dtype=torch.int64) * 7 + 3,
        )
    return dict(PARAMS[name], seed=11)


def _run(backend: str, *args, **kwargs):
    if backend == "cpu":
        cpu_core_or_skip()
    return kwargs.pop("op", sk.verify)(*args, backend=backend, **kwargs)


def _random_allowed(lead: tuple, gen: torch.Generator, tokens: torch.Tensor | None = None) -> torch.Tensor:
    """bool [*lead, V]: random masks (about half allowed) with the special rows of the contract:
    one allowing a single token, one allowing only a token of the last partial word, one allowing
    nothing; draft tokens allowed at their rows (so accept paths run) where tokens [*lead[:-1], G]."""
    allowed = torch.rand(*lead, V, generator=gen) < 0.5
    if tokens is not None and tokens.shape[-1] > 0:
        G = tokens.shape[-1]
        allowed[..., :G, :].scatter_(-1, tokens[..., None].clamp(0, V - 1), True)
    flat = allowed.view(-1, V)
    if flat.shape[0] >= 6:
        flat[1] = False
        flat[1, 17] = True  # one allowed token
        flat[3] = False
        flat[3, V - 2] = True  # only a token in the last, partial word
        flat[5] = False  # nothing allowed
    return allowed


def _same(a, b, what: str) -> None:
    for field in ("tokens", "num_accepted", "nonfinite", "accepted_nodes"):
        if hasattr(a, field):
            assert torch.equal(getattr(a, field), getattr(b, field)), f"{what}: {field}\n{a}\n{b}"


def _assert_chain_allowed(out, allowed: torch.Tensor) -> None:
    """tokens[b, i] allowed by mask row i for i <= num_accepted[b], unless flagged (empty row: 0)."""
    for b in range(out.tokens.shape[0]):
        for i in range(int(out.num_accepted[b]) + 1):
            tok = int(out.tokens[b, i])
            assert 0 <= tok < V
            assert bool(allowed[b, i, tok]) or (bool(out.nonfinite[b]) and not bool(allowed[b, i].any())), (b, i, tok)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
@pytest.mark.parametrize("params", list(PARAMS))
def test_chain_backends_equal_reference_and_never_disallowed(backend, mode, params):
    B, G = 8, 3
    target, tokens, draft = make_problem(B, G, V, seed=len(mode) * 10 + len(params))
    allowed = _random_allowed((B, G + 1), torch.Generator().manual_seed(5), tokens)
    mask = pack_bitmask(allowed)
    kw = dict(_params(params, B), token_bitmask=mask, num_draft_tokens=torch.tensor([3, 2, 0, 3, 1, 3, 3, 2]))
    if mode == "logits":
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    want = _run("torch", target, tokens, **kw)
    _assert_chain_allowed(want, allowed)
    assert not bool(want.nonfinite[0])  # rows allowing a single token are no empty rows
    _same(_run(backend, target, tokens, **kw), want, backend)


def test_empty_row_is_flagged_and_emits_token_zero():
    target, tokens, draft = make_problem(3, 2, V, seed=1)
    allowed = torch.ones(3, 3, V, dtype=torch.bool)
    allowed[0, 0] = False  # request 0's first row allows nothing
    allowed[2, 2] = False  # request 2's bonus row allows nothing (drafts all accepted? only then read)
    for temperature in (0.0, 1.0):
        out = sk.verify(target, tokens, draft, temperature=temperature, seed=3, token_bitmask=pack_bitmask(allowed))
        assert int(out.num_accepted[0]) == 0 and int(out.tokens[0, 0]) == 0 and bool(out.nonfinite[0])
        assert not bool(out.nonfinite[1])


def test_greedy_is_argmax_over_allowed_tokens():
    target, tokens, _ = make_problem(4, 2, V, seed=2)
    allowed = _random_allowed((4, 3), torch.Generator().manual_seed(9))
    allowed[:, :, 0] = True  # no empty rows here
    out = sk.verify(target, tokens, temperature=0.0, token_bitmask=pack_bitmask(allowed))
    best = torch.where(allowed, target, torch.tensor(float("-inf"))).argmax(-1)
    for b in range(4):
        n = int(out.num_accepted[b])
        assert torch.equal(out.tokens[b, : n + 1], best[b, : n + 1])


def _flatten(target, tokens, draft, allowed, n):
    B = len(n)
    flat = (
        torch.cat([target[b, : n[b] + 1] for b in range(B)]),
        torch.cat([tokens[b, : n[b]] for b in range(B)]),
        torch.cat([draft[b, : n[b]] for b in range(B)]),
        torch.cat([allowed[b, : n[b] + 1] for b in range(B)]),
    )
    return *flat, torch.tensor([0, *n]).cumsum(0)


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_flattened_layout_equals_padded(backend):
    B, G = 6, 3
    n = [3, 0, 2, 3, 1, 3]
    target, tokens, draft = make_problem(B, G, V, seed=4)
    allowed = _random_allowed((B, G + 1), torch.Generator().manual_seed(6), tokens)
    kw = dict(temperature=torch.tensor([0.9, 0.0, 1.2, 0.7, 1.0, 0.8]), top_k=7, seed=torch.arange(B) + 40)
    want = sk.verify(target, tokens, draft, num_draft_tokens=torch.tensor(n), token_bitmask=pack_bitmask(allowed), **kw)
    f_target, f_tokens, f_draft, f_allowed, cu = _flatten(target, tokens, draft, allowed, n)
    got = _run(
        backend, f_target, f_tokens, f_draft, cu_num_draft_tokens=cu, token_bitmask=pack_bitmask(f_allowed), **kw
    )
    _same(got, want, backend)


def _assert_tree_allowed(out, allowed) -> None:
    """Token d of the path is emitted at row accepted_nodes[d - 1] + 1 (row 0 for d = 0)."""
    for b in range(out.tokens.shape[0]):
        n = int(out.num_accepted[b])
        rows = [0] + [int(out.accepted_nodes[b, d]) + 1 for d in range(n)]
        for d, row in enumerate(rows):
            tok = int(out.tokens[b, d])
            assert bool(allowed[b, row, tok]) or (tok == 0 and not bool(allowed[b, row].any()))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "method, mode", [("kseq", "logits"), ("rrs", "probs"), ("rrs_wor", "logits"), ("kseq", "ngram")]
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_backends_equal_reference(backend, method, mode, temperature):
    B, N = 4, 7
    target, tokens, parents, draft = make_tree_problem(B, N, V, seed=8, without_replacement=method == "rrs_wor")
    allowed = torch.rand(B, N + 1, V, generator=torch.Generator().manual_seed(2)) < 0.5
    for b in range(B):  # node i is a candidate at row parents[i] + 1: allow every other one there
        for i in range(0, N, 2):
            allowed[b, int(parents[b, i]) + 1, int(tokens[b, i])] = True
    allowed[1, 0] = False  # request 1: its root allows nothing
    kw = dict(method=method, temperature=temperature, seed=torch.arange(B) + 5, token_bitmask=pack_bitmask(allowed))
    if mode == "logits":
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    want = _run("torch", target, tokens, parents, op=sk.verify_tree, **kw)
    _assert_tree_allowed(want, allowed)
    assert int(want.tokens[1, 0]) == 0
    assert bool(want.nonfinite[1])  # an empty row is flagged, greedy walks included (as sk.verify)
    got = _run(backend, target, tokens, parents, op=sk.verify_tree, **kw)
    _same(got, want, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["kseq", "rrs"])
def test_multi_backends_equal_reference(backend, method):
    B, K, G = 3, 2, 3
    target, tokens, draft = make_problem(B * K, G, V, seed=12)
    target, tokens, draft = target.view(B, K, G + 1, V), tokens.view(B, K, G), draft.view(B, K, G, V)
    tokens[:, 1, 0] = tokens[:, 0, 0]  # shared prefixes: candidates with multiplicity
    allowed = _random_allowed((B, K, G + 1), torch.Generator().manual_seed(3), tokens)
    kw = dict(method=method, temperature=0.9, top_p=0.95, seed=torch.arange(B) + 1, token_bitmask=pack_bitmask(allowed))
    want = _run("torch", target, tokens, draft, op=sk.verify_multi, **kw)
    _same(_run(backend, target, tokens, draft, op=sk.verify_multi, **kw), want, backend)


def test_strided_masks_are_read_as_given():
    B, G = 4, 2
    target, tokens, draft = make_problem(B, G, V, seed=13)
    mask = pack_bitmask(_random_allowed((B, G + 1), torch.Generator().manual_seed(1), tokens))
    wide = torch.zeros(G + 1, B, 2 * mask.shape[-1], dtype=torch.int32)
    wide[..., ::2] = mask.transpose(0, 1)
    strided = wide.transpose(0, 1)[..., ::2]  # non-contiguous in every dimension
    assert not strided.is_contiguous() and torch.equal(strided, mask)
    for backend in ("torch", "vectorized", "cpu"):
        kw = dict(temperature=0.8, seed=2)
        _same(_run(backend, target, tokens, draft, token_bitmask=strided, **kw),
              _run(backend, target, tokens, draft, token_bitmask=mask, **kw), backend)  # fmt: skip


def test_target_probs_disallowed_have_probability_zero():
    B, G = 5, 2
    target, tokens, draft = make_problem(B, G, V, seed=14)
    probs = torch.softmax(target, -1)
    allowed = _random_allowed((B, G + 1), torch.Generator().manual_seed(4), tokens)
    kw = dict(draft_logits=draft, temperature=1.0, seed=9, token_bitmask=pack_bitmask(allowed))
    got = sk.verify(None, tokens, target_probs=probs, **kw)
    want = sk.verify(torch.log(probs), tokens, backend="torch", **kw)
    _same(got, want, "target_probs")


def test_block_method_masks_like_the_reference():
    B, G = 6, 3
    target, tokens, draft = make_problem(B, G, V, seed=15)
    allowed = _random_allowed((B, G + 1), torch.Generator().manual_seed(8), tokens)
    kw = dict(temperature=0.9, seed=torch.arange(B), token_bitmask=pack_bitmask(allowed), method="block")
    want = sk.verify(target, tokens, draft, backend="torch", **kw)
    _assert_chain_allowed(want, allowed)
    _same(sk.verify(target, tokens, draft, backend="vectorized", **kw), want, "block")
    _same(sk.verify(target, tokens, draft, backend="triton", **kw), want, "block, Triton (native words)")
    cpu_core_or_skip()  # the CPU build reads the words itself (tests/ops/test_cpu_block.py)
    _same(sk.verify(target, tokens, draft, backend="cpu", **kw), want, "block, CPU build")


def test_chain_custom_op_path_carries_the_mask():
    """The torch.compile path (one ``specdec::verify_chain`` / ``verify_tree`` custom op) gets the mask."""
    B, G = 4, 2
    target, tokens, draft = make_problem(B, G, V, seed=16)
    allowed = _random_allowed((B, G + 1), torch.Generator().manual_seed(7), tokens)
    args = check_verify_call(target, tokens, draft, None, 0.9, 0, 1.0, None, 3, token_bitmask=pack_bitmask(allowed))
    _same(_dispatch.call_verify_chain(args, "vectorized"), _dispatch.run_verify(args, "torch"), "custom op")
    _same(_dispatch.call_verify_chain(args, "vectorized"), sk.verify(target, tokens, draft, temperature=0.9, seed=3,
          backend="torch", token_bitmask=pack_bitmask(allowed)), "custom op vs api")  # fmt: skip


def test_tree_custom_op_path_carries_the_mask():
    from specdec_kernels._tree_args import check_tree_args

    t_target, t_tokens, parents, t_draft = make_tree_problem(2, 5, V, seed=3)
    mask = pack_bitmask(torch.rand(2, 6, V, generator=torch.Generator().manual_seed(1)) < 0.6)
    targs = check_tree_args(t_target, t_tokens, parents, t_draft, None, 0.8, 0, 1.0, 4, None, "kseq", None,
                            token_bitmask=mask)  # fmt: skip
    _same(_dispatch.call_verify_tree(targs, "vectorized"), _dispatch.run_tree(targs, "torch"), "tree custom op")


def test_zero_sizes():
    W = (V + 31) // 32
    for backend in ("torch", "vectorized", "cpu"):
        out = _run(backend, torch.zeros(0, 3, V), torch.zeros(0, 2, dtype=torch.int64),
                   token_bitmask=torch.zeros(0, 3, W, dtype=torch.int32))  # fmt: skip
        assert out.tokens.shape == (0, 3)
        target = torch.randn(2, 1, V)
        allowed = torch.zeros(2, 1, V, dtype=torch.bool)
        allowed[0, 0, 66] = True
        out = _run(backend, target, torch.zeros(2, 0, dtype=torch.int64), temperature=0.7, seed=1,
                   token_bitmask=pack_bitmask(allowed))  # fmt: skip
        assert out.tokens[:, 0].tolist() == [66, 0] and out.nonfinite.tolist() == [False, True]
        out = _run(backend, target, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, 0, dtype=torch.int64),
                   op=sk.verify_tree, token_bitmask=pack_bitmask(allowed), temperature=0.7)  # fmt: skip
        assert out.tokens[:, 0].tolist() == [66, 0] and out.nonfinite.tolist() == [False, True]
    no_drafts = torch.zeros(0, dtype=torch.int64)
    flat = sk.verify(torch.randn(2, V), no_drafts, cu_num_draft_tokens=torch.zeros(3, dtype=torch.int64),
                     token_bitmask=pack_bitmask(allowed[:, 0]), temperature=0.0)  # fmt: skip
    assert flat.tokens[:, 0].tolist() == [66, 0]


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.zeros(2, 3, 3, dtype=torch.int64), "int32 words"),
        (torch.zeros(2, 3, 2, dtype=torch.int32), r"shape \[B, G\+1, W\] = \[2, 3, 3\]"),
        (torch.zeros(2, 2, 3, dtype=torch.int32), "token_bitmask must have shape"),
        (torch.zeros(2, 3, dtype=torch.int32), "token_bitmask must have shape"),
        ([[1]], "token_bitmask must be a torch.Tensor"),
    ],
)
def test_bad_masks_raise_value_errors_naming_token_bitmask(mask, message):
    target, tokens, _ = make_problem(2, 2, V)
    with pytest.raises(ValueError, match=message):
        sk.verify(target, tokens, token_bitmask=mask)


def test_bad_masks_of_the_other_layouts():
    W = (V + 31) // 32
    with pytest.raises(ValueError, match=r"token_bitmask must have shape \[N \+ B, W\]"):
        sk.verify(torch.randn(3, V), torch.zeros(1, dtype=torch.int64), cu_num_draft_tokens=torch.tensor([0, 1, 1]),
                  token_bitmask=torch.zeros(2, W, dtype=torch.int32))  # fmt: skip
    target, tokens, parents, _ = make_tree_problem(1, 3, V)
    with pytest.raises(ValueError, match=r"token_bitmask must have shape \[B, N\+1, W\]"):
        sk.verify_tree(target, tokens, parents, token_bitmask=torch.zeros(1, 3, W, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"token_bitmask must have shape \[B, K, G\+1, W\]"):
        sk.verify_multi(target[:, None], tokens[:, None], token_bitmask=torch.zeros(1, 4, W, dtype=torch.int32))


# --------------------------------------------------------------------------------------------
# statistics (slow): the first emitted token follows the masked, processed target

N_STAT = 40_000
V_STAT = 40  # two words: the allowed set includes tokens of the partial second word


def _stat_problem():
    """Target and draft logits [2, V] / [1, V] and the allowed set: the draft puts much of its
    mass on disallowed tokens, so a kernel that skips the draft row's mask is visibly biased."""
    gen = torch.Generator().manual_seed(21)
    target = torch.randn(2, V_STAT, generator=gen)
    draft = torch.randn(1, V_STAT, generator=gen)
    allowed = torch.rand(V_STAT, generator=gen) < 0.5
    allowed[[3, 36, 39]] = True
    draft = torch.where(allowed, draft, draft + 2.0)  # disallowed tokens are the draft's favourites
    return target, draft, allowed


def _expanded_call(backend, target, draft, allowed, use_mask=True, n=N_STAT, mask_target=False, mask_draft=False):
    """n requests on the same rows (seeds 0 .. n-1), drafts sampled from the masked draft."""
    masked_draft = torch.where(allowed, draft, torch.tensor(float("-inf")))
    gen = torch.Generator().manual_seed(5)
    tokens = torch.multinomial(torch.softmax(masked_draft, -1).expand(n, -1), 1, replacement=True, generator=gen)
    t = torch.where(allowed, target, torch.tensor(float("-inf"))) if mask_target else target
    d = masked_draft if mask_draft else draft
    mask = pack_bitmask(allowed.expand(n, 2, -1)) if use_mask else None
    out = sk.verify(t.expand(n, -1, -1), tokens, d.expand(n, -1, -1), temperature=1.0,
                    seed=torch.arange(n, dtype=torch.int64), backend=backend, token_bitmask=mask)  # fmt: skip
    return out.tokens[:, 0]


def _masks_target_only(backend, target, draft, allowed):
    """A wrong kernel: the target row masked, the draft logits row not."""
    return _expanded_call(backend, target, draft, allowed, use_mask=False, mask_target=True)


def _masks_draft_only(backend, target, draft, allowed):
    """A wrong kernel: the draft row masked, the target row not."""
    return _expanded_call(backend, target, draft, allowed, use_mask=False, mask_draft=True)


def _target_only_law(p, q_used, q_sampled):
    """Exact law of the first token when drafts come from q_sampled but the test uses q_used."""
    accept = torch.where(q_used > 0, torch.clamp(p / q_used, max=1.0), torch.ones_like(p))
    residual = torch.clamp(p - q_used, min=0)
    return q_sampled * accept + (1 - float((q_sampled * accept).sum())) * residual / residual.sum()


@pytest.mark.slow
@pytest.mark.parametrize("backend", SAMPLED_BACKENDS)
def test_first_token_follows_masked_target(backend):
    backend_device(backend, "cpu")
    target, draft, allowed = _stat_problem()
    masked = lambda x: torch.where(allowed, x, torch.tensor(float("-inf")))  # noqa: E731
    p = processed_probs(masked(target[0]), 1.0, 0, 1.0)
    q_masked = processed_probs(masked(draft[0]), 1.0, 0, 1.0)
    wrong_law = _target_only_law(p, processed_probs(draft[0], 1.0, 0, 1.0), q_masked)
    power = chi_square_power(p, wrong_law, N_STAT)
    assert power > 0.99, f"the target-only variant is detected with probability {power} only"
    first = _expanded_call(backend, target, draft, allowed)
    assert bool(allowed[first].all()), "a disallowed token was emitted"
    assert chi_square_pvalue(first, p) >= ALPHA
    if backend == "vectorized":  # the wrong variants (run on one backend: the statistic is what is shown)
        assert chi_square_pvalue(_masks_target_only(backend, target, draft, allowed), p) < ALPHA
        assert chi_square_pvalue(_masks_draft_only(backend, target, draft, allowed), p) < ALPHA


def test_pack_matches_the_independent_packer():
    from specdec_kernels._bitmask import allowed as unpack
    from specdec_kernels._bitmask import pack

    mask = torch.rand(3, 2, V, generator=torch.Generator().manual_seed(0)) < 0.5
    mask[0, 0, 31] = mask[0, 0, 63] = True  # sign bits
    assert torch.equal(pack(mask), pack_bitmask(mask))
    assert torch.equal(unpack(pack_bitmask(mask), V), mask)


def test_verify_with_mask_inside_torch_compile():
    """dynamo traces sk.verify / sk.verify_multi with token_bitmask= into their custom ops, no graph break."""
    B, G = 3, 2
    target, tokens, draft = make_problem(B, G, V, seed=17)
    mask = pack_bitmask(_random_allowed((B, G + 1), torch.Generator().manual_seed(2), tokens))
    seeds = torch.arange(B) * 3
    kw = dict(temperature=0.8, validate=False, backend="vectorized")

    def step(t, x, d, m, s):
        out = sk.verify(t * 1.0, x, d, seed=s, token_bitmask=m, **kw)
        multi = sk.verify_multi(t[:, None], x[:, None], d[:, None], seed=s, token_bitmask=m[:, None], **kw)
        return out.tokens + 0, out.nonfinite, multi.tokens

    torch._dynamo.reset()
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(target, tokens, draft, mask, seeds)
    want = sk.verify(target, tokens, draft, seed=seeds, token_bitmask=mask, temperature=0.8, backend="torch")
    assert torch.equal(got[0], want.tokens) and torch.equal(got[1], want.nonfinite)
    assert torch.equal(got[2], want.tokens)  # verify_multi with K = 1 is verify
    plain = sk.verify(target, tokens, draft, seed=seeds, temperature=0.8, backend="torch")
    assert not torch.equal(plain.tokens, want.tokens)  # the mask changed something


@pytest.mark.parametrize("backend", ["torch", "vectorized", "cpu"])
def test_nan_at_a_disallowed_token_is_masked_not_flagged(backend):
    target, tokens, draft = make_problem(2, 2, V, seed=18)
    allowed = torch.ones(2, 3, V, dtype=torch.bool)
    allowed[:, :, 40] = False
    target[0, :, 40] = float("nan")  # disallowed: -inf like any disallowed entry
    target[1, :, 41] = float("nan")  # allowed: flagged as usual
    out = _run(backend, target, tokens, draft, temperature=0.9, seed=1, token_bitmask=pack_bitmask(allowed))
    assert out.nonfinite.tolist() == [False, True]
