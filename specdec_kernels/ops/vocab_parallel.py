"""Vocabulary-parallel (tensor-parallel) verification: each rank holds a contiguous vocabulary
shard of the logits and only O(B (G+1)) numbers cross the process group.

A tensor-parallel engine shards its LM head over the vocabulary; the usual sampler all-gathers the
``B (G+1) V`` logits first. The verification needs far less: per row, the max and first argmax,
the softmax normaliser, the target / draft probability of the draft token, the top-k / top-p
thresholds, and the winner of the exponential race. The race's random number for vocabulary entry
x is Philox keyed by (request seed; x // 4, row, purpose), so a shard can draw exactly the numbers
the unsharded call draws for its entries; the winner is the (max key, lowest index) over ranks.

Collectives (``torch.distributed``: NCCL on GPU, gloo on CPU), per call:

* one tiny all-gather of each rank's argument signature: shard size (offsets, V), shapes, a CRC
  of the replicated arguments when validating, and whether its argument checks passed (an error
  then raises on every rank instead of leaving the others waiting in a collective);
* per batch of rows (target and draft rows together): an all-gather of per-rank row stats (max,
  first argmax, non-finite flags), an all-reduce of the softmax sums with the owners' weights at
  the draft tokens folded in, and an all-gather of the race winners at the emitting rows;
* top-k <= 256: one all-gather of each rank's k largest values (plus its count of ties at its
  k-th) gives the k-th largest value and the kept set, on which top-p is computed as the
  reference does; larger k, or top-p alone: radix select over the 32-bit order keys of the logits,
  4 all-reduces of [rows, 256] histograms (counts for top-k, softmax mass for top-p). Either way
  the thresholds are the reference's exactly, ties included;
* the tree walk (``verify_multi`` / ``verify_tree``) does this once per depth, plus the K-SEQ rho
  search (1 + 4 all-reduces of 16 sums) or two all-reduces per tested candidate (RRS).

Arithmetic follows ``reference/`` elementwise in float64 (same operations, same order), so the only
difference to the unsharded call is the order of float sums across shards: tokens are equal except
at measure-zero ties. Every control-flow decision depends only on replicated inputs or on reduced
values (identical on every rank), so all ranks run the same collectives and return the same tokens.
Those decisions read values on the host: the sharded path synchronises (no CUDA-graph capture).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields, replace

import torch
import torch.distributed as dist

from .._params import SamplingParams, mix_seed
from .._types import DRAFT_LOGITS, DRAFT_NONE, DRAFT_PROBS, TreeVerifyOutput, VerifyOutput
from ..reference.philox import philox4x32_torch, uniform_open_torch
from ..reference.sampling import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RECOVER
from ..reference.verify_tree import RHO_POINTS, kseq_scale, rho_search

NEG_INF = float("-inf")
_DIGIT_BITS = 8
_BINS = 1 << _DIGIT_BITS
_SHIFTS = (24, 16, 8, 0)  # radix select over 32-bit keys, most significant digit first
TOPK_GATHER_MAX = 256  # top-k up to this: all-gather each rank's k largest values (else radix select)
_MIN_TEMPERATURE = 2.0**-126
_NO_INDEX = float(2**53)  # "no index" in float64 stat records (exact integers below it)

# signature record exchanged first:
# [ok, V_r, kind, B, dim1, dim2, draft mode, seed is int, seed, vocab_size, checksum of the replicated args]


class ShardError(ValueError):
    """Arguments that do not fit together across ranks (raised on every rank)."""


# --------------------------------------------------------------------------------------------
# the process group


class Shard:
    """This rank's place in the vocabulary: ``offset`` .. ``offset + size`` of ``V`` entries."""

    def __init__(self, group, device, sizes: list[int]):
        self.group, self.device = group, device
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.sizes = sizes
        self.offset = sum(sizes[: self.rank])
        self.size = sizes[self.rank]
        self.V = sum(sizes)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's t, in rank order."""
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t, group=self.group)
        return torch.stack(out)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous().clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def gather_many(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-gather for several float64 tensors: [world, *part.shape] each."""
        flat = torch.cat([t.reshape(-1).double() for t in parts]).to(self.device)
        allr = self.gather(flat).to(parts[0].device)
        out, start = [], 0
        for t in parts:
            out.append(allr[:, start : start + t.numel()].reshape(self.world, *t.shape))
            start += t.numel()
        return out

    def sum_many(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """One all-reduce (sum) for several float64 tensors."""
        flat = self.sum(torch.cat([t.reshape(-1).double() for t in parts]).to(self.device)).to(parts[0].device)
        out, start = [], 0
        for t in parts:
            out.append(flat[start : start + t.numel()].reshape(t.shape))
            start += t.numel()
        return out

    def local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(whether this rank owns each global id, its local index clamped into the shard)."""
        own = (ids >= self.offset) & (ids < self.offset + self.size)
        return own, (ids - self.offset).clamp(0, max(self.size - 1, 0))

    def lookup(self, rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Local contribution to rows[r, ids[r, j]] (0 where another rank owns the id): summed over
        ranks this is the value itself, exactly (one non-zero term)."""
        own, idx = self.local(ids)
        if self.size == 0:
            return torch.zeros(ids.shape, dtype=rows.dtype, device=rows.device)
        return torch.where(own, rows.gather(-1, idx), torch.zeros((), dtype=rows.dtype, device=rows.device))


_SHARDED_FIELDS = ("target_logits", "target", "draft")  # per-rank shards; everything else is replicated


def replicated_checksum(args) -> int:
    """CRC32 of the arguments every rank must pass identically (ids, counts, parameters, seeds,
    parents, method): a host copy of small tensors (only when validating)."""
    crc = 0
    values = [getattr(args, f.name) for f in fields(args) if f.name not in _SHARDED_FIELDS]
    seed = args.sampling.seed  # an int seed may differ (seed=None draws per rank): rank 0's is used
    values += [getattr(args.sampling, f.name) for f in fields(args.sampling) if f.name != "seed"]
    values += [seed] if isinstance(seed, torch.Tensor) else []
    for v in values:
        if isinstance(v, SamplingParams):
            continue
        if isinstance(v, torch.Tensor):
            data = v.detach().cpu().contiguous().numpy().tobytes() + str(v.dtype).encode()
        else:
            data = repr(v).encode()
        crc = zlib.crc32(data, crc)
    return crc


def _signature(kind: int, args, error, vocab_size, B_dims, checksum) -> torch.Tensor:
    ok = error is None
    V_r, B, d1, d2, mode, seed_int, seed = 0, 0, 0, 0, 0, 0, 0
    if ok:
        V_r = args.V
        B, d1, d2 = B_dims
        mode = args.draft_mode
        seed_int = int(not isinstance(args.sampling.seed, torch.Tensor))
        seed = mix_seed(args.sampling.seed) if seed_int else 0  # the key the kernels use; fits int64
    vs = -1 if vocab_size is None else int(vocab_size)
    return torch.tensor([int(ok), V_r, kind, B, d1, d2, mode, seed_int, seed, vs, checksum], dtype=torch.int64)


def exchange_layout(
    process_group, device, kind: int, args, error, vocab_size, dims, checksum: int = -1
) -> tuple[Shard, object]:
    """The one collective before any work: every rank's shard size and argument signature.

    Raises on every rank (the rank's own error where it has one) when a rank's arguments failed
    their checks, when ranks disagree on shapes / draft mode / seed kind, or when ``vocab_size``
    differs from the sum of the shard sizes. Int seeds (``seed=None`` draws one per rank) are
    replaced by rank 0's so that every rank draws the same random numbers. ``checksum``
    (``replicated_checksum``, or -1 when not validating) catches ranks passing different
    replicated arguments; then value checks give the same verdict on every rank."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group= needs an initialised torch.distributed process group")
    if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)):
        error = error or TypeError(f"vocab_size must be an int or None, got {vocab_size!r}")
    comm_device = device if dist.get_backend(process_group) == "nccl" else torch.device("cpu")
    sig = _signature(kind, args, error, vocab_size, dims, checksum).to(comm_device)
    world = dist.get_world_size(process_group)
    out = [torch.empty_like(sig) for _ in range(world)]
    dist.all_gather(out, sig, group=process_group)
    sigs = torch.stack(out).cpu()
    bad = [r for r in range(world) if not int(sigs[r, 0])]
    if error is not None:
        raise error
    if bad:
        raise ShardError(f"rank(s) {bad} of the process group failed their argument checks (see their error)")
    for col, what in ((2, "operation"), (3, "batch size B"), (4, "shape"), (5, "shape"), (6, "draft mode")):
        if len(set(sigs[:, col].tolist())) > 1:
            raise ShardError(f"ranks disagree on the {what}: {sigs[:, col].tolist()} (every rank passes the same call)")
    if len(set(sigs[:, 7].tolist())) > 1:
        raise ShardError("ranks disagree on the seed kind (int on some, tensor on others)")
    if len(set(sigs[:, 10].tolist())) > 1:
        raise ShardError(
            "ranks pass different draft tokens, counts, sampling parameters or seeds (checksums "
            f"{sigs[:, 10].tolist()}): everything but the vocabulary shards must be the same on every rank"
        )
    sizes = sigs[:, 1].tolist()
    V = sum(sizes)
    if vocab_size is not None and len(set(sigs[:, 9].tolist())) > 1:
        raise ShardError(f"ranks pass different vocab_size values: {sigs[:, 9].tolist()}")
    if vocab_size is not None and V != vocab_size:
        raise ShardError(
            f"vocabulary shards do not add up: ranks hold {sizes} entries (sum {V}) but vocab_size={vocab_size}"
        )
    if int(sigs[0, 7]):
        args = replace(args, sampling=replace(args.sampling, seed=int(sigs[0, 8])))
    return Shard(process_group, comm_device, sizes), args


