"""Argument checking shared by the kernels and the reference, so both raise the same errors.

Shape, dtype and device checks are free (metadata only). Value checks (ids in range,
temperature >= 0, ...) read tensors and therefore synchronise with the GPU; they run when
``validate=True`` and never while a CUDA graph is being captured. The kernels are memory-safe
without them: out-of-range ids are rejected, never dereferenced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
INT_DTYPES = (torch.int32, torch.int64)

# Mixing constants for deriving per-request seeds from one integer seed (splitmix64-style).
_SEED_MUL = 0x5851F42D4C957F2D  # odd, < 2**63
_SEED_STEP = 0x14057B7EF767814F


@dataclass
class VerifyArgs:
    """Checked arguments. Per-request parameters stay scalars when given as scalars (the kernels
    take them as arguments, launching nothing) and [B] tensors on the device otherwise."""

    target_logits: torch.Tensor  # [B, G+1, V], last dim contiguous
    draft_tokens: torch.Tensor  # [B, G] int32 | int64
    draft: torch.Tensor | None  # [B, G, V] draft logits or probs, last dim contiguous
    draft_mode: int  # 0 none (one-hot), 1 logits, 2 probs
    temperature: torch.Tensor | float  # [B] float tensor or scalar
    top_k: torch.Tensor | int  # [B] int tensor or scalar
    top_p: torch.Tensor | float  # [B] float tensor or scalar
    num_draft_tokens: torch.Tensor | None  # [B] int tensor, None = G for every request
    seed: torch.Tensor | int  # [B] int tensor, or an int from which per-request seeds are mixed

    @property
    def B(self) -> int:
        return self.target_logits.shape[0]

    @property
    def G(self) -> int:
        return self.target_logits.shape[1] - 1

    @property
    def V(self) -> int:
        return self.target_logits.shape[2]

    @property
    def has_filter(self) -> bool:
        """Top-k or top-p may be active for some request (decided without reading tensors)."""
        k, p = self.top_k, self.top_p
        return isinstance(k, torch.Tensor) or 0 < k < self.V or isinstance(p, torch.Tensor) or p < 1.0

    def per_request_cpu(self) -> dict[str, torch.Tensor]:
        """Every per-request parameter as a [B] CPU tensor (for the reference)."""
        n = self.num_draft_tokens if self.num_draft_tokens is not None else self.G
        return per_request_cpu(self.B, self.temperature, self.top_k, self.top_p, self.seed, num_draft_tokens=n)


def per_request_cpu(B: int, temperature, top_k, top_p, seed, **counts) -> dict[str, torch.Tensor]:
    """Scalar-or-[B] parameters as [B] CPU tensors, seeds mixed as the kernels mix them."""

    def full(v, dtype):
        return v.cpu().to(dtype) if isinstance(v, torch.Tensor) else torch.full((B,), v, dtype=dtype)

    params = {
        "temperature": full(temperature, torch.float32),
        "top_k": full(top_k, torch.int64),
        "top_p": full(top_p, torch.float32),
        "seed": per_request_seeds(seed, B, "cpu"),
    }
    params.update({name: full(v, torch.int64) for name, v in counts.items()})
    return params


def _require(cond: bool, message: str, exc: type[Exception] = ValueError) -> None:
    if not cond:
        raise exc(message)


def _check_tensor(name: str, t, ndim: int, dtypes, device) -> None:
    _require(isinstance(t, torch.Tensor), f"{name} must be a torch.Tensor, got {type(t).__name__}", TypeError)
    _require(t.dim() == ndim, f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    _require(
        t.dtype in dtypes,
        f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}",
        TypeError,
    )
    _require(t.device == device, f"{name} is on {t.device} but target_logits is on {device}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _per_request(name, value, B, device, kind):
    """Check a scalar-or-[B]-tensor parameter; return it unchanged (no copy, no launch)."""
    if isinstance(value, torch.Tensor):
        _require(
            value.dim() == 1 and value.shape[0] == B,
            f"{name} must be a scalar or a [B={B}] tensor, got shape {tuple(value.shape)}",
        )
        _require(value.device == device, f"{name} is on {value.device} but target_logits is on {device}")
        if kind is int:
            _require(
                value.dtype in INT_DTYPES,
                f"{name} must be an integer tensor (int32/int64), got {value.dtype}",
                TypeError,
            )
        else:
            _require(value.dtype in FLOAT_DTYPES + INT_DTYPES, f"{name} has unsupported dtype {value.dtype}", TypeError)
        return value
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    _require(ok, f"{name} must be a {kind.__name__} or a [B] tensor, got {value!r}", TypeError)
    return kind(value)


def mix_seed(seed: int) -> int:
    """The scalar seed as the kernels take it (in [0, 2**62))."""
    return seed % (1 << 62)


def per_request_seeds(seed, B: int, device) -> torch.Tensor:
    """[B] int64 Philox keys: a [B] tensor as given, or mixed from (int seed, batch index) exactly
    as the kernels' ``request_seed`` does (int64 arithmetic wraps modulo 2**64)."""
    if isinstance(seed, torch.Tensor):
        return seed.to(device=device, dtype=torch.int64)
    index = torch.arange(B, dtype=torch.int64) + mix_seed(seed)
    mixed = index * torch.tensor(_SEED_MUL, dtype=torch.int64) + _SEED_STEP
    return (mixed ^ (mixed >> 29)).to(device)


