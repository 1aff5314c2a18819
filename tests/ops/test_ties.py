"""The accept rule on a tie, pinned in every backend: a draft is accepted when u * q(x) == p(x).

The documented rule is ``u * q(x) <= p(x)`` (u from Philox, never 0). Ties are rare but real: in
float32 a product rounds onto p often enough to matter (sweeping 6,001 consecutive float32 values of
one logit of a 2-token row gives ~10 exact ties), and a backend that tests ``<`` instead of ``<=``
drops those tokens where the others keep them. Each backend is checked on a row crafted so that the
equality holds exactly in its own arithmetic:

* float32 backends (triton, the C++ core "cpu", cuda): target logits [0, 0] give p = 1 / 2 exactly
  (exp(0) = 1, z = 2); the draft probability q0 is the float32 with fl32(u * q0) == 0.5 for the
  request's u. Its exact product is just below 1/2, so the float64 backends accept it too (no tie
  there, and no disagreement between backends).
* float64 backends (the reference "torch", "vectorized", the vocabulary-parallel path): target
  logits [0, a, b, c] whose float64 softmax gives p(0) == u * q0 exactly, for one-hot drafts (q0 = 1)
  and for draft probabilities with q0 = 3/4.

The seeds and rows were found offline: for the float32 row, seeds whose u is in (0.55, 0.95) and the
float32 neighbours of 0.5 / u; for the float64 row, a below log(1/u - 1), then b and c taking up the
remainder, the float32 values of c swept until ``processed_probs`` gave p(0) == u. The tests assert
those equalities first, so a change of the generator or of the softmax shows as a broken premise,
not as a silent pass.
"""

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from specdec_kernels.reference.sampling import PURPOSE_ACCEPT, processed_probs, uniforms

from ._stats import backend_device

FLOAT32_BACKENDS = ["triton", "cpu", "cuda"]
# "vocab_parallel": the sharded path (process_group=, ops/vocab_parallel.py) on a one-rank gloo group
FLOAT64_BACKENDS = ["torch", "vectorized", "vocab_parallel"]

# float32 tie: seed -> q0 with fl32(u * q0) == 0.5 (u of the seed's first draft)
F32_SEED, F32_Q0 = 20, 0.651020884513855
# float64 ties: p(0) of softmax([0, a, b, c]) == u * q0 of the seed's first draft, in float64, for a
# one-hot draft (q0 = 1) and for draft probabilities [0.75, 0.25, 0, 0] (u * 0.75 is exact in float64)
F64_SEED, F64_ROW = 29, (0.0, -1.8418903350830078, -18.51570701599121, -32.80497360229492)
F64_Q_ROW, F64_Q = (0.0, -0.6075384616851807, -19.055957794189453, -32.80357360839844), (0.75, 0.25, 0.0, 0.0)


def _u(seed):
    return uniforms(seed, 0, 0, PURPOSE_ACCEPT)  # float32: the first draft's (row 0) accept uniform


def _float32_tie():
    u, q0 = np.float32(_u(F32_SEED)), np.float32(F32_Q0)
    assert np.float32(u * q0) == np.float32(0.5) and float(u) * float(q0) < 0.5, "premise: a float32 tie"
    target = torch.zeros(2)
    draft = torch.tensor([F32_Q0, 1.0 - F32_Q0], dtype=torch.float32)
    return F32_SEED, target, {"draft_probs": draft}


def _float64_tie(one_hot: bool):
    target = torch.tensor(F64_ROW if one_hot else F64_Q_ROW, dtype=torch.float32)
    q0 = 1.0 if one_hot else F64_Q[0]
    assert float(processed_probs(target, 1.0, 0, 1.0)[0]) == float(_u(F64_SEED)) * q0, "premise: a float64 tie"
    return F64_SEED, target, ({} if one_hot else {"draft_probs": torch.tensor(F64_Q, dtype=torch.float32)})


def _call_kw(backend, device, request):
    """(device, backend keyword arguments) of a backend name of this file."""
    if backend == "vocab_parallel":
        return "cpu", {"backend": "torch", "process_group": request.getfixturevalue("one_rank_group")}
    return (backend_device(backend, device) if backend != "torch" else "cpu"), {"backend": backend}


def _tie(backend, drafts, device, request):
    device, kw = _call_kw(backend, device, request)
    seed, target, draft = _float32_tie() if backend in FLOAT32_BACKENDS else _float64_tie(drafts == "one-hot")
    return device, kw, seed, target, draft


# float32 one-hot ties depend on the platform's exp: the C++ core's alone (below, with libm's expf)
TIE_CASES = [
    (b, d)
    for b in FLOAT32_BACKENDS + FLOAT64_BACKENDS
    for d in ("probs", "one-hot")
    if b in FLOAT64_BACKENDS or d == "probs"
]


@pytest.mark.parametrize("backend, drafts", TIE_CASES)
def test_chain_accepts_on_a_tie(backend, drafts, device, request):
    device, backend_kw, seed, target, draft = _tie(backend, drafts, device, request)
    kw = {name: row.expand(1, 1, -1).contiguous().to(device) for name, row in draft.items()}
    out = sk.verify(
        target.expand(1, 2, -1).contiguous().to(device),
        torch.zeros(1, 1, dtype=torch.int64, device=device),
        seed=torch.tensor([seed], device=device),
        **backend_kw,
        **kw,
    )
    assert out.num_accepted.tolist() == [1], "u * q == p must accept the draft"
    assert out.tokens[0, 0].item() == 0