# --------------------------------------------------------------------------------------------
# row math on shards (float64, elementwise as the reference)


def sanitize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits with NaN / +inf -> -inf, and whether each row held any."""
    x = x.to(torch.float32)
    bad = torch.isnan(x) | (x == float("inf"))
    return x.masked_fill(bad, NEG_INF), bad.any(-1)


def sanitize_probs(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q = q.double()
    bad = ~((q >= 0) & (q < float("inf")))
    return torch.where(bad, torch.zeros_like(q), q), bad.any(-1)


def safe_log(w: torch.Tensor) -> torch.Tensor:
    pos = w > 0
    return torch.where(pos, torch.log(torch.where(pos, w, torch.ones_like(w))), torch.full_like(w, NEG_INF))


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """int64 keys in [0, 2**32) ordered like the fp32 values (-0.0 counts as +0.0)."""
    bits = (x + 0.0).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(bits >= 2**31, 0xFFFFFFFF - bits, bits + 2**31)


def _key_to_float(key: torch.Tensor) -> torch.Tensor:
    bits = torch.where(key >= 2**31, key - 2**31, 0xFFFFFFFF - key)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)
    return bits.to(torch.int32).view(torch.float32)


def _row_stats(shard: Shard, x: torch.Tensor, bad: torch.Tensor, extra: torch.Tensor | None) -> tuple:
    """Global (max, first argmax, any NaN / +inf) of rows x [R, V_r] (sanitised fp32; bad: the
    local flags), and the OR over ranks of the extra flags (another row set), in one all-gather."""
    R = x.shape[0]
    if shard.size:
        mx, first = x.max(-1)  # the first index of the max (documented for torch.max)
        first = first.double() + shard.offset
    else:
        mx = torch.full((R,), NEG_INF, device=x.device)
        first = torch.full((R,), _NO_INDEX, dtype=torch.float64, device=x.device)
    rec = torch.stack([mx.double(), first, bad.double()], -1)
    extra = torch.zeros(0, dtype=torch.bool, device=x.device) if extra is None else extra
    allr, all_extra = shard.gather_many([rec, extra])  # [world, R, 3], [world, ...]
    gmax = allr[..., 0].max(0).values
    at_max = allr[..., 0] == gmax[None]
    argmax = torch.where(at_max, allr[..., 1], _NO_INDEX).min(0).values.long()
    return gmax.float(), argmax, allr[..., 2].amax(0) > 0, all_extra.amax(0) > 0


def _radix_select(shard: Shard, keys: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None, goal):
    """Per row, the key of the threshold entry, by 4 all-reduced 256-bin histograms.

    weights None: the goal-th largest key (goal [R] int64 >= 1; counts). Else: the largest key v
    with mass(keys >= v) >= goal (the top-p pivot; goal [R] float64, or a function of the first
    level's row totals: top_p * total). Returns (keys [R], the first level's row totals [R])."""
    R = keys.shape[0]
    dev = keys.device
    prefix = torch.zeros(R, dtype=torch.int64, device=dev)
    vals = valid.to(torch.int64) if weights is None else torch.where(valid, weights, torch.zeros_like(weights))
    bins = torch.arange(_BINS, device=dev)
    total = None
    need = goal
    for level, shift in enumerate(_SHIFTS):
        match = valid & ((keys >> (shift + _DIGIT_BITS)) == (prefix >> (shift + _DIGIT_BITS))[:, None])
        digit = (keys >> shift) & (_BINS - 1)
        hist = torch.zeros((R, _BINS), dtype=vals.dtype, device=dev)
        hist.scatter_add_(1, digit, torch.where(match, vals, torch.zeros_like(vals)))
        hist = shard.sum(hist.to(shard.device)).to(dev)
        suffix = hist.flip(1).cumsum(1).flip(1)  # suffix[d] = sum over bins >= d
        if level == 0:
            total = suffix[:, 0]
            if callable(need):
                need = need(total)
        ok = suffix >= need[:, None]
        d = ok.sum(1) - 1
        if weights is not None:  # rounding left the goal above the group's mass: its lowest entry
            lowest = torch.where(hist > 0, bins, _BINS).min(1).values.clamp(max=_BINS - 1)
            d = torch.where(d < 0, lowest, d)
        d = d.clamp(0, _BINS - 1)
        above = suffix.gather(1, d[:, None])[:, 0] - hist.gather(1, d[:, None])[:, 0]
        need = need - above
        prefix = prefix | (d << shift)
    return prefix, total


def _gathered_top(shard: Shard, x: torch.Tensor, k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's k_max largest values of each row, merged: (values [R, M] float64 sorted
    descending, multiplicities [R, M] float64), in one all-gather.

    A rank's entries tied with its k_max-th value that did not fit are added as one extra entry
    (that value, their count). Then the multiset is exact at and above the global k-th largest
    value for any k <= k_max: a rank holding an entry >= that value which it did not send would
    hold k_max >= k entries above it."""
    R, dev = x.shape[0], x.device
    take = min(k_max, shard.size)
    vals = torch.full((R, k_max), NEG_INF, dtype=torch.float64, device=dev)
    bound = torch.full((R, 1), NEG_INF, dtype=torch.float64, device=dev)
    extra = torch.zeros((R, 1), dtype=torch.float64, device=dev)
    if take:
        top = torch.topk(x, take, dim=-1).values
        vals[:, :take] = top.double()
        if take == k_max:
            b = top[:, -1:]
            ties = ((x == b).sum(-1, keepdim=True) - (top == b).sum(-1, keepdim=True)).double()
            bound = torch.where(b > NEG_INF, b, NEG_INF).double()
            extra = torch.where(b > NEG_INF, ties, 0.0)
    (allr,) = shard.gather_many([torch.cat([vals, bound, extra], -1)])  # [world, R, k_max + 2]
    sent = allr[..., :k_max].permute(1, 0, 2).reshape(R, -1)
    values = torch.cat([sent, allr[..., k_max].T], -1)
    mult = torch.cat([torch.ones_like(sent), allr[..., k_max + 1].T], -1)
    mult = torch.where(values > NEG_INF, mult, 0.0)
    values = torch.where(mult > 0, values, NEG_INF)  # empty slots sort last
    values, order = torch.sort(values, dim=-1, descending=True, stable=True)
    return values, mult.gather(1, order)


