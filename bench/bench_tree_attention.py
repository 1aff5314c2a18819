"""Microbenchmark: tree attention (``specdec_kernels.tree_attention``) against the ways engines do it today.

What is measured
----------------
One attention call of a verification step: B requests, each with a committed prefix of ``prefix``
keys and a token tree of N nodes appended after it (keys [prefix, prefix + N)); queries
[B, Hq, N, D], keys/values [B, Hkv, prefix + N, D] (GQA: Hq/Hkv query heads share a KV head).
Tree node n attends the whole prefix, itself and its ancestors. Trees are random (each node hangs
under a random earlier node or the root), fixed by ``--seed``, different per request; the trees at
batch B are the first B trees at any larger batch. Providers:

* ``sdpa_dense_mask`` -- ``torch.nn.functional.scaled_dot_product_attention`` with a dense boolean
                        mask [B, 1, N, prefix + N] (True = may attend): all-True over the prefix,
                        the tree's ancestor-or-self matrix over the tree keys -- the mask Hugging
                        Face, EAGLE and Medusa build for tree verification. Building the mask is
                        NOT timed (an engine builds it once per step and reuses it in every layer).
* ``flex_attention``  -- ``torch.nn.attention.flex_attention`` (compiled) with a ``BlockMask`` from
                        the same tree; creating the block mask and compiling are not timed. Only on
                        CUDA (on CPU it would time an unfused fallback); skipped, not an error, when
                        unavailable.
* ``sdpa_no_mask``    -- plain SDPA over the same queries and keys without any mask
                        (``is_causal=False``): not a correct tree attention, but the time reading the
                        same KV costs with the best fused kernel, i.e. what a tree *should* cost.
* ``ours``            -- ``specdec_kernels.tree_attention(q, k, v, prefix_lens, parents, validate=False)``.
                        The timed call includes ``tree_metadata`` (ancestor bitmasks from the parents,
                        one small launch), which the dense-mask provider gets for free.

GQA for SDPA (column ``gqa``; ``--sdpa-gqa``): ``enable_gqa`` passes the KV heads as they are;
``repeat`` expands K/V with ``repeat_interleave`` inside the timed call (what Hugging Face's
``repeat_kv`` does in every forward); ``pre_repeated`` expands them once, untimed (SDPA's best
case). ``auto`` (default): ``enable_gqa`` when this torch supports it, except for the masked call on
CUDA, which gets ``repeat`` -- masked GQA there only runs on SDPA's unfused math kernel, so Hugging
Face uses ``repeat_kv`` whenever there is a mask; without ``enable_gqa`` support, ``repeat``.
``ours`` and ``flex_attention`` handle GQA natively (``native``).

``--sliding-window W`` (Mistral-style layers): a query at position p sees only keys at positions
> p - W (prefix key s is at position s, a node at prefix + depth - 1); every masked provider applies
the window, ``sdpa_no_mask`` then reads only the last min(prefix, W) prefix keys plus the tree (the
keys a windowed tree needs), and ``bytes_read_once`` counts those keys.

``--check`` compares every masked provider (``ours``, ``flex_attention``) with ``sdpa_dense_mask`` on
each shape before timing (allclose with atol = rtol = 1e-4 fp32, 1e-2 fp16, 2e-2 bf16, and the max
error relative to the output's largest magnitude within the same tolerance); a mismatch is an
error, that provider is not timed on that shape, and the script exits non-zero. ``--smoke`` checks.

How to read a row
-----------------
* ``median_us`` (``p20_us``/``p80_us``): wall time of one call. CUDA: CUDA events around each call
  (launch gaps count when the host cannot keep the GPU fed). CPU: ``time.perf_counter``; on CPU
  ``ours`` runs in the Triton *interpreter*, so CPU numbers only show that the script works.
* ``bytes_read_once`` = 2 * B * Hkv * (prefix + N) * D * element size (K and V) + the queries: the
  bytes any attention must read at least once. The output (q's size) is ignored.
* ``copy_GBps``: device-to-device copy bandwidth measured in this run ((read + write) / time on a
  1 GiB buffer on GPU, 64 MiB on CPU) -- the practical bandwidth ceiling of this machine.
* ``GBps`` = bytes_read_once / median time: the effective bandwidth of the provider.
* ``floor_us`` = bytes_read_once / copy bandwidth: the time a kernel that streams K and V exactly
  once at copy speed would take. ``frac_of_floor`` = floor_us / median_us, in (0, ~1]; at small
  shapes launch overhead dominates and it is far below 1; shapes that fit in L2 (caches are not
  flushed between repetitions) can read above 1.
* ``ratio_vs_sdpa_no_mask`` = provider median / ``sdpa_no_mask`` median, same run, same shape:
  what the tree costs over plain attention on the same keys (1.0 = free).
* ``speedup_vs_dense`` = ``sdpa_dense_mask`` median / provider median, same run, same shape.
* ``status``: ``ok``, or ``skipped: out of memory`` (the shape did not fit; nothing timed).
* ``check_max_err``: max |provider - sdpa_dense_mask| from ``--check`` (empty without it).

Issue targets, printed next to the results and not claimed by this script: at prefix >= 4096 on an
H100, ``ours`` within 1.15x of ``sdpa_no_mask`` and >= 2x faster than ``sdpa_dense_mask``.

Usage
-----
    python bench/bench_tree_attention.py                 # full sweep -> bench/results/tree_attention.csv
    python bench/bench_tree_attention.py --B 8 --prefix 4096 --N 32 --check
    python bench/bench_tree_attention.py --providers sdpa_no_mask ours --sdpa-gqa pre_repeated
    python bench/bench_tree_attention.py --smoke         # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

_BENCH_DIR = Path(__file__).resolve().parent
if str(_BENCH_DIR) not in sys.path:  # `import _common` also when this file is imported, not run
    sys.path.insert(0, str(_BENCH_DIR))

import _common as common  # noqa: E402

PROVIDERS = ("sdpa_dense_mask", "flex_attention", "sdpa_no_mask", "ours")
MASKED_PROVIDERS = ("flex_attention", "ours")  # compared with sdpa_dense_mask by --check
GQA_MODES = ("auto", "enable_gqa", "repeat", "pre_repeated")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
CHECK_TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 2e-2}

DEFAULT_B = (1, 8, 32)
DEFAULT_PREFIX = (512, 4096, 32768)
DEFAULT_N = (8, 32, 64)
DEFAULT_HQ, DEFAULT_HKV, DEFAULT_D = 32, 8, 128

SMOKE_B, SMOKE_PREFIX, SMOKE_N = (1, 2), (64,), (8,)
SMOKE_HQ, SMOKE_HKV, SMOKE_D = 4, 2, 64

MAX_NODES = 64  # the kernel keeps each node's ancestor set in one int64

# Issue targets (printed next to the results; this script does not claim them).
TARGET_PREFIX = 4096
TARGET_RATIO_VS_NO_MASK = 1.15
TARGET_SPEEDUP_VS_DENSE = 2.0

CSV_COLUMNS = (
    "date",
    "commit",
    "device",
    "torch",
    "triton",
    "provider",
    "gqa",
    "status",
    "B",
    "prefix",
    "N",
    "Hq",
    "Hkv",
    "D",
    "dtype",
    "median_us",
    "p20_us",
    "p80_us",
    "GBps",
    "floor_us",
    "frac_of_floor",
    "ratio_vs_sdpa_no_mask",
    "speedup_vs_dense",
    "copy_GBps",
    "bytes_read_once",
    "check_max_err",
    "tree_seed",
    "sliding_window",
    "warmup",
    "rep",
    "triton_interpret",
    "cuda",
    "python",
)
TABLE_COLUMNS = (
    "provider",
    "gqa",
    "B",
    "prefix",
    "N",
    "Hq",
    "Hkv",
    "D",
    "dtype",
    "median_us",
    "p20_us",
    "p80_us",
    "floor_us",
    "frac_of_floor",
    "ratio_vs_sdpa_no_mask",
    "speedup_vs_dense",
    "check_max_err",
    "status",
)
TARGET_TABLE_COLUMNS = (
    "B",
    "prefix",
    "N",
    "ratio_vs_sdpa_no_mask",
    "ratio_target",
    "speedup_vs_dense",
    "speedup_target",
)


# --------------------------------------------------------------------------------------------
# Trees and inputs
# --------------------------------------------------------------------------------------------


def random_parents(N: int, gen: torch.Generator) -> torch.Tensor:
    """[N] int64: node n hangs under a uniformly random earlier node or the root (-1)."""
    parents = torch.empty(N, dtype=torch.int64)
    for n in range(N):
        parents[n] = int(torch.randint(-1, n, (1,), generator=gen)) if n > 0 else -1
    return parents


def random_trees(B: int, N: int, seed: int) -> torch.Tensor:
    """[B, N] parents, one random tree per request; the first b trees are the same for every B >= b."""
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([random_parents(N, gen) for _ in range(B)])


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """[B, N, N] bool: [b, n, j] iff node j is node n or one of its ancestors (parents come first)."""
    B, N = parents.shape
    anc = torch.eye(N, dtype=torch.bool).repeat(B, 1, 1)
    rows = torch.arange(B)
    for n in range(N):
        p = parents[:, n]
        inherited = anc[rows, p.clamp(min=0)] & (p >= 0)[:, None]  # the parent's row is complete
        anc[:, n] |= inherited
    return anc


def key_and_query_positions(parents: torch.Tensor, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, prefix + N] key positions, [B, N] query positions): prefix key s at s, node n at
    prefix + depth(n) - 1 (depth = size of its ancestor-or-self set)."""
    B, N = parents.shape
    node_pos = prefix + ancestor_matrix(parents).sum(-1) - 1
    keys = torch.cat([torch.arange(prefix).expand(B, prefix), node_pos], dim=1)
    return keys, node_pos


