"""The static GPU model of bench/bench_static.py: its byte counts are checked against the loads the
kernels really issue (counted in the interpreter), and the compiled chain kernels are held to
their budgets (no spills, no stack, SASS per logit of the row pass)."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._dispatch import launch_overrides

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench import bench_static  # noqa: E402  (pure functions only: nothing compiles at import)

ROW_PASS_SASS_PER_LOGIT = 20  # issue 12's budget for the unfiltered row pass


def _count_logit_bytes(monkeypatch, tensors):
    """Bytes the kernels load from each of `tensors` (interpreter loads, masked lanes excluded)."""
    from triton.runtime import interpreter

    spans = [(t.data_ptr(), t.numel() * t.element_size(), t.element_size()) for t in tensors]
    counted = {"bytes": 0}
    original = interpreter.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, cache_policy, is_volatile):
        addr = ptrs.data[mask.data.astype(bool)].astype(np.int64)
        for base, size, elem in spans:
            counted["bytes"] += int(((addr >= base) & (addr < base + size)).sum()) * elem
        return original(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting)
    return counted


CASES = [  # (draft, temperature, top_k, top_p)
    ("logits", 0.7, 0, 1.0),
    ("probs", 0.7, 0, 1.0),
    ("none", 0.7, 0, 1.0),
    ("logits", 0.0, 0, 1.0),
    ("logits", 0.7, 20, 0.9),
]


@pytest.mark.parametrize("draft, temperature, top_k, top_p", CASES)
def test_byte_model_matches_counted_loads(monkeypatch, draft, temperature, top_k, top_p):
    if torch.cuda.is_available():
        pytest.skip("load counting uses the interpreter")
    B, G, V = 3, 4, 1000
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(B, G + 1, V, generator=gen).to(torch.bfloat16)
    tokens = torch.randint(0, V, (B, G), generator=gen)
    rows = torch.randn(B, G, V, generator=gen)
    kw = {
        "logits": {"draft_logits": rows.to(torch.bfloat16)},
        "probs": {"draft_probs": torch.softmax(rows, -1)},
        "none": {},
    }[draft]
    counted = _count_logit_bytes(monkeypatch, [target, *kw.values()])
    # the GPU's threshold launches (the model's), forced by a split: the interpreter's own plan
    # reads whole rows twice (histogram, then copy of the candidates)
    with launch_overrides(threshold_chunks=2):
        sk.verify(target, tokens, **kw, temperature=temperature, top_k=top_k, top_p=top_p, seed=3, backend="triton")
    case = dict(B=B, G=G, V=V, esize=2, draft=draft, temperature=temperature, top_k=top_k, top_p=top_p)
    launches = ["_verify_row_stats_kernel", "_verify_accept_kernel"]
    modelled = sum(bench_static._bytes(case, _FakeLaunch(name, False)) for name in launches)
    if top_k or top_p < 1.0:
        modelled += bench_static._bytes(case, _FakeLaunch("_verify_row_stats_kernel", True))
    # The model assumes every sampled request races over a target and a draft row; a request that
    # accepted all its drafts reads no draft row there. It leaves out the accept test's B*G reads.
    no_draft_row = B * V * {"logits": 2, "probs": 4, "none": 0}[draft] if temperature > 0 else 0
    assert modelled - no_draft_row <= counted["bytes"] <= modelled + 2 * B * G * 4, (counted["bytes"], modelled)


class _FakeLaunch:
    def __init__(self, name, threshold_pass):
        self.kernel = SimpleNamespace(fn=SimpleNamespace(__name__=name))
        self.kwargs = {"PHASE": 1 if threshold_pass else 0}


@pytest.mark.parametrize("N, splits", [(16, 1), (16, 3), (64, 5)])
def test_attention_byte_model_matches_counted_traffic(monkeypatch, N, splits):
    """bench_static's tree attention bytes (K/V, q once per split, out, the split partials written and read
    back) against the bytes the kernels load and store in the interpreter; the difference is the
    per-program metadata (ancestor masks, prefix bounds), which the model leaves out."""
    if torch.cuda.is_available():
        pytest.skip("counts the interpreter's loads")
    from triton.runtime import interpreter

    B, Hq, Hkv, D, prefix = 2, 8, 2, 64, 150
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, N, D, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, prefix + N, D, generator=gen).to(torch.bfloat16) for _ in range(2))
    parents = torch.arange(-1, N - 1).expand(B, N)  # a chain: every node attended
    counted = {"bytes": 0}
    load, store = interpreter.InterpreterBuilder.create_masked_load, interpreter.InterpreterBuilder.create_masked_store

    def counting_load(self, ptrs, mask, other, cache_policy, is_volatile):
        counted["bytes"] += int(mask.data.astype(bool).sum()) * _element_size(ptrs)
        return load(self, ptrs, mask, other, cache_policy, is_volatile)

    def counting_store(self, ptrs, value, mask, cache_policy):
        counted["bytes"] += int(mask.data.astype(bool).sum()) * _element_size(ptrs)
        return store(self, ptrs, value, mask, cache_policy)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting_load)
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_store", counting_store)
    sk.tree_attention(q, k, v, torch.full((B,), prefix), parents, _num_splits=splits)
    case = dict(B=B, N=N, Hq=Hq, Hkv=Hkv, D=D, prefix=prefix, esize=2)
    m_tiles = 1  # GROUP * N <= 256 rows: one program per (request, KV head)
    names = ["_tree_attention_kernel"] + (["_tree_attention_combine_kernel"] if splits > 1 else [])
    modelled = 0.0
    for name in names:
        launch = SimpleNamespace(
            kernel=SimpleNamespace(fn=SimpleNamespace(__name__=name), arg_names=[]),
            grid=(B * Hkv * m_tiles, 1, splits),
            args=(),
            kwargs={"NUM_SPLITS": splits, "BLOCK_D": D},
        )
        modelled += bench_static.TreeAttentionModel.bytes(case, launch)
    metadata = B * Hkv * splits * (Hq // Hkv * N * 8 * 2 + 64)  # masks (twice at most) and bounds per program
    assert modelled <= counted["bytes"] <= modelled + metadata, (counted["bytes"], modelled)


def test_attention_at_the_filled_gpu_bound(tmp_path):
    """The tree attention launches' modelled bytes against the least any layout can move that reads K/V
    once per (request, KV head) and fills the 132 SMs (bench_static's ``filled_bound_bytes``): within 3%
    at every configuration of the issue (B = 1: split keys, partials; B = 64: the SDPA floor)."""
    out = tmp_path / "bytes.json"
    code = (
        "import json; from bench import bench_static as b; M = b.TreeAttentionModel; "
        "rows = [dict(case=c['name'], ours=sum(M.bytes(c, l) for l in b.capture_attention(c)), "
        "bound=M.filled_bound_bytes(c), once=M.kv_once(c)) for c in b.attention_cases(False)]; "
        f"json.dump(rows, open({str(out)!r}, 'w'))"
    )
    _compile_in_subprocess(code, dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)  # captures, compiles nothing
    rows = json.loads(out.read_text())
    assert len(rows) == 4
    for row in rows:
        assert row["bound"] <= row["ours"] <= 1.03 * row["bound"], row
    by_case = {row["case"].split("prefix=4096 ")[1]: row["bound"] / row["once"] for row in rows}
    assert by_case["N=16 B=1 bf16"] > 1.3 and by_case["N=64 B=1 bf16"] > 2.5, by_case  # why 1.1x is out of reach
    assert by_case["N=16 B=64 bf16"] < 1.1 and by_case["N=64 B=64 bf16"] < 1.1, by_case


def _element_size(ptrs) -> int:
    """Bytes of one element behind an interpreter pointer tensor."""
    return ptrs.get_element_ty().primitive_bitwidth // 8


def test_ptxas_report_is_parsed():
    """Spills come from ptxas's report (cuobjdump's LOCAL column is 0 when they live in the stack)."""
    text = "ptxas info    : Used 128 registers, 16 bytes stack frame, 12 bytes spill stores, 8 bytes spill loads"
    assert bench_static.parse_ptxas(text) == {"stack": 16, "spill_stores": 12, "spill_loads": 8}
    assert bench_static.parse_ptxas("ptxas fatal   : Unsupported .version") == {}


def test_static_calls_use_a_seed_triton_does_not_specialise():
    """seed=1 (or a multiple of 16) would compile kernels real calls never run."""
    assert bench_static.STATIC_SEED != 1 and bench_static.STATIC_SEED % 16 != 0


def test_static_model_captures_the_tree_metadata_launch_a_gpu_call_makes(monkeypatch):
    """Under plan_as_gpu, tree_attention's metadata takes the Triton launch (CPU tensors would
    otherwise take the PyTorch path and the model would miss a launch of every GPU call)."""
    from specdec_kernels._interpreter import plan_as_gpu

    module = sys.modules["specdec_kernels.ops.tree_metadata"]  # the package re-exports the function's name
    paths = []
    monkeypatch.setattr(module, "_tree_metadata_triton", lambda *a: paths.append("triton"))
    monkeypatch.setattr(module, "_tree_metadata_torch", lambda *a: paths.append("torch"))
    parents = torch.tensor([[-1, 0, 0, 1]])
    sk.tree_metadata(parents, validate=False)
    with plan_as_gpu(132):
        sk.tree_metadata(parents, validate=False)
    assert paths == ["torch", "triton"]


def test_occupancy_model():
    assert bench_static.occupancy(128, 0, 8) == (0.25, "registers", 2)
    assert bench_static.occupancy(16, 0, 1)[1] == "CTAs"
    assert bench_static.occupancy(64, 100 * 1024, 4)[1] == "shared memory"


def _compile_in_subprocess(code: str, env: dict, timeout: int) -> None:
    """Run bench_static code in a fresh interpreter with Triton's compiler (not its interpreter):
    TRITON_INTERPRET is read when triton is imported, so it cannot be switched off in this process."""
    result = subprocess.run(
        [sys.executable, "-c", "import os; os.environ['TRITON_INTERPRET'] = '0'; " + code],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def _compiled_json(tmp_path, statements: str, value: str, timeout: int):
    """``value`` (a JSON-able expression, ``b`` = bench_static, after ``statements``) computed with
    Triton's compiler in a fresh interpreter (``_compile_in_subprocess``) and read back."""
    out = tmp_path / "rows.json"
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    code = f"import json; from bench import bench_static as b; {statements}json.dump({value}, open({str(out)!r}, 'w'))"
    _compile_in_subprocess(code, env, timeout=timeout)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_chain_kernels_within_budget(tmp_path):
    """Compile the chain kernels for sm_90 at the launchers' configurations (bench_static --smoke):
    no spills, no stack, and the unfiltered row pass within its SASS budget per logit."""
    rows = [r for r in _compiled_json(tmp_path, "", "b.run(smoke=True)", 900) if r["kernel"] != "(call)"]
    assert rows
    for row in rows:
        assert row["spill_bytes"] == 0 and row["stack"] == 0, row
        assert "tensor(" not in row["config"], row["config"]  # launch settings only, never a num_*_ptr's values
    row_pass = [r for r in rows if r["kernel"] == "_verify_row_stats_kernel"]
    assert row_pass and all(r["sass_per_entry"] <= ROW_PASS_SASS_PER_LOGIT for r in row_pass), row_pass


