"""Chain verification as batched PyTorch tensor ops: the ``backend="vectorized"`` path.

What ``backend="auto"`` runs on CPU tensors when the csrc CPU build cannot be compiled (no C++
compiler): the same tokens as the reference (``reference/verify.py``) for the same seeds, without
its Python loops over requests and rows. Every request and every row is one slice of a
``[B, G+1, V]`` tensor operation; the only loops are over the rounds of Philox and, for top-p, over
a few widenings of a partial sort.

It follows the reference step by step, in float64 where the reference is float64:

* logits are read as fp32 with NaN / +inf -> -inf (flagged); draft probabilities as float64 with
  NaN / +inf / negative -> 0 (flagged);
* top-k: the k-th largest finite logit (``torch.topk``, ties kept); top-p: the first position of
  the descending cumulative mass reaching ``top_p`` times the total, found on a partial sort that
  widens until it holds that position (the whole row is never sorted unless it must be);
* p(x) = exp((x - max) / T) / Z over the kept entries; the accept test u * q(x) <= p(x) with u from
  Philox(seed; 0, i, ACCEPT); the first rejection j by a cumulative product;
* the recovered / bonus token: the exponential race over row j with the uniforms of
  Philox(seed; x // 4, j, RECOVER | BONUS) word x % 4 (only at the entries with positive weight:
  after top-k that is a handful), keys log w(x) - log(-log u_x), lowest index on ties.

Philox runs on int64 tensors: a product of two 32-bit words wraps modulo 2**64 and its high and low
words are taken with a shift and a mask, bit-identical to ``reference/philox.py`` (tested).
Works on any device (it is plain tensor code); ``auto`` uses it only for CPU tensors.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._types import DRAFT_LOGITS, DRAFT_PROBS, VerifyOutput
from .._validation import VerifyArgs
from ..reference.sampling import PURPOSE_ACCEPT, PURPOSE_BONUS, PURPOSE_RECOVER

_MASK32 = 0xFFFFFFFF
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_UNIFORM_SHIFT = 9  # 23 random bits: ((bits >> 9) + 0.5) * 2**-23
_MIN_TEMPERATURE = 2.0**-126  # below (or NaN): greedy, as the reference and the kernels
_TOP_P_FIRST_WIDTH = 256  # entries of the first partial sort for top-p (doubled until enough)
_SPARSE_RACE = 0.25  # race only over the positive entries when they are at most this fraction


# --------------------------------------------------------------------------------------------
# random numbers


def philox(seed: Tensor, c0: Tensor, c1: Tensor, c2: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Philox4x32-10, key = 64-bit ``seed``, counter (c0, c1, c2, 0); int64 tensors that broadcast.

    Returns the four output words as int64 tensors in [0, 2**32)."""
    k0 = seed & _MASK32
    k1 = (seed >> 32) & _MASK32
    c0, c1, c2, k0, k1 = torch.broadcast_tensors(c0 & _MASK32, c1 & _MASK32, c2 & _MASK32, k0, k1)
    c3 = torch.zeros_like(c0)
    for _ in range(10):
        prod_b = c2 * _ROUND_B  # < 2**64 as unsigned; int64 wraps, the bits are the same
        prod_a = c0 * _ROUND_A
        c0, c2 = ((prod_b >> 32) & _MASK32) ^ c1 ^ k0, ((prod_a >> 32) & _MASK32) ^ c3 ^ k1
        c1, c3 = prod_b & _MASK32, prod_a & _MASK32
        k0 = (k0 + _KEY_A) & _MASK32
        k1 = (k1 + _KEY_B) & _MASK32
    return c0, c1, c2, c3


def uniform_from_bits(bits: Tensor) -> Tensor:
    """int64 words in [0, 2**32) -> float32 uniforms strictly inside (0, 1)."""
    return ((bits >> _UNIFORM_SHIFT).to(torch.float32) + 0.5) * 2.0**-23


