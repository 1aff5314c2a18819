"""The CPU build's AVX2 paths (csrc/verify_cpu_simd.h) against its scalar programs.

The AVX2 row pass and race use SLEEF's exp / log and sum the row's exp in eight lanes, so their
statistics may differ from the scalar path's by a few ulps; the tokens must not (a token flips
only when an accept test or the race's top two keys fall within that margin, ~1e-6 per call).
SPECDEC_CPU_SIMD=0 (read per call) selects the scalar path: every draft mode, dtype, filter,
ragged and non-finite input, many seeds, token for token.
"""

from __future__ import annotations

import pytest
import torch

import specdec_kernels as sk

from .conftest import cpu_core_or_skip


@pytest.fixture(scope="module", autouse=True)
def cpu_build():
    return cpu_core_or_skip()


SEEDS = range(6)
SAMPLING = [  # (temperature, top_k, top_p)
    (0.0, 0, 1.0),
    (0.7, 0, 1.0),
    (1.0, 50, 0.9),
    (0.9, 0, 0.8),
]


def _inputs(dtype, draft_mode: str, B: int, G: int, V: int, gen: torch.Generator):
    target = (torch.randn(B, G + 1, V, generator=gen) * 3).to(dtype)
    draft = target[:, :G].float() + torch.randn(B, G, V, generator=gen)
    if draft_mode == "probs":
        kwargs = dict(draft_probs=torch.softmax(draft, -1).to(dtype))
    elif draft_mode == "logits":
        kwargs = dict(draft_logits=draft.to(dtype))
    else:
        kwargs = {}
    tokens = torch.softmax(draft, -1).view(B * G, V).multinomial(1, generator=gen).view(B, G)
    return target, tokens, kwargs


def _both_paths(monkeypatch, *args, **kwargs):
    out = []
    for flag in ("1", "0"):
        monkeypatch.setenv("SPECDEC_CPU_SIMD", flag)
        out.append(sk.verify(*args, backend="cpu", **kwargs))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("draft_mode", ["logits", "probs", "none"])
def test_simd_tokens_equal_scalar(monkeypatch, dtype, draft_mode):
    gen = torch.Generator().manual_seed(hash((str(dtype), draft_mode)) % 2**31)
    # V = 4099: a 32-entry race step, an 8-entry tail and a 3-entry remainder; V = 333: tails only
    for B, G, V in ((3, 4, 4099), (2, 3, 333)):
        target, tokens, kw = _inputs(dtype, draft_mode, B, G, V, gen)
        for temperature, top_k, top_p in SAMPLING:
            for seed in SEEDS:
                fast, scalar = _both_paths(
                    monkeypatch, target, tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, **kw
                )
                assert torch.equal(fast.tokens, scalar.tokens), (temperature, top_k, top_p, seed, B, V)
                assert torch.equal(fast.num_accepted, scalar.num_accepted)
                assert torch.equal(fast.nonfinite, scalar.nonfinite)


def test_simd_non_finite_ragged_and_ties(monkeypatch):
    """NaN / inf logits and unusable probabilities (counted and flagged alike), ragged drafts,
    2 threads, greedy ties (lowest index)."""
    gen = torch.Generator().manual_seed(5)
    B, G, V = 4, 3, 6000
    target = torch.randn(B, G + 1, V, generator=gen) * 2
    target[0, 1, 7] = float("nan")
    target[1, 0, 100] = float("inf")
    target[2, :, 3000:3010] = 50.0  # a tie of ten at the max: greedy takes index 3000
    draft = target[:, :G] + torch.randn(B, G, V, generator=gen)
    probs = torch.softmax(draft, -1)
    probs[3, 0, 11] = float("nan")
    probs[3, 1, 12] = -1.0
    tokens = draft.argmax(-1)
    num_draft = torch.tensor([3, 1, 0, 2])
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kw in (dict(draft_logits=draft), dict(draft_probs=probs)):
            for temperature in (0.0, 0.8):
                for seed in SEEDS:
                    fast, scalar = _both_paths(
                        monkeypatch, target, tokens, temperature=temperature, seed=seed, num_draft_tokens=num_draft,
                        validate=False, **kw,
                    )  # fmt: skip
                    assert torch.equal(fast.tokens, scalar.tokens), (temperature, seed, list(kw))
                    assert torch.equal(fast.nonfinite, scalar.nonfinite)
    finally:
        torch.set_num_threads(threads)


# ---- the row normaliser z of the CPU row pass against float64 (binding's row_softmax_program)

# Relative error allowed in z (measured <= 1e-7): expf / SLEEF's exp round each term (unbiased), z is stored
# as float32 (6e-8). A float32 sum of V = 152k terms in sequence was ~1.6e-4 low (small terms
# rounded against a partial sum near z); every accept probability p / q scales with 1 / z.
Z_REL_TOL = 5e-7


def _z_reference(rows: torch.Tensor, temperature: float, m: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """sum over x >= thr of exp((x - m) * inv_t) in float64, inv_t the core's float32(1 / T)."""
    x = rows.double()
    inv_t = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32))
    terms = torch.exp((x - m[:, None]) * inv_t)
    return torch.where(x >= thr[:, None], terms, torch.zeros_like(terms)).sum(-1)


@pytest.mark.parametrize("simd", ["1", "0"])
@pytest.mark.parametrize("V", [32000, 151936])
def test_row_normaliser_matches_float64(monkeypatch, cpu_build, simd, V):
    """z of the scalar (SPECDEC_CPU_SIMD=0) and AVX2 row passes within Z_REL_TOL of float64 at real
    vocabulary sizes: randn * 3 logits, fp32 and bf16, T = 0.7 and 1, no filter / top-k / top-p,
    one chunk and four (merged as program 2 merges them)."""
    monkeypatch.setenv("SPECDEC_CPU_SIMD", simd)
    gen = torch.Generator().manual_seed(V)
    worst = 0.0
    for dtype in (torch.float32, torch.bfloat16):
        rows = (torch.randn(3, V, generator=gen) * 3).to(dtype)
        for temperature in (0.7, 1.0):
            for top_k, top_p in ((0, 1.0), (5000, 1.0), (0, 0.95)):
                for chunks in (1, 4):
                    out = cpu_build.row_softmax_program(rows, temperature, top_k, top_p, chunks)
                    m, z, thr = out.unbind(-1)
                    assert torch.equal(m, rows.float().max(-1).values.double())
                    ref = _z_reference(rows.float(), temperature, m, thr)
                    rel = ((z - ref) / ref).abs().max().item()
                    worst = max(worst, rel)
                    assert rel < Z_REL_TOL, (dtype, temperature, top_k, top_p, chunks, rel)
    print(f"V = {V}, SPECDEC_CPU_SIMD = {simd}: worst relative error of z {worst:.2e}")
