"""Medusa heads: extra next-next-token heads on the target's last hidden state, and their token trees.

Head k (k = 1..K) reads the hidden state h_t the target's LM head reads at position t and predicts the
token at t + 1 + k. In the driver, t is the last accepted node of the previous step (the position
just before the root, the last committed token), so head k proposes the depth-k nodes of the tree
hanging off the root; no forward beyond the target's verification forward is needed.

Tree (one per request and step). The candidates at depth k are s_k tokens of head k's
distribution q_k: its top-s_k when greedy, or, when sampling, s_k draws *without replacement*
from q_k in draw order (Gumbel-top-s: the ordered top-s of q / E, E ~ Exp(1)). A node is a path of
ranks (r_1, ..., r_d) with token cand[d][r_d]; its score is prod_j sorted(q_j)[r_j], the product
of the heads' sorted probabilities at those ranks. The tree keeps the N best-scoring nodes of the
Cartesian product (ties broken by a fixed breadth-first order), which is closed under parents and
earlier siblings, and orders them by score: parents come before children and siblings in rank
(= draw) order.

Why sampled trees stay exact (``sk.verify_tree`` with ``method="rrs_wor"``, q = q_k for every
node at depth k): the tree's *shape* depends only on the heads' sorted probabilities, never on
the sampled tokens; the children of every node are the first few draws of one sequential
without-replacement sample from the head's distribution, and that sample is independent of
everything that decided the walk reached that node (the walk visits one node per depth). Those are
the conditions of recursive rejection sampling without replacement. Deterministic top-s with
the heads' q is *not* exact for sampling (only for greedy, where q is never read); the statistical
test in ``tests/hf/test_medusa.py`` shows that variant failing.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
MAX_CARTESIAN = 4096  # nodes of the full Cartesian tree before pruning (scores are [A, M])
MIN_RANK_PROB = 1e-4  # sampled trees: a rank whose sorted head probability is below this gets no node


class ResBlock(nn.Module):
    """x + SiLU(W x + b); W starts at zero so a fresh head equals its output layer (Medusa)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K heads, each ``num_layers`` residual SiLU blocks and a linear layer to the vocabulary.

    ``forward(hidden [..., H]) -> logits [..., K, V]``; head k (index k - 1) predicts the token
    k + 1 positions after the hidden state's own position.
    """

    def __init__(self, hidden_size: int, vocab_size: int, num_heads: int = 4, num_layers: int = 1):
        super().__init__()
        if num_heads < 1 or num_layers < 0:
            raise ValueError(f"num_heads must be >= 1 and num_layers >= 0, got {num_heads}, {num_layers}")
        self.config = dict(
            hidden_size=int(hidden_size),
            vocab_size=int(vocab_size),
            num_heads=int(num_heads),
            num_layers=int(num_layers),
        )
        self.heads = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(hidden_size) for _ in range(num_layers)], nn.Linear(hidden_size, vocab_size, bias=False)
            )
            for _ in range(num_heads)
        )

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def hidden_size(self) -> int:
        return self.config["hidden_size"]

    @property
    def vocab_size(self) -> int:
        return self.config["vocab_size"]

    def init_from_lm_head(self, lm_head: nn.Module) -> None:
        """Copy the target's LM head into every head's output layer (the usual Medusa start)."""
        with torch.no_grad():
            for head in self.heads:
                head[-1].weight.copy_(lm_head.weight[: self.vocab_size])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = self.heads[0][-1].weight.dtype
        x = hidden.to(dtype)
        return torch.stack([head(x) for head in self.heads], dim=-2)

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.float16) -> int:
        """``config.json`` + ``model.safetensors`` (``dtype``); returns the weight file's size in bytes."""
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        (path / CONFIG_NAME).write_text(json.dumps(self.config, indent=2) + "\n")
        state = {k: v.detach().to(dtype).contiguous() for k, v in self.state_dict().items()}
        save_file(state, str(path / WEIGHTS_NAME))
        return (path / WEIGHTS_NAME).stat().st_size

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> MedusaHeads:
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / CONFIG_NAME).is_file() or not (path / WEIGHTS_NAME).is_file():
            raise FileNotFoundError(f"no Medusa heads at {path} (expected {CONFIG_NAME} and {WEIGHTS_NAME})")
        heads = cls(**json.loads((path / CONFIG_NAME).read_text()))
        heads.load_state_dict(load_file(str(path / WEIGHTS_NAME)))
        return heads.to(device=device, dtype=dtype).eval()