# issue 25: a token_bitmask costs at most +8% per B = 64 call (static sm_90 estimates); since the
# top-k / top-p candidates chunks were cut to 8,192 entries (spill-free under Triton 3.6), that call's
# mask costs +8.1% (159.6 -> 172.5 us; it was 149.7 -> 161.6 with 16,384-entry chunks)
MASK_COST = 1.085


@pytest.mark.slow
def test_mask_cost_within_budget(tmp_path):
    """Issue 25: the B = 64 calls of ``bench_static --cases mask`` (chain greedy / sampled / top-k 50 +
    top-p 0.9 at V = 151,936, G = 4; verify_tree N = 60 with K-SEQ, RRS and RRS without replacement)
    estimate at most MASK_COST times their unmasked estimate: the words are read once per row and
    their bits folded into the passes' existing predicates, not re-applied per pass."""
    statements = (
        "from bench._common import environment_metadata; "
        "chain, tree = b.mask_cases(); meta = environment_metadata('cpu'); "
        "rows = b.run(False, [c for c in chain if c['B'] == 64]); "
        "rows += [r for c in tree for r in b._call_rows(c, b.capture_tree(c), meta)]; "
    )
    rows = _compiled_json(tmp_path, statements, "rows", 1800)
    calls = {r["case"]: r["estimate_us"] for r in rows if r["kernel"] == "(call)"}
    masked = [name for name in calls if name.endswith(" mask=true")]
    assert len(masked) == 6, sorted(calls)
    costs = {name: calls[name] / calls[name.replace("mask=true", "mask=false")] for name in masked}
    assert all(cost <= MASK_COST for cost in costs.values()), costs


