"""``SamplingParams``: the sampling parameters of a verification call, normalised once.

Every parameter is a scalar (the same for every request) or a ``[B]`` tensor (one value per
request). Scalars stay Python numbers all the way to the kernels, which take them as arguments
(a call with plain parameters launches no fill kernels); tensors stay on the device. Every backend
(Triton, csrc, the reference) and the Hugging Face driver read the parameters from here, so a new
sampling parameter touches this type, the kernels, the reference and csrc only.

Value rules (checked for scalars always, for tensors when ``validate=True``):

* ``temperature``: 0 = greedy; otherwise a finite float32 >= 2**-126 (the smallest normal float32).
  Smaller positive values would overflow ``1 / T`` and are rejected; with ``validate=False`` the
  kernels treat them as greedy (the limit T -> 0, lowest index on ties).
* ``top_k``: 0 = off; values >= V keep the whole vocabulary (also off). Any int64 is honoured.
* ``top_p``: in (0, 1]; 1 = off.
* ``top_p_ties`` (one value for the call): which tokens of the tie group at the top-p boundary
  stay. Order the kept-by-top-k tokens by descending logit; top-p keeps a token when the mass
  ordered before it is < top_p of the total.

  - ``"keep"`` (default; every kernel): equal logits are one token for this test: the whole tie
    group at the boundary stays (the smallest set of whole tie groups holding top_p of the mass).
  - ``"by_index"``: among equal logits the higher token index comes first, so only the tie
    group's highest-index tokens that pass the test stay (4 equal logits, top_p = 0.5: tokens 2
    and 3). This is transformers' ``TopPLogitsWarper`` (ascending ``torch.sort``, drop cumulative
    mass <= 1 - top_p) when its sort is stable; the count it keeps is the same either way. The
    reference, the vectorized backend, the Triton kernels and the CPU build implement it (a
    threshold plus an index cut: x > thr, or x == thr at an index >= the cut); the CUDA build and
    vocabulary shards raise ValueError when top_p can be < 1 (the rule changes nothing otherwise).
* ``seed``: an int (per-request keys are mixed from (seed, b)) or a [B] int tensor of keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)

# Smallest positive temperature (the smallest normal float32): 1/T stays finite in float32.
MIN_TEMPERATURE = 2.0**-126
MAX_FLOAT32 = float(torch.finfo(torch.float32).max)

# Integer seeds are taken modulo SEED_RANGE (``mix_seed``) and random ones drawn below it: the
# kernels add the batch index to the mixed seed in int64, which cannot overflow from below 2**62.
SEED_RANGE = 1 << 62

# SamplingParams.top_p_ties: the whole boundary tie group stays, or ties broken by token index
# (higher index first: transformers' TopPLogitsWarper). The custom ops carry it as its index.
TOP_P_TIES = ("keep", "by_index")

# Scalars the kernels take as int32 / the custom ops as floats are clamped to this (top_k >= V is off).
_INT32_MAX = 2**31 - 1

# Mixing constants for deriving per-request seeds from one integer seed (splitmix64-style).
_SEED_MUL = 0x5851F42D4C957F2D  # odd, < 2**63
_SEED_STEP = 0x14057B7EF767814F


def check_top_p_ties(top_p_ties) -> None:
    """ValueError unless ``top_p_ties`` is one of ``TOP_P_TIES``."""
    if not isinstance(top_p_ties, str) or top_p_ties not in TOP_P_TIES:
        _fail(f"top_p_ties must be one of {TOP_P_TIES}, got {top_p_ties!r}")


def _fail(message: str, exc: type[Exception] = ValueError):
    raise exc(message)


def mix_seed(seed: int) -> int:
    """The scalar seed as the kernels take it (in [0, SEED_RANGE))."""
    return seed % SEED_RANGE


def per_request_seeds(seed, B: int, device) -> torch.Tensor:
    """[B] int64 Philox keys: a [B] tensor as given, or mixed from (int seed, batch index) exactly
    as the kernels' ``request_seed`` does (int64 arithmetic wraps modulo 2**64)."""
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    index = torch.arange(B, dtype=torch.int64) + mix_seed(seed)
    mixed = index * torch.tensor(_SEED_MUL, dtype=torch.int64) + _SEED_STEP
    return (mixed ^ (mixed >> 29)).to(device)