# ---------------------------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------------------------


@dataclass
class CartesianTree:
    """The full Cartesian tree over candidate ranks, in breadth-first order (depth, then parent,
    then rank): M = s_1 + s_1 s_2 + ... nodes. Built once per call, on the device.

    depth [M] int64 (1..K), rank [M] int64, parent [M] int64 (a node index, -1 at depth 1),
    path_rank [M, K] int64: the rank at every depth of the node's path (0 past its depth).
    """

    topk: tuple[int, ...]
    depth: torch.Tensor
    rank: torch.Tensor
    parent: torch.Tensor
    path_rank: torch.Tensor

    @property
    def size(self) -> int:
        return int(self.depth.numel())


def cartesian_tree(topk: tuple[int, ...], device="cpu") -> CartesianTree:
    """Breadth-first Cartesian tree with s_k = topk[k - 1] candidates at depth k."""
    if not topk or any(int(s) < 1 for s in topk):
        raise ValueError(f"candidates per head must be >= 1, got {topk}")
    K = len(topk)
    paths: list[tuple[int, ...]] = []
    level: list[tuple[int, ...]] = [()]
    index = {(): -1}
    parents: list[int] = []
    for s in topk:
        nxt = []
        for path in level:
            for r in range(s):
                child = path + (r,)
                index[child] = len(paths)
                parents.append(index[path])
                paths.append(child)
                nxt.append(child)
        level = nxt
        if len(paths) > MAX_CARTESIAN:
            raise ValueError(f"the Cartesian tree of candidates {topk} has more than {MAX_CARTESIAN} nodes")
    depth = torch.tensor([len(p) for p in paths], dtype=torch.int64)
    rank = torch.tensor([p[-1] for p in paths], dtype=torch.int64)
    path_rank = torch.tensor([list(p) + [0] * (K - len(p)) for p in paths], dtype=torch.int64)
    parent = torch.tensor(parents, dtype=torch.int64)
    return CartesianTree(tuple(int(s) for s in topk), *(t.to(device) for t in (depth, rank, parent, path_rank)))


@dataclass
class MedusaTree:
    """One step's trees, as ``sk.verify_tree`` takes them (N = tree width, nodes past num_nodes pad).

    tokens [A, N] int64, parents [A, N] int64 (-1 = child of the root), num_nodes [A] int64,
    depth [A, N] int64 (0 for padding), max_depth [A] int64 (the depth each request offers),
    probs [A, N, V] fp32 (q of each node's head; None when greedy).
    """

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor
    depth: torch.Tensor
    max_depth: torch.Tensor
    probs: torch.Tensor | None


def candidate_tokens(
    q: torch.Tensor, logits: torch.Tensor, topk: tuple[int, ...], *, greedy: bool, generator=None
) -> torch.Tensor:
    """[A, K, S] candidate tokens per head (S = max topk), in rank order.

    greedy: each head's top-S tokens (q unused). Sampled: the first S draws of a sequential sample
    without replacement from q (Gumbel-top-S as the exponential race: the top-S of q / E, E ~ Exp(1),
    in decreasing order). Tokens with q = 0 come last; the tree never uses their ranks (score -inf).
    """
    S = max(topk)
    if greedy:
        return torch.topk(logits.float(), S, dim=-1).indices
    # fp64 exponentials (a float32 draw of exactly 0 would give a zero-probability token the key
    # 0 / 0 = NaN, which topk ranks first); zero-probability tokens get key -1, after every real one.
    race = torch.empty_like(q, dtype=torch.float64).exponential_(generator=generator)
    keys = torch.where(q > 0, q.double() / race.clamp_min(torch.finfo(torch.float64).tiny), -1.0)
    return torch.topk(keys, S, dim=-1).indices


