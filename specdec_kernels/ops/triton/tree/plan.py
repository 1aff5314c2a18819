"""The launch plan of one tree verification call: tiles, grids, vocabulary chunks and the kernels'
shared arguments, computed once from the checked arguments (``_tree_args.check_tree_args``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...._interpreter import multiprocessors, plans_for_interpreter
from ...._params import MIN_TEMPERATURE
from ...._tree_args import TreeArgs
from ...._types import METHODS
from ..helpers import DRAFT_LOGITS, DRAFT_NONE, cdiv, next_pow2
from ..launch import INTERPRETER_TILE, ties_by_index_at_unit_t, tile_settings
from ..row_pass import RowPassPlan
from ..threshold_phases import threshold_plan
from .common import RHO_POINTS, RRS_MAX_HOST

RHO_GPU_BLOCK_V = 512  # the rho rounds hold [RHO_POINTS, BLOCK_V] accumulators
RHO_STEP_GPU_BLOCK_P = 64
MAX_GPU_CHUNKS = 64  # vocabulary chunks of a row at most (row pass, rho and RRS rounds)


def vocab_split(V: int, block_v: int, num_chunks: int | None, gpu_chunks: int | None) -> tuple[int, int]:
    """(chunks, chunk size) of a vocabulary split into chunks of whole BLOCK_V blocks: num_chunks when
    given (tests split small vocabularies), else gpu_chunks (None: one chunk, the interpreter's)."""
    blocks = cdiv(V, block_v)
    want = num_chunks if num_chunks is not None else (gpu_chunks or 1)
    chunks = max(1, min(int(want), blocks))
    chunk_size = cdiv(blocks, chunks) * block_v
    return cdiv(V, chunk_size), chunk_size


@dataclass(frozen=True)
class TreePlan:
    """What every launch of a call reads: sizes, flags, tiles per phase and the kernels' arguments
    (pointers of per-request parameters or placeholders, scalar values, per-request flags)."""

    args: TreeArgs
    rows: int  # row-statistics records: B * K * (G + 1)
    P: int  # positions: B * (N + 1)
    has_filter: bool
    by_index: bool  # top_p_ties="by_index": thresholds carry an index cut
    logprobs: bool  # return_logprobs without top-n: the walk and the race's merge write out.logprobs
    lp_by_index: bool  # (logprobs) the index cuts the scores read: greedy rows apply top-p at T = 1 too
    sampled: bool  # some request samples (temperature > 0)
    kseq: bool  # K-SEQ with draft distributions (the rho search), else RRS / one-hot
    method: int  # METHODS[args.method]
    # tiles and chunks
    block_v: int
    np2: int  # next power of two >= N (>= 2)
    row_pass: RowPassPlan  # the row pass's tiles (block_v, block_r, warps), chunks and threshold phases
    positions_block_b: int
    walk_block_b: int
    rho_block_v: int
    rho_chunks: int
    rho_chunk: int
    rho_block_p: int
    rho_step_block_p: int
    rrs_rounds: int  # Z_1 .. Z_rrs_rounds before the walk (0: none)
    rrs_chunks: int
    rrs_chunk: int
    rrs_block_p: int
    race_block_b: int
    race_chunks: int
    race_chunk: int
    finalize_block_b: int
    # kernel arguments
    draft: torch.Tensor  # the target where there is no draft tensor (unused)
    d_strides: tuple[int, int, int]
    parents: torch.Tensor  # the target for chains (unused)
    stride_pb: int
    n_ptr: torch.Tensor
    per_req_n: bool
    params: dict  # SamplingParams.kernel_args: name -> (pointer, scalar, per-request flag)

    @property
    def with_positions(self) -> bool:
        """The positions kernel runs (sampled calls with draft distributions); otherwise the row pass
        reads every row and the rho / RRS rounds do not run."""
        return self.args.draft_mode != DRAFT_NONE and self.sampled


def plan_tree(
    args: TreeArgs,
    block_v: int | None = None,
    num_chunks: int | None = None,
    threshold_chunks: int | None = None,
    threshold_capacity: int | None = None,
    logprobs: bool = False,
) -> TreePlan:
    """The plan of a call with B > 0. num_chunks / block_v override the launch plan (tests use them to
    split small vocabularies: the row pass, the rho / RRS rounds and the race all take them);
    threshold_chunks / threshold_capacity make the interpreter run the GPU's two-launch top-k/top-p
    thresholds (``threshold_phases.threshold_plan``); logprobs: return_logprobs without top-n."""
    B, K, G, V, N = args.B, args.K, args.G, args.V, args.N
    target = args.target
    dev = target.device
    interpreted = plans_for_interpreter(dev)
    rows = B * K * (G + 1)
    tiles = tile_settings(V, rows, interpreted, block_v)  # the row pass's tiles (launch.py)
    block_v, tile = tiles.block_v, tiles.tile
    np2 = max(2, next_pow2(N))
    has_filter = args.has_filter
    P = B * (N + 1)
    sms = 0 if interpreted else multiprocessors(dev)
    # Row pass: split rows so that a small batch still fills the GPU (~4 programs per SM). Filtered
    # rows are split too: their thresholds come from the threshold phases.
    row_gpu = min(MAX_GPU_CHUNKS, max(1, cdiv(4 * sms, cdiv(rows, tiles.block_r)))) if sms else None
    row_chunks, row_chunk = vocab_split(V, block_v, num_chunks, row_gpu)
    # the rho and RRS rounds: a few positions per request have siblings, fill the GPU with chunks
    per_request = min(MAX_GPU_CHUNKS, cdiv(4 * sms, B)) if sms else None
    rho_block_v = block_v if interpreted else RHO_GPU_BLOCK_V
    rho_chunks, rho_chunk = vocab_split(V, rho_block_v, num_chunks, per_request)
    rrs_chunks, rrs_chunk = vocab_split(V, block_v, num_chunks, per_request)
    race_chunks, race_chunk = vocab_split(V, block_v, num_chunks, cdiv(2 * sms, B) if sms else None)  # ~2 per SM
    kseq = METHODS[args.method] == 0 and args.draft_mode != DRAFT_NONE
    params = args.sampling.kernel_args(target)
    t_val, per_req_t = params["temperature"][1:]
    # The walk holds [BLOCK_B, NP2, NP2] tiles (and [BLOCK_B, NP2, BLOCK_V] ones in its rare RRS passes).
    walk_block_b = max(1, min(next_pow2(B), tile // max(block_v * RHO_POINTS, np2 * np2, 1))) if interpreted else 1
    rrs_rounds = 0 if kseq else min((K if args.parents is None else N) - 1, RRS_MAX_HOST - 1)
    tplan = threshold_plan(target, rows, V, threshold_chunks, args.draft_mode == DRAFT_LOGITS, threshold_capacity)
    return TreePlan(
        args=args,
        rows=rows,
        P=P,
        has_filter=has_filter,
        by_index=has_filter and args.sampling.ties_by_index(),
        logprobs=logprobs,
        lp_by_index=logprobs and has_filter and ties_by_index_at_unit_t(args.sampling),
        sampled=per_req_t or float(t_val) >= MIN_TEMPERATURE,
        kseq=kseq,
        method=METHODS[args.method],
        block_v=block_v,
        np2=np2,
        row_pass=RowPassPlan(tiles, row_chunks, row_chunk, tplan),
        positions_block_b=max(1, min(next_pow2(B), INTERPRETER_TILE // (np2 * np2))) if interpreted else 1,
        walk_block_b=walk_block_b,
        rho_block_v=rho_block_v,
        rho_chunks=rho_chunks,
        rho_chunk=rho_chunk,
        rho_block_p=max(1, min(next_pow2(P), INTERPRETER_TILE // (rho_block_v * RHO_POINTS))) if interpreted else 1,
        rho_step_block_p=min(next_pow2(P), INTERPRETER_TILE // RHO_POINTS) if interpreted else RHO_STEP_GPU_BLOCK_P,
        rrs_rounds=max(rrs_rounds, 0),
        rrs_chunks=rrs_chunks,
        rrs_chunk=rrs_chunk,
        rrs_block_p=max(1, min(next_pow2(P), INTERPRETER_TILE // block_v)) if interpreted else 1,
        race_block_b=walk_block_b if interpreted else 1,
        race_chunks=race_chunks,
        race_chunk=race_chunk,
        finalize_block_b=min(next_pow2(B), 128),
        draft=args.draft if args.draft is not None else target,
        d_strides=(args.draft.stride(0), args.draft.stride(1), args.draft.stride(2))
        if args.draft is not None
        else (0, 0, 0),
        parents=args.parents if args.parents is not None else target,
        stride_pb=args.parents.stride(0) if args.parents is not None else 0,
        n_ptr=args.num_nodes if args.num_nodes is not None else target,
        per_req_n=args.num_nodes is not None,
        params=params,
    )
