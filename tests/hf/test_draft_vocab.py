"""A draft restricted to part of the vocabulary (``hf/draft_vocab.py``): its output layer, the call's
swap and restore, greedy identity and the sampled law through the driver."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.cpu_linear import OneDnnLinear, onednn_linear_available, use_onednn_linears  # noqa: E402
from specdec_kernels.hf.draft_vocab import OFF_VOCAB_LOGIT, DraftVocab, DraftVocabHead, frequent_token_ids  # noqa: E402
from specdec_kernels.hf.drafters.base import ChainProposal, TreeProposal  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402
from .test_generate import PAD, _greedy_reference, _near_copy, _ragged_prompts, _two_token_distribution  # noqa: E402

KEPT = [0, 1, 4, 5, 9, 12, 17, 30, 31, 32, 50, 64, 77, 90, 96]  # of V = 97: not a prefix, EOS (1) kept


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    return target, _near_copy(target, 0.3, seed=5)


def _full_logits(model, x):
    out = model.get_output_embeddings()
    return torch.nn.functional.linear(x, out.weight, out.bias)


@pytest.mark.parametrize("ids", [KEPT, list(range(40))], ids=["scattered", "prefix"])
@pytest.mark.parametrize("bias", [False, True])
def test_head_keeps_the_rows_and_fills_the_rest(ids, bias):
    """The restricted layer's logits equal the full layer's at the kept ids and OFF_VOCAB_LOGIT
    elsewhere, for a strided view of the input and for zero rows."""
    model = tiny_model("llama", seed=2)
    if bias:
        head = model.lm_head
        model.lm_head = torch.nn.Linear(head.in_features, head.out_features, bias=True)
    x = torch.randn(3, 10, 64)[:, ::3]  # [3, 4, 64], odd strides
    full = _full_logits(model, x)
    vocab = DraftVocab(torch.tensor(ids[::-1]))  # any order: kept sorted
    with vocab.installed(model) as head:
        assert model.get_output_embeddings() is head and isinstance(head, DraftVocabHead)
        assert head.prefix == (ids == list(range(len(ids))))
        got = model.lm_head(x)
        empty = model.lm_head(x[:0])
    kept = torch.zeros(97, dtype=torch.bool)
    kept[ids] = True
    assert got.shape == full.shape and empty.shape == (0, 4, 97)
    torch.testing.assert_close(got[..., kept], full[..., kept])
    assert bool((got[..., ~kept] == OFF_VOCAB_LOGIT).all())


@pytest.mark.parametrize("kind", ["onednn", "native"])
def test_head_of_a_packed_output_layer(kind):
    """An output layer on oneDNN or on the native fp32 kernel keeps its kind when restricted."""
    from specdec_kernels.hf.cpu_f32 import NativeLinear, native_linear_available, use_native_linears

    if not (onednn_linear_available() if kind == "onednn" else native_linear_available()):
        pytest.skip(f"no {kind} linear here")
    model = tiny_model("llama", seed=2)
    (use_onednn_linears if kind == "onednn" else use_native_linears)(model)
    x = torch.randn(5, 64)
    full = model.lm_head(x)
    with DraftVocab(KEPT).installed(model) as head:
        assert isinstance(head.kept, OneDnnLinear if kind == "onednn" else NativeLinear)
        got = model.lm_head(x)
    torch.testing.assert_close(got[:, KEPT], full[:, KEPT], rtol=1e-5, atol=1e-5)


def test_the_call_restores_the_output_layer_and_reuses_its_head(pair):
    target, draft = pair
    original = draft.get_output_embeddings()
    vocab = DraftVocab(KEPT)
    ids, mask = _ragged_prompts()
    speculative_generate(target, draft, ids, mask, max_new_tokens=3, draft_vocab=vocab, eos_token_id=[])
    assert draft.get_output_embeddings() is original
    head = vocab.head_for(draft)
    with pytest.raises(RuntimeError, match="boom"), vocab.installed(draft):
        raise RuntimeError("boom")
    assert draft.get_output_embeddings() is original and vocab.head_for(draft) is head


def _record_proposals(monkeypatch) -> list:
    """Every step's drafted tokens and their q rows (None when greedy), as the verifier gets them."""
    seen = []

    def chain(self, *a, **kw):
        n = self.drafts.shape[-1] if self.n_drafts is None else int(self.n_drafts.max())
        seen.append((self.drafts[..., :n], None if self.probs is None else self.probs[..., :n, :]))
        return real_chain(self, *a, **kw)

    def tree(self, *a, **kw):
        valid = torch.arange(self.tokens.shape[1])[None] < self.num_nodes[:, None]
        seen.append((self.tokens[valid], None if self.probs is None else self.probs[valid]))
        return real_tree(self, *a, **kw)

    real_chain, real_tree = ChainProposal.verify, TreeProposal.verify
    monkeypatch.setattr(ChainProposal, "verify", chain)
    monkeypatch.setattr(TreeProposal, "verify", tree)
    return seen


TREE = dict(draft_tree="dynamic", num_draft_tokens=8, tree_width=3, method="rrs_wor")