def dense_tree_mask(parents: torch.Tensor, prefix: int, device: str, window: int | None = None) -> torch.Tensor:
    """[B, 1, N, prefix + N] bool, True = may attend: ones over the prefix, the tree matrix after it
    (and, with a sliding window, only keys at positions > the query's - window)."""
    B, N = parents.shape
    tree = ancestor_matrix(parents)
    mask = torch.cat([torch.ones(B, N, prefix, dtype=torch.bool), tree], dim=-1)
    if window is not None:
        keys, queries = key_and_query_positions(parents, prefix)
        mask &= keys[:, None, :] > queries[:, :, None] - window
    return mask[:, None].to(device)


@dataclass(frozen=True)
class Shape:
    B: int
    prefix: int
    N: int
    Hq: int
    Hkv: int
    D: int

    def label(self, dtype: str) -> str:
        return f"B={self.B} prefix={self.prefix} N={self.N} H={self.Hq}/{self.Hkv} D={self.D} {dtype}"


@dataclass
class AttentionInputs:
    q: torch.Tensor  # [B, Hq, N, D]
    k: torch.Tensor  # [B, Hkv, prefix + N, D]
    v: torch.Tensor  # [B, Hkv, prefix + N, D]
    prefix_lens: torch.Tensor  # [B] int32
    parents: torch.Tensor  # [B, N] int64 (on the device)
    parents_cpu: torch.Tensor  # [B, N] int64