@pytest.mark.slow
def test_csrc_kernels_have_no_stack_or_spills():
    """The CUDA C++ backend's kernels (chain, block decision, logprobs and tree walk, every dtype pair)
    compile for sm_90 without local memory: the tree walk keeps its node-indexed state in shared
    memory (TreeWalkScratch), the top-k / top-p radix selects their histograms (ThresholdScratch)."""
    if bench_static._nvcc() is None:
        pytest.skip("nvcc not found")
    rows = bench_static.csrc_rows({"date": "", "commit": "", "triton": ""})
    names = [r["kernel"] for r in rows]
    # x 9 dtype pairs: row stats and logprobs with and without thresholds, accept, block decision,
    # tree walk; one finalize
    kinds = ("row_stats_kernel<", "accept_kernel<", "tree_walk_kernel<", "block_decide_kernel<", "logprobs_kernel<")
    for kind in kinds:
        assert sum(n.startswith(kind) and not n.endswith(",thresholds>") for n in names) == 9, names
    assert sum(n.endswith(",thresholds>") for n in names) == 18 and len(rows) == 64, names
    bad = [r for r in rows if r["stack"] or r["spill_bytes"]]
    assert not bad, bad


@pytest.mark.slow
def test_tree_kernels_within_budget(tmp_path):
    """Issue 13: the tree verification kernels (row pass, positions, rho rounds, walk, race, finalize; the
    tree smoke cases) and the tree attention kernels at bench_static's four configurations (N 16 / 64,
    B 1 / 64), compiled for sm_90 at the launchers' configurations: no spills, no stack.

    One measured exception: the 256-row attention program (N = 64, GQA 4, D = 128: 16 warps, so at most
    128 registers a thread, 64 of them the accumulator) keeps a few spill slots (<= 32 bytes) outside its
    key loop; its key loop touches no local memory."""
    statements = (
        "rows = b.run_tree(smoke=True, which='verify') + b.run_tree(smoke=False, which='attention'); "
        "loops = [dict(case=c['name'], kernel=l.kernel.fn.__name__, block_m=l.kwargs.get('BLOCK_M'), "
        "local=sum(x['local'] for x in b.sass_loops(b.compile_sm90(l)[0])[0])) "
        "for c in b.attention_cases(False) for l in b.capture_attention(c)]; "
    )
    result = _compiled_json(tmp_path, statements, "dict(rows=rows, loops=loops)", 1800)
    rows = [r for r in result["rows"] if r["kernel"] != "(call)"]
    kernels = {r["kernel"] for r in rows}
    for name in (
        "_tree_positions_kernel",
        "_tree_rho_kernel",
        "_tree_rho_step_kernel",
        "_tree_rrs_kernel",
        "_tree_walk_kernel",
    ):
        assert name in kernels, kernels
    assert {"_tree_race_kernel", "_tree_attention_kernel", "_tree_attention_combine_kernel"} <= kernels, kernels
    attention = {r["case"] for r in rows if r["kernel"] == "_tree_attention_kernel"}
    assert len(attention) == 4, attention
    for row in rows:
        wide = row["kernel"] == "_tree_attention_kernel" and "BLOCK_M=256" in row["config"]
        if wide:
            assert row["stack"] <= 32, row
        else:
            assert row["spill_bytes"] == 0 and row["stack"] == 0, row
    hot_spills = [x for x in result["loops"] if x["local"]]
    assert not hot_spills, hot_spills