def race_noise_dense(seed: Tensor, row: Tensor, purpose: Tensor, V: int) -> Tensor:
    """log(-log u_x) [R, V] (float64) for every vocabulary entry x of R rows: u_x is word x % 4 of
    Philox(seed; x // 4, row, purpose). One Philox call per quad of entries. seed, row, purpose: [R]."""
    quads = torch.arange((V + 3) // 4, device=seed.device, dtype=torch.int64)
    words = philox(seed[:, None], quads[None, :], row[:, None], purpose[:, None])
    bits = torch.stack(words, -1).reshape(seed.shape[0], -1)[:, :V]
    return torch.log(-torch.log(uniform_from_bits(bits).to(torch.float64)))


def race_noise_at(seed: Tensor, x: Tensor, row: Tensor, purpose: Tensor) -> Tensor:
    """log(-log u_x) (float64) at given entries: seed, x, row, purpose are equal-length [M]."""
    words = philox(seed, x >> 2, row, purpose)
    lane = x & 3
    bits = torch.where(lane == 0, words[0], words[1])
    bits = torch.where(lane == 2, words[2], bits)
    bits = torch.where(lane == 3, words[3], bits)
    return torch.log(-torch.log(uniform_from_bits(bits).to(torch.float64)))


# --------------------------------------------------------------------------------------------
# logit processing (batched rows [R, V]; per-row temperature, top_k, top_p)


def sanitize(x: Tensor) -> tuple[Tensor, Tensor]:
    """(fp32 logits with NaN / +inf -> -inf, [rows] whether a row had any)."""
    x = x.to(torch.float32)
    bad = torch.isnan(x) | torch.isposinf(x)
    row_bad = bad.any(-1)
    if bool(row_bad.any()):
        x = x.masked_fill(bad, float("-inf"))
    return x, row_bad


def sanitize_probs(q: Tensor) -> tuple[Tensor, Tensor]:
    """(float64 probabilities with NaN / +inf / negative -> 0, [rows] whether a row had any)."""
    q = q.to(torch.float64)
    bad = ~((q >= 0) & (q < float("inf")))
    row_bad = bad.any(-1)
    if bool(row_bad.any()):
        q = q.masked_fill(bad, 0.0)
    return q, row_bad


def _weights(x: Tensor, thr: Tensor, m: Tensor, t: Tensor) -> Tensor:
    """float64 exp((x - m) / T) at the kept entries (x >= thr, finite), 0 elsewhere.

    x [..., V]; thr, m (a finite row max), t: [...]."""
    w = torch.exp((x.to(torch.float64) - m[..., None]) / t[..., None])
    return w.masked_fill(~((x >= thr[..., None]) & (x > float("-inf"))), 0.0)


def filter_thresholds(x: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Raw-logit thresholds [R] of top-k then top-p (keep x >= thr; -inf: nothing filtered) for
    sanitised fp32 rows x [R, V]; t, top_p float64 [R], top_k int64 [R]. As the reference's
    ``filter_threshold``: the k-th largest finite logit (ties kept); then the kept logit at the
    first position of the descending cumulative mass that reaches top_p * the total."""
    R, V = x.shape
    thr = torch.full((R,), float("-inf"), dtype=torch.float32, device=x.device)
    use_k = (top_k > 0) & (top_k < V)
    if bool(use_k.any()):
        rows = use_k.nonzero().squeeze(1)
        k = top_k[rows]
        top = torch.topk(x[rows], int(k.max()), dim=-1).values
        # fewer than k finite logits: the k-th is -inf, and -inf filters nothing (as the reference)
        thr[rows] = top.gather(1, (k - 1)[:, None]).squeeze(1)
    use_p = top_p < 1.0
    if bool(use_p.any()):
        rows = use_p.nonzero().squeeze(1)
        thr[rows] = _top_p_thresholds(x[rows], thr[rows], t[rows], top_p[rows])
    return thr


def _top_p_thresholds(x: Tensor, thr: Tensor, t: Tensor, top_p: Tensor) -> Tensor:
    """top-p on rows already cut at thr (top-k): the smallest descending prefix of the kept logits
    whose mass reaches top_p times the total, ties at its end kept. A partial sort (``topk``) that
    doubles in width until it holds that position; the weights and the cumulative mass are float64
    exp((x - max) / T), as the reference computes them on its full sort."""
    R, V = x.shape
    kept = torch.where(x >= thr[:, None], x, torch.full_like(x, float("-inf")))
    m = kept.amax(-1)
    finite = m > float("-inf")  # rows with nothing kept keep their threshold
    count = (kept > float("-inf")).sum(-1)
    total = torch.exp((kept.to(torch.float64) - torch.where(finite, m, 0.0)[:, None]) / t[:, None]).sum(-1)
    goal = top_p.to(torch.float64) * total
    out = thr.clone()
    pending = finite.nonzero().squeeze(1)
    width = min(V, _TOP_P_FIRST_WIDTH)
    while pending.numel() > 0:
        vals = torch.topk(kept[pending], width, dim=-1).values  # descending
        mass = torch.cumsum(torch.exp((vals.to(torch.float64) - m[pending, None]) / t[pending, None]), -1)
        n = count[pending]
        # the prefix holds the answer when its mass reaches the goal or it holds every kept entry
        done = (mass[:, -1] >= goal[pending]) | (n <= width)
        first = (mass < goal[pending, None]).sum(-1)  # searchsorted (left) on the nondecreasing mass
        first = torch.minimum(first, n - 1).clamp(max=width - 1)
        chosen = vals.gather(1, first[:, None]).squeeze(1)
        out[pending[done]] = chosen[done]
        pending = pending[~done]
        width = min(V, width * 4)
    return out


class _Rows:
    """The processed distributions of a stack of sanitised rows x [..., V] (per-row temperature,
    top_k, top_p: [...]): threshold, max and normaliser of each row, as ``processed_probs``."""

    def __init__(self, x: Tensor, t: Tensor, top_k: Tensor, top_p: Tensor, filtered: bool):
        lead, V = x.shape[:-1], x.shape[-1]
        self.x, self.t = x, t
        if filtered:
            flat = filter_thresholds(x.reshape(-1, V), t.reshape(-1), top_k.reshape(-1), top_p.reshape(-1))
            self.thr = flat.reshape(lead)
        else:
            self.thr = torch.full(lead, float("-inf"), dtype=torch.float32, device=x.device)
        m = x.amax(-1)  # the largest finite logit is always kept
        self.empty = m == float("-inf")  # nothing to sample: p = 0 everywhere
        self.m = m.masked_fill(self.empty, 0.0)
        self.z = _weights(x, self.thr, self.m, t).sum(-1).masked_fill(self.empty, 1.0)

    def prob_at(self, x_at: Tensor, rows: int) -> Tensor:
        """float64 p(x) for logits x_at [M, rows], one read from each of the first ``rows`` rows of
        every request (rows [M, rows] of the stack [M, R, V])."""
        thr, m, t, z = (v[:, :rows] for v in (self.thr, self.m, self.t, self.z))
        kept = (x_at >= thr) & (x_at > float("-inf"))
        p = torch.exp((x_at.to(torch.float64) - m) / t) / z
        return p.masked_fill(~kept, 0.0)

    def probs(self, index: tuple) -> Tensor:
        """float64 probabilities [M, V] of the rows picked by an advanced index of the leading dims."""
        return _weights(self.x[index], self.thr[index], self.m[index], self.t[index]) / self.z[index][:, None]


# --------------------------------------------------------------------------------------------
# chain verification


def verify_vectorized(args: VerifyArgs) -> VerifyOutput:
    """Chain verification on checked arguments in the padded layout (``VerifyArgs.padded()``)."""
    B, G, V = args.B, args.G, args.V
    dev = args.target_logits.device
    params = {k: v.to(dev) for k, v in args.per_request_cpu().items()}
    pos = torch.arange(G + 1, device=dev)
    drafts = args.draft_tokens.to(torch.int64)
    # A placeholder id (outside [0, V)) ends the draft: that position draws the bonus token from p.
    n = params["num_draft_tokens"].clamp(0, G)
    usable = (drafts >= 0) & (drafts < V) & (pos[None, :G] < n[:, None])
    n = usable.to(torch.int64).cumprod(-1).sum(-1)
    tok = drafts.clamp(0, max(V - 1, 0))

    x, row_bad = sanitize(args.target_logits)  # [B, G+1, V]
    g_max, g_idx = torch.max(x, dim=-1)  # the first index among equal maxima
    flag_rows = row_bad | (g_max == float("-inf"))  # nothing to choose from: token 0, flagged
    accept = tok == g_idx[:, :G]  # greedy requests
    greedy = ~(params["temperature"] >= _MIN_TEMPERATURE)  # NaN / subnormal act as greedy
    sampled = (~greedy).nonzero().squeeze(1)
    chain = None
    if sampled.numel() > 0:
        chain = _SampledChain(args, params, x, tok, n, sampled)
        accept[sampled] = chain.accept
    j = (accept & (pos[None, :G] < n[:, None])).to(torch.int64).cumprod(-1).sum(-1)  # first rejection
    flagged = (flag_rows & (pos[None, :] <= j[:, None])).any(-1)
    token = g_idx.gather(1, j[:, None]).squeeze(1)
    if chain is not None:
        js = j[sampled]
        flagged[sampled] |= chain.draft_flags(js)
        token[sampled] = chain.race(js)
    out = torch.cat([drafts, drafts.new_full((B, 1), -1)], 1)
    out = torch.where(pos[None, :] < j[:, None], out, torch.full_like(out, -1))
    out = torch.where(pos[None, :] == j[:, None], token[:, None], out)
    return VerifyOutput(out, j.to(torch.int32), flagged)


class _SampledChain:
    """The sampled requests (rows ``index`` of the batch): accept tests of every draft, then the
    race over each request's row j."""

    def __init__(self, args: VerifyArgs, params: dict, x: Tensor, tok: Tensor, n: Tensor, index: Tensor):
        B, G, V = args.B, args.G, args.V
        whole = index.numel() == B
        pick = (lambda t: t) if whole else (lambda t: t[index])
        self.mode, self.V, self.G = args.draft_mode, V, G
        self.tok, self.n = pick(tok), pick(n)
        self.seed = pick(params["seed"])
        t = pick(params["temperature"]).to(torch.float64)
        top_k, top_p = pick(params["top_k"]), pick(params["top_p"]).to(torch.float64)
        filtered = args.has_filter and bool((((top_k > 0) & (top_k < V)) | (top_p < 1.0)).any())
        G1 = G + 1
        xs = pick(x)
        self.target = _Rows(
            xs, t[:, None].expand(-1, G1), top_k[:, None].expand(-1, G1), top_p[:, None].expand(-1, G1), filtered
        )
        p_tok = self.target.prob_at(xs[:, :G].gather(2, self.tok[:, :, None]).squeeze(2), G)
        draft = pick(args.draft) if args.draft is not None else None
        self.draft = self.qs = None
        self.draft_bad = torch.zeros(self.tok.shape, dtype=torch.bool, device=x.device)
        if self.mode == DRAFT_LOGITS:
            xd, self.draft_bad = sanitize(draft)
            self.draft = _Rows(
                xd, t[:, None].expand(-1, G), top_k[:, None].expand(-1, G), top_p[:, None].expand(-1, G), filtered
            )
            q_tok = self.draft.prob_at(xd.gather(2, self.tok[:, :, None]).squeeze(2), G)
        elif self.mode == DRAFT_PROBS:
            self.qs, self.draft_bad = sanitize_probs(draft)
            q_tok = self.qs.gather(2, self.tok[:, :, None]).squeeze(2)
        else:
            q_tok = torch.ones_like(p_tok)
        rows = torch.arange(G, device=x.device, dtype=torch.int64)
        u = uniform_from_bits(
            philox(self.seed[:, None], torch.zeros_like(rows), rows, torch.full_like(rows, PURPOSE_ACCEPT))[0]
        )
        self.accept = (p_tok > 0) & (u.to(torch.float64) * q_tok <= p_tok)

    def draft_flags(self, j: Tensor) -> Tensor:
        """Unusable values in the draft rows a request used: rows 0 .. j that are drafts."""
        rows = torch.arange(self.G, device=j.device)
        used = (rows[None, :] <= j[:, None]) & (rows[None, :] < self.n[:, None])
        return (self.draft_bad & used).any(-1)

    def race(self, j: Tensor) -> Tensor:
        """The recovered (j < n: residual max(p - q, 0), else p) or bonus (p) token of row j."""
        M = j.numel()
        ar = torch.arange(M, device=j.device)
        p = self.target.probs((ar, j))  # [M, V]
        recover = j < self.n
        w = p
        if bool(recover.any()):
            jq = j.clamp(max=max(self.G - 1, 0))
            if self.mode == DRAFT_LOGITS:
                q = self.draft.probs((ar, jq))
            elif self.mode == DRAFT_PROBS:
                q = self.qs[ar, jq]
            else:  # one-hot q: the residual is p without the draft token
                q = torch.zeros_like(p).scatter_(1, self.tok[ar, jq][:, None], 1.0)
            w = torch.where(recover[:, None], torch.clamp(p - q, min=0), p)
        purpose = torch.where(recover, PURPOSE_RECOVER, PURPOSE_BONUS).to(torch.int64)
        noise = self._noise(p > 0, j, purpose)
        res_key = _safe_log(w) - noise
        p_key = _safe_log(p) - noise
        res_best, res_idx = res_key.max(-1)
        p_best, p_idx = p_key.max(-1)
        p_idx = torch.where(p_best > float("-inf"), p_idx, torch.zeros_like(p_idx))  # nothing: token 0
        return torch.where(recover & (res_best > float("-inf")), res_idx, p_idx)

    def _noise(self, positive: Tensor, j: Tensor, purpose: Tensor) -> Tensor:
        """log(-log u_x) of row j's race at the entries with p > 0 (0 elsewhere: their key is -inf)."""
        M, V = positive.shape
        count = int(positive.sum())
        if count > _SPARSE_RACE * M * V:
            return race_noise_dense(self.seed, j, purpose, V)
        r, x = positive.nonzero(as_tuple=True)
        noise = torch.zeros((M, V), dtype=torch.float64, device=j.device)
        noise[r, x] = race_noise_at(self.seed[r], x, j[r], purpose[r])
        return noise


def _safe_log(w: Tensor) -> Tensor:
    """log w where w > 0, -inf elsewhere."""
    return torch.log(w).masked_fill(~(w > 0), float("-inf"))