def make_inputs(shape: Shape, dtype, device: str, seed: int) -> AttentionInputs:
    S = shape.prefix + shape.N
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn((shape.B, shape.Hq, shape.N, shape.D), generator=gen, device=device, dtype=dtype)
    k = torch.randn((shape.B, shape.Hkv, S, shape.D), generator=gen, device=device, dtype=dtype)
    v = torch.randn((shape.B, shape.Hkv, S, shape.D), generator=gen, device=device, dtype=dtype)
    parents = random_trees(shape.B, shape.N, seed)
    prefix_lens = torch.full((shape.B,), shape.prefix, dtype=torch.int32, device=device)
    return AttentionInputs(q, k, v, prefix_lens, parents.to(device), parents)


def bytes_read_once(inputs: AttentionInputs, window: int | None = None) -> int:
    """K and V once (2 * B * Hkv * (keys) * D * element size) + the queries; keys = prefix + N, or
    min(prefix, window) + N with a sliding window."""
    k, q = inputs.k, inputs.q
    N = q.shape[2]
    prefix = k.shape[2] - N
    keys = (prefix if window is None else min(prefix, window)) + N
    kv = 2 * k.shape[0] * k.shape[1] * keys * k.shape[3] * k.element_size()
    return kv + q.numel() * q.element_size()


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


_ENABLE_GQA_SUPPORTED: bool | None = None


