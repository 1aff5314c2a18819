"""Microbenchmark: fused speculative-decoding verification (``specdec_kernels.verify``).

What is measured
----------------
One call of chain verification for a batch of B requests, each with G draft tokens over a
vocabulary of V: target logits [B, G+1, V] and (depending on ``--mode``) draft logits [B, G, V]
in, accepted tokens and counts out. Providers:

* ``eager``     -- the PyTorch pipeline serving engines commonly run: temperature scaling, softmax
                   to full probability tensors for target and draft, sort-based top-k/top-p masking
                   (``torch.sort`` + ``cumsum``), gather p(x)/q(x), compare with ``torch.rand``,
                   first rejection via ``cumprod``, residual ``max(p - q, 0)`` normalised and sampled
                   with ``torch.multinomial``, bonus sampled from p. Vectorised, no per-request loop.
* ``reference`` -- ``specdec_kernels.reference.verify_reference`` (plain PyTorch, loops; slow). Skipped
                   when B*(G+1)*V > 5e7 unless ``--all-providers``, and timed with few repetitions.
* ``ours``      -- ``specdec_kernels.verify`` (the fused Triton kernels, ``backend="triton"``).
* ``cuda``      -- ``specdec_kernels.verify(..., backend="cuda")``: the CUDA C++ kernels of ``csrc/``
                   (prebuilt or compiled just in time on first use). Skipped, not an error, without a
                   GPU or when the extension cannot be built.
* ``auto``      -- ``specdec_kernels.verify(..., backend="auto")``, what a user gets: on CPU tensors the
                   native CPU backend (csrc compiled with OpenMP), on a GPU the faster compiled backend.
* ``vectorized`` -- ``specdec_kernels.verify(..., backend="vectorized")``: batched PyTorch ops, what auto
                   falls back to on CPU tensors when the CPU build cannot be compiled.

On CPU (``--device cpu``) rows also carry ``cpu_us``: process CPU time per call (all threads), the
steadier number on a shared machine; ``--threads`` pins torch's (and OpenMP's) thread count.

Modes: ``stochastic`` (temperature 1, draft logits), ``greedy`` (temperature 0; draft logits are
passed as a caller with a draft model would, but are not counted as must-read bytes because greedy
verification never needs them), ``ngram`` (temperature 1, no draft logits: one-hot q, as for
n-gram / prompt-lookup drafters), ``topk_topp`` (temperature 1, top_k=50, top_p=0.9), ``t0.7`` and
``t0.7_topk_topp`` (the same at temperature 0.7).

How to read a row
-----------------
* ``median_us`` (``p20_us``/``p80_us``): wall time of one call. CUDA: CUDA events around each call
  (launch gaps count when the host cannot keep the GPU fed). CPU: ``time.perf_counter``; on CPU the
  kernels run in the Triton *interpreter*, so CPU numbers only show that the script works.
* ``bytes_read_once``: the bytes any verifier must read at least once: target logits + draft logits
  (when the mode needs them) + draft tokens. Outputs are tiny and ignored.
* ``copy_GBps``: device-to-device copy bandwidth measured in this run ((read + write) / time on a
  1 GiB buffer on GPU, 64 MiB on CPU) -- the practical bandwidth ceiling of this machine.
* ``GBps`` = bytes_read_once / median time: the effective bandwidth of the provider.
* ``floor_us`` = bytes_read_once / copy bandwidth: the time a kernel that streams its inputs exactly
  once at copy speed would take; no memory-bound implementation can be much faster.
* ``frac_of_floor`` = floor_us / median_us, in (0, ~1]: the fraction of the bandwidth-bound ideal
  achieved. 1.0 means "as fast as reading the logits once"; 0.5 means the provider takes twice the
  ideal (e.g. two passes over the logits, or launch overhead at small shapes). Small shapes that fit
  in L2 (caches are not flushed between repetitions) can read above 1.
* ``speedup_vs_eager`` = eager median / provider median, both measured in this run for this shape.
* ``mean_accepted``: mean accepted drafts per request in one call -- a sanity check on the inputs.

Usage
-----
    python bench/bench_verify.py                          # full sweep -> bench/results/verify.csv
    python bench/bench_verify.py --B 1 8 --G 4 --V 128256 --providers eager ours --mode topk_topp
    python bench/bench_verify.py --providers ours cuda    # Triton vs CUDA C++ backend
    python bench/bench_verify.py --smoke                  # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import argparse
import inspect
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

_BENCH_DIR = Path(__file__).resolve().parent
if str(_BENCH_DIR) not in sys.path:  # `import _common` also when this file is imported, not run
    sys.path.insert(0, str(_BENCH_DIR))

import _common as common  # noqa: E402

PROVIDERS = ("eager", "reference", "ours", "cuda", "auto", "vectorized")
MODES = ("stochastic", "greedy", "ngram", "topk_topp", "t0.7", "t0.7_topk_topp")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

DEFAULT_B = (1, 8, 64, 256)
DEFAULT_G = (1, 4, 8)
DEFAULT_V = (32000, 128256, 151936)

SMOKE_B, SMOKE_G, SMOKE_V = (2,), (2,), (64,)

# The reference loops in Python over requests and rows; above this many logits per tensor a single
# call takes seconds, so it is skipped (unless --all-providers) and never repeated much.
REFERENCE_MAX_ELEMENTS = 5e7
REFERENCE_MAX_WARMUP = 1
REFERENCE_MAX_REP = 3

# Synthetic logits: the draft is the target plus noise, so that acceptance is neither ~0 nor ~1 and
# every branch (accept, reject + residual, bonus) is exercised.
LOGIT_SCALE = 3.0
DRAFT_NOISE = 1.0

CSV_COLUMNS = (
    "date",
    "commit",
    "device",
    "torch",
    "triton",
    "provider",
    "mode",
    "B",
    "G",
    "V",
    "dtype",
    "median_us",
    "p20_us",
    "p80_us",
    "cpu_us",
    "GBps",
    "floor_us",
    "frac_of_floor",
    "speedup_vs_eager",
    "copy_GBps",
    "bytes_read_once",
    "mean_accepted",
    "warmup",
    "rep",
    "triton_interpret",
    "cuda",
    "python",
)
TABLE_COLUMNS = (
    "provider",
    "mode",
    "B",
    "G",
    "V",
    "dtype",
    "median_us",
    "p20_us",
    "p80_us",
    "cpu_us",
    "GBps",
    "floor_us",
    "frac_of_floor",
    "speedup_vs_eager",
    "mean_accepted",
)


# --------------------------------------------------------------------------------------------
# Modes and inputs
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Mode:
    name: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    passes_draft_logits: bool = True  # False: one-hot q (n-gram drafter)
    needs_draft_logits: bool = True  # False: a verifier never has to read them (greedy)


MODE_SETTINGS = {
    "stochastic": Mode("stochastic", temperature=1.0),
    "greedy": Mode("greedy", temperature=0.0, needs_draft_logits=False),
    "ngram": Mode("ngram", temperature=1.0, passes_draft_logits=False, needs_draft_logits=False),
    "topk_topp": Mode("topk_topp", temperature=1.0, top_k=50, top_p=0.9),
    "t0.7": Mode("t0.7", temperature=0.7),
    "t0.7_topk_topp": Mode("t0.7_topk_topp", temperature=0.7, top_k=50, top_p=0.9),
}


@dataclass
class VerifyInputs:
    target_logits: torch.Tensor  # [B, G+1, V]
    draft_tokens: torch.Tensor  # [B, G] int64
    draft_logits: torch.Tensor | None  # [B, G, V] or None (ngram)
    seeds: torch.Tensor  # [B] int64, built once so no call pays a host-to-device copy for it

    @property
    def shape(self) -> tuple[int, int, int]:
        B, G1, V = self.target_logits.shape
        return B, G1 - 1, V


def make_inputs(B: int, G: int, V: int, dtype, mode: Mode, device: str, seed: int = 0) -> VerifyInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    target = torch.randn((B, G + 1, V), generator=gen, device=device, dtype=dtype).mul_(LOGIT_SCALE)
    noise = torch.randn((B, G, V), generator=gen, device=device, dtype=dtype).mul_(DRAFT_NOISE)
    draft = noise.add_(target[:, :G])
    draft_tokens = sample_draft_tokens(draft, mode, gen)
    seeds = torch.arange(B, dtype=torch.int64, device=device) + 1000 * seed
    return VerifyInputs(target, draft_tokens, draft if mode.passes_draft_logits else None, seeds)


def sample_draft_tokens(draft_logits, mode: Mode, gen) -> torch.Tensor:
    """The tokens the draft proposed: argmax for greedy, otherwise a sample from the processed q."""
    B, G, V = draft_logits.shape
    if mode.temperature == 0.0:
        return draft_logits.argmax(dim=-1)
    q = probs_from_logits(draft_logits, mode.temperature, mode.top_k, mode.top_p)
    tokens = torch.multinomial(q.view(B * G, V), 1, generator=gen).view(B, G)
    return tokens


def bytes_read_once(inputs: VerifyInputs, mode: Mode) -> int:
    """Bytes any verifier must read at least once (the bandwidth floor's numerator)."""
    t = inputs.target_logits
    n = t.numel() * t.element_size() + inputs.draft_tokens.numel() * inputs.draft_tokens.element_size()
    if inputs.draft_logits is not None and mode.needs_draft_logits:
        n += inputs.draft_logits.numel() * inputs.draft_logits.element_size()
    return n


# --------------------------------------------------------------------------------------------
# The eager baseline
# --------------------------------------------------------------------------------------------


def mask_top_k_top_p(logits, top_k: int, top_p: float):
    """Set logits outside top-k, then outside the top-p nucleus, to -inf (sort-based, as engines do)."""
    V = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if 0 < top_k < V:
        kth_largest = sorted_logits[..., V - top_k : V - top_k + 1]
        drop = sorted_logits < kth_largest
    if top_p < 1.0:
        # Ascending order: the tail whose total mass is <= 1 - top_p is what the nucleus leaves out.
        cum = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1).cumsum(dim=-1)
        drop = drop | (cum <= 1.0 - top_p)
        drop[..., -1] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def probs_from_logits(logits, temperature: float, top_k: int, top_p: float):
    """fp32 probabilities of the processed distribution: temperature, top-k, top-p, softmax."""
    x = logits.float() / temperature
    if top_k > 0 or top_p < 1.0:
        x = mask_top_k_top_p(x, top_k, top_p)
    return x.softmax(dim=-1)