@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
@pytest.mark.parametrize("backend, drafts", TIE_CASES)
def test_tree_accepts_on_a_tie(backend, drafts, method, device, request):
    """A root with one child (K-SEQ's rho is 1 for one candidate): the same tie as the chain's."""
    device, backend_kw, seed, target, draft = _tie(backend, drafts, device, request)
    kw = {name: row.expand(1, 1, -1).contiguous().to(device) for name, row in draft.items()}
    out = sk.verify_tree(
        target.expand(1, 2, -1).contiguous().to(device),
        torch.zeros(1, 1, dtype=torch.int64, device=device),
        torch.full((1, 1), -1, dtype=torch.int64, device=device),
        seed=torch.tensor([seed], device=device),
        method=method,
        **backend_kw,
        **kw,
    )
    assert out.num_accepted.tolist() == [1], "u * q == p must accept the node"
    assert out.accepted_nodes[0, 0].item() == 0


# float32 one-hot tie of the C++ core (q = 1: u == p): target logits [0, a] give p(0) = 1 / (1 + expf(a))
# in the core (libm's expf, one float32 addition and division); a was swept over float32 values near
# log(1 / u - 1) until that equals u. The premise is computed with the same libm expf (ctypes).
CORE_ONE_HOT_SEED, CORE_ONE_HOT_A = 1, -2.0933918952941895


def _core_one_hot_tie():
    import ctypes
    import ctypes.util

    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to compute the core's expf with")
    expf = ctypes.CDLL(libm).expf
    expf.restype, expf.argtypes = ctypes.c_float, [ctypes.c_float]
    f32 = np.float32
    p0 = f32(1.0) / (f32(1.0) + f32(expf(CORE_ONE_HOT_A)))
    assert p0 == _u(CORE_ONE_HOT_SEED), "premise: the core's p(0) equals u"
    return torch.tensor([0.0, CORE_ONE_HOT_A]).expand(1, 2, -1).contiguous()


@pytest.mark.parametrize("method", [None, "kseq", "rrs", "rrs_wor"])
def test_core_one_hot_accepts_on_a_tie(method, device):
    backend_device("cpu", device)
    target, token, seed = _core_one_hot_tie(), torch.zeros(1, 1, dtype=torch.int64), torch.tensor([CORE_ONE_HOT_SEED])
    if method is None:
        out = sk.verify(target, token, seed=seed, backend="cpu")
    else:
        out = sk.verify_tree(target, token, torch.full((1, 1), -1), seed=seed, method=method, backend="cpu")
    assert out.num_accepted.tolist() == [1], "u == p must accept the one-hot draft"


# ---- K-SEQ: the upper end of the rho bracket decides. The search returns rho = hi >= rho* (exact);
# a backend using the lower end (rho < rho*) accepts slightly more often (up to RHO_TOL = 5e-5 of
# acceptance), which no sampling test can see. Here u falls between the acceptance thresholds of
# rho* and of the search's rho: p(x) / (rho q(x)) < u <= p(x) / (rho* q(x)), so every backend must
# reject node 0 where a lower-end (or rho*) backend accepts it. Found offline: of 400 rows (V = 16,
# k = 2, torch seeds 0..399) the one with the widest bracket (rho / rho* - 1 = 1.2e-4 in the reference
# and the C++ core), its token with the largest p / q below rho*, and the first seeds whose u lies in
# the middle of that window (KSEQ_REJECT_SEED) and just below it (KSEQ_ACCEPT_SEED, accepted by all).
KSEQ_ROW_SEED, KSEQ_TOKEN, KSEQ_REJECT_SEED, KSEQ_ACCEPT_SEED = 348, 14, 17593, 5639


def _kseq_window_row():
    from specdec_kernels.reference.verify_tree import solve_rho

    from ._stats import exact_rho

    gen = torch.Generator().manual_seed(KSEQ_ROW_SEED)
    target = torch.randn(16, generator=gen) * 2
    q = torch.softmax(torch.randn(16, generator=gen).double() * 2, 0).float()
    p = torch.softmax(target.double(), 0)
    ratio = float(p[KSEQ_TOKEN] / q[KSEQ_TOKEN].double())
    lower, upper = ratio / solve_rho(p, q.double(), 2)[0], ratio / exact_rho(p, q.double(), 2)[0]
    width = upper - lower
    u_reject, u_accept = float(_u(KSEQ_REJECT_SEED)), float(_u(KSEQ_ACCEPT_SEED))
    assert lower + 0.3 * width < u_reject < upper - 0.3 * width, "premise: u between the two thresholds"
    assert u_accept < lower - 0.2 * width, "premise: u below both thresholds"
    return target, q


@pytest.mark.parametrize("backend", FLOAT32_BACKENDS + FLOAT64_BACKENDS)
def test_kseq_uses_the_upper_end_of_the_rho_bracket(backend, device, request):
    device, backend_kw = _call_kw(backend, device, request)
    target, q = _kseq_window_row()
    seeds = torch.tensor([KSEQ_REJECT_SEED, KSEQ_ACCEPT_SEED], device=device)
    out = sk.verify_tree(
        target.expand(2, 3, -1).contiguous().to(device),  # the root's row and its two children's
        torch.tensor([[KSEQ_TOKEN, 4]] * 2, device=device),
        torch.full((2, 2), -1, dtype=torch.int64, device=device),
        draft_probs=q.expand(2, 2, -1).contiguous().to(device),
        seed=seeds,
        method="kseq",
        **backend_kw,
    )
    first = out.accepted_nodes[:, 0].tolist()
    assert first[0] != 0, "u * rho * q > p with rho = the bracket's upper end: node 0 must be rejected"
    assert first[1] == 0, "u below both thresholds: node 0 must be accepted"