def sdpa_supports_enable_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5); probed once on tiny CPU tensors."""
    global _ENABLE_GQA_SUPPORTED
    if _ENABLE_GQA_SUPPORTED is None:
        q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
        try:
            F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
            _ENABLE_GQA_SUPPORTED = True
        except (TypeError, RuntimeError):
            _ENABLE_GQA_SUPPORTED = False
    return _ENABLE_GQA_SUPPORTED


def sdpa_gqa_mode(requested: str, masked: bool, device: str) -> str:
    """The GQA handling an SDPA provider uses (see the module docstring for ``auto``)."""
    if requested == "auto":
        if not sdpa_supports_enable_gqa():
            return "repeat"
        return "repeat" if masked and str(device).startswith("cuda") else "enable_gqa"
    if requested == "enable_gqa" and not sdpa_supports_enable_gqa():
        raise RuntimeError("this torch's scaled_dot_product_attention has no enable_gqa (torch >= 2.5)")
    return requested


def _sdpa_call(inputs: AttentionInputs, mask, gqa: str) -> Callable:
    q, k, v = inputs.q, inputs.k, inputs.v
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
    if gqa == "enable_gqa":
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False, enable_gqa=True)
    if gqa == "pre_repeated":
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # once, untimed
        return lambda: F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=False)

    def run():  # "repeat": expand K/V in every call, as Hugging Face's repeat_kv does
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, is_causal=False)

    return run


def sdpa_dense_mask_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    gqa = sdpa_gqa_mode(args.sdpa_gqa, masked=True, device=args.device)
    prefix = inputs.k.shape[2] - inputs.q.shape[2]
    mask = dense_tree_mask(inputs.parents_cpu, prefix, args.device, args.sliding_window)  # untimed
    return _sdpa_call(inputs, mask, gqa), gqa


def sdpa_no_mask_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    gqa = sdpa_gqa_mode(args.sdpa_gqa, masked=False, device=args.device)
    if args.sliding_window is not None:  # only the keys a windowed tree needs: the last W prefix keys + the tree
        prefix = inputs.k.shape[2] - inputs.q.shape[2]
        first = max(0, prefix - args.sliding_window)
        inputs = AttentionInputs(
            inputs.q,
            inputs.k[:, :, first:],
            inputs.v[:, :, first:],
            inputs.prefix_lens,
            inputs.parents,
            inputs.parents_cpu,
        )
    return _sdpa_call(inputs, None, gqa), gqa


_COMPILED_FLEX = None


def flex_unavailable(device: str) -> str | None:
    """Why the flex_attention provider cannot run here (None: it can)."""
    if not str(device).startswith("cuda"):
        return "flex_attention is only timed on CUDA (on CPU it would time an unfused fallback)"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch.nn.attention.flex_attention unavailable: {e}"
    return None


def flex_block_mask(parents: torch.Tensor, prefix: int, Hq: int, device: str, window: int | None = None):
    """A BlockMask for the tree: keys < prefix always, tree key prefix + j iff j is an ancestor-or-self
    (with a sliding window: and the key's position > the query's - window)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, N = parents.shape
    tree = ancestor_matrix(parents.cpu()).to(device)  # [B, N, N]
    key_pos, query_pos = (t.to(device) for t in key_and_query_positions(parents.cpu(), prefix))

    def mask_mod(b, h, q_idx, kv_idx):
        j = (kv_idx - prefix).clamp(0, N - 1)
        allowed = (kv_idx < prefix) | tree[b, q_idx, j]
        if window is None:
            return allowed
        return allowed & (key_pos[b, kv_idx] > query_pos[b, q_idx] - window)

    return create_block_mask(mask_mod, B, None, N, prefix + N, device=device)


def flex_attention_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    global _COMPILED_FLEX
    from torch.nn.attention.flex_attention import flex_attention

    if _COMPILED_FLEX is None:
        # One compiled kernel per shape: lift dynamo's recompile limit (default 8) so that a sweep never
        # silently falls back to the unfused eager implementation after the 8th shape.
        import torch._dynamo.config as dynamo_config

        for name in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo_config, name):
                setattr(dynamo_config, name, max(getattr(dynamo_config, name), 1024))
        _COMPILED_FLEX = torch.compile(flex_attention, dynamic=False)
    q, k, v = inputs.q, inputs.k, inputs.v
    block_mask = flex_block_mask(
        inputs.parents_cpu, k.shape[2] - q.shape[2], q.shape[1], args.device, args.sliding_window
    )  # untimed
    gqa = q.shape[1] != k.shape[1]
    return (lambda: _COMPILED_FLEX(q, k, v, block_mask=block_mask, enable_gqa=gqa)), "native"


