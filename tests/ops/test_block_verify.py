"""method="block": the vectorized backend against the reference rule, token for token."""

import pytest
import torch

from specdec_kernels._types import DRAFT_LOGITS, DRAFT_PROBS
from specdec_kernels._validation import check_verify_args
from specdec_kernels.ops.vectorized.block import verify_block_vectorized
from specdec_kernels.reference.block import verify_request_block


def _reference(args):
    cpu = args.per_request_cpu()
    tokens = torch.full((args.B, args.G + 1), -1, dtype=torch.int64)
    accepted = torch.zeros(args.B, dtype=torch.int32)
    flagged = torch.zeros(args.B, dtype=torch.bool)
    for b in range(args.B):
        drafts = args.draft_tokens[b].tolist()
        a, token, bad = verify_request_block(
            args.target_logits[b],
            drafts,
            args.draft[b] if args.draft is not None else None,
            args.draft_mode,
            float(cpu["temperature"][b]),
            int(cpu["top_k"][b]),
            float(cpu["top_p"][b]),
            int(cpu["num_draft_tokens"][b]),
            int(cpu["seed"][b]),
            args.V,
            args.sampling.top_p_ties,
        )
        tokens[b, :a] = torch.tensor(drafts[:a], dtype=torch.int64)
        tokens[b, a] = token
        accepted[b], flagged[b] = a, bad
    return tokens, accepted, flagged


@pytest.mark.parametrize("mode", ["logits", "probs", "none"])
@pytest.mark.parametrize("V", [2, 111])
def test_vectorized_block_matches_the_reference(mode, V):
    gen = torch.Generator().manual_seed(V)
    B, G = 24, 4
    target = torch.randn(B, G + 1, V, generator=gen) * 2
    draft_logits = target[:, :G] + torch.randn(B, G, V, generator=gen)
    q = torch.softmax(draft_logits, -1)
    drafts = torch.multinomial(q.reshape(-1, V), 1, generator=gen).view(B, G)
    kw = {"logits": dict(draft_logits=draft_logits), "probs": dict(draft_probs=q), "none": {}}[mode]
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (B // 4))
    top_k = torch.tensor([0, 0, 5, 0] * (B // 4))
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.8] * (B // 4))
    n = torch.randint(0, G + 1, (B,), generator=gen)
    args = check_verify_args(
        target,
        drafts,
        kw.get("draft_logits"),
        kw.get("draft_probs"),
        temperature,
        top_k,
        top_p,
        n,
        torch.arange(B) * 7919 + 1,
        validate=True,
    )
    assert args.draft_mode == {"logits": DRAFT_LOGITS, "probs": DRAFT_PROBS, "none": 0}[mode]
    got = verify_block_vectorized(args)
    tokens, accepted, flagged = _reference(args)
    assert torch.equal(got.num_accepted, accepted)
    assert torch.equal(got.tokens, tokens)
    assert torch.equal(got.nonfinite, flagged)
