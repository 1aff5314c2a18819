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


# ---- the same generator on torch tensors (any device): the vocabulary-parallel path and the ------
# ---- vectorized backend draw their numbers here ------------------------------------------------

_MASK32_I = 0xFFFFFFFF


def philox4x32_torch(seed: torch.Tensor, c0, c1, c2, c3, n_rounds: int = 10):
    """:func:`philox4x32` on int64 torch tensors (broadcast; any device): four int64 tensors
    holding the uint32 words, bit-identical to the NumPy version and to ``tl.philox``.

    A round's products of two 32-bit words reach 2**64, past int64: the multiplication wraps
    modulo 2**64, which leaves exactly the bits of the unsigned product, and its high word is
    taken with an (arithmetic) shift and a mask. The keys keep the seed's shape (the key schedule
    is per seed); the counters are expanded to the broadcast shape once, so a round updates them
    in place."""
    seed = torch.as_tensor(seed, dtype=torch.int64)
    dev = seed.device
    k0, k1 = seed & _MASK32_I, (seed >> 32) & _MASK32_I
    counters = [torch.as_tensor(v, dtype=torch.int64, device=dev) & _MASK32_I for v in (c0, c1, c2, c3)]
    shape = torch.broadcast_shapes(seed.shape, *(c.shape for c in counters))
    c0, c1, c2, c3 = (c.expand(shape) for c in counters)
    for _ in range(n_rounds):
        prod_b = c2 * int(_ROUND_B)  # wraps modulo 2**64: the bits of the unsigned product
        prod_a = c0 * int(_ROUND_A)
        new_c0 = (prod_b >> 32).bitwise_and_(_MASK32_I).bitwise_xor_(c1).bitwise_xor_(k0)
        new_c2 = (prod_a >> 32).bitwise_and_(_MASK32_I).bitwise_xor_(c3).bitwise_xor_(k1)
        c0, c1, c2, c3 = new_c0, prod_b.bitwise_and_(_MASK32_I), new_c2, prod_a.bitwise_and_(_MASK32_I)
        k0 = (k0 + int(_KEY_A)) & _MASK32_I
        k1 = (k1 + int(_KEY_B)) & _MASK32_I
    return c0, c1, c2, c3


def uniform_open_torch(bits: torch.Tensor) -> torch.Tensor:
    """:func:`uniform_open` on int64 tensors of uint32 words: float32 uniforms in (0, 1)."""
    k = (bits >> (32 - UNIFORM_BITS)).to(torch.float32)
    return (k + 0.5) * (2.0**-UNIFORM_BITS)
