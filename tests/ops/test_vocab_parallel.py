"""Vocabulary-parallel verification (``process_group=``): 2, 3 and 4 gloo processes on CPU.

Each rank passes its contiguous vocabulary shard (uneven: V = 1000 over 3 ranks is 300 / 450 /
250); every rank must return exactly the tokens, num_accepted and nonfinite flags of the
unsharded call with the same seed, for backend="torch" (the reference) and backend="cpu" (csrc).
One process group per world size runs every case (starting processes is the slow part: they
fork from a server that has imported the package once); the parent computes the unsharded calls
and compares.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import specdec_kernels as sk
from specdec_kernels.ops import csrc
from specdec_kernels.reference.philox import philox4x32, philox4x32_torch, uniform_open, uniform_open_torch

from ._inputs import pack_bitmask

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

VOCAB = V = 1000
SHARDS = {2: [400, 600], 3: [300, 450, 250], 4: [250, 100, 400, 250]}
CHAIN_PARAMS = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=0.8),
    "top_k": dict(temperature=0.9, top_k=20),
    "top_p": dict(temperature=0.7, top_p=0.8),
    "per_request": "per_request",  # tensors: mixed greedy / filters, per-request seeds
    "big_top_k": dict(temperature=0.9, top_k=300, top_p=0.95),  # k > 256: radix select, not a gather
}
MODES = ("logits", "probs", "ngram")


# --------------------------------------------------------------------------------------------
# the cases (pure functions of their spec: parent and workers build the same tensors)


def _params(spec: dict, B: int) -> dict:
    p = spec["params"]
    if p == "per_request":
        cycle = torch.arange(B) % 4
        return dict(
            temperature=torch.tensor([0.0, 0.9, 1.3, 0.6])[cycle],
            top_k=torch.tensor([0, 5, 0, 40])[cycle],
            top_p=torch.tensor([1.0, 0.9, 0.5, 1.0])[cycle],
            seed=torch.tensor([11, -3, 2**40 + 5, 7], dtype=torch.int64)[cycle] + torch.arange(B),
        )
    return dict(p if isinstance(p, dict) else CHAIN_PARAMS[p], seed=spec["seed"] * 101 + 1)


def _inputs(spec: dict):
    """Full (unsharded) inputs of a case: target, drafts, draft logits, kwargs."""
    g = torch.Generator().manual_seed(spec["seed"])
    B, G, V = spec["B"], spec["G"], spec.get("V", VOCAB)
    lead = (B, spec["K"]) if spec["op"] == "multi" else (B,)
    target = torch.randn(*lead, G + 1, V, generator=g) * 2
    if spec.get("ties") == "coarse":  # 5 values: more ties at the top-k pivot than a rank sends
        target = (target * 0.3).round()
    elif spec.get("ties"):  # few distinct values: ties at the argmax and the top-k / top-p pivots
        target = target.round()
    draft = target[..., :G, :] + torch.randn(*lead, G, V, generator=g) * spec.get("noise", 0.7)
    if spec.get("paper"):  # the two-token example: every row p = (1/3, 2/3), q = (2/3, 1/3)
        target[...] = torch.tensor([1.0, 2.0]).log()
        draft[...] = torch.tensor([2.0, 1.0]).log()
    # drafts sampled from the draft (accepted often enough that every path runs)
    probs = torch.softmax(draft.reshape(-1, V), -1)
    tokens = torch.multinomial(probs, 1, generator=g).reshape(*lead, G) if probs.numel() else draft[..., 0].long()
    if spec["op"] == "multi" and spec["K"] > 1:
        tokens[0, 1, 0] = tokens[0, 0, 0]  # chains sharing a prefix: candidates with multiplicity
        if spec["method"] == "rrs_wor":  # without replacement: distinct first tokens
            first, second = tokens[:, 0, 0], tokens[:, 1, 0]
            tokens[:, 1, 0] = torch.where(second == first, (first + 7) % V, second)
    if spec.get("dtype"):  # half-precision logits (the kernels read them as fp32)
        target, draft = target.to(spec["dtype"]), draft.to(spec["dtype"])
    kw = _params(spec, B)
    if spec.get("nan"):  # NaN logits inside rank 1's shard, request 1 only
        off = _sizes(spec)[0]
        target[1, ..., off + 3] = float("nan")
        if spec["mode"] == "logits":
            draft[1, ..., off + 5] = float("nan")
    for b, row in spec.get("nan_at", ()):  # NaN in one row of one request (rank 1's shard)
        target[b, row, _sizes(spec)[0] + 3] = float("nan")
    if spec["mode"] == "logits":
        kw["draft_logits"] = draft
    elif spec["mode"] == "probs":
        kw["draft_probs"] = torch.softmax(draft, -1)
    if spec["op"] == "chain":
        n = spec.get("n", [G, 1, 0, G - 1])
        kw["num_draft_tokens"] = torch.tensor(n)[torch.arange(B) % len(n)]
        if spec.get("block"):
            kw["method"] = "block"
        if spec.get("placeholder"):
            tokens[0, 1] = -1
            kw["validate"] = False
    else:
        kw["method"] = spec["method"]
        if spec.get("placeholder"):  # a chain whose second draft is padding: it ends there
            tokens[0, -1, 1] = -1
            kw["validate"] = False
    if spec.get("int32"):
        kw["out_dtype"] = torch.int32
    if spec.get("logprobs") is not None:  # return_logprobs with this many top logprobs
        kw.update(return_logprobs=True, num_logprobs=spec["logprobs"])
    if spec.get("mask"):  # grammar masks: each rank packs the words of its own slice (_call)
        kw["allowed"] = _allowed(spec, target.shape, tokens)
    return target, tokens, kw


def _allowed(spec: dict, shape, tokens) -> torch.Tensor:
    """bool allow-mask of the target rows: random, the drafts allowed at their rows (so accept
    paths run), request 1's first row allowing nothing (flagged on every rank)."""
    allowed = torch.rand(shape, generator=torch.Generator().manual_seed(spec["seed"] + 7)) < 0.5
    if spec["op"] != "tree":
        G = tokens.shape[-1]
        allowed[..., :G, :].scatter_(-1, tokens[..., None].clamp(0, shape[-1] - 1), True)
    allowed[1, ..., 0, :] = False
    return allowed