def check_temperature_value(t: float, name: str = "temperature") -> float:
    """A scalar temperature, or ValueError naming it (used by the ops, the driver and the CLI)."""
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        _fail(f"{name} must be a float, got {t!r}", TypeError)
    t = float(t)
    if math.isnan(t) or t < 0:
        _fail(f"{name} must be >= 0 (0 = greedy), got {t}")
    if t > MAX_FLOAT32:
        _fail(f"{name} must be finite in float32 (at most {MAX_FLOAT32:.4g}), got {t}")
    if 0 < t < MIN_TEMPERATURE:
        _fail(f"{name} must be 0 (greedy) or >= 2**-126 (1/T overflows float32 below), got {t}")
    return t


def _per_request(name: str, value, B: int, device, kind: type):
    """Check a scalar-or-[B]-tensor parameter. Tensors keep their values (no launch) and are made
    contiguous: the kernels read them at ``ptr + b``."""
    if type(value) is kind:  # a plain float / int (bool is not an int here): nothing to convert
        return value
    if isinstance(value, torch.Tensor):
        if value.dim() != 1 or value.shape[0] != B:
            _fail(f"{name} must be a scalar or a [B={B}] tensor, got shape {tuple(value.shape)}")
        if value.device != device:
            _fail(f"{name} is on {value.device} but target_logits is on {device}")
        allowed = INT_DTYPES if kind is int else FLOAT_DTYPES + INT_DTYPES
        if value.dtype not in allowed:
            what = "an integer tensor (int32/int64)" if kind is int else "a float or integer tensor"
            _fail(f"{name} must be {what}, got {value.dtype}", TypeError)
        return value.contiguous()
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok:
        _fail(f"{name} must be a {kind.__name__} or a [B] tensor, got {value!r}", TypeError)
    return kind(value)