def ours_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    import specdec_kernels as sk  # lazy: TRITON_INTERPRET must be decided before this import

    q, k, v, lens, parents = inputs.q, inputs.k, inputs.v, inputs.prefix_lens, inputs.parents
    # Host-side value checks synchronise with the device; an engine's hot loop turns them off.
    window = args.sliding_window
    return (lambda: sk.tree_attention(q, k, v, lens, parents, sliding_window=window, validate=args.validate)), "native"


PROVIDER_FACTORIES = {
    "sdpa_dense_mask": sdpa_dense_mask_provider,
    "flex_attention": flex_attention_provider,
    "sdpa_no_mask": sdpa_no_mask_provider,
    "ours": ours_provider,
}


# --------------------------------------------------------------------------------------------
# Checks (outside the timed region)
# --------------------------------------------------------------------------------------------


def is_out_of_memory(e: BaseException) -> bool:
    if isinstance(e, torch.cuda.OutOfMemoryError):
        return True
    text = str(e).lower()
    return isinstance(e, (RuntimeError, MemoryError)) and ("out of memory" in text or "can't allocate" in text)


def mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> tuple[float, str | None]:
    """(max abs error, problem or None): allclose and the error relative to the largest |ref|."""
    tol = CHECK_TOL[dtype]
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("nan"), "non-finite values in the output"
    err = (o - r).abs()
    max_err = float(err.max())
    scale = float(r.abs().max())
    if not torch.allclose(o, r, atol=tol, rtol=tol):
        return max_err, f"not allclose to sdpa_dense_mask (atol=rtol={tol}): max abs error {max_err:.3g}"
    if scale > 0 and max_err / scale > tol:
        relative = f"{max_err / scale:.3g} of the largest |output| {scale:.3g}"
        return max_err, f"max abs error {max_err:.3g} is {relative} (> {tol})"
    return max_err, None


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


def bandwidth_columns(nbytes: int, median_us: float, copy_gbps: float) -> dict:
    floor_us = nbytes / (copy_gbps * 1e9) * 1e6
    return {
        "GBps": nbytes / (median_us * 1e-6) / 1e9,
        "floor_us": floor_us,
        "frac_of_floor": floor_us / median_us,
    }


def shape_columns(shape: Shape, args) -> dict:
    return {
        "B": shape.B,
        "prefix": shape.prefix,
        "N": shape.N,
        "Hq": shape.Hq,
        "Hkv": shape.Hkv,
        "D": shape.D,
        "dtype": args.dtype,
        "tree_seed": args.seed,
        "sliding_window": args.sliding_window,
    }


def skipped_row(meta: dict, provider: str, shape: Shape, args, why: str, gqa: str | None = None) -> dict:
    return {
        **meta,
        "provider": provider,
        "gqa": gqa,
        "status": f"skipped: {why}",
        **shape_columns(shape, args),
        "warmup": args.warmup,
        "rep": args.rep,
    }


def fill_ratios(rows: list[dict]) -> None:
    """Rows of one shape: ratio_vs_sdpa_no_mask and speedup_vs_dense where those baselines ran."""
    timed = [r for r in rows if r.get("status") == "ok"]
    base = next((r for r in timed if r["provider"] == "sdpa_no_mask"), None)
    dense = next((r for r in timed if r["provider"] == "sdpa_dense_mask"), None)
    for r in timed:
        r["ratio_vs_sdpa_no_mask"] = r["median_us"] / base["median_us"] if base else None
        r["speedup_vs_dense"] = dense["median_us"] / r["median_us"] if dense else None


