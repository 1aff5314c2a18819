"""method="block" cases shared by the CPU build's and the Triton kernels' tests (test_cpu_block.py,
test_triton_block.py): each builds its inputs and runs them through ``check(target, tokens,
draft_kw, **kw)``, the test file's call of its backend asserted equal to the other backends, then
checks what the case is about."""

from __future__ import annotations

import torch

import specdec_kernels as sk

from ._inputs import flattened_problem, make_problem, pack_bitmask
from .test_cpu_native_mask import _allowed, _draft_kw, _same


def mixed_sampling(B: int, gen: torch.Generator) -> dict:
    """Per-request sampling: greedy, plain, top-k, top-p, both; seeds."""
    return dict(
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3, 0.9] * B)[:B],
        top_k=torch.tensor([0, 0, 5, 0, 7] * B)[:B],
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.8, 0.9] * B)[:B],
        seed=torch.randint(0, 2**62, (B,), generator=gen),
    )


def top_p_ties_case(check) -> None:
    """Integer logits: large tie groups at the top-p boundary, kept or cut by index."""
    B, G, V = 16, 3, 64
    gen = torch.Generator().manual_seed(12)
    target = torch.randint(-3, 3, (B, G + 1, V), generator=gen).float()
    draft = torch.randint(-3, 3, (B, G, V), generator=gen).float()
    tokens = torch.randint(0, V, (B, G), generator=gen)
    for ties in ("keep", "by_index"):
        kw = dict(temperature=1.0, top_p=0.6, top_k=20, top_p_ties=ties, seed=5)
        check(target, tokens, dict(draft_logits=draft), **kw)


def flattened_case(backend: str, others: tuple[str, ...]) -> None:
    """Ragged requests (3, 0 and 2 drafts) in the flattened layout: `backend` equal to `others` on
    the same call and to its own padded call."""
    cu, rows, ids, draft = flattened_problem(257, seed=2)
    B, G = 3, 3
    kw = dict(temperature=0.9, top_p=0.95, seed=torch.tensor([5, 6, 7]), method="block")
    flat = dict(cu_num_draft_tokens=cu, max_num_draft_tokens=G, **kw)
    out = sk.verify(rows, ids, draft, backend=backend, **flat)
    for other in others:
        _same(out, sk.verify(rows, ids, draft, backend=other, **flat), f"flattened: {backend} vs {other}")
    n = cu.diff()
    target = torch.full((B, G + 1, 257), -1.0)
    padded_draft, tokens = torch.zeros(B, G, 257), torch.zeros(B, G, dtype=torch.int64)
    for b in range(B):
        target[b, : n[b] + 1] = rows[cu[b] + b : cu[b + 1] + b + 1]
        padded_draft[b, : n[b]], tokens[b, : n[b]] = draft[cu[b] : cu[b + 1]], ids[cu[b] : cu[b + 1]]
    padded = sk.verify(target, tokens, padded_draft, num_draft_tokens=n, backend=backend, **kw)
    _same(out, padded, "flattened vs padded")


def token_bitmask_case(check, mode: str) -> None:
    """Random masks with rows allowing one token, the last token, nothing (flagged: block reads
    every row 0 .. n, so such a row flags its request wherever tau stops), everything."""
    B, G, V = 12, 3, 70
    target, tokens, draft = make_problem(B, G, V, seed=21, closeness=0.3)
    gen = torch.Generator().manual_seed(22)
    allowed = _allowed((B, G + 1), V, gen, tokens)
    mask = pack_bitmask(allowed)
    if mode == "logits":
        draft = draft.masked_fill(~allowed[:, :G], float("-inf"))  # drafts sampled under the grammar
    kw = dict(temperature=torch.tensor([0.0, 0.8, 1.0] * 4), top_k=3, token_bitmask=mask, seed=23)
    out = check(target, tokens, _draft_kw(mode, draft), **kw)
    sampled = torch.tensor([0.0, 0.8, 1.0] * 4) > 0
    empty = ~allowed.any(-1)  # [B, G+1]: rows with nothing to sample
    assert bool(out.nonfinite[sampled & empty.any(-1)].all())
    emitted = out.tokens.clamp(min=0)
    ok = allowed.gather(2, emitted[..., None]).squeeze(2) | (out.tokens < 0) | empty
    assert bool(ok.all()), "a disallowed token was emitted"


def nonfinite_case(check) -> None:
    """NaN / +inf logits flag the request (any row 0 .. n); a -1 draft id (validate=False) ends the
    draft there; unusable draft probabilities flag it too."""
    B, G, V = 10, 4, 50
    target, tokens, draft = make_problem(B, G, V, seed=31)
    target[1, 3, 7] = float("nan")
    target[2, 0, :] = float("nan")
    draft[3, 1, 4] = float("inf")
    tokens[4, 2] = -1
    tokens[5, 0] = -1
    kw = dict(temperature=0.9, seed=32, validate=False)
    out = check(target, tokens, dict(draft_logits=draft), **kw)
    assert out.nonfinite[:4].tolist() == [False, True, True, True]
    assert int(out.num_accepted[5]) == 0 and int(out.num_accepted[4]) <= 2
    probs = torch.softmax(draft.nan_to_num(posinf=0.0), -1)
    probs[6, 2, 9], probs[7, 0, 3] = float("nan"), -1.0  # unusable draft probabilities: flagged
    out = check(target, tokens, dict(draft_probs=probs), **kw)
    assert out.nonfinite[6:8].tolist() == [True, True]


def strided_views_case(check, backend: str) -> None:
    """Rows, drafts and draft logits that are views (non-contiguous leading dims, a vocabulary slice)."""
    B, G, V = 8, 3, 40
    big_t, _, big_d = make_problem(2 * B, G + 2, V + 9, seed=41, closeness=0.3)
    target = big_t[::2, 1 : G + 2, 3 : 3 + V]
    draft = big_d[::2, 1 : G + 1, 3 : 3 + V]
    tokens = torch.randint(0, V, (2 * B, G + 2), generator=torch.Generator().manual_seed(43))[::2, 1 : G + 1]
    assert not target.is_contiguous() and not draft.is_contiguous() and not tokens.is_contiguous()
    kw = dict(temperature=0.8, top_p=0.9, seed=42)
    out = check(target, tokens, dict(draft_logits=draft), **kw)
    dense = (target.contiguous(), tokens.contiguous(), draft.contiguous())
    dense = sk.verify(*dense, backend=backend, method="block", **kw)
    _same(out, dense, "views vs contiguous copies")


def zero_sizes_case(check) -> None:
    for B, G in ((0, 3), (4, 0), (0, 0)):
        target, tokens, draft = make_problem(B, G, 17, seed=51)
        out = check(target, tokens, dict(draft_logits=draft), temperature=0.9, seed=52)
        assert out.tokens.shape == (B, G + 1) and out.num_accepted.shape == (B,)
        if B:
            assert bool((out.num_accepted == 0).all())