def _top_p_pivot(values, weights, kept, top_p) -> torch.Tensor:
    """The top-p pivot of sorted values [R, M] (descending; the kept ones first) with weights (0
    past the kept ones), as the reference: the first value whose cumulative mass reaches
    top_p * total (the last kept one if rounding leaves the goal above every partial sum)."""
    mass = torch.cumsum(weights, -1)
    goal = top_p * mass[:, -1]
    n_kept = kept.sum(-1)
    first = torch.minimum((mass < goal[:, None]).sum(-1), (n_kept - 1).clamp(min=0))
    return values.gather(1, first[:, None])[:, 0]


def _thresholds(shard: Shard, x, gmax, temp, top_k, top_p, sampled) -> torch.Tensor:
    """``reference.sampling.filter_threshold`` of every row, globally: fp32 [R] (-inf = no filter).

    Rows with top-k <= TOPK_GATHER_MAX: one all-gather of each rank's k largest values gives the
    k-th largest value and the kept set itself, so top-p is computed on it exactly as the reference
    does (same sorted order, same cumulative sum). Other rows: radix select over all-reduced key
    histograms (counts for top-k, softmax mass for top-p). Decisions depend on replicated
    parameters and gathered values only: every rank runs the same collectives."""
    R = x.shape[0]
    dev = x.device
    thr = torch.full((R,), NEG_INF, dtype=torch.float32, device=dev)
    finite = x > NEG_INF
    use_k = sampled & (top_k > 0) & (top_k < shard.V)
    use_p = sampled & (top_p < 1.0)
    small = use_k & (top_k <= TOPK_GATHER_MAX)
    if bool(small.any()):
        values, mult = _gathered_top(shard, x, int(top_k[small].max()))
        cum = torch.cumsum(mult, -1)
        idx = (cum < top_k[:, None]).sum(-1).clamp(max=values.shape[1] - 1)
        kth = values.gather(1, idx[:, None])[:, 0]
        thr = torch.where(small & (cum[:, -1] >= top_k), kth.float(), thr)
        if bool((small & use_p).any()):
            kept = (values >= thr[:, None].double()) & (values > NEG_INF)
            t = torch.where(use_p, temp, torch.ones_like(temp))
            w = torch.where(kept, torch.exp((values - gmax.double()[:, None]) / t[:, None]), 0.0) * mult
            has = gmax > NEG_INF
            pivot = _top_p_pivot(values, w, kept, top_p.double())
            thr = torch.where(small & use_p & has, pivot.float(), thr)
    keys = None
    big_k = use_k & ~small
    if bool(big_k.any()):
        keys = _order_keys(x)
        k = torch.where(big_k, top_k, torch.ones_like(top_k))
        kth_key, count = _radix_select(shard, keys, finite, None, k)
        thr = torch.where(big_k & (count >= top_k), _key_to_float(kth_key), thr)
    big_p = use_p & ~small
    if bool(big_p.any()):
        keys = _order_keys(x) if keys is None else keys
        kept = finite & (x >= thr[:, None])
        t = torch.where(big_p, temp, torch.ones_like(temp))
        w = torch.exp((x.double() - gmax.double()[:, None]) / t[:, None])
        frac = top_p.double()

        def goal(total):
            return frac * total

        pivot, _ = _radix_select(shard, keys, kept, w, goal)
        has = gmax > NEG_INF  # some finite entry (then some kept)
        thr = torch.where(big_p & has, _key_to_float(pivot), thr)
    return thr


