"""The radix-select top-k / top-p thresholds (ops/triton/thresholds.filter_threshold) against the
reference's sort-based definition (reference/sampling.filter_threshold), value for value.

Cases that break selection code: ties at the boundary, all-equal rows, runs of -inf, NaN entries,
top-k >= V or > the finite count, top-p tiny and 1, negative and positive values, and every input
dtype (bf16 / fp16 rows select on 2 / 3 key digits, fp32 on 4)."""

import pytest
import torch
import triton
import triton.language as tl

from specdec_kernels.ops.triton.helpers import inverse_temperature
from specdec_kernels.ops.triton.thresholds import (
    bisect_threshold,
    chunk_candidates,
    filter_threshold,
    select_candidates,
)
from tests.conftest import DEVICE

from ._inputs import THRESHOLD_SETTINGS, reference_thresholds


@triton.jit
def _threshold_kernel(
    x_ptr,  # [R, V] logits
    t_ptr,  # [R] fp32 temperatures
    k_ptr,  # [R] int32 top-k (0 = off)
    p_ptr,  # [R] fp32 top-p (1 = off)
    out_ptr,  # [R] fp32 thresholds
    fast_ptr,  # [R] int32: 1 if the row took the two-pass path
    buf_ptr,  # [R, CAP] fp32 scratch
    stride_r,
    R,
    V,
    BLOCK_R: tl.constexpr,
    FILTER_BLOCK: tl.constexpr,
    CAP: tl.constexpr,
    NB_BITS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = rows < R
    _greedy, inv_t = inverse_temperature(tl.load(t_ptr + rows, mask=ok, other=1.0))
    top_k = tl.load(k_ptr + rows, mask=ok, other=0)
    top_p = tl.load(p_ptr + rows, mask=ok, other=1.0)
    row_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_r
    buf_ptrs = buf_ptr + rows[:, None].to(tl.int64) * CAP
    thr, fast = filter_threshold(row_ptrs, buf_ptrs, ok, V, inv_t, top_k, top_p, FILTER_BLOCK, CAP, NB_BITS)
    tl.store(out_ptr + rows, thr, mask=ok)
    tl.store(fast_ptr + rows, fast.to(tl.int32), mask=ok)


def _kernel_thresholds(x, temperature, top_k, top_p, block_r=2, filter_block=64, cap=4096, nb_bits=10, fast=None):
    # the cases are built on the CPU; the kernel runs where Triton does (the GPU, else the interpreter)
    R, V = x.shape
    out = torch.empty(R, dtype=torch.float32, device=DEVICE)
    fast_out = torch.empty(R, dtype=torch.int32, device=DEVICE)
    _threshold_kernel[(triton.cdiv(R, block_r),)](
        x.to(DEVICE),
        torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
        torch.tensor(top_k, dtype=torch.int32, device=DEVICE),
        torch.tensor(top_p, dtype=torch.float32, device=DEVICE),
        out,
        fast_out,
        torch.empty(R, cap, device=DEVICE),
        x.stride(0),
        R,
        V,
        BLOCK_R=block_r,
        FILTER_BLOCK=filter_block,
        CAP=cap,
        NB_BITS=nb_bits,
    )
    if fast is not None:
        fast.copy_(fast_out)
    return out.cpu()


def _check(x, temperature, top_k, top_p, **kw):
    got = _kernel_thresholds(x, temperature, top_k, top_p, **kw)
    want = reference_thresholds(x, temperature, top_k, top_p)
    assert torch.equal(got, want), (got, want)


PARAMS = THRESHOLD_SETTINGS  # one (temperature, top_k, top_p) per row


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [111, 1000])
def test_random_rows_match_reference(dtype, V):
    gen = torch.Generator().manual_seed(V)
    x = (torch.randn(len(PARAMS), V, generator=gen) * 3).to(dtype)
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    _check(x, t, k, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ties_at_the_boundary_are_kept(dtype):
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-4, 5, (len(PARAMS), 300), generator=gen).to(dtype)  # 9 values, ~33 copies each
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    _check(x, t, k, p)


