"""Argument checking shared by the kernels and the reference, so both raise the same errors.

Shape, dtype and device checks are free (metadata only). Value checks (ids in range,
temperature >= 0, ...) read tensors and therefore synchronise with the GPU; they run when
``validate=True`` and never while a CUDA graph is being captured. The kernels are memory-safe
without them: out-of-range ids are rejected, never dereferenced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._params import FLOAT_DTYPES, INT_DTYPES, SamplingParams
from ._types import DRAFT_LOGITS, DRAFT_NONE, DRAFT_PROBS


@dataclass
class VerifyArgs:
    """Checked arguments of a chain verification."""

    target_logits: torch.Tensor  # [B, G+1, V], last dim contiguous
    draft_tokens: torch.Tensor  # [B, G] int32 | int64, last dim contiguous
    draft: torch.Tensor | None  # [B, G, V] draft logits or probs, last dim contiguous
    draft_mode: int  # DRAFT_NONE (one-hot), DRAFT_LOGITS, DRAFT_PROBS
    sampling: SamplingParams
    num_draft_tokens: torch.Tensor | None  # [B] int tensor (contiguous), None = G for every request

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
        return self.sampling.has_filter(self.V)

    def per_request_cpu(self) -> dict[str, torch.Tensor]:
        """Every per-request parameter as a [B] CPU tensor (for the reference)."""
        params = self.sampling.per_request_cpu(self.B)
        params["num_draft_tokens"] = counts_cpu(self.num_draft_tokens, self.B, self.G)
        return params


def counts_cpu(counts: torch.Tensor | None, B: int, default: int) -> torch.Tensor:
    """[B] int64 CPU copy of a per-request count (num_draft_tokens, num_nodes); None = default."""
    return counts.cpu().to(torch.int64) if counts is not None else torch.full((B,), default, dtype=torch.int64)


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
    sampling = SamplingParams.check(B, device, temperature, top_k, top_p, seed)
    num_draft_tokens = check_counts("num_draft_tokens", num_draft_tokens, B, device)
    # The kernels index drafts and vocabulary entries with stride 1 (a copy only for odd views).
    args = VerifyArgs(
        _last_dim_contiguous(target_logits),
        _last_dim_contiguous(draft_tokens),
        draft,
        mode,
        sampling,
        num_draft_tokens,
    )
    if validate and not _capturing(device) and B > 0:
        _validate_values(args)
    return args


def check_counts(name: str, counts, B: int, device) -> torch.Tensor | None:
    """A [B] int tensor of per-request counts (num_draft_tokens, num_nodes), contiguous, or None."""
    if counts is None:
        return None
    _check_tensor(name, counts, 1, INT_DTYPES, device)
    _require(counts.shape[0] == B, f"{name} must have shape [B={B}], got {tuple(counts.shape)}")
    return counts.contiguous()


def _capturing(device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_draft(draft_logits, draft_probs, lead: tuple, V: int, device):
    """(draft tensor or None, DRAFT_* mode); the tensor has shape lead + (V,)."""
    _require(draft_logits is None or draft_probs is None, "pass draft_logits or draft_probs, not both")
    for name, t, mode in (("draft_logits", draft_logits, DRAFT_LOGITS), ("draft_probs", draft_probs, DRAFT_PROBS)):
        if t is None:
            continue
        _check_tensor(name, t, len(lead) + 1, FLOAT_DTYPES, device)
        _require(t.shape[-1] == V, f"vocabulary size mismatch: {name} has V={t.shape[-1]} but target_logits has V={V}")
        dims = ", ".join(str(d) for d in lead + (V,))
        _require(tuple(t.shape[:-1]) == lead, f"{name} must have shape [{dims}], got {tuple(t.shape)}")
        return _last_dim_contiguous(t), mode
    return None, DRAFT_NONE


def _validate_values(args: VerifyArgs) -> None:
    """Checks that read tensor values (one host synchronisation)."""
    params = args.per_request_cpu()
    SamplingParams.check_values(params)
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
