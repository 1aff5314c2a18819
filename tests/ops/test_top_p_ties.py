"""``top_p_ties``: which tokens of the tie group at the top-p boundary stay.

"keep" (default) keeps the whole group; "by_index" is transformers' TopPLogitsWarper: among equal
logits the higher index counts as more probable (its ascending torch.sort, when stable). The
reference's rule is checked against the warper itself on tie-heavy bf16 rows; the vectorized and
Triton backends against the reference token for token (Triton: every threshold plan, the cut
inside the tie group from ``tie_need`` / ``tie_index``) and the CPU build; the CUDA build and
vocabulary shards refuse the rule."""

from unittest import mock

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._dispatch import launch_overrides
from specdec_kernels._params import TOP_P_TIES, SamplingParams
from specdec_kernels.ops.vectorized.chain import processed_probs as vectorized_probs
from specdec_kernels.ops.vectorized.chain import sanitize
from specdec_kernels.reference.sampling import filter_threshold, kept_entries, processed_probs

from ._stats import ALPHA, chi_square_power, chi_square_pvalue

_torch_sort = torch.sort


def _stable_sort(*args, **kwargs):
    return _torch_sort(*args, **{**kwargs, "stable": True})


def _transformers_kept(x: torch.Tensor, temperature: float, top_k: int, top_p: float, stable: bool) -> torch.Tensor:
    """The entries generate's warpers (temperature, top-k, top-p; as generate orders them) keep."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    scores = x[None] / temperature
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    with mock.patch.object(torch, "sort", _stable_sort) if stable else mock.MagicMock():
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores[0] > float("-inf")


def _tie_heavy_row(gen: torch.Generator, V: int) -> torch.Tensor:
    """bf16-rounded logits on a few levels (many exact ties), or bf16-rounded normals."""
    if bool(torch.rand(1, generator=gen) < 0.5):
        levels = int(torch.randint(1, 6, (1,), generator=gen))
        return (torch.randint(0, levels, (V,), generator=gen).float() * 0.75).bfloat16().float()
    return (torch.randn(V, generator=gen) * 2).bfloat16().float()


def test_four_equal_logits():
    """transformers keeps tokens 2 and 3 of four equal logits at top_p = 0.5 (and 1, 2, 3 when a
    small fifth token adds mass below them); "keep" keeps all four."""
    x = torch.zeros(4)
    assert kept_entries(x, 1.0, 0, 0.5, "by_index").tolist() == [False, False, True, True]
    assert torch.equal(kept_entries(x, 1.0, 0, 0.5, "by_index"), _transformers_kept(x, 1.0, 0, 0.5, stable=False))
    assert kept_entries(x, 1.0, 0, 0.5, "keep").all()
    y = torch.tensor([2.0, 2.0, 2.0, 2.0, -1.0])
    assert kept_entries(y, 1.0, 0, 0.5, "by_index").tolist() == [False, True, True, True, False]
    assert torch.equal(kept_entries(y, 1.0, 0, 0.5, "by_index"), _transformers_kept(y, 1.0, 0, 0.5, stable=False))


def test_by_index_is_transformers_top_p_on_tie_heavy_rows():
    """600 random rows: the kept set equals the warper's with a stable sort, and its size equals the
    warper's as shipped (torch.sort is not stable: which equal tokens it keeps is arbitrary)."""
    gen = torch.Generator().manual_seed(0)
    differs_from_keep = 0
    for i in range(600):
        V = int(torch.randint(2, 400, (1,), generator=gen))
        x = _tie_heavy_row(gen, V)
        temperature = (1.0, 0.7, 1.3)[i % 3]
        top_k = int(torch.randint(0, V + 1, (1,), generator=gen)) if i % 4 == 0 else 0
        top_p = float(torch.rand(1, generator=gen)) * 0.98 + 0.01
        ours = kept_entries(x, temperature, top_k, top_p, "by_index")
        assert torch.equal(ours, _transformers_kept(x, temperature, top_k, top_p, stable=True)), (i, x, top_p)
        assert int(ours.sum()) == int(_transformers_kept(x, temperature, top_k, top_p, stable=False).sum())
        differs_from_keep += not torch.equal(ours, kept_entries(x, temperature, top_k, top_p, "keep"))
    assert differs_from_keep > 100  # the rows do exercise the boundary ties


