"""sk.tree_attention against the fp64 dense-mask reference (and against SDPA for chains and N = 1)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import specdec_kernels as sk
from specdec_kernels.ops.tree_attention import tree_attention_from_masks
from specdec_kernels.reference import tree_attention_mask, tree_attention_reference

from ._trees import tree_parents

TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def _problem(B, Hq, Hkv, N, D, *, shape="random", dtype=torch.float32, seed=0, max_prefix=70, ragged_nodes=True):
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, max_prefix + 1, (B,), generator=gen)
    num_nodes = torch.randint(1, N + 1, (B,), generator=gen) if ragged_nodes else torch.full((B,), N)
    S = int((prefix + N).max()) + 3  # slack keys past every request: must be ignored
    q = torch.randn(B, Hq, N, D, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, S, D, generator=gen).to(dtype)
    parents = torch.stack([tree_parents(shape, N, gen) for _ in range(B)])
    return q, k, v, prefix, parents, num_nodes


def _check(q, k, v, prefix, parents, num_nodes, **kw):
    out = sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes, **kw)
    ref = tree_attention_reference(
        q, k, v, prefix, parents, num_nodes=num_nodes, scale=kw.get("scale"), sliding_window=kw.get("sliding_window")
    )
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[q.dtype], rtol=TOL[q.dtype])
    return out


@pytest.mark.parametrize("shape", ["random", "chain", "star"])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_random_trees_ragged(shape, group):
    _check(*_problem(3, 2 * group, 2, 7, 64, shape=shape, seed=group))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
def test_head_dims_and_dtypes(D, dtype):
    _check(*_problem(2, 4, 1, 5, D, dtype=dtype, seed=D))


@pytest.mark.parametrize("splits", [2, 3, 4, 7])
def test_flash_decoding_splits_match_one_pass(splits):
    """Any split count (the launcher picks just enough to fill the SMs, not a power of two); the last split
    takes the tree keys and whatever prefix the others leave."""
    args = _problem(2, 8, 2, 6, 64, seed=3, max_prefix=300)
    whole = _check(*args, _num_splits=1)
    split = _check(*args, _num_splits=splits)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_partials_in_half_precision(dtype):
    """The splits' partial outputs are stored normalised in q's dtype (fp32 max and sum): still within the
    dtype's tolerance of the fp64 reference, negative scales included (the kernel flips q's sign)."""
    args = _problem(2, 8, 2, 6, 128, dtype=dtype, seed=5, max_prefix=300)
    _check(*args, _num_splits=5)
    _check(*args, _num_splits=5, scale=-0.05)


@pytest.mark.parametrize("window, splits", [(7, 1), (16, 1), (40, 4), (1000, 1)])
def test_sliding_window(window, splits):
    """Mistral-style windows: long prefixes see only their last keys; the split that holds no
    visible key contributes nothing; a window wider than every sequence is full attention."""
    args = _problem(3, 4, 2, 7, 64, seed=window, max_prefix=200)
    out = _check(*args, sliding_window=window, _num_splits=splits)
    if window == 1000:
        torch.testing.assert_close(out, sk.tree_attention(*args[:5], num_nodes=args[5]), atol=1e-5, rtol=1e-5)
    else:  # the window changes the result: the test would notice it being ignored
        assert not torch.allclose(out, sk.tree_attention(*args[:5], num_nodes=args[5]), atol=1e-3)


def test_sliding_window_must_cover_the_tree():
    q, k, v, prefix, parents, num_nodes = _problem(1, 2, 2, 7, 64)
    with pytest.raises(ValueError, match="sliding_window must be >= N=7"):
        sk.tree_attention(q, k, v, prefix, parents, sliding_window=6)


def test_full_64_node_tree():
    _check(*_problem(2, 2, 1, 64, 64, seed=5, max_prefix=20))


def test_custom_scale():
    _check(*_problem(2, 2, 2, 4, 64, seed=6), scale=0.3)


def test_chain_is_causal_attention():
    """parents[i] = i - 1 and equal prefixes: SDPA with is_causal over the tree, prefix fully visible."""
    B, H, N, D, P = 2, 4, 6, 64, 9
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, n, D, generator=gen) for n in (N, P + N, P + N))
    parents = torch.arange(N).expand(B, N) - 1
    out = sk.tree_attention(q, k, v, torch.full((B,), P), parents)
    causal = torch.ones(N, P + N, dtype=torch.bool).tril(diagonal=P)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_single_node_is_decoding():
    B, H, D, P = 3, 4, 128, 33
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(B, H, 1, D, generator=gen)
    k, v = (torch.randn(B, H, P + 1, D, generator=gen) for _ in range(2))
    out = sk.tree_attention(q, k, v, torch.full((B,), P), torch.full((B, 1), -1))
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v), atol=1e-5, rtol=1e-5)


def test_padding_nodes_are_zero_and_isolated():
    q, k, v, prefix, parents, num_nodes = _problem(3, 4, 2, 8, 64, seed=9)
    num_nodes = torch.tensor([3, 8, 1])
    out = sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes)
    # Scribble over everything that belongs to padding nodes: queries, keys and values.
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    for b in range(3):
        n, p = int(num_nodes[b]), int(prefix[b])
        q2[b, :, n:] = 1e3
        k2[b, :, p + n :] = -7.0
        v2[b, :, p + n :] = 1e4
    out2 = sk.tree_attention(q2, k2, v2, prefix, parents, num_nodes=num_nodes)
    for b in range(3):
        n = int(num_nodes[b])
        assert torch.equal(out[b, :, n:], torch.zeros_like(out[b, :, n:]))
        torch.testing.assert_close(out2[b, :, :n], out[b, :, :n], atol=1e-5, rtol=1e-5)


def test_zero_prefix_and_empty_batch():
    q, k, v, prefix, parents, num_nodes = _problem(2, 2, 2, 4, 64, seed=10)
    _check(q, k, v, torch.zeros_like(prefix), parents, num_nodes)
    empty = sk.tree_attention(q[:0], k[:0], v[:0], prefix[:0], parents[:0])
    assert empty.shape == (0, 2, 4, 64)


def test_noncontiguous_hf_layout():
    """HF hands attention q as a transposed view of [B, N, H, D]; the kernel takes strides."""
    q, k, v, prefix, parents, num_nodes = _problem(2, 4, 2, 5, 64, seed=11)
    q_view = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert not q_view.is_contiguous()
    _check(q_view, k, v, prefix, parents, num_nodes)


def test_general_form_left_padding_and_tree_after_shared_length():
    """What the HF backend uses: keys [key_start, prefix_end) plus tree slots at tree_start."""
    B, H, D, S, N = 2, 2, 64, 30, 4
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(B, H, N, D, generator=gen)
    k, v = (torch.randn(B, H, S, D, generator=gen) for _ in range(2))
    key_start, prefix_end, tree_start = torch.tensor([3, 0]), torch.tensor([20, 14]), torch.tensor([24, 24])
    parents = torch.tensor([[-1, 0, 1, 0], [-1, -1, 1, 2]])
    masks = sk.tree_metadata(parents).ancestor_mask
    out = tree_attention_from_masks(q, k, v, key_start.int(), prefix_end.int(), tree_start.int(), masks)
    allowed = torch.zeros(B, N, S, dtype=torch.bool)
    for b in range(B):
        allowed[b, :, key_start[b] : prefix_end[b]] = True
        for n in range(N):
            for j in range(N):
                allowed[b, n, tree_start[b] + j] = bool((int(masks[b, n]) >> j) & 1)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_reference_mask_matches_definition():
    parents = torch.tensor([[-1, 0, 0, 2]])
    mask = tree_attention_mask(torch.tensor([2]), parents, S=7)
    expected = torch.tensor(
        [[1, 1, 1, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 0, 1, 0, 0], [1, 1, 1, 0, 1, 1, 0]], dtype=torch.bool
    )
    assert torch.equal(mask[0], expected)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: a.update(q=a["q"][0]), "q must be"),
        (lambda a: a.update(k=a["k"][:, :, :, :32], v=a["v"][:, :, :, :32]), "head dim"),
        (lambda a: a.update(q=a["q"][:, :3]), "multiple of key/value heads"),
        (lambda a: a.update(v=a["v"].half()), "share a dtype"),
        (lambda a: a.update(parents=a["parents"][:, :2]), "parents must have shape"),
        (lambda a: a.update(prefix_lens=a["prefix_lens"].float()), "int32/int64"),
        (lambda a: a.update(prefix_lens=torch.tensor([-1, 0])), "prefix_lens must be >= 0"),
        (lambda a: a.update(prefix_lens=torch.tensor([0, 100])), "exceeds the key length"),
        (lambda a: a.update(parents=torch.tensor([[-1, 0, 2, 0], [-1, 0, 0, 0]])), "an earlier node"),
        (lambda a: a.update(num_nodes=torch.tensor([5, 1])), "num_nodes must be in"),
        (lambda a: a.update(q=a["q"].int()), "dtype"),
    ],
)
def test_bad_input(mutate, match):
    gen = torch.Generator().manual_seed(0)
    args = dict(
        q=torch.randn(2, 4, 4, 64, generator=gen),
        k=torch.randn(2, 2, 10, 64, generator=gen),
        v=torch.randn(2, 2, 10, 64, generator=gen),
        prefix_lens=torch.tensor([3, 6]),
        parents=torch.tensor([[-1, 0, 0, 1], [-1, -1, 1, 2]]),
    )
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        sk.tree_attention(**args)


def test_large_scores_stay_finite():
    """Scores of +-1e4 (scale 1): online softmax with running max must not overflow."""
    q, k, v, prefix, parents, num_nodes = _problem(2, 2, 2, 4, 64, seed=13)
    out = _check(q * 30, k * 30, v, prefix, parents, num_nodes, scale=1.0)
    assert torch.isfinite(out).all()
    assert math.isfinite(float(out.abs().max()))


def test_custom_op_schema_and_fake():
    """specdec::tree_attention passes torch.library.opcheck (schema, fake tensor, autograd registration)."""
    from specdec_kernels.ops.tree_attention import tree_attention_op

    q, k, v, prefix, parents, num_nodes = _problem(2, 4, 2, 4, 64, seed=14, max_prefix=20)
    masks = sk.tree_metadata(parents, num_nodes).ancestor_mask
    p32 = prefix.to(torch.int32)
    args = (q, k, v, torch.zeros_like(p32), p32, p32, masks, 0.125, 4)
    torch.library.opcheck(tree_attention_op, args, test_utils=("test_schema", "test_faketensor"))
    ref = tree_attention_reference(q, k, v, prefix, parents, num_nodes=num_nodes, scale=0.125)
    torch.testing.assert_close(tree_attention_op(*args), ref, atol=1e-4, rtol=1e-4)


def test_every_argument_strided():
    """Issue 14 item 1: transposed q/k/v, int32 slices with stride 2, expanded parents, strided num_nodes:
    the same answer as the contiguous call."""
    B, Hq, Hkv, N, D = 3, 4, 2, 5, 64
    gen = torch.Generator().manual_seed(21)
    S = 40
    q = torch.randn(B, N, Hq, D, generator=gen).transpose(1, 2)  # HF layout
    k = torch.randn(B, S, Hkv, D, generator=gen).transpose(1, 2)
    v = torch.randn(Hkv, B, S, D, generator=gen).permute(1, 0, 2, 3)
    prefix = torch.tensor([[7, -5], [30, -5], [0, -5]], dtype=torch.int32)[:, 0]  # stride 2
    num_nodes = torch.tensor([[5, 9], [2, 9], [4, 9]], dtype=torch.int32)[:, 0]
    parents = torch.tensor([[-1, 0, 0, 1, 3]]).expand(B, N)  # batch stride 0
    assert prefix.stride(0) == 2 and num_nodes.stride(0) == 2 and parents.stride(0) == 0
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    for window in (None, 9):
        out = sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes, sliding_window=window)
        dense = sk.tree_attention(
            q.contiguous(),
            k.contiguous(),
            v.contiguous(),
            prefix.contiguous(),
            parents.contiguous(),
            num_nodes=num_nodes.contiguous(),
            sliding_window=window,
        )
        torch.testing.assert_close(out, dense, atol=0, rtol=0)
        _check(q, k, v, prefix, parents, num_nodes, sliding_window=window)
        if window is None:
            plain = dense
    # parents strided along nodes too
    wide = torch.stack([parents.contiguous(), torch.full_like(parents, 99)], dim=-1).reshape(B, 2 * N)[:, ::2]
    assert wide.stride(1) == 2
    torch.testing.assert_close(sk.tree_attention(q, k, v, prefix, wide, num_nodes=num_nodes), plain, atol=0, rtol=0)


def _poison_slots(kind, prefix, parents, num_nodes, S):
    """[B, S] bool: key slots to fill with NaN/inf for one class of keys some query does not attend."""
    B, N = parents.shape
    slots = torch.zeros(B, S, dtype=torch.bool)
    for b in range(B):
        p, n = int(prefix[b]), int(num_nodes[b])
        if kind == "stale":  # past the request's tree: slack keys
            slots[b, p + N :] = True
        elif kind == "padding":  # slots of padding nodes
            slots[b, p + n : p + N] = True
        elif kind == "sibling":  # the last real node's own slot: attended by it (and descendants) only
            slots[b, p + n - 1] = True
        elif kind == "window":  # the first prefix key: outside every long-prefix query's window
            slots[b, 0] = p > 0
    return slots


@pytest.mark.parametrize("kind", ["stale", "padding", "sibling", "window"])
@pytest.mark.parametrize("what", ["v_nan", "v_inf", "k_nan"])
@pytest.mark.parametrize("impl", ["triton", "triton_split", "torch"])
def test_nonfinite_unattended_keys_do_not_leak(kind, what, impl):
    """Issue 14 item 2: NaN/inf at a key no query attends must not reach it through 0 * NaN; a query that
    does attend a NaN/inf value (V) outputs NaN, exactly as the reference says."""
    from specdec_kernels.ops.tree_attention import tree_attention_torch, window_start

    B, Hq, Hkv, N, D = 3, 4, 2, 6, 64
    gen = torch.Generator().manual_seed(31)
    prefix = torch.tensor([40, 3, 25])
    num_nodes = torch.tensor([4, 6, 2])
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2], [-1, -1, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4]])
    S = int((prefix + N).max()) + 4
    q = torch.randn(B, Hq, N, D, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    window = 8 if kind == "window" else None
    slots = _poison_slots(kind, prefix, parents, num_nodes, S)
    bad = {"v_nan": float("nan"), "v_inf": float("inf"), "k_nan": float("nan")}[what]
    k2, v2 = k.clone(), v.clone()
    (k2 if what == "k_nan" else v2)[slots[:, None, :, None].expand(B, Hkv, S, D)] = bad

    def run(k, v):
        if impl == "torch":
            meta = sk.tree_metadata(parents, num_nodes)
            p32 = prefix.to(torch.int32)
            zero = torch.zeros_like(p32)
            lo = None if window is None else window_start(zero, p32[:, None] + meta.depth - 1, window)
            return tree_attention_torch(q, k, v, zero, p32, p32, meta.ancestor_mask, tree_slots=N, window_lo=lo)
        splits = 2 if impl == "triton_split" else 1
        return sk.tree_attention(
            q, k, v, prefix, parents, num_nodes=num_nodes, sliding_window=window, _num_splits=splits
        )

    clean, dirty = run(k, v), run(k2, v2)
    attended = tree_attention_mask(prefix, parents, S, num_nodes, window)  # [B, N, S]
    hit = (attended & slots[:, None, :]).any(-1)[:, None, :].expand(B, Hq, N)  # rows that attend a bad key
    assert (~hit).any()
    torch.testing.assert_close(dirty[~hit], clean[~hit], atol=0, rtol=0)
    real = (torch.arange(N)[None, :] < num_nodes[:, None])[:, None, :].expand(B, Hq, N)
    assert torch.equal(dirty[~real], torch.zeros_like(dirty[~real]))
    ref = tree_attention_reference(q, k2, v2, prefix, parents, num_nodes=num_nodes, sliding_window=window)
    assert torch.equal(ref[~hit].isnan(), torch.zeros_like(ref[~hit], dtype=torch.bool))
    if what != "k_nan":  # a query attending a NaN/inf value: NaN in every implementation and the reference
        assert dirty[hit].isnan().all() and ref[hit].isnan().all()
    if kind in ("sibling", "window"):
        assert hit.any()  # the class really splits the queries


@pytest.mark.parametrize("slot", [31, 32, 63])
@pytest.mark.parametrize("splits", [1, 2])
def test_nonfinite_value_in_a_high_tree_slot(slot, splits):
    """A NaN value in tree slot 31, 32 (the masks' high word) or 63 (their sign bit) of a 64-node chain with
    GQA 4 (256 rows, one tile): the rows attending it (nodes >= slot) output NaN, the others are untouched.
    The kernel marks those rows from a 64-bit set of bad slots once, after the tree tiles."""
    B, Hq, Hkv, N, D, P = 1, 4, 1, 64, 16, 5
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, Hq, N, D, generator=gen)
    k, v = (torch.randn(B, Hkv, P + N, D, generator=gen) for _ in range(2))
    parents = (torch.arange(N) - 1)[None, :]  # a chain: node n attends slots 0 .. n
    prefix = torch.tensor([P])
    v2 = v.clone()
    v2[:, :, P + slot, 3] = float("nan")
    clean, dirty = (sk.tree_attention(q, k, vv, prefix, parents, _num_splits=splits) for vv in (v, v2))
    hit = (torch.arange(N) >= slot)[None, None, :].expand(B, Hq, N)
    assert dirty[hit].isnan().all()
    torch.testing.assert_close(dirty[~hit], clean[~hit], atol=0, rtol=0)


def test_under_torch_compile_fullgraph():
    """Issue 14 item 12: sk.tree_attention and sk.tree_metadata trace as custom ops (aot_eager on CPU)."""
    q, k, v, prefix, parents, num_nodes = _problem(2, 4, 2, 5, 64, seed=41)

    def step(q, k, v, prefix, parents, num_nodes):
        meta = sk.tree_metadata(parents, num_nodes)
        out = sk.tree_attention(q, k, v, prefix, parents, num_nodes=num_nodes, sliding_window=16)
        return out, meta.depth, meta.ancestor_mask

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v, prefix, parents, num_nodes)
    want = step(q, k, v, prefix, parents, num_nodes)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def _count_kv_loads(monkeypatch, k, v):
    """Wrap the interpreter's masked load: per element of k and v, how many times a program read it."""
    import numpy as np
    from triton.runtime import interpreter

    counts = {name: np.zeros(t.numel(), dtype=np.int64) for name, t in (("k", k), ("v", v))}
    spans = {name: (t.data_ptr(), t.element_size()) for name, t in (("k", k), ("v", v))}
    original = interpreter.InterpreterBuilder.create_masked_load

    def counting(self, ptrs, mask, other, cache_policy, is_volatile):
        addr = ptrs.data[mask.data.astype(bool)].astype(np.int64)
        for name, (base, size) in spans.items():
            idx = (addr - base) // size
            hit = (addr >= base) & (idx < counts[name].size)
            np.add.at(counts[name], idx[hit], 1)
        return original(self, ptrs, mask, other, cache_policy, is_volatile)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_masked_load", counting)
    return counts


@pytest.mark.parametrize(
    "N, splits",
    [
        (16, 1),
        (16, 4),
        (64, 1),  # issue 13: the GQA group's 256 query rows in one program
        (64, 4),
    ],
)
def test_prefix_keys_read_once_per_request_and_kv_head(monkeypatch, N, splits):
    """Issue 13: the GQA group's query rows share one pass over the prefix, so every prefix element of K
    and V is loaded exactly once per (request, KV head), whatever the split count."""
    B, Hq, Hkv, D = 2, 8, 2, 64
    gen = torch.Generator().manual_seed(51)
    prefix = torch.tensor([150, 37])
    S = int(prefix.max()) + N
    q = torch.randn(B, Hq, N, D, generator=gen)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen) for _ in range(2))
    parents = torch.stack([tree_parents("random", N, gen) for _ in range(B)])
    counts = _count_kv_loads(monkeypatch, k, v)
    sk.tree_attention(q, k, v, prefix, parents, _num_splits=splits)
    for name in ("k", "v"):
        c = torch.from_numpy(counts[name]).view(B, Hkv, S, D)
        for b in range(B):
            assert (c[b, :, : int(prefix[b])] == 1).all(), f"{name}: prefix elements read {c[b].unique().tolist()}"


