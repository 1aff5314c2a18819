"""The "specdec_tree" attention backend: tree forwards match an explicit dense 4D mask; other forwards are SDPA."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from specdec_kernels.hf import (  # noqa: E402
    register_tree_attention,
    tree_attention_context,
    tree_attention_metadata,
    using_tree_attention,
)

from ._models import tiny_model  # noqa: E402


def _prefill_ragged(model, lens, seed=0):
    """Left-aligned ragged prefixes (right padding) in a DynamicCache; returns the cache and its length."""
    gen = torch.Generator().manual_seed(seed)
    B, T = len(lens), max(lens)
    ids = torch.randint(3, model.config.vocab_size, (B, T), generator=gen).to(model.device)
    mask = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None]).long().to(model.device)
    positions = torch.arange(T, device=model.device).expand(B, T)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache, position_ids=positions)
    return cache, T


def _dense_tree_mask(prefix_lens, parents, cache_len, N):
    """[B, 1, N, cache_len + N] bool: committed prefix of each request plus its tree ancestors."""
    B = parents.shape[0]
    mask = torch.zeros(B, 1, N, cache_len + N, dtype=torch.bool)
    for b in range(B):
        mask[b, 0, :, : prefix_lens[b]] = True
        for i in range(N):
            node = i
            while node >= 0:
                mask[b, 0, i, cache_len + node] = True
                node = int(parents[b, node])
    return mask


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_tree_forward_matches_dense_mask(kind, backend):
    model = tiny_model(kind, seed=1)
    lens = [5, 9, 2]
    cache, T = _prefill_ragged(model, lens)
    parents = torch.tensor([[-1, 0, 0, 1, 2, -1], [-1, 0, 1, 2, 3, 4], [-1, -1, -1, 0, 1, 2]])
    N = parents.shape[1]
    tokens = torch.randint(3, model.config.vocab_size, (3, N), generator=torch.Generator().manual_seed(5))
    prefix = torch.tensor(lens)

    meta = tree_attention_metadata(parents, prefix, cache_len=T, backend=backend)
    dense_cache = copy.deepcopy(cache)
    with torch.no_grad(), using_tree_attention(model), tree_attention_context(meta):
        ours = model(input_ids=tokens, position_ids=meta.position_ids, past_key_values=cache).logits
    mask = _dense_tree_mask(lens, parents, T, N)
    with torch.no_grad():
        dense = model(
            input_ids=tokens, position_ids=meta.position_ids, past_key_values=dense_cache, attention_mask=mask
        ).logits
    torch.testing.assert_close(ours, dense, atol=2e-5, rtol=2e-5)
    assert torch.equal(meta.position_ids[1], torch.arange(9, 15))  # a chain continues its sequence


def _chains(n: int) -> list[list[int]]:
    """Three requests' parents: a chain of n nodes, a root with n - 1 children, n roots."""
    return [[i - 1 for i in range(n)], [-1] + [0] * (n - 1), [-1] * n]


@pytest.mark.parametrize(
    "parents",
    [[[-1], [-1], [-1]], [[-1, 0], [-1, 0], [-1, -1]], [[-1, 0, 1], [-1, 0, 0], [-1, -1, 0]], _chains(9), _chains(10)],
)
def test_cpu_auto_runs_few_queries_grouped(parents, monkeypatch):
    """On the CPU, "auto" runs forwards of up to GROUPED_MAX_QUERIES queries through
    tree_attention_grouped and longer ones through SDPA; both match the dense mask."""
    from specdec_kernels.hf import attention

    calls = []
    for name in ("tree_attention_grouped", "tree_attention_sdpa"):
        real = getattr(attention, name)
        monkeypatch.setattr(attention, name, lambda *a, _real=real, _name=name: calls.append(_name) or _real(*a))
    model = tiny_model("qwen2", seed=1)
    lens = [5, 9, 2]
    cache, T = _prefill_ragged(model, lens)
    parents = torch.tensor(parents)
    N = parents.shape[1]
    tokens = torch.randint(3, model.config.vocab_size, (3, N), generator=torch.Generator().manual_seed(5))
    meta = tree_attention_metadata(parents, torch.tensor(lens), cache_len=T)
    dense_cache = copy.deepcopy(cache)
    with torch.no_grad(), using_tree_attention(model), tree_attention_context(meta):
        ours = model(input_ids=tokens, position_ids=meta.position_ids, past_key_values=cache).logits
    with torch.no_grad():
        mask = _dense_tree_mask(lens, parents, T, N)
        dense = model(
            input_ids=tokens, position_ids=meta.position_ids, past_key_values=dense_cache, attention_mask=mask
        ).logits
    torch.testing.assert_close(ours, dense, atol=2e-5, rtol=2e-5)
    want = "tree_attention_grouped" if N <= attention.GROUPED_MAX_QUERIES else "tree_attention_sdpa"
    assert calls == [want] * model.config.num_hidden_layers


