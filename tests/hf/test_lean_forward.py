"""specdec_kernels.hf.lean_forward: the leaner CPU forward gives the model's own logits and cache, bit
for bit (chain, catch-up and tree forwards, ragged batches, bf16, int8 layers, a restricted output
layer), applies only where it can, and whole generate calls are unchanged by it (greedy and seeded
sampling, token for token)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.attention import (  # noqa: E402
    tree_attention_context,
    tree_attention_metadata,
    using_tree_attention,
)
from specdec_kernels.hf.cache import cache_kwargs  # noqa: E402
from specdec_kernels.hf.forwards import prefill  # noqa: E402
from specdec_kernels.hf.lean_forward import lean_forward, lean_forward_applies  # noqa: E402

from ._models import tiny_model  # noqa: E402
from .test_generate import PAD, _near_copy, _ragged_prompts  # noqa: E402

PROMPTS = [[5, 9, 11, 3, 7, 8], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19]]


def _prefilled(model, prompts):
    with torch.no_grad():
        return prefill(model, prompts, "cpu")


def _metas(prompts, cache):
    """(name, ids [B, N], metadata): a one-token chain step, a 3-token catch-up, a 5-node tree."""
    B, S = len(prompts), cache.get_seq_length()
    cached = torch.tensor([len(p) - 1 for p in prompts])
    gen = torch.Generator().manual_seed(3)
    out = []
    for name, parents in (
        ("chain", [[-1]] * B),
        ("catch-up", [[-1, 0, 1]] * B),
        ("tree", [[-1, 0, 0, 1, 1]] * B),
    ):
        parents = torch.tensor(parents)
        meta = tree_attention_metadata(parents, cached, S, validate=False)
        ids = torch.randint(3, 97, parents.shape, generator=gen)
        out.append((name, ids, meta))
    return out


def _both(model, prompts, keep):
    """For each forward: (the model's logits, lean logits, the model's cache, lean's cache)."""
    results = []
    with torch.no_grad(), using_tree_attention(model):
        base = _prefilled(model, prompts)
        for name, ids, meta in _metas(prompts, base):
            theirs, mine = copy.deepcopy(base), copy.deepcopy(base)
            assert lean_forward_applies(model, mine, "cpu"), name
            with tree_attention_context(meta):
                kw = {"logits_to_keep": keep, **cache_kwargs(model, theirs)}
                want = model(input_ids=ids, position_ids=meta.position_ids, use_cache=True, **kw).logits
                got = lean_forward(model, mine, ids, meta.position_ids, keep)
            results.append((name, want, got, theirs, mine))
    return results


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_logits_and_cache_are_the_models_own_bit_for_bit(kind, dtype, keep):
    extra = {"sliding_window": None} if kind == "mistral" else {}
    model = tiny_model(kind, seed=4, **extra).to(dtype)
    for name, want, got, theirs, mine in _both(model, PROMPTS, keep):
        assert got.dtype == want.dtype and torch.equal(got, want), name
        for a, b in zip(theirs.layers, mine.layers, strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), name


def test_int8_layers_and_a_restricted_output_layer_are_replayed_too():
    from specdec_kernels.hf.cpu_int8 import int8_linear_available, use_int8_linears
    from specdec_kernels.hf.draft_vocab import DraftVocab

    if not int8_linear_available():
        pytest.skip("no int8 kernel here")
    model = tiny_model("qwen2", seed=5)
    use_int8_linears(model)
    with DraftVocab([0, 1, 3, 7, 20, 40, 96]).installed(model):
        for name, want, got, _, _ in _both(model, PROMPTS, 1):
            assert got.shape[-1] == 97 and torch.equal(got, want), name


def test_it_applies_only_where_it_replays_the_model():
    model = tiny_model("llama", seed=6)
    with using_tree_attention(model):
        cache = _prefilled(model, PROMPTS)
        with torch.no_grad():
            assert lean_forward_applies(model, cache, "cpu")
            assert not lean_forward_applies(model, cache, "cuda")
            assert not lean_forward_applies(model, DynamicCache(), "cpu")  # no layer holds the prompt yet
            handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
            assert not lean_forward_applies(model, cache, "cpu")  # hooks would be skipped
            handle.remove()
            assert lean_forward_applies(model, cache, "cpu")
            model.train()
            assert not lean_forward_applies(model, cache, "cpu")
            model.eval()
        assert not lean_forward_applies(model, cache, "cpu")  # grad enabled
    with torch.no_grad():
        assert not lean_forward_applies(model, cache, "cpu")  # not the tree-attention implementation
        for windowed in (
            tiny_model("mistral", seed=6),  # sliding_window 4096
            tiny_model("qwen2", seed=6, use_sliding_window=True, sliding_window=4, max_window_layers=0),
        ):
            with using_tree_attention(windowed):
                assert not lean_forward_applies(windowed, _prefilled(windowed, PROMPTS), "cpu")


def test_the_environment_switch_turns_it_off(monkeypatch):
    model = tiny_model("llama", seed=7)
    with torch.no_grad(), using_tree_attention(model):
        cache = _prefilled(model, PROMPTS)
        monkeypatch.setenv("SPECDEC_LEAN_FORWARD", "0")
        assert not lean_forward_applies(model, cache, "cpu")


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0, num_draft_tokens=4),
        dict(temperature=1.0, num_draft_tokens=3, seed=11),
        dict(temperature=0.8, draft_tree="dynamic", num_draft_tokens=6, tree_width=2, method="rrs_wor", seed=12),
    ],
    ids=["greedy-chain", "sampled-chain", "sampled-tree"],
)
def test_generate_is_unchanged_token_for_token(monkeypatch, kw):
    """Bit-identical forwards make whole calls identical: every draft, acceptance and random draw."""
    target = tiny_model("llama", seed=1)
    draft = _near_copy(target, 0.3, seed=5)
    ids, mask = _ragged_prompts()
    args = dict(max_new_tokens=10, eos_token_id=[], pad_token_id=PAD, adaptive_draft=False, **kw)  # timing-free
    lean = speculative_generate(target, draft, ids, mask, **args)
    monkeypatch.setenv("SPECDEC_LEAN_FORWARD", "0")
    plain = speculative_generate(target, draft, ids, mask, **args)
    assert torch.equal(lean.sequences, plain.sequences)
    for field in ("steps", "proposed", "accepted", "draft_forwards"):
        assert getattr(lean.stats, field) == getattr(plain.stats, field), field
    assert 0 < lean.stats.accepted < lean.stats.proposed  # both accept and reject paths ran
