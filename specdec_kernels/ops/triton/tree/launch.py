"""The launches of tree verification (the phases of the package docstring), one small function per
phase, all reading one ``TreePlan``."""

from __future__ import annotations

import dataclasses

import torch

from ...._tree_args import TreeArgs
from ...._types import TreeVerifyOutput
from ...._validation import _last_dim_contiguous
from ..helpers import cdiv, next_pow2
from ..row_pass import RowPassLayout, launch_row_stats
from .common import POS_REC_HOST, RACE_F_HOST, RACE_I_HOST, RB_REC_HOST, RHO_POINTS, RHO_ROUNDS, RRS_MAX_HOST
from .plan import TreePlan, plan_tree
from .positions import _tree_positions_kernel
from .race import _tree_finalize_kernel, _tree_race_kernel
from .rho import _tree_rho_kernel, _tree_rho_step_kernel
from .rrs import _tree_rrs_kernel
from .walk import _tree_walk_kernel

# One program per request walks [NP2, NP2] tiles (NP2 = 64 at N = 60): at 4 warps the rrs_wor walk with a
# token_bitmask held 255 registers and spilled 28 bytes (bench_static, sm_90); 8 warps: 211, no spill. The
# K-SEQ walk (about 80 registers) stays at 4: at 8 its masked form kept a 4-byte local slot.
WALK_WARPS_RRS = 8
WALK_WARPS_KSEQ = 4


def launch_tree(args: TreeArgs, *overrides, logprobs: bool = False) -> TreeVerifyOutput:
    """Run the launches of the package docstring on checked arguments (``_tree_args.check_tree_args``).
    overrides: ``plan_tree``'s, in its order (block_v, num_chunks, threshold_chunks, threshold_capacity).
    logprobs (return_logprobs without top-n): the walk also writes ``out.logprobs`` of the tokens it
    knows (accepted, greedy) and the race's merge those of the raced ones, from the records of the
    rows the walk scored them with (``walk._walk_logprobs``), so the post-pass (``ops/logprobs.py``)
    returns at once."""
    B, D = args.B, args.max_depth
    dev = args.target.device
    tokens = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    nodes = torch.empty((B, D), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    nonfinite = torch.empty((B,), dtype=torch.bool, device=dev)
    lp = torch.empty((B, D + 1), dtype=torch.float32, device=dev) if logprobs else None
    out = TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite, logprobs=lp)
    if B == 0:
        return out
    if args.token_bitmask is not None:  # the kernels step through a mask row's words with stride 1
        args = dataclasses.replace(args, token_bitmask=_last_dim_contiguous(args.token_bitmask))
    plan = plan_tree(args, *overrides, logprobs=logprobs)
    pos = use = None  # the row pass reads every row unless the positions say which are used
    if plan.with_positions:
        pos, use = _launch_positions(plan)
    stats, idx, thr = _launch_row_pass(plan, use)
    brk = rrs = stats  # unused unless K-SEQ / RRS sample with draft distributions
    if plan.kseq and plan.sampled:
        brk = _launch_rho(plan, pos, stats, thr)
    if plan.with_positions and plan.rrs_rounds > 0:
        rrs = _launch_rrs(plan, pos, stats, thr)
    race = _launch_walk(plan, out, stats, idx, thr, brk, rrs)
    if plan.sampled:  # the recovered / bonus tokens: races split over the vocabulary like chain verification
        _launch_race(plan, race, stats, thr, out)
    return out


