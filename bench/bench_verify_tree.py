"""Microbenchmark: multi-draft / token-tree verification (``specdec_kernels.verify_multi`` / ``verify_tree``).

What is measured
----------------
One call of multi-draft verification for a batch of B requests, each with K draft chains of G
tokens over a vocabulary of V: target logits [B, K, G+1, V], draft logits [B, K, G, V] and draft
tokens [B, K, G] in, accepted path and counts out; temperature 1, no top-k/top-p. For every
method ``verify_multi`` supports (``kseq``, ``rrs``, ``rrs_wor``) and every provider:

* ``reference`` -- ``specdec_kernels.reference.verify_multi_reference`` (plain PyTorch, float64, loops;
                   slow). Skipped when B*K*(G+1)*V > 1e7 unless ``--all-providers``, and timed with
                   few repetitions.
* ``ours``      -- ``specdec_kernels.verify_multi`` (the Triton kernels: row-statistics pass + tree walk).
* ``vectorized`` -- ``specdec_kernels.verify_multi(..., backend="vectorized")``: batched PyTorch ops, the
                   CPU fallback when the CPU build cannot be compiled.

``--api tree`` also times the same chains through ``verify_tree`` / ``verify_tree_reference``
(explicit parents, N = K*G nodes); the walk is the same, so the results are too.

Inputs come from a synthetic "language": for request r the target logits after any prefix are
3*N(0, 1) and the draft logits there are target + sigma*N(0, 1), both fixed by (seed, r, prefix);
``--sigma`` sets the draft/target mismatch directly, ``--overlap A`` picks the sigma whose mean
overlap sum_x min(p, q) at the root is A. The drafts are *sampled* from the draft distribution q
at their own prefix (chain k's draw at a prefix is fixed by (seed, r, prefix, k)), so chains that
share a prefix really are independent samples of the same q and acceptance means what it would in
an engine. ``kseq`` and ``rrs`` get drafts drawn with replacement; ``rrs_wor`` gets the K first
tokens drawn without replacement (ordered Gumbel top-K), deeper tokens as before.
Chain 0 is the same in both draft sets, and the input at K chains is the first K chains of the
input at the largest K, so every (method, K) sees the same distributions and K = 1 is the same
single chain for every method.

How to read a row
-----------------
* ``median_us`` (``p20_us``/``p80_us``): wall time of one call. CUDA: CUDA events around each call
  (launch gaps count when the host cannot keep the GPU fed). CPU: ``time.perf_counter``; on CPU the
  kernels run in the Triton *interpreter*, so CPU numbers only show that the script works.
* ``bytes_read_once``: the bytes any verifier must read at least once: the target rows the contract
  can use (the root row [0, 0] and the K*G node rows; rows [k, 0] of chains k > 0 are never used)
  + the draft rows it can use (the root's, i.e. chain 0's slot 0, and the K*(G-1) deeper ones) +
  draft tokens (+ parents for ``--api tree``). Outputs are tiny and ignored. With K = 1 this is
  exactly ``bench_verify.py``'s count.
* ``copy_GBps``: device-to-device copy bandwidth measured in this run ((read + write) / time on a
  1 GiB buffer on GPU, 64 MiB on CPU) -- the practical bandwidth ceiling of this machine.
* ``GBps`` = bytes_read_once / median time: the effective bandwidth of the provider.
* ``floor_us`` = bytes_read_once / copy bandwidth: the time a kernel that streams its inputs exactly
  once at copy speed would take; no memory-bound implementation can be much faster.
* ``frac_of_floor`` = floor_us / median_us, in (0, ~1]: the fraction of the bandwidth-bound ideal
  achieved. K-SEQ's rho search and RRS's renormalisation after each rejection re-read rows, so
  values well below 1 at K > 1 are expected; rows that fit in L2 can read above 1.
* ``mean_accepted``: mean accepted drafts per request in the timed call (B requests; a sanity check).
* ``sigma`` / ``overlap``: the draft noise scale and the measured mean root overlap sum_x min(p, q)
  (= the acceptance probability of one draft at the root) over 256 requests of this world.
* ``accept_len``: mean accepted path length (accepted drafts per request, 0..G) of this method at
  this K, over ``accept_requests`` requests (``--accept-requests``, default 1024) of the same world,
  measured with ``accept_provider`` (``ours`` when selected) -- the same for every B and provider.
  ``accept_len_k1``: the same requests with only chain 0 (K = 1), measured side by side in this run.
  ``accept_gain`` = accept_len / accept_len_k1 and ``accept_gain_diff`` = accept_len - accept_len_k1:
  what K drafts buy over one; ``accept_gain_se`` is the standard error of the difference (paired:
  the same requests and seeds).

Usage
-----
    python bench/bench_verify_tree.py                      # full sweep -> bench/results/verify_tree.csv
    python bench/bench_verify_tree.py --B 16 --K 1 4 --V 32000 --methods kseq rrs --overlap 0.5 0.8
    python bench/bench_verify_tree.py --smoke              # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import argparse
import hashlib
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

PROVIDERS = ("reference", "ours", "vectorized")
APIS = ("multi", "tree")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}

DEFAULT_B = (1, 16, 64)
DEFAULT_K = (1, 2, 4, 8)
DEFAULT_G = (4,)
DEFAULT_V = (32000, 151936)
DEFAULT_SIGMA = 1.0
DEFAULT_ACCEPT_REQUESTS = 1024

SMOKE_B, SMOKE_K, SMOKE_G, SMOKE_V = (2,), (1, 2), (2,), (64,)
SMOKE_ACCEPT_REQUESTS = 8

MAX_NODES = 64  # K*G; the walk keeps node sets as 64-bit masks

# The reference loops in Python over requests, positions and candidates (K-SEQ evaluates 64 vocabulary
# sums per position); above this many target logits a call takes seconds, so it is skipped (unless
# --all-providers) and never repeated much.
REFERENCE_MAX_ELEMENTS = 1e7
REFERENCE_MAX_WARMUP = 1
REFERENCE_MAX_REP = 3

# The synthetic world: target logits LOGIT_SCALE * N(0, 1); draft logits = target + sigma * N(0, 1).
LOGIT_SCALE = 3.0
OVERLAP_REQUESTS = 256  # root rows the reported (and --overlap-calibrated) overlap is averaged over
ACCEPT_CHUNK_BYTES = 1 << 30  # logits built at once per draft set while measuring acceptance

CSV_COLUMNS = (
    "date",
    "commit",
    "device",
    "torch",
    "triton",
    "provider",
    "api",
    "method",
    "B",
    "K",
    "G",
    "V",
    "dtype",
    "sigma",
    "overlap",
    "median_us",
    "p20_us",
    "p80_us",
    "GBps",
    "floor_us",
    "frac_of_floor",
    "copy_GBps",
    "bytes_read_once",
    "mean_accepted",
    "accept_len",
    "accept_len_k1",
    "accept_gain",
    "accept_gain_diff",
    "accept_gain_se",
    "accept_requests",
    "accept_provider",
    "warmup",
    "rep",
    "triton_interpret",
    "cuda",
    "python",
)
TABLE_COLUMNS = (
    "provider",
    "api",
    "method",
    "B",
    "K",
    "G",
    "V",
    "dtype",
    "sigma",
    "median_us",
    "p20_us",
    "p80_us",
    "floor_us",
    "frac_of_floor",
    "mean_accepted",
    "accept_len",
    "accept_gain",
    "accept_gain_diff",
)
ACCEPT_TABLE_COLUMNS = (
    "V",
    "G",
    "sigma",
    "overlap",
    "method",
    "K",
    "accept_len",
    "accept_len_k1",
    "accept_gain",
    "accept_gain_diff",
    "accept_gain_se",
    "accept_requests",
)


def tree_methods() -> tuple[str, ...]:
    """Every method verify_multi accepts (import only after prepare_environment)."""
    from specdec_kernels._tree_args import METHODS

    return tuple(METHODS)


def draws_without_replacement(method: str) -> bool:
    """Methods whose siblings must be distinct: the drafts are sampled without replacement."""
    return method.endswith("_wor")


# --------------------------------------------------------------------------------------------
# The synthetic world and its inputs
# --------------------------------------------------------------------------------------------


def _stable_seed(*parts) -> int:
    """A 63-bit seed from the parts (stable across processes, unlike hash())."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class World:
    """Request r's target/draft logits after any prefix, and chain k's draw there, fixed by the seed.

    target = LOGIT_SCALE * z0 and draft = target + sigma * z1 with z ~ N(0, 1) keyed by
    (seed, r, prefix): the same z for every sigma, so a sigma sweep varies only the mismatch.
    """

    def __init__(self, V: int, sigma: float, seed: int, device: str):
        self.V, self.sigma, self.seed, self.device = V, sigma, seed, device
        self._gen = torch.Generator(device=device)

    def noise(self, request: int, prefix: tuple) -> torch.Tensor:
        self._gen.manual_seed(_stable_seed(self.seed, request, "logits", prefix))
        return torch.randn((2, self.V), generator=self._gen, device=self.device)

    def logits(self, request: int, prefix: tuple) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.noise(request, prefix)
        target = z[0].mul_(LOGIT_SCALE)
        return target, z[1].mul_(self.sigma).add_(target)

    def race(self, request: int, prefix: tuple, chain: int) -> torch.Tensor:
        """Exponential(1) noise E for chain ``chain``'s draw after ``prefix``: argmax(q / E) ~ q.

        (q / E is exp(log q + Gumbel): the Gumbel-max trick without logarithms.)
        """
        self._gen.manual_seed(_stable_seed(self.seed, request, "draw", chain, prefix))
        e = torch.empty(self.V, device=self.device).exponential_(generator=self._gen)
        return e.clamp_min_(torch.finfo(e.dtype).tiny)


