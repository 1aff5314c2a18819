"""The CUDA backend's per-row math, tested without a GPU.

csrc/verify_core.h holds every piece of the CUDA kernels' arithmetic (Philox, uniforms, logit
sanitising, online softmax, top-k/top-p radix select, accept test, exponential races) as
__host__ __device__ functions, and the three kernel bodies as "programs" over a thread-block
abstraction. The CPU build (csrc/verify_cpu.cpp, compiled here by the host C++ compiler through
torch.utils.cpp_extension) runs those programs sequentially. These tests compare it token for token
with the Triton kernels and the reference. Skipped when no C++ toolchain can build the extension.
"""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._validation import check_verify_args
from specdec_kernels.reference import verify_reference

from ._inputs import THRESHOLD_SETTINGS, make_problem, reference_thresholds
from .conftest import cpu_core_or_skip

MODES = ["greedy", "logits", "probs", "ngram"]


@pytest.fixture(scope="module")
def core():
    return cpu_core_or_skip()


def _run_core(core, target, tokens, draft_logits=None, *, num_chunks=1, **kw):
    from specdec_kernels.ops import csrc

    args = check_verify_args(
        target,
        tokens,
        draft_logits,
        kw.get("draft_probs"),
        kw.get("temperature", 1.0),
        kw.get("top_k", 0),
        kw.get("top_p", 1.0),
        kw.get("num_draft_tokens"),
        kw.get("seed"),
    )
    return csrc.run_chain(core, args, num_chunks=num_chunks)


def _mode_kwargs(mode, draft):
    if mode in ("logits", "greedy"):
        return {"draft_logits": draft}
    if mode == "probs":
        return {"draft_probs": torch.softmax(draft.float(), dim=-1)}
    return {}


def _assert_same(out, ref):
    assert (
        out.tokens.dtype == torch.int64 and out.num_accepted.dtype == torch.int32 and out.nonfinite.dtype == torch.bool
    )
    assert torch.equal(out.num_accepted, ref.num_accepted.cpu())
    assert torch.equal(out.tokens, ref.tokens.cpu())
    assert torch.equal(out.nonfinite, ref.nonfinite.cpu())


@pytest.mark.parametrize("V", [111, 1000, 32000])
@pytest.mark.parametrize("G", [0, 1, 5])
@pytest.mark.parametrize("mode", MODES)
def test_core_matches_triton_and_reference(core, V, G, mode):
    B = 6 if V < 32000 else 3
    target, tokens, draft = make_problem(B, G, V, seed=V + G)
    if mode == "greedy" and G > 0:
        tokens = torch.where(torch.rand(B, G) < 0.8, target[:, :G].argmax(-1), tokens)
    seeds = torch.arange(B, dtype=torch.int64) * 1000 + G
    kw = dict(_mode_kwargs(mode, draft), temperature=0.0 if mode == "greedy" else 1.0, seed=seeds)
    triton_out = sk.verify(target, tokens, **kw, backend="triton")
    _assert_same(_run_core(core, target, tokens, **kw), triton_out)
    _assert_same(_run_core(core, target, tokens, **kw, num_chunks=3), triton_out)
    if V < 32000:
        _assert_same(triton_out, verify_reference(target, tokens, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_core_dtypes_filters_ragged_per_request(core, dtype, mode):
    B, G, V = 8, 4, 1000
    target, tokens, draft = make_problem(B, G, V, dtype=dtype, seed=7)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.5, 2.0, 1.0, 0.9])
    if mode == "greedy":
        temperature = torch.zeros(B)
    kw = dict(
        _mode_kwargs(mode, draft),
        temperature=temperature,
        top_k=torch.tensor([0, 5, 50, 0, 1, 999, 2000, 0], dtype=torch.int32),
        top_p=torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.3, 0.95, 0.01]),
        num_draft_tokens=torch.tensor([0, 1, 4, 2, 3, 4, 0, 1]),
        seed=torch.arange(B, dtype=torch.int32) + 11,
    )
    _assert_same(_run_core(core, target, tokens, **kw), sk.verify(target, tokens, **kw, backend="triton"))


@pytest.mark.parametrize(
    "kw", [dict(temperature=0.8, top_p=0.9, seed=5), dict(temperature=1.1, top_k=20, seed=123456789123)]
)
@pytest.mark.parametrize("mode", ["logits", "ngram"])
def test_core_scalar_parameters_and_mixed_seeds(core, kw, mode):
    """Scalar seeds are mixed per request in the kernels: the core must mix them identically."""
    B, G, V = 5, 3, 500
    target, tokens, draft = make_problem(B, G, V, seed=13)
    kw = dict(_mode_kwargs(mode, draft), **kw)
    _assert_same(_run_core(core, target, tokens, **kw), sk.verify(target, tokens, **kw, backend="triton"))


