"""The process group of the vocabulary-parallel path: each rank's shard of the vocabulary, the
collectives on it, and the one exchange before any work (shard sizes and argument signatures)."""

from __future__ import annotations

import zlib
from dataclasses import fields, replace

import torch
import torch.distributed as dist

from ..._params import SamplingParams, mix_seed

NEG_INF = float("-inf")
NO_INDEX = float(2**53)  # "no index" in float64 stat records (exact integers below it)

# signature record exchanged first:
# [ok, V_r, kind, B, dim1, dim2, draft mode, seed is int, seed, vocab_size, checksum of the replicated args]


class ShardError(ValueError):
    """Arguments that do not fit together across ranks (raised on every rank)."""


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


_SHARDED_FIELDS = (
    "target_logits",
    "target",
    "draft",
    "token_bitmask",
)  # per-rank shards; everything else is replicated


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