@dataclass
class TreeInputs:
    target_logits: torch.Tensor  # [n, K, G+1, V]
    draft_logits: torch.Tensor  # [n, K, G, V]
    draft_tokens: torch.Tensor  # [n, K, G] int64
    seeds: torch.Tensor  # [n] int64, built once so no call pays a host-to-device copy for it

    @property
    def shape(self) -> tuple[int, int, int, int]:
        B, K, G1, V = self.target_logits.shape
        return B, K, G1 - 1, V

    def first_chains(self, K: int) -> TreeInputs:
        """The same requests with only chains [0, K) (contiguous copies, as an engine would pass)."""
        return TreeInputs(
            self.target_logits[:, :K].contiguous(),
            self.draft_logits[:, :K].contiguous(),
            self.draft_tokens[:, :K].contiguous(),
            self.seeds,
        )

    def as_tree(self) -> dict:
        """verify_tree arguments for the same chains: node k*G + i is chain k's slot i."""
        B, K, G, V = self.shape
        N = K * G
        i = torch.arange(N, device=self.draft_tokens.device)
        parents = torch.where(i % G == 0, torch.full_like(i, -1), i - 1).expand(B, N).contiguous()
        root = self.target_logits[:, 0, :1]
        nodes = self.target_logits[:, :, 1:].reshape(B, N, V)
        return dict(
            target_logits=torch.cat([root, nodes], dim=1),
            tree_tokens=self.draft_tokens.reshape(B, N),
            parents=parents,
            draft_logits=self.draft_logits.reshape(B, N, V),
            max_depth=G,
        )