def test_keep_is_todays_rule():
    gen = torch.Generator().manual_seed(1)
    for _ in range(200):
        x = _tie_heavy_row(gen, 50)
        thr = filter_threshold(x, 0.9, 7, 0.6)
        assert torch.equal(kept_entries(x, 0.9, 7, 0.6), (x >= thr) & (x > float("-inf")))
        assert torch.equal(processed_probs(x, 0.9, 7, 0.6), processed_probs(x, 0.9, 7, 0.6, "keep"))


@pytest.mark.parametrize("V", [7, 300, 5000])  # 5000: the partial sort widens past its first 256
def test_vectorized_probabilities_equal_the_reference(V):
    gen = torch.Generator().manual_seed(V)
    R = 8
    x = torch.stack([_tie_heavy_row(gen, V) for _ in range(R)])
    t = torch.tensor([1.0, 0.5, 2.0, 1.0] * 2, dtype=torch.float64)
    top_k = torch.tensor([0, 5, 0, 3, 0, 0, V, 1])
    top_p = torch.rand(R, generator=gen, dtype=torch.float64) * 0.9 + 0.05
    xs, _, m, _ = sanitize(x)
    got = vectorized_probs(xs, m, t, top_k, top_p, True, by_index=True)
    for r in range(R):
        want = processed_probs(x[r], float(t[r]), int(top_k[r]), float(top_p[r]), "by_index")
        assert torch.equal(got[r] > 0, want > 0)
        torch.testing.assert_close(got[r], want, rtol=1e-12, atol=0)


def _chain_inputs(gen, B=4, G=3, V=60, K=None):
    lead = (B,) if K is None else (B, K)
    levels = torch.randint(0, 4, (*lead, G + 1, V), generator=gen).float() * 0.5
    target = levels.bfloat16().float()
    draft = (torch.randint(0, 4, (*lead, G, V), generator=gen).float() * 0.5).bfloat16().float()
    tokens = torch.randint(0, V, (*lead, G), generator=gen)
    return target, tokens, draft


SAMPLED = dict(temperature=0.9, top_k=0, top_p=0.6, top_p_ties="by_index")


@pytest.mark.parametrize("backend", ["vectorized", "auto", "cpu"])
def test_chain_backend_matches_reference(backend):
    gen = torch.Generator().manual_seed(2)
    for seed in range(6):
        target, tokens, draft = _chain_inputs(gen)
        want = sk.verify(target, tokens, draft, backend="torch", seed=seed, **SAMPLED)
        got = sk.verify(target, tokens, draft, backend=backend, seed=seed, **SAMPLED)
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.num_accepted, want.num_accepted)
        probs = torch.softmax(draft, -1)
        want = sk.verify(target, tokens, draft_probs=probs, backend="torch", seed=seed, **SAMPLED)
        got = sk.verify(target, tokens, draft_probs=probs, backend=backend, seed=seed, **SAMPLED)
        assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("backend", ["vectorized", "triton", "cpu"])
@pytest.mark.parametrize("method", ["kseq", "rrs", "rrs_wor"])
def test_multi_and_tree_backends_match_reference(method, backend):
    gen = torch.Generator().manual_seed(3)
    for seed in range(4 if backend == "vectorized" else 2):
        target, tokens, draft = _chain_inputs(gen, K=2)
        if method == "rrs_wor":
            tokens[:, 1, 0] = (tokens[:, 0, 0] + 1) % target.shape[-1]  # distinct siblings
        for kw in ({"draft_logits": draft}, {"draft_probs": torch.softmax(draft, -1)}, {}):
            want = sk.verify_multi(target, tokens, backend="torch", seed=seed, method=method, **kw, **SAMPLED)
            got = sk.verify_multi(target, tokens, backend=backend, seed=seed, method=method, **kw, **SAMPLED)
            assert torch.equal(got.tokens, want.tokens), (seed, list(kw))
    parents = torch.tensor([[-1, 0, 0, 1]] * 2)
    tree_target = (torch.randint(0, 3, (2, 5, 40), generator=gen).float() * 0.5).bfloat16().float()
    tree_tokens = torch.randint(0, 40, (2, 4), generator=gen)
    tree_tokens[:, 2] = (tree_tokens[:, 1] + 1) % 40  # distinct siblings (rrs_wor)
    tree_draft = (torch.randint(0, 3, (2, 4, 40), generator=gen).float() * 0.5).bfloat16().float()
    for kw in ({}, {"draft_logits": tree_draft}):
        want = sk.verify_tree(
            tree_target, tree_tokens, parents, backend="torch", seed=1, method=method, **kw, **SAMPLED
        )
        got = sk.verify_tree(tree_target, tree_tokens, parents, backend=backend, seed=1, method=method, **kw, **SAMPLED)
        assert torch.equal(got.tokens, want.tokens)


