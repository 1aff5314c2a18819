"""sk.verify against the reference: exact token ids on shared random numbers, bad input, invariance."""

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._dispatch import launch_overrides
from specdec_kernels.ops.triton import chain
from specdec_kernels.ops.triton.chain import GREEDY_INLINE_CHUNKS
from specdec_kernels.reference import verify_reference

from ._inputs import make_problem

MODES = ["greedy", "logits", "probs", "ngram"]


def _mode_kwargs(mode, draft):
    if mode == "logits" or mode == "greedy":
        return {"draft_logits": draft}
    if mode == "probs":
        return {"draft_probs": torch.softmax(draft.float(), dim=-1)}
    return {}


def _assert_same(out, ref):
    assert out.tokens.dtype == torch.int64 and out.num_accepted.dtype == torch.int32
    assert torch.equal(out.num_accepted.cpu(), ref.num_accepted.cpu())
    assert torch.equal(out.tokens.cpu(), ref.tokens.cpu())
    assert torch.equal(out.nonfinite.cpu(), ref.nonfinite.cpu())


def _check_tokens_well_formed(out, B, G, V):
    n = out.num_accepted.cpu()
    toks = out.tokens.cpu()
    assert toks.shape == (B, G + 1)
    for b in range(B):
        k = int(n[b])
        assert 0 <= k <= G
        assert ((toks[b, : k + 1] >= 0) & (toks[b, : k + 1] < V)).all()
        assert (toks[b, k + 1 :] == -1).all()


@pytest.mark.parametrize("V", [111, 1000, 32000])
@pytest.mark.parametrize("G", [0, 1, 5])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(V, G, mode, device):
    B = 6 if V < 32000 else 3
    target, tokens, draft = make_problem(B, G, V, device=device, seed=V + G)
    temperature = 0.0 if mode == "greedy" else 1.0
    if mode == "greedy" and G > 0:  # make greedy acceptance likely: drafts = target argmax mostly
        tokens = torch.where(torch.rand(B, G, device=device) < 0.8, target[:, :G].argmax(-1), tokens)
    seeds = torch.arange(B, dtype=torch.int64, device=device) * 1000 + G
    kw = dict(_mode_kwargs(mode, draft), temperature=temperature, seed=seeds)
    out = sk.verify(target, tokens, **kw)
    _check_tokens_well_formed(out, B, G, V)
    _assert_same(out, verify_reference(target, tokens, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
def test_dtypes_ragged_and_per_request_params(dtype, mode, device):
    B, G, V = 8, 4, 1000
    target, tokens, draft = make_problem(B, G, V, dtype=dtype, device=device, seed=7)
    n = torch.tensor([0, 1, 4, 2, 3, 4, 0, 1], device=device)
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 0.5, 2.0, 1.0, 0.9], device=device)
    if mode == "greedy":
        temperature = torch.zeros(B, device=device)
    top_k = torch.tensor([0, 5, 50, 0, 1, 999, 2000, 0], device=device)
    top_p = torch.tensor([1.0, 0.9, 0.5, 1.0, 1.0, 0.3, 0.95, 0.01], device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device) + 11
    kw = dict(
        _mode_kwargs(mode, draft), temperature=temperature, top_k=top_k, top_p=top_p, num_draft_tokens=n, seed=seeds
    )
    out = sk.verify(target, tokens, **kw)
    _check_tokens_well_formed(out, B, G, V)
    assert (out.num_accepted.cpu() <= n.cpu()).all()
    _assert_same(out, verify_reference(target, tokens, **kw))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_chunks", [2, 3])
def test_vocab_split_across_programs(mode, num_chunks, device):
    """The chunked path (small batches on big GPUs) must give the same tokens as one chunk."""
    B, G, V = 5, 3, 1000
    target, tokens, draft = make_problem(B, G, V, device=device, seed=3)
    seeds = torch.arange(B, dtype=torch.int64, device=device) * 3
    kw = dict(_mode_kwargs(mode, draft), temperature=0.0 if mode == "greedy" else 0.8, seed=seeds)
    ref = verify_reference(target, tokens, **kw)
    for chunks in (num_chunks, 1):
        with launch_overrides(num_chunks=chunks, block_v=128):
            _assert_same(sk.verify(target, tokens, **kw), ref)