def _weights(x, thr, gmax, temp) -> torch.Tensor:
    """exp((x - max) / T) on the kept entries (x >= thr, finite), 0 elsewhere: float64, computed
    as the reference does (x and max in float64, then / T, then exp)."""
    kept = (x >= thr[:, None]) & (x > NEG_INF)
    m = torch.where(gmax > NEG_INF, gmax.double(), torch.zeros_like(gmax, dtype=torch.float64))
    w = x.double()
    w.sub_(m[:, None]).div_(temp[:, None]).exp_()
    return w.masked_fill_(~kept, 0.0)


@dataclass
class Rows:
    """Processed rows on this shard: weights w (p = w / Z) and global stats."""

    w: torch.Tensor  # [R, V_r] float64
    Z: torch.Tensor  # [R] float64, global sum of w
    gmax: torch.Tensor  # [R] fp32 global max (greedy argmax value)
    argmax: torch.Tensor  # [R] int64 global first argmax
    bad: torch.Tensor  # [R] bool: NaN / +inf somewhere in the row
    at_ids: torch.Tensor  # [R, J] float64: p (or q) at the looked-up ids (0 where id < 0)

    @property
    def p(self) -> torch.Tensor:
        return self.p_rows(slice(None))

    def p_rows(self, idx) -> torch.Tensor:
        """p = w / Z of the rows idx (all zeros where nothing is kept; probabilities: Z = 1)."""
        Z = self.Z[idx]
        return self.w[idx] / torch.where(Z > 0, Z, torch.ones_like(Z))[:, None]

    @property
    def empty(self) -> torch.Tensor:
        return self.gmax == NEG_INF

    def take(self, rows: slice) -> Rows:
        return Rows(*(getattr(self, f)[rows] for f in ("w", "Z", "gmax", "argmax", "bad", "at_ids")))


def process_rows(shard: Shard, logits, params, sampled, ids, probs=None, probs_ids=None) -> tuple[Rows, Rows | None]:
    """Sanitise, filter (global thresholds) and exponentiate logit rows [R, V_r] and look up p at
    the global ids [R, J] (negative: none); optionally also draft-probability rows probs [Rq, V_r]
    (used as given) with their ids [Rq, Jq]. Both row sets share each collective.
    params: (temperature f64 [R], top_k int64 [R], top_p f64 [R]); sampled: [R] bool."""
    temp, top_k, top_p = params
    x, bad = sanitize(logits)
    q, q_bad = sanitize_probs(probs) if probs is not None else (None, None)
    gmax, argmax, bad, q_bad = _row_stats(shard, x, bad, q_bad)
    if q is None and not bool(sampled.any()):  # greedy rows only need the argmax: no weights, no sums
        zeros = torch.zeros((), dtype=torch.float64, device=x.device)
        none = zeros.expand(x.shape[0])
        return Rows(zeros.expand(x.shape), none, gmax, argmax, bad, zeros.expand(ids.shape)), None
    t = torch.where(sampled, temp, torch.ones_like(temp))
    thr = _thresholds(shard, x, gmax, t, top_k, top_p, sampled)
    w = _weights(x, thr, gmax, t)
    w.masked_fill_(~sampled[:, None], 0.0)
    local = torch.cat([w.sum(-1, keepdim=True), shard.lookup(w, ids.clamp(min=0))], -1)
    parts = [local] if q is None else [local, shard.lookup(q, probs_ids.clamp(min=0))]
    sums = shard.sum_many(parts)
    Z = sums[0][:, 0]
    at = sums[0][:, 1:] / torch.where(Z > 0, Z, torch.ones_like(Z))[:, None]
    rows = Rows(w, Z, gmax, argmax, bad, torch.where(ids >= 0, at, torch.zeros_like(at)))
    if q is None:
        return rows, None
    ones = torch.ones(q.shape[0], dtype=torch.float64, device=q.device)
    q_at = torch.where(probs_ids >= 0, sums[1], torch.zeros_like(sums[1]))
    return rows, Rows(q, ones, ones.float(), ones.long(), q_bad, q_at)