# Triton threshold plans: the interpreter's whole rows; the GPU's two launches (candidates per chunk,
# selection per row); a tiny selection tile (the bisection fallback); split row passes.
TRITON_PLANS = {
    "whole": {},
    "two_launch": {"threshold_chunks": 3},
    "bisect": {"threshold_chunks": 2, "threshold_capacity": 16},
    "split_rows": {"num_chunks": 3, "block_v": 64},
}


def _tie_boundary_inputs(gen, B, G, V, dtype):
    """Tie-heavy bf16-rounded rows: few levels (wide tie groups at any top-p boundary) or normals."""
    levels = int(torch.randint(2, 5, (1,), generator=gen))
    target = torch.randint(0, levels, (B, G + 1, V), generator=gen).float() * 0.75
    target[: B // 2] = torch.randn(B // 2, G + 1, V, generator=gen) * 2
    draft = torch.randint(0, levels, (B, G, V), generator=gen).float() * 0.75
    tokens = torch.randint(0, V, (B, G), generator=gen)
    return target.bfloat16().to(dtype), tokens, draft.bfloat16().to(dtype)


def _slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


@pytest.mark.parametrize(
    "plan, V, dtype",
    [
        ("whole", 50, torch.bfloat16),
        ("whole", 300, torch.float32),
        ("two_launch", 50, torch.bfloat16),
        ("bisect", 40, torch.float32),
        ("split_rows", 300, torch.bfloat16),
        _slow("whole", 2100, torch.bfloat16),  # tie_index over several blocks
        _slow("two_launch", 300, torch.float32),
        _slow("two_launch", 2100, torch.bfloat16),
        _slow("bisect", 300, torch.bfloat16),
    ],
)
def test_triton_chain_matches_reference_on_tie_boundaries(plan, V, dtype):
    """Both rules, Triton against the reference token for token: ragged drafts (n_b), per-request
    top-p with top-k, draft logits / probabilities / one-hot, bf16 and fp32 rows. Fails before the
    Triton kernels implemented by_index (ValueError)."""
    _check_chain_tie_boundaries("triton", TRITON_PLANS[plan], V, dtype, small=plan in ("two_launch", "bisect"))


@pytest.mark.parametrize("V, dtype", [(50, torch.bfloat16), (300, torch.float32), (2100, torch.bfloat16)])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_cpu_chain_matches_reference_on_tie_boundaries(V, dtype, num_chunks):
    """The CPU build (thresholds and cuts by selection, rows split into chunks or not)."""
    _check_chain_tie_boundaries("cpu", {"num_chunks": num_chunks}, V, dtype, small=False)


def _check_chain_tie_boundaries(backend, overrides, V, dtype, small):
    gen = torch.Generator().manual_seed(11 + V)
    B, G = (3, 1) if small else (6, 3)
    top_p = torch.tensor([0.3, 0.55, 0.9, 0.7, 1.0, 0.45])[:B]
    top_k = torch.tensor([0, 0, 7, 0, 3, 40])[:B]
    n_b = torch.tensor([3, 0, 2, 3, 1, 3])[:B].clamp(max=G)
    target, tokens, draft = _tie_boundary_inputs(gen, B, G, V, dtype)
    cases = (
        {"draft_logits": draft, "top_p": top_p, "top_k": top_k},
        {"draft_probs": torch.softmax(draft.float(), -1), "top_p": 0.6},
        {"top_p": top_p, "num_draft_tokens": n_b},
        {"draft_logits": draft, "top_p": 0.5, "num_draft_tokens": n_b},
    )
    differs = 0
    for i, kw in enumerate(cases[::3] if small else cases):
        for ties in TOP_P_TIES:
            common = dict(temperature=(0.8, 1.0, 1.3)[i % 3], seed=i, top_p_ties=ties)
            want = sk.verify(target, tokens, backend="torch", **kw, **common)
            with launch_overrides(**overrides):
                got = sk.verify(target, tokens, backend=backend, **kw, **common)
            assert torch.equal(got.tokens, want.tokens), (i, ties)
            assert torch.equal(got.num_accepted, want.num_accepted)
    # the rows do cut inside tie groups (the two rules keep different sets)
    for row, p in zip(target.float().reshape(-1, V), top_p.repeat_interleave(G + 1), strict=True):
        differs += not torch.equal(kept_entries(row, 1.0, 0, float(p), "by_index"), kept_entries(row, 1.0, 0, float(p)))
    assert differs > 0


def test_triton_flattened_layout_by_index():
    """The flattened ragged layout (cu_num_draft_tokens) keeps the rule."""
    gen = torch.Generator().manual_seed(12)
    V, n = 64, torch.tensor([2, 0, 3])
    target, tokens, draft = _tie_boundary_inputs(gen, 3, 3, V, torch.float32)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), n.cumsum(0)])
    flat_t = torch.cat([target[b, : int(n[b]) + 1] for b in range(3)])
    flat_d = torch.cat([draft[b, : int(n[b])] for b in range(3)])
    flat_x = torch.cat([tokens[b, : int(n[b])] for b in range(3)])
    kw = dict(temperature=0.9, top_p=0.5, top_p_ties="by_index", seed=3)
    want = sk.verify(target, tokens, draft, num_draft_tokens=n, backend="torch", **kw)
    got = sk.verify(flat_t, flat_x, flat_d, cu_num_draft_tokens=cu, max_num_draft_tokens=3, backend="triton", **kw)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.parametrize("plan", ["whole", _slow("two_launch"), _slow("bisect"), "cpu"])
