"""Logits processors under speculation (issue 26): every target row and every draft row is processed
with the exact prefix it follows, so greedy output equals ``target.generate`` with the same settings
and sampled output follows generate's processed law."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList  # noqa: E402
from transformers.generation import logits_process as lp  # noqa: E402

from specdec_kernels.hf import CUSTOM_GENERATE, processors, session, speculative_generate  # noqa: E402
from specdec_kernels.hf.drafting import chains_tree_parents  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import perfect_draft_run, tiny_model  # noqa: E402

PAD = 2
NEW = 8


def _ragged_prompts(B=3, T=8, seed=0, lens=(5, 8, 3)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 97, (B, T), generator=gen)
    mask = (torch.arange(T)[None, :] >= T - torch.tensor(lens)[:, None]).long()  # left padding
    return ids * mask + PAD * (1 - mask), mask


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.3 * p.std().clamp_min(1e-3))
    return target, draft


@pytest.fixture(scope="module")
def free(pair):
    """Greedy output without settings, and the token each setting below is aimed at."""
    ids, mask = _ragged_prompts()
    out = pair[0].generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD)
    return out[:, ids.shape[1] :]


# Each setting aimed at what greedy generates (so that it changes the output: asserted).
SETTINGS = {
    "repetition_penalty": lambda f: dict(repetition_penalty=3.0),
    "no_repeat_ngram_size": lambda f: dict(no_repeat_ngram_size=1),
    "min_new_tokens": lambda f: dict(min_new_tokens=NEW, eos_token_id=int(f[0, 2])),
    "min_length": lambda f: dict(min_length=8 + NEW, eos_token_id=int(f[0, 2])),
    "suppress_tokens": lambda f: dict(suppress_tokens=[int(f[0, 1]), int(f[1, 3])]),
    "begin_suppress_tokens": lambda f: dict(begin_suppress_tokens=[int(t) for t in f[:, 0]]),
    "bad_words_ids": lambda f: dict(bad_words_ids=[[int(f[0, 1]), int(f[0, 2])], [int(f[2, 1])]]),
    "sequence_bias": lambda f: dict(sequence_bias={(int(f[1, 2]),): -20.0}),
    "forced_eos_token_id": lambda f: dict(forced_eos_token_id=int(f[0, 0])),
}


def _run(pair, settings: dict, K: int = 1, **kw):
    target, draft = pair
    ids, mask = _ragged_prompts()
    eos = settings.pop("eos_token_id", [])
    expected = target.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD, eos_token_id=eos, **settings
    )
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=NEW,
        num_draft_tokens=3,
        num_drafts=K,
        eos_token_id=eos,
        pad_token_id=PAD,
        generation_config=GenerationConfig(**settings) if settings else None,
        **kw,
    )
    return expected, out.sequences


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_greedy_equals_generate_with_the_setting(pair, free, name):
    settings = SETTINGS[name](free)
    plain = _run(pair, {"eos_token_id": settings.get("eos_token_id", [])})[0]
    expected, got = _run(pair, dict(settings))
    assert not torch.equal(expected, plain), "the setting must change generate's output (power)"
    assert torch.equal(got, expected)


@pytest.mark.parametrize("K", [2, 3])
def test_greedy_repetition_penalty_on_k_chains(pair, K):
    """K chains: each chain's rows are processed with its own drafts (the accepted chain varies)."""
    expected, got = _run(pair, dict(repetition_penalty=3.0, no_repeat_ngram_size=2), K=K)
    assert torch.equal(got, expected)


class _Favour(LogitsProcessor):
    """A user's processor, a function of (input_ids, scores): favours (7 * last token + 3) mod V."""

    def __call__(self, input_ids, scores):
        favoured = (7 * input_ids[:, -1:] + 3) % scores.shape[-1]
        return scores.scatter_add(1, favoured, torch.full_like(scores[:, :1], 4.0))


def test_users_processor_greedy_equals_generate(pair):
    target, draft = pair
    ids, mask = _ragged_prompts(seed=3)
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=[])
    expected = target.generate(
        ids, attention_mask=mask, do_sample=False, logits_processor=LogitsProcessorList([_Favour()]), **kw
    )
    plain = target.generate(ids, attention_mask=mask, do_sample=False, **kw)
    assert not torch.equal(expected, plain)
    procs = LogitsProcessorList([_Favour()])
    for drafter, d in (("model", draft), ("prompt_lookup", None)):
        out = speculative_generate(
            target, d, ids, mask, num_draft_tokens=3, drafter=drafter, logits_processor=procs, **kw
        )
        assert torch.equal(out.sequences, expected), drafter


def test_medusa_tree_rows_are_processed_with_their_paths(pair):
    """A Medusa tree: every node's target row follows its own root-to-node path (the heads' q need
    no processing for exactness: the verifier is told the law the candidates were drawn from)."""
    from specdec_kernels.hf import MedusaHeads

    target = pair[0]
    ids, mask = _ragged_prompts(seed=3)
    torch.manual_seed(0)
    heads = MedusaHeads(64, 97, num_heads=2)
    heads.init_from_lm_head(target.get_output_embeddings())
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=[], repetition_penalty=3.0)
    expected = target.generate(ids, attention_mask=mask, do_sample=False, **kw)
    medusa = dict(drafter="medusa", medusa_heads=heads, num_draft_tokens=6, num_drafts=2)
    settings = GenerationConfig(repetition_penalty=3.0)
    kw.pop("repetition_penalty")
    out = speculative_generate(target, None, ids, mask, **medusa, **kw, generation_config=settings)
    assert torch.equal(out.sequences, expected)
    assert out.stats.accepted > 0  # the tree's rows past the root were used