def _assemble_tokens(draft_tokens, accepted_prefix, emitted):
    """[B, G+1]: accepted drafts, the emitted token at index num_accepted, then -1."""
    B, G = draft_tokens.shape
    num_accepted = accepted_prefix.sum(dim=1)
    tokens = torch.full((B, G + 1), -1, dtype=torch.int64, device=draft_tokens.device)
    tokens[:, :G] = torch.where(accepted_prefix.bool(), draft_tokens, -1)
    tokens.scatter_(1, num_accepted.view(B, 1), emitted.view(B, 1))
    return tokens, num_accepted.to(torch.int32)


def eager_verify_greedy(target_logits, draft_tokens):
    target_argmax = target_logits.argmax(dim=-1)  # [B, G+1]
    G = draft_tokens.shape[1]
    accepted_prefix = (draft_tokens == target_argmax[:, :G]).long().cumprod(dim=1)
    num_accepted = accepted_prefix.sum(dim=1)
    emitted = target_argmax.gather(1, num_accepted.view(-1, 1))
    return _assemble_tokens(draft_tokens, accepted_prefix, emitted)


def eager_verify(target_logits, draft_tokens, draft_logits=None, *, temperature=1.0, top_k=0, top_p=1.0):
    """Standard rejection-sampling verification with full probability tensors. Returns (tokens, num_accepted)."""
    if temperature == 0.0:
        return eager_verify_greedy(target_logits, draft_tokens)
    B, G = draft_tokens.shape
    V = target_logits.shape[-1]
    target_probs = probs_from_logits(target_logits, temperature, top_k, top_p)  # [B, G+1, V]
    p_rows = target_probs[:, :G]
    index = draft_tokens.unsqueeze(-1)
    p_x = p_rows.gather(-1, index).squeeze(-1)
    if draft_logits is None:  # one-hot q: q(x) = 1, residual = p without x
        q_x = torch.ones_like(p_x)
        residual = p_rows.clone().scatter_(-1, index, 0.0)
    else:
        draft_probs = probs_from_logits(draft_logits, temperature, top_k, top_p)
        q_x = draft_probs.gather(-1, index).squeeze(-1)
        residual = (p_rows - draft_probs).clamp_min_(0.0)

    u = torch.rand((B, G), device=target_logits.device)
    accepted_prefix = (u * q_x <= p_x).long().cumprod(dim=1)
    num_accepted = accepted_prefix.sum(dim=1)

    total = residual.sum(dim=-1, keepdim=True)
    # A row with p <= q everywhere is never rejected, but multinomial refuses all-zero rows:
    # give those rows a dummy unit mass that is never used.
    residual[..., :1] += (total == 0).to(residual.dtype)
    residual /= total.clamp_min_(torch.finfo(residual.dtype).tiny)
    recovered = torch.multinomial(residual.view(B * G, V), 1).view(B, G)
    bonus = torch.multinomial(target_probs[:, G], 1).view(B)

    first_rejection = num_accepted.clamp(max=G - 1).view(B, 1)
    emitted = torch.where(num_accepted == G, bonus, recovered.gather(1, first_rejection).view(B))
    return _assemble_tokens(draft_tokens, accepted_prefix, emitted)


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