@dataclass
class SamplingParams:
    """Checked per-request sampling parameters (scalars or contiguous [B] tensors on the device)."""

    temperature: torch.Tensor | float
    top_k: torch.Tensor | int
    top_p: torch.Tensor | float
    seed: torch.Tensor | int
    top_p_ties: str = "keep"

    @classmethod
    def check(cls, B: int, device, temperature=1.0, top_k=0, top_p=1.0, seed=None, top_p_ties="keep") -> SamplingParams:
        """Type/shape checks of everything and value checks of the scalars (no host sync)."""
        check_top_p_ties(top_p_ties)
        temperature = _per_request("temperature", temperature, B, device, float)
        top_k = _per_request("top_k", top_k, B, device, int)
        top_p = _per_request("top_p", top_p, B, device, float)
        if not isinstance(temperature, torch.Tensor):
            temperature = check_temperature_value(temperature)
        if not isinstance(top_k, torch.Tensor) and top_k < 0:
            _fail(f"top_k must be >= 0 (0 = off), got {top_k}")
        if not isinstance(top_p, torch.Tensor) and not (0.0 < top_p <= 1.0):
            _fail(f"top_p must be in (0, 1], got {top_p}")
        return cls(temperature, top_k, top_p, _check_seed(seed, B, device), top_p_ties)

    # ---- properties decided without reading tensors

    def has_filter(self, V: int) -> bool:
        """Top-k or top-p may be active for some request."""
        k, p = self.top_k, self.top_p
        return isinstance(k, torch.Tensor) or 0 < k < V or isinstance(p, torch.Tensor) or p < 1.0

    def ties_by_index(self) -> bool:
        """The ``"by_index"`` top-p tie rule with top-p possibly active (the CUDA build and vocabulary
        shards refuse it; the Triton kernels compile its index cuts only then)."""
        p, greedy = self.top_p, isinstance(self.temperature, float) and self.temperature == 0.0
        return self.top_p_ties == "by_index" and not greedy and (isinstance(p, torch.Tensor) or p < 1.0)

    def shape_class(self, V: int) -> tuple:
        """(greedy or "tensor", filtered) for the auto backend's measurement cache."""
        t = self.temperature
        return ("tensor" if isinstance(t, torch.Tensor) else t == 0.0), self.has_filter(V)

    # ---- host copies and value checks (one synchronisation)

    def per_request_cpu(self, B: int) -> dict[str, torch.Tensor]:
        """Every parameter as a [B] CPU tensor, seeds mixed as the kernels mix them."""

        def full(v, dtype):
            return v.cpu().to(dtype) if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dtype)

        return {
            "temperature": full(self.temperature, torch.float32),
            "top_k": full(self.top_k, torch.int64),
            "top_p": full(self.top_p, torch.float32),
            "seed": per_request_seeds(self.seed, B, "cpu"),
        }

    @staticmethod
    def check_values(params: dict[str, torch.Tensor]) -> None:
        """Value checks of host copies (``per_request_cpu``); ValueError naming the parameter."""
        for name in _VALUE_RULES:
            _check_host_values(name, params[name])

    def check_tensor_values(self) -> bool:
        """``check_values`` without building [B] copies of scalars: the per-request tensors are
        checked (a host copy of each; ValueError as there), the scalars not read. False, having
        checked nothing, when a scalar could still fail ``check_values`` (its float32 / int64 host
        copy out of range, which ``check`` does not see): then run ``check_values`` instead."""
        k, p = self.top_k, self.top_p
        if not isinstance(k, torch.Tensor) and k > _INT64_MAX:
            return False
        if not isinstance(p, torch.Tensor) and p < _MIN_FLOAT32_SUBNORMAL:
            return False  # rounds to 0 in float32 (temperature scalars cannot: MIN_TEMPERATURE is normal)
        for name, (dtype, _) in _VALUE_RULES.items():
            value = getattr(self, name)
            if isinstance(value, torch.Tensor):
                _check_host_values(name, value.cpu().to(dtype))
        return True

    # ---- how the backends take them

    def kernel_args(self, dummy: torch.Tensor) -> dict[str, tuple]:
        """name -> (pointer, scalar, per-request flag) for the kernels: a [B] tensor is passed as
        the pointer (scalar unused), a scalar as the value (pointer unused). The seed scalar is
        already mixed into [0, 2**62); top_k scalars are clamped to int32 (>= V means off)."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "top_p_ties":  # a constexpr of the launches (BY_INDEX), not a kernel argument
                continue
            if isinstance(value, torch.Tensor):
                out[f.name] = (value, 0, True)
            elif f.name == "seed":
                out[f.name] = (dummy, mix_seed(value), False)
            elif f.name == "top_k":
                out[f.name] = (dummy, min(value, _INT32_MAX), False)
            else:
                out[f.name] = (dummy, value, False)
        return out

    def op_args(
        self, with_ties: bool = False
    ) -> tuple[list[torch.Tensor | None], list[float], torch.Tensor | None, int]:
        """Flat form for the torch.library custom ops: (tensors, float scalars, seed tensor, seed int);
        ``with_ties``: the floats end with the index of ``top_p_ties`` in ``TOP_P_TIES`` (the
        custom ops carry it; the csrc calls take the first three floats)."""
        t_t, t, k_t, k, p_t, p, seed_t, seed = self.flat_args()
        floats = [t, float(k), p, float(TOP_P_TIES.index(self.top_p_ties))] if with_ties else [t, float(k), p]
        return [t_t, k_t, p_t], floats, seed_t, seed

    def flat_args(self) -> tuple:
        """(temperature tensor or None, float, top_k tensor or None, int, top_p tensor or None, float,
        seed tensor or None, int): the order the csrc calls take them (``op_args`` lists them). A
        scalar's slot holds it (numbers clamped to int32, the seed mixed) and its tensor slot None;
        a tensor's scalar slot holds 0. Written out, no loop: it runs on every call."""
        t, k, p, seed = self.temperature, self.top_k, self.top_p, self.seed
        t_t = t if isinstance(t, torch.Tensor) else None
        k_t = k if isinstance(k, torch.Tensor) else None
        p_t = p if isinstance(p, torch.Tensor) else None
        seed_t = seed if isinstance(seed, torch.Tensor) else None
        return (
            t_t, 0.0 if t_t is not None else float(t if t < _INT32_MAX else _INT32_MAX),
            k_t, 0 if k_t is not None else (k if k < _INT32_MAX else _INT32_MAX),
            p_t, 0.0 if p_t is not None else float(p if p < _INT32_MAX else _INT32_MAX),
            seed_t, 0 if seed_t is not None else mix_seed(seed),
        )  # fmt: skip

    @classmethod
    def from_op_args(cls, tensors, floats, seed_t, seed) -> SamplingParams:
        floats, ties = (floats[:3], floats[3]) if len(floats) > 3 else (floats, 0)
        t, k, p = (tensor if tensor is not None else value for tensor, value in zip(tensors, floats, strict=True))
        seed = seed_t if seed_t is not None else seed
        return cls(t, k if isinstance(k, torch.Tensor) else int(k), p, seed, TOP_P_TIES[int(ties)])