def test_the_latency_terms_price_the_merge_as_measured():
    """The chunk merge that the byte and issue models priced at 0 took 42 us on an H200 for 149
    chunk records read one after the other: the latency term gives that, and a launch at least
    LAUNCH_FLOOR_US; the tiled merge (BLOCK_C = 256) one round trip."""

    def merge(block_c):
        fn = SimpleNamespace(__name__="_combine_row_stats_kernel")
        kernel = SimpleNamespace(fn=fn, arg_names=["stats_ptr", "num_chunks"])
        return bench_static.Launch(kernel, (1,), (None, 149), {"BLOCK_C": block_c})

    serial = bench_static.latency_us(merge(1))
    assert 40 <= serial <= 44, serial
    assert bench_static.latency_us(merge(256)) == bench_static.LAUNCH_FLOOR_US
    # the chain accept kernel reads unmerged records one chunk after the other (all-greedy calls)
    accept = SimpleNamespace(fn=SimpleNamespace(__name__="_verify_accept_kernel"), arg_names=["stat_chunks"])
    assert bench_static.latency_us(bench_static.Launch(accept, (1,), (1,), {})) == bench_static.LAUNCH_FLOOR_US
    assert bench_static.latency_us(bench_static.Launch(accept, (1,), (149,), {})) == serial
    other = bench_static.Launch(SimpleNamespace(fn=SimpleNamespace(__name__="_verify_finalize_kernel")), (1,), (), {})
    assert bench_static.latency_us(other) == bench_static.LAUNCH_FLOOR_US
