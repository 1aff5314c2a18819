"""Speculative decoding through transformers' own ``model.generate(custom_generate=...)``."""

import pytest
import torch

from specdec_kernels.hf import CUSTOM_GENERATE, speculative_generate

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue
from ._models import tiny_model

pytest.importorskip("transformers")


def _ragged_batch(V=97):
    """Three left-padded prompts of lengths 5, 3, 6 (pad id 2)."""
    torch.manual_seed(0)
    lengths = [5, 3, 6]
    T = max(lengths)
    ids = torch.full((3, T), 2, dtype=torch.long)
    mask = torch.zeros((3, T), dtype=torch.long)
    for b, n in enumerate(lengths):
        ids[b, T - n :] = torch.randint(3, V, (n,))
        mask[b, T - n :] = 1
    return ids, mask


def _spec(target, ids, mask, **kw):
    return target.generate(ids, attention_mask=mask, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, **kw)


@pytest.mark.parametrize(
    "draft_kwargs",
    [{"num_assistant_tokens": 3}, {}, {"specdec_num_drafts": 2}, {"specdec_draft_vocab": list(range(0, 97, 3))}],
)
def test_greedy_equals_plain_generate(draft_kwargs, monkeypatch):
    from specdec_kernels.hf.draft_vocab import DraftVocab

    installed = []
    real = DraftVocab.installed
    monkeypatch.setattr(DraftVocab, "installed", lambda self, model: installed.append(len(self)) or real(self, model))
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", seed=2, layers=1)
    ids, mask = _ragged_batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=[])
    out = _spec(
        target, ids, mask, assistant_model=draft, max_new_tokens=12, do_sample=False, eos_token_id=[], **draft_kwargs
    )
    assert torch.equal(out, expected)
    assert installed == ([33] if "specdec_draft_vocab" in draft_kwargs else [])  # the restriction was applied


def test_prompt_lookup_and_return_dict():
    target = tiny_model("llama", seed=1)
    ids, mask = _ragged_batch()
    expected = target.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, eos_token_id=[])
    out = _spec(
        target, ids, mask, prompt_lookup_num_tokens=3, max_new_tokens=8, eos_token_id=[], return_dict_in_generate=True
    )
    assert torch.equal(out.sequences, expected)


def test_same_torch_seed_same_sampled_output():
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", seed=2, layers=1)
    ids, mask = _ragged_batch()
    kw = dict(assistant_model=draft, max_new_tokens=6, do_sample=True, temperature=0.9, top_k=0, eos_token_id=[])
    torch.manual_seed(5)
    a = _spec(target, ids, mask, **kw)
    torch.manual_seed(5)
    b = _spec(target, ids, mask, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({}, "assistant_model"),
        ({"num_beams": 2}, "num_beams"),
        ({"stopping_criteria": [object()]}, "stopping_criteria"),
        ({"no_such_argument": 1}, "no_such_argument"),
    ],
)
def test_unsupported_arguments_are_clear_errors(kwargs, message):
    target = tiny_model("llama", seed=1)
    ids, mask = _ragged_batch()
    with pytest.raises(ValueError, match=message):
        _spec(target, ids, mask, max_new_tokens=4, **kwargs)


def test_sampled_output_follows_the_target():
    """Chi-square (alpha 1e-6) of the first generated token of 2,000 prompts (V = 6) through
    generate(); power > 0.99 against the draft's own distribution (a verifier accepting everything)."""
    from specdec_kernels.reference.sampling import processed_probs

    V, n = 6, 2000
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)
    draft = tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1)
    prompt = [3, 4, 5, 0]
    with torch.no_grad():
        p = processed_probs(target(input_ids=torch.tensor([prompt])).logits[0, -1].float(), 1.0, 0, 1.0)
        q = processed_probs(draft(input_ids=torch.tensor([prompt])).logits[0, -1].float(), 1.0, 0, 1.0)
    assert chi_square_power(p, q, n) > 0.99
    ids = torch.tensor([prompt] * n)
    torch.manual_seed(3)
    out = _spec(
        target,
        ids,
        torch.ones_like(ids),
        assistant_model=draft,
        num_assistant_tokens=2,
        max_new_tokens=1,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        eos_token_id=[],
    )
    assert chi_square_pvalue(out[:, len(prompt)], p) > ALPHA


def test_matches_speculative_generate_directly():
    """The adapter maps generate's arguments; greedy output equals a direct driver call."""
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", seed=2, layers=1)
    ids, mask = _ragged_batch()
    direct = speculative_generate(target, draft, ids, mask, max_new_tokens=5, num_draft_tokens=2, eos_token_id=[])
    out = _spec(target, ids, mask, assistant_model=draft, num_assistant_tokens=2, max_new_tokens=5, eos_token_id=[])
    assert torch.equal(out, direct.sequences)