def _op_kwargs(inputs: VerifyInputs, mode: Mode) -> dict:
    return dict(temperature=mode.temperature, top_k=mode.top_k, top_p=mode.top_p, seed=inputs.seeds)


def _as_pair(out):
    """(tokens, num_accepted) from either a VerifyOutput-like object or a tuple."""
    if hasattr(out, "tokens"):
        return out.tokens, out.num_accepted
    return out[0], out[1]


def eager_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    def run():
        return eager_verify(
            inputs.target_logits,
            inputs.draft_tokens,
            inputs.draft_logits,
            temperature=mode.temperature,
            top_k=mode.top_k,
            top_p=mode.top_p,
        )

    return run


def reference_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    from specdec_kernels.reference import verify_reference  # lazy: --help must work without it

    kwargs = _op_kwargs(inputs, mode)
    return lambda: _as_pair(verify_reference(inputs.target_logits, inputs.draft_tokens, inputs.draft_logits, **kwargs))


def _sk_provider(inputs: VerifyInputs, mode: Mode, validate: bool, backend: str) -> Callable:
    import specdec_kernels as sk  # lazy: TRITON_INTERPRET must be decided before this import

    kwargs = _op_kwargs(inputs, mode)
    # Host-side value checks synchronise with the device; an engine's hot loop turns them off.
    params = inspect.signature(sk.verify).parameters
    if "validate" in params:
        kwargs["validate"] = validate
    if "backend" in params:
        kwargs["backend"] = backend
    return lambda: _as_pair(sk.verify(inputs.target_logits, inputs.draft_tokens, inputs.draft_logits, **kwargs))