def test_all_equal_rows_negative_rows_and_minus_inf_runs():
    V = 200
    x = torch.full((6, V), -3.25)
    x[1] = 2.5  # all equal, positive
    x[2, 50:] = float("-inf")  # a long -inf run: 50 finite values
    x[3, :] = float("-inf")
    x[3, 7] = 0.0  # a single finite value
    x[4] = -torch.arange(V, dtype=torch.float32)  # all negative, distinct
    x[5, ::3] = float("nan")  # NaN counts as -inf
    x[5, 1::3] = torch.linspace(-1, 1, len(range(1, V, 3)))
    t = [1.0, 0.7, 0.8, 1.0, 0.5, 1.0]
    k = [3, 10, 60, 2, 20, 5]
    p = [0.5, 0.9, 0.95, 0.5, 0.7, 1.0]
    _check(x, t, k, p)
    _check(x, t, [0] * 6, p)
    _check(x, t, k, [1.0] * 6)


def test_no_filter_rows_get_minus_inf():
    x = torch.randn(3, 100)
    got = _kernel_thresholds(x, [1.0] * 3, [0, 100, 1000], [1.0] * 3)
    assert torch.equal(got, torch.full((3,), float("-inf")))


def test_tile_width_does_not_change_the_threshold():
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(len(PARAMS), 1000, generator=gen).to(torch.bfloat16)
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    wide = _kernel_thresholds(x, t, k, p, block_r=4, filter_block=1024)
    narrow = _kernel_thresholds(x, t, k, p, block_r=1, filter_block=16)
    assert torch.equal(wide, narrow)


@pytest.mark.parametrize("cap", [16, 64])
def test_rows_with_too_many_candidates_fall_back_to_bisection(cap):
    """A small candidate buffer forces the bisection fallback on flat rows: same thresholds."""
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(len(PARAMS), 300, generator=gen) * 0.3).to(torch.bfloat16)
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    got = _kernel_thresholds(x, t, k, p, cap=cap)
    assert torch.equal(got, reference_thresholds(x, t, k, p))


def test_coarse_pivot_bins_still_exact():
    """Power check of the pivot: with 2 bins (sign only) nearly everything is a candidate, with
    2**16 the pivot is tight; both must give the reference's thresholds."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(len(PARAMS), 500, generator=gen) * 2
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    want = reference_thresholds(x, t, k, p)
    assert torch.equal(_kernel_thresholds(x, t, k, p, nb_bits=1), want)
    assert torch.equal(_kernel_thresholds(x, t, k, p, nb_bits=14, block_r=1), want)


def test_peaked_rows_take_the_two_pass_path():
    """The pivot must be tight where the kept set is small: 16 candidate slots suffice for top-k 5
    and for top-p 0.9 of a peaked row (a pivot at the lowest bin would need all 5000)."""
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(2, 5000, generator=gen)
    x[:, :3] += 12.0  # three dominant tokens
    fast = torch.empty(2, dtype=torch.int32)
    got = _kernel_thresholds(x, [1.0, 1.0], [5, 0], [1.0, 0.9], cap=16, filter_block=1024, fast=fast)
    assert fast.tolist() == [1, 1]
    assert torch.equal(got, reference_thresholds(x, [1.0, 1.0], [5, 0], [1.0, 0.9]))


def test_a_wrong_threshold_is_caught():
    """Power check of the comparison itself: a pivot one bin too high (cutting into the kept set)
    would change thresholds, and this test's reference comparison sees a 1-ulp change."""
    x = torch.randn(4, 200)
    t, k, p = [1.0] * 4, [5] * 4, [1.0] * 4
    got = _kernel_thresholds(x, t, k, p)
    assert not torch.equal(torch.nextafter(got, torch.full_like(got, float("inf"))), reference_thresholds(x, t, k, p))


# --------------------------------------------------------------------------------------------
# The split path of ops/triton/threshold_phases.py: candidates per vocabulary chunk (chunk_candidates), then the
# selection among them (select_candidates), with the bisection over the row where they do not
# decide a row - here with tiny chunks, few candidate slots and few bins, so that the union bound,
# the far bin and the fallback are all exercised.