def request_seeds(requests: range, seed: int, device: str) -> torch.Tensor:
    return torch.tensor(list(requests), dtype=torch.int64, device=device) + (seed << 32)


def build_inputs(world: World, requests: range, K: int, G: int, dtype, without_replacement: bool) -> TreeInputs:
    """K chains of G sampled drafts per request, level by level (rows depend on the prefix).

    Chains with equal prefixes get equal rows (copied, not regenerated). With replacement, chain k
    draws argmax(q / E) with E ~ Exp(1) keyed by (seed, r, prefix, k) (the Gumbel-max trick);
    without replacement the K first tokens are the ordered top-K of q / E(seed, r, (), 0) (an
    ordered sample without replacement whose first token is chain 0's draw with replacement), and
    deeper tokens are drawn as with replacement.
    """
    n, V, device = len(requests), world.V, world.device
    target = torch.empty((n, K, G + 1, V), dtype=dtype, device=device)
    draft = torch.empty((n, K, G, V), dtype=dtype, device=device)
    paths = [[[] for _ in range(K)] for _ in range(n)]
    for i in range(G + 1):
        for b, r in enumerate(requests):
            first_chain: dict[tuple, int] = {}
            for k in range(K):
                prefix = tuple(paths[b][k])
                k0 = first_chain.setdefault(prefix, k)
                if k0 != k:
                    target[b, k, i] = target[b, k0, i]
                    if i < G:
                        draft[b, k, i] = draft[b, k0, i]
                    continue
                t, d = world.logits(r, prefix)
                target[b, k, i] = t
                if i < G:
                    draft[b, k, i] = d
        if i == G:
            break
        # q as the verifier sees it: the stored (rounded) draft logits at temperature 1
        q = torch.softmax(draft[:, :, i].float(), dim=-1)  # [n, K, V]
        wor_root = without_replacement and i == 0
        noise = torch.empty_like(q)
        for b, r in enumerate(requests):
            for k in range(1 if wor_root else K):
                noise[b, k] = world.race(r, tuple(paths[b][k]), k)
        if wor_root:
            drawn = (q[:, 0] / noise[:, 0]).topk(K, dim=-1).indices  # [n, K], ordered
        else:
            drawn = (q / noise).argmax(dim=-1)  # [n, K]
        for b, row in enumerate(drawn.tolist()):
            for k, token in enumerate(row):
                paths[b][k].append(token)
    tokens = torch.tensor(paths, dtype=torch.int64, device=device).view(n, K, G)
    return TreeInputs(target, draft, tokens, request_seeds(requests, world.seed, device))