def _sizes(spec: dict) -> list[int]:
    return spec.get("sizes") or SHARDS[spec["world"]]


def _slice(spec: dict, rank: int) -> slice:
    sizes = _sizes(spec)
    return slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))


def _shard(t: torch.Tensor | None, sl: slice):
    return None if t is None else t[..., sl]


def _call(spec: dict, sl: slice | None = None, **extra):
    """The op on the full inputs (sl None) or on the vocabulary slice sl."""
    target, tokens, kw = _inputs(spec)
    if spec.get("flat"):  # the engines' flattened ragged layout (cu_num_draft_tokens)
        target, tokens, kw = _flatten(target, tokens, kw)
    if spec.get("target_probs"):  # probabilities of the full vocabulary, sharded like the logits
        kw["target_probs"] = torch.softmax(target, -1)
        target = kw["target_probs"][..., :0]  # placeholder, replaced below
    if sl is not None:
        target = target[..., sl]
        if "target_probs" in kw:
            kw["target_probs"] = kw["target_probs"][..., sl]
        for name in ("draft_logits", "draft_probs"):
            if name in kw:
                kw[name] = _shard(kw[name], sl)
    if "allowed" in kw:  # this rank's words: bit j of word w = token lo + 32 w + j of its slice [lo, hi)
        allowed = kw.pop("allowed")
        kw["token_bitmask"] = pack_bitmask(allowed if sl is None else allowed[..., sl])
    kw.update(spec.get("extra", {}) if sl is not None else {}, **extra)  # extra: sharded-call options
    if spec["op"] == "chain":
        return sk.verify(None if "target_probs" in kw else target, tokens, **kw)
    if spec["op"] == "tree":
        parents = torch.tensor([[-1, -1, 0, 0, 2, 1], [-1, 0, 1, -1, 3, 3]])[: tokens.shape[0]]
        if "num_nodes" in spec:
            kw["num_nodes"] = torch.tensor(spec["num_nodes"])
        return sk.verify_tree(target, tokens, parents, **kw)
    return sk.verify_multi(target, tokens, **kw)


