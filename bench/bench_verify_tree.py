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
* ``vectorized`` -- ``verify_multi(..., backend="vectorized")``: batched PyTorch ops, the CPU fallback
                   when the CPU build cannot be compiled.

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

Columns
-------
Shared columns (``median_us``, ``GBps``, ``floor_us``, ``copy_GBps``): ``bench/_common.py``.

* ``bytes_read_once``: the target rows the contract can use (the root row [0, 0] and the K*G node
  rows; rows [k, 0] of chains k > 0 are never used) + the draft rows it can use (the root's, i.e.
  chain 0's slot 0, and the K*(G-1) deeper ones) + draft tokens (+ parents for ``--api tree``). With
  K = 1 this is exactly ``bench_verify.py``'s count.
* ``frac_of_floor``: K-SEQ's rho search and RRS's renormalisation after each rejection re-read rows,
  so values well below 1 at K > 1 are expected.
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
* ``kseq_rho_accept_diff`` (kseq rows): max over RHO_CHECK_REQUESTS root rows of this world of
  |A(rho) - A(rho*)|, A = 1 - (1 - beta)^K the probability that K-SEQ accepts a draft, with rho from
  the rule every backend implements (``reference.verify_tree.rho_search``, float64 here) and rho*
  solved to float64 resolution by bisection. Issue 13 bounds it by 1e-4.

Usage
-----
    python bench/bench_verify_tree.py                      # full sweep -> bench/results/verify_tree.csv
    python bench/bench_verify_tree.py --B 16 --K 1 4 --V 32000 --methods kseq rrs --overlap 0.5 0.8
    python bench/bench_verify_tree.py --smoke              # tiny CPU run of everything (CI)
"""

from __future__ import annotations

import functools
import hashlib
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import _common` when run or imported
import _common as common  # noqa: E402

PROVIDERS = ("reference", "ours", "vectorized")
APIS = ("multi", "tree")
AXES = {
    "B": common.Axis("batch sizes", (1, 16, 64), (2,)),
    "K": common.Axis("draft chains per request", (1, 2, 4, 8), (1, 2)),
    "G": common.Axis("drafts per chain", (4,), (2,)),
    "V": common.Axis("vocabulary sizes", (32000, 151936), (64,)),
}
DEFAULT_SIGMA = 1.0
DEFAULT_ACCEPT_REQUESTS, SMOKE_ACCEPT_REQUESTS = 1024, 8
MAX_NODES = 64  # K*G; the walk keeps node sets as 64-bit masks

# The reference loops in Python over requests, positions and candidates (K-SEQ evaluates up to 24
# vocabulary sums per position); above this many target logits a call takes seconds, so it is skipped (unless
# --all-providers) and never repeated much.
REFERENCE_MAX_ELEMENTS = 1e7
REFERENCE_MAX_WARMUP, REFERENCE_MAX_REP = 1, 3

# The synthetic world: target logits LOGIT_SCALE * N(0, 1); draft logits = target + sigma * N(0, 1).
LOGIT_SCALE = 3.0
OVERLAP_REQUESTS = 256  # root rows the reported (and --overlap-calibrated) overlap is averaged over
RHO_CHECK_REQUESTS = 64  # root rows K-SEQ's rho rule is compared with the exact rho* on
RHO_EXACT_STEPS = 64  # bisection steps for rho* on [1, K]: below float64 resolution
ACCEPT_CHUNK_BYTES = 1 << 30  # logits built at once per draft set while measuring acceptance

ACCEPT_COLUMNS = (
    "accept_len accept_len_k1 accept_gain accept_gain_diff accept_gain_se accept_requests kseq_rho_accept_diff"
)
CSV_COLUMNS = common.csv_columns(
    "provider api method B K G V dtype sigma overlap median_us graph_us p20_us p80_us GBps floor_us frac_of_floor "
    f"copy_GBps bytes_read_once mean_accepted {ACCEPT_COLUMNS} accept_provider"
)
TABLE_COLUMNS = (
    "provider api method B K G V dtype sigma median_us graph_us p20_us p80_us floor_us frac_of_floor mean_accepted "
    "accept_len accept_gain accept_gain_diff"
).split()
ACCEPT_TABLE_COLUMNS = f"V G sigma overlap method K {ACCEPT_COLUMNS}".split()


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


def kseq_rho_accept_diff(z: torch.Tensor, sigma: float, dtype, K: int) -> float:
    """Max over the root rows built from noise z [R, 2, V] of |A(rho) - A(rho*)|: K-SEQ's acceptance
    with the backends' rho rule vs with rho* (float64 bisection to machine resolution)."""
    from specdec_kernels.reference.verify_tree import RHO_POINTS, rho_search  # lazy, like the providers

    target = z[:, 0] * LOGIT_SCALE
    p = target.to(dtype).double().softmax(dim=-1)
    q = (target + sigma * z[:, 1]).to(dtype).double().softmax(dim=-1)

    def g(rho):  # sum_x min(rho q, p) per row, rho [R]
        return torch.minimum(rho[:, None] * q, p).sum(dim=-1)

    _rho, beta = rho_search(
        lambda pts: torch.stack([g(pts[:, m]) for m in range(RHO_POINTS)], 1),
        torch.full((p.shape[0],), K, dtype=torch.int64, device=p.device),
    )
    lo = torch.ones(p.shape[0], dtype=torch.float64, device=p.device)
    hi = torch.full_like(lo, float(K))
    for _ in range(RHO_EXACT_STEPS):
        mid = 0.5 * (lo + hi)
        gm = g(mid)
        positive = 1.0 - (1.0 - gm / mid).clamp(min=0.0) ** K - gm > 0.0
        lo, hi = torch.where(positive, mid, lo), torch.where(positive, hi, mid)
    beta_star = g(hi) / hi
    return float(((1.0 - beta_star) ** K - (1.0 - beta) ** K).abs().max())


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


def provider_fn(provider: str, api: str, inputs: TreeInputs, method: str, validate: bool):
    """A call of ``provider`` through ``api`` (``tree``: the same chains as explicit parents)."""
    if provider == "reference":
        from specdec_kernels.reference import verify_multi_reference as multi_fn  # lazy
        from specdec_kernels.reference import verify_tree_reference as tree_fn
    else:
        import specdec_kernels as sk  # lazy: TRITON_INTERPRET must be decided before this import

        multi_fn, tree_fn = sk.verify_multi, sk.verify_tree
        if provider == "vectorized":
            multi_fn, tree_fn = (functools.partial(f, backend="vectorized") for f in (multi_fn, tree_fn))
    # Host-side value checks synchronise with the device; an engine's hot loop turns them off.
    kwargs = dict(seed=inputs.seeds, method=method, validate=validate)
    if api == "tree":
        tree = inputs.as_tree()  # built once, outside the timed region
        return lambda: tree_fn(**tree, **kwargs)
    return lambda: multi_fn(inputs.target_logits, inputs.draft_tokens, inputs.draft_logits, **kwargs)


def reference_too_slow(B: int, K: int, G: int, V: int) -> bool:
    return B * K * (G + 1) * V > REFERENCE_MAX_ELEMENTS


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
# The sweep
# --------------------------------------------------------------------------------------------


def acceptance_provider(args) -> str:
    return "ours" if "ours" in args.providers else args.providers[0]


def measure_acceptance(world: World, G: int, run: common.Run, dtype, label: str) -> dict:
    """{(method, K): acceptance columns} over args.accept_requests requests of this world.

    Every method runs on the same requests at every K in args.K and at K = 1 (chain 0 only), with
    the same seeds, so the gain columns compare like with like.
    """
    args = run.args
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
                    out = provider_fn(provider, "multi", inputs, method, False)()
                    lengths[method, K].append(out.num_accepted.long().cpu())
            del sets
            common.free_device_memory(args.device)
    except Exception as e:
        run.error(f"acceptance ({provider}) at {label}", e)
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


def run_shape(world: World, B: int, G: int, run: common.Run, base: dict, acceptance: dict) -> list[dict]:
    """Every K, api, method and provider at one (B, G, V, sigma)."""
    args, dtype = run.args, common.torch_dtype(run.args.dtype)
    label = f"B={B} G={G} V={world.V} sigma={world.sigma:.3g} {args.dtype}"
    wors = sorted({draws_without_replacement(m) for m in args.methods})
    sets = common.make_or_report(
        lambda: {wor: build_inputs(world, range(B), max(args.K), G, dtype, wor) for wor in wors}, label, run
    )
    if sets is None:
        return []
    rows = []
    for K, api, method in [(K, api, method) for K in args.K for api in args.api for method in args.methods]:
        inputs = sets[draws_without_replacement(method)].first_chains(K)
        case = {**base, "api": api, "method": method, "B": B, "K": K, "G": G, "V": world.V, "sigma": world.sigma}
        rows += [
            {**r, **acceptance.get((method, K), {})}
            for r in run_case(inputs, case, run, f"{api} {method} K={K} {label}")
        ]
    return rows


def run_case(inputs: TreeInputs, case: dict, run: common.Run, label: str) -> list[dict]:
    """Every provider on one input set (``case``: the row's columns so far)."""
    args, nbytes = run.args, bytes_read_once(inputs, case["api"])

    def skip(provider: str) -> str | None:
        if provider == "reference" and reference_too_slow(*inputs.shape) and not args.all_providers:
            return f"B*K*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}; --all-providers to force"
        return None

    def measure(provider: str) -> dict:
        fn = provider_fn(provider, case["api"], inputs, case["method"], args.validate)
        cap = (REFERENCE_MAX_WARMUP, REFERENCE_MAX_REP) if provider == "reference" else None
        check = lambda out: output_problems(out, inputs)  # noqa: E731
        graph = provider == "ours"  # the Triton kernels: capturable
        measured, out = common.timed_row(fn, run, nbytes, check=check, cap=cap, graph=graph)
        mean_accepted = float(out.num_accepted.float().mean().item())
        return {**case, "provider": provider, "dtype": args.dtype, **measured, "mean_accepted": mean_accepted}

    return common.run_providers(args.providers, label, run, measure, skip=skip)


def sigmas_for(V: int, args, dtype) -> list[tuple[float, float]]:
    """(sigma, measured root overlap) for every --sigma, or the calibrated sigma of every --overlap."""
    z = root_noise(World(V, 0.0, args.seed, args.device))
    sigmas = [calibrate_sigma(a, z, dtype) for a in args.overlap] if args.overlap else list(args.sigma)
    return [(s, root_overlap(z, s, dtype)) for s in sigmas]


def sweep(run: common.Run) -> list[dict]:
    args = run.args
    available = tree_methods()
    args.methods = args.methods or list(available)
    if unknown := [m for m in args.methods if m not in available]:
        raise common.SetupError(f"unknown method(s) {unknown}; verify_multi supports {list(available)}")
    dtype = common.torch_dtype(args.dtype)
    rows, accept_rows = [], []
    for V in args.V:
        try:
            sigmas = sigmas_for(V, args, dtype)
        except ValueError as e:
            run.error(f"V={V}: {e}")
            continue
        for sigma, overlap in sigmas:
            world = World(V, sigma, args.seed, args.device)
            z = root_noise(world)[:RHO_CHECK_REQUESTS]
            rho_diff = {K: kseq_rho_accept_diff(z, sigma, dtype, K) for K in args.K if K > 1}
            for G in args.G:
                acceptance = measure_acceptance(world, G, run, dtype, f"G={G} V={V} sigma={sigma:.3g}")
                for (method, K), cols in acceptance.items():
                    if method == "kseq" and K in rho_diff:
                        cols["kseq_rho_accept_diff"] = rho_diff[K]
                for (method, K), cols in sorted(acceptance.items()):
                    if K in args.K:
                        accept_rows.append(dict(V=V, G=G, sigma=sigma, overlap=overlap, method=method, K=K, **cols))
                for B in args.B:
                    rows += run_shape(world, B, G, run, {**run.meta, "overlap": overlap}, acceptance)
    if accept_rows:
        print("\n# acceptance: mean accepted drafts per request, K chains vs chain 0 alone (same requests)")
        common.print_table(accept_rows, ACCEPT_TABLE_COLUMNS)
    return rows


# what the providers import lazily (after prepare_environment), imported by --dry-run
PROVIDER_MODULES = (
    "specdec_kernels.reference",
    "specdec_kernels.ops.triton",
    "specdec_kernels.ops.csrc",
    "specdec_kernels.ops.vectorized",
)


def parse_args(argv=None):
    p = common.make_parser(
        "verify_tree",
        "Benchmark multi-draft verification (verify_multi / verify_tree): reference vs specdec_kernels, "
        "time and acceptance per method. See the module docstring for the columns.",
        axes=AXES,
        providers=PROVIDERS,
        dtype_help="logits dtype (default bf16; smoke: fp32)",
        smoke_help="tiny CPU-friendly run of every provider, api and method; exits non-zero on any error",
        all_providers_help=f"run the reference even where B*K*(G+1)*V > {REFERENCE_MAX_ELEMENTS:.0e}",
        validate_help="let the ops run their host-side input checks (off: as in a serving hot loop)",
        seed_help="seed of the synthetic world and of the verify calls",
    )
    methods_help = "verification methods (default: every one verify_multi supports: kseq, rrs, rrs_wor)"
    p.add_argument("--methods", nargs="+", help=methods_help)
    api_help = "multi = verify_multi (default); tree = the same chains through verify_tree"
    p.add_argument("--api", nargs="+", choices=APIS, help=api_help)
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
    args = p.parse_args(argv)
    common.resolve_common(args, p, AXES, PROVIDERS)
    args.api = args.api or (list(APIS) if args.smoke else ["multi"])
    args.sigma = args.sigma or [DEFAULT_SIGMA]
    if args.accept_requests is None:
        args.accept_requests = SMOKE_ACCEPT_REQUESTS if args.smoke else DEFAULT_ACCEPT_REQUESTS
    if args.accept_requests < 0:
        p.error("--accept-requests must be >= 0")
    if min(args.B) < 1 or min(args.K) < 1 or min(args.G) < 1 or min(args.V) < 2:
        p.error("need B >= 1, K >= 1, G >= 1 and V >= 2")
    if max(args.K) * max(args.G) > MAX_NODES:
        p.error(f"K*G must be <= {MAX_NODES} (tree nodes per request)")
    if max(args.K) > min(args.V):
        p.error("K must be <= V (rrs_wor draws K distinct first tokens)")
    if min(args.sigma) < 0 or (args.overlap and not all(0 < a <= 1 for a in args.overlap)):
        p.error("need --sigma >= 0 and --overlap in (0, 1]")
    return args


def print_header(run: common.Run) -> None:
    a = run.args
    knob = f"overlap {a.overlap}" if a.overlap else f"sigma {a.sigma}"
    print(
        f"# world: target {LOGIT_SCALE:g}*N(0,1), draft = target + sigma*N(0,1), temperature 1; {knob}; "
        f"acceptance over {a.accept_requests} requests"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    return common.bench_main(
        "verify_tree",
        args,
        sweep,
        table_columns=TABLE_COLUMNS,
        csv_columns=CSV_COLUMNS,
        header=print_header,
        modules=PROVIDER_MODULES,
    )


if __name__ == "__main__":
    sys.exit(main())
