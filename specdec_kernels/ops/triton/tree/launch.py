"""The launches of tree verification (the phases of the package docstring), one small function per
phase, all reading one ``TreePlan``."""

from __future__ import annotations

import torch

from ...._tree_args import TreeArgs
from ...._types import TreeVerifyOutput
from ..helpers import cdiv, next_pow2
from ..row_pass import RowPassLayout, RowPassPlan, launch_row_stats
from .common import POS_REC_HOST, RACE_F_HOST, RACE_I_HOST, RB_REC_HOST, RHO_POINTS, RHO_ROUNDS, RRS_MAX_HOST
from .plan import TreePlan, plan_tree
from .positions import _tree_positions_kernel
from .race import _tree_finalize_kernel, _tree_race_kernel
from .rho import _tree_rho_kernel, _tree_rho_step_kernel
from .rrs import _tree_rrs_kernel
from .walk import _tree_walk_kernel


def launch_tree(
    args: TreeArgs,
    block_v: int | None = None,
    num_chunks: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
) -> TreeVerifyOutput:
    """Run the launches of the package docstring on checked arguments (``_tree_args.check_tree_args``).

    num_chunks / block_v override the launch plan (tests use them to split small vocabularies: the row
    pass, the rho / RRS rounds and the race all take them); threshold_chunks / threshold_capacity make
    the interpreter run the GPU's two-launch top-k/top-p thresholds (``row_pass.threshold_plan``)."""
    B, D = args.B, args.max_depth
    dev = args.target.device
    tokens = torch.empty((B, D + 1), dtype=torch.int64, device=dev)
    nodes = torch.empty((B, D), dtype=torch.int64, device=dev)
    num_accepted = torch.empty((B,), dtype=torch.int32, device=dev)
    nonfinite = torch.empty((B,), dtype=torch.bool, device=dev)
    out = TreeVerifyOutput(tokens, num_accepted, nodes, nonfinite)
    if B == 0:
        return out
    plan = plan_tree(args, block_v, num_chunks, threshold_chunks, threshold_capacity)
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
        _launch_race(plan, race, stats, thr, tokens)
    return out