def _flatten(target, tokens, kw):
    """The padded chain inputs in the flattened layout: request b's n_b draft rows, then its bonus row."""
    n = kw.pop("num_draft_tokens").tolist()
    B = len(n)
    flat_target = torch.cat([target[b, : n[b] + 1] for b in range(B)])
    flat_tokens = torch.cat([tokens[b, : n[b]] for b in range(B)])
    for name in ("draft_logits", "draft_probs"):
        if name in kw:
            kw[name] = torch.cat([kw[name][b, : n[b]] for b in range(B)])
    if "allowed" in kw:
        kw["allowed"] = torch.cat([kw["allowed"][b, : n[b] + 1] for b in range(B)])
    kw["cu_num_draft_tokens"] = torch.tensor([0, *n]).cumsum(0)
    return flat_target, flat_tokens, kw


def _chain(world, seed, mode, params, **more):
    return dict(dict(op="chain", world=world, seed=seed, B=4, G=4, K=1, mode=mode, params=params), **more)


def _multi(world, seed, mode, params, method, **more):
    spec = dict(op="multi", world=world, seed=seed, B=3, G=3, K=2, mode=mode, params=params, method=method)
    return dict(spec, **more)


def suite(world: int) -> dict[str, dict]:
    """name -> case spec, per world size (each world size runs in one process group)."""
    cases = {}
    if world == 2:  # the chain sweep: every mode x every parameter kind (ragged drafts in all)
        for i, (mode, params) in enumerate((m, p) for m in MODES for p in CHAIN_PARAMS):
            cases[f"chain-{mode}-{params}"] = _chain(world, i, mode, params)
        cases["chain-placeholder"] = _chain(world, 40, "logits", "sampled", placeholder=True)
        cases["chain-placeholder-greedy"] = _chain(world, 41, "ngram", "greedy", placeholder=True)
        cases["chain-ties-topk-topp"] = _chain(world, 42, "probs", "per_request", ties=True)
        cases["chain-ties-greedy"] = _chain(world, 43, "logits", "greedy", ties=True)
        cases["chain-int32-vocab_size"] = _chain(world, 44, "logits", "top_p", int32=True, extra={"vocab_size": V})
        cases["multi-kseq-logits"] = _multi(world, 45, "logits", "sampled", "kseq")
        cases["chain-flat-layout"] = _chain(world, 46, "probs", "per_request", flat=True)
        cases["chain-target_probs"] = _chain(world, 47, "ngram", "top_k", target_probs=True)
        cases["chain-logprobs"] = _chain(world, 48, "logits", "per_request", logprobs=5)
        cases["chain-logprobs-flat-big_top_k"] = _chain(world, 49, "probs", "big_top_k", flat=True, logprobs=0)
        cases["chain-mask"] = _chain(world, 94, "logits", "per_request", mask=True)  # shard cut at 400
        cases["chain-mask-flat"] = _chain(world, 95, "probs", "top_p", mask=True, flat=True)
    if world == 3:  # verify_multi K=2: every method x mode, filters, greedy; verify_tree; NaN
        for i, (method, mode) in enumerate((m, d) for m in ("kseq", "rrs", "rrs_wor") for d in MODES):
            cases[f"multi-{method}-{mode}"] = _multi(world, 50 + i, mode, "sampled", method)
            cases[f"multi-{method}-{mode}-filters"] = _multi(world, 60 + i, mode, "per_request", method)
        cases["multi-greedy"] = _multi(world, 70, "logits", "greedy", "kseq")
        cases["multi-placeholder"] = _multi(world, 76, "probs", "sampled", "rrs", placeholder=True)
        cases["multi-placeholder-ngram"] = _multi(world, 77, "ngram", "top_p", "kseq", placeholder=True)
        cases["multi-ties"] = _multi(world, 71, "probs", "top_k", "kseq", ties=True)
        tree = dict(op="tree", world=world, seed=72, B=2, G=6, K=1, mode="logits", params="top_p", method="rrs")
        cases["tree-rrs"] = tree
        cases["chain-nan"] = _chain(world, 73, "logits", "sampled", nan=True)
        cases["chain-nan-greedy"] = _chain(world, 74, "ngram", "greedy", nan=True)
        cases["multi-nan"] = _multi(world, 75, "logits", "top_k", "kseq", nan=True)
        cases["multi-logprobs"] = _multi(world, 78, "logits", "per_request", "rrs", logprobs=3)
        cases["tree-logprobs-ties"] = dict(tree, seed=79, ties=True, logprobs=4)
        cases["chain-nan-logprobs"] = _chain(world, 93, "logits", "top_p", nan=True, logprobs=2)
        cases["multi-mask"] = _multi(world, 96, "logits", "top_p", "kseq", mask=True)
        cases["tree-mask"] = dict(tree, seed=97, mask=True)
    if world == 4:  # a few of everything with a 100-entry shard
        cases["chain-logits-top_k"] = _chain(world, 80, "logits", "top_k")
        cases["chain-probs-per_request"] = _chain(world, 81, "probs", "per_request")
        cases["chain-ngram-greedy"] = _chain(world, 82, "ngram", "greedy")
        cases["multi-rrs-probs"] = _multi(world, 83, "probs", "top_p", "rrs")
        cases["multi-kseq-ngram"] = _multi(world, 84, "ngram", "per_request", "kseq")
        cases["chain-int32"] = _chain(world, 85, "ngram", "top_p", int32=True)
        ragged = dict(op="tree", world=world, seed=92, B=2, G=6, K=1, mode="probs", params="per_request")
        cases["tree-kseq-ragged"] = dict(ragged, method="kseq", num_nodes=[4, 6])
        cases["chain-ties-big_top_k"] = _chain(world, 86, "logits", "big_top_k", ties=True)
        coarse = dict(temperature=0.3, top_k=30, top_p=0.5)  # the top-p mass needs every tie at the pivot
        cases["chain-bf16"] = _chain(world, 89, "logits", "per_request", dtype=torch.bfloat16)
        cases["multi-fp16"] = _multi(world, 91, "probs", "top_p", "kseq", dtype=torch.float16)
        cases["chain-coarse-ties"] = _chain(world, 88, "ngram", coarse, ties="coarse")
        cases["multi-ties-per_request"] = _multi(world, 87, "logits", "per_request", "rrs", ties=True)
        cases["chain-mask-greedy"] = _chain(world, 93, "ngram", "greedy", mask=True)
    return cases