@pytest.mark.parametrize("path", ["sdpa", "grouped"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 12])
def test_cpu_paths_equal_the_matmul_path(path, dtype, window):
    """tree_attention_sdpa and tree_attention_grouped (the Hugging Face backend's CPU paths) compute
    tree_attention_torch's attention on finite caches: ragged prefixes, left padding, stale slots,
    GQA (3 query heads per KV head), a padding query (zeros), a sliding window, a strided query."""
    from specdec_kernels.ops.tree_attention import (
        tree_attention_allowed,
        tree_attention_grouped,
        tree_attention_sdpa,
        tree_attention_torch,
        window_start,
    )

    attend = {"sdpa": tree_attention_sdpa, "grouped": tree_attention_grouped}[path]

    B, Hq, Hkv, N, D, S = 3, 6, 2, 5, 32, 40
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(B, Hq, N, D, generator=gen).to(dtype)
    k, v = (torch.randn(B, Hkv, S, D, generator=gen).to(dtype) for _ in range(2))
    key_start = torch.tensor([0, 4, 9], dtype=torch.int32)
    prefix_end = torch.tensor([30, 20, 25], dtype=torch.int32)
    tree_start = torch.tensor([30, 24, 33], dtype=torch.int32)  # stale slots [prefix_end, tree_start)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3], [-1, -1, 0, 1, 1]])
    meta = sk.tree_metadata(parents, torch.tensor([5, 5, 4]))  # request 2: query 4 is padding
    masks = meta.ancestor_mask
    positions = prefix_end[:, None].to(torch.int64) + meta.depth - 1 - key_start[:, None]
    lo = None if window is None else window_start(key_start, positions, window)
    allowed = tree_attention_allowed(key_start, prefix_end, tree_start, masks, S, tree_slots=N, window_lo=lo)
    want = tree_attention_torch(q, k, v, key_start, prefix_end, tree_start, masks, tree_slots=N, window_lo=lo)
    strided_q = q.transpose(1, 2).contiguous().transpose(1, 2)  # [B, Hq, N, D] view of [B, N, Hq, D], as HF passes
    got = attend(strided_q, k, v, allowed)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype and got.shape == q.shape
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    assert torch.equal(got[2, :, 4], torch.zeros_like(got[2, :, 4]))  # the padding query
    assert not torch.equal(got[0], attend(q, k, v, allowed | True)[0])  # the mask matters
    one = attend(q[:, :, 1:2], k, v, allowed[:, 1:2])  # one query (the grouped path's use)
    torch.testing.assert_close(one, want[:, :, 1:2], atol=tol, rtol=tol)


def test_grouped_path_zero_sizes():
    """tree_attention_grouped with no queries, no keys (a query attending nothing: zeros) or no requests."""
    from specdec_kernels.ops.tree_attention import tree_attention_grouped

    def call(B, Nq, S):
        q, k, v = torch.randn(B, 6, Nq, 8), torch.randn(B, 2, S, 8), torch.randn(B, 2, S, 8)
        return tree_attention_grouped(q, k, v, torch.ones(B, Nq, S, dtype=torch.bool))

    assert call(2, 0, 5).shape == (2, 6, 0, 8)
    assert torch.equal(call(2, 1, 0), torch.zeros(2, 6, 1, 8))
    assert call(0, 1, 4).shape == (0, 6, 1, 8)
