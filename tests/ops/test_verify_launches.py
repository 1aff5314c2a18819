"""The call path of sk.verify: three kernel launches, no other device work, no host sync.

On CPU we count launches by wrapping the interpreter's launcher and record every aten op with a
dispatch mode: with validate=False only allocations (aten.empty*) may run besides the kernels,
so nothing can synchronise and the call is CUDA-graph capturable (checked for real on GPU).
"""

import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import specdec_kernels as sk
from specdec_kernels._dispatch import launch_overrides

from ._inputs import make_problem


class _RecordOps(TorchDispatchMode):
    """Records aten ops, except inside kernel launches (the interpreter copies tensors there)."""

    def __init__(self):
        super().__init__()
        self.ops = []
        self.in_kernel = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel:
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _count_launches(monkeypatch, recorder):
    from triton.runtime import interpreter

    launches = []
    original = interpreter.InterpretedFunction.run

    def counting_run(self, *args, **kwargs):
        launches.append(self.fn.__name__)
        recorder.in_kernel = True
        try:
            return original(self, *args, **kwargs)
        finally:
            recorder.in_kernel = False

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting_run)
    return launches


@pytest.mark.parametrize("two_launch_thresholds", [False, True])
@pytest.mark.parametrize("per_request", [False, True])
@pytest.mark.parametrize("mode", ["logits", "probs", "ngram"])
def test_three_launches_and_no_other_device_work(monkeypatch, mode, per_request, two_launch_thresholds):
    """Three kernels (more with top-k / top-p: the threshold phases run the row-stats kernel before
    the statistics pass - once, whole rows per program, in the interpreter's plan; twice,
    candidates per chunk then selection per row, in the GPU's plan, forced here by a threshold
    split) and no other device work (no fills, copies or syncs)."""
    if torch.cuda.is_available():
        pytest.skip("launch counting uses the interpreter")
    B, G, V = 4, 3, 50
    target, tokens, draft = make_problem(B, G, V)
    kw = {"logits": {"draft_logits": draft}, "probs": {"draft_probs": torch.softmax(draft, -1)}, "ngram": {}}[mode]
    if per_request:
        kw.update(
            temperature=torch.tensor([0.0, 0.5, 1.0, 2.0]),
            top_k=torch.tensor([0, 3, 0, 10]),
            top_p=torch.tensor([1.0, 0.9, 0.5, 1.0]),
            num_draft_tokens=torch.tensor([3, 0, 2, 1]),
            seed=torch.arange(B),
        )
    else:
        kw.update(temperature=0.8, top_p=0.9, seed=5)
    recorder = _RecordOps()
    launches = _count_launches(monkeypatch, recorder)
    split = launch_overrides(threshold_chunks=2) if two_launch_thresholds else contextlib.nullcontext()
    with recorder, split:
        sk.verify(target, tokens, validate=False, **kw)
    # (candidates, selection or whole rows), statistics: both calls filter
    passes = ["_verify_row_stats_kernel"] * (3 if two_launch_thresholds else 2)
    assert launches == [*passes, "_verify_accept_kernel", "_verify_finalize_kernel"]
    assert set(recorder.ops) <= {"aten.empty", "aten.empty_strided"}, recorder.ops


@pytest.mark.parametrize("mask", [False, True])
def test_greedy_row_pass_reads_max_and_argmax_only(monkeypatch, mask):
    """An all-greedy call (scalar temperature 0) launches the row pass argmax-only: no draft row
    (DRAFT_NONE), no sum-exp, no threshold phases even with top-k / top-p given; the first index of
    a row max repeated across tiles and chunks still wins, as in the reference."""
    if torch.cuda.is_available():
        pytest.skip("launch recording uses the interpreter")
    from triton.runtime import interpreter

    B, G, V = 3, 2, 70
    target, tokens, draft = make_problem(B, G, V)
    top = target.amax(-1, keepdim=True) + 1.0
    target[..., 37] = target[..., 9] = top[..., 0]  # tiles 0 and 2 of 16 entries, chunks 0 and 1
    target[1, 1, 5] = top[1, 1, 0] + 1.0  # one row's max elsewhere
    tokens[:, 0] = 9
    bitmask = torch.full((B, G + 1, 3), -1, dtype=torch.int32) if mask else None
    if mask:
        bitmask[0, 0, 0] = ~(1 << 9)  # row (0, 0): column 9 disallowed, 37 wins
    launches = []
    original = interpreter.InterpretedFunction.run

    def recording_run(self, *args, **kwargs):
        launches.append((self.fn.__name__, kwargs))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    kw = dict(draft_logits=draft, temperature=0.0, top_k=3, top_p=0.5, token_bitmask=bitmask)
    with launch_overrides(num_chunks=2, block_v=16):
        out = sk.verify(target, tokens, validate=False, backend="triton", **kw)
    row_pass = [k for name, k in launches if name == "_verify_row_stats_kernel"]
    assert len(row_pass) == 1 and row_pass[0]["ARGMAX_ONLY"] and row_pass[0]["DRAFT_MODE"] == 0
    ref = sk.verify(target, tokens, validate=False, backend="torch", **kw)
    assert torch.equal(out.tokens, ref.tokens) and torch.equal(out.num_accepted, ref.num_accepted)


@pytest.mark.gpu
def test_cuda_graph_capture_replays_exactly():
    B, G, V = 8, 4, 32000
    target, tokens, draft = make_problem(B, G, V, dtype=torch.bfloat16, device="cuda")
    seeds = torch.arange(B, device="cuda", dtype=torch.int64)
    temperature = torch.full((B,), 0.8, device="cuda")
    eager = sk.verify(target, tokens, draft, temperature=temperature, seed=seeds, validate=False)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compiles) outside the capture
        sk.verify(target, tokens, draft, temperature=temperature, seed=seeds, validate=False)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sk.verify(target, tokens, draft, temperature=temperature, seed=seeds)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.tokens, eager.tokens)
    seeds += 1000  # new randomness without re-capturing
    graph.replay()
    fresh = sk.verify(target, tokens, draft, temperature=temperature, seed=seeds, validate=False)
    assert torch.equal(captured.tokens, fresh.tokens)


@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("V", [32000, 151936])
def test_gpu_plan_fills_an_h100(B, V):
    """Launch plan on a GPU with 132 SMs (computed from shapes, no GPU needed): the row pass has
    >= 132 programs and the accept kernel >= 66, also at B = 1 (vocabulary chunks)."""
    from specdec_kernels._validation import check_verify_args
    from specdec_kernels.ops.triton.chain import gpu_plan

    G = 4
    target = torch.empty(B, G + 1, V, device="meta", dtype=torch.bfloat16)
    tokens = torch.empty(B, G, dtype=torch.int64, device="meta")
    args = check_verify_args(target, tokens, target[:, :G], None, 0.7, 0, 1.0, None, 1, validate=False)
    plan = gpu_plan(args, sms=132)
    rows = B * (G + 1)
    assert -(-rows // plan.block_r) * plan.num_chunks >= 132
    assert -(-B // plan.block_b) * plan.num_chunks >= 66
    assert plan.chunk_size % plan.block_v == 0 and (plan.num_chunks - 1) * plan.chunk_size < V