def root_overlap(z: torch.Tensor, sigma: float, dtype) -> float:
    """Mean sum_x min(p, q) of root rows built from noise z [R, 2, V] (rounded to dtype as stored)."""
    target = z[:, 0] * LOGIT_SCALE
    draft = target + sigma * z[:, 1]
    p = target.to(dtype).float().softmax(dim=-1)
    q = draft.to(dtype).float().softmax(dim=-1)
    return float(torch.minimum(p, q).sum(dim=-1).mean())


def root_noise(world: World) -> torch.Tensor:
    return torch.stack([world.noise(r, ()) for r in range(OVERLAP_REQUESTS)])


def calibrate_sigma(overlap: float, z: torch.Tensor, dtype) -> float:
    """The sigma whose mean root overlap is ``overlap`` (bisection; overlap falls as sigma grows)."""
    if overlap >= 1.0:
        return 0.0
    lo, hi = 0.0, 1.0
    while root_overlap(z, hi, dtype) > overlap:
        lo, hi = hi, hi * 2
        if hi > 1e4:
            raise ValueError(f"--overlap {overlap} is below what any sigma gives here")
    for _ in range(40):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if root_overlap(z, mid, dtype) > overlap else (lo, mid)
    return hi


def bytes_read_once(inputs: TreeInputs, api: str) -> int:
    """Bytes any verifier must read at least once (the bandwidth floor's numerator)."""
    B, K, G, V = inputs.shape
    target_rows = 1 + K * G  # root + one row after every node
    draft_rows = 1 + K * (G - 1)  # the root's draft row (chain 0's slot 0) + every deeper slot
    element = inputs.target_logits.element_size()
    tokens = inputs.draft_tokens
    n = B * (target_rows + draft_rows) * V * element + tokens.numel() * tokens.element_size()
    if api == "tree":
        n += tokens.numel() * 8  # int64 parents
    return n


# --------------------------------------------------------------------------------------------
# Providers
# --------------------------------------------------------------------------------------------


def _provider(multi_fn, tree_fn, api: str, inputs: TreeInputs, method: str, validate: bool) -> Callable:
    kwargs = dict(seed=inputs.seeds, method=method, validate=validate)
    if api == "tree":
        tree = inputs.as_tree()  # built once, outside the timed region
        return lambda: tree_fn(**tree, **kwargs)
    return lambda: multi_fn(inputs.target_logits, inputs.draft_tokens, inputs.draft_logits, **kwargs)


