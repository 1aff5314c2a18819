"""Microbenchmark: tree attention (``specdec_kernels.tree_attention``) against the ways engines do it today.

One attention call of a verification step: B requests, each with a committed prefix of ``prefix``
keys and a token tree of N nodes appended after it (keys [prefix, prefix + N)); queries
[B, Hq, N, D], keys/values [B, Hkv, prefix + N, D] (GQA: Hq/Hkv query heads share a KV head).
Tree node n attends the whole prefix, itself and its ancestors. Trees are random (each node hangs
under a random earlier node or the root), fixed by ``--seed``, different per request; the trees at
batch B are the first B trees at any larger batch. Providers:

* ``sdpa_dense_mask`` -- SDPA with the dense boolean mask [B, 1, N, prefix + N] Hugging Face, EAGLE
                        and Medusa build for tree verification (``_baselines.dense_tree_mask``);
                        building the mask is NOT timed (an engine reuses it in every layer).
* ``flex_attention``  -- ``torch.nn.attention.flex_attention`` (compiled) with a ``BlockMask`` of the
                        same tree; block mask and compilation not timed. CUDA only (on CPU it would
                        time an unfused fallback); skipped, not an error, when unavailable.
* ``sdpa_no_mask``    -- plain SDPA over the same queries and keys without a mask: not a correct tree
                        attention, but what reading the same KV costs with the best fused kernel.
* ``ours``            -- ``specdec_kernels.tree_attention(q, k, v, prefix_lens, parents)``, including
                        ``tree_metadata`` (one small launch) that the dense-mask provider gets for free.

GQA for SDPA (column ``gqa``; ``--sdpa-gqa``): ``enable_gqa`` passes the KV heads as they are;
``repeat`` expands K/V with ``repeat_interleave`` inside the timed call (Hugging Face's
``repeat_kv``); ``pre_repeated`` expands them once, untimed (SDPA's best case). ``auto`` (default):
``enable_gqa`` when this torch supports it, except for the masked call on CUDA, which gets
``repeat`` (masked GQA there only runs on SDPA's unfused math kernel, so Hugging Face uses
``repeat_kv`` whenever there is a mask). ``ours`` and ``flex_attention`` are GQA-native (``native``).

``--sliding-window W``: a query at position p sees only keys at positions > p - W (prefix key s is
at s, a node at prefix + depth - 1); ``sdpa_no_mask`` then reads only the last min(prefix, W)
prefix keys plus the tree, and ``bytes_read_once`` counts those keys.

``--check`` (on in ``--smoke``) compares ``ours`` and ``flex_attention`` with ``sdpa_dense_mask`` before
timing (allclose with atol = rtol = 1e-4 fp32, 1e-2 fp16, 2e-2 bf16, and the max error relative to
the largest |output| within the same tolerance); a mismatch is an error and that provider is not
timed on that shape.

Columns (``median_us``, ``GBps``, ``floor_us``, ``frac_of_floor``, ``copy_GBps``: ``bench/_common.py``):

* ``bytes_read_once`` = K and V once (2 * B * Hkv * keys * D * element size) + the queries.
* ``ratio_vs_sdpa_no_mask`` = provider median / ``sdpa_no_mask`` median, same run and shape: what
  the tree costs over plain attention on the same keys (1.0 = free).
* ``speedup_vs_dense`` = ``sdpa_dense_mask`` median / provider median, same run and shape.
* ``status``: ``ok``, or ``skipped: out of memory`` (nothing timed); ``check_max_err``: max
  |provider - sdpa_dense_mask| from ``--check``.

Issue targets, printed next to the results and not claimed by this script: at prefix >= 4096 on an
H100, ``ours`` within 1.15x of ``sdpa_no_mask`` and >= 2x faster than ``sdpa_dense_mask``.

Usage::

    python bench/bench_tree_attention.py                 # full sweep -> bench/results/tree_attention.csv
    python bench/bench_tree_attention.py --B 8 --prefix 4096 --N 32 --check
    python bench/bench_tree_attention.py --providers sdpa_no_mask ours --sdpa-gqa pre_repeated
    python bench/bench_tree_attention.py --smoke         # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import _common` when run or imported
import _common as common  # noqa: E402
from _baselines import dense_tree_mask, flex_block_mask  # noqa: E402

PROVIDERS = ("sdpa_dense_mask", "flex_attention", "sdpa_no_mask", "ours")
MASKED_PROVIDERS = ("flex_attention", "ours")  # compared with sdpa_dense_mask by --check
GQA_MODES = ("auto", "enable_gqa", "repeat", "pre_repeated")
CHECK_TOL = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 2e-2}
MAX_NODES = 64  # the kernel keeps each node's ancestor set in one int64
AXES = {
    "B": common.Axis("batch sizes", (1, 8, 32), (1, 2)),
    "prefix": common.Axis("committed prefix lengths", (512, 4096, 32768), (64,)),
    "N": common.Axis(f"tree nodes per request, <= {MAX_NODES}", (8, 32, 64), (8,)),
    "Hq": common.Axis("query heads", 32, 4, many=False),
    "Hkv": common.Axis("key/value heads", 8, 2, many=False),
    "D": common.Axis("head dim", 128, 64, many=False),
}

# Issue targets (printed next to the results; this script does not claim them).
TARGET_PREFIX, TARGET_RATIO_VS_NO_MASK, TARGET_SPEEDUP_VS_DENSE = 4096, 1.15, 2.0

SHAPE_COLUMNS = "B prefix N Hq Hkv D dtype"
CSV_COLUMNS = common.csv_columns(
    f"provider gqa status {SHAPE_COLUMNS} median_us graph_us p20_us p80_us GBps floor_us frac_of_floor "
    "ratio_vs_sdpa_no_mask speedup_vs_dense copy_GBps bytes_read_once check_max_err tree_seed sliding_window"
)
TABLE_COLUMNS = (
    f"provider gqa {SHAPE_COLUMNS} median_us graph_us p20_us p80_us floor_us frac_of_floor ratio_vs_sdpa_no_mask "
    "speedup_vs_dense check_max_err status"
).split()
TARGET_TABLE_COLUMNS = "B prefix N ratio_vs_sdpa_no_mask ratio_target speedup_vs_dense speedup_target".split()


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

    @property
    def prefix(self) -> int:
        return self.k.shape[2] - self.q.shape[2]


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
    """K and V once (2 * B * Hkv * keys * D * element size) + the queries; keys = prefix + N, or
    min(prefix, window) + N with a sliding window."""
    k, q = inputs.k, inputs.q
    keys = (inputs.prefix if window is None else min(inputs.prefix, window)) + q.shape[2]
    return 2 * k.shape[0] * k.shape[1] * keys * k.shape[3] * k.element_size() + q.numel() * q.element_size()


# --------------------------------------------------------------------------------------------
# Providers: each returns (the call, its GQA handling)
# --------------------------------------------------------------------------------------------


@functools.cache
def sdpa_supports_enable_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5); probed once on tiny CPU tensors."""
    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except (TypeError, RuntimeError):
        return False
    return True


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
    sdpa = functools.partial(F.scaled_dot_product_attention, attn_mask=mask, is_causal=False)
    if group == 1:
        return lambda: sdpa(q, k, v)
    if gqa == "enable_gqa":
        return lambda: sdpa(q, k, v, enable_gqa=True)
    if gqa == "pre_repeated":
        kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # once, untimed
        return lambda: sdpa(q, kk, vv)
    # "repeat": expand K/V in every call, as Hugging Face's repeat_kv does
    return lambda: sdpa(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))