@pytest.mark.parametrize("num_chunks", [GREEDY_INLINE_CHUNKS, GREEDY_INLINE_CHUNKS + 1, 16])
def test_greedy_chunks_merged_inline_or_by_the_merge_kernel(num_chunks, device, monkeypatch):
    """An all-greedy call: the accept kernel writes the tokens, merging up to GREEDY_INLINE_CHUNKS
    chunks itself (more go through the merge kernel first). Ties across chunks keep the lowest id,
    a NaN row flags its request; per-request temperature 0 (a tensor) takes the general kernels:
    the same tokens."""
    B, G, V = 5, 3, 1000
    target, tokens, draft = make_problem(B, G, V, device=device, seed=7)
    target[1, 2, 600] = target[1, 2, 40] = target[1, 2].max() + 1  # a tie across chunks
    target[3, 1, 17] = float("nan")
    tokens[0, :2] = target[0, :2].argmax(-1)  # accepted drafts
    ref = verify_reference(target, tokens, draft_logits=draft, temperature=0.0)
    launches = []
    real = chain._verify_finalize_kernel
    monkeypatch.setattr(chain, "_verify_finalize_kernel", _Recorder(real, launches))
    with launch_overrides(num_chunks=num_chunks, block_v=64):
        _assert_same(sk.verify(target, tokens, draft_logits=draft, temperature=0.0, backend="triton"), ref)
        assert not launches  # no kernel 3
        zeros = torch.zeros(B, device=device)
        _assert_same(sk.verify(target, tokens, draft_logits=draft, temperature=zeros, backend="triton"), ref)
        assert launches