def ours_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    return _sk_provider(inputs, mode, validate, "triton")


def cuda_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    return _sk_provider(inputs, mode, validate, "cuda")


def cuda_unavailable(device: str) -> str | None:
    """Why the cuda provider cannot run here (None: it can); builds the extension if needed."""
    if not str(device).startswith("cuda"):
        return "the CUDA backend needs a GPU device"
    try:
        from specdec_kernels.ops import _cuda_ext

        _cuda_ext.load_cuda_extension()
    except (ImportError, RuntimeError) as e:
        return str(e).splitlines()[0][:200]
    return None


def auto_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    return _sk_provider(inputs, mode, validate, "auto")


def vectorized_provider(inputs: VerifyInputs, mode: Mode, validate: bool) -> Callable:
    return _sk_provider(inputs, mode, validate, "vectorized")


PROVIDER_FACTORIES = {
    "eager": eager_provider,
    "reference": reference_provider,
    "ours": ours_provider,
    "cuda": cuda_provider,
    "auto": auto_provider,
    "vectorized": vectorized_provider,
}


def reference_too_slow(B: int, G: int, V: int) -> bool:
    return B * (G + 1) * V > REFERENCE_MAX_ELEMENTS


# --------------------------------------------------------------------------------------------
# Checks (outside the timed region)
# --------------------------------------------------------------------------------------------