def test_custom_generate_applies_the_settings(pair, free):
    target, draft = pair
    ids, mask = _ragged_prompts()
    kw = dict(max_new_tokens=NEW, pad_token_id=PAD, eos_token_id=[], repetition_penalty=3.0, do_sample=False)
    expected = target.generate(ids, attention_mask=mask, **kw)
    out = target.generate(
        ids, attention_mask=mask, assistant_model=draft, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, **kw
    )
    assert torch.equal(out, expected)


def test_unsupported_processors_are_a_clear_error(pair):
    target, draft = pair
    ids, mask = _ragged_prompts()
    prefix = lp.PrefixConstrainedLogitsProcessor(lambda b, ids: [3], 1)
    with pytest.raises(ValueError, match="PrefixConstrainedLogitsProcessor"):
        speculative_generate(target, draft, ids, mask, logits_processor=LogitsProcessorList([prefix]))
    with pytest.raises(ValueError, match="forced_bos_token_id"):
        speculative_generate(target, draft, ids, mask, generation_config=GenerationConfig(forced_bos_token_id=0))
    with pytest.raises(ValueError, match="top_p_ties"):
        speculative_generate(
            target, draft, ids, mask, temperature=0.7, top_p=0.9, top_p_ties="keep", logits_processor=[_Favour()]
        )


def test_node_paths_follow_each_chain():
    """Row 1 + k*g + t of K chains follows chain k's drafts 0..t (its own path, never another's)."""
    drafts = torch.arange(2 * 3 * 2).reshape(2, 3, 2) + 10  # [A, K, g]
    A, K, g = drafts.shape
    paths = processors.node_paths(drafts.reshape(A, K * g), chains_tree_parents(K, g, "cpu").expand(A, -1))
    for a in range(A):
        assert paths[a][0] == []
        for k in range(K):
            for t in range(g):
                assert paths[a][1 + k * g + t] == drafts[a, k, : t + 1].tolist()


# ---- sampled: the output law is generate's processed law


SAMPLES = 20_000
ROW = [1.2, 0.6, 0.0, -0.4]  # context-free logits (V = 4); the prompt is [3]


def _generate_law(procs: list, T: float, prefix_of_second=lambda x1: [3, x1]) -> torch.Tensor:
    """Joint law [V * V] of generate's first two tokens from the prompt [3] under ``procs`` then
    temperature T (computed with the processors themselves, in float64)."""
    V = len(ROW)

    def law(prefix):
        scores = torch.tensor([ROW], dtype=torch.float32)
        for proc in procs:
            scores = proc(torch.tensor([prefix]), scores)
        return torch.softmax(scores[0].double() / T, dim=0)

    first = law([3])
    return torch.cat([first[x1] * law(prefix_of_second(x1)) for x1 in range(V)])


def _pairs(procs, T, *, K=1, seed=0, **kw) -> torch.Tensor:
    """The first two tokens (as one cell id) of SAMPLES requests; with a perfect draft the second
    token's target row follows an accepted draft."""
    procs = LogitsProcessorList(procs)
    out = perfect_draft_run(
        ROW, SAMPLES, max_new_tokens=2, num_drafts=K, temperature=T, seed=seed, logits_processor=procs, **kw
    )
    return out.sequences[:, 1] * len(ROW) + out.sequences[:, 2]


@pytest.mark.slow
@pytest.mark.parametrize("K", [1, 2])
def test_repetition_penalty_follows_generates_law(K, monkeypatch):
    """Chi-square (alpha 1e-6) of the first two tokens (16 cells) against generate's law with a
    repetition penalty of 3 at T = 0.8. Power: > 0.99 against the law of a driver that processes
    the target's rows with the committed tokens only (the draft before the row missing); a sample
    of it is rejected, and that driver itself (paths emptied) is rejected."""
    procs, T = [lp.RepetitionPenaltyLogitsProcessor(3.0)], 0.8
    expected = _generate_law(procs, T)
    biased = _generate_law(procs, T, prefix_of_second=lambda x1: [3])
    assert chi_square_power(expected, biased, SAMPLES) > 0.99
    gen = torch.Generator().manual_seed(1)
    assert chi_square_pvalue(torch.multinomial(biased, SAMPLES, replacement=True, generator=gen), expected) < ALPHA
    assert chi_square_pvalue(_pairs(procs, T, K=K, seed=3), expected) > ALPHA
    committed_only = lambda tokens, parents: [[[]] * parents.shape[1] for _ in range(parents.shape[0])]  # noqa: E731
    monkeypatch.setattr(session, "node_paths", committed_only)
    assert chi_square_pvalue(_pairs(procs, T, K=K, seed=3), expected) < ALPHA


@pytest.mark.slow
def test_min_p_follows_generates_law():
    """min_p 0.3 after temperature 0.6, as generate orders them. Power: > 0.99 against min_p applied
    before the temperature (a sample of that law is rejected)."""
    T = 0.6
    expected = _generate_law([lp.TemperatureLogitsWarper(T), lp.MinPLogitsWarper(0.3)], 1.0)
    biased = _generate_law([lp.MinPLogitsWarper(0.3), lp.TemperatureLogitsWarper(T)], 1.0)
    assert chi_square_power(expected, biased, SAMPLES) > 0.99
    gen = torch.Generator().manual_seed(2)
    assert chi_square_pvalue(torch.multinomial(biased, SAMPLES, replacement=True, generator=gen), expected) < ALPHA
    settings = GenerationConfig(min_p=0.3, do_sample=True)
    assert chi_square_pvalue(_pairs([], T, seed=5, generation_config=settings), expected) > ALPHA