def sdpa_dense_mask_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    gqa = sdpa_gqa_mode(args.sdpa_gqa, masked=True, device=args.device)
    mask = dense_tree_mask(inputs.parents_cpu, inputs.prefix, args.device, args.sliding_window)  # untimed
    return _sdpa_call(inputs, mask, gqa), gqa


def sdpa_no_mask_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    gqa = sdpa_gqa_mode(args.sdpa_gqa, masked=False, device=args.device)
    if args.sliding_window is not None:  # only the keys a windowed tree needs: the last W prefix keys + the tree
        first = max(0, inputs.prefix - args.sliding_window)
        inputs = dataclasses.replace(inputs, k=inputs.k[:, :, first:], v=inputs.v[:, :, first:])
    return _sdpa_call(inputs, None, gqa), gqa


def flex_unavailable(device: str) -> str | None:
    """Why the flex_attention provider cannot run here (None: it can)."""
    if not str(device).startswith("cuda"):
        return "flex_attention is only timed on CUDA (on CPU it would time an unfused fallback)"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"torch.nn.attention.flex_attention unavailable: {e}"
    return None


@functools.cache
def compiled_flex_attention():
    import torch._dynamo.config as dynamo_config
    from torch.nn.attention.flex_attention import flex_attention

    # One compiled kernel per shape: lift dynamo's recompile limit (default 8) so that a sweep never
    # silently falls back to the unfused eager implementation after the 8th shape.
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, max(getattr(dynamo_config, name), 1024))
    return torch.compile(flex_attention, dynamic=False)