class _Recorder:
    """A kernel's ``kernel[grid](...)`` that records its launches."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.mark.parametrize("num_chunks, threshold_chunks", [(1, None), (3, None), (1, 1), (3, 1), (1, 3), (3, 7)])
def test_filtered_rows_split_across_programs(num_chunks, threshold_chunks, device):
    """With top-k / top-p the thresholds come first - whole rows per program (the interpreter's
    plan: no threshold split), or candidates of whole rows or of chunks, then the selection among
    them per row (the GPU's plan) - then the statistics pass is split like an unfiltered one: same
    tokens as the reference, per-request filters included."""
    B, G, V = 4, 3, 1000
    target, tokens, draft = make_problem(B, G, V, device=device, seed=4)
    kw = dict(
        draft_logits=draft,
        temperature=torch.tensor([0.0, 0.7, 1.0, 1.3], device=device),
        top_k=torch.tensor([0, 20, 0, 5], device=device),
        top_p=torch.tensor([1.0, 0.9, 0.8, 1.0], device=device),
        seed=torch.arange(B, dtype=torch.int64, device=device) + 11,
    )
    ref = verify_reference(target, tokens, **kw)
    with launch_overrides(num_chunks=num_chunks, block_v=128, threshold_chunks=threshold_chunks):
        _assert_same(sk.verify(target, tokens, **kw), ref)


@pytest.mark.parametrize("threshold_chunks, capacity", [(4, 32), (1, 8)])
def test_filtered_rows_with_few_candidate_slots(threshold_chunks, capacity, device):
    """One group of candidates per chunk (or 8 slots for a whole row): most rows are not decided by
    the candidates and take the bisection over the row inside the selection launch - target and
    draft rows, top-k, top-p and both - with the same tokens as the reference."""
    B, G, V = 4, 3, 500
    target, tokens, draft = make_problem(B, G, V, device=device, seed=6)
    kw = dict(
        draft_logits=draft,
        temperature=torch.tensor([0.9, 0.7, 1.0, 1.3], device=device),
        top_k=torch.tensor([50, 20, 0, 5], device=device),
        top_p=torch.tensor([1.0, 0.9, 0.8, 0.95], device=device),
        seed=torch.arange(B, dtype=torch.int64, device=device) + 21,
    )
    ref = verify_reference(target, tokens, **kw)
    with launch_overrides(threshold_chunks=threshold_chunks, threshold_capacity=capacity):
        _assert_same(sk.verify(target, tokens, **kw), ref)


def test_greedy_ties_break_to_lowest_index(device):
    target = torch.zeros(2, 2, 16, device=device)
    target[:, :, 3] = 5.0
    target[:, :, 9] = 5.0
    tokens = torch.tensor([[3], [9]], device=device)
    out = sk.verify(target, tokens, temperature=0.0)
    assert out.tokens.cpu().tolist() == [[3, 3], [3, -1]]
    assert out.num_accepted.cpu().tolist() == [1, 0]


def test_batch_invariance_and_seed_determinism(device):
    B, G, V = 6, 3, 111
    target, tokens, draft = make_problem(B, G, V, device=device, seed=5)
    seeds = torch.tensor([11, 22, 33, 44, 55, 66], dtype=torch.int64, device=device)
    full = sk.verify(target, tokens, draft, seed=seeds)
    again = sk.verify(target, tokens, draft, seed=seeds)
    assert torch.equal(full.tokens, again.tokens)
    perm = torch.tensor([4, 1, 5, 0, 3, 2], device=device)
    permuted = sk.verify(target[perm], tokens[perm], draft[perm], seed=seeds[perm])
    assert torch.equal(permuted.tokens, full.tokens[perm])
    single = sk.verify(target[2:3], tokens[2:3], draft[2:3], seed=seeds[2:3])
    assert torch.equal(single.tokens[0], full.tokens[2])
    # an int seed is reproducible too
    assert torch.equal(sk.verify(target, tokens, draft, seed=7).tokens, sk.verify(target, tokens, draft, seed=7).tokens)


def test_zero_target_probability_is_never_accepted(device):
    """u is never 0, so a draft whose target probability is 0 is always rejected."""
    B, V = 512, 8
    target = torch.zeros(B, 2, V, device=device)
    target[:, 0, 0] = float("-inf")  # p(0) = 0 at row 0
    tokens = torch.zeros(B, 1, dtype=torch.int64, device=device)
    seeds = torch.arange(B, dtype=torch.int64, device=device)
    for kw in ({}, {"draft_probs": torch.full((B, 1, V), 1.0 / V, device=device)}):
        out = sk.verify(target, tokens, seed=seeds, **kw)
        assert (out.num_accepted == 0).all()
        assert (out.tokens[:, 0] != 0).all()


def test_nan_rows_stay_in_vocab_and_isolated(device):
    B, G, V = 4, 2, 111
    target, tokens, draft = make_problem(B, G, V, device=device, seed=9)
    target[1, 0, 5] = float("nan")
    target[2, :, :] = float("nan")  # a whole request of NaN
    target[3, 1, 7] = float("inf")
    seeds = torch.arange(B, dtype=torch.int64, device=device)
    clean = sk.verify(target[:1], tokens[:1], draft[:1], seed=seeds[:1])
    for kw in ({"temperature": 1.0}, {"temperature": 0.0}):
        out = sk.verify(target, tokens, draft, seed=seeds, **kw)
        _check_tokens_well_formed(out, B, G, V)
        assert out.nonfinite.cpu().tolist()[:3] == [False, True, True]
        _assert_same(out, verify_reference(target, tokens, draft, seed=seeds, **kw))
    assert torch.equal(sk.verify(target, tokens, draft, seed=seeds).tokens[0], clean.tokens[0])
    assert sk.verify(target, tokens, draft, seed=seeds).tokens[2, 0].item() == 0  # no finite logit


def test_empty_batch_and_no_drafts(device):
    out = sk.verify(torch.randn(0, 3, 50, device=device), torch.zeros(0, 2, dtype=torch.int64, device=device))
    assert out.tokens.shape == (0, 3) and out.num_accepted.shape == (0,)
    target = torch.randn(3, 1, 50, device=device)
    out = sk.verify(target, torch.zeros(3, 0, dtype=torch.int64, device=device), temperature=0.0)
    assert out.tokens[:, 0].cpu().tolist() == target[:, 0].argmax(-1).cpu().tolist()
    assert (out.num_accepted == 0).all()


def _base(device):
    target, tokens, draft = make_problem(2, 3, 20, device=device)
    return target, tokens, draft


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda t, x, d: (t[0], x, d, {}), ValueError, "target_logits must have 3 dimensions"),
        (lambda t, x, d: (t, x[:, :2], d, {}), ValueError, r"draft_tokens must have shape \[B, G\]"),
        (lambda t, x, d: (t, x, d[..., :19], {}), ValueError, "V=19 but target_logits has V=20"),
        (lambda t, x, d: (t, x, d[:, :2], {}), ValueError, "draft_logits must have shape"),
        (lambda t, x, d: (t, x.float(), d, {}), TypeError, "draft_tokens has dtype"),
        (lambda t, x, d: (t.double(), x, d, {}), TypeError, "target_logits has dtype"),
        (lambda t, x, d: (t, x, d.int(), {}), TypeError, "draft_logits has dtype"),
        (lambda t, x, d: (t, x + 20, d, {}), ValueError, r"draft_tokens must be in \[0, V=20\)"),
        (lambda t, x, d: (t, x - 21, d, {}), ValueError, r"draft_tokens must be in \[0, V=20\)"),
        (lambda t, x, d: (t, x, d, {"temperature": -0.5}), ValueError, "temperature must be >= 0"),
        (lambda t, x, d: (t, x, d, {"temperature": torch.tensor([1.0, -1.0])}), ValueError, "temperature must be >= 0"),
        (lambda t, x, d: (t, x, d, {"top_p": 0.0}), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda t, x, d: (t, x, d, {"top_p": 1.5}), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda t, x, d: (t, x, d, {"top_p": torch.tensor([0.5, 1.01])}), ValueError, r"top_p must be in \(0, 1\]"),
        (lambda t, x, d: (t, x, d, {"top_k": -1}), ValueError, "top_k must be >= 0"),
        (lambda t, x, d: (t, x, d, {"top_k": torch.tensor([3, -2])}), ValueError, "top_k must be >= 0"),
        (lambda t, x, d: (t, x, d, {"top_k": torch.tensor([1.0, 2.0])}), TypeError, "top_k must be an integer tensor"),
        (
            lambda t, x, d: (t, x, d, {"temperature": torch.ones(3)}),
            ValueError,
            r"temperature must be a scalar or a \[B=2\]",
        ),
        (
            lambda t, x, d: (t, x, d, {"num_draft_tokens": torch.tensor([1, 4])}),
            ValueError,
            r"num_draft_tokens must be in \[0, G=3\]",
        ),
        (
            lambda t, x, d: (t, x, d, {"num_draft_tokens": torch.tensor([-1, 2])}),
            ValueError,
            r"num_draft_tokens must be in \[0, G=3\]",
        ),
        (
            lambda t, x, d: (t, x, d, {"num_draft_tokens": torch.tensor([1.0, 2.0])}),
            TypeError,
            "num_draft_tokens has dtype",
        ),
        (lambda t, x, d: (t, x, d, {"draft_probs": d}), ValueError, "not both"),
        (lambda t, x, d: (t, x, d, {"seed": 1.5}), TypeError, "seed must be"),
        (lambda t, x, d: (t, x, d, {"seed": torch.tensor([1, 2, 3])}), ValueError, r"seed must be an int or a \[B=2\]"),
        (lambda t, x, d: ("logits", x, d, {}), TypeError, "target_logits must be a torch.Tensor"),
        (lambda t, x, d: (t, x, d, {"temperature": "hot"}), TypeError, "temperature must be a float"),
    ],
)
def test_bad_input_raises_clear_errors(change, error, match, device):
    target, tokens, draft, kw = change(*_base(device))
    for fn in (sk.verify, verify_reference):
        with pytest.raises(error, match=match):
            fn(target, tokens, draft, **kw)


def test_ragged_padding_tokens_are_not_validated(device):
    """Draft ids past num_draft_tokens are padding: any value is allowed there."""
    target, tokens, draft = make_problem(2, 3, 20, device=device)
    tokens[0, 1:] = -1
    out = sk.verify(target, tokens, draft, num_draft_tokens=torch.tensor([1, 3], device=device), seed=1)
    assert out.num_accepted[0] <= 1


def test_out_of_range_ids_without_validation_are_placeholders(device):
    """validate=False: an id outside [0, V) ends the draft (engines pad with -1); not an error."""
    target, tokens, draft = make_problem(2, 3, 20, device=device)
    tokens[:, 0] = torch.tensor([25, -4])
    for temperature in (0.0, 1.0):
        out = sk.verify(target, tokens, draft, temperature=temperature, validate=False, seed=3)
        assert (out.num_accepted == 0).all()
        assert ((out.tokens[:, 0] >= 0) & (out.tokens[:, 0] < 20)).all()
        assert not out.nonfinite.any()
        ended = sk.verify(
            target,
            tokens,
            draft,
            temperature=temperature,
            seed=3,
            num_draft_tokens=torch.zeros(2, dtype=torch.long, device=device),
        )
        assert torch.equal(out.tokens[:, 0], ended.tokens[:, 0])  # the same as a draft of length 0


@pytest.mark.gpu
def test_different_devices_rejected():
    target, tokens, draft = make_problem(2, 3, 20, device="cuda")
    with pytest.raises(ValueError, match="is on cpu but target_logits is on cuda"):
        sk.verify(target, tokens.cpu(), draft)


def test_different_devices_rejected_meta():
    """Device mismatch check without a GPU: a meta tensor plays the other device."""
    target, tokens, draft = make_problem(2, 3, 20)
    with pytest.raises(ValueError, match="draft_logits is on meta but target_logits is on cpu"):
        sk.verify(target, tokens, draft.to("meta"))
