"""Philox4x32-10 in NumPy, bit-identical to Triton's ``tl.philox``.

The kernels draw every random number from Philox keyed by the request's 64-bit seed, with the
counter ``(c0, c1, c2, c3)`` naming *what* the number is for (vocab index, draft row, purpose).
Re-implementing the generator here lets the reference reproduce the kernels' random numbers
exactly, so kernel and reference can be compared token for token.
"""

from __future__ import annotations

import numpy as np
import torch

_ROUND_A = np.uint64(0xD2511F53)
_ROUND_B = np.uint64(0xCD9E8D57)
_KEY_A = np.uint64(0x9E3779B9)
_KEY_B = np.uint64(0xBB67AE85)
_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)

# 23 random bits -> (k + 0.5) * 2**-23 is exact in float32 and lies strictly inside (0, 1).
UNIFORM_BITS = 23


def philox4x32(seed, c0, c1, c2, c3, n_rounds: int = 10):
    """Philox4x32 with key = 64-bit ``seed`` (low word k0, high word k1); arrays broadcast.

    Returns four uint32 arrays, as ``tl.philox(seed, c0, c1, c2, c3)`` does.
    """
    seed = np.asarray(seed).astype(np.int64).view(np.uint64)
    k0 = seed & _MASK32
    k1 = (seed >> _SHIFT32) & _MASK32
    c0, c1, c2, c3, k0, k1 = np.broadcast_arrays(
        *(np.asarray(v).astype(np.uint64) & _MASK32 for v in (c0, c1, c2, c3)), k0, k1
    )
    c0, c1, c2, c3, k0, k1 = (np.array(v, dtype=np.uint64) for v in (c0, c1, c2, c3, k0, k1))
    for _ in range(n_rounds):
        prod_b = _ROUND_B * c2  # < 2**64: both factors are 32-bit
        prod_a = _ROUND_A * c0
        new_c0 = (prod_b >> _SHIFT32) ^ c1 ^ k0
        new_c2 = (prod_a >> _SHIFT32) ^ c3 ^ k1
        c1 = prod_b & _MASK32
        c3 = prod_a & _MASK32
        c0, c2 = new_c0 & _MASK32, new_c2 & _MASK32
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return tuple(v.astype(np.uint32) for v in (c0, c1, c2, c3))


def uniform_open(bits: np.ndarray) -> np.ndarray:
    """uint32 -> float32 uniform on (0, 1): ``((bits >> 9) + 0.5) * 2**-23``.

    Never 0 (so ``u * q <= p`` cannot accept a token with p = 0) and never 1 (so -log(u) > 0).
    """
    k = (np.asarray(bits, dtype=np.uint32) >> np.uint32(32 - UNIFORM_BITS)).astype(np.float32)
    return ((k + np.float32(0.5)) * np.float32(2.0**-UNIFORM_BITS)).astype(np.float32)


# ---- the same generator on torch tensors (any device), for the vocabulary-parallel path ----------

_MASK32_I = 0xFFFFFFFF


def _mulhilo32(a: int, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * c for a 32-bit constant and int64 tensors c in [0, 2**32).

    The product can reach 2**64, past int64; split c into 16-bit halves so nothing overflows."""
    t_hi = a * (c >> 16)  # < 2**48
    t_lo = a * (c & 0xFFFF)  # < 2**48
    s = ((t_hi & 0xFFFF) << 16) + t_lo  # < 2**49
    return (t_hi >> 16) + (s >> 32), s & _MASK32_I


def philox4x32_torch(seed: torch.Tensor, c0, c1, c2, c3, n_rounds: int = 10):
    """:func:`philox4x32` on int64 torch tensors (broadcast; any device): four int64 tensors
    holding the uint32 words, bit-identical to the NumPy version and to ``tl.philox``."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    k0, k1 = seed & _MASK32_I, (seed >> 32) & _MASK32_I
    dev = seed.device
    c0, c1, c2, c3 = (torch.as_tensor(v, dtype=torch.int64, device=dev) & _MASK32_I for v in (c0, c1, c2, c3))
    c0, c1, c2, c3, k0, k1 = torch.broadcast_tensors(c0, c1, c2, c3, k0, k1)
    for _ in range(n_rounds):
        hi_b, lo_b = _mulhilo32(int(_ROUND_B), c2)
        hi_a, lo_a = _mulhilo32(int(_ROUND_A), c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + int(_KEY_A)) & _MASK32_I
        k1 = (k1 + int(_KEY_B)) & _MASK32_I
    return c0, c1, c2, c3


def uniform_open_torch(bits: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_open` on int64 tensors of uint32 words: float32 uniforms in (0, 1)."""
    k = (bits >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (k + 0.5) * (2.0**-UNIFORM_BITS)