def test_backend_without_tree_is_sdpa():
    """Prefill and decoding through "specdec_tree" without a tree context give SDPA's logits exactly."""
    model = tiny_model("llama", seed=2)
    ids = torch.randint(3, 97, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
        register_tree_attention()
        with using_tree_attention(model):
            got = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "sdpa"  # restored
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_metadata_shape_mismatch_is_an_error():
    model = tiny_model("llama", seed=3)
    cache, T = _prefill_ragged(model, [3, 4])
    meta = tree_attention_metadata(torch.tensor([[-1, 0], [-1, 0]]), torch.tensor([3, 4]), cache_len=T)
    with pytest.raises(ValueError, match="tree metadata"), torch.no_grad(), using_tree_attention(model):
        with tree_attention_context(meta):
            model(input_ids=torch.ones(2, 3, dtype=torch.long), past_key_values=cache)


def test_static_cache_tree_forward_matches_dense_mask():
    """StaticCache: keys are a fixed [B, H, max_len, D] buffer, the tree is written at cache_position."""
    from transformers import StaticCache

    model = tiny_model("llama", seed=4)
    lens, max_len = [4, 7], 32
    B, T = len(lens), max(lens)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (B, T), generator=gen)
    mask2d = (torch.arange(T)[None, :] < torch.tensor(lens)[:, None]).long()
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]])
    N = parents.shape[1]
    tokens = torch.randint(3, 97, (B, N), generator=gen)
    meta = tree_attention_metadata(parents, torch.tensor(lens), cache_len=T, backend="triton")
    logits = []
    for use_tree in (True, False):
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            model(
                input_ids=ids,
                attention_mask=mask2d,
                past_key_values=cache,
                position_ids=torch.arange(T).expand(B, T),
                cache_position=torch.arange(T),
            )
            position = torch.arange(T, T + N)
            if use_tree:
                with using_tree_attention(model), tree_attention_context(meta):
                    out = model(
                        input_ids=tokens, position_ids=meta.position_ids, past_key_values=cache, cache_position=position
                    )
            else:
                dense = torch.zeros(B, 1, N, max_len, dtype=torch.bool)
                dense[..., : T + N] = _dense_tree_mask(lens, parents, T, N)
                out = model(
                    input_ids=tokens,
                    position_ids=meta.position_ids,
                    past_key_values=cache,
                    cache_position=position,
                    attention_mask=dense,
                )
        logits.append(out.logits)
    torch.testing.assert_close(logits[0], logits[1], atol=2e-5, rtol=2e-5)


def test_attention_features_it_does_not_implement_are_errors():
    """Softcapped logits (Gemma 2), attention sinks (gpt-oss), position biases: a clear error, never
    attention computed without them."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from specdec_kernels.hf.attention import _tree_attention_forward

    gemma = Gemma2ForCausalLM(
        Gemma2Config(
            vocab_size=97,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
        )
    )
    with pytest.raises(NotImplementedError, match="softcaps"):
        with using_tree_attention(gemma):
            pass
    q, k, v = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    meta = tree_attention_metadata(torch.tensor([[-1, 0, 1]]), torch.tensor([2]), 2)
    with tree_attention_context(meta):
        _tree_attention_forward(torch.nn.Module(), q, k, v, None)  # supported: runs
        for feature in ("softcap", "s_aux", "sinks", "position_bias"):
            with pytest.raises(NotImplementedError, match=feature):
                _tree_attention_forward(torch.nn.Module(), q, k, v, None, **{feature: torch.ones(1)})


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_tree_forward_on_cuda_matches_dense_mask(dtype):
    """The Triton kernel on the GPU (backend auto) inside a half-precision model: its logits are as close
    to the fp32 model's (dense mask) as SDPA's in the same dtype. (A fixed bf16 tolerance failed on an
    H200 by rounding alone: 6 of 1,746 logits 2 bf16 ulp apart.)"""
    model = tiny_model("llama", seed=1).to("cuda", dtype)
    lens = [5, 9, 2]
    cache, T = _prefill_ragged(model, lens)
    model32 = tiny_model("llama", seed=1).to("cuda")
    cache32, _ = _prefill_ragged(model32, lens)
    parents = torch.tensor([[-1, 0, 0, 1, 2, -1], [-1, 0, 1, 2, 3, 4], [-1, -1, -1, 0, 1, 2]], device="cuda")
    N = parents.shape[1]
    tokens = torch.randint(3, model.config.vocab_size, (3, N), generator=torch.Generator().manual_seed(5)).cuda()
    meta = tree_attention_metadata(parents, torch.tensor(lens, device="cuda"), cache_len=T)
    dense_cache = copy.deepcopy(cache)
    with torch.no_grad(), using_tree_attention(model), tree_attention_context(meta):
        ours = model(input_ids=tokens, position_ids=meta.position_ids, past_key_values=cache).logits
    mask = _dense_tree_mask(lens, parents.cpu(), T, N).cuda()
    with torch.no_grad():
        dense = model(
            input_ids=tokens, position_ids=meta.position_ids, past_key_values=dense_cache, attention_mask=mask
        ).logits
        exact = model32(input_ids=tokens, position_ids=meta.position_ids, past_key_values=cache32, attention_mask=mask)
    ours_err = (ours.float() - exact.logits).abs().max().item()
    sdpa_err = (dense.float() - exact.logits).abs().max().item()
    assert ours_err <= 2 * sdpa_err + 1e-2, (ours_err, sdpa_err)
    torch.testing.assert_close(ours.float(), dense.float(), atol=0.1, rtol=0.1)  # a wrong mask is off by O(1)
