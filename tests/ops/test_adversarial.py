"""Adversarial inputs (issues 14 and 15): strided views, extreme temperatures, huge top_k, rows with
nothing finite, placeholder draft ids, empty batches - the same answer (or the same clear error)
from every backend: Triton, the CPU build of csrc, and the reference."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.ops import csrc

from ._inputs import make_problem
from ._stats import ALPHA, chi_square_power, chi_square_pvalue

BACKENDS = ["triton", "cpu", "vectorized", "torch"]


def _backend_or_skip(backend):
    if backend == "cpu" and not csrc.cpu_backend_ready():
        pytest.skip("the CPU backend cannot be built here")
    return backend


def _same(a, b):
    for name in ("tokens", "num_accepted", "nonfinite"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def _strided(t: torch.Tensor) -> torch.Tensor:
    """The same values as a view with stride 2 in its last dimension."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    wide[..., ::2] = t
    return wide[..., ::2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_argument_as_a_strided_view(backend):
    backend = _backend_or_skip(backend)
    B, G, V = 3, 4, 100
    target, tokens, draft = make_problem(B, G, V, seed=1)
    tokens = torch.where(torch.rand(B, G) < 0.5, target[:, :G].argmax(-1), tokens)
    per_request = dict(
        temperature=torch.tensor([0.0, 0.9, 1.3]),
        top_k=torch.tensor([0, 7, 0]),
        top_p=torch.tensor([1.0, 0.95, 0.8]),
        seed=torch.tensor([5, 6, 7]),
        num_draft_tokens=torch.tensor([4, 2, 3]),
    )
    plain = sk.verify(target, tokens, draft, **per_request, backend=backend)
    views = {k: _strided(v) for k, v in per_request.items()}
    assert all(not v.is_contiguous() for v in views.values())
    out = sk.verify(_strided(target), _strided(tokens), _strided(draft), **views, backend=backend)
    _same(out, plain)
    # the reproduction: request 1 must not be sampled at the neighbouring value 9
    t = torch.tensor([[0.0, 9.0]] * 3)[:, 0]
    _same(sk.verify(target, tokens, draft, temperature=t, seed=3, backend=backend),
          sk.verify(target, tokens, draft, temperature=0.0, seed=3, backend=backend))  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_expanded_arguments_stride_zero(backend):
    """Broadcast views (stride 0), as engines build them for one shared temperature or one prompt's
    logits repeated over a batch, read as their contiguous copies."""
    backend = _backend_or_skip(backend)
    B, G, V = 3, 4, 100
    target, tokens, draft = make_problem(1, G, V, seed=4)
    tokens = target[:, :G].argmax(-1)
    per_request = dict(
        temperature=torch.tensor(0.7).expand(B),
        top_k=torch.tensor(20).expand(B),
        top_p=torch.tensor(0.9).expand(B),
        seed=torch.tensor(5).expand(B),
        num_draft_tokens=torch.tensor(3).expand(B),
    )
    views = dict(target_logits=target.expand(B, -1, -1), draft_tokens=tokens.expand(B, -1))
    views["draft_logits"] = draft.expand(B, -1, -1)
    out = sk.verify(**views, **per_request, backend=backend)
    copies = {k: v.contiguous() for k, v in {**views, **per_request}.items()}
    _same(out, sk.verify(**copies, backend=backend))


@pytest.mark.parametrize("bad", [float("inf"), 1e300, float("nan"), -1.0, 1e-40, 1e-45])
def test_unusable_temperatures_are_clear_errors(bad):
    target, tokens, draft = make_problem(2, 3, 50, seed=2)
    with pytest.raises(ValueError, match="temperature"):
        sk.verify(target, tokens, draft, temperature=bad)
    with pytest.raises(ValueError, match="temperature"):
        sk.verify(target, tokens, draft, temperature=torch.tensor([0.5, bad]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_unchecked_subnormal_temperature_is_greedy(backend):
    backend = _backend_or_skip(backend)
    target, tokens, draft = make_problem(3, 4, 100, seed=3)
    tokens = torch.where(torch.rand(3, 4) < 0.6, target[:, :4].argmax(-1), tokens)
    greedy = sk.verify(target, tokens, draft, temperature=0.0, seed=1, backend=backend)
    for t in (1e-40, 1e-45):
        tiny = torch.full((3,), t)
        out = sk.verify(target, tokens, draft, temperature=tiny, seed=1, validate=False, backend=backend)
        _same(out, greedy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_huge_int64_top_k_means_no_top_k(backend):
    backend = _backend_or_skip(backend)
    target, tokens, draft = make_problem(3, 3, 100, seed=4)
    huge = torch.tensor([2**32 + 1, 2**40, 2**31], dtype=torch.int64)
    off = sk.verify(target, tokens, draft, temperature=0.9, top_k=0, seed=2, backend=backend)
    _same(sk.verify(target, tokens, draft, temperature=0.9, top_k=huge, seed=2, backend=backend), off)
    _same(sk.verify(target, tokens, draft, temperature=0.9, top_k=2**33, seed=2, backend=backend), off)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_row_with_nothing_finite_is_flagged(backend, temperature):
    backend = _backend_or_skip(backend)
    target, tokens, draft = make_problem(3, 2, 50, seed=5)
    target[1, 0] = float("nan")  # request 1's first row: nothing to choose from
    out = sk.verify(target, tokens, draft, temperature=temperature, seed=1, backend=backend)
    assert out.nonfinite.tolist() == [False, True, False]
    assert out.tokens[1, 0] == 0 and out.num_accepted[1] == 0
    clean = sk.verify(target[[0, 2]], tokens[[0, 2]], draft[[0, 2]], temperature=temperature, seed=torch.tensor([0, 2]))
    mixed = sk.verify(target, tokens, draft, temperature=temperature, seed=torch.arange(3), backend=backend)
    assert torch.equal(mixed.tokens[[0, 2]], clean.tokens)  # the NaN request changes no other request


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["ngram", "logits", "probs", "greedy"])
def test_placeholder_ids_reject_without_masking_or_flagging(backend, mode):
    """vLLM pads drafts with -1: a rejection at that position, residual = p (nothing masked), not
    nonfinite; verify_multi with K = 1 gives the same tokens."""
    backend = _backend_or_skip(backend)
    B, G, V = 4, 3, 60
    target, tokens, draft = make_problem(B, G, V, seed=6)
    tokens[:, 1] = -1
    tokens[2, 0] = V + 5
    kw = {"seed": torch.arange(B) + 40, "temperature": 0.0 if mode == "greedy" else 0.9, "validate": False}
    if mode in ("logits", "greedy"):
        kw["draft_logits"] = draft
    elif mode == "probs":
        kw["draft_probs"] = torch.softmax(draft / 0.9, -1)
    out = sk.verify(target, tokens, **kw, backend=backend)
    assert not out.nonfinite.any()
    assert (out.num_accepted <= 1).all() and out.num_accepted[2] == 0
    assert ((out.tokens >= 0) & (out.tokens < V) | (out.tokens == -1)).all()
    multi_kw = {k: (v[:, None] if k.startswith("draft_") else v) for k, v in kw.items()}
    multi = sk.verify_multi(target[:, None], tokens[:, None], **multi_kw, backend=backend)
    assert torch.equal(multi.tokens[:, : G + 1], out.tokens[:, : multi.tokens.shape[1]])
    assert torch.equal(multi.num_accepted, out.num_accepted)
    with pytest.raises(ValueError, match="draft_tokens must be in"):
        sk.verify(target, tokens, **{**kw, "validate": True}, backend=backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["triton", "cpu"])
@pytest.mark.parametrize("mode", ["ngram", "probs", "logits"])
def test_placeholder_position_emits_p(backend, mode):
    """The issue's case: p(0) = 0.6 at a placeholder position; the emitted token must follow p
    (chi-square, alpha 1e-6, 4,000 draws), with power > 0.99 against masking token 0."""
    backend = _backend_or_skip(backend)
    n, V = 4000, 5
    p = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.1])
    target = torch.log(p)[None, None].expand(n, 2, V).contiguous()
    tokens = torch.full((n, 1), -1)
    masked = torch.cat([torch.zeros(1), p[1:] / p[1:].sum()])
    assert chi_square_power(p, masked, n) > 0.99
    kw = {
        "ngram": {},
        "probs": {"draft_probs": torch.full((n, 1, V), 0.2)},
        "logits": {"draft_logits": torch.zeros(n, 1, V)},
    }[mode]
    out = sk.verify(target, tokens, **kw, temperature=1.0, seed=torch.arange(n), validate=False, backend=backend)
    assert (out.num_accepted == 0).all() and not out.nonfinite.any()
    assert chi_square_pvalue(out.tokens[:, 0], p.double()) > ALPHA


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches(backend):
    backend = _backend_or_skip(backend)
    t, x = torch.randn(0, 5, 10), torch.zeros(0, 4, dtype=torch.long)
    assert sk.verify(t, x, backend=backend, seed=1).tokens.shape == (0, 5)
    assert sk.verify_tree(t, x, torch.full((0, 4), -1), backend=backend, seed=1).tokens.shape[0] == 0
    multi = sk.verify_multi(torch.randn(0, 2, 3, 10), torch.zeros(0, 2, 2, dtype=torch.long), backend=backend, seed=1)
    assert multi.tokens.shape[0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batches_as_strided_views(backend):
    # An empty tensor is "contiguous" whatever its strides: found by the property test (B = 0 with
    # a stride-2 last dimension reached the CPU build's layout check).
    backend = _backend_or_skip(backend)
    t, x = _strided(torch.randn(0, 2, 2)), _strided(torch.zeros(0, 1, dtype=torch.long))
    for kw in ({}, {"draft_logits": _strided(torch.randn(0, 1, 2))}, {"draft_probs": _strided(torch.ones(0, 1, 2))}):
        out = sk.verify(t, x, **kw, temperature=0.7, backend=backend, seed=torch.zeros(0, dtype=torch.long))
        assert out.tokens.shape == (0, 2)
    multi = sk.verify_multi(_strided(torch.randn(0, 2, 3, 10)), _strided(torch.zeros(0, 2, 2, dtype=torch.long)))
    assert multi.tokens.shape[0] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_int32_outputs(backend):
    backend = _backend_or_skip(backend)
    target, tokens, draft = make_problem(3, 3, 50, seed=8)
    wide = sk.verify(target, tokens, draft, seed=2, backend=backend)
    narrow = sk.verify(target, tokens, draft, seed=2, backend=backend, out_dtype=torch.int32)
    assert narrow.tokens.dtype == torch.int32 and torch.equal(narrow.tokens.long(), wide.tokens)
    t4, x4 = target[:, None], tokens[:, None]
    multi = sk.verify_multi(t4, x4, draft[:, None], seed=2, backend=backend, out_dtype=torch.int32)
    assert multi.tokens.dtype == multi.accepted_nodes.dtype == torch.int32
    with pytest.raises(TypeError, match="out_dtype"):
        sk.verify(target, tokens, draft, out_dtype=torch.float32)


# ---- unusable draft_probs (issue 14, item 5): NaN / +-inf / negative entries count as 0 and flag
# the request when they lie in a draft row it uses; every backend gives the same tokens.

NAN, INF = float("nan"), float("inf")
# (what request b of the batch holds, flagged?) - "root row": the draft row of the first position
# tested; "later row": the draft row of the second position, unused because every root candidate
# has target probability 0; "greedy": a temperature-0 request, which never reads q.
UNUSABLE_PROBS = [
    ("clean", False),
    ("nan at the draft token", True),
    ("nan elsewhere in the root row", True),
    ("whole root row nan", True),
    ("negative at the draft token", True),
    ("-inf elsewhere", True),
    ("+inf elsewhere", True),
    ("nan in a later row after a certain rejection", False),
    ("greedy request, whole row nan", False),
]


def _chain_layout(B, V, seed):
    target, tokens, draft = make_problem(B, 3, V, seed=seed)
    return {
        "target": target,
        "probs": torch.softmax(draft, -1),
        "root": lambda b: (b, 0),  # index of the root position's draft row
        "later": lambda b: (b, 1),
        "root_target": lambda b: (b, 0),
        "root_tokens": lambda b: [int(tokens[b, 0])],
        "call": lambda rows, target, probs, **kw: sk.verify(target, tokens[rows], draft_probs=probs, **kw),
    }


def _multi_layout(B, V, seed):
    t, x, d = make_problem(2 * B, 3, V, seed=seed)
    target, tokens, draft = t.reshape(B, 2, 4, V), x.reshape(B, 2, 3), d.reshape(B, 2, 3, V)
    return {
        "target": target,
        "probs": torch.softmax(draft, -1),
        "root": lambda b: (b, 0, 0),  # the first candidate's row (chain 0, slot 0)
        "later": lambda b: (b, 0, 1),
        "root_target": lambda b: (b, 0, 0),
        "root_tokens": lambda b: tokens[b, :, 0].tolist(),
        "call": lambda rows, target, probs, **kw: sk.verify_multi(
            target, tokens[rows], draft_probs=probs, method="rrs", **kw
        ),
    }


def _tree_layout(B, V, seed):
    target, tokens, draft = make_problem(B, 5, V, seed=seed)
    parents = torch.tensor([-1, -1, 0, 0, 2]).expand(B, 5)  # root: nodes 0, 1; under node 0: 2, 3
    return {
        "target": target,
        "probs": torch.softmax(draft, -1),
        "root": lambda b: (b, 0),  # node 0's draft row (the root's first candidate)
        "later": lambda b: (b, 2),  # node 2's row (the first candidate under node 0)
        "root_target": lambda b: (b, 0),
        "root_tokens": lambda b: tokens[b, :2].tolist(),
        "call": lambda rows, target, probs, **kw: sk.verify_tree(
            target, tokens[rows], parents[rows], draft_probs=probs, **kw
        ),
    }


def _unusable_probs_batch(layout):
    """(target, probs with the cases of UNUSABLE_PROBS injected, temperatures, expected flags)."""
    target, probs = layout["target"].clone(), layout["probs"].clone()
    temperature = torch.full((len(UNUSABLE_PROBS),), 0.9)
    for b, (case, _) in enumerate(UNUSABLE_PROBS):
        root, tok = layout["root"](b), layout["root_tokens"](b)[0]
        other = (tok + 1) % probs.shape[-1]
        if case == "nan at the draft token":
            probs[root + (tok,)] = NAN
        elif case == "nan elsewhere in the root row":
            probs[root + (other,)] = NAN
        elif case in ("whole root row nan", "greedy request, whole row nan"):
            probs[root] = NAN
        elif case == "negative at the draft token":
            probs[root + (tok,)] = -0.25
        elif case == "-inf elsewhere":
            probs[root + (other,)] = -INF
        elif case == "+inf elsewhere":
            probs[root + (other,)] = INF
        elif case == "nan in a later row after a certain rejection":
            target[layout["root_target"](b) + (layout["root_tokens"](b),)] = -INF  # p = 0: never accepted
            probs[layout["later"](b)] = NAN
        if case.startswith("greedy"):
            temperature[b] = 0.0
    return target, probs, temperature, [flag for _, flag in UNUSABLE_PROBS]


@pytest.mark.parametrize("layout", [_chain_layout, _multi_layout, _tree_layout], ids=["verify", "multi", "tree"])
def test_unusable_draft_probs_count_as_zero_and_flag(layout):
    """Every backend: the flags of UNUSABLE_PROBS, the same tokens as with the unusable entries set
    to 0 (the documented rule), the same tokens across backends, and no effect on other requests."""
    layout = layout(len(UNUSABLE_PROBS), 37, seed=11)
    target, probs, temperature, flags = _unusable_probs_batch(layout)
    zeroed = torch.where((probs >= 0) & (probs < INF), probs, torch.zeros_like(probs))
    seeds = torch.arange(len(flags)) + 70
    clean = [b for b, (case, _) in enumerate(UNUSABLE_PROBS) if case == "clean"]
    every = slice(None)
    first = None
    for backend in BACKENDS:
        if backend == "cpu" and not csrc.cpu_backend_ready():
            continue
        kw = {"temperature": temperature, "seed": seeds, "backend": backend}
        out = layout["call"](every, target, probs, **kw)
        assert out.nonfinite.tolist() == flags, backend
        as_zero = layout["call"](every, target, zeroed, **kw)
        assert not as_zero.nonfinite.any()
        assert torch.equal(out.tokens, as_zero.tokens) and torch.equal(out.num_accepted, as_zero.num_accepted)
        first = first if first is not None else out
        assert torch.equal(out.tokens, first.tokens), f"{backend} differs from {BACKENDS[0]}"
        alone = layout["call"](clean, target[clean], probs[clean], **{**kw, "temperature": 0.9, "seed": seeds[clean]})
        assert torch.equal(out.tokens[clean], alone.tokens)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_requests_never_read_the_draft(backend):
    """Temperature 0 follows the argmax chain: NaN draft logits / probs are not read, not flagged
    (the reference used to flag NaN draft logits of greedy requests; the kernels never did)."""
    backend = _backend_or_skip(backend)
    target, tokens, draft = make_problem(3, 3, 40, seed=12)
    tokens = target[:, :3].argmax(-1)  # every draft accepted: all draft rows would be "used"
    draft[1] = NAN
    probs = torch.softmax(draft, -1)
    for kw in ({"draft_logits": draft}, {"draft_probs": probs}, {}):
        out = sk.verify(target, tokens, **kw, temperature=0.0, seed=1, backend=backend)
        assert not out.nonfinite.any() and (out.num_accepted == 3).all()


def test_row_pass_running_max_edges_match_the_reference():
    """The Triton row pass keeps one running max per lane for the sum-exp and the greedy argmax,
    started below every finite bf16 / fp16 value (``helpers.lane_max_exp_update``): fp32 rows whose
    max is -FLT_MAX (never above the start: the exact pass takes them, first index kept), rows with
    nothing finite, and NaN / +inf entries below the top-k / top-p threshold (a filter with its own
    NaN-propagating max used to find them; now the NaN passes the filter and poisons z) must give
    the reference's tokens and flags, with and without a filter and a token_bitmask."""
    lowest = torch.finfo(torch.float32).min
    target, tokens, draft = make_problem(4, 2, 96, seed=11)
    target[0, 0] = float("-inf")
    target[0, 0, [5, 70]] = lowest  # request 0, row 0: max -FLT_MAX, first at column 5
    target[1, 1] = float("-inf")  # request 1, row 1: nothing finite
    target[2, 0, 3] = float("nan")  # request 2: a NaN far below the threshold ...
    target[2, 0, 40] = -50.0
    draft[3, 0, 9] = float("inf")  # request 3: +inf in a draft row
    tokens[:, 0] = torch.tensor([5, 1, 2, 4])
    words = torch.full((4, 3, 3), -1, dtype=torch.int32)
    words[2, 0, 0] = 0x7FFFFFF7  # columns 3 (the NaN: not counted) and 31 (bit 31) disallowed
    mixed = torch.tensor([0.0, 0.0, 0.8, 0.8])  # greedy rows in a sampled call: the running max's argmax
    for temperature, top_k, top_p in [(0.0, 0, 1.0), (mixed, 0, 1.0), (0.8, 0, 1.0), (mixed, 3, 0.9), (0.8, 3, 0.9)]:
        for bitmask in (None, words):
            kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=torch.arange(4), token_bitmask=bitmask)
            ref = sk.verify(target, tokens, draft, backend="torch", **kw)
            out = sk.verify(target, tokens, draft, backend="triton", **kw)
            assert out.nonfinite.tolist() == ref.nonfinite.tolist(), (temperature, top_k, bitmask is None)
            assert torch.equal(out.tokens, ref.tokens), (temperature, top_k, bitmask is None)
            _same(out, ref)