def test_triton_tree_matches_reference_on_tie_boundaries(plan):
    gen = torch.Generator().manual_seed(13)
    V = 120
    parents = torch.tensor([[-1, 0, 0, 1, -1, 4]] * 3)
    target = (torch.randint(0, 3, (3, 7, V), generator=gen).float() * 0.75).bfloat16()
    draft = (torch.randint(0, 3, (3, 6, V), generator=gen).float() * 0.75).bfloat16()
    tokens = torch.randint(0, V, (3, 6), generator=gen)
    top_p = torch.tensor([0.4, 0.8, 0.55])
    for method in ("kseq", "rrs", "rrs_wor"):
        for ties in TOP_P_TIES:
            kw = dict(temperature=1.1, top_p=top_p, top_p_ties=ties, seed=5, method=method, draft_logits=draft)
            want = sk.verify_tree(target, tokens, parents, backend="torch", **kw)
            backend, overrides = ("cpu", {}) if plan == "cpu" else ("triton", TRITON_PLANS[plan])
            with launch_overrides(**overrides):
                got = sk.verify_tree(target, tokens, parents, backend=backend, **kw)
            assert torch.equal(got.tokens, want.tokens), (method, ties)


def test_vocabulary_shards_refuse_by_index():
    """process_group= (one gloo rank): by_index is not implemented there; ValueError, never "keep"."""
    import tempfile

    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available() or dist.is_initialized():
        pytest.skip("needs gloo and no default process group")
    gen = torch.Generator().manual_seed(8)
    target, tokens, draft = _chain_inputs(gen)
    with tempfile.NamedTemporaryFile() as store:
        dist.init_process_group("gloo", init_method=f"file://{store.name}", rank=0, world_size=1)
        try:
            group = dist.group.WORLD
            with pytest.raises(ValueError, match="top_p_ties='by_index'.*vocabulary shards"):
                sk.verify(target, tokens, draft, process_group=group, vocab_size=target.shape[-1], seed=0, **SAMPLED)
            with pytest.raises(ValueError, match="top_p_ties='by_index'.*vocabulary shards"):
                sk.verify_multi(
                    target[:, None], tokens[:, None], draft[:, None], process_group=group, seed=0, **SAMPLED
                )
        finally:
            dist.destroy_process_group()


@pytest.mark.parametrize("backend", ["cuda"])
def test_fused_backends_refuse_by_index(backend):
    gen = torch.Generator().manual_seed(4)
    target, tokens, draft = _chain_inputs(gen)
    with pytest.raises(ValueError, match="top_p_ties='by_index'.*backend"):
        sk.verify(target, tokens, draft, backend=backend, seed=0, **SAMPLED)
    with pytest.raises(ValueError, match="top_p_ties='by_index'.*backend"):
        sk.verify_multi(target[:, None], tokens[:, None], draft[:, None], backend=backend, seed=0, **SAMPLED)


