"""Launch configuration of the Triton backend: tile widths, rows per program, warps and the split of
the vocabulary into chunks. The one home of these rules: the chain launcher, the tree launcher, the
row pass and the threshold phases all take their settings from here.

``tile_settings`` is the backend's counterpart of a (block, warps) helper: from the vocabulary and
the number of rows it gives the vocabulary tile (BLOCK_V), the rows per program (BLOCK_R) and the
warps; ``vocab_chunks`` splits a row into chunks of whole tiles; ``chunks_to_fill`` says how many
chunks keep every SM busy; ``num_warps`` is the warp rule on its own (the threshold phases' tiles).
``greedy_logprobs_filter`` and ``ties_by_index_at_unit_t`` pick the row pass's native-logprobs variant.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..._params import MIN_TEMPERATURE, SamplingParams
from .helpers import cdiv, next_pow2

# The interpreter pays per operation, not per element: it gets big tiles (a whole row when it fits).
INTERPRETER_BLOCK_V = 8192
INTERPRETER_TILE = 1 << 16  # entries per program (rows x BLOCK_V)
# On a GPU 2 rows x 1024 entries per program (8 warps): the row pass keeps per-lane running state
# (about 60 registers of it at 8 entries per thread; 4 rows x 4 warps spilled).
GPU_BLOCK_V = 1024
GPU_TILE = 2048
MIN_BLOCK_V = 4  # the races take 4 entries per Philox call
ROW_PASS_ENTRIES_PER_THREAD = 8  # per-lane running state of the row pass and the races
PROGRAMS_PER_SM = 4  # programs of the row pass per SM that a small batch still gets (vocabulary split)


@dataclass(frozen=True)
class TileSettings:
    """The tiles of a launch over rows of the vocabulary."""

    block_v: int  # vocabulary entries per tile (a power of two)
    block_r: int  # rows per program (a power of two)
    num_warps: int
    tile: int  # entries a program may hold (block_r x block_v at most): other tiles of the call fit in it


def num_warps(tile_entries: int, entries_per_thread: int, fewest: int = 4) -> int:
    """`fewest` (4: latency hiding) to 8 warps: enough that a thread holds at most
    `entries_per_thread` entries of a tile of `tile_entries` (powers of two)."""
    return max(fewest, min(8, tile_entries // (32 * entries_per_thread)))


def tile_settings(
    V: int, rows: int, interpreted: bool, block_v: int | None = None, max_block_r: int | None = None
) -> TileSettings:
    """Tiles of a launch over `rows` rows of V entries: BLOCK_V (`block_v` forces it: tests) and up
    to `max_block_r` rows per program within the program's tile; warps for
    ROW_PASS_ENTRIES_PER_THREAD entries per thread."""
    max_block_v, tile = (INTERPRETER_BLOCK_V, INTERPRETER_TILE) if interpreted else (GPU_BLOCK_V, GPU_TILE)
    block_v = max(MIN_BLOCK_V, min(next_pow2(V), block_v or max_block_v))
    block_r = max(1, min(next_pow2(rows), tile // block_v, max_block_r or 1 << 30))
    return TileSettings(block_v, block_r, num_warps(block_r * block_v, ROW_PASS_ENTRIES_PER_THREAD), tile)


def chunks_to_fill(sms: int, programs: int, cap: int) -> int:
    """Vocabulary chunks per row that give `programs` programs (one per row tile) about
    PROGRAMS_PER_SM programs per SM, at most `cap`."""
    return min(cap, max(1, -(-PROGRAMS_PER_SM * sms // programs)))


def vocab_chunks(V: int, block_v: int, num_chunks: int) -> tuple[int, int]:
    """(chunks, chunk_size): about `num_chunks` chunks of whole BLOCK_V tiles covering V entries
    (at least one chunk, at most one per tile; the last chunk may be shorter)."""
    blocks = cdiv(V, block_v)
    num_chunks = max(1, min(int(num_chunks), blocks))
    chunk_size = cdiv(blocks, num_chunks) * block_v
    return cdiv(V, chunk_size), chunk_size


def greedy_logprobs_filter(sampling: SamplingParams, V: int) -> bool:
    """Whether return_logprobs needs the threshold phases on greedy rows: some request may be
    greedy and top-k / top-p may be active (the logprobs score greedy rows at T = 1 with them).
    Cost: those greedy rows go through the threshold phases, one more read of each (their records
    already hold the T = 1 normaliser: the row pass runs greedy rows at T = 1)."""
    t = sampling.temperature
    return sampling.has_filter(V) and (isinstance(t, torch.Tensor) or t < MIN_TEMPERATURE)


def ties_by_index_at_unit_t(sampling: SamplingParams) -> bool:
    """``sampling.ties_by_index()`` with greedy requests counted (their logprobs apply top-p)."""
    p = sampling.top_p
    return sampling.top_p_ties == "by_index" and (isinstance(p, torch.Tensor) or p < 1.0)