def build_tree(
    cart: CartesianTree, log_sorted: torch.Tensor, candidates: torch.Tensor, num_nodes: int
) -> tuple[torch.Tensor, ...]:
    """Prune the Cartesian tree to the ``num_nodes`` best nodes per request.

    log_sorted: [A, K, S] log of each head's probabilities in decreasing order (-inf where zero);
    candidates: [A, K, S] tokens by rank. Returns tokens, parents, num_nodes, depth [A, N] / [A]
    with N = min(num_nodes, M). Nodes of score -inf (ranks past a head's support) are dropped.
    """
    A, K, S = log_sorted.shape
    M = cart.size
    N = min(num_nodes, M)
    # score[a, m] = sum over the node's path of log q_j sorted at rank r_j
    gathered = log_sorted.gather(2, cart.path_rank.T[None].expand(A, K, M))  # [A, K, M]
    on_path = torch.arange(K, device=log_sorted.device)[:, None] < cart.depth[None, :]  # [K, M]
    score = torch.where(on_path[None], gathered, torch.zeros_like(gathered)).sum(dim=1)  # [A, M]
    # stable: equal scores keep breadth-first order, so parents and earlier siblings come first
    order = torch.sort(-score, dim=1, stable=True).indices[:, :N]  # [A, N] Cartesian ids
    kept_score = score.gather(1, order)
    real = kept_score > float("-inf")
    position = torch.empty(A, M, dtype=torch.int64, device=order.device)
    position.scatter_(1, order, torch.arange(N, device=order.device).expand(A, N))
    position.masked_fill_(torch.ones(A, M, dtype=torch.bool, device=order.device).scatter(1, order, False), -1)
    cart_parent = cart.parent[order]  # [A, N]
    parents = torch.where(cart_parent >= 0, position.gather(1, cart_parent.clamp_min(0)), -1)
    parents = torch.where(real, parents, -1)
    depth = torch.where(real, cart.depth[order], 0)
    tokens = candidates.reshape(A, K * S).gather(1, (cart.depth[order] - 1) * S + cart.rank[order])
    tokens = torch.where(real, tokens, 0)
    return tokens, parents, real.long().sum(dim=1), depth


def medusa_tree(
    head_logits: torch.Tensor,
    cart: CartesianTree,
    num_nodes: int,
    sampling: dict,
    *,
    generator=None,
    sampler=candidate_tokens,
) -> MedusaTree:
    """The step's trees from the heads' logits [A, K, V] (see the module docstring)."""
    from .drafting import draft_distribution

    greedy = sampling["temperature"] == 0.0
    topk = cart.topk
    S = max(topk)
    if greedy:
        q = None
        log_q = torch.log_softmax(head_logits.float(), dim=-1)
    else:
        q = draft_distribution(head_logits, **sampling)  # [A, K, V]
        log_q = torch.log(q)
    log_sorted = torch.topk(log_q, S, dim=-1).values  # [A, K, S]
    allowed = (
        torch.arange(S, device=head_logits.device)[None, :] < torch.tensor(topk, device=head_logits.device)[:, None]
    )
    allowed = allowed[None]
    if not greedy:
        # Rank r is drawn after r others were removed; rrs_wor renormalises q by the mass left, which
        # is >= sorted q[r]. Ranks below MIN_RANK_PROB would divide by fp32 dust (1 - q(x) == 0 for a
        # q(x) that rounds to 1) and are never worth a node. A rule on the sorted probabilities only,
        # so the shape stays independent of the draws.
        allowed = allowed & (log_sorted >= math.log(MIN_RANK_PROB))
    log_sorted = log_sorted.masked_fill(~allowed, float("-inf"))
    candidates = sampler(q, head_logits, topk, greedy=greedy, generator=generator)
    tokens, parents, n, depth = build_tree(cart, log_sorted, candidates, num_nodes)
    probs = None
    if q is not None:
        A, N = tokens.shape
        V = q.shape[-1]
        probs = q.gather(1, (depth - 1).clamp_min(0)[:, :, None].expand(A, N, V))
    return MedusaTree(tokens, parents, n, depth, depth.max(dim=1).values, probs)
