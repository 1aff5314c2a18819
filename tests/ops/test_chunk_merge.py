"""The merge of the row pass's per-chunk records (ops/triton/chunk_merge.merge_chunk_stats) against
a left-to-right merge written in PyTorch: one chunk after the other, as the records define it.

The merge kernel reads tiles of chunks; what must not change: the greedy index is the first chunk's
among those holding the row's max (ties across chunks, across tiles too), NaN maxima never win, rows
with every chunk at -inf keep index 0, non-finite counts add up, and (max, sum-exp) equal the
sequential merge up to rounding."""

import math

import pytest
import torch

from specdec_kernels.ops.triton.chunk_merge import MERGE_MAX_CHUNKS, merge_chunk_stats, merge_tiles
from tests.conftest import DEVICE


def _sequential(stats, idx, inv_t):
    """[R, 7], [R] from [R, C, 7] / [R, C, 1]: combine_chunk_records' loop, in float64."""
    R, C, _ = stats.shape
    s = stats.double()
    out = torch.zeros(R, 7, dtype=torch.float64)
    gidx = torch.zeros(R, dtype=torch.int32)
    for r in range(R):
        m = {0: -math.inf, 2: -math.inf}
        z = {0: 0.0, 2: 0.0}
        gmax = -math.inf
        bad = [0.0, 0.0]
        for c in range(C):
            rec = s[r, c].tolist()
            for k in (0, 2):
                m_new = max(m[k], rec[k])
                ref = 0.0 if m_new == -math.inf else m_new
                z[k] = z[k] * math.exp((m[k] - ref) * inv_t[r]) + rec[k + 1] * math.exp((rec[k] - ref) * inv_t[r])
                m[k] = m_new
            if rec[4] > gmax:  # strict, NaN never
                gmax, gidx[r] = rec[4], int(idx[r, c, 0])
            bad[0] += rec[5]
            bad[1] += rec[6]
        out[r] = torch.tensor([m[0], z[0], m[2], z[2], gmax, bad[0], bad[1]], dtype=torch.float64)
    return out, gidx


def _records(R, C, gen, ties=False):
    stats = torch.empty(R, C, 7)
    stats[..., 0] = torch.randn(R, C, generator=gen) * 3
    stats[..., 1] = torch.rand(R, C, generator=gen) * 50 + 1
    stats[..., 2] = torch.randn(R, C, generator=gen) * 3
    stats[..., 3] = torch.rand(R, C, generator=gen) * 50 + 1
    # greedy maxima: integers in a narrow range, so ties across chunks are common with `ties`
    gm = torch.randint(0, 4 if ties else 10**6, (R, C), generator=gen).float()
    stats[..., 4] = gm
    stats[..., 5] = torch.randint(0, 2, (R, C), generator=gen).float()
    stats[..., 6] = torch.randint(0, 2, (R, C), generator=gen).float()
    # each chunk's own argmax lies in its own vocabulary range: chunk c covers [1000c, 1000c + 1000)
    own = torch.randint(0, 1000, (R, C, 1), generator=gen, dtype=torch.int32)
    idx = (torch.arange(C, dtype=torch.int32) * 1000)[None, :, None] + own
    return stats, idx


def _merge(stats, idx, temperature):
    R, C, _ = stats.shape
    t = torch.tensor(temperature, dtype=torch.float32, device=DEVICE)
    whole, whole_idx = merge_chunk_stats(stats.to(DEVICE), idx.to(DEVICE), R, 1, t, 1.0, True)
    return whole.cpu()[:, 0], whole_idx.cpu()[:, 0, 0]


def _check(stats, idx, temperature):
    R = stats.shape[0]
    inv_t = [1.0 / t for t in temperature]
    want, want_idx = _sequential(stats, idx, inv_t)
    got, got_idx = _merge(stats, idx, temperature)
    assert torch.equal(got_idx, want_idx), (got_idx, want_idx)
    for col in (0, 2, 4, 5, 6):  # maxima and counts: exact
        assert torch.equal(got[:, col].double(), want[:, col]), col
    for col in (1, 3):  # sums of exponentials: rounding of another order
        torch.testing.assert_close(got[:, col].double(), want[:, col], rtol=2e-5, atol=0)
    assert got.shape == (R, 7)


@pytest.mark.parametrize("R, C", [(1, 2), (5, 90), (3, MERGE_MAX_CHUNKS + 37), (130, 3), (7, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_merge_equals_a_sequential_merge(R, C, ties):
    gen = torch.Generator().manual_seed(R * 1000 + C + ties)
    stats, idx = _records(R, C, gen, ties)
    _check(stats, idx, [0.7 + 0.1 * (r % 5) for r in range(R)])


def test_nan_maxima_minus_inf_rows_and_ties_across_tiles():
    """Row 0: NaN greedy maxima never win; row 1: every chunk -inf (index 0, max -inf, sum 0);
    row 2: the max is tied in the first and the last tile (the first tile's chunk wins);
    row 3: the max only in the last tile."""
    C = MERGE_MAX_CHUNKS + 5
    gen = torch.Generator().manual_seed(3)
    stats, idx = _records(4, C, gen)
    stats[0, ::3, 4] = float("nan")
    stats[1, :, :5] = torch.tensor([float("-inf"), 0.0, float("-inf"), 0.0, float("-inf")])
    stats[2, :, 4] = 1.0
    stats[2, [10, C - 2], 4] = 7.0
    stats[3, :, 4] = 1.0
    stats[3, C - 1, 4] = 9.0
    _check(stats, idx, [1.0, 1.0, 0.5, 2.0])
    got, got_idx = _merge(stats, idx, [1.0, 1.0, 0.5, 2.0])
    assert got_idx[1] == 0 and got[1, 0] == float("-inf") and got[1, 1] == 0
    assert got_idx[2] == idx[2, 10, 0] and got_idx[3] == idx[3, C - 1, 0]


def test_tiles_fit_the_tile_budget():
    assert merge_tiles(5, 90) == (8, 128)
    assert merge_tiles(1000, 3) == (128, 4)
    assert merge_tiles(2, 5000) == (2, MERGE_MAX_CHUNKS)
    for rows in (1, 7, 320, 5000):
        for chunks in (1, 2, 90, 600):
            r, c = merge_tiles(rows, chunks)
            assert r * c <= 4096 and c >= min(chunks, MERGE_MAX_CHUNKS)
