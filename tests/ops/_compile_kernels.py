"""Compile every Triton kernel for real GPU targets, without a GPU (run in a subprocess).

The CPU test suite runs the kernels in Triton's interpreter, which accepts programs the compiler
rejects (loop-carried type changes, unsupported ops). Compiling to PTX for sm_80 and sm_90 here
catches those breaks in CI. Usage: python -m tests.ops._compile_kernels [verify tree metadata attention]
"""

import importlib
import itertools
import os
import pkgutil
import sys
from types import SimpleNamespace

os.environ["TRITON_INTERPRET"] = "0"

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.compiler import compile as triton_compile

TARGETS = [GPUTarget("cuda", 80, 32), GPUTarget("cuda", 90, 32)]


def compile_kernel(fn, types: dict, constexprs: dict, num_warps: int = 4) -> None:
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in types:
            signature[name] = types[name]
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "i32"
    const = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    for target in TARGETS:
        triton_compile(ASTSource(fn, signature, const), target=target, options={"num_warps": num_warps})


def triton_kernels() -> SimpleNamespace:
    """Every module-level name of the Triton backend's modules (specdec_kernels.ops.triton), so
    the lists below name kernels without caring which module of the backend defines them."""
    package = importlib.import_module("specdec_kernels.ops.triton")
    found = {}
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        found.update(vars(importlib.import_module(info.name)))
    return SimpleNamespace(**found)


def verify_kernels():
    v = triton_kernels()
    ints = {
        "num_draft_ptr": "*i32",
        "top_k_ptr": "*i64",
        "seed_ptr": "*i64",
        "idx_ptr": "*i32",
        "draft_tokens_ptr": "*i64",
        "cu_ptr": "*i64",
        "filter_int_ptr": "*i32",
        "use_ptr": "*i8",
    }
    variants = itertools.product(["*bf16"], [0, 1, 2], [False, True], [(1, 2048), (2, 16)])
    others = [("*fp16", 1, True, (1, 2048)), ("*fp32", 2, True, (2, 16)), ("*bf16", 1, False, (64, 16))]
    for dtype, mode, has_filter, (block, bv) in itertools.chain(variants, others):
        types = dict(ints, target_ptr=dtype, draft_ptr=dtype if mode == 1 else "*fp32")
        per_req = block > 1  # one variant with [B] tensors, one with scalar parameters
        flags = dict(PER_REQ_N=per_req, PER_REQ_T=per_req, PER_REQ_SEED=per_req)
        types.update(temperature="fp32", top_k="i32", top_p="fp32", seed="i64")
        phases = range(3) if has_filter and block == 2 else [0]  # statistics pass, threshold phases
        for phase in phases:
            yield (
                v._verify_row_stats_kernel,
                types,
                dict(
                    PER_REQ_N=per_req,
                    PER_REQ_T=per_req,
                    PER_REQ_K=per_req,
                    PER_REQ_P=per_req,
                    DRAFT_MODE=mode,
                    HAS_FILTER=has_filter,
                    PHASE=phase,
                    FILTER_BLOCK=4096,
                    FILTER_CAP=16,
                    FILTER_BINS=256,
                    FILTER_CHUNKS=64,
                    PLACEHOLDERS_END=not per_req,
                    GP2=8,
                    FLAT=per_req,  # the flattened ragged layout rides on the per-request variant
                    ROW_USE=not per_req,  # trees' row use rides on the scalar variant
                    BLOCK_R=block if phase == 0 else 1,  # the threshold phases: one row per program
                    BLOCK_V=bv,
                    LOGPROBS=has_filter and mode != 1,  # return_logprobs: greedy rows' thresholds
                    ARGMAX_ONLY=mode == 0 and not has_filter,  # all-greedy chains: max / argmax only
                ),
            )
        types2 = dict(
            types,
            draft_tokens_ptr="*i64",
            first_reject_ptr="*i32",
            token_ptr="*i32",
            nonfinite_ptr="*i1",
            race_idx_ptr="*i32",
            mass_ptr="*fp64",
            out_tokens_ptr="*i64",
            out_accepted_ptr="*i32",
        )
        accept = dict(flags, DRAFT_MODE=mode, HAS_FILTER=has_filter, FLAT=per_req, BLOCK_B=block, ROWS=8, BLOCK_V=bv)
        # method="block": the residual-mass and race launches (ops/triton/block.py), bf16 tiles of 2 requests
        for block_launch in (0, 1, 2) if dtype == "*bf16" and block == 2 else (0,):
            yield v._verify_accept_kernel, types2, dict(accept, BLOCK=block_launch)
        if mode == 0 and not has_filter:  # an all-greedy call: no race, the tokens written here
            yield v._verify_accept_kernel, types2, dict(accept, WRITE_TOKENS=True)
    types3 = {
        "draft_tokens_ptr": "*i64",
        "cu_ptr": "*i64",
        "num_draft_ptr": "*i32",
        "first_reject_ptr": "*i32",
        "token_ptr": "*i32",
        "race_idx_ptr": "*i32",
        "out_tokens_ptr": "*i64",
        "out_accepted_ptr": "*i32",
        "temperature": "fp32",
    }
    for per_req in (False, True):
        types4 = {"idx_ptr": "*i32", "out_idx_ptr": "*i32", "temperature": "fp32"}
        yield v._combine_row_stats_kernel, types4, dict(PER_REQ_T=per_req, BLOCK_R=8, BLOCK_C=512)
        for logprobs in (False, True):  # return_logprobs: the logprobs from the row records, filtered or not
            flags = dict(LOGPROBS=logprobs, HAS_FILTER=logprobs and per_req, BY_INDEX=logprobs and per_req)
            yield (
                v._verify_finalize_kernel,
                dict(types3, target_ptr="*bf16" if per_req else "*fp32"),
                dict(PER_REQ_T=per_req, FLAT=per_req, BLOCK_B=128, ROWS=8, **flags),
            )


