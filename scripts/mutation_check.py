"""Mutation check: do the tests catch one-line bugs in the sampling paths? (Not run in CI: long.)

Each mutant is (function name, pattern, replacement): the function is found by NAME anywhere in
specdec_kernels/ or csrc/ (no paths or line numbers, so files may move), the pattern must occur
exactly once in its body, and the mutant is applied to a scratch copy of the working tree (tracked
and untracked, not ignored files). The tests covering that code run there: the fast ones first, then
the slow statistical ones (``-m slow``), each run stopping at its first failure. A mutant is KILLED
(with the killing test's id) or SURVIVED. csrc mutants rebuild the native CPU core: its build cache
is keyed by a hash of the sources (specdec_kernels/ops/csrc/__init__.py), so each mutant gets its own
build (about a minute) and the unmutated one is reused; a mutant that does not compile is killed by
the build. Equivalent mutants (no input can tell them apart) are listed with the reason, not run.

    python scripts/mutation_check.py                 # every mutant (an hour or more on 2 cores)
    python scripts/mutation_check.py --list          # the mutants, located (no tests run)
    python scripts/mutation_check.py core-tie ref-rho-lo --fast-only
    python scripts/mutation_check.py --jobs 2        # pytest -n 2 in each run

Run it before any change to a sampling path; CONTRIBUTING.md ("Mutation check") has the kill rate.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEARCH_DIRS = ("specdec_kernels", "csrc")
PY_SUFFIXES = (".py",)
CPP_SUFFIXES = (".h", ".cpp", ".cu")

# Test groups: the tests a developer runs for a file (fast), then the statistical ones (slow).
TIES = "tests/ops/test_ties.py"
TREE = "tests/ops/test_verify_tree.py"  # the kernels against the reference, node for node
STATS = ["tests/ops/test_verify_stats.py", "tests/ops/test_verify_tree_stats.py"]
GROUPS = {
    "reference": (
        [TIES, "tests/reference", "tests/ops/test_verify_tree_stats.py", "tests/ops/test_verify.py", TREE],
        STATS,
    ),
    "triton": ([TIES, "tests/ops/test_verify.py", TREE], STATS),
    "triton_logprobs": (["tests/ops/test_native_logprobs.py"], ["tests/ops/test_native_logprobs.py"]),
    "core": ([TIES, "tests/ops/test_csrc_tree_core.py", "tests/ops/test_csrc_core.py"], STATS),
    "vectorized": ([TIES, "tests/ops/test_vectorized_backend.py"], STATS),
    "cpu_block": (["tests/ops/test_cpu_block.py"], ["tests/ops/test_cpu_block.py"]),
    "triton_block": (["tests/ops/test_triton_block.py"], ["tests/ops/test_triton_block.py"]),
    "vocab_parallel": ([TIES, "tests/ops/test_vocab_parallel.py"], ["tests/ops/test_vocab_parallel.py"]),
    "vp_block": (["tests/ops/test_vocab_parallel.py"], ["tests/ops/test_vocab_parallel.py"]),
    "shaped_tree": (["tests/hf/test_shaped_tree.py"], ["tests/hf/test_dynamic_tree.py"]),
    "tree_policy": (["tests/hf/test_dynamic_tree.py"], []),
    "chunk_merge": (["tests/ops/test_chunk_merge.py"], []),
    "cpu_linear": (["tests/hf/test_cpu_linear.py"], []),
    "draft_vocab": (["tests/hf/test_draft_vocab.py"], []),
    "cpu_int8": (["tests/hf/test_cpu_int8.py", "tests/hf/test_cpu_int8_native.py"], []),
    "cpu_int4": (["tests/hf/test_cpu_int4.py"], []),
    "cpu_f32": (["tests/hf/test_cpu_f32.py"], []),
    "lean_forward": (["tests/hf/test_lean_forward.py"], []),
    "draft_length": (["tests/hf/test_draft_length.py"], []),
    "cpu_attention": (["tests/ops/test_tree_attention.py", "tests/hf/test_tree_attention_backend.py"], []),
    "driver": (
        ["tests/hf/test_generate.py", "tests/hf/test_draft_law.py", "tests/hf/test_medusa.py"],
        ["tests/hf/test_draft_law.py", "tests/hf/test_generate.py"],
    ),
}
# -k filters of the slow statistical tests per group (only the mutated backend's parametrisations)
SLOW_FILTER = {
    "triton": "triton",
    "core": "cpu",
    "vectorized": "vectorized",
    "reference": "not triton",
    "vp_block": "block",
}
# -k filters of the fast tests where a file parametrises several backends (only the mutated one's)
# or holds several features' tests (vp_block: the block-verification tests of the sharded path)
FAST_FILTER = {
    "triton_logprobs": "triton",
    "vp_block": "block",
    "tree_policy": "chain_equivalent or teach or shape_model or budget_policy",
}


@dataclass(frozen=True)
class Mutant:
    name: str
    group: str  # key of GROUPS
    function: str  # def / C++ function whose body holds the pattern
    pattern: str
    replacement: str
    equivalent: str = ""  # why no input can tell it apart (then it is listed, not run)


MUTANTS = [
    # ---- reference (specdec_kernels/reference)
    Mutant("ref-tie", "reference", "_verify_request", "u * q_tok <= p_tok", "u * q_tok < p_tok"),
    Mutant("ref-residual-abs", "reference", "_verify_request", "torch.clamp(p - q, min=0)", "torch.abs(p - q)"),
    Mutant("ref-rho-lo", "reference", "rho_search", "_lo, _glo, hi, ghi = state", "hi, ghi, _lo, _glo = state"),
    Mutant("ref-kseq-scale", "reference", "kseq_scale", "(1.0 - (1.0 - beta) ** k) / beta", "float(k)"),
    Mutant("ref-uniform-half", "reference", "uniform_open", "np.float32(0.5)", "np.float32(0.25)"),
    # ---- Triton kernels (specdec_kernels/ops)
    Mutant("triton-tie", "triton", "_first_rejection", "(u * q_tok <= p_tok)", "(u * q_tok < p_tok)"),
    Mutant("triton-rho-lo", "triton", "_accept_kseq", "hi = tl.load(rec + RB_HI", "hi = tl.load(rec + RB_LO"),
    Mutant("triton-rrs-tie", "triton", "_accept_rrs", "(u_j * q_j <= p_j)", "(u_j * q_j < p_j)"),
    Mutant(
        "triton-kseq-tie",
        "triton",
        "_accept_kseq",
        "u * rho[:, None] * q_c <= p_c",
        "u * rho[:, None] * q_c < p_c",
    ),
    Mutant("triton-p-zero", "triton", "_first_rejection", " & (p_tok > 0.0)  #", "  #"),
    # native tree logprobs: greedy rows scored at their T = 0, not 1; a raced token scored with the
    # draft row's record of its position (one slot early) instead of the target row's
    Mutant(
        "triton-tree-lp-unit-t",
        "triton_logprobs",
        "_tree_walk_kernel",
        "tl.where(greedy, 1.0, temperature)",
        "temperature",
    ),
    Mutant(
        "triton-tree-lp-race-row",
        "triton_logprobs",
        "_tree_finalize_kernel",
        "_record(b, rep, K, G, 1), race",
        "_record(b, rep, K, G, 0), race",
    ),
    # ---- C++ core (csrc)
    Mutant("core-tie", "core", "accept_walk", "accept = (u * q <= p)", "accept = (u * q < p)"),
    Mutant("core-rho-lo", "core", "kseq_rho", "rho = hi;", "rho = lo;"),
    Mutant("core-kseq-tie", "core", "tree_walk_program", "c.u * rho * c.q <= c.p", "c.u * rho * c.q < c.p"),
    Mutant("core-rrs-tie", "core", "tree_walk_program", "c.u * q_j <= p_j", "c.u * q_j < p_j"),
    Mutant("core-onehot-tie", "core", "tree_walk_program", "c.u <= p_j", "c.u < p_j"),
    Mutant("core-kseq-f", "core", "kseq_f", "- g;", "- 0.5f * g;"),
    # ---- block verification in the CPU build (csrc/verify_cpu.cpp)
    Mutant("block-w-prev", "cpu_block", "block_decide_program", "s, toks[i], w[i]);", "s, toks[i], w[i - 1]);"),
    Mutant("block-hn-one", "cpu_block", "block_decide_program", "if (eta <= w[n])", "if (eta <= 1.0)"),
    Mutant(
        "block-eta-row", "cpu_block", "block_decide_program", "uint32_t(i - 1), PURPOSE_ACC", "uint32_t(i), PURPOSE_ACC"
    ),
    Mutant("block-unweighted", "cpu_block", "block_walk", "aw.w = P.block_w[b];", "aw.w = 1.0f;"),
    # ---- block verification in the Triton chain kernels (specdec_kernels/ops/triton/block.py)
    Mutant("tblock-eta-row", "triton_block", "block_candidates", "i * 0, i - 1, PURPOSE_ACC", "i * 0, i, PURPOSE_ACC"),
    Mutant("tblock-hn-one", "triton_block", "block_tau", "tl.where(last, eta <= w,", "tl.where(last, eta <= 1.0,"),
    Mutant("tblock-mass-unweighted", "triton_block", "_row_mass", "w_k * p.to(tl.float64)", "p.to(tl.float64)"),
    Mutant(
        "tblock-race-w1", "triton_block", "_verify_accept_kernel", "(w, i, j).to(tl.float32)", "(w, i, j) * 0.0 + 1.0"
    ),
    # ---- vectorized backend (specdec_kernels/ops)
    Mutant("vec-tie", "vectorized", "__init__", "u[testing, i] * q_tok <= p_tok", "u[testing, i] * q_tok < p_tok"),
    Mutant("vec-kseq-tie", "vectorized", "_choose_kseq", "u[:, j] * rho * qx <= px", "u[:, j] * rho * qx < px"),
    Mutant("vec-rrs-tie", "vectorized", "_choose_rrs", "u[rows, j] * qx <= px", "u[rows, j] * qx < px"),
    Mutant("vec-onehot-tie", "vectorized", "_choose_one_hot", "(u[:, j] <= pj)", "(u[:, j] < pj)"),
    Mutant(
        "vec-rho-one",
        "vectorized",
        "_choose_kseq",
        "rho, beta = _solve_rho(p, q, k)",
        "rho, beta = _solve_rho(p, q, k * 0 + 1)",
    ),
    # ---- vocabulary-parallel (specdec_kernels/ops/vocab_parallel)
    Mutant("vp-tie", "vocab_parallel", "verify_chain_sharded", "(u * q_tok <= p_tok)", "(u * q_tok < p_tok)"),
    Mutant("vp-rho-one", "vocab_parallel", "_kseq", "hi[b] if multi[b] else 1.0", "1.0"),
    Mutant(
        "vp-greedy",
        "vocab_parallel",
        "verify_chain_sharded",
        "acc_greedy = ids == argmax",
        "acc_greedy = ids != argmax",
    ),
    # ---- block verification on vocabulary shards (specdec_kernels/ops/vocab_parallel/block.py)
    Mutant("vpb-local-r", "vp_block", "residual_masses", "shard.sum_many([local])[0]", "local"),
    Mutant("vpb-h", "vp_block", "sharded_block_tau", "r / (r + 1.0 - w[:, 1:G])", "r / (r + 1.0)"),
    Mutant("vpb-flag-rows", "vp_block", "verify_chain_sharded", "row[None] <= n[:, None])", "row[None] <= j[:, None])"),
    Mutant(
        "vpb-residual-w",
        "vp_block",
        "verify_chain_sharded",
        "(p_row if w_j is None else w_j[:, None] * p_row)",
        "p_row",
    ),
    # ---- Hugging Face driver (specdec_kernels/hf)
    Mutant("driver-path", "driver", "verify", "slots <= out.num_accepted", "slots < out.num_accepted"),
    Mutant(
        "driver-no-q",
        "driver",
        "verify",
        '{"draft_probs": self.probs}\n        # validate=False',
        "{}\n        # validate=False",
    ),
    # ---- shaped dynamic trees (hf/drafters/dynamic_tree.py's _Shape)
    Mutant("shape-budget", "shaped_tree", "keep", "(col < self.left[:, None])", "(col <= self.left[:, None])"),
    Mutant("shape-no-root", "shaped_tree", "keep", "((col == 0) & (d == 1))", "((col == 0) & (d == 0))"),
    Mutant(
        "shape-kept-kids",
        "shaped_tree",
        "propose",
        'score = torch.where(ok, score, float("-inf"))',
        "pass",
        equivalent="a node dropped by the threshold has children scoring below it (scores only fall along a path), "
        "and one dropped by the budget leaves its request no budget: their children are never kept either way",
    ),
    # ---- the tree policy's chain-equivalent counts (specdec_kernels/hf/drafters/dynamic_tree.py)
    Mutant("chain-eq-stop", "tree_policy", "chain_equivalent", "(run < accepted) | stopped", "(run < accepted)"),
    Mutant("chain-eq-run", "tree_policy", "chain_equivalent", "on_path.long().cumprod(dim=1)", "on_path.long()"),
    Mutant("chain-observe", "tree_policy", "observe_chain", 'self.counts["chain"][0] += accepted', "pass"),
    # ---- the shape models' price of the target's rows (specdec_kernels/hf/draft_length.py, tree_budget.py)
    Mutant(
        "tree-rows-unpriced",
        "tree_policy",
        "_shape",
        "1 + nodes, self.cost, self.row_cost",
        "1, self.cost, self.row_cost",
    ),
    Mutant(
        "tree-draft-rows-unpriced",
        "tree_policy",
        "_shape",
        "max(0, min(nodes, width * (depth - 1)) - (depth - 1))",
        "0",
    ),
    Mutant(
        "draft-row-cost-layers",
        "draft_length",
        "draft_row_cost_estimate",
        "layers * CPU_LAYER_ROW_BYTES /",
        "CPU_LAYER_ROW_BYTES /",
    ),
    Mutant(
        "chain-rows-unpriced",
        "draft_length",
        "best_by_shapes",
        "/ shape_cost(g, g + 1, cost, row_cost)",
        "/ (1 + g * cost)",
    ),
    Mutant("row-cost-flops", "draft_length", "row_cost_estimate", "2.0 * weights", "1.0 * weights"),
    Mutant("free-rows", "draft_length", "shape_cost", "max(0, rows - FREE_ROWS)", "max(0, rows - 1)"),
    # ---- the learned node threshold of shaped trees (specdec_kernels/hf/tree_budget.py, dynamic_tree.py)
    Mutant("node-threshold-rate", "shaped_tree", "node_threshold", "min(c * self.rate,", "min(c / self.rate,"),
    Mutant(
        "row-cost-column", "shaped_tree", "per_node", "torch.linalg.solve(a, rhs)[2]", "torch.linalg.solve(a, rhs)[1]"
    ),
    Mutant("step-threshold-max", "shaped_tree", "_step_threshold", "max(self.threshold, learned)", "learned"),
    # ---- oneDNN linears' short-input padding (specdec_kernels/hf/cpu_linear.py)
    Mutant("linear-no-pad", "cpu_linear", "forward", "if 0 < rows < MIN_ROWS:", "if 0 < rows < 1:"),
    Mutant("linear-pad-rows", "cpu_linear", "forward", "self._linear(padded)[:rows]", "self._linear(padded)[-rows:]"),
    # ---- a draft restricted to part of the vocabulary (specdec_kernels/hf/draft_vocab.py, drafters/model.py)
    Mutant(
        "vocab-prefix-slice",
        "draft_vocab",
        "forward",
        "out[..., : y.shape[-1]] = y",
        "out[..., 1 : y.shape[-1] + 1] = y[..., :-1]",
    ),
    Mutant(
        "vocab-not-restored",
        "draft_vocab",
        "installed",
        "finally:\n            model.set_output_embeddings(original)",
        "finally:\n            pass",
    ),
    Mutant("vocab-not-installed", "draft_vocab", "enter", "self.cost_key = stack.enter_context(", "self.cost_key = ("),
    Mutant(
        "vocab-rank-by-id",
        "draft_vocab",
        "frequent_token_ids",
        "torch.sort(-counts, stable=True)",
        "torch.sort(-counts.clamp(max=0), stable=True)",
    ),
    # ---- int8 linear layers for CPU drafts (specdec_kernels/hf/cpu_int8.py)
    Mutant("int8-half-scale", "cpu_int8", "_row_scales", "(amax / INT8_MAX)", "(amax / 254.0)"),
    Mutant(
        "int8-reduce-range",
        "cpu_int8",
        "forward",
        "self.packed, self.reduce_range)",
        "self.packed, not self.reduce_range)",
    ),
    Mutant("int8-keep-ignored", "cpu_int8", "replace_cpu_linears", "or any(part in full for part in keep)", "or False"),
    Mutant("int8-bytes-uncounted", "cpu_int8", "_streamed", "elif isinstance(m, Int8Linear):", "elif False:"),
    # (the native kernel, csrc/int8_linear.cpp)
    Mutant(
        "int8n-scalar-zero-point",
        "cpu_int8",
        "finish",
        "static_cast<float>(dot - za * wsum)",
        "static_cast<float>(dot)",
    ),
    Mutant(
        "int8n-vector-zero-point",
        "cpu_int8",
        "gemv_vnni",
        "_mm512_sub_epi32(acc[m][t], _mm512_mullo_epi32(_mm512_set1_epi32(za[m]), wsv))",
        "acc[m][t]",
    ),
    Mutant(
        "int8n-panel-stride",
        "cpu_int8",
        "gemv_vnni",
        "panel + (t * Q + q) * PANEL * QUAD",
        "panel + (t + q) * PANEL * QUAD",
    ),
    Mutant(
        "int8n-avx2-zero-point",
        "cpu_int8",
        "gemv_avx2",
        "_mm_sub_epi32(dot, _mm_mullo_epi32(_mm_set1_epi32(za[m]), wsv))",
        "dot",
    ),
    Mutant("int8n-avx2-chunk", "cpu_int8", "gemv_avx2", "block + t * QUAD * QUAD", "block + t * QUAD"),
    Mutant("int8n-avx2-tail", "cpu_int8", "gemv_avx2", "std::min<int64_t>(QUAD, N - n)", "int64_t{QUAD}"),
    Mutant("int8-fbgemm-full-range", "cpu_int8", "__init__", "and not _fbgemm_sums_exact()", "and False"),
    Mutant("int8n-rounding", "cpu_int8", "quantize_rows", "std::nearbyint(xr[k] * inv)", "std::trunc(xr[k] * inv)"),
    Mutant(
        "int8n-pack-order",
        "cpu_int8",
        "pack_int8",
        "Kp // 4, 4).permute(0, 2, 1, 3)",
        "Kp // 4, 4).permute(0, 1, 2, 3)",
    ),
    Mutant(
        "int8n-bytes-unpadded",
        "cpu_int8",
        "_streamed",
        "m.wq.numel() + 4 * m.sw.numel() + 4 * m.wsum.numel()",
        "m.in_features * m.out_features + 4 * m.out_features",
    ),
    # ---- the native fp32 linear of CPU models (csrc/f32_linear.cpp, specdec_kernels/hf/cpu_f32.py)
    Mutant(
        "f32-bias-inside",
        "cpu_f32",
        "panels_avx512",
        "_mm512_setzero_ps();\n  const float* panel",
        "_mm512_set1_ps(1e-3f);\n  const float* panel",
    ),
    Mutant(
        "f32-scalar-no-fma",
        "cpu_f32",
        "panels_scalar",
        "acc = std::fma(panel[k * PANEL + j], x[m * K + k], acc)",
        "acc += panel[k * PANEL + j] * x[m * K + k]",
    ),
    Mutant("f32-panel-stride", "cpu_f32", "panels_avx512", "panel + (t * K + k) * PANEL", "panel + (t + k) * PANEL"),
    Mutant("f32-tail-mask", "cpu_f32", "panels_avx512", "(1u << (N - n)) - 1", "(1u << (N - n + 1)) - 1"),
    Mutant(
        "f32-avx2-upper-half",
        "cpu_f32",
        "panels_avx2",
        "panel + (t * K + k) * PANEL + PANEL / 2",
        "panel + (t * K + k) * PANEL",
    ),
    Mutant("f32-avx2-sub-rows", "cpu_f32", "panels_avx2_rows", "m0 < rows; m0 += per)", "m0 < rows; m0 += AVX2_ROWS)"),
    Mutant("f32-tail-panels", "cpu_f32", "f32_linear", "int64_t{2}, int64_t{1}}", "int64_t{2}}"),
    Mutant("f32-pass-rows", "cpu_f32", "f32_linear", "m0 < M; m0 += per_pass)", "m0 < M; m0 += ROWS)"),
    Mutant(
        "f32-pack-order",
        "cpu_f32",
        "pack_f32",
        "K).transpose(1, 2).reshape(P, K * F32_PANEL)",
        "K).reshape(P, K * F32_PANEL)",
    ),
    Mutant("f32-bytes-uncounted", "draft_length", "_streamed", "elif isinstance(m, NativeLinear):", "elif False:"),
    Mutant("f32-keep-bf16", "cpu_f32", "_plain_fp32", "layer.weight.dtype == fp32 and", "True and"),
    # ---- the lean CPU forward (specdec_kernels/hf/lean_forward.py)
    Mutant(
        "lean-rope-sin", "lean_forward", "lean_forward", "apply_rotary(q, k, cos, sin)", "apply_rotary(q, k, cos, cos)"
    ),
    Mutant("lean-keep-ignored", "lean_forward", "lean_forward", "hidden[:, -keep:, :] if keep else hidden", "hidden"),
    Mutant(
        "lean-hooks-ignored", "lean_forward", "_any_hooks", "if m._forward_hooks or m._forward_pre_hooks:", "if False:"
    ),
    Mutant(
        "lean-window-ignored",
        "lean_forward",
        "_structure_fits",
        'getattr(att, "sliding_window", None) is not None',
        "False",
    ),
    # ---- int4 linear layers for CPU drafts (specdec_kernels/hf/cpu_int4.py, csrc/int4_linear.cpp)
    Mutant(
        "int4-offset",
        "cpu_int4",
        "quantize_rows",
        "-8.f * s * static_cast<float>(sum)",
        "-7.f * s * static_cast<float>(sum)",
    ),
    Mutant(
        "int4-rounding",
        "cpu_int4",
        "quantize_rows",
        "std::nearbyint(xr[g * GROUP + i] * inv)",
        "std::trunc(xr[g * GROUP + i] * inv)",
    ),
    Mutant(
        "int4-scale-spread",
        "cpu_int4",
        "gemv_vnni",
        "_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)",
        "_mm512_set_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)",
    ),
    Mutant(
        "int4-vector-halves",
        "cpu_int4",
        "gemv_vnni",
        "d = _mm512_dpbusd_epi32(d, hi[t], a_second);",
        "d = _mm512_dpbusd_epi32(d, hi[t], a_first);",
    ),
    Mutant("int4-portable-halves", "cpu_int4", "gemv_scalar", "(wb[i] >> 4) * ab[64 + i]", "(wb[i] >> 4) * ab[i]"),
    Mutant(
        "int4-nibble-order",
        "cpu_int4",
        "pack_int4",
        "(q[..., :16] | (q[..., 16:] << 4))",
        "(q[..., 16:] | (q[..., :16] << 4))",
    ),
    Mutant("int4-narrow-taken", "cpu_int4", "use_int4_linears", "% INT4_GROUP == 0 and", "% 1 == 0 and"),
    Mutant("int4-bytes-uncounted", "cpu_int4", "_streamed", "elif isinstance(m, Int4Linear):", "elif False:"),
    # ---- all-greedy chain calls: the accept kernel merges the chunks and writes the tokens (triton/chain.py)
    Mutant(
        "greedy-inline-one-chunk", "triton", "_accept_launch", "stat_chunks=records.stats.shape[1],", "stat_chunks=1,"
    ),
    Mutant(
        "greedy-inline-too-many",
        "triton",
        "launch_verify",
        "plan.num_chunks > GREEDY_INLINE_CHUNKS",
        "plan.num_chunks > 2 * GREEDY_INLINE_CHUNKS",
        equivalent="merging 9-16 chunks inline gives the same records (a slower program, not another token)",
    ),
    # ---- the CPU attention of a few queries (specdec_kernels/ops/tree_attention.py, hf/attention.py)
    Mutant(
        "grouped-heads",
        "cpu_attention",
        "tree_attention_grouped",
        "q.reshape(B, Hkv, group * Nq, D)",
        "q.reshape(B, group, Hkv * Nq, D).transpose(1, 2).reshape(B, Hkv, group * Nq, D)",
    ),
    Mutant(
        "grouped-padding",
        "cpu_attention",
        "tree_attention_grouped",
        "out.masked_fill_(~real[:, None, :, None], 0.0)",
        "out",
    ),
    Mutant(
        "grouped-dispatch",
        "cpu_attention",
        "_tree_attention_forward",
        "query.shape[2] <= GROUPED_MAX_QUERIES",
        "query.shape[2] < GROUPED_MAX_QUERIES",
    ),
    # ---- the merge of the row pass's chunk records (specdec_kernels/ops/triton/chunk_merge.py)
    Mutant(
        "merge-first-chunk",
        "chunk_merge",
        "_combine_row_stats_kernel",
        "tl.min(tl.where(hit, c, num_chunks), 1)",
        "tl.max(tl.where(hit, c, -1), 1)",
    ),
    Mutant(
        "merge-tile-tie",
        "chunk_merge",
        "_combine_row_stats_kernel",
        "take = tile_max > g_max",
        "take = tile_max >= g_max",
    ),
    Mutant("merge-bad-sum", "chunk_merge", "_combine_row_stats_kernel", "bad_t += tl.sum(", "bad_t = tl.sum("),
    Mutant(
        "merge-z-ref",
        "chunk_merge",
        "_tile_softmax",
        "tl.exp((cm - ref[:, None]) * inv_t[:, None])",
        "tl.exp((cm - ref[:, None]))",
    ),
    # ---- equivalent mutants (listed, not run)
    Mutant(
        "ref-uniform-div",
        "reference",
        "uniform_open",
        "* np.float32(2.0**-UNIFORM_BITS)",
        "/ np.float32(2.0**UNIFORM_BITS)",
        equivalent="multiplying by 2^-23 and dividing by 2^23 are both exact in float32: same bits",
    ),
    Mutant(
        "core-kseq-f-clamp",
        "core",
        "kseq_f",
        "om > 0.0f ? om : 0.0f",
        "om >= 0.0f ? om : 0.0f",
        equivalent="the two differ only at om == 0, where both give 0",
    ),
]


def _sources():
    for top in SEARCH_DIRS:
        for path in sorted((ROOT / top).rglob("*")):
            if path.suffix in PY_SUFFIXES + CPP_SUFFIXES and path.is_file():
                yield path


def _py_span(text: str, name: str) -> list[tuple[int, int]]:
    """Character spans of every def / async def called name (nested ones included)."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return [
        (starts[node.lineno - 1], starts[node.end_lineno])
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name
    ]