@pytest.mark.parametrize(
    "kw",
    [dict(num_draft_tokens=4), dict(num_draft_tokens=4, adaptive_draft=False), TREE, {**TREE, "tree_threshold": 0.05}],
    ids=["chain", "chain_fixed", "tree", "shaped_tree"],
)
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_drafts_come_from_the_kept_ids_and_greedy_equals_generate(pair, kw, temperature, monkeypatch):
    """Greedy: identical to ``generate`` (batch 3, ragged), though the target's tokens are mostly
    outside the kept ids. Every drafted token is a kept id, and a sampled draft's q rows (what the
    verifier is told) put no mass elsewhere."""
    target, draft = pair
    ids, mask = _ragged_prompts()
    seen = _record_proposals(monkeypatch)
    out = speculative_generate(
        target, draft, ids, mask, max_new_tokens=12, draft_vocab=KEPT, temperature=temperature, seed=3,
        eos_token_id=[], pad_token_id=PAD, **kw,
    )  # fmt: skip
    if temperature == 0.0:
        assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    kept = torch.zeros(97, dtype=torch.bool)
    kept[KEPT] = True
    assert seen and all(bool(kept[tokens].all()) for tokens, _ in seen)
    for _, probs in seen:
        if probs is not None:
            assert float(probs[..., ~kept].abs().max()) == 0.0


def test_sampled_output_follows_the_target():
    """Chi-square (alpha 1e-6) on the first two generated tokens (V = 6: 36 cells) of 3000 requests
    at T = 1, chain and dynamic tree, with a draft kept to ids {0, 2, 3} (the target puts ~40% of its
    mass on the others, which only recovered and bonus tokens can emit).

    Power, asserted below: the test rejects with probability > 0.99 the restricted draft's own law (a
    verifier that accepts every draft) and the target's law cut to the kept ids (a recovery that
    never leaves the draft's vocabulary)."""
    V, n, kept = 6, 3000, [0, 2, 3]
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)
    draft = tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1)
    prompt = [3, 4, 5, 0]
    vocab = DraftVocab(kept)
    expected = _two_token_distribution(target, prompt, 1.0)
    with vocab.installed(draft):
        draft_law = _two_token_distribution(draft, prompt, 1.0)
    in_kept = torch.zeros(V, dtype=torch.bool)
    in_kept[kept] = True
    cut = expected * (in_kept[:, None] & in_kept[None, :])
    assert chi_square_power(expected.flatten(), draft_law.flatten(), n) > 0.99
    assert chi_square_power(expected.flatten(), (cut / cut.sum()).flatten(), n) > 0.99
    for kw in (dict(num_draft_tokens=2), dict(draft_tree="dynamic", num_draft_tokens=4, tree_width=2)):
        out = speculative_generate(
            target, draft, torch.tensor([prompt] * n), max_new_tokens=2, seed=1, eos_token_id=[],
            temperature=1.0, draft_vocab=vocab, **kw,
        )  # fmt: skip
        pairs = out.sequences[:, len(prompt) :]
        assert 0.05 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
        assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], expected.flatten()) > ALPHA


@pytest.mark.parametrize(
    "value, kw, match",
    [
        ([], {}, "non-empty 1-D"),
        ([[1, 2]], {}, "non-empty 1-D"),
        ([1.0, 2.0], {}, "integers"),
        ([-1, 2], {}, ">= 0"),
        ([3, 3], {}, "unique"),
        ([5, 97], {}, "97 >= the vocabulary size 97"),
        ([5, 50], dict(vocab_size=50), "50 >= the vocabulary size 50"),
        ([5, 6], dict(drafter="prompt_lookup"), "drafter='prompt_lookup' has none"),
    ],
)
def test_bad_draft_vocab_is_a_clear_error(pair, value, kw, match):
    target, draft = pair
    ids = torch.randint(3, 40, (1, 4))
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, None if "drafter" in kw else draft, ids, max_new_tokens=2, draft_vocab=value, **kw)
    assert type(draft.get_output_embeddings()) is torch.nn.Linear


class _ScaledLinear(torch.nn.Linear):
    def forward(self, x):
        return 2 * super().forward(x)


def test_the_target_as_its_own_draft_is_a_clear_error(pair):
    target, _ = pair
    with pytest.raises(ValueError, match="not the target itself"):
        speculative_generate(target, target, torch.randint(3, 97, (1, 4)), max_new_tokens=2, draft_vocab=KEPT)
    assert type(target.get_output_embeddings()) is torch.nn.Linear


def test_an_output_layer_it_cannot_restrict_is_a_clear_error(pair):
    target, _ = pair
    draft = tiny_model("llama", seed=4, layers=1)
    draft.lm_head = _ScaledLinear(64, 97, bias=False)  # a subclass may compute anything: not sliced
    with pytest.raises(ValueError, match="output layer is an nn.Linear"):
        speculative_generate(target, draft, torch.randint(3, 97, (1, 4)), max_new_tokens=2, draft_vocab=KEPT)


class _Tokenizer:
    """Characters as token ids ('a' = 3, ...), 0-2 special."""

    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 12

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) - ord("a") for c in text]}


def test_frequent_token_ids():
    tok = _Tokenizer()
    # counts: c (5) 5, e (7) 3, a (3) 1, i (11) 1; ties and unused ids by lowest id
    assert frequent_token_ids(tok, ["ccccc", "eee", "ai"], 6).tolist() == [0, 1, 2, 3, 5, 7]
    assert frequent_token_ids(tok, ["ccccc", "eee", "ai"], 6, include=[10]).tolist() == [0, 1, 2, 5, 7, 10]
    assert frequent_token_ids(tok, [], 4).tolist() == [0, 1, 2, 3]
    assert frequent_token_ids(tok, ["ab"], 100).tolist() == list(range(12))
    assert frequent_token_ids(tok, ["kkk"], 4, vocab_size=9).tolist() == [0, 1, 2, 3]  # "k" (13) past it
    with pytest.raises(ValueError, match="size must be an int >= 1"):
        frequent_token_ids(tok, [], 0)