def free_device_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_shape(shape: Shape, args, copy_gbps: float, meta: dict, errors: list) -> list[dict]:
    label = shape.label(args.dtype)
    dtype = getattr(torch, DTYPES[args.dtype])
    try:
        inputs = make_inputs(shape, dtype, args.device, args.seed)
    except Exception as e:
        if is_out_of_memory(e):
            print(f"[skip] {label}: inputs do not fit in memory", file=sys.stderr)
            free_device_memory(args.device)
            return [skipped_row(meta, p, shape, args, "out of memory (inputs)") for p in args.providers]
        errors.append(f"{label}: making inputs failed: {e!r}")
        traceback.print_exc()
        return []
    nbytes = bytes_read_once(inputs, args.sliding_window)
    rows: list[dict] = []
    reference = None  # sdpa_dense_mask's output, for --check
    # --check needs the dense-mask output before the providers it checks: run that provider first.
    order = sorted(args.providers, key=lambda p: p != "sdpa_dense_mask") if args.check else args.providers
    for provider in order:
        if provider == "flex_attention" and (why := flex_unavailable(args.device)):
            print(f"[skip] flex_attention at {label}: {why}", file=sys.stderr)
            continue
        fn, gqa, check_err = None, None, None
        try:
            fn, gqa = PROVIDER_FACTORIES[provider](inputs, args)
            out = fn()  # untimed first call: the check, and compile/autotune if any
            if args.check and provider == "sdpa_dense_mask":
                reference = out
            elif args.check and provider in MASKED_PROVIDERS:
                problem = "not checked: sdpa_dense_mask did not run" if reference is None else None
                if reference is not None:
                    check_err, problem = mismatch(out, reference, args.dtype)
                if problem:
                    print(f"[FAIL] {provider} at {label}: {problem}", file=sys.stderr)
                    errors.append(f"{provider} at {label}: --check against sdpa_dense_mask: {problem}")
                    continue
            out = None
            timing = common.time_fn(fn, warmup=args.warmup, rep=args.rep, device=args.device)
        except Exception as e:
            fn = out = None
            free_device_memory(args.device)
            if is_out_of_memory(e):
                print(f"[skip] {provider} at {label}: out of memory", file=sys.stderr)
                rows.append(skipped_row(meta, provider, shape, args, "out of memory", gqa))
                continue
            errors.append(f"{provider} at {label}: {e!r}")
            traceback.print_exc()
            continue
        fn = None
        row = {
            **meta,
            "provider": provider,
            "gqa": gqa,
            "status": "ok",
            **shape_columns(shape, args),
            **timing,
            **bandwidth_columns(nbytes, timing["median_us"], copy_gbps),
            "ratio_vs_sdpa_no_mask": None,
            "speedup_vs_dense": None,
            "copy_GBps": copy_gbps,
            "bytes_read_once": nbytes,
            "check_max_err": check_err,
            "warmup": args.warmup,
            "rep": args.rep,
        }
        rows.append(row)
        print(
            f"[done] {provider:15s} {label}: median {row['median_us']:.1f} us, "
            f"frac_of_floor {row['frac_of_floor']:.3g}",
            file=sys.stderr,
        )
    fill_ratios(rows)
    rows.sort(key=lambda r: PROVIDERS.index(r["provider"]))
    del inputs, reference
    free_device_memory(args.device)
    return rows


def run_sweep(args, copy_gbps: float, meta: dict, errors: list) -> list[dict]:
    rows = []
    for prefix in args.prefix:
        for N in args.N:
            for B in args.B:
                shape = Shape(B, prefix, N, args.Hq, args.Hkv, args.D)
                rows += run_shape(shape, args, copy_gbps, meta, errors)
    return rows


def target_rows(rows: list[dict]) -> list[dict]:
    """``ours`` at prefix >= TARGET_PREFIX next to the issue targets (measured values, no verdict)."""
    out = []
    for r in rows:
        if r["provider"] != "ours" or r.get("status") != "ok" or r["prefix"] < TARGET_PREFIX:
            continue
        out.append(
            {
                "B": r["B"],
                "prefix": r["prefix"],
                "N": r["N"],
                "ratio_vs_sdpa_no_mask": r.get("ratio_vs_sdpa_no_mask"),
                "ratio_target": f"<= {TARGET_RATIO_VS_NO_MASK}",
                "speedup_vs_dense": r.get("speedup_vs_dense"),
                "speedup_target": f">= {TARGET_SPEEDUP_VS_DENSE:g}",
            }
        )
    return out