def tree_kernels():
    v = triton_kernels()
    types = {
        "target_ptr": "*bf16",
        "tokens_ptr": "*i64",
        "parents_ptr": "*i64",
        "num_nodes_ptr": "*i32",
        "seed_ptr": "*i64",
        "idx_ptr": "*i32",
        "out_tokens_ptr": "*i64",
        "out_nodes_ptr": "*i64",
        "out_accepted_ptr": "*i32",
        "nonfinite_ptr": "*i1",
        "temperature": "fp32",
        "seed": "i64",
        "race_i_ptr": "*i32",
        "race_xs_ptr": "*i64",
        "pos_ptr": "*i32",
        "use_ptr": "*i8",
    }
    for chains in (False, True):
        yield v._tree_positions_kernel, types, dict(PER_REQ_N=not chains, CHAINS=chains, NP2=64, BLOCK_B=1)
    yield v._tree_finalize_kernel, types, dict(BLOCK_B=64)
    for mode, method, has_filter, chains in [
        (0, 0, False, False),
        (1, 0, True, False),
        (2, 0, False, True),
        (1, 1, False, False),
        (2, 2, True, True),
    ]:
        t = dict(types, draft_ptr="*bf16" if mode == 1 else "*fp32")
        yield (
            v._tree_walk_kernel,
            t,
            dict(
                PER_REQ_N=not chains,
                PER_REQ_T=True,
                PER_REQ_SEED=True,
                CHAINS=chains,
                DRAFT_MODE=mode,
                HAS_FILTER=has_filter,
                METHOD=method,
                BLOCK_B=1,
                NP2=64,
                DP2=32,
                BLOCK_V=1024,
            ),
        )
        race = dict(PER_REQ_T=True, PER_REQ_SEED=True, DRAFT_MODE=mode, HAS_FILTER=has_filter, METHOD=method)
        yield v._tree_race_kernel, t, dict(race, NP2=64, BLOCK_B=1, BLOCK_V=1024)
        if mode and method == 0:
            rho = dict(
                PER_REQ_T=True, DRAFT_MODE=mode, HAS_FILTER=has_filter, RHO_P=v.RHO_POINTS, BLOCK_P=1, BLOCK_V=256
            )
            yield v._tree_rho_kernel, t, rho
            step = dict(PER_REQ_T=True, RHO_P=v.RHO_POINTS, BLOCK_P=64)
            yield v._tree_rho_step_kernel, t, step
        if mode and method > 0:
            rrs = dict(PER_REQ_T=True, DRAFT_MODE=mode, HAS_FILTER=has_filter, WOR=method == 2, BLOCK_P=1)
            for first_round in (False, True):  # round 1 compiles with rnd a constant
                yield v._tree_rrs_kernel, t, dict(rrs, FIRST_ROUND=first_round, BLOCK_V=1024)