def _launch_positions(plan: TreePlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions a walk can reach and their candidates, from the tree alone; (positions, the
    row pass's record use)."""
    a, dev = plan.args, plan.args.target.device
    pos = torch.empty((a.B, a.N + 1, POS_REC_HOST), dtype=torch.int32, device=dev)
    use = torch.zeros((plan.rows, 2), dtype=torch.int8, device=dev)
    _tree_positions_kernel[(cdiv(a.B, plan.positions_block_b),)](
        tokens_ptr=a.tokens,
        parents_ptr=plan.parents,
        num_nodes_ptr=plan.n_ptr,
        pos_ptr=pos,
        use_ptr=use,
        stride_xb=a.tokens.stride(0),
        stride_xk=a.tokens.stride(1),
        stride_pb=plan.stride_pb,
        B=a.B,
        K=a.K,
        G=a.G,
        V=a.V,
        N=a.N,
        D=a.max_depth,
        PER_REQ_N=plan.per_req_n,
        CHAINS=a.parents is None,
        NP2=plan.np2,
        BLOCK_B=plan.positions_block_b,
    )
    return pos, use


def _launch_row_pass(plan: TreePlan, use: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Row statistics of every used row (thresholds first where filtered), merged to one record per
    row for the walk: (stats, idx, thr) - the row pass chain verification runs (``launch_row_stats``).
    Rows past a ragged tree's last node are skipped: the pass's count of a request is its node count
    (row i of a single chain belongs to node i - 1); chains of verify_multi are never ragged;
    placeholder drafts are the walk's, not the row pass's."""
    a = plan.args
    layout = RowPassLayout(
        a.target, a.draft, a.draft_mode, a.B, a.K, a.G, a.V, tuple(a.target.stride()[:3]), plan.d_strides,
        counts=a.num_nodes, use=use,
    )  # fmt: skip
    rows = launch_row_stats(
        layout, a.sampling, RowPassPlan(plan.row_tiles, plan.row_chunks, plan.row_chunk, plan.tplan)
    )
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
    )


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
    rows, temperature = _row_args(plan), _sampling_args(plan, "temperature")
    for rnd in range(RHO_ROUNDS):
        _tree_rho_kernel[(cdiv(P, plan.rho_block_p), C)](
            **rows,
            **temperature,
            pos_ptr=pos,
            stats_ptr=stats,
            thr_ptr=thr,
            brk_ptr=brk,
            sums_ptr=sums,
            N=plan.args.N,
            chunk_size=plan.rho_chunk,
            num_chunks=C,
            rnd=rnd,
            RHO_P=RHO_POINTS,
            BLOCK_P=plan.rho_block_p,
            BLOCK_V=plan.rho_block_v,
            num_warps=4,
        )
        _tree_rho_step_kernel[(cdiv(P, plan.rho_step_block_p),)](
            **temperature,
            pos_ptr=pos,
            brk_ptr=brk,
            sums_ptr=sums,
            B=plan.args.B,
            N=plan.args.N,
            num_chunks=C,
            rnd=rnd,
            RHO_P=RHO_POINTS,
            BLOCK_P=plan.rho_step_block_p,
            num_warps=4,
        )
    return brk


def _launch_rrs(plan: TreePlan, pos: torch.Tensor, stats: torch.Tensor, thr: torch.Tensor) -> torch.Tensor:
    """RRS's residual masses Z_1 .. Z_rrs_rounds of every position, before the walk and split over the
    vocabulary: [RRS_MAX - 1, P, chunks] chunk sums."""
    C = plan.rrs_chunks
    rrs = torch.empty((RRS_MAX_HOST - 1, plan.P, C), dtype=torch.float32, device=plan.args.target.device)
    rows, temperature = _row_args(plan), _sampling_args(plan, "temperature")
    for rnd in range(1, plan.rrs_rounds + 1):
        _tree_rrs_kernel[(cdiv(plan.P, plan.rrs_block_p), C)](
            **rows,
            **temperature,
            pos_ptr=pos,
            stats_ptr=stats,
            thr_ptr=thr,
            sums_ptr=rrs,
            N=plan.args.N,
            chunk_size=plan.rrs_chunk,
            num_chunks=C,
            rnd=rnd,
            WOR=plan.args.method == "rrs_wor",
            BLOCK_P=plan.rrs_block_p,
            BLOCK_V=plan.block_v,
            num_warps=4,
        )
    return rrs


def _launch_walk(
    plan: TreePlan, out: TreeVerifyOutput, stats: torch.Tensor, idx: torch.Tensor, thr: torch.Tensor,
    brk: torch.Tensor, rrs: torch.Tensor,
) -> tuple[torch.Tensor, ...]:  # fmt: skip
    """The walks; their races' records (race_i, race_f, race_zs, race_ds, race_xs)."""
    a, dev, B, np2, D = plan.args, plan.args.target.device, plan.args.B, plan.np2, plan.args.max_depth
    race = (
        torch.empty((B, RACE_I_HOST), dtype=torch.int32, device=dev),
        torch.empty((B, RACE_F_HOST), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.float32, device=dev),
        torch.empty((B, np2), dtype=torch.int64, device=dev),
    )
    _tree_walk_kernel[(cdiv(B, plan.walk_block_b),)](
        **_row_args(plan),
        **_sampling_args(plan, "temperature", "seed"),
        tokens_ptr=a.tokens,
        parents_ptr=plan.parents,
        num_nodes_ptr=plan.n_ptr,
        stats_ptr=stats,
        idx_ptr=idx,
        thr_ptr=thr,
        out_tokens_ptr=out.tokens,
        out_nodes_ptr=out.accepted_nodes,
        out_accepted_ptr=out.num_accepted,
        nonfinite_ptr=out.nonfinite,
        brk_ptr=brk,
        race_i_ptr=race[0],
        race_f_ptr=race[1],
        race_zs_ptr=race[2],
        race_ds_ptr=race[3],
        race_xs_ptr=race[4],
        rrs_ptr=rrs,
        stride_xb=a.tokens.stride(0),
        stride_xk=a.tokens.stride(1),
        stride_pb=plan.stride_pb,
        stride_ob=out.tokens.stride(0),
        stride_nb=out.accepted_nodes.stride(0) if D > 0 else 0,
        N=a.N,
        D=D,
        rrs_chunks=plan.rrs_chunks if plan.with_positions and plan.rrs_rounds > 0 else 1,
        PER_REQ_N=plan.per_req_n,
        CHAINS=a.parents is None,
        METHOD=plan.method,
        BLOCK_B=plan.walk_block_b,
        NP2=np2,
        DP2=next_pow2(D + 1),
        BLOCK_V=plan.block_v,
        num_warps=4,
    )
    return race


def _launch_race(plan: TreePlan, race: tuple[torch.Tensor, ...], stats: torch.Tensor, thr: torch.Tensor, tokens):
    """The recovered / bonus tokens: each chunk's race winners, then their merge into `tokens`."""
    B, C, dev = plan.args.B, plan.race_chunks, plan.args.target.device
    race_i, race_f, race_zs, race_ds, race_xs = race
    key = torch.empty((B, C, 2), dtype=torch.float32, device=dev)
    idx = torch.empty((B, C, 2), dtype=torch.int32, device=dev)
    _tree_race_kernel[(cdiv(B, plan.race_block_b), C)](
        **_row_args(plan),
        **_sampling_args(plan, "temperature", "seed"),
        stats_ptr=stats,
        thr_ptr=thr,
        race_i_ptr=race_i,
        race_f_ptr=race_f,
        race_zs_ptr=race_zs,
        race_ds_ptr=race_ds,
        race_xs_ptr=race_xs,
        key_ptr=key,
        idx_ptr=idx,
        chunk_size=plan.race_chunk,
        num_chunks=C,
        METHOD=plan.method,
        NP2=plan.np2,
        BLOCK_B=plan.race_block_b,
        BLOCK_V=plan.block_v,
        num_warps=4,
    )
    fin = plan.finalize_block_b
    _tree_finalize_kernel[(cdiv(B, fin),)](
        race_i_ptr=race_i,
        key_ptr=key,
        idx_ptr=idx,
        out_tokens_ptr=tokens,
        stride_ob=tokens.stride(0),
        B=B,
        V=plan.args.V,
        num_chunks=C,
        BLOCK_B=fin,
    )