def _launch_positions(plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a walk can reach and their candidates, from the tree alone; (positions, the
    row pass's record use)."""
    a, dev = plan.args, plan.args.target.device
    pos = torch.empty((a.B, a.N + 1, POS_REC_HOST), dtype=torch.int32, device=dev)
    use = torch.zeros((plan.rows, 2), dtype=torch.int8, device=dev)
    _tree_positions_kernel[(cdiv(a.B, plan.positions_block_b),)](
        **_tree_args(plan), pos_ptr=pos, use_ptr=use, B=a.B, K=a.K, G=a.G, V=a.V, BLOCK_B=plan.positions_block_b
    )
    return pos, use


def _launch_row_pass(plan: TreePlan, use: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics of every used row (thresholds first where filtered), merged to one record per
    row for the walk: (stats, idx, thr) - the row pass chain verification runs (``launch_row_stats``).
    Rows past a ragged tree's last node are skipped: the pass's count of a request is its node count
    (row i of a single chain belongs to node i - 1); chains of verify_multi are never ragged;
    placeholder drafts are the walk's, not the row pass's. With logprobs greedy rows get their
    top-k / top-p thresholds too (their scores apply them at T = 1)."""
    a = plan.args
    m = _mask_args(plan)  # token_bitmask [B, K, G+1, W] (verify_tree: K = 1, G = N)
    layout = RowPassLayout(
        a.target, a.draft, a.draft_mode, a.B, a.K, a.G, a.V, tuple(a.target.stride()[:3]), plan.d_strides,
        counts=a.num_nodes, use=use, mask=a.token_bitmask, parents=a.parents,
        mask_strides=(m["stride_mb"], m["stride_mk"], m["stride_mg"]),
    )  # fmt: skip
    rows = launch_row_stats(layout, a.sampling, plan.row_pass, logprobs=plan.logprobs)
    return rows.stats, rows.idx, rows.thr


def _row_args(plan: TreePlan) -> dict:
    """What every kernel that reads target / draft rows takes: the rows (a draft-less call's draft is
    the target, its strides 0), their sizes and how they are read."""
    a, target, d = plan.args, plan.args.target, plan.d_strides
    return dict(
        target_ptr=target,
        draft_ptr=plan.draft,
        stride_tb=target.stride(0),
        stride_tk=target.stride(1),
        stride_tg=target.stride(2),
        stride_db=d[0],
        stride_dk=d[1],
        stride_dg=d[2],
        B=a.B,
        K=a.K,
        G=a.G,
        V=a.V,
        DRAFT_MODE=a.draft_mode,
        HAS_FILTER=plan.has_filter,
        BY_INDEX=plan.by_index,
    ) | _mask_args(plan)


def _mask_args(plan: TreePlan) -> dict:
    """The token_bitmask (a placeholder and HAS_MASK False without one): its words [B, K, G+1, W] and
    strides; a tree's draft rows find their mask rows through the parents (``_parents_args``)."""
    mask = plan.args.token_bitmask
    strides = tuple(mask.stride()[:3]) if mask is not None else (0, 0, 0)
    return dict(
        mask_ptr=mask if mask is not None else plan.args.target,
        stride_mb=strides[0],
        stride_mk=strides[1],
        stride_mg=strides[2],
        HAS_MASK=mask is not None,
    )


def _parents_args(plan: TreePlan) -> dict:
    """The tree's parents (verify_tree) or CHAINS (verify_multi: implicit parents)."""
    return dict(parents_ptr=plan.parents, stride_pb=plan.stride_pb, CHAINS=plan.args.parents is None)


def _tree_args(plan: TreePlan) -> dict:
    """What the kernels that read the tree take (positions, walk): its tokens, parents and node
    counts, their strides, and how they are laid out."""
    a = plan.args
    return _parents_args(plan) | dict(
        tokens_ptr=a.tokens,
        num_nodes_ptr=plan.n_ptr,
        stride_xb=a.tokens.stride(0),
        stride_xk=a.tokens.stride(1),
        N=a.N,
        D=a.max_depth,
        PER_REQ_N=plan.per_req_n,
        NP2=plan.np2,
    )


def _position_args(plan: TreePlan, pos: torch.Tensor, stats: torch.Tensor, thr: torch.Tensor) -> dict:
    """What the kernels that sum over the vocabulary at each position take (rho, RRS): the rows,
    the temperature, the positions and the row pass's records."""
    rows = _row_args(plan) | _parents_args(plan) | _sampling_args(plan, "temperature")
    return rows | dict(pos_ptr=pos, stats_ptr=stats, thr_ptr=thr, N=plan.args.N)


def _race_args(race: tuple[torch.Tensor, ...]) -> dict:
    """The walk's race records (race_i, race_f, race_zs, race_ds, race_xs), which the race reads."""
    return {f"race_{name}_ptr": record for name, record in zip(("i", "f", "zs", "ds", "xs"), race, strict=True)}


def _sampling_args(plan: TreePlan, *names: str) -> dict:
    """The per-request tensor (or a placeholder), the scalar and the flag of each sampling parameter
    named (temperature, top_k, top_p, seed), by the kernels' argument names."""
    flags = {"temperature": "PER_REQ_T", "top_k": "PER_REQ_K", "top_p": "PER_REQ_P", "seed": "PER_REQ_SEED"}
    convert = {"temperature": float, "top_k": int, "top_p": float, "seed": lambda s: s}
    out = {}
    for name in names:
        ptr, value, per_request = plan.params[name]
        out.update({f"{name}_ptr": ptr, name: convert[name](value), flags[name]: per_request})
    return out


def _launch_rho(plan: TreePlan, pos: torch.Tensor, stats: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """K-SEQ's rho for every position with siblings, before the walk and split over the vocabulary:
    RHO_ROUNDS rounds of sums, each followed by one step of every search that ran; the searches'
    records."""
    dev, P, C = plan.args.target.device, plan.P, plan.rho_chunks
    brk = torch.empty((P, RB_REC_HOST), dtype=torch.float32, device=dev)
    sums = torch.empty((P, C, RHO_POINTS), dtype=torch.float32, device=dev)
    at_positions, temperature = _position_args(plan, pos, stats, thr), _sampling_args(plan, "temperature")
    rounds = dict(brk_ptr=brk, sums_ptr=sums, num_chunks=C, RHO_P=RHO_POINTS, num_warps=4)
    for rnd in range(RHO_ROUNDS):
        _tree_rho_kernel[(cdiv(P, plan.rho_block_p), C)](
            **at_positions, **rounds, rnd=rnd, chunk_size=plan.rho_chunk, BLOCK_P=plan.rho_block_p,
            BLOCK_V=plan.rho_block_v,
        )  # fmt: skip
        _tree_rho_step_kernel[(cdiv(P, plan.rho_step_block_p),)](
            **temperature, **rounds, rnd=rnd, pos_ptr=pos, B=plan.args.B, N=plan.args.N,
            BLOCK_P=plan.rho_step_block_p,
        )  # fmt: skip
    return brk


def _launch_rrs(plan: TreePlan, pos: torch.Tensor, stats: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """RRS's residual masses Z_1 .. Z_rrs_rounds of every position, before the walk and split over the
    vocabulary: [RRS_MAX - 1, P, chunks] chunk sums."""
    C = plan.rrs_chunks
    rrs = torch.empty((RRS_MAX_HOST - 1, plan.P, C), dtype=torch.float32, device=plan.args.target.device)
    at_positions = _position_args(plan, pos, stats, thr)
    for rnd in range(1, plan.rrs_rounds + 1):
        _tree_rrs_kernel[(cdiv(plan.P, plan.rrs_block_p), C)](
            **at_positions, sums_ptr=rrs, chunk_size=plan.rrs_chunk, num_chunks=C, rnd=rnd,
            WOR=plan.args.method == "rrs_wor", FIRST_ROUND=rnd == 1, BLOCK_P=plan.rrs_block_p, BLOCK_V=plan.block_v,
            num_warps=4,
        )  # fmt: skip
    return rrs


def _launch_walk(
    plan: TreePlan, out: TreeVerifyOutput, stats: torch.Tensor, idx: torch.Tensor, thr: torch.Tensor,
    brk: torch.Tensor, rrs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The walks; their races' records (race_i, race_f, race_zs, race_ds, race_xs)."""
    dev, B, np2, D = plan.args.target.device, plan.args.B, plan.np2, plan.args.max_depth
    race = (
        torch.empty((B, RACE_I_HOST), dtype=torch.int32, device=dev),
        torch.empty((B, RACE_F_HOST), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.int64, device=dev),
    )
    outputs = dict(
        out_tokens_ptr=out.tokens,
        out_nodes_ptr=out.accepted_nodes,
        out_accepted_ptr=out.num_accepted,
        nonfinite_ptr=out.nonfinite,
        stride_ob=out.tokens.stride(0),
        stride_nb=out.accepted_nodes.stride(0) if D > 0 else 0,
        out_logprobs_ptr=out.logprobs if plan.logprobs else out.tokens,
        stride_lb=out.logprobs.stride(0) if plan.logprobs else 0,
    )
    _tree_walk_kernel[(cdiv(B, plan.walk_block_b),)](
        **_row_args(plan), **_sampling_args(plan, "temperature", "seed"), **_tree_args(plan), **outputs,
        **_race_args(race), stats_ptr=stats, idx_ptr=idx, thr_ptr=thr, brk_ptr=brk, rrs_ptr=rrs,
        rrs_chunks=plan.rrs_chunks if plan.with_positions and plan.rrs_rounds > 0 else 1, METHOD=plan.method,
        BLOCK_B=plan.walk_block_b, DP2=next_pow2(D + 1), BLOCK_V=plan.block_v, LOGPROBS=plan.logprobs,
        LP_BY_INDEX=plan.lp_by_index,
        num_warps=WALK_WARPS_RRS if plan.method else WALK_WARPS_KSEQ,
    )  # fmt: skip
    return race


def _launch_race(plan: TreePlan, race: tuple[torch.Tensor, ...], stats: torch.Tensor, thr: torch.Tensor, out):
    """The recovered / bonus tokens: each chunk's race winners, then their merge into out.tokens (and,
    with logprobs, the raced tokens' logprobs into out.logprobs)."""
    B, C, dev = plan.args.B, plan.race_chunks, plan.args.target.device
    key = torch.empty((B, C, 2), dtype=torch.float32, device=dev)
    idx = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    _tree_race_kernel[(cdiv(B, plan.race_block_b), C)](
        **_row_args(plan), **_parents_args(plan), **_sampling_args(plan, "temperature", "seed"), **_race_args(race),
        stats_ptr=stats,
        thr_ptr=thr, key_ptr=key, idx_ptr=idx, chunk_size=plan.race_chunk, num_chunks=C, METHOD=plan.method,
        NP2=plan.np2, BLOCK_B=plan.race_block_b, BLOCK_V=plan.block_v, num_warps=4,
    )  # fmt: skip
    fin = plan.finalize_block_b
    _tree_finalize_kernel[(cdiv(B, fin),)](
        race_i_ptr=race[0],
        key_ptr=key,
        idx_ptr=idx,
        out_tokens_ptr=out.tokens,
        stride_ob=out.tokens.stride(0),
        B=B,
        V=plan.args.V,
        num_chunks=C,
        BLOCK_B=fin,
        **_finalize_logprobs_args(plan, out, stats, thr),
    )


def _finalize_logprobs_args(plan: TreePlan, out: TreeVerifyOutput, stats: torch.Tensor, thr: torch.Tensor) -> dict:
    """What the race's merge reads to score the raced tokens (LOGPROBS); without logprobs placeholders
    and every switch off, so that the merge compiles as before."""
    a, lp = plan.args, plan.logprobs
    mask = _mask_args(plan) if lp else dict(_mask_args(plan), HAS_MASK=False)
    t_ptr, t_val, per_req_t = plan.params["temperature"]
    return mask | dict(
        target_ptr=a.target,
        stats_ptr=stats,
        thr_ptr=thr,
        temperature_ptr=t_ptr,
        out_logprobs_ptr=out.logprobs if lp else out.tokens,
        stride_tb=a.target.stride(0),
        stride_tk=a.target.stride(1),
        stride_tg=a.target.stride(2),
        stride_lb=out.logprobs.stride(0) if lp else 0,
        K=a.K,
        G=a.G,
        temperature=float(t_val),
        PER_REQ_T=lp and per_req_t,
        HAS_FILTER=lp and plan.has_filter,
        BY_INDEX=plan.lp_by_index,
        LOGPROBS=lp,
    )