def test_rule_without_top_p_runs_anywhere():
    """top_p = 1 or greedy: no boundary, the rule changes nothing, every backend takes it."""
    gen = torch.Generator().manual_seed(5)
    target, tokens, draft = _chain_inputs(gen)
    for kw in (dict(temperature=0.9, top_p=1.0), dict(temperature=0.0, top_p=0.5)):
        want = sk.verify(target, tokens, draft, backend="torch", seed=0, **kw)
        got = sk.verify(target, tokens, draft, backend="triton", seed=0, top_p_ties="by_index", **kw)
        assert torch.equal(got.tokens, want.tokens)


def test_default_and_keep_are_the_same_call():
    gen = torch.Generator().manual_seed(6)
    target, tokens, draft = _chain_inputs(gen)
    kw = dict(temperature=0.9, top_p=0.6, seed=3, backend="vectorized")
    assert torch.equal(
        sk.verify(target, tokens, draft, **kw).tokens, sk.verify(target, tokens, draft, top_p_ties="keep", **kw).tokens
    )


def test_bad_rule_and_op_args_round_trip():
    gen = torch.Generator().manual_seed(7)
    target, tokens, draft = _chain_inputs(gen)
    with pytest.raises(ValueError, match="top_p_ties"):
        sk.verify(target, tokens, draft, top_p_ties="first")
    for ties in TOP_P_TIES:
        params = SamplingParams.check(2, torch.device("cpu"), 0.5, 3, torch.tensor([0.5, 0.9]), 7, ties)
        back = SamplingParams.from_op_args(*params.op_args(with_ties=True))
        assert back.top_p_ties == ties and back.top_k == 3 and torch.equal(back.top_p, params.top_p)


@pytest.mark.parametrize("backend", ["auto", pytest.param("triton", marks=pytest.mark.slow)])
def test_sampled_tokens_follow_the_by_index_distribution(backend):
    """Chi-square (alpha 1e-6) of 4,000 bonus tokens (G = 0) from a row of 4 equal logits and a
    smaller one at top_p = 0.5: tokens 1, 2, 3 only; power > 0.99 against the "keep" rule's p. The
    keep rule's tokens (same backend) must fail the test."""
    n = 4000
    row = torch.tensor([2.0, 2.0, 2.0, 2.0, -1.0, 0.5])
    target = row.expand(n, 1, 6).contiguous()
    tokens = torch.zeros(n, 0, dtype=torch.long)
    p = processed_probs(row, 1.0, 0, 0.5, "by_index")
    p_keep = processed_probs(row, 1.0, 0, 0.5, "keep")
    assert chi_square_power(p, p_keep, n) > 0.99
    out = sk.verify(target, tokens, temperature=1.0, top_p=0.5, top_p_ties="by_index", seed=11, backend=backend)
    assert chi_square_pvalue(out.tokens[:, 0], p) > ALPHA
    keep_backend = "vectorized" if backend == "auto" else backend  # auto: the CPU build (no by_index)
    keep = sk.verify(target, tokens, temperature=1.0, top_p=0.5, seed=11, backend=keep_backend)
    assert chi_square_pvalue(keep.tokens[:, 0], p) < ALPHA


@pytest.mark.parametrize("backend", ["triton", "cpu"])
def test_signed_zeros_are_one_tie_group(backend):
    """-0.0 == 0.0: both zeros form one boundary tie group, cut by index (the per-column threshold
    before the cut lies above both zeros)."""
    row = torch.tensor([0.0, -0.0, 0.0, -0.0, -0.0, 0.0, -1.0, -3.0])
    target = row.expand(64, 1, 8).contiguous()
    tokens = torch.zeros(64, 0, dtype=torch.long)
    kw = dict(temperature=1.0, top_p=0.4, top_p_ties="by_index", seed=4)
    want = sk.verify(target, tokens, backend="torch", **kw)
    got = sk.verify(target, tokens, backend=backend, **kw)
    assert torch.equal(got.tokens, want.tokens)
    assert set(want.tokens[:, 0].tolist()) <= {3, 4, 5}  # the three highest indices of the six zeros