def output_problems(tokens, num_accepted, inputs: VerifyInputs) -> list[str]:
    """Structural checks any correct verifier passes; catches a provider returning garbage fast."""
    B, G, V = inputs.shape
    if tuple(tokens.shape) != (B, G + 1) or tuple(num_accepted.shape) != (B,):
        return [f"bad shapes: tokens {tuple(tokens.shape)}, num_accepted {tuple(num_accepted.shape)}"]
    problems = []
    n = num_accepted.long().cpu()
    tokens = tokens.long().cpu()
    drafts = inputs.draft_tokens.long().cpu()
    if bool(((n < 0) | (n > G)).any()):
        return [f"num_accepted out of [0, {G}]: {n.tolist()}"]
    cols = torch.arange(G + 1)
    accepted = cols[None, :G] < n[:, None]
    if not torch.equal(tokens[:, :G][accepted], drafts[accepted]):
        problems.append("accepted positions do not hold the draft tokens")
    emitted = tokens.gather(1, n.view(B, 1))
    if bool(((emitted < 0) | (emitted >= V)).any()):
        problems.append(f"emitted token out of [0, {V})")
    if bool((tokens[cols[None, :] > n[:, None]] != -1).any()):
        problems.append("positions after the emitted token are not -1")
    return problems


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


def measure_provider(provider: str, inputs: VerifyInputs, mode: Mode, args, copy_gbps: float, meta: dict):
    """Time one provider on one input set. Returns (row, (tokens, num_accepted)); raises on failure."""
    fn = PROVIDER_FACTORIES[provider](inputs, mode, args.validate)
    tokens, num_accepted = fn()  # untimed first call: output check, and compile/autotune if any
    problems = output_problems(tokens, num_accepted, inputs)
    if problems:
        raise RuntimeError(f"{provider} returned an invalid result: " + "; ".join(problems))
    warmup, rep = args.warmup, args.rep
    if provider == "reference":
        warmup, rep = min(warmup, REFERENCE_MAX_WARMUP), min(rep, REFERENCE_MAX_REP)
    timing = common.time_fn(fn, warmup=warmup, rep=rep, device=args.device)

    B, G, V = inputs.shape
    nbytes = bytes_read_once(inputs, mode)
    row = {
        **meta,
        "provider": provider,
        "mode": mode.name,
        "B": B,
        "G": G,
        "V": V,
        "dtype": args.dtype,
        **timing,
        **bandwidth_columns(nbytes, timing["median_us"], copy_gbps),
        "speedup_vs_eager": None,
        "copy_GBps": copy_gbps,
        "bytes_read_once": nbytes,
        "mean_accepted": float(num_accepted.float().mean().item()),
        "warmup": warmup,
        "rep": rep,
    }
    return row, (tokens, num_accepted)


def fill_speedup_vs_eager(rows: list[dict]) -> None:
    """Rows of one (mode, shape): speedup = eager median / provider median, if eager ran."""
    eager = next((r for r in rows if r["provider"] == "eager"), None)
    for r in rows:
        r["speedup_vs_eager"] = eager["median_us"] / r["median_us"] if eager else None


def greedy_disagreements(outputs: dict) -> list[str]:
    """Greedy verification is deterministic: every provider must emit the same tokens."""
    if len(outputs) < 2:
        return []
    (first_name, (first_tokens, _)), *others = outputs.items()
    return [
        f"greedy tokens of {name} differ from {first_name}"
        for name, (tokens, _) in others
        if not torch.equal(tokens.long().cpu(), first_tokens.long().cpu())
    ]