def _check_seed(seed, B: int, device):
    """None -> a fresh random int (drawn on the host: no device work); int or [B] int tensor."""
    if seed is None:
        return int(torch.randint(0, 1 << 62, (1,)))
    if isinstance(seed, torch.Tensor):
        _require(
            seed.dim() == 1 and seed.shape[0] == B,
            f"seed must be an int or a [B={B}] tensor, got shape {tuple(seed.shape)}",
        )
        _require(seed.dtype in INT_DTYPES, f"seed must be an integer tensor, got {seed.dtype}", TypeError)
        _require(seed.device == device, f"seed is on {seed.device} but target_logits is on {device}")
        return seed
    _require(
        isinstance(seed, int) and not isinstance(seed, bool),
        f"seed must be None, an int or a [B] tensor, got {seed!r}",
        TypeError,
    )
    return seed


def check_verify_args(
    target_logits,
    draft_tokens,
    draft_logits,
    draft_probs,
    temperature,
    top_k,
    top_p,
    num_draft_tokens,
    seed,
    *,
    validate: bool = True,
) -> VerifyArgs:
    _require(isinstance(target_logits, torch.Tensor), "target_logits must be a torch.Tensor", TypeError)
    device = target_logits.device
    _check_tensor("target_logits", target_logits, 3, FLOAT_DTYPES, device)
    B, G1, V = target_logits.shape
    _require(G1 >= 1, f"target_logits must have G+1 >= 1 rows per request, got shape {tuple(target_logits.shape)}")
    _require(V >= 1, "target_logits has an empty vocabulary dimension")
    G = G1 - 1
    _check_tensor("draft_tokens", draft_tokens, 2, INT_DTYPES, device)
    _require(
        tuple(draft_tokens.shape) == (B, G),
        f"draft_tokens must have shape [B, G] = [{B}, {G}] to match target_logits "
        f"{tuple(target_logits.shape)}, got {tuple(draft_tokens.shape)}",
    )
    draft, mode = _check_draft(draft_logits, draft_probs, (B, G), V, device)
    temperature, top_k, top_p, seed = _check_sampling(temperature, top_k, top_p, seed, B, device)
    if num_draft_tokens is not None:
        _check_tensor("num_draft_tokens", num_draft_tokens, 1, INT_DTYPES, device)
        _require(
            num_draft_tokens.shape[0] == B,
            f"num_draft_tokens must have shape [B={B}], got {tuple(num_draft_tokens.shape)}",
        )
    args = VerifyArgs(
        _last_dim_contiguous(target_logits),
        draft_tokens,
        draft,
        mode,
        temperature,
        top_k,
        top_p,
        num_draft_tokens,
        seed,
    )
    if validate and not _capturing(device) and B > 0:
        _validate_values(args)
    return args


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_draft(draft_logits, draft_probs, lead: tuple, V: int, device):
    """(draft tensor or None, mode): 0 none (one-hot), 1 logits, 2 probs; shape lead + (V,)."""
    _require(draft_logits is None or draft_probs is None, "pass draft_logits or draft_probs, not both")
    for name, t, mode in (("draft_logits", draft_logits, 1), ("draft_probs", draft_probs, 2)):
        if t is None:
            continue
        _check_tensor(name, t, len(lead) + 1, FLOAT_DTYPES, device)
        _require(t.shape[-1] == V, f"vocabulary size mismatch: {name} has V={t.shape[-1]} but target_logits has V={V}")
        dims = ", ".join(str(d) for d in lead + (V,))
        _require(tuple(t.shape[:-1]) == lead, f"{name} must have shape [{dims}], got {tuple(t.shape)}")
        return _last_dim_contiguous(t), mode
    return None, 0


def _check_sampling(temperature, top_k, top_p, seed, B: int, device):
    """Per-request sampling parameters; scalars are checked here, tensor values when validating."""
    temperature = _per_request("temperature", temperature, B, device, float)
    top_k = _per_request("top_k", top_k, B, device, int)
    top_p = _per_request("top_p", top_p, B, device, float)
    seed = _check_seed(seed, B, device)
    if not isinstance(temperature, torch.Tensor):
        _require(temperature >= 0 and temperature == temperature, f"temperature must be >= 0, got {temperature}")
    if not isinstance(top_k, torch.Tensor):
        _require(top_k >= 0, f"top_k must be >= 0 (0 = off), got {top_k}")
    if not isinstance(top_p, torch.Tensor):
        _require(0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}")
    return temperature, top_k, top_p, seed


def _check_sampling_values(params: dict) -> None:
    temperature, top_k, top_p = params["temperature"], params["top_k"], params["top_p"]
    bad_t = ~(temperature >= 0)  # also catches NaN
    bad_k = top_k < 0
    bad_p = ~((top_p > 0) & (top_p <= 1))
    _require(not bool(bad_t.any()), f"temperature must be >= 0; got {temperature[bad_t][:4].tolist()}")
    _require(not bool(bad_k.any()), f"top_k must be >= 0 (0 = off); got {top_k[bad_k][:4].tolist()}")
    _require(not bool(bad_p.any()), f"top_p must be in (0, 1]; got {top_p[bad_p][:4].tolist()}")


def _validate_values(args: VerifyArgs) -> None:
    """Checks that read tensor values (one host synchronisation)."""
    params = args.per_request_cpu()
    _check_sampling_values(params)
    n, G, V = params["num_draft_tokens"], args.G, args.V
    bad_n = (n < 0) | (n > G)
    _require(not bool(bad_n.any()), f"num_draft_tokens must be in [0, G={G}]; got {n[bad_n][:4].tolist()}")
    if G > 0:
        tokens = args.draft_tokens.cpu()
        used = torch.arange(G)[None, :] < n[:, None]
        _check_ids("draft_tokens", tokens, used, V)


def _check_ids(name: str, tokens: torch.Tensor, used: torch.Tensor, V: int) -> None:
    out_of_range = used & ((tokens < 0) | (tokens >= V))
    if bool(out_of_range.any()):
        raise ValueError(f"{name} must be in [0, V={V}); got {tokens[out_of_range][:4].tolist()}")
