"""Microbenchmark: fused speculative-decoding verification (``specdec_kernels.verify``).

One call of chain verification for B requests, each with G draft tokens over a vocabulary of V:
target logits [B, G+1, V] and (depending on ``--mode``) draft logits [B, G, V] in, accepted tokens
and counts out. Providers:

* ``eager``     -- the PyTorch pipeline serving engines commonly run (``_baselines.eager_verify``:
                   full probability tensors, sort-based top-k/top-p, ``torch.multinomial``).
* ``reference`` -- ``specdec_kernels.reference.verify_reference`` (plain PyTorch, loops; slow). Skipped
                   when B*(G+1)*V > 5e7 unless ``--all-providers``, and timed with few repetitions.
* ``ours``      -- ``specdec_kernels.verify`` (the fused Triton kernels, ``backend="triton"``).
* ``cuda``      -- ``backend="cuda"``: the CUDA C++ kernels of ``csrc/`` (prebuilt or compiled just in
                   time). Skipped, not an error, without a GPU or when the extension cannot be built.
* ``auto``      -- ``backend="auto"``, what a user gets: the native CPU build on CPU tensors, the
                   faster compiled backend on a GPU.
* ``vectorized`` -- ``backend="vectorized"``: batched PyTorch ops, what auto falls back to on CPU
                   tensors when the CPU build cannot be compiled.

Modes: ``stochastic`` (temperature 1, draft logits), ``greedy`` (temperature 0; draft logits are
passed but not counted as must-read bytes: greedy verification never needs them), ``ngram``
(temperature 1, no draft logits: one-hot q, as for n-gram / prompt-lookup drafters),
``topk_topp`` (temperature 1, top_k=50, top_p=0.9), ``t0.7`` and ``t0.7_topk_topp`` (the same
at temperature 0.7), ``t0.7_topk_topp_logprobs`` (that with ``return_logprobs=True,
num_logprobs=5``: the post-pass's cost, for the sk providers), ``t0.7_topk_topp_logprobs0`` and
``greedy_logprobs0`` (``return_logprobs=True`` alone, with ``t0.7_topk_topp`` / ``greedy``),
``grammar`` (stochastic with ``token_bitmask=``: a random grammar mask allowing half the
vocabulary, the drafts allowed; eager masks the target and draft rows by hand first, as engines do
today; compare its rows with ``stochastic`` for the cost of the mask), ``t0.7_block`` and
``t0.7_topk_topp_block`` (``t0.7`` / ``t0.7_topk_topp`` with ``method="block"``: block
verification, for the providers that implement it - auto, vectorized; compare with the token-rule
rows of the same run).

Columns (``median_us``, ``GBps``, ``floor_us``, ``frac_of_floor``, ``copy_GBps``: ``bench/_common.py``):

* ``bytes_read_once``: target logits + draft logits (when the mode needs them) + draft tokens.
* ``speedup_vs_eager`` = eager median / provider median, both measured in this run for this shape.
* ``mean_accepted``: mean accepted drafts per request in one call -- a sanity check on the inputs.

Usage::

    python bench/bench_verify.py                          # full sweep -> bench/results/verify.csv
    python bench/bench_verify.py --B 1 8 --G 4 --V 128256 --providers eager ours --mode topk_topp
    python bench/bench_verify.py --providers ours cuda    # Triton vs CUDA C++ backend
    python bench/bench_verify.py --smoke                  # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import _common` when run or imported
import _common as common  # noqa: E402
from _baselines import eager_verify, probs_from_logits  # noqa: E402

PROVIDERS = ("eager", "reference", "ours", "cuda", "auto", "vectorized")
# Providers also timed as a CUDA-graph replay (graph_us): compiled kernels, no host synchronisation.
GRAPH_PROVIDERS = ("ours", "cuda")
MODES = (
    "stochastic", "greedy", "ngram", "topk_topp", "t0.7", "t0.7_topk_topp", "t0.7_topk_topp_logprobs",
    "t0.7_topk_topp_logprobs0", "greedy_logprobs0", "grammar", "t0.7_block", "t0.7_topk_topp_block",
)  # fmt: skip
BLOCK_PROVIDERS = ("auto", "vectorized")  # those running method="block" (the reference: too slow here)
AXES = {
    "B": common.Axis("batch sizes", (1, 8, 64, 256), (2,)),
    "G": common.Axis("draft lengths", (1, 4, 8), (2,)),
    "V": common.Axis("vocabulary sizes", (32000, 128256, 151936), (64,)),
}

# The reference loops in Python over requests and rows; above this many logits per tensor a single
# call takes seconds, so it is skipped (unless --all-providers) and never repeated much.
REFERENCE_MAX_ELEMENTS = 5e7
REFERENCE_MAX_WARMUP, REFERENCE_MAX_REP = 1, 3

# Synthetic logits: the draft is the target plus noise, so that acceptance is neither ~0 nor ~1 and
# every branch (accept, reject + residual, bonus) is exercised.
LOGIT_SCALE, DRAFT_NOISE = 3.0, 1.0

CSV_COLUMNS = common.csv_columns(
    "provider mode B G V dtype threads median_us graph_us p20_us p80_us cpu_us GBps floor_us frac_of_floor "
    "speedup_vs_eager copy_GBps bytes_read_once mean_accepted"
)
TABLE_COLUMNS = (
    "provider mode B G V dtype median_us graph_us p20_us p80_us cpu_us GBps floor_us frac_of_floor speedup_vs_eager "
    "mean_accepted"
).split()


@dataclass(frozen=True)
class Mode:
    name: str
    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    passes_draft_logits: bool = True  # False: one-hot q (n-gram drafter)
    needs_draft_logits: bool = True  # False: a verifier never has to read them (greedy)
    num_logprobs: int | None = None  # return_logprobs=True with this many top logprobs (sk providers only)
    grammar_mask: bool = False  # True: a token_bitmask of int32 words per target row
    method: str = "token"  # sk.verify's method ("block": block verification)


MODE_SETTINGS = {
    "stochastic": Mode("stochastic", temperature=1.0),
    "greedy": Mode("greedy", temperature=0.0, needs_draft_logits=False),
    "ngram": Mode("ngram", temperature=1.0, passes_draft_logits=False, needs_draft_logits=False),
    "topk_topp": Mode("topk_topp", temperature=1.0, top_k=50, top_p=0.9),
    "t0.7": Mode("t0.7", temperature=0.7),
    "t0.7_topk_topp": Mode("t0.7_topk_topp", temperature=0.7, top_k=50, top_p=0.9),
    # the cost of return_logprobs (the post-pass): compare with the t0.7_topk_topp rows
    "t0.7_topk_topp_logprobs": Mode("t0.7_topk_topp_logprobs", temperature=0.7, top_k=50, top_p=0.9, num_logprobs=5),
    # return_logprobs=True without top-n (the CPU build computes it in its row pass): compare with
    # the t0.7_topk_topp / greedy rows
    "t0.7_topk_topp_logprobs0": Mode("t0.7_topk_topp_logprobs0", temperature=0.7, top_k=50, top_p=0.9, num_logprobs=0),
    "greedy_logprobs0": Mode("greedy_logprobs0", temperature=0.0, needs_draft_logits=False, num_logprobs=0),
    "grammar": Mode("grammar", temperature=1.0, grammar_mask=True),
    # block verification: compare with the t0.7 / t0.7_topk_topp rows
    "t0.7_block": Mode("t0.7_block", temperature=0.7, method="block"),
    "t0.7_topk_topp_block": Mode("t0.7_topk_topp_block", temperature=0.7, top_k=50, top_p=0.9, method="block"),
}
GRAMMAR_ALLOWED = 0.5  # share of the vocabulary the synthetic grammar mask allows


# --------------------------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------------------------


@dataclass
class VerifyInputs:
    target_logits: torch.Tensor  # [B, G+1, V]
    draft_tokens: torch.Tensor  # [B, G] int64
    draft_logits: torch.Tensor | None  # [B, G, V] or None (ngram)
    seeds: torch.Tensor  # [B] int64, built once so no call pays a host-to-device copy for it
    token_bitmask: torch.Tensor | None = None  # [B, G+1, ceil(V/32)] int32 (mode "grammar")

    @property
    def shape(self) -> tuple[int, int, int]:
        B, G1, V = self.target_logits.shape
        return B, G1 - 1, V


def make_inputs(B: int, G: int, V: int, dtype, mode: Mode, device: str, seed: int = 0) -> VerifyInputs:
    gen = torch.Generator(device=device).manual_seed(seed)
    target = torch.randn((B, G + 1, V), generator=gen, device=device, dtype=dtype).mul_(LOGIT_SCALE)
    draft = torch.randn((B, G, V), generator=gen, device=device, dtype=dtype).mul_(DRAFT_NOISE).add_(target[:, :G])
    if mode.temperature == 0.0:  # the tokens the draft proposed: argmax, or a sample from the processed q
        draft_tokens = draft.argmax(dim=-1)
    else:
        q = probs_from_logits(draft, mode.temperature, mode.top_k, mode.top_p)
        draft_tokens = torch.multinomial(q.view(B * G, V), 1, generator=gen).view(B, G)
    seeds = torch.arange(B, dtype=torch.int64, device=device) + 1000 * seed
    mask = None
    if mode.grammar_mask:  # random allowed half; each draft allowed at its own row
        from specdec_kernels._bitmask import pack  # lazy: TRITON_INTERPRET must be decided before this import

        allowed = torch.rand((B, G + 1, V), generator=gen, device=device) < GRAMMAR_ALLOWED
        allowed[:, :G].scatter_(-1, draft_tokens[..., None], True)
        mask = pack(allowed)
    return VerifyInputs(target, draft_tokens, draft if mode.passes_draft_logits else None, seeds, mask)


def bytes_read_once(inputs: VerifyInputs, mode: Mode) -> int:
    """Bytes any verifier must read at least once (the bandwidth floor's numerator)."""
    t, tokens, draft = inputs.target_logits, inputs.draft_tokens, inputs.draft_logits
    n = t.numel() * t.element_size() + tokens.numel() * tokens.element_size()
    if draft is not None and mode.needs_draft_logits:
        n += draft.numel() * draft.element_size()
    if inputs.token_bitmask is not None:
        n += inputs.token_bitmask.numel() * inputs.token_bitmask.element_size()
    return n


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


def provider_fn(provider: str, inputs: VerifyInputs, mode: Mode, validate: bool):
    """A call of ``provider`` on ``inputs`` returning (tokens, num_accepted)."""
    args = (inputs.target_logits, inputs.draft_tokens, inputs.draft_logits)
    sampling = dict(temperature=mode.temperature, top_k=mode.top_k, top_p=mode.top_p)
    mask = inputs.token_bitmask
    if provider == "eager" and mask is not None:  # masks applied by hand before the sampler
        return lambda: eager_verify(*_masked_by_hand(*args, mask), **sampling)
    if provider == "eager":
        return lambda: eager_verify(*args, **sampling)
    if provider == "reference" and mask is not None:
        import specdec_kernels as sk

        return lambda: _as_pair(sk.verify(*args, **sampling, seed=inputs.seeds, backend="torch", token_bitmask=mask))
    if provider == "reference":
        from specdec_kernels.reference import verify_reference  # lazy: --help must work without it

        return lambda: _as_pair(verify_reference(*args, **sampling, seed=inputs.seeds))
    import specdec_kernels as sk  # lazy: TRITON_INTERPRET must be decided before this import

    backend = {"ours": "triton"}.get(provider, provider)
    if mode.num_logprobs is not None:
        sampling.update(return_logprobs=True, num_logprobs=mode.num_logprobs)
    # Host-side value checks synchronise with the device; an engine's hot loop turns them off.
    options = dict(seed=inputs.seeds, validate=validate, backend=backend, token_bitmask=mask, method=mode.method)
    return lambda: _as_pair(sk.verify(*args, **sampling, **options))


def _masked_by_hand(target, tokens, draft, mask):
    """What engines do without token_bitmask=: -inf at the disallowed entries of every row."""
    from specdec_kernels._bitmask import allowed

    V = target.shape[-1]
    keep = allowed(mask, V)
    target = target.masked_fill(~keep, float("-inf"))
    draft = None if draft is None else draft.masked_fill(~keep[:, :-1], float("-inf"))
    return target, tokens, draft


def _as_pair(out):
    """(tokens, num_accepted) from either a VerifyOutput-like object or a tuple."""
    return (out.tokens, out.num_accepted) if hasattr(out, "tokens") else (out[0], out[1])


def cuda_unavailable(device: str) -> str | None:
    """Why the cuda provider cannot run here (None: it can); builds the extension if needed."""
    if not str(device).startswith("cuda"):
        return "the CUDA backend needs a GPU device"
    try:
        from specdec_kernels.ops import csrc

        csrc.load_cuda_extension()
    except (ImportError, RuntimeError) as e:
        return str(e).splitlines()[0][:200]
    return None


def reference_too_slow(B: int, G: int, V: int) -> bool:
    return B * (G + 1) * V > REFERENCE_MAX_ELEMENTS


def output_problems(out, inputs: VerifyInputs) -> list[str]:
    """Structural checks any correct verifier passes; catches a provider returning garbage fast."""
    tokens, num_accepted = out
    B, G, V = inputs.shape
    if tuple(tokens.shape) != (B, G + 1) or tuple(num_accepted.shape) != (B,):
        return [f"bad shapes: tokens {tuple(tokens.shape)}, num_accepted {tuple(num_accepted.shape)}"]
    n, tokens, drafts = num_accepted.long().cpu(), tokens.long().cpu(), inputs.draft_tokens.long().cpu()
    if bool(((n < 0) | (n > G)).any()):
        return [f"num_accepted out of [0, {G}]: {n.tolist()}"]
    problems = []
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
# The sweep
# --------------------------------------------------------------------------------------------


def run_shape(B: int, G: int, V: int, mode: Mode, run: common.Run) -> list[dict]:
    args = run.args
    label = f"mode={mode.name} B={B} G={G} V={V} {args.dtype}"
    dtype = common.torch_dtype(args.dtype)
    inputs = common.make_or_report(lambda: make_inputs(B, G, V, dtype, mode, args.device, args.seed), label, run)
    if inputs is None:
        return []
    outputs = {}

    def skip(provider: str) -> str | None:
        if mode.num_logprobs is not None and provider in ("eager", "reference"):
            return "it computes no logprobs (compare with the mode without them)"
        if mode.method == "block" and provider not in BLOCK_PROVIDERS:
            return f"method='block' runs in {BLOCK_PROVIDERS} only here"
        if provider == "reference" and reference_too_slow(B, G, V) and not args.all_providers:
            return f"B*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}; --all-providers to force"
        return cuda_unavailable(args.device) if provider == "cuda" else None

    def measure(provider: str) -> dict:
        torch.manual_seed(args.seed)  # eager's torch.rand / multinomial draw from the global RNG
        fn = provider_fn(provider, inputs, mode, args.validate)
        cap = (REFERENCE_MAX_WARMUP, REFERENCE_MAX_REP) if provider == "reference" else None
        check = lambda out: output_problems(out, inputs)  # noqa: E731
        graph = provider in GRAPH_PROVIDERS
        measured, outputs[provider] = common.timed_row(
            fn, run, bytes_read_once(inputs, mode), check=check, cap=cap, graph=graph
        )
        mean_accepted = float(outputs[provider][1].float().mean().item())
        shape = dict(
            provider=provider, mode=mode.name, B=B, G=G, V=V, dtype=args.dtype, threads=torch.get_num_threads()
        )
        return {**run.meta, **shape, **measured, "mean_accepted": mean_accepted}

    rows = common.run_providers(args.providers, label, run, measure, skip=skip)
    if mode.temperature == 0.0 and outputs:  # greedy is deterministic: every provider emits the same tokens
        first, (tokens, _) = next(iter(outputs.items()))
        for name, (other, _) in outputs.items():
            if not torch.equal(other.long().cpu(), tokens.long().cpu()):
                run.errors.append(f"greedy tokens of {name} differ from {first} at {label}")
    common.ratio_columns(rows, "median_us", speedup_vs_eager=("eager", True))
    return rows


def sweep(run: common.Run) -> list[dict]:
    a = run.args
    return [
        row
        for mode in a.mode
        for V in a.V
        for B in a.B
        for G in a.G
        for row in run_shape(B, G, V, MODE_SETTINGS[mode], run)
    ]


# what the providers import lazily (after prepare_environment), imported by --dry-run
PROVIDER_MODULES = ("specdec_kernels.reference", "specdec_kernels.ops.triton", "specdec_kernels.ops.csrc")


def parse_args(argv=None):
    p = common.make_parser(
        "verify",
        "Benchmark speculative-decoding verification: eager PyTorch vs reference vs specdec_kernels.verify. "
        "See the module docstring for how to read frac_of_floor.",
        axes=AXES,
        providers=PROVIDERS,
        dtype_help="logits dtype (default bf16; smoke: fp32)",
        smoke_help="tiny CPU-friendly run of every provider and mode; exits non-zero on any error",
        all_providers_help=f"run the reference even where B*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}",
        validate_help="let sk.verify run its host-side input checks (off: as in a serving hot loop)",
        seed_help="seed for the synthetic inputs and eager's RNG",
    )
    p.add_argument(
        "--mode",
        nargs="+",
        choices=MODES,
        help="stochastic (default) | greedy (temperature 0) | ngram (no draft logits) | "
        "topk_topp (top_k=50, top_p=0.9) | grammar (token_bitmask=) | t0.7_block (method='block') ...; "
        "several may be given",
    )
    p.add_argument("--threads", type=int, help="torch / OpenMP threads (CPU; default: torch's)")
    args = p.parse_args(argv)
    common.resolve_common(args, p, AXES, PROVIDERS)
    args.mode = args.mode or (list(MODES) if args.smoke else ["stochastic"])
    if min(args.G) < 1 or min(args.B) < 1 or min(args.V) < 2:
        p.error("need B >= 1, G >= 1 and V >= 2")
    return args


def main(argv=None) -> int:
    return common.bench_main(
        "verify",
        parse_args(argv),
        sweep,
        table_columns=TABLE_COLUMNS,
        csv_columns=CSV_COLUMNS,
        modules=PROVIDER_MODULES,
    )


if __name__ == "__main__":
    sys.exit(main())