def free_device_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_shape(B, G, V, mode: Mode, args, copy_gbps, meta, errors: list) -> list[dict]:
    label = f"mode={mode.name} B={B} G={G} V={V} {args.dtype}"
    try:
        inputs = make_inputs(B, G, V, getattr(torch, DTYPES[args.dtype]), mode, args.device, seed=args.seed)
    except Exception as e:  # e.g. out of memory for the inputs themselves
        errors.append(f"{label}: making inputs failed: {e!r}")
        traceback.print_exc()
        return []
    rows, outputs = [], {}
    for provider in args.providers:
        if provider == "reference" and reference_too_slow(B, G, V) and not args.all_providers:
            print(
                f"[skip] reference at {label} (B*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}; --all-providers to force)",
                file=sys.stderr,
            )
            continue
        if provider == "cuda" and (why := cuda_unavailable(args.device)):
            print(f"[skip] cuda at {label}: {why}", file=sys.stderr)
            continue
        try:
            torch.manual_seed(args.seed)  # eager's torch.rand / multinomial draw from the global RNG
            row, outputs[provider] = measure_provider(provider, inputs, mode, args, copy_gbps, meta)
        except Exception as e:
            errors.append(f"{provider} at {label}: {e!r}")
            traceback.print_exc()
            free_device_memory(args.device)
            continue
        rows.append(row)
        print(
            f"[done] {provider:9s} {label}: median {row['median_us']:.1f} us, frac_of_floor {row['frac_of_floor']:.3g}",
            file=sys.stderr,
        )
    if mode.temperature == 0.0:
        errors.extend(f"{msg} at {label}" for msg in greedy_disagreements(outputs))
    fill_speedup_vs_eager(rows)
    del inputs, outputs
    free_device_memory(args.device)
    return rows


def run_sweep(args, copy_gbps: float, meta: dict, errors: list) -> list[dict]:
    rows = []
    for mode_name in args.mode:
        for V in args.V:
            for B in args.B:
                for G in args.G:
                    rows += run_shape(B, G, V, MODE_SETTINGS[mode_name], args, copy_gbps, meta, errors)
    return rows


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark speculative-decoding verification: eager PyTorch vs reference vs "
        "specdec_kernels.verify. See the module docstring for how to read frac_of_floor.",
    )
    p.add_argument("--B", type=int, nargs="+", help=f"batch sizes (default {list(DEFAULT_B)})")
    p.add_argument("--G", type=int, nargs="+", help=f"draft lengths (default {list(DEFAULT_G)})")
    p.add_argument("--V", type=int, nargs="+", help=f"vocabulary sizes (default {list(DEFAULT_V)})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all")
    p.add_argument(
        "--mode",
        nargs="+",
        choices=MODES,
        help="stochastic (default) | greedy (temperature 0) | ngram (no draft logits) | "
        "topk_topp (top_k=50, top_p=0.9); several may be given",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), help="logits dtype (default bf16; smoke: fp32)")
    common.add_output_args(p, "verify")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU-friendly run of every provider and mode; exits non-zero on any error",
    )
    p.add_argument(
        "--all-providers",
        action="store_true",
        help=f"run the reference even where B*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="let sk.verify run its host-side input checks (off: as in a serving hot loop)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed for the synthetic inputs and eager's RNG")
    p.add_argument("--threads", type=int, help="torch / OpenMP threads (CPU; default: torch's)")
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


def resolve_defaults(args, parser):
    """Fill unset options: smoke defaults in --smoke, sweep defaults otherwise; explicit flags win."""
    smoke = args.smoke
    args.B = args.B or list(SMOKE_B if smoke else DEFAULT_B)
    args.G = args.G or list(SMOKE_G if smoke else DEFAULT_G)
    args.V = args.V or list(SMOKE_V if smoke else DEFAULT_V)
    args.providers = args.providers or list(PROVIDERS)
    args.mode = args.mode or (list(MODES) if smoke else ["stochastic"])
    args.dtype = args.dtype or ("fp32" if smoke else "bf16")
    common.resolve_timing(args, parser)
    if min(args.G) < 1 or min(args.B) < 1 or min(args.V) < 2:
        parser.error("need B >= 1, G >= 1 and V >= 2")
    return args


def print_header(meta: dict, args, copy_gbps: float) -> None:
    common.print_run_header("verify", meta, args, copy_gbps)
    common.print_cpu_caveat(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.prepare_environment(args.device)  # before anything imports specdec_kernels
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)

    meta = common.environment_metadata(args.device)
    copy_gbps = common.measure_copy_bandwidth(args.device)
    print_header(meta, args, copy_gbps)

    errors: list[str] = []
    rows = run_sweep(args, copy_gbps, meta, errors)

    common.save_rows(rows, args, "verify", {**meta, "copy_GBps": copy_gbps}, TABLE_COLUMNS, CSV_COLUMNS)
    return common.exit_code(errors)


if __name__ == "__main__":
    sys.exit(main())