def test_core_nonfinite_and_invalid_ids(core):
    B, G, V = 4, 2, 111
    target, tokens, draft = make_problem(B, G, V, seed=9)
    target[1, 0, 5] = float("nan")
    target[2] = float("nan")
    target[3, 1, 7] = float("inf")
    seeds = torch.arange(B, dtype=torch.int64)
    for temperature in (1.0, 0.0):
        kw = dict(draft_logits=draft, temperature=temperature, seed=seeds)
        _assert_same(_run_core(core, target, tokens, **kw), sk.verify(target, tokens, **kw, backend="triton"))
    bad = tokens.clone()
    bad[:, 0] = torch.tensor([25 + V, -4, 3, V])
    for temperature in (0.0, 1.0):
        args = check_verify_args(target, bad, draft, None, temperature, 0, 1.0, None, 3, validate=False)
        from specdec_kernels.ops import csrc

        out = csrc.run_chain(core, args)
        ref = sk.verify(target, bad, draft, temperature=temperature, seed=3, validate=False, backend="triton")
        _assert_same(out, ref)
        # placeholders end the draft at position 0: only rows 0 are used (requests 1 and 2 have NaN there)
        assert out.nonfinite.tolist() == [False, True, True, False]


def test_core_empty_batch_and_no_drafts(core):
    out = _run_core(core, torch.randn(0, 3, 50), torch.zeros(0, 2, dtype=torch.int64))
    assert out.tokens.shape == (0, 3)
    target = torch.randn(3, 1, 50)
    kw = dict(temperature=0.7, seed=torch.arange(3))
    _assert_same(
        _run_core(core, target, torch.zeros(3, 0, dtype=torch.int64), **kw),
        sk.verify(target, torch.zeros(3, 0, dtype=torch.int64), **kw, backend="triton"),
    )


def test_core_strided_target(core):
    """Non-contiguous batch / row strides are read in place."""
    B, G, V = 4, 3, 300
    big, tokens, draft = make_problem(B, G + 2, V, seed=21)
    target = big[:, 1 : G + 2]  # a view: row stride V, batch stride (G + 3) * V
    kw = dict(draft_logits=draft[:, :G], seed=torch.arange(B), temperature=0.9)
    tokens = tokens[:, :G]
    _assert_same(_run_core(core, target, tokens, **kw), sk.verify(target, tokens, **kw, backend="triton"))


# --- the CUDA programs' top-k / top-p thresholds (radix select in verify_core.h) -----------------
# The CPU backend finds thresholds by selection before its row pass; the CUDA row-stats program
# finds them itself by radix select (three digit passes, top-k survivors gathered for top-p). The
# binding runs that program code on one host thread so it is checked here, value for value against
# the reference's sort-based definition.

THRESHOLD_PARAMS = [
    *THRESHOLD_SETTINGS,
    (1.0, 3_000, 0.9),  # more top-k survivors than the 2048 candidate slots: top-p over the row
]


def _program_threshold(core, row, temperature, top_k, top_p):
    return core.filter_threshold_program(row, temperature, top_k, top_p)


def _check_thresholds(core, rows, params=THRESHOLD_PARAMS):
    for t, k, p in params:
        got = torch.tensor([_program_threshold(core, row, t, k, p) for row in rows])
        want = reference_thresholds(rows, [t] * len(rows), [k] * len(rows), [p] * len(rows))
        assert torch.equal(got, want), (rows.dtype, rows.shape, t, k, p, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V", [111, 1000, 5000])
def test_program_thresholds_random_rows(core, dtype, V):
    gen = torch.Generator().manual_seed(V)
    _check_thresholds(core, (torch.randn(3, V, generator=gen) * 3).to(dtype))


def test_program_thresholds_ties_flat_rows_and_minus_inf_runs(core):
    V = 3000
    gen = torch.Generator().manual_seed(4)
    rows = torch.randint(-4, 5, (6, V), generator=gen).float()  # 9 values, ~330 copies each: ties
    rows[1] = 2.5  # all equal: every survivor set is the whole row (> 2048 candidates)
    rows[2, 50:] = float("-inf")  # 50 finite values
    rows[3, :] = float("-inf")
    rows[3, 7] = 0.0  # a single finite value
    rows[4] = -torch.arange(V, dtype=torch.float32)  # all negative, distinct
    rows[5, ::3] = float("nan")  # NaN counts as -inf
    rows[5, 1::3] = torch.linspace(-1, 1, len(range(1, V, 3)))
    _check_thresholds(core, rows)
    _check_thresholds(core, rows.bfloat16())


def test_program_thresholds_extreme_ranges_and_full_vocab(core):
    """fp16 near its limits, bf16 with huge magnitudes, and one Qwen-sized row."""
    gen = torch.Generator().manual_seed(5)
    half = (torch.rand(2, 2000, generator=gen) * 2 - 1) * 65000
    _check_thresholds(core, half.half())
    wide = torch.randn(2, 2000, generator=gen) * 1e30
    _check_thresholds(core, wide.bfloat16())
    big = torch.randn(1, 151_936, generator=gen) * 2
    _check_thresholds(core, big.bfloat16(), [(0.7, 50, 0.9), (1.0, 0, 0.95), (1.0, 20, 1.0)])


def test_program_thresholds_no_filter_and_a_wrong_threshold_is_seen(core):
    x = torch.randn(300)
    for k in (0, 300, 1000):
        assert _program_threshold(core, x, 1.0, k, 1.0) == float("-inf")
    # power: the comparison distinguishes neighbouring logits (a threshold one rank too low)
    ordered = torch.sort(x, descending=True).values
    assert _program_threshold(core, x, 1.0, 5, 1.0) == float(ordered[4]) != float(ordered[5])
