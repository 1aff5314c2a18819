"""Reference chain verification: the specification of ``specdec_kernels.verify``.

A loop over requests and rows in float64. It shares the argument checks and the counter-based
random numbers with the kernels, so for equal seeds both return the same tokens (up to float
rounding ties, which random inputs essentially never hit).
"""

from __future__ import annotations

import torch

from .._params import MIN_TEMPERATURE
from .._types import DRAFT_LOGITS, VerifyOutput
from .._validation import check_verify_args
from .block import verify_request_block
from .sampling import (
    accept_uniforms,
    bonus_token,
    draft_distribution,
    grammar_masked,
    processed_probs,
    recover_token,
    sanitize_logits,
)


def verify_reference(
    target_logits, draft_tokens, draft_logits=None, *, draft_probs=None, temperature=1.0, top_k=0, top_p=1.0,
    num_draft_tokens=None, seed=None, validate=True, top_p_ties="keep",
) -> VerifyOutput:  # fmt: skip
    """Same contract as :func:`specdec_kernels.verify`; see its docstring."""
    args = check_verify_args(
        target_logits, draft_tokens, draft_logits, draft_probs, temperature, top_k, top_p, num_draft_tokens, seed,
        validate=validate, top_p_ties=top_p_ties,
    )  # fmt: skip
    return verify_checked(args)


def verify_checked(args, method: str = "token") -> VerifyOutput:
    """The reference on checked arguments (``_validation.VerifyArgs``); the torch backend.
    method="block": the block rule of ``reference/block.py`` for every sampled request."""
    B, G, V = args.B, args.G, args.V
    cpu = {k: v.cpu() for k, v in vars(args).items() if isinstance(v, torch.Tensor)}
    cpu.update(args.per_request_cpu())
    greedy = ~(cpu["temperature"] >= MIN_TEMPERATURE)  # the argmax chain: the same under both rules
    tokens = torch.full((B, G + 1), -1, dtype=torch.int64)
    num_accepted = torch.zeros(B, dtype=torch.int32)
    nonfinite = torch.zeros(B, dtype=torch.bool)
    for b in range(B):
        request_rule = verify_request_block if method == "block" and not greedy[b] else _verify_request
        target, draft = cpu["target_logits"][b], cpu["draft"][b] if args.draft is not None else None
        if args.token_bitmask is not None:  # grammar: target row i and draft-logits row i use mask row i
            words = cpu["token_bitmask"][b]
            target = _grammar_rows(target, words)
            draft = _grammar_rows(draft, words) if args.draft_mode == DRAFT_LOGITS else draft
        accepted, token, flagged = request_rule(
            target=target,
            drafts=cpu["draft_tokens"][b].tolist(),
            draft=draft,
            mode=args.draft_mode,
            temperature=float(cpu["temperature"][b]),
            top_k=int(cpu["top_k"][b]),
            top_p=float(cpu["top_p"][b]),
            n=int(cpu["num_draft_tokens"][b]),
            seed=int(cpu["seed"][b]),
            V=V,
            ties=args.sampling.top_p_ties,
        )
        tokens[b, :accepted] = torch.tensor(cpu["draft_tokens"][b][:accepted].tolist(), dtype=torch.int64)
        tokens[b, accepted] = token
        num_accepted[b] = accepted
        nonfinite[b] = flagged
    dev = args.target_logits.device
    return VerifyOutput(tokens.to(dev), num_accepted.to(dev), nonfinite.to(dev))


def _grammar_rows(rows: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
    """Rows [n, V] with row i masked by words[i] (``sampling.grammar_masked``); draft probabilities
    are never masked (the draft sampled from them as given)."""
    out = rows.clone()
    for i in range(rows.shape[0]):
        out[i] = grammar_masked(rows[i], words[i])
    return out


def _verify_request(target, drafts, draft, mode, temperature, top_k, top_p, n, seed, V, ties="keep"):
    """(number accepted, emitted token, nonfinite flag) for one request."""
    greedy = not temperature >= MIN_TEMPERATURE  # subnormal / NaN temperatures act as greedy, like the kernels
    flagged = False
    # A placeholder id (outside [0, V), e.g. vLLM's -1 padding) ends the draft: that position draws
    # the bonus token from p, masking nothing, exactly like a tree node without valid children.
    n = next((i for i in range(n) if not 0 <= drafts[i] < V), n)
    for i in range(n + 1):
        x, bad = sanitize_logits(target[i])
        flagged |= bad
        if greedy:  # the argmax chain: the draft distribution is never read (nor flagged)
            best = int(torch.argmax(x))  # NaN already -inf; first index on ties
            flagged |= not bool((x > float("-inf")).any())  # nothing to choose from: token 0, flagged
            if i < n and drafts[i] == best:
                continue
            return i, best, flagged
        p = processed_probs(target[i], temperature, top_k, top_p, ties)
        flagged |= not bool((p > 0).any())
        if i == n:  # all drafts accepted: bonus token from p_n
            return n, bonus_token(p, seed, i), flagged
        tok = drafts[i]  # in [0, V): n ends at the first placeholder
        q, bad_q = draft_distribution(draft[i] if draft is not None else None, mode, temperature, top_k, top_p, ties)
        flagged |= bad_q  # a draft row the request used held NaN / inf (or, as probabilities, < 0)
        if q is None:  # one-hot q (n-gram drafts): accept with probability p(x), residual = p without x
            q = torch.zeros(V, dtype=torch.float64)
            q[tok] = 1.0
        (u,) = accept_uniforms(seed, i, 1)
        p_tok, q_tok = float(p[tok]), float(q[tok])
        if p_tok > 0 and u * q_tok <= p_tok:
            continue
        return i, recover_token(torch.clamp(p - q, min=0), p, seed, i), flagged
    raise AssertionError("unreachable")