def reference_provider(api: str, inputs: TreeInputs, method: str, validate: bool) -> Callable:
    from specdec_kernels.reference import verify_multi_reference, verify_tree_reference  # lazy

    return _provider(verify_multi_reference, verify_tree_reference, api, inputs, method, validate)


def ours_provider(api: str, inputs: TreeInputs, method: str, validate: bool) -> Callable:
    import specdec_kernels as sk  # lazy: TRITON_INTERPRET must be decided before this import

    # Host-side value checks synchronise with the device; an engine's hot loop turns them off.
    return _provider(sk.verify_multi, sk.verify_tree, api, inputs, method, validate)


def vectorized_provider(api: str, inputs: TreeInputs, method: str, validate: bool) -> Callable:
    import functools

    import specdec_kernels as sk

    multi, tree = (functools.partial(f, backend="vectorized") for f in (sk.verify_multi, sk.verify_tree))
    return _provider(multi, tree, api, inputs, method, validate)


PROVIDER_FACTORIES = {"reference": reference_provider, "ours": ours_provider, "vectorized": vectorized_provider}


def reference_too_slow(B: int, K: int, G: int, V: int) -> bool:
    return B * K * (G + 1) * V > REFERENCE_MAX_ELEMENTS


# --------------------------------------------------------------------------------------------
# Checks (outside the timed region)
# --------------------------------------------------------------------------------------------


def output_problems(out, inputs: TreeInputs) -> list[str]:
    """Structural checks any correct verifier passes; catches a provider returning garbage fast."""
    B, K, G, V = inputs.shape
    tokens, n, nodes = out.tokens, out.num_accepted, out.accepted_nodes
    if tuple(tokens.shape) != (B, G + 1) or tuple(n.shape) != (B,) or tuple(nodes.shape) != (B, G):
        return [
            f"bad shapes: tokens {tuple(tokens.shape)}, num_accepted {tuple(n.shape)}, "
            f"accepted_nodes {tuple(nodes.shape)}"
        ]
    tokens, n, nodes = tokens.long().cpu(), n.long().cpu(), nodes.long().cpu()
    if bool(((n < 0) | (n > G)).any()):
        return [f"num_accepted out of [0, {G}]: {n.tolist()}"]
    drafts = inputs.draft_tokens.long().cpu().reshape(B, K * G)
    problems = set()
    for b in range(B):
        m = int(n[b])
        path = nodes[b, :m]
        chain = path // G
        if m and (bool((path % G != torch.arange(m)).any()) or bool((chain != chain[0]).any())):
            problems.add("accepted_nodes is not a root-to-node path of one chain")
        elif not torch.equal(tokens[b, :m], drafts[b, path.clamp(0, K * G - 1)]):
            problems.add("accepted tokens are not the tokens of the accepted nodes")
        if bool((nodes[b, m:] != -1).any()) or bool((tokens[b, m + 1 :] != -1).any()):
            problems.add("padding after the accepted path is not -1")
        if not 0 <= int(tokens[b, m]) < V:
            problems.add(f"emitted token out of [0, {V})")
    return sorted(problems)


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


def measure_provider(provider: str, api: str, method: str, inputs: TreeInputs, args, copy_gbps: float) -> dict:
    """Time one provider on one input set; returns the row's measured columns. Raises on failure."""
    fn = PROVIDER_FACTORIES[provider](api, inputs, method, args.validate)
    out = fn()  # untimed first call: output check, and compile/autotune if any
    problems = output_problems(out, inputs)
    if problems:
        raise RuntimeError(f"{provider} returned an invalid result: " + "; ".join(problems))
    warmup, rep = args.warmup, args.rep
    if provider == "reference":
        warmup, rep = min(warmup, REFERENCE_MAX_WARMUP), min(rep, REFERENCE_MAX_REP)
    timing = common.time_fn(fn, warmup=warmup, rep=rep, device=args.device)
    nbytes = bytes_read_once(inputs, api)
    return {
        **timing,
        **bandwidth_columns(nbytes, timing["median_us"], copy_gbps),
        "copy_GBps": copy_gbps,
        "bytes_read_once": nbytes,
        "mean_accepted": float(out.num_accepted.float().mean().item()),
        "warmup": warmup,
        "rep": rep,
    }