def metadata_kernels():
    v = importlib.import_module("specdec_kernels.ops.tree_metadata")
    types = {"parents_ptr": "*i64", "num_nodes_ptr": "*i64", "depth_ptr": "*i32", "mask_ptr": "*i64"}
    yield v._tree_metadata_kernel, types, dict(PER_REQ_N=True, BLOCK_B=16, NP2=64)


def attention_kernels():
    import triton.language as tl

    v = triton_kernels()  # ops/triton/attention.py
    ints = {
        "key_start_ptr": "*i32",
        "prefix_end_ptr": "*i32",
        "tree_start_ptr": "*i32",
        "anc_ptr": "*i64",
        "window_lo_ptr": "*i32",
        "qk_scale": "fp32",
    }
    for dtype, dot, D, block_d, block_m, splits, window in [
        ("*bf16", tl.bfloat16, 128, 128, 64, 1, False),
        ("*fp16", tl.float16, 80, 128, 16, 4, True),
        ("*bf16", tl.bfloat16, 256, 256, 16, 8, False),
        ("*fp32", tl.float32, 64, 64, 32, 1, True),
    ]:
        types = dict(ints, q_ptr=dtype, k_ptr=dtype, v_ptr=dtype, out_ptr=dtype, part_acc_ptr=dtype)
        yield (
            v._tree_attention_kernel,
            types,
            dict(
                GROUP=4,
                D=D,
                BLOCK_D=block_d,
                BLOCK_M=block_m,
                BLOCK_N=32 if block_d > 128 else 64,
                TREE_SPAN=64,
                NUM_SPLITS=splits,
                HAS_WINDOW=window,
                DOT_DTYPE=dot,
            ),
        )
        if splits > 1:
            combine_types = dict(out_ptr=dtype, part_acc_ptr=dtype)  # the splits' partials are in q's dtype
            yield v._tree_attention_combine_kernel, combine_types, dict(D=D, BLOCK_D=block_d, SPLITS_P2=splits)


FAMILIES = {
    "verify": verify_kernels,
    "tree": tree_kernels,
    "metadata": metadata_kernels,
    "attention": attention_kernels,
}


def with_mask_variant(fn, types: dict, constexprs: dict, nth: int) -> tuple[dict, dict]:
    """Kernels reading token_bitmask words (HAS_MASK): every other variant of each kernel compiles
    the masked form (int32 words; every fourth, in the row-statistics kernel, with the tree's
    parents mapping), so both forms are covered without doubling the compile time."""
    if "HAS_MASK" not in fn.arg_names or "HAS_MASK" in constexprs:
        return types, constexprs
    has_mask = nth % 2 == 1
    constexprs = dict(constexprs, HAS_MASK=has_mask)
    if "MASK_PARENTS" in fn.arg_names:
        constexprs["MASK_PARENTS"] = has_mask and nth % 4 == 3
    types = dict(types)
    types.setdefault("mask_ptr", "*i32")
    types.setdefault("parents_ptr", "*i64")
    return types, constexprs


def main(families=None) -> int:
    count = 0
    chosen = [FAMILIES[name]() for name in (families or FAMILIES)]
    seen: dict[str, int] = {}
    for fn, types, constexprs in itertools.chain(*chosen):
        nth = seen[fn.__name__] = seen.get(fn.__name__, -1) + 1
        types, constexprs = with_mask_variant(fn, types, constexprs, nth)
        try:
            compile_kernel(fn, types, constexprs)
        except Exception as exc:  # report which variant broke, then fail
            print(f"FAILED {fn.__name__} {constexprs} {types}: {exc}", file=sys.stderr)
            return 1
        count += 1
    print(f"compiled {count} kernel variants for sm_80 and sm_90")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
