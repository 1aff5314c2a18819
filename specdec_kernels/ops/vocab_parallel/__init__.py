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
  search (1 + 4 all-reduces of 16 sums) or two all-reduces per tested candidate (RRS);
* ``sk.verify(..., method="block")``: one more all-reduce of the residual masses r_i of every
  position that can stop (one number each, all requests together; ``block``).

Arithmetic follows ``reference/`` elementwise in float64 (same operations, same order), so the only
difference to the unsharded call is the order of float sums across shards: tokens are equal except
at measure-zero ties. Every control-flow decision depends only on replicated inputs or on reduced
values (identical on every rank), so all ranks run the same collectives and return the same tokens.
Those decisions read values on the host: the sharded path synchronises (no CUDA-graph capture).

The package, by job: ``protocol`` (the shards and their collectives, the layout exchange),
``selection`` (top-k / top-p thresholds across shards), ``rows`` (row processing and the race,
shared by both walks), ``chain`` and ``tree`` (the two verifications), ``block`` (block verification
of the chain's sampled requests).
"""

from __future__ import annotations

from .chain import verify_chain_sharded
from .protocol import Shard, ShardError, exchange_layout, replicated_checksum
from .tree import verify_tree_sharded

__all__ = [
    "Shard",
    "ShardError",
    "exchange_layout",
    "replicated_checksum",
    "verify_chain_sharded",
    "verify_tree_sharded",
]