def flex_attention_provider(inputs: AttentionInputs, args) -> tuple[Callable, str]:
    flex = compiled_flex_attention()
    q, k, v = inputs.q, inputs.k, inputs.v
    block_mask = flex_block_mask(inputs.parents_cpu, inputs.prefix, q.shape[1], args.device, args.sliding_window)
    gqa = q.shape[1] != k.shape[1]
    return (lambda: flex(q, k, v, block_mask=block_mask, enable_gqa=gqa)), "native"


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


def mismatch(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> tuple[float, str | None]:
    """(max abs error, problem or None): allclose and the error relative to the largest |ref|."""
    tol = CHECK_TOL[dtype]
    if tuple(out.shape) != tuple(ref.shape):
        return float("nan"), f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.float(), ref.float()
    if not bool(torch.isfinite(o).all()):
        return float("nan"), "non-finite values in the output"
    max_err = float((o - r).abs().max())
    scale = float(r.abs().max())
    if not torch.allclose(o, r, atol=tol, rtol=tol):
        return max_err, f"not allclose to sdpa_dense_mask (atol=rtol={tol}): max abs error {max_err:.3g}"
    if scale > 0 and max_err / scale > tol:
        relative = f"{max_err / scale:.3g} of the largest |output| {scale:.3g}"
        return max_err, f"max abs error {max_err:.3g} is {relative} (> {tol})"
    return max_err, None


# --------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------


def run_shape(shape: Shape, run: common.Run) -> list[dict]:
    args = run.args
    label = shape.label(args.dtype)
    columns = {**dataclasses.asdict(shape), "dtype": args.dtype, "tree_seed": args.seed}
    columns["sliding_window"] = args.sliding_window

    def skipped(provider: str, why: str) -> dict:
        status = f"skipped: {why}"
        return {**run.meta, "provider": provider, "status": status, **columns, "warmup": args.warmup, "rep": args.rep}

    try:
        inputs = make_inputs(shape, common.torch_dtype(args.dtype), args.device, args.seed)
    except Exception as e:
        if not common.is_out_of_memory(e):
            run.error(f"{label}: making inputs failed", e)
            return []
        print(f"[skip] {label}: inputs do not fit in memory", file=sys.stderr)
        common.free_device_memory(args.device)
        return [skipped(p, "out of memory (inputs)") for p in args.providers]
    nbytes = bytes_read_once(inputs, args.sliding_window)
    checked = {}  # sdpa_dense_mask's output (for --check), and each checked provider's max error

    def check(provider: str, out) -> list[str]:
        if not args.check or provider not in ("sdpa_dense_mask", *MASKED_PROVIDERS):
            return []
        if provider == "sdpa_dense_mask":
            checked["reference"] = out
            return []
        if "reference" not in checked:
            return ["--check against sdpa_dense_mask: not checked: sdpa_dense_mask did not run"]
        checked[provider], problem = mismatch(out, checked["reference"], args.dtype)
        return [f"--check against sdpa_dense_mask: {problem}"] if problem else []

    def measure(provider: str) -> dict:
        fn, gqa = PROVIDER_FACTORIES[provider](inputs, args)
        graph = provider != "flex_attention"  # flex: compiled per shape, left eager
        measured, _ = common.timed_row(fn, run, nbytes, check=lambda out: check(provider, out), graph=graph)
        row = {**run.meta, "provider": provider, "gqa": gqa, "status": "ok", **columns, **measured}
        return {**row, "check_max_err": checked.get(provider)}

    def skip(provider: str) -> str | None:
        return flex_unavailable(args.device) if provider == "flex_attention" else None

    # --check needs the dense-mask output before the providers it checks: run that provider first.
    order = sorted(args.providers, key=lambda p: p != "sdpa_dense_mask") if args.check else args.providers
    on_oom = functools.partial(skipped, why="out of memory")
    rows = common.run_providers(order, label, run, measure, skip=skip, on_oom=on_oom)
    common.ratio_columns(
        rows, "median_us", ratio_vs_sdpa_no_mask=("sdpa_no_mask", False), speedup_vs_dense=("sdpa_dense_mask", True)
    )
    return sorted(rows, key=lambda r: PROVIDERS.index(r["provider"]))


def sweep(run: common.Run) -> list[dict]:
    a = run.args
    shapes = [Shape(B, prefix, N, a.Hq, a.Hkv, a.D) for prefix in a.prefix for N in a.N for B in a.B]
    return [row for shape in shapes for row in run_shape(shape, run)]


def print_targets(run: common.Run, rows: list[dict]) -> None:
    """``ours`` at prefix >= TARGET_PREFIX next to the issue targets (measured values, no verdict)."""
    if not rows or "ours" not in run.args.providers:
        return
    print(
        f"\n# issue targets (goals, not claims): at prefix >= {TARGET_PREFIX} on an H100, ours within "
        f"{TARGET_RATIO_VS_NO_MASK}x of sdpa_no_mask and >= {TARGET_SPEEDUP_VS_DENSE:g}x faster than "
        "sdpa_dense_mask"
    )
    if "H100" not in run.meta["device"]:
        print(f"# this run is on {run.meta['device']}, not an H100: the targets do not apply to its numbers")
    selected = [
        {
            **{c: r.get(c) for c in ("B", "prefix", "N", "ratio_vs_sdpa_no_mask", "speedup_vs_dense")},
            "ratio_target": f"<= {TARGET_RATIO_VS_NO_MASK}",
            "speedup_target": f">= {TARGET_SPEEDUP_VS_DENSE:g}",
        }
        for r in rows
        if r["provider"] == "ours" and r.get("status") == "ok" and r["prefix"] >= TARGET_PREFIX
    ]
    if selected:
        common.print_table(selected, TARGET_TABLE_COLUMNS)
    else:
        print(f"# (no ours rows at prefix >= {TARGET_PREFIX} in this run)")


def parse_args(argv=None):
    p = common.make_parser(
        "tree_attention",
        "Benchmark tree attention: SDPA with a dense tree mask, flex_attention, unmasked SDPA and "
        "specdec_kernels.tree_attention. See the module docstring for the columns.",
        axes=AXES,
        providers=PROVIDERS,
        dtype_help="q/k/v dtype (default bf16; smoke: fp32)",
        smoke_help="tiny CPU-friendly run of every provider that runs here, with --check; exits non-zero on any error",
        validate_help="let sk.tree_attention run its host-side value checks (off: as in a serving hot loop)",
        seed_help="seed of the random trees and of q/k/v",
    )
    p.add_argument(
        "--sliding-window",
        type=int,
        default=None,
        help="Mistral-style window W: keys at positions > query position - W (>= every N)",
    )
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
    args = p.parse_args(argv)
    common.resolve_common(args, p, AXES, PROVIDERS)
    args.check = args.check or args.smoke
    if min(args.B) < 1 or min(args.prefix) < 0 or min(args.N) < 1 or max(args.N) > MAX_NODES:
        p.error(f"need B >= 1, prefix >= 0 and 1 <= N <= {MAX_NODES}")
    if args.sliding_window is not None and args.sliding_window < max(args.N):
        p.error("--sliding-window must be >= every N (the window covers the tree)")
    if args.Hkv < 1 or args.Hq % args.Hkv or args.D < 1:
        p.error("need Hkv >= 1, Hq a multiple of Hkv and D >= 1")
    return args


def print_header(run: common.Run) -> None:
    a = run.args
    print(
        f"# random trees (seed {a.seed}); dense-mask and block-mask construction not timed; "
        f"--sdpa-gqa {a.sdpa_gqa} (enable_gqa supported: {sdpa_supports_enable_gqa()}); "
        f"check {'on' if a.check else 'off'}"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    return common.bench_main(
        "tree_attention",
        args,
        sweep,
        table_columns=TABLE_COLUMNS,
        csv_columns=CSV_COLUMNS,
        header=print_header,
        after=print_targets,
        modules=("torch.nn.attention.flex_attention",),  # flex_attention's provider imports it lazily
    )


if __name__ == "__main__":
    sys.exit(main())