# Value rules of the per-request parameters on their host copies (``check_values``): name ->
# (host dtype, the entries that break the rule). The errors say what the rule is and list up to 4 values.
_VALUE_RULES = {
    "temperature": (torch.float32, lambda t: ~((t == 0) | ((t >= MIN_TEMPERATURE) & (t <= MAX_FLOAT32)))),  # NaN too
    "top_k": (torch.int64, lambda k: k < 0),
    "top_p": (torch.float32, lambda p: ~((p > 0) & (p <= 1))),
}
_VALUE_ERRORS = {
    "temperature": "temperature must be >= 0 (0 = greedy), finite in float32 and not in (0, 2**-126) where 1/T "
    "overflows",
    "top_k": "top_k must be >= 0 (0 = off)",
    "top_p": "top_p must be in (0, 1]",
}
# The host copies of scalars that SamplingParams.check passed can only fail there when a top_k
# does not fit int64 or a top_p rounds to 0 in float32 (below the smallest subnormal float32).
_INT64_MAX = 2**63 - 1
_MIN_FLOAT32_SUBNORMAL = 2.0**-149


def _check_host_values(name: str, values: torch.Tensor) -> None:
    bad = _VALUE_RULES[name][1](values)
    if bool(bad.any()):
        _fail(f"{_VALUE_ERRORS[name]}; got {values[bad][:4].tolist()}")


def _check_seed(seed, B: int, device):
    """None -> a fresh random int (drawn on the host: no device work); int or [B] int tensor."""
    if seed is None:
        return int(torch.randint(0, 1 << 62, (1,)))
    if isinstance(seed, torch.Tensor):
        if seed.dim() != 1 or seed.shape[0] != B:
            _fail(f"seed must be an int or a [B={B}] tensor, got shape {tuple(seed.shape)}")
        if seed.dtype not in INT_DTYPES:
            _fail(f"seed must be an integer tensor, got {seed.dtype}", TypeError)
        if seed.device != device:
            _fail(f"seed is on {seed.device} but target_logits is on {device}")
        return seed.contiguous()
    if isinstance(seed, bool) or not isinstance(seed, int):
        _fail(f"seed must be None, an int or a [B] tensor, got {seed!r}", TypeError)
    return seed
