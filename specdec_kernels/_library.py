"""``torch.library`` custom ops for the verification functions (torch.compile / CUDA graphs).

``specdec::verify_chain`` and ``specdec::verify_tree`` take the *checked* arguments (the public
functions check them first) with every scalar-or-[B]-tensor parameter split into an optional tensor
and a scalar, and return plain tensors. Each has a fake (meta) implementation giving the output
shapes, so a ``torch.compile`` graph holds the op as one opaque node (no graph break inside the
Triton launcher, which dynamo cannot trace), and ``mode="reduce-overhead"`` can capture it in a CUDA
graph. The public functions call the op only while torch.compile traces them; eager calls go to the
launcher directly (same implementation, less dispatch overhead).

Under torch.compile pass ``validate=False`` (value checks read tensors, a graph break) and an
explicit ``seed`` (``seed=None`` draws a host random number, also a graph break).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._tree_args import TreeArgs
from ._validation import VerifyArgs


def _split(value):
    """(tensor or None, scalar) for a scalar-or-[B]-tensor parameter."""
    return (value, 0) if isinstance(value, Tensor) else (None, value)


def _join(tensor, scalar):
    return tensor if tensor is not None else scalar


# --------------------------------------------------------------------------------------------
# chain verification


@torch.library.custom_op("specdec::verify_chain", mutates_args=())
def verify_chain_op(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft: Tensor | None,
    draft_mode: int,
    temperature_t: Tensor | None,
    temperature: float,
    top_k_t: Tensor | None,
    top_k: int,
    top_p_t: Tensor | None,
    top_p: float,
    num_draft_tokens: Tensor | None,
    seed_t: Tensor | None,
    seed: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """tokens [B, G+1] int64, num_accepted [B] int32, nonfinite [B] bool (see ``sk.verify``)."""
    from ._backend import run_verify

    args = VerifyArgs(
        target_logits,
        draft_tokens,
        draft,
        draft_mode,
        _join(temperature_t, temperature),
        _join(top_k_t, top_k),
        _join(top_p_t, top_p),
        num_draft_tokens,
        _join(seed_t, seed),
    )
    out = run_verify(args, backend)
    return out.tokens, out.num_accepted, out.nonfinite


@verify_chain_op.register_fake
def _verify_chain_fake(
    target_logits,
    draft_tokens,
    draft,
    draft_mode,
    temperature_t,
    temperature,
    top_k_t,
    top_k,
    top_p_t,
    top_p,
    num_draft_tokens,
    seed_t,
    seed,
    backend,
):
    B, G1 = target_logits.shape[0], target_logits.shape[1]
    return (
        target_logits.new_empty((B, G1), dtype=torch.int64),
        target_logits.new_empty((B,), dtype=torch.int32),
        target_logits.new_empty((B,), dtype=torch.bool),
    )


def call_verify_chain(args: VerifyArgs, backend: str):
    """Run the custom op on checked arguments; returns VerifyOutput."""
    from .ops.verify import VerifyOutput

    t_t, t = _split(args.temperature)
    k_t, k = _split(args.top_k)
    p_t, p = _split(args.top_p)
    s_t, s = _split(args.seed)
    tokens, accepted, nonfinite = verify_chain_op(
        args.target_logits,
        args.draft_tokens,
        args.draft,
        args.draft_mode,
        t_t,
        float(t),
        k_t,
        int(k),
        p_t,
        float(p),
        args.num_draft_tokens,
        s_t,
        int(s) % (1 << 62),
        backend,
    )
    return VerifyOutput(tokens, accepted, nonfinite)


# --------------------------------------------------------------------------------------------
# tree / multi-draft verification


@torch.library.custom_op("specdec::verify_tree", mutates_args=())
def verify_tree_op(
    target: Tensor,
    tokens: Tensor,
    parents: Tensor | None,
    draft: Tensor | None,
    draft_mode: int,
    temperature_t: Tensor | None,
    temperature: float,
    top_k_t: Tensor | None,
    top_k: int,
    top_p_t: Tensor | None,
    top_p: float,
    seed_t: Tensor | None,
    seed: int,
    num_nodes: Tensor | None,
    method: str,
    max_depth: int,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """tokens [B, D+1] int64, num_accepted [B] int32, accepted_nodes [B, D] int64, nonfinite [B] bool.

    target [B, K, G+1, V], tokens [B, K, G] (the K-chains view of ``_tree_args``)."""
    from ._backend import run_tree

    args = TreeArgs(
        target,
        tokens,
        parents,
        draft,
        draft_mode,
        _join(temperature_t, temperature),
        _join(top_k_t, top_k),
        _join(top_p_t, top_p),
        _join(seed_t, seed),
        num_nodes,
        method,
        max_depth,
    )
    out = run_tree(args, backend)
    return out.tokens, out.num_accepted, out.accepted_nodes, out.nonfinite


@verify_tree_op.register_fake
def _verify_tree_fake(
    target,
    tokens,
    parents,
    draft,
    draft_mode,
    temperature_t,
    temperature,
    top_k_t,
    top_k,
    top_p_t,
    top_p,
    seed_t,
    seed,
    num_nodes,
    method,
    max_depth,
    backend,
):
    B = target.shape[0]
    return (
        target.new_empty((B, max_depth + 1), dtype=torch.int64),
        target.new_empty((B,), dtype=torch.int32),
        target.new_empty((B, max_depth), dtype=torch.int64),
        target.new_empty((B,), dtype=torch.bool),
    )


def call_verify_tree(args: TreeArgs, backend: str):
    """Run the custom op on checked arguments; returns TreeVerifyOutput."""
    from .ops.verify_tree import TreeVerifyOutput

    t_t, t = _split(args.temperature)
    k_t, k = _split(args.top_k)
    p_t, p = _split(args.top_p)
    s_t, s = _split(args.seed)
    tokens, accepted, nodes, nonfinite = verify_tree_op(
        args.target,
        args.tokens,
        args.parents,
        args.draft,
        args.draft_mode,
        t_t,
        float(t),
        k_t,
        int(k),
        p_t,
        float(p),
        s_t,
        int(s) % (1 << 62),
        args.num_nodes,
        args.method,
        args.max_depth,
        backend,
    )
    return TreeVerifyOutput(tokens, accepted, nodes, nonfinite)