@triton.jit
def _candidates_kernel(
    x_ptr,  # [R, V] logits
    t_ptr,  # [R] fp32 temperatures
    k_ptr,  # [R] int32 top-k
    p_ptr,  # [R] fp32 top-p
    buf_ptr,  # [R, TC, L] fp32 candidates out
    rec_ptr,  # [R, TC, 2] fp32 (max, sum-exp) out
    tau_ptr,  # [R, TC] int32 candidate bounds out
    stride_r,
    V,
    TC,
    CW: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    E: tl.constexpr,
    WITH_Z: tl.constexpr,
):
    r = tl.program_id(0)
    c = tl.program_id(1)
    one = tl.arange(0, 1)
    _greedy, inv_t = inverse_temperature(tl.load(t_ptr + r + one))
    top_k = tl.load(k_ptr + r + one)
    active = ((top_k > 0) & (top_k < V)) | (tl.load(p_ptr + r + one) < 1.0)
    slot = r * TC + c
    m, z, tau = chunk_candidates(
        x_ptr + r.to(tl.int64) * stride_r + one, buf_ptr + slot * L + one, active, c * CW, tl.minimum(c * CW + CW, V),
        inv_t, CW, L, NB, E, WITH_Z,
    )  # fmt: skip
    tl.store(rec_ptr + slot * 2 + one, m, mask=active)
    tl.store(rec_ptr + slot * 2 + 1 + one, z, mask=active)
    tl.store(tau_ptr + slot + one, tau, mask=active)


@triton.jit
def _select_kernel(
    x_ptr,
    t_ptr,
    k_ptr,
    p_ptr,
    buf_ptr,
    rec_ptr,
    tau_ptr,
    out_ptr,  # [R] fp32 thresholds
    fast_ptr,  # [R] int32: 1 if the candidates decided the row
    stride_r,
    V,
    TC,
    TCP2: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    SHIFT: tl.constexpr,
):
    r = tl.program_id(0)
    one = tl.arange(0, 1)
    _greedy, inv_t = inverse_temperature(tl.load(t_ptr + r + one))
    top_k = tl.load(k_ptr + r + one)
    top_p = tl.load(p_ptr + r + one)
    ok = one == 0
    thr, fast = select_candidates(
        buf_ptr + r * TC * L + one, rec_ptr + r * TC * 2 + one, tau_ptr + r * TC + one, TC, ok, V, inv_t, top_k,
        top_p, TCP2, L, NB, SHIFT,
    )  # fmt: skip
    slow = (((top_k > 0) & (top_k < V)) | (top_p < 1.0)) & ~fast
    row = x_ptr + r.to(tl.int64) * stride_r + one[:, None]
    exact = bisect_threshold(row, slow, V, inv_t, top_k, top_p, 1024)
    tl.store(out_ptr + r + one, tl.where(slow, exact, thr))
    tl.store(fast_ptr + r + one, fast.to(tl.int32))


_SHIFT = {torch.float32: 0, torch.float16: 13, torch.bfloat16: 16}


def _split_thresholds(x, temperature, top_k, top_p, width=64, slots=16, bins=256):
    R, V = x.shape
    tc = triton.cdiv(V, width)
    scal = (
        torch.tensor(temperature, dtype=torch.float32, device=DEVICE),
        torch.tensor(top_k, dtype=torch.int32, device=DEVICE),
        torch.tensor(top_p, dtype=torch.float32, device=DEVICE),
    )
    dtype = x.dtype
    x = x.to(DEVICE)
    buf, rec = torch.empty(R, tc, slots, device=DEVICE), torch.empty(R, tc, 2, device=DEVICE)
    tau = torch.empty(R, tc, dtype=torch.int32, device=DEVICE)
    group = 4 if x.dtype == torch.float32 else 8
    with_z = any(kk == 0 and pp < 1.0 for kk, pp in zip(top_k, top_p, strict=True))
    _candidates_kernel[(R, tc)](
        x, *scal, buf, rec, tau, x.stride(0), V, tc, CW=width, L=slots, NB=bins, E=group, WITH_Z=with_z
    )
    out, fast = torch.empty(R, device=DEVICE), torch.empty(R, dtype=torch.int32, device=DEVICE)
    _select_kernel[(R,)](
        x, *scal, buf, rec, tau, out, fast, x.stride(0), V, tc,
        TCP2=1 << (tc - 1).bit_length(), L=slots, NB=bins, SHIFT=_SHIFT[dtype],
    )  # fmt: skip
    return out.cpu(), fast.cpu()