def race_uniforms(seeds, rows, purposes, start: int, count: int) -> torch.Tensor:
    """[R, count] float32: the race uniforms of global vocab entries start .. start+count-1 for
    (seed, row, purpose) of each of the R rows, as ``reference.sampling.race_uniforms``."""
    R = seeds.shape[0]
    dev = seeds.device
    if count == 0:
        return torch.empty((R, 0), dtype=torch.float32, device=dev)
    b0, b1 = start // 4, (start + count - 1) // 4 + 1
    c0 = torch.arange(b0, b1, device=dev)[None, :]
    words = philox4x32_torch(seeds[:, None], c0, rows[:, None], purposes[:, None], 0)
    words = torch.stack(words, -1).reshape(R, -1)[:, start - 4 * b0 : start - 4 * b0 + count]
    return uniform_open_torch(words)


def _live_uniforms(live: torch.Tensor, seeds, rows, purposes, start: int) -> torch.Tensor:
    """float64 race uniforms [R, V_r] where ``live`` (an entry with weight 0 loses whatever its
    number: 0.5 stands in). Sparse rows (top-k / top-p keep few entries) draw Philox for their live
    entries only (one block per entry) instead of one block per 4 entries of the shard."""
    R, count = live.shape
    n_live = int(live.sum())
    if 4 * n_live >= R * count:  # dense: every block once
        return race_uniforms(seeds, rows, purposes, start, count).double()
    u = torch.full((R, count), 0.5, dtype=torch.float64, device=live.device)
    if n_live:
        r, c = live.nonzero(as_tuple=True)
        x = c + start
        words = torch.stack(philox4x32_torch(seeds[r], x // 4, rows[r], purposes[r], 0), -1)
        u[r, c] = uniform_open_torch(words.gather(1, (x % 4)[:, None])[:, 0]).double()
    return u


def accept_uniforms(seeds, c0, rows) -> torch.Tensor:
    """float64 accept-test uniforms of counters (c0, row, ACCEPT, 0), as ``reference.sampling.uniforms``."""
    bits, _, _, _ = philox4x32_torch(seeds, c0, rows, PURPOSE_ACCEPT, 0)
    return uniform_open_torch(bits).double()


def race(shard: Shard, log_ws: list[torch.Tensor], seeds, rows, purposes) -> list[torch.Tensor]:
    """Global exponential-race winners (lowest index on exact ties; -1 when every weight is 0) of
    each log-weight tensor [R, V_r] in ``log_ws``; all share the uniforms of (seed, row, purpose)."""
    R = seeds.shape[0]
    dev = seeds.device
    live = torch.zeros((R, shard.size), dtype=torch.bool, device=dev)
    for lw in log_ws:
        live |= lw > NEG_INF
    u = _live_uniforms(live, seeds, rows, purposes, shard.offset)
    noise = torch.log(-torch.log(u))
    recs = []
    for lw in log_ws:
        keys = lw.double() - noise
        keys = torch.where(torch.isnan(keys), torch.full_like(keys, NEG_INF), keys)
        if shard.size:
            best, idx = keys.max(-1)  # the first index of the max (documented for torch.max)
            idx = idx.double() + shard.offset
        else:
            best = torch.full((R,), NEG_INF, dtype=torch.float64, device=dev)
            idx = torch.full((R,), _NO_INDEX, dtype=torch.float64, device=dev)
        recs += [best, idx]
    allr = shard.gather(torch.stack(recs, -1).to(shard.device)).to(dev)  # [world, R, 2 * len]
    out = []
    for i in range(len(log_ws)):
        best = allr[..., 2 * i].max(0).values
        idx = torch.where(allr[..., 2 * i] == best[None], allr[..., 2 * i + 1], _NO_INDEX).min(0).values.long()
        out.append(torch.where(best > NEG_INF, idx, torch.full_like(idx, -1)))
    return out


def _params(sampling: SamplingParams, B: int, device):
    pr = sampling.per_request_cpu(B)
    temp = pr["temperature"].double().to(device)
    greedy = ~(temp >= _MIN_TEMPERATURE)
    return temp, pr["top_k"].to(device), pr["top_p"].double().to(device), pr["seed"].to(device), greedy


# --------------------------------------------------------------------------------------------
# chain verification


def verify_chain_sharded(shard: Shard, args) -> VerifyOutput:
    """``reference.verify.verify_checked`` on vocabulary shards (padded VerifyArgs, global ids)."""
    B, G, V = args.B, args.G, shard.V
    dev = args.target_logits.device
    G1 = G + 1
    if B == 0:  # B is replicated (the layout exchange checks it): every rank returns here, no collective
        empty = torch.empty((0,), device=dev)
        return VerifyOutput(empty.new_empty((0, G1), dtype=torch.int64), empty.int(), empty.bool())
    temp, top_k, top_p, seeds, greedy = _params(args.sampling, B, dev)
    n = args.per_request_cpu()["num_draft_tokens"].to(dev)
    drafts = args.draft_tokens.to(torch.int64)
    pos = torch.arange(G, device=dev)
    invalid = (pos[None] < n[:, None]) & ((drafts < 0) | (drafts >= V))
    n = torch.where(invalid.any(1), _row_min(torch.where(invalid, pos[None], G), G), n)  # placeholder ends it
    ids = torch.cat([torch.where((drafts >= 0) & (drafts < V), drafts, -1), torch.full((B, 1), -1, device=dev)], 1)

    def per_row(v):
        return v[:, None].expand(B, G1).reshape(-1)

    rows_sampled = per_row(~greedy)
    params = (per_row(temp), per_row(top_k), per_row(top_p))
    logits = args.target_logits.reshape(B * G1, -1)
    has_draft = args.draft_mode != DRAFT_NONE and G > 0 and not bool(greedy.all())  # greedy never reads q
    if has_draft:
        d_rows = (slice(None), slice(0, G))
        d_params = tuple(v.reshape(B, G1)[d_rows].reshape(-1) for v in params)
        d_sampled = rows_sampled.reshape(B, G1)[d_rows].reshape(-1)
        d_ids = ids[:, :G].reshape(-1, 1)
    if has_draft and args.draft_mode == DRAFT_LOGITS:  # target and draft rows share the collectives
        rows, _ = process_rows(
            shard,
            torch.cat([logits.float(), args.draft.reshape(B * G, -1).float()]),
            tuple(torch.cat([t, d]) for t, d in zip(params, d_params, strict=True)),
            torch.cat([rows_sampled, d_sampled]),
            torch.cat([ids.reshape(-1, 1), d_ids]),
        )
        target, draft = rows.take(slice(0, B * G1)), rows.take(slice(B * G1, None))
    elif has_draft:
        probs = args.draft.reshape(B * G, -1)
        target, draft = process_rows(shard, logits, params, rows_sampled, ids.reshape(-1, 1), probs, d_ids)
    else:
        (target, _), draft = process_rows(shard, logits, params, rows_sampled, ids.reshape(-1, 1)), None
    p_tok = target.at_ids.reshape(B, G1)
    t_bad, t_empty = target.bad.reshape(B, G1), target.empty.reshape(B, G1)
    argmax = target.argmax.reshape(B, G1)
    if draft is None:
        q_tok = torch.ones((B, G1), dtype=torch.float64, device=dev)
        d_bad = torch.zeros((B, G1), dtype=torch.bool, device=dev)
    else:
        pad = torch.zeros((B, 1), dtype=torch.float64, device=dev)
        q_tok = torch.cat([draft.at_ids.reshape(B, G), pad], 1)
        d_bad = torch.cat([draft.bad.reshape(B, G), pad.bool()], 1)
    row = torch.arange(G1, device=dev)
    u = accept_uniforms(seeds[:, None], 0, row[None, :])
    acc_sampled = (p_tok > 0) & (u * q_tok <= p_tok)
    acc_greedy = ids == argmax
    acc = torch.where(greedy[:, None], acc_greedy, acc_sampled) & (row[None] < n[:, None])
    j = torch.where(~acc, row[None], G1).min(1).values.clamp(max=n)  # first rejection, else n
    upto = row[None] <= j[:, None]
    t_flag = t_bad | t_empty  # greedy: no finite logit; sampled: p == 0 everywhere (the same rows)
    flag = (upto & t_flag).any(1) | (~greedy & (upto & (row[None] < n[:, None]) & d_bad).any(1))
    # the emitted token: greedy argmax, else a race at row j (bonus from p_n, or the residual)
    b_idx = torch.arange(B, device=dev)
    flat = b_idx * G1 + j
    p_row = target.p_rows(flat)
    bonus = j >= n
    if draft is None:
        q_row = torch.zeros_like(p_row)
        own, loc = shard.local(ids[b_idx, j])
        if shard.size:
            q_row[own, loc[own]] = 1.0
    else:
        q_row = draft.p_rows(b_idx * G + j.clamp(max=G - 1))
    token = argmax[b_idx, j]
    if not bool(greedy.all()):  # replicated: every rank takes the same branch
        residual = torch.clamp(p_row - q_row, min=0)
        purposes = torch.where(bonus, PURPOSE_BONUS, PURPOSE_RECOVER)
        res_tok, p_tok_won = race(shard, [safe_log(residual), safe_log(p_row)], seeds, j, purposes)
        sampled_tok = torch.where(bonus | (res_tok < 0), p_tok_won, res_tok).clamp(min=0)
        token = torch.where(greedy, token, sampled_tok)
    tokens = torch.full((B, G1), -1, dtype=torch.int64, device=dev)
    if G:
        tokens[:, :G] = torch.where(row[None, :G] < j[:, None], drafts, -1)
    tokens[b_idx, j] = token
    return VerifyOutput(tokens, j.to(torch.int32), flag)


# --------------------------------------------------------------------------------------------
# tree / multi-draft verification (the walk of reference.verify_tree, one depth per step)


def verify_tree_sharded(shard: Shard, args) -> TreeVerifyOutput:
    """``reference.verify_tree.verify_tree_checked`` on vocabulary shards (TreeArgs, global ids)."""
    B, G, N, V, D = args.B, args.G, args.N, shard.V, args.max_depth
    dev = args.target.device
    temp, top_k, top_p, seeds, greedy = _params(args.sampling, B, dev)
    params = (temp, top_k, top_p)
    num_nodes = args.per_request_cpu()["num_nodes"].to(dev)
    toks = args.tokens.reshape(B, N).to(torch.int64)
    parents = args.parents_cpu().to(dev)
    node = torch.arange(N, device=dev)
    usable = (node[None] < num_nodes[:, None]) & (toks >= 0) & (toks < V)
    b_idx = torch.arange(B, device=dev)
    all_greedy = bool(greedy.all())
    slots = max(G, 1)  # G as a divisor: with G = 0 (no nodes) only the root row is ever read
    draft_mode = args.draft_mode if N > 0 else DRAFT_NONE  # no nodes: no candidate, no draft row to read

    cur = torch.zeros((B, N), dtype=torch.bool, device=dev)  # the node set S (empty: the root)
    at_root = torch.ones(B, dtype=torch.bool, device=dev)
    first = torch.full((B,), -1, dtype=torch.int64, device=dev)
    last_node = torch.full((B,), -1, dtype=torch.int64, device=dev)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    token = torch.zeros(B, dtype=torch.int64, device=dev)
    flag = torch.zeros(B, dtype=torch.bool, device=dev)
    for _ in range(D + 2):
        if bool(done.all()):
            break
        live = ~done
        r = first + 1
        t_rows = torch.where(first < 0, 0, first // slots), torch.where(first < 0, 0, first % slots + 1)
        x_raw = args.target[b_idx, t_rows[0], t_rows[1]]  # [B, V_r]
        parent_in = torch.where(parents >= 0, cur.gather(1, parents.clamp(min=0)), at_root[:, None])
        cand = parent_in & usable
        ncand = cand.sum(1)
        # candidates in node order, compacted: [B, N] node ids (-1 padding)
        order = torch.where(cand, node[None], N).sort(1).values
        cnode = torch.where(order < N, order, -1)
        ctok = torch.where(cnode >= 0, toks.gather(1, cnode.clamp(min=0)), -1)
        c0 = _row_min(cnode.clamp(min=0)[:, :1], 0)  # the position's draft row: the first candidate's
        d_raw = None if draft_mode == DRAFT_NONE else args.draft[b_idx, c0 // slots, c0 % slots]
        if all_greedy:  # greedy never reads q
            (target, _), draft = process_rows(shard, x_raw, params, ~greedy, ctok), None
        elif draft_mode == DRAFT_LOGITS:  # target and draft rows share the collectives
            both, _ = process_rows(
                shard,
                torch.cat([x_raw.float(), d_raw.float()]),
                tuple(torch.cat([v, v]) for v in params),
                torch.cat([~greedy, ~greedy]),
                torch.cat([ctok, ctok]),
            )
            target, draft = both.take(slice(0, B)), both.take(slice(B, None))
        elif draft_mode == DRAFT_PROBS:
            target, draft = process_rows(shard, x_raw, params, ~greedy, ctok, d_raw, ctok)
        else:
            (target, _), draft = process_rows(shard, x_raw, params, ~greedy, ctok), None
        flag |= live & (target.bad | (~greedy & target.empty))
        # greedy requests: follow the first candidate equal to the argmax
        best = target.argmax
        g_match = cand & (toks == best[:, None])
        g_end = live & greedy & ~g_match.any(1)
        token = torch.where(g_end, best, token)
        # sampled requests
        s_live = live & ~greedy
        leaf = s_live & (ncand == 0)
        q_at = None if draft is None else draft.at_ids
        if draft is not None:
            flag |= s_live & (ncand > 0) & draft.bad
        q_rows = None if draft is None else draft.p
        testing = s_live & ~leaf
        if bool(testing.any()):  # replicated / reduced values: every rank takes the same branch
            chosen, residual = _choose(shard, target, q_rows, q_at, ctok, ncand, args.method, seeds, r, testing)
        else:
            chosen, residual = torch.full((B,), -1, dtype=torch.int64, device=dev), None
        rejected = testing & (chosen < 0)
        if bool((leaf | rejected).any()):
            purposes = torch.where(leaf, PURPOSE_BONUS, PURPOSE_RECOVER)
            p = target.p
            residual = p if residual is None else residual
            res_tok, p_tok = race(shard, [safe_log(residual), safe_log(p)], seeds, r, purposes)
            drawn = torch.where(leaf | (res_tok < 0), p_tok, res_tok).clamp(min=0)
            token = torch.where(leaf | rejected, drawn, token)
        s_acc = s_live & ~leaf & (chosen >= 0)
        # move S: to the candidates spelling the accepted token
        acc_tok = torch.where(greedy, best, _at_rank(ctok, chosen))
        acc_node = torch.where(
            greedy,
            _row_min(torch.where(g_match, node[None], N), N),
            _at_rank(cnode, chosen),
        )
        moving = (live & greedy & ~g_end) | s_acc
        new_cur = cand & (toks == acc_tok[:, None])
        cur = torch.where(moving[:, None], new_cur, cur)
        first = torch.where(moving, _row_min(torch.where(new_cur, node[None], N), N), first)
        last_node = torch.where(moving, acc_node, last_node)
        at_root = at_root & ~moving
        done = done | g_end | leaf | rejected
    return _tree_output(args, toks, parents, last_node, token, flag)


def _row_min(x: torch.Tensor, empty: int) -> torch.Tensor:
    """Minimum of each row of x [R, C]; ``empty`` when C = 0 (no drafts / no tree nodes)."""
    if x.shape[1] == 0:
        return torch.full((x.shape[0],), empty, dtype=x.dtype, device=x.device)
    return x.min(1).values


def _at_rank(x: torch.Tensor, rank: torch.Tensor) -> torch.Tensor:
    """x[b, rank[b]] of candidates x [B, N] (rank -1 reads rank 0); -1 when there are no nodes."""
    if x.shape[1] == 0:
        return torch.full_like(rank, -1)
    return x.gather(1, rank.clamp(min=0)[:, None])[:, 0]


def _tree_output(args, toks, parents, last_node, token, flag) -> TreeVerifyOutput:
    B, D = args.B, args.max_depth
    dev = toks.device
    paths = torch.full((B, D), -1, dtype=torch.int64)
    out_tokens = torch.full((B, D + 1), -1, dtype=torch.int64)
    num = torch.zeros(B, dtype=torch.int32)
    par, last, tk, tok_all = parents.cpu().tolist(), last_node.cpu().tolist(), token.cpu().tolist(), toks.cpu()
    for b in range(B):
        path, nd = [], last[b]
        while nd >= 0:
            path.append(nd)
            nd = par[b][nd]
        path.reverse()
        n = len(path)
        paths[b, :n] = torch.tensor(path, dtype=torch.int64)
        out_tokens[b, :n] = tok_all[b][path] if n else out_tokens[b, :0]
        out_tokens[b, n] = tk[b]
        num[b] = n
    return TreeVerifyOutput(out_tokens.to(dev), num.to(dev), paths.to(dev), flag.to(dev))


def _choose(shard, target: Rows, q_rows, q_at, ctok, ncand, method, seeds, r, active):
    """(chosen candidate rank [B] or -1, residual weights [B, V_r]) for the rows that test
    candidates (``active``), as ``reference.verify_tree._choose``."""
    B, N = ctok.shape
    dev = ctok.device
    p, p_at = target.p, target.at_ids
    ranks = torch.arange(N, device=dev)
    valid = ranks[None] < ncand[:, None]
    u = accept_uniforms(seeds[:, None], ranks[None], r[:, None])
    # duplicates: an earlier candidate with the same token
    same = (ctok[:, :, None] == ctok[:, None, :]) & valid[:, :, None] & valid[:, None, :]
    earlier = torch.tril(torch.ones((N, N), dtype=torch.bool, device=dev), diagonal=-1)
    repeated = (same & earlier[None]).any(2)
    chosen = torch.full((B,), -1, dtype=torch.int64, device=dev)
    if q_rows is None:  # one-hot drafts (host arithmetic, as the reference's scalar loop)
        p_at_h, u_h, rep_h, val_h = p_at.cpu().tolist(), u.cpu().tolist(), repeated.cpu().tolist(), valid.cpu()
        act = active.cpu().tolist()
        ch = [-1] * B
        for b in range(B):
            if not act[b]:
                continue
            mass = 0.0
            for jj in range(int(val_h[b].sum())):
                if rep_h[b][jj]:
                    continue
                pj = p_at_h[b][jj] / (1.0 - mass) if mass < 1.0 else 0.0
                if pj > 0 and u_h[b][jj] <= pj:
                    ch[b] = jj
                    break
                mass += p_at_h[b][jj]
        chosen = torch.tensor(ch, dtype=torch.int64, device=dev)
        own, loc = shard.local(ctok.clamp(min=0))
        removed = torch.zeros_like(p)
        if shard.size:
            removed.scatter_add_(1, loc, (own & valid).double())
        return chosen, torch.where(removed > 0, torch.zeros_like(p), p)
    if method == "kseq":
        return _kseq(shard, p, q_rows, p_at, q_at, u, ncand, active)
    return _rrs(shard, p, q_rows, ctok, u, ncand, repeated, active, method == "rrs_wor")


def _kseq(shard, p, q, p_at, q_at, u, ncand, active):
    B = p.shape[0]
    dev = p.device
    k_h = ncand.cpu().tolist()
    act = active.cpu().tolist()
    hi, beta_hi = [1.0] * B, [0.0] * B
    multi = [act[b] and k_h[b] > 1 for b in range(B)]
    # k <= 1: rho = 1 and beta(1) (one sum); k > 1: the reference's rho search on global sums (every
    # shard takes the same rounds: they see the same sums)
    one = torch.minimum(q, p / 1.0).sum(1, keepdim=True)
    beta1 = shard.sum(one.to(shard.device)).cpu()[:, 0].tolist()
    if any(multi):

        def g_of(pts):
            rho = pts.to(dev)
            local = torch.stack([torch.minimum(rho[:, m : m + 1] * q, p).sum(1) for m in range(RHO_POINTS)], 1)
            return shard.sum(local.to(shard.device)).cpu()

        rho_t, beta_t = rho_search(g_of, torch.tensor([max(k, 2) for k in k_h]))
        hi, beta_hi = rho_t.tolist(), beta_t.tolist()
    rho_h = [hi[b] if multi[b] else 1.0 for b in range(B)]
    beta_h = [beta_hi[b] if multi[b] else beta1[b] for b in range(B)]
    p_h, q_h, u_h = p_at.cpu().tolist(), q_at.cpu().tolist(), u.cpu().tolist()
    ch = [-1] * B
    for b in range(B):
        if not act[b]:
            continue
        for jj in range(k_h[b]):
            if p_h[b][jj] > 0 and u_h[b][jj] * rho_h[b] * q_h[b][jj] <= p_h[b][jj]:
                ch[b] = jj
                break
    c = torch.tensor([kseq_scale(beta_h[b], max(k_h[b], 1)) for b in range(B)], dtype=torch.float64, device=dev)
    rho = torch.tensor(rho_h, dtype=torch.float64, device=dev)
    residual = torch.clamp(p - c[:, None] * torch.minimum(q, p / rho[:, None]), min=0.0)
    return torch.tensor(ch, dtype=torch.int64, device=dev), residual


def _rrs(shard, p, q, ctok, u, ncand, repeated, active, wor: bool):
    B, N = ctok.shape
    dev = p.device
    pj, qj = p.clone(), q.clone()
    chosen = torch.full((B,), -1, dtype=torch.int64, device=dev)
    testing = active.clone()
    for jj in range(int(ncand.max()) if B else 0):
        testing = testing & (jj < ncand) & (chosen < 0)
        if not bool(testing.any()):
            break
        x = ctok[:, jj : jj + 1].clamp(min=0)
        at = shard.sum(torch.cat([shard.lookup(pj, x), shard.lookup(qj, x)], 1).to(shard.device)).to(dev)
        pjx, qjx = at[:, 0], at[:, 1]
        rep = repeated[:, jj] & wor
        ok = testing & ~rep & (pjx > 0) & (u[:, jj] * qjx <= pjx)
        chosen = torch.where(ok, jj, chosen)
        step = testing & ~ok
        r_next = torch.clamp(pj - qj, min=0.0)
        z = shard.sum(r_next.sum(1).to(shard.device)).to(dev)
        new_p = torch.where(z[:, None] > 0, r_next / torch.where(z > 0, z, 1.0)[:, None], r_next)
        pj = torch.where(step[:, None], new_p, pj)
        if wor:
            drop = step & ~rep
            keep = 1.0 - qjx
            own, loc = shard.local(x[:, 0])
            zeroed = qj.clone()
            if shard.size:
                hit = drop & own
                zeroed[hit, loc[hit]] = 0.0
            zeroed = torch.where(keep[:, None] > 0, zeroed / torch.where(keep > 0, keep, 1.0)[:, None], zeroed)
            qj = torch.where(drop[:, None], zeroed, qj)
    return chosen, pj