def _cpp_span(text: str, name: str) -> list[tuple[int, int]]:
    """Character spans of C++ function definitions called name: the name, its (...) and a {...} body."""
    spans = []
    for match in re.finditer(rf"\b{re.escape(name)}\s*\(", text):
        depth, i = 0, match.end() - 1
        while i < len(text):  # the parameter list
            depth += text[i] == "("
            depth -= text[i] == ")"
            i += 1
            if depth == 0:
                break
        rest = re.match(r"[\s\w:&*]*\{", text[i:])  # const / noexcept ... then the body
        if not rest:
            continue  # a call or a declaration
        j, depth = i + rest.end() - 1, 0
        while j < len(text):
            depth += text[j] == "{"
            depth -= text[j] == "}"
            j += 1
            if depth == 0:
                break
        line_start = text.rfind("\n", 0, match.start()) + 1
        spans.append((line_start, j))
    return spans


def locate(mutant: Mutant, root: Path = ROOT) -> tuple[Path, int]:
    """(file, offset of the pattern) of the mutant, or ValueError saying what was not found."""
    hits, defined = [], []
    for path in _sources():
        path = root / path.relative_to(ROOT)
        text = path.read_text()
        if mutant.function not in text:
            continue
        spans = _py_span(text, mutant.function) if path.suffix in PY_SUFFIXES else _cpp_span(text, mutant.function)
        for start, end in spans:
            defined.append(path)
            body = text[start:end]
            at = body.find(mutant.pattern)
            while at >= 0:
                hits.append((path, start + at))
                at = body.find(mutant.pattern, at + 1)
    if not defined:
        raise ValueError(f"{mutant.name}: no function named {mutant.function!r} under {', '.join(SEARCH_DIRS)}")
    if len(hits) != 1:
        where = ", ".join(str(p.relative_to(root)) for p in sorted(set(defined)))
        raise ValueError(f"{mutant.name}: {mutant.pattern!r} occurs {len(hits)} times in {mutant.function} ({where})")
    return hits[0]