def print_targets(rows: list[dict], meta: dict) -> None:
    print(
        f"\n# issue targets (goals, not claims): at prefix >= {TARGET_PREFIX} on an H100, ours within "
        f"{TARGET_RATIO_VS_NO_MASK}x of sdpa_no_mask and >= {TARGET_SPEEDUP_VS_DENSE:g}x faster than "
        "sdpa_dense_mask"
    )
    if "H100" not in meta["device"]:
        print(f"# this run is on {meta['device']}, not an H100: the targets do not apply to its numbers")
    selected = target_rows(rows)
    if selected:
        common.print_table(selected, TARGET_TABLE_COLUMNS)
    else:
        print(f"# (no ours rows at prefix >= {TARGET_PREFIX} in this run)")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark tree attention: SDPA with a dense tree mask, flex_attention, unmasked SDPA "
        "and specdec_kernels.tree_attention. See the module docstring for the columns.",
    )
    p.add_argument("--B", type=int, nargs="+", help=f"batch sizes (default {list(DEFAULT_B)})")
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="Mistral-style window W: keys at positions > query position - W (>= every N)",
    )
    p.add_argument("--prefix", type=int, nargs="+", help=f"committed prefix lengths (default {list(DEFAULT_PREFIX)})")
    p.add_argument(
        "--N", type=int, nargs="+", help=f"tree nodes per request, <= {MAX_NODES} (default {list(DEFAULT_N)})"
    )
    p.add_argument("--Hq", type=int, help=f"query heads (default {DEFAULT_HQ}; smoke: {SMOKE_HQ})")
    p.add_argument("--Hkv", type=int, help=f"key/value heads (default {DEFAULT_HKV}; smoke: {SMOKE_HKV})")
    p.add_argument("--D", type=int, help=f"head dim (default {DEFAULT_D}; smoke: {SMOKE_D})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all")
    p.add_argument(
        "--sdpa-gqa",
        choices=GQA_MODES,
        default="auto",
        help="GQA in the SDPA providers: auto (default), enable_gqa, repeat (repeat_interleave "
        "in every call, as HF's repeat_kv), pre_repeated (expanded once, untimed)",
    )
    p.add_argument(
        "--check",
        action="store_true",
        help="compare ours and flex_attention with sdpa_dense_mask on every shape before timing",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), help="q/k/v dtype (default bf16; smoke: fp32)")
    common.add_output_args(p, "tree_attention")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU-friendly run of every provider that runs here, with --check; exits non-zero on any error",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="let sk.tree_attention run its host-side value checks (off: as in a serving hot loop)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the random trees and of q/k/v")
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


def resolve_defaults(args, parser):
    """Fill unset options: smoke defaults in --smoke, sweep defaults otherwise; explicit flags win."""
    smoke = args.smoke
    args.B = args.B or list(SMOKE_B if smoke else DEFAULT_B)
    args.prefix = args.prefix or list(SMOKE_PREFIX if smoke else DEFAULT_PREFIX)
    args.N = args.N or list(SMOKE_N if smoke else DEFAULT_N)
    args.Hq = args.Hq or (SMOKE_HQ if smoke else DEFAULT_HQ)
    args.Hkv = args.Hkv or (SMOKE_HKV if smoke else DEFAULT_HKV)
    args.D = args.D or (SMOKE_D if smoke else DEFAULT_D)
    args.providers = args.providers or list(PROVIDERS)
    args.check = args.check or smoke
    args.dtype = args.dtype or ("fp32" if smoke else "bf16")
    common.resolve_timing(args, parser)
    if min(args.B) < 1 or min(args.prefix) < 0 or min(args.N) < 1 or max(args.N) > MAX_NODES:
        parser.error(f"need B >= 1, prefix >= 0 and 1 <= N <= {MAX_NODES}")
    if args.sliding_window is not None and args.sliding_window < max(args.N):
        parser.error("--sliding-window must be >= every N (the window covers the tree)")
    if args.Hkv < 1 or args.Hq % args.Hkv or args.D < 1:
        parser.error("need Hkv >= 1, Hq a multiple of Hkv and D >= 1")
    return args


def print_header(meta: dict, args, copy_gbps: float) -> None:
    common.print_run_header("tree_attention", meta, args, copy_gbps)
    print(
        f"# random trees (seed {args.seed}); dense-mask and block-mask construction not timed; "
        f"--sdpa-gqa {args.sdpa_gqa} (enable_gqa supported: {sdpa_supports_enable_gqa()}); "
        f"check {'on' if args.check else 'off'}"
    )
    common.print_cpu_caveat(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.prepare_environment(args.device)  # before anything imports specdec_kernels

    meta = common.environment_metadata(args.device)
    copy_gbps = common.measure_copy_bandwidth(args.device)
    print_header(meta, args, copy_gbps)

    errors: list[str] = []
    rows = run_sweep(args, copy_gbps, meta, errors)

    common.save_rows(rows, args, "tree_attention", {**meta, "copy_GBps": copy_gbps}, TABLE_COLUMNS, CSV_COLUMNS)
    if rows and "ours" in args.providers:
        print_targets(rows, meta)
    return common.exit_code(errors)


if __name__ == "__main__":
    sys.exit(main())