def free_device_memory(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def acceptance_provider(args) -> str:
    return "ours" if "ours" in args.providers else args.providers[0]


def measure_acceptance(world: World, G: int, args, dtype, errors: list, label: str) -> dict:
    """{(method, K): acceptance columns} over args.accept_requests requests of this world.

    Every method runs on the same requests at every K in args.K and at K = 1 (chain 0 only), with
    the same seeds, so the gain columns compare like with like.
    """
    A = args.accept_requests
    if A < 1:
        return {}
    provider = acceptance_provider(args)
    Ks = sorted(set(args.K) | {1})
    Kmax = Ks[-1]
    per_request = Kmax * (2 * G + 1) * world.V * torch.empty((), dtype=dtype).element_size()
    chunk = max(1, min(A, ACCEPT_CHUNK_BYTES // per_request))
    lengths = {(m, K): [] for m in args.methods for K in Ks}
    try:
        for start in range(0, A, chunk):
            requests = range(start, min(A, start + chunk))
            sets = {}
            for method in args.methods:
                wor = draws_without_replacement(method)
                if wor not in sets:
                    sets[wor] = build_inputs(world, requests, Kmax, G, dtype, wor)
                for K in Ks:
                    inputs = sets[wor].first_chains(K)
                    out = PROVIDER_FACTORIES[provider]("multi", inputs, method, False)()
                    lengths[method, K].append(out.num_accepted.long().cpu())
            del sets
            free_device_memory(args.device)
    except Exception as e:
        errors.append(f"acceptance ({provider}) at {label}: {e!r}")
        traceback.print_exc()
        return {}

    lengths = {key: torch.cat(v).double() for key, v in lengths.items()}
    k1 = [lengths[m, 1] for m in args.methods]
    if any(not torch.equal(k1[0], other) for other in k1[1:]):
        print(
            f"[warn] at {label}: methods accept different lengths at K=1 on the same chain (they should agree exactly)",
            file=sys.stderr,
        )
    result = {}
    for (method, K), n in lengths.items():
        base = lengths[method, 1]
        diff = n - base
        mean, mean_k1 = float(n.mean()), float(base.mean())
        result[method, K] = {
            "accept_len": mean,
            "accept_len_k1": mean_k1,
            "accept_gain": mean / mean_k1 if mean_k1 > 0 else None,
            "accept_gain_diff": float(diff.mean()),
            "accept_gain_se": float(diff.std() / len(diff) ** 0.5) if len(diff) > 1 else None,
            "accept_requests": A,
            "accept_provider": provider,
        }
    return result


def run_shape(world: World, B: int, G: int, args, dtype, base: dict, acceptance: dict, copy_gbps, errors) -> list[dict]:
    """Every K, api, method and provider at one (B, G, V, sigma)."""
    V = world.V
    Kmax = max(args.K)
    label = f"B={B} G={G} V={V} sigma={world.sigma:.3g} {args.dtype}"
    try:
        sets = {
            wor: build_inputs(world, range(B), Kmax, G, dtype, wor)
            for wor in sorted({draws_without_replacement(m) for m in args.methods})
        }
    except Exception as e:  # e.g. out of memory for the inputs themselves
        errors.append(f"{label}: making inputs failed: {e!r}")
        traceback.print_exc()
        return []
    rows = []
    for K in args.K:
        chains = {wor: s.first_chains(K) for wor, s in sets.items()}
        for api in args.api:
            for method in args.methods:
                inputs = chains[draws_without_replacement(method)]
                where = f"{api} {method} K={K} {label}"
                for provider in args.providers:
                    if provider == "reference" and reference_too_slow(B, K, G, V) and not args.all_providers:
                        print(
                            f"[skip] reference at {where} (B*K*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}; "
                            "--all-providers to force)",
                            file=sys.stderr,
                        )
                        continue
                    try:
                        measured = measure_provider(provider, api, method, inputs, args, copy_gbps)
                    except Exception as e:
                        errors.append(f"{provider} at {where}: {e!r}")
                        traceback.print_exc()
                        free_device_memory(args.device)
                        continue
                    row = {
                        **base,
                        "provider": provider,
                        "api": api,
                        "method": method,
                        "B": B,
                        "K": K,
                        "G": G,
                        "V": V,
                        "dtype": args.dtype,
                        "sigma": world.sigma,
                        **measured,
                        **acceptance.get((method, K), {}),
                    }
                    rows.append(row)
                    print(
                        f"[done] {provider:9s} {where}: median {row['median_us']:.1f} us, "
                        f"frac_of_floor {row['frac_of_floor']:.3g}",
                        file=sys.stderr,
                    )
        del chains
    del sets
    free_device_memory(args.device)
    return rows


def sigmas_for(V: int, args, dtype) -> list[tuple[float, float]]:
    """(sigma, measured root overlap) for every --sigma, or the calibrated sigma of every --overlap."""
    z = root_noise(World(V, 0.0, args.seed, args.device))
    if args.overlap:
        sigmas = [calibrate_sigma(a, z, dtype) for a in args.overlap]
    else:
        sigmas = list(args.sigma)
    return [(s, root_overlap(z, s, dtype)) for s in sigmas]


def run_sweep(args, copy_gbps: float, meta: dict, errors: list) -> tuple[list[dict], list[dict]]:
    dtype = getattr(torch, DTYPES[args.dtype])
    rows, accept_rows = [], []
    for V in args.V:
        try:
            sigmas = sigmas_for(V, args, dtype)
        except ValueError as e:
            errors.append(f"V={V}: {e}")
            continue
        for sigma, overlap in sigmas:
            world = World(V, sigma, args.seed, args.device)
            for G in args.G:
                label = f"G={G} V={V} sigma={sigma:.3g}"
                acceptance = measure_acceptance(world, G, args, dtype, errors, label)
                for (method, K), cols in sorted(acceptance.items()):
                    if K in args.K:
                        accept_rows.append(
                            {"V": V, "G": G, "sigma": sigma, "overlap": overlap, "method": method, "K": K, **cols}
                        )
                base = {**meta, "overlap": overlap}
                for B in args.B:
                    rows += run_shape(world, B, G, args, dtype, base, acceptance, copy_gbps, errors)
    return rows, accept_rows


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Benchmark multi-draft verification (verify_multi / verify_tree): reference vs "
        "specdec_kernels, time and acceptance per method. See the module docstring for the columns.",
    )
    p.add_argument("--B", type=int, nargs="+", help=f"batch sizes (default {list(DEFAULT_B)})")
    p.add_argument("--K", type=int, nargs="+", help=f"draft chains per request (default {list(DEFAULT_K)})")
    p.add_argument("--G", type=int, nargs="+", help=f"drafts per chain (default {list(DEFAULT_G)})")
    p.add_argument("--V", type=int, nargs="+", help=f"vocabulary sizes (default {list(DEFAULT_V)})")
    p.add_argument("--providers", nargs="+", choices=PROVIDERS, help="default: all")
    p.add_argument(
        "--methods",
        nargs="+",
        help="verification methods (default: every one verify_multi supports: kseq, rrs, rrs_wor)",
    )
    p.add_argument(
        "--api",
        nargs="+",
        choices=APIS,
        help="multi = verify_multi (default); tree = the same chains through verify_tree",
    )
    knob = p.add_mutually_exclusive_group()
    knob.add_argument(
        "--sigma", type=float, nargs="+", help=f"draft logits = target + sigma * N(0, 1) (default {DEFAULT_SIGMA})"
    )
    knob.add_argument(
        "--overlap",
        type=float,
        nargs="+",
        help="instead of --sigma: target mean root overlap sum_x min(p, q) in (0, 1]; sigma is calibrated per V",
    )
    p.add_argument(
        "--accept-requests",
        type=int,
        help=f"requests the acceptance columns average over (default {DEFAULT_ACCEPT_REQUESTS}; "
        f"smoke: {SMOKE_ACCEPT_REQUESTS}; 0 = skip)",
    )
    p.add_argument("--dtype", choices=tuple(DTYPES), help="logits dtype (default bf16; smoke: fp32)")
    common.add_output_args(p, "verify_tree")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny CPU-friendly run of every provider, api and method; exits non-zero on any error",
    )
    p.add_argument(
        "--all-providers",
        action="store_true",
        help=f"run the reference even where B*K*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}",
    )
    p.add_argument(
        "--validate",
        action="store_true",
        help="let the ops run their host-side input checks (off: as in a serving hot loop)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic world and of the verify calls")
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


def resolve_defaults(args, parser):
    """Fill unset options: smoke defaults in --smoke, sweep defaults otherwise; explicit flags win."""
    smoke = args.smoke
    args.B = args.B or list(SMOKE_B if smoke else DEFAULT_B)
    args.K = args.K or list(SMOKE_K if smoke else DEFAULT_K)
    args.G = args.G or list(SMOKE_G if smoke else DEFAULT_G)
    args.V = args.V or list(SMOKE_V if smoke else DEFAULT_V)
    args.providers = args.providers or list(PROVIDERS)
    args.api = args.api or (list(APIS) if smoke else ["multi"])
    args.sigma = args.sigma or [DEFAULT_SIGMA]
    if args.accept_requests is None:
        args.accept_requests = SMOKE_ACCEPT_REQUESTS if smoke else DEFAULT_ACCEPT_REQUESTS
    args.dtype = args.dtype or ("fp32" if smoke else "bf16")
    common.resolve_timing(args, parser)
    if args.accept_requests < 0:
        parser.error("--accept-requests must be >= 0")
    if min(args.B) < 1 or min(args.K) < 1 or min(args.G) < 1 or min(args.V) < 2:
        parser.error("need B >= 1, K >= 1, G >= 1 and V >= 2")
    if max(args.K) * max(args.G) > MAX_NODES:
        parser.error(f"K*G must be <= {MAX_NODES} (tree nodes per request)")
    if max(args.K) > min(args.V):
        parser.error("K must be <= V (rrs_wor draws K distinct first tokens)")
    if min(args.sigma) < 0 or (args.overlap and not all(0 < a <= 1 for a in args.overlap)):
        parser.error("need --sigma >= 0 and --overlap in (0, 1]")
    return args


def resolve_methods(args) -> str | None:
    """Fill --methods from the ops (after prepare_environment); returns an error message or None."""
    available = tree_methods()
    args.methods = args.methods or list(available)
    unknown = [m for m in args.methods if m not in available]
    if unknown:
        return f"unknown method(s) {unknown}; verify_multi supports {list(available)}"
    return None


def print_header(meta: dict, args, copy_gbps: float) -> None:
    common.print_run_header("verify_tree", meta, args, copy_gbps)
    knob = f"overlap {args.overlap}" if args.overlap else f"sigma {args.sigma}"
    print(
        f"# world: target {LOGIT_SCALE:g}*N(0,1), draft = target + sigma*N(0,1), temperature 1; {knob}; "
        f"acceptance over {args.accept_requests} requests"
    )
    common.print_cpu_caveat(args)


def main(argv=None) -> int:
    args = parse_args(argv)
    common.prepare_environment(args.device)  # before anything imports specdec_kernels
    problem = resolve_methods(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    meta = common.environment_metadata(args.device)
    copy_gbps = common.measure_copy_bandwidth(args.device)
    print_header(meta, args, copy_gbps)

    errors: list[str] = []
    rows, accept_rows = run_sweep(args, copy_gbps, meta, errors)

    if accept_rows:
        print("\n# acceptance: mean accepted drafts per request, K chains vs chain 0 alone (same requests)")
        common.print_table(accept_rows, ACCEPT_TABLE_COLUMNS)
    common.save_rows(rows, args, "verify_tree", {**meta, "copy_GBps": copy_gbps}, TABLE_COLUMNS, CSV_COLUMNS)
    return common.exit_code(errors)


if __name__ == "__main__":
    sys.exit(main())
