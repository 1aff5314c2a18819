"""The reference's NumPy Philox must reproduce Triton's tl.philox bit for bit."""

import numpy as np
import torch
import triton
import triton.language as tl

from specdec_kernels.ops.triton.helpers import race_noise, uniform_open
from specdec_kernels.reference.philox import philox4x32
from specdec_kernels.reference.philox import uniform_open as uniform_open_np
from specdec_kernels.reference.sampling import race_uniforms


@triton.jit
def _philox_probe_kernel(out_ptr, uni_ptr, seed_ptr, R: tl.constexpr, N: tl.constexpr):
    r = tl.arange(0, R)
    seed = tl.load(seed_ptr + r)[:, None]
    c0 = tl.arange(0, N)[None, :] * 7919
    c1 = r[:, None] * 0 + 5
    a, b, c, d = tl.philox(seed, c0.to(tl.uint32), c1.to(tl.uint32), (c1 * 0 + 2).to(tl.uint32), (c1 * 0).to(tl.uint32))
    offs = r[:, None] * N + tl.arange(0, N)[None, :]
    tl.store(out_ptr + 0 * R * N + offs, a.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 1 * R * N + offs, b.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 2 * R * N + offs, c.to(tl.int32, bitcast=True))
    tl.store(out_ptr + 3 * R * N + offs, d.to(tl.int32, bitcast=True))
    tl.store(uni_ptr + offs, uniform_open(seed, c0, c1, 2))


def test_philox_matches_triton(device):
    seeds = torch.tensor([0, 1, 2**40 + 7, -3, 2**63 - 1, -(2**63), 123456789, 42], dtype=torch.int64, device=device)
    R, N = seeds.numel(), 64
    out = torch.empty((4, R, N), dtype=torch.int32, device=device)
    uni = torch.empty((R, N), dtype=torch.float32, device=device)
    _philox_probe_kernel[(1,)](out, uni, seeds, R=R, N=N)
    expected = philox4x32(seeds.cpu().numpy()[:, None], (np.arange(N) * 7919)[None, :], 5, 2, 0)
    for word in range(4):
        np.testing.assert_array_equal(out[word].cpu().numpy().view(np.uint32), expected[word])
    np.testing.assert_array_equal(uni.cpu().numpy(), uniform_open_np(expected[0]))


def test_uniform_is_strictly_inside_unit_interval():
    bits = np.array([0, 1, 511, 512, 2**32 - 1, 2**31], dtype=np.uint32)
    u = uniform_open_np(bits)
    assert u.dtype == np.float32
    assert (u > 0).all() and (u < 1).all()
    assert u[0] == np.float32(2.0**-24) and u[4] == np.float32(1 - 2.0**-24)


@triton.jit
def _race_noise_probe_kernel(out_ptr, seed_ptr, R: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr):
    from_row = tl.arange(0, R)[:, None]
    seed = tl.load(seed_ptr + tl.arange(0, R))[:, None]
    for start in range(0, N, BLOCK):
        noise = race_noise(seed, start, from_row + 3, 1, BLOCK)
        tl.store(out_ptr + from_row * N + start + tl.arange(0, BLOCK)[None, :], noise)


def test_race_noise_matches_reference(device):
    seeds = torch.tensor([7, -2, 2**50 + 1, 0], dtype=torch.int64, device=device)
    R, N = 4, 64
    out = torch.empty((R, N), dtype=torch.float32, device=device)
    _race_noise_probe_kernel[(1,)](out, seeds, R=R, N=N, BLOCK=16)
    for r in range(R):
        u = race_uniforms(int(seeds[r]), N, r + 3, 1)
        expected = -np.log(-np.log(u.astype(np.float64)))
        np.testing.assert_allclose(out[r].cpu().numpy(), expected, rtol=1e-5, atol=1e-6)
