"""Argument checking shared by the kernels and the reference, so both raise the same errors.

Shape, dtype and device checks are free (metadata only). Value checks (ids in range,
temperature >= 0, ...) read tensors and therefore synchronise with the GPU; they run when
``validate=True`` and never while a CUDA graph is being captured. The kernels are memory-safe
without them: out-of-range ids are rejected, never dereferenced.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._bitmask import check_token_bitmask, padded_mask
from ._params import FLOAT_DTYPES, INT_DTYPES, MAX_FLOAT32, MIN_TEMPERATURE, SamplingParams
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
    # Flattened ragged layout (engines' own): target_logits [N + B, V], draft_tokens [N], draft [N, V];
    # request b owns drafts cu[b] .. cu[b+1]-1 and target rows cu[b] + b .. cu[b+1] + b.
    cu: torch.Tensor | None = None  # [B+1] int64, contiguous; num_draft_tokens = its differences
    max_drafts: int = 0  # G of the flattened layout (the output width is G + 1)
    token_bitmask: torch.Tensor | None = None  # [*target rows, ceil(V/32)] int32 grammar words (_bitmask)

    @property
    def B(self) -> int:
        return self.target_logits.shape[0] if self.cu is None else self.cu.shape[0] - 1

    @property
    def G(self) -> int:
        return self.target_logits.shape[1] - 1 if self.cu is None else self.max_drafts

    @property
    def V(self) -> int:
        return self.target_logits.shape[-1]

    def padded(self) -> VerifyArgs:
        """The same call in the padded ``[B, G+1, V]`` layout, for backends without a flattened path.

        A gather: one copy of the rows (the Triton kernels read the flattened layout in place)."""
        if self.cu is None:
            return self
        B, G, V, dev = self.B, self.G, self.V, self.target_logits.device
        start = self.cu[:-1]
        n = self.num_draft_tokens
        pos = torch.arange(G + 1, device=dev)
        t_rows = start[:, None] + torch.arange(B, device=dev)[:, None] + torch.minimum(pos[None, :], n[:, None])
        target = self.target_logits[t_rows]
        N = self.draft_tokens.shape[0]
        if N == 0:  # no request drafted anything: nothing below is ever read
            tokens = torch.zeros((B, G), dtype=self.draft_tokens.dtype, device=dev)
            draft = None if self.draft is None else self.draft.new_zeros((B, G, V))
        else:
            d_rows = (start[:, None] + pos[None, :G]).clamp(max=N - 1)
            tokens = self.draft_tokens[d_rows]
            draft = None if self.draft is None else self.draft[d_rows]
        mask = padded_mask(self.token_bitmask, t_rows)
        return VerifyArgs(target, tokens, draft, self.draft_mode, self.sampling, n, token_bitmask=mask)

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
    # Runs on every call, validate=False too: messages are formatted only on failure (formatting them
    # eagerly was ~60% of the host time of a small sk.verify call).
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d) for d in dtypes)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but target_logits is on {device}")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    if t.stride()[-1] == 1:  # (stride() then [-1] is cheaper than stride(-1): runs on every call)
        return t
    # An empty tensor counts as contiguous whatever its strides, so .contiguous() would keep them.
    return t.contiguous() if t.numel() else t.new_empty(t.shape)


def check_target(target_logits, ndim: int):
    """The device of target_logits, which must be a float tensor of `ndim` dimensions."""
    _require(isinstance(target_logits, torch.Tensor), "target_logits must be a torch.Tensor", TypeError)
    device = target_logits.device
    _check_tensor("target_logits", target_logits, ndim, FLOAT_DTYPES, device)
    return device


def check_verify_args(
    target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, num_draft_tokens, seed, *,
    validate: bool = True, top_p_ties: str = "keep",
) -> VerifyArgs:  # fmt: skip
    """Checked arguments of the padded layout (``[B, G+1, V]`` target rows; see ``sk.verify``)."""
    device = check_target(target_logits, 3)
    B, G1, V = shape = target_logits.shape
    if G1 < 1:
        raise ValueError(f"target_logits must have G+1 >= 1 rows per request, got shape {tuple(target_logits.shape)}")
    _require(V >= 1, "target_logits has an empty vocabulary dimension")
    G = G1 - 1
    _check_tensor("draft_tokens", draft_tokens, 2, INT_DTYPES, device)
    if draft_tokens.shape != (B, G):  # (torch.Size == tuple)
        raise ValueError(
            f"draft_tokens must have shape [B, G] = [{B}, {G}] to match target_logits "
            f"{tuple(shape)}, got {tuple(draft_tokens.shape)}"
        )
    draft, mode = _check_draft(draft_logits, draft_probs, (B, G), V, device)
    sampling = SamplingParams.check(B, device, temperature, top_k, top_p, seed, top_p_ties)
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
    if validate and B > 0 and not _capturing(device):
        _validate_values(args)
    return args


def check_verify_call(
    target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, num_draft_tokens, seed, *,
    cu_num_draft_tokens=None, max_num_draft_tokens=None, target_probs=None, logits_scaled: bool = False,
    validate: bool = True, top_p_ties: str = "keep", sharded: bool = False, token_bitmask=None,
) -> VerifyArgs:  # fmt: skip
    """The checked arguments of an ``sk.verify`` call, padded or flattened (``cu_num_draft_tokens``):
    the target as logits (``target_input``), the temperature of pre-scaled logits
    (``unit_temperature``), the layout's checks; `sharded` (vocabulary shards): values are checked
    after the shards exchange their layout, and the by_index tie rule is refused; `token_bitmask`:
    checked against the target rows (``_bitmask``)."""
    target_logits = target_input(target_logits, target_probs)
    if logits_scaled:
        temperature = unit_temperature(temperature)
    validate = validate and not sharded
    if cu_num_draft_tokens is not None:
        if num_draft_tokens is not None:
            raise ValueError("pass num_draft_tokens or cu_num_draft_tokens, not both (cu implies the counts)")
        args = check_flat_verify_args(
            target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, cu_num_draft_tokens,
            max_num_draft_tokens, seed, validate=validate, top_p_ties=top_p_ties,
        )  # fmt: skip
    else:
        if max_num_draft_tokens is not None:
            raise ValueError("max_num_draft_tokens belongs to the flattened layout (cu_num_draft_tokens=)")
        args = check_verify_args(
            target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, num_draft_tokens, seed,
            validate=validate, top_p_ties=top_p_ties,
        )  # fmt: skip
    if sharded:
        check_sharded_ties(args)
    if token_bitmask is not None:  # (None stays None: nothing to check)
        layout = "[B, G+1, W]" if cu_num_draft_tokens is None else "[N + B, W]"
        target = args.target_logits
        args.token_bitmask = check_token_bitmask(token_bitmask, target.shape[:-1], args.V, target.device, layout)
    return args


def check_flat_verify_args(
    target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, cu_num_draft_tokens,
    max_num_draft_tokens, seed, *, validate: bool = True, top_p_ties: str = "keep",
) -> VerifyArgs:  # fmt: skip
    """Checked arguments of the flattened ragged layout (``cu_num_draft_tokens``; see ``sk.verify``)."""
    device = check_target(target_logits, 2)
    _check_tensor("draft_tokens", draft_tokens, 1, INT_DTYPES, device)
    _check_tensor("cu_num_draft_tokens", cu_num_draft_tokens, 1, INT_DTYPES, device)
    T, V = target_logits.shape
    N = draft_tokens.shape[0]
    B = cu_num_draft_tokens.shape[0] - 1
    _require(B >= 0, "cu_num_draft_tokens must have B+1 >= 1 entries (it starts with 0)")
    _require(V >= 1, "target_logits has an empty vocabulary dimension")
    _require(
        T == N + B,
        f"flattened layout: target_logits must have N + B = {N} + {B} rows (every draft position plus "
        f"one bonus row per request), got {T}",
    )
    draft, mode = _check_draft(draft_logits, draft_probs, (N,), V, device)
    # Clamped so that unchecked offsets (validate=False) can never address rows outside the inputs.
    cu = cu_num_draft_tokens.to(torch.int64).clamp(0, N).contiguous()
    counts = (cu[1:] - cu[:-1]).clamp(min=0)
    if max_num_draft_tokens is None:
        G = int(counts.max()) if B > 0 else 0  # one host synchronisation; pass max_num_draft_tokens
    else:
        _require(
            isinstance(max_num_draft_tokens, int) and not isinstance(max_num_draft_tokens, bool),
            f"max_num_draft_tokens must be an int, got {max_num_draft_tokens!r}",
            TypeError,
        )
        G = max_num_draft_tokens
    _require(G >= 0, f"max_num_draft_tokens must be >= 0, got {G}")
    sampling = SamplingParams.check(B, device, temperature, top_k, top_p, seed, top_p_ties)
    args = VerifyArgs(
        _last_dim_contiguous(target_logits),
        draft_tokens.contiguous(),
        draft,
        mode,
        sampling,
        counts.clamp(max=G),
        cu=cu,
        max_drafts=G,
    )
    if validate and not _capturing(device) and B > 0:
        host_cu = cu_num_draft_tokens.cpu().to(torch.int64)
        n = host_cu[1:] - host_cu[:-1]
        _require(
            int(host_cu[0]) == 0 and int(host_cu[-1]) == N and bool((n >= 0).all()),
            f"cu_num_draft_tokens must start at 0, never decrease and end at N = {N} (the number of "
            f"draft tokens); got {host_cu[:8].tolist()}{' ...' if B > 7 else ''}",
        )
        _require(
            int(n.max()) <= G,
            f"a request has {int(n.max())} drafts but max_num_draft_tokens = {G}",
        )
        SamplingParams.check_values(args.sampling.per_request_cpu(B))
        _check_ids("draft_tokens", draft_tokens.cpu(), torch.ones(N, dtype=torch.bool), V)
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
    if draft_logits is not None:
        _require(draft_probs is None, "pass draft_logits or draft_probs, not both")
        name, t, mode = "draft_logits", draft_logits, DRAFT_LOGITS
    elif draft_probs is not None:
        name, t, mode = "draft_probs", draft_probs, DRAFT_PROBS
    else:
        return None, DRAFT_NONE
    _check_tensor(name, t, len(lead) + 1, FLOAT_DTYPES, device)
    shape = t.shape
    if shape != (*lead, V):  # one comparison; the messages below say which part differs
        if shape[-1] != V:
            raise ValueError(f"vocabulary size mismatch: {name} has V={shape[-1]} but target_logits has V={V}")
        dims = ", ".join(str(d) for d in lead + (V,))
        raise ValueError(f"{name} must have shape [{dims}], got {tuple(shape)}")
    return _last_dim_contiguous(t), mode


def _validate_values(args: VerifyArgs, V: int | None = None) -> None:
    """Checks that read tensor values (one host synchronisation). V: the vocabulary the draft ids
    index (default the logits' last dimension; the full vocabulary for vocabulary shards)."""
    G, V = args.G, args.V if V is None else V
    # Every request using all G drafts (the common call): no [B] copies of counts or scalars, one
    # reduction for the ids; anything out of range takes the general checks below for their error.
    if args.num_draft_tokens is None and _ids_in_range(args.draft_tokens, V):
        if args.sampling.check_tensor_values():
            return
    params = args.per_request_cpu()
    SamplingParams.check_values(params)
    n = params["num_draft_tokens"]
    bad_n = (n < 0) | (n > G)
    _require(not bool(bad_n.any()), f"num_draft_tokens must be in [0, G={G}]; got {n[bad_n][:4].tolist()}")
    if G > 0:
        tokens = args.draft_tokens.cpu()
        used = torch.arange(G)[None, :] < n[:, None]
        _check_ids("draft_tokens", tokens, used, V)


def _ids_in_range(tokens: torch.Tensor, V: int) -> bool:
    """Every id in [0, V) (one min/max reduction, one host read; nothing to read in an empty tensor)."""
    if tokens.numel() == 0:
        return True
    lo, hi = torch.stack(torch.aminmax(tokens)).tolist()
    return lo >= 0 and hi < V


def _check_ids(name: str, tokens: torch.Tensor, used: torch.Tensor, V: int) -> None:
    out_of_range = used & ((tokens < 0) | (tokens >= V))
    if bool(out_of_range.any()):
        raise ValueError(f"{name} must be in [0, V={V}); got {tokens[out_of_range][:4].tolist()}")


def validate_sharded_verify_values(args: VerifyArgs, V: int) -> None:
    """Value checks of a vocabulary-parallel call (``process_group=``): draft ids are global ids,
    checked against the full vocabulary V (the sum of the shards)."""
    if args.B > 0:
        _validate_values(args.padded(), V)


def check_vocab_size_use(process_group, vocab_size) -> None:
    if vocab_size is not None and process_group is None:
        raise ValueError("vocab_size= describes vocabulary shards: it needs process_group=")


def check_sharded_ties(args) -> None:
    if args.sampling.ties_by_index():
        raise ValueError("top_p_ties='by_index' is not implemented for vocabulary shards (process_group=) yet")


def check_out_dtype(out_dtype) -> None:
    if out_dtype not in (torch.int64, torch.int32):
        raise TypeError(f"out_dtype must be torch.int64 or torch.int32 (as engines hold token ids), got {out_dtype!r}")


def target_input(target_logits, target_probs):
    """The target as logits: target_logits as given, or log(target_probs) (0 -> -inf; NaN, +inf
    and negative entries become NaN / +inf, which the kernels flag as non-finite)."""
    if target_probs is None:
        if target_logits is None:
            raise TypeError("pass target_logits or target_probs")
        return target_logits
    if target_logits is not None:
        raise ValueError("pass target_logits or target_probs, not both")
    if not isinstance(target_probs, torch.Tensor):
        raise TypeError(f"target_probs must be a torch.Tensor, got {type(target_probs).__name__}")
    if not target_probs.is_floating_point():
        raise TypeError(f"target_probs has dtype {target_probs.dtype}; it must be a float tensor")
    p = target_probs.float()
    return torch.where(p < 0, torch.full_like(p, float("nan")), torch.log(p))


def unit_temperature(temperature):
    """Temperature for logits already divided by it: 1 for sampled requests, 0 (greedy) kept, and
    unusable values (NaN, inf, negative, subnormal) kept as given so the usual checks report them."""
    if isinstance(temperature, torch.Tensor):
        usable = (temperature >= MIN_TEMPERATURE) & (temperature <= MAX_FLOAT32)
        return torch.where(usable, torch.ones_like(temperature), temperature)
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool):
        if MIN_TEMPERATURE <= temperature <= MAX_FLOAT32:
            return 1.0
    return temperature