def slow_suite(world: int) -> dict[str, dict]:
    """Random cases at V = 32000 over uneven shards: every op, mode, method and parameter kind."""
    g = torch.Generator().manual_seed(world)
    V_big = 32000
    cuts = sorted(torch.randperm(V_big - 1, generator=g)[: world - 1].add(1).tolist())
    sizes = [b - a for a, b in zip([0, *cuts], [*cuts, V_big], strict=True)]
    params = [*CHAIN_PARAMS, dict(temperature=1.1, top_k=1000, top_p=0.7), dict(temperature=0.5, top_p=0.99)]
    cases = {}
    for i in range(24):
        mode, p = MODES[i % 3], params[i % len(params)]
        more = dict(V=V_big, sizes=sizes, B=6, G=5)
        cases[f"chain-{i}"] = _chain(world, 1000 + i, mode, p, **more)
        method = ("kseq", "rrs", "rrs_wor")[(i // 3) % 3]
        cases[f"multi-{i}"] = _multi(world, 2000 + i, mode, p, method, **dict(more, B=4, G=3, K=3))
    return cases


BLOCK_V, BLOCK_SHARDS = 203, {2: [77, 126], 3: [70, 45, 88]}  # odd V, cuts off multiples of 32
# (mode, params) -> seed of the 2-rank sweep; per_request mixes greedy and sampled requests. The
# seeds (here and below) are ones where block verification's output differs from the token rule's
# (test_block_cases_tell_the_rules_apart), so that a sharded path ignoring method= fails.
BLOCK_SWEEP = {
    ("logits", "sampled"): 300, ("logits", "top_k"): 301, ("logits", "top_p"): 302, ("logits", "per_request"): 303,
    ("probs", "sampled"): 304, ("probs", "top_k"): 309, ("probs", "top_p"): 303, ("probs", "per_request"): 306,
    ("ngram", "sampled"): 307, ("ngram", "top_k"): 335, ("ngram", "top_p"): 302, ("ngram", "per_request"): 310,
}  # fmt: skip
# NaN at sampled request 3's bonus row (block reads it even where tau < n; the token rule only if
# all 3 drafts are accepted), at sampled request 1's row 3 (beyond its n = 1: neither rule reads it), in sampled
# request 2's only row, and at greedy request 0's row 2 (the argmax chain under both rules)
NAN_AT = [(3, 3), (1, 3), (2, 0), (0, 2)]
PAPER = dict(V=2, sizes=[1, 1], B=3000, G=2, n=[2], params=dict(temperature=1.0), paper=True)  # PAPER: _inputs


def block_suite(world: int) -> dict[str, dict]:
    """method="block" chains (ragged drafts [G, 1, 0, G - 1] unless said) at V = 203 over uneven shards."""
    more = dict(block=True, V=BLOCK_V, sizes=BLOCK_SHARDS[world], B=8, noise=0.4)  # drafts close: long prefixes
    cases = {}
    if world == 2:
        for (mode, params), seed in BLOCK_SWEEP.items():
            cases[f"block-{mode}-{params}"] = _chain(world, seed, mode, params, **more)
        cases["block-flat"] = _chain(world, 301, "probs", "per_request", flat=True, **more)
        cases["block-flat-mask-logprobs"] = _chain(
            world, 310, "logits", "top_p", flat=True, mask=True, logprobs=2, **more
        )
        cases["block-placeholder"] = _chain(world, 308, "ngram", "sampled", placeholder=True, **more)
        cases["block-big_top_k"] = _chain(world, 301, "logits", "big_top_k", block=True, noise=0.4)  # radix select
        cases["block-G0"] = _chain(world, 323, "logits", "per_request", G=0, n=[0], **more)
        cases["block-B0"] = _chain(world, 324, "probs", "sampled", **dict(more, B=0))
        # the paper's known answer (the residual mass of x_1 = b is all on rank 1: r needs the all-reduce)
        cases["token-paper"] = dict(_chain(world, 326, "logits", "sampled"), **PAPER)
        cases["block-paper"] = dict(cases["token-paper"], block=True)
    if world == 3:
        for mode, params, seed in (("logits", "top_p", 302), ("probs", "per_request", 306), ("ngram", "top_k", 353)):
            cases[f"block-{mode}-{params}"] = _chain(world, seed, mode, params, G=5, **more)
        nan_rows = _chain(world, 342, "logits", "per_request", nan_at=NAN_AT, V=BLOCK_V, sizes=more["sizes"])
        cases["block-nan-rows"], cases["token-nan-rows"] = dict(nan_rows, block=True), nan_rows
        cases["block-logprobs-mask"] = _chain(world, 332, "probs", "top_k", mask=True, logprobs=0, **more)
    return cases


# errors every rank must raise: name -> (spec, extra kwargs, per-rank override, exception, message part)
def error_cases(world: int) -> dict:
    base = _chain(world, 90, "logits", "sampled")
    return {
        "vocab_size": (base, {"vocab_size": V + 1}, None, "ShardError", "do not add up"),
        "draft_id_range": (dict(base, extra={}), {}, "bad_id", "ValueError", "draft_tokens must be in [0, V=1000)"),
        "backend": (base, {"backend": "triton"}, None, "ValueError", "backend must be one of"),
        "block_backend": (base, {"backend": "cpu", "method": "block"}, None, "ValueError", "backend must be one of"),
        "rank_method": (base, {}, "rank_method", "ShardError", "ranks disagree on the operation"),
        "rank_shape": (base, {}, "bad_shape", "ShardError", "failed their argument checks"),
        "not_replicated": (base, {}, "rank_tokens", "ShardError", "ranks pass different draft tokens"),
        "seed_none": (dict(base, extra={}), {"seed": None}, None, None, None),
        "seed_huge": (dict(base, extra={}), {"seed": 2**70 + 5}, None, None, None),
    }


SUITES = {"fast": suite, "slow": slow_suite, "block": block_suite}


# --------------------------------------------------------------------------------------------
# the worker (one process per rank)


def _summary(out) -> dict:
    d = {"tokens": out.tokens, "num_accepted": out.num_accepted, "nonfinite": out.nonfinite}
    if hasattr(out, "accepted_nodes"):
        d["accepted_nodes"] = out.accepted_nodes
    for name in ("logprobs", "top_logprob_ids", "top_logprobs"):  # float sums in another order: 1e-5
        if getattr(out, name) is not None:
            d[name] = getattr(out, name)
    return d


def _worker(rank: int, world: int, init_file: str, out_dir: str, suite_name: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    results: dict = {}
    try:
        for name, spec in SUITES[suite_name](world).items():
            results[name] = _summary(_call(spec, _slice(spec, rank), backend="torch", process_group=dist.group.WORLD))
        for name, (spec, extra, override, _, _) in (error_cases(world) if suite_name == "fast" else {}).items():
            sl = _slice(spec, rank)
            target, tokens, kw = _inputs(spec)
            kw = {k: (_shard(v, sl) if k.startswith("draft_") else v) for k, v in kw.items()}
            target = target[..., sl]
            if override == "bad_id":
                tokens = tokens.clone()
                tokens[0, 0] = V + 3  # within no shard: a global id out of range
            if override == "rank_tokens" and rank == 0:
                tokens = tokens.clone()
                tokens[1, 0] = (tokens[1, 0] + 1) % V
            if override == "rank_method" and rank == 0:
                kw["method"] = "block"  # block on one rank, token on the others: different collectives
            if override == "bad_shape" and rank == world - 1:
                target = target[:, :-1]  # one rank's shapes are wrong: every rank must raise
            try:
                kw.update(extra)
                out = sk.verify(target, tokens, **kw, process_group=dist.group.WORLD)
                results[f"error-{name}"] = None
                results[f"out-{name}"] = _summary(out)
            except Exception as exc:  # noqa: BLE001  (the test checks type and message)
                results[f"error-{name}"] = (type(exc).__name__, str(exc))
    except Exception:  # noqa: BLE001
        results["crash"] = traceback.format_exc()
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()  # no rank tears gloo down while another is still in a collective (see bench_vocab_parallel)
    dist.destroy_process_group()


_RUNS: dict[tuple, list[dict]] = {}


def run_world(world: int, suite_name: str = "fast") -> list[dict]:
    """Every rank's results for the world size's suite (run once per test session)."""
    key = (world, suite_name)
    if key not in _RUNS:
        with tempfile.TemporaryDirectory() as tmp:
            # forkserver: like spawn (fresh interpreters, no inherited threads), but the package is
            # imported once in the server instead of once per rank (seconds each on a busy machine)
            method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
            if method == "forkserver":
                mp.get_context(method).set_forkserver_preload(["specdec_kernels", __name__])
            init_file = os.path.join(tmp, "init")
            args = (world, init_file, tmp, suite_name)
            mp.start_processes(_worker, args=args, nprocs=world, start_method=method)
            _RUNS[key] = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(world)]
    for r, res in enumerate(_RUNS[key]):
        assert "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    return _RUNS[key]


def _cpu_ready() -> bool:
    try:
        return csrc.cpu_backend_ready()
    except Exception:  # noqa: BLE001
        return False


def _assert_same(got: dict, want, name: str, who: str) -> None:
    summary = _summary(want)
    assert got.keys() == summary.keys(), (name, who)
    for field, value in summary.items():
        if value.is_floating_point():  # logprobs: float sums in another order across shards
            torch.testing.assert_close(got[field], value, atol=1e-5, rtol=0, equal_nan=True, msg=f"{name} {who}")
            continue
        assert torch.equal(got[field], value), f"{name}: {field} differs ({who}): {got[field]} vs {value}"


def _backends(spec: dict) -> list[str]:
    """The unsharded backends a case is compared with: the reference (not at the paper case's
    B = 3000: its loop is slow), the vectorized backend for method="block", the CPU build."""
    cpu = ["cpu"] if _cpu_ready() else []
    if spec.get("paper"):
        return ["vectorized", *cpu]
    return ["torch", *(["vectorized"] if spec.get("block") else []), *cpu]


def _check_world(world: int, suite_name: str = "fast") -> None:
    runs = run_world(world, suite_name)
    for name, spec in SUITES[suite_name](world).items():
        for backend in _backends(spec):
            want = _call(spec, None, backend=backend)
            for rank, res in enumerate(runs):
                _assert_same(res[name], want, name, f"rank {rank} vs unsharded backend={backend}")
    for name, (_, _, _, exc_type, message) in (error_cases(world) if suite_name == "fast" else {}).items():
        if exc_type is None:  # no error: every rank returns the same output (seed=None: rank 0's seed)
            assert all(res[f"error-{name}"] is None for res in runs), [res[f"error-{name}"] for res in runs]
            for res in runs[1:]:
                for field, value in runs[0][f"out-{name}"].items():
                    assert torch.equal(res[f"out-{name}"][field], value), (name, field)
            if name == "seed_huge":  # an int seed beyond int64 still gives the unsharded call's tokens
                spec, extra = error_cases(world)[name][:2]
                _assert_same(runs[0][f"out-{name}"], _call(spec, None, backend="torch", **extra), name, "unsharded")
            continue
        for rank, res in enumerate(runs):
            err = res[f"error-{name}"]
            assert err is not None, f"{name}: rank {rank} raised nothing"
            if name == "rank_shape" and rank == world - 1:
                assert err[0] == "ValueError" and "draft_tokens must have shape" in err[1], err
            else:
                assert err[0] == exc_type and message in err[1], (name, rank, err)


# --------------------------------------------------------------------------------------------
# tests


@pytest.mark.parametrize("world", [2, 3, 4])
def test_shards_match_unsharded_call(world):
    """Every case of the world size's suite, every rank, against backend="torch" and "cpu";
    argument errors raise on every rank (none is left waiting in a collective)."""
    _check_world(world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [3, 4])
def test_shards_match_unsharded_call_random_large(world):
    """24 random chain and 24 random K=3 multi-draft cases at V = 32000 over random uneven shards."""
    _check_world(world, "slow")


@pytest.mark.parametrize("world", [2, 3])
def test_block_shards_match_unsharded_call(world):
    """method="block" on uneven shards (V = 203): every draft mode, filters, greedy and sampled
    requests mixed, ragged and placeholder drafts, the flattened layout, grammar masks, logprobs,
    G = 0 and B = 0, against backend="torch", "vectorized" and "cpu" on every rank."""
    _check_world(world, "block")


def test_block_cases_tell_the_rules_apart():
    """Every block case with drafts to verify gives other tokens than the token rule would."""
    for world in BLOCK_SHARDS:
        for name, spec in block_suite(world).items():
            if spec.get("block") and spec["B"] and spec["G"]:
                token = _call(dict(spec, block=False), None, backend="vectorized")
                assert not torch.equal(_call(spec, None, backend="vectorized").tokens, token.tokens), name


def test_block_known_answer_on_shards():
    """The paper's two-token example over 2 ranks of one entry each: 11/9 drafts accepted per step
    by block verification, 10/9 by the token rule (3000 requests: standard error about 0.015)."""
    for res in run_world(2, "block"):
        block = float(res["block-paper"]["num_accepted"].double().mean())
        token = float(res["token-paper"]["num_accepted"].double().mean())
        assert abs(block - 11 / 9) < 0.05 and abs(token - 10 / 9) < 0.05, (block, token)


def test_block_flags_every_row_it_reads():
    """Under block verification a sampled request is flagged by its rows 0 .. n (NAN_AT), on every
    rank; the token rule by rows 0 .. j only (the case tells the two apart)."""
    for res in run_world(3, "block"):
        block, token = res["block-nan-rows"], res["token-nan-rows"]
        assert block["nonfinite"][1:].tolist() == [False, True, True]
        assert int(block["num_accepted"][3]) < 3  # tau < n: the NaN row lies beyond tau, still read
        assert not bool(token["nonfinite"][3])  # request 3 rejected a draft: its bonus row is not read
        assert torch.equal(block["nonfinite"][0], token["nonfinite"][0])  # greedy: the same chain


def test_nan_on_one_rank_flags_the_request_everywhere():
    runs = run_world(3)
    for name in ("chain-nan", "chain-nan-greedy", "multi-nan"):
        for res in runs:
            assert res[name]["nonfinite"].tolist() == [False, True, False, False][: len(res[name]["nonfinite"])], name


def test_cases_cover_the_contract():
    """The suites exercise every mode, filter, method, ragged drafts and placeholder ids (so a
    passing run means something)."""
    all_cases = [spec for w in SHARDS for spec in suite(w).values()]
    chain = [s for s in all_cases if s["op"] == "chain"]
    multi = [s for s in all_cases if s["op"] == "multi"]
    assert {(s["mode"], str(s["params"])) for s in chain} >= {(m, p) for m in MODES for p in CHAIN_PARAMS}
    assert {(s["method"], s["mode"]) for s in multi} >= {(m, d) for m in ("kseq", "rrs", "rrs_wor") for d in MODES}
    assert any(s.get("placeholder") for s in chain) and any(s.get("nan") for s in all_cases)
    assert {s["world"] for s in all_cases} == {2, 3, 4}


def test_mask_cases_depend_on_the_mask():
    """The token_bitmask cases are no accident of inputs the mask does not change."""
    for w in SHARDS:
        for name, spec in suite(w).items():
            if spec.get("mask"):
                plain = _call(dict(spec, mask=False), None, backend="torch")
                masked = _call(spec, None, backend="torch")
                assert not torch.equal(plain.tokens, masked.tokens), name
                assert bool(masked.nonfinite[1]) and not bool(plain.nonfinite[1]), name


def test_torch_philox_matches_numpy():
    seeds = torch.tensor([0, 1, -3, 2**63 - 1, -(2**63), 2**40 + 7], dtype=torch.int64)[:, None]
    c0 = torch.arange(0, 4000, 37)[None, :]
    want = philox4x32(seeds.numpy(), c0.numpy(), 9, 2, 0)
    got = philox4x32_torch(seeds, c0, 9, 2, 0)
    for w, g in zip(want, got, strict=True):
        assert (torch.from_numpy(w.astype("int64")) == g).all()
    assert torch.equal(uniform_open_torch(got[0]), torch.from_numpy(uniform_open(want[0])))


def test_vocab_size_needs_process_group():
    with pytest.raises(ValueError, match="vocab_size= describes vocabulary shards"):
        sk.verify(torch.zeros(1, 1, 4), torch.zeros(1, 0, dtype=torch.int64), vocab_size=4)


def test_process_group_needs_initialised_distributed():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="initialised torch.distributed"):
        sk.verify(torch.zeros(1, 1, 4), torch.zeros(1, 0, dtype=torch.int64), process_group=object())