def scratch_copy() -> Path:
    """A copy of the working tree (tracked and untracked files that git does not ignore)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    dest = Path(tempfile.mkdtemp(prefix="specdec-mutation-"))
    for name in filter(None, files):
        src = ROOT / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())
    return dest


def _pytest(copy: Path, tests: list[str], slow: bool, keyword: str | None, jobs: int, env: dict) -> str | None:
    """The id of the first failing test, or None when all pass (or none was collected)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-rfE", "-p", "no:cacheprovider", "-n", str(jobs)]
    cmd += ["-m", "slow" if slow else "not slow"] + (["-k", keyword] if keyword else []) + tests
    run = subprocess.run(cmd, cwd=copy, env=env, capture_output=True, text=True)
    if run.returncode in (0, 5):  # passed / nothing collected
        return None
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, re.M)
    return failed[0] if failed else f"pytest exit {run.returncode}: {run.stdout[-300:]}"


def check(mutant: Mutant, copy: Path, jobs: int, fast_only: bool, cache: Path) -> str:
    path, offset = locate(mutant, copy)
    original, stamp = path.read_text(), path.stat()
    path.write_text(original[:offset] + mutant.replacement + original[offset + len(mutant.pattern) :])
    env = dict(os.environ, SPECDEC_BUILD_DIR=str(cache), SPECDEC_REQUIRE_CPU_BUILD="1", SPECDEC_TEST_THREADS="1")
    env.pop("PYTHONPATH", None)
    try:
        fast, slow = GROUPS[mutant.group]
        killer = _pytest(copy, fast, False, FAST_FILTER.get(mutant.group), jobs, env)
        if killer is None and not fast_only and slow:  # (no slow files: not the whole slow suite)
            killer = _pytest(copy, slow, True, SLOW_FILTER.get(mutant.group), jobs, env)
    finally:  # the original text and time stamp: the unmutated native build stays up to date
        path.write_text(original)
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    return f"KILLED by {killer}" if killer else "SURVIVED"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="locate and list the mutants, run nothing")
    parser.add_argument("--fast-only", action="store_true", help="skip the slow statistical tests")
    parser.add_argument("--jobs", type=int, default=0, help="pytest -n (default 0: one process)")
    parser.add_argument("--cache", default=str(ROOT / "build" / "mutation_cache"), help="native build cache")
    args = parser.parse_args(argv)
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants: {sorted(unknown)}")
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    lost = []
    for m in chosen:
        try:
            path, offset = locate(m)
        except ValueError as exc:  # moved or rewritten code: say which mutant needs updating
            lost.append(m.name)
            print(f"NOT FOUND {exc}")
            continue
        line = path.read_text().count("\n", 0, offset) + 1
        tag = f"EQUIVALENT: {m.equivalent}" if m.equivalent else m.group
        print(f"{m.name:20s} {path.relative_to(ROOT)}:{line} {m.function}: {m.pattern!r} -> {m.replacement!r} [{tag}]")
    if args.list or lost:
        return 1 if lost else 0
    copy = scratch_copy()
    results = {}
    try:
        for m in chosen:
            if m.equivalent:
                continue
            start = time.time()
            results[m.name] = check(m, copy, args.jobs, args.fast_only, Path(args.cache))
            print(f"{m.name:20s} {results[m.name]}  ({time.time() - start:.0f} s)", flush=True)
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    killed = sum(r.startswith("KILLED") for r in results.values())
    print(
        f"\nkilled {killed} of {len(results)} non-equivalent mutants; equivalent (not run): "
        f"{', '.join(m.name for m in chosen if m.equivalent) or 'none'}"
    )
    return 0 if killed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