def _check_split(x, t, k, p, **kw):
    got, fast = _split_thresholds(x, t, k, p, **kw)
    want = reference_thresholds(x, t, k, p)
    assert torch.equal(got, want), (got, want, fast)
    return fast


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V, width", [(111, 16), (1000, 64), (1000, 1024)])
def test_split_candidates_match_reference(dtype, V, width):
    gen = torch.Generator().manual_seed(V + width)
    x = (torch.randn(len(PARAMS), V, generator=gen) * 3).to(dtype)
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    _check_split(x, t, k, p, width=width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_ties_equal_rows_minus_inf_and_nan(dtype):
    gen = torch.Generator().manual_seed(3)
    ties = torch.randint(-4, 5, (len(PARAMS), 300), generator=gen).to(dtype)  # ~33 copies of 9 values
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    _check_split(ties, t, k, p, width=32)
    V = 200
    x = torch.full((6, V), -3.25)
    x[1] = 2.5  # all equal: more ties at the max than candidate slots
    x[2, 50:] = float("-inf")
    x[3, :] = float("-inf")
    x[3, 7] = 0.0
    x[4] = -torch.arange(V, dtype=torch.float32)
    x[5, ::3] = float("nan")
    x[5, 1::3] = torch.linspace(-1, 1, len(range(1, V, 3)))
    x = x.to(dtype)
    t = [1.0, 0.7, 0.8, 1.0, 0.5, 1.0]
    k = [3, 10, 60, 2, 20, 5]
    p = [0.5, 0.9, 0.95, 0.5, 0.7, 1.0]
    _check_split(x, t, k, p, width=32, slots=8)
    _check_split(x, t, [0] * 6, p, width=32, slots=8)
    _check_split(x, t, k, [1.0] * 6, width=32, slots=8)


@pytest.mark.parametrize("slots, bins", [(8, 256), (8, 4), (16, 2)])
def test_split_small_capacity_and_few_bins_stay_exact(slots, bins):
    """One group per chunk (the union rarely holds k), 2-4 bins (the k-th largest lies in the far
    bin: bisection between the bound and it): same thresholds, through the fallback where needed."""
    gen = torch.Generator().manual_seed(slots + bins)
    x = (torch.randn(len(PARAMS), 500, generator=gen) * 2).to(torch.bfloat16)
    t, k, p = (list(c) for c in zip(*PARAMS, strict=True))
    _check_split(x, t, k, p, width=32, slots=slots, bins=bins)


def test_split_peaked_rows_are_decided_by_the_candidates():
    """Power check of the union bound: 16 groups of 8 per 1024-entry chunk decide top-k 50 + top-p 0.9
    of bf16 rows of 8192 entries and top-k 5 / top-p 0.8 of peaked rows, without the bisection over
    the row."""
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 8192, generator=gen) * 2
    x[2:, :3] += 12.0  # three dominant tokens
    x = x.to(torch.bfloat16)
    fast = _check_split(x, [0.7, 1.0, 1.0, 1.0], [50, 20, 5, 0], [0.9, 1.0, 1.0, 0.8], width=1024, slots=128)
    assert fast.tolist() == [1, 1, 1, 1]


def test_split_heavy_tails_are_decided_by_the_candidates():
    """Power check of the coarse far bins: a chunk whose max stands ~350 bf16 steps above its 16th
    group still keeps 16 groups (one-step bins would keep only the max's, and every top-k would
    need the bisection over the row)."""
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(2, 8192, generator=gen) * 2
    x[:, 5] = 40.0
    x[1, 3000] = -40.0
    x = x.to(torch.bfloat16)
    fast = _check_split(x, [0.7, 1.0], [50, 30], [0.9, 1.0], width=1024, slots=128)
    assert fast.tolist() == [1, 1]
