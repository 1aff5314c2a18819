"""speculative_generate(verification="block"): block verification of the draft model's chains."""

import copy
import math

import pytest
import torch

from ..ops._stats import ALPHA, chi_square_pvalue
from ._models import fixed_logits_model, tiny_model

PAD = 2
RULES = ("token", "block")


def test_greedy_block_equals_generate():
    from specdec_kernels.hf import speculative_generate

    target = tiny_model("llama", seed=1)
    draft = copy.deepcopy(target)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp_min(1e-3))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 97, (3, 8), generator=gen)
    mask = (torch.arange(8)[None, :] >= 8 - torch.tensor([5, 8, 3])[:, None]).long()
    ids = ids * mask + PAD * (1 - mask)
    want = target.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=PAD)
    got = speculative_generate(
        target, draft, ids, mask, max_new_tokens=20, num_draft_tokens=4, verification="block", pad_token_id=PAD
    )
    assert torch.equal(got.sequences, want)


def _paper_pair():
    """Context-free target (1/3, 2/3) and draft (2/3, 1/3) over tokens {0, 1} (the other two ids
    of the vocabulary of 4 have logit -40: mass 1e-17)."""
    rows = ([math.log(1 / 3), math.log(2 / 3), -40.0, -40.0], [math.log(2 / 3), math.log(1 / 3), -40.0, -40.0])
    return fixed_logits_model(rows[0]), fixed_logits_model(rows[1])


@pytest.mark.slow
def test_sampled_block_keeps_the_target_law_and_accepts_more():
    """2,000 generations of 2 tokens with G = 2 drafts of the paper's pair: the two tokens are
    i.i.d. from the target (chi-square over the 4 pairs at ALPHA), and block verification's
    accepted drafts per step exceed token-wise's (11/9 vs 10/9 in expectation; 4 standard errors)."""
    from specdec_kernels.hf import speculative_generate

    target, draft = _paper_pair()
    prompts = torch.full((2000, 1), 3)
    kw = dict(max_new_tokens=2, num_draft_tokens=2, temperature=1.0, adaptive_draft=False, eos_token_id=[])
    runs = {
        rule: speculative_generate(target, draft, prompts, seed=7, verification=rule, **kw)
        for rule in ("token", "block")
    }
    tokens = runs["block"].sequences[:, 1:3]
    assert chi_square_pvalue(tokens[:, 0] * 2 + tokens[:, 1], torch.tensor([1, 2, 2, 4]) / 9.0) > ALPHA
    hist = {rule: out.stats.accepted_length_histogram[:, :].sum(0).double() for rule, out in runs.items()}
    means = {rule: float((h * torch.arange(len(h))).sum() / h.sum()) for rule, h in hist.items()}
    first = {rule: out.stats.accepted / max(out.stats.request_steps, 1) for rule, out in runs.items()}
    assert first["block"] > first["token"], (means, first)


def test_block_verification_settings():
    from specdec_kernels.hf import speculative_generate

    target, draft = _paper_pair()
    prompts = torch.full((1, 1), 3)
    with pytest.raises(ValueError, match="verification must be one of"):
        speculative_generate(target, draft, prompts, max_new_tokens=2, verification="blocks")
    with pytest.raises(ValueError, match="num_drafts=1"):
        speculative_generate(target, draft, prompts, max_new_tokens=2, num_drafts=2, verification="block")
