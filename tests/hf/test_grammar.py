"""hf/grammar.py: xgrammar masks per position, rollback to the committed state, spec parsing."""

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from specdec_kernels._bitmask import allowed  # noqa: E402
from specdec_kernels.demo import EOS_ID, VOCAB_SIZE, ByteTokenizer  # noqa: E402
from specdec_kernels.hf.grammar import (  # noqa: E402
    GrammarSpec,
    GrammarState,
    as_spec,
    compile_grammar,
)

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}


def _compiled(grammar=SCHEMA):
    return compile_grammar(grammar, ByteTokenizer(), VOCAB_SIZE, [EOS_ID])


def _fresh_mask(compiled, tokens):
    matcher = xgr.GrammarMatcher(compiled)
    for t in tokens:
        assert matcher.accept_token(t)
    words = xgr.allocate_token_bitmask(1, VOCAB_SIZE)
    matcher.fill_next_token_bitmask(words)
    return allowed(words[0], VOCAB_SIZE)


def test_bitmask_words_agree_with_xgrammar_apply():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 9), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.zeros(3, VOCAB_SIZE)
    xgr.apply_token_bitmask_inplace(logits, words)
    assert torch.equal(allowed(words, VOCAB_SIZE), logits == 0)


def test_masks_along_a_path_and_the_rollback_leave_the_committed_state():
    compiled = _compiled()
    state = GrammarState([compiled] * 2, VOCAB_SIZE)
    committed = list(b'{"name": "a')
    state.commit(0, committed)
    path = list(b'b", "n": 1')
    words, valid = state.words_along(0, path)
    masks = allowed(words, VOCAB_SIZE)
    assert valid == len(path)
    for i in range(len(path) + 1):
        assert torch.equal(masks[i], _fresh_mask(compiled, committed + path[:i])), i
    assert torch.equal(allowed(state.words_along(0, [])[0][0], VOCAB_SIZE), _fresh_mask(compiled, committed))
    bad, valid = state.words_along(0, list(b'b"}x'))  # "n" is required: no '}' after the name
    assert valid == 2 and not bad[valid + 1 :].any()
    other = state.words_along(1, [])[0][0]
    assert torch.equal(allowed(other, VOCAB_SIZE), _fresh_mask(compiled, []))  # other requests untouched


def test_the_masker_fills_each_prefix_once_per_step(monkeypatch):
    """Rows of one step share their prefixes' words (the target's rows reuse the draft's); a commit
    forgets them. Refused paths allow everything (a row no verification reaches)."""
    from specdec_kernels.hf.grammar import GrammarMasker

    masker = GrammarMasker([_compiled()], VOCAB_SIZE)
    fills = []
    fill = masker.state.fill
    monkeypatch.setattr(masker.state, "fill", lambda b: fills.append(b) or fill(b))
    first = masker.masks(0, [[], list(b"{")])
    assert len(fills) == 2
    again = masker.masks(0, [list(b'{"'), list(b"{"), [], list(b"x")])
    assert len(fills) == 3  # only '{"' is new; 'x' is refused at the root
    assert torch.equal(again[1:3], first.flip(0)) and bool((again[3] == -1).all())
    want = [_fresh_mask(_compiled(), list(p)) for p in (b'{"', b"{", b"")]
    assert all(torch.equal(allowed(again[r], VOCAB_SIZE), want[r]) for r in range(3))
    masker.commit([0], [list(b"{")])
    assert torch.equal(allowed(masker.masks(0, [[]])[0], VOCAB_SIZE), want[1])
    assert len(fills) == 4


def test_a_complete_grammar_allows_only_the_stop_token():
    compiled = _compiled('root ::= "yes" | "no"')
    state = GrammarState([compiled], VOCAB_SIZE)
    words, valid = state.words_along(0, list(b"no") + [EOS_ID])
    masks = allowed(words, VOCAB_SIZE)
    assert valid == 3
    assert masks[2].nonzero().flatten().tolist() == [EOS_ID]
    assert masks[3].nonzero().flatten().tolist() == [EOS_ID]  # past the end: the stop token (cut at commit)


def test_prompt_lookup_offers_only_what_the_grammar_allows(pair, monkeypatch):
    """Lookup chains are cut at their first refused token: every draft offered is a valid path."""
    from specdec_kernels.hf import speculative_generate
    from specdec_kernels.hf.drafters import lookup

    target, _, tok = pair
    compiled = compile_grammar('root ::= "ab" ("ab" | "ba")*', tok, VOCAB_SIZE, [EOS_ID])
    offered = []

    def spy(histories, g):
        return [[ord("a"), ord("b"), ord("x"), ord("a")] for _ in histories]  # 'x' is never allowed

    monkeypatch.setattr(lookup, "prompt_lookup", spy)
    seen = lookup.ChainProposal

    def record(drafts, probs=None, n_drafts=None, draft_forwards=0):
        offered.extend(n_drafts.tolist())
        return seen(drafts, probs, n_drafts, draft_forwards)

    monkeypatch.setattr(lookup, "ChainProposal", record)
    batch = tok(["s = "])
    speculative_generate(target, None, **batch, drafter="prompt_lookup", max_new_tokens=6, grammar=compiled)
    assert offered and max(offered) <= 2, offered  # without the cut: 4 (the 'x' and what follows)


def test_grammar_specs():
    assert as_spec(SCHEMA) == GrammarSpec(json_schema=SCHEMA)
    assert as_spec('{"type": "integer"}').json_schema == '{"type": "integer"}'
    assert as_spec('root ::= "a"').ebnf == 'root ::= "a"'
    with pytest.raises(ValueError, match="regex"):
        as_spec("[0-9]+")
    with pytest.raises(ValueError, match="exactly one"):
        GrammarSpec(ebnf='root ::= "a"', regex="a")
    compiled = _compiled(GrammarSpec(regex="[0-9]{2}"))
    assert as_spec(compiled) is compiled
    with pytest.raises(ValueError, match="vocabulary"):
        compile_grammar(compiled, ByteTokenizer(), VOCAB_SIZE + 2, [EOS_ID])


# ---- the driver: speculative_generate(grammar=...) on the demo pair


@pytest.fixture(scope="module")
def pair():
    from specdec_kernels.demo import load_demo_pair

    return load_demo_pair()


GRAMMARS = [
    GrammarSpec(json_schema=SCHEMA, any_whitespace=False),
    'root ::= ("def " | "class ") [a-z_]+ "(" [a-z, ]* "):"',
    GrammarSpec(regex=r"[0-9]{1,3}(\.[0-9]+)? (apples|pears)"),
]


def _valid_prefix(compiled, tokens) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
    return all(matcher.accept_token(t) for t in tokens)


@pytest.mark.parametrize(
    "drafter, K, penalty", [("model", 1, None), ("model", 2, None), ("prompt_lookup", 1, None), ("model", 1, 1.3)]
)
def test_greedy_output_equals_generate_with_xgrammars_processor(pair, drafter, K, penalty):
    """Batch 3, ragged prompts, a different grammar per request (with a repetition penalty: the
    grammar's mask after generate's processors): token for token what generate produces with
    xgrammar's transformers processor; every output a valid prefix of its grammar."""
    from transformers import GenerationConfig

    from specdec_kernels.hf import speculative_generate

    target, draft, tok = pair
    batch = tok(["x = ", "    ", "total = count_of("])
    compiled = [compile_grammar(g, tok, VOCAB_SIZE, [EOS_ID]) for g in GRAMMARS]
    kw = dict(max_new_tokens=24, pad_token_id=EOS_ID, eos_token_id=EOS_ID)
    settings = {} if penalty is None else dict(repetition_penalty=penalty)
    processor = [xgr.contrib.hf.LogitsProcessor(compiled)]
    want = target.generate(**batch, do_sample=False, logits_processor=processor, **settings, **kw)
    got = speculative_generate(
        target,
        draft if drafter == "model" else None,
        **batch,
        drafter=drafter,
        num_drafts=K,
        num_draft_tokens=4,
        grammar=compiled,
        generation_config=GenerationConfig(**settings) if settings else None,
        **kw,
    ).sequences
    width = batch["input_ids"].shape[1]
    for b in range(3):
        ours, theirs = got[b, width:].tolist(), want[b, width:].tolist()
        ours = ours[: ours.index(EOS_ID) + 1] if EOS_ID in ours else ours
        assert ours == theirs[: len(ours)], (b, tok.decode(ours), tok.decode(theirs))
        assert _valid_prefix(compiled[b], ours), tok.decode(ours)


def test_a_completed_json_document_parses(pair):
    import json

    from specdec_kernels.hf import speculative_generate

    target, draft, tok = pair
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    batch = tok(["x = "])
    out = speculative_generate(
        target,
        draft,
        **batch,
        max_new_tokens=40,
        grammar=GrammarSpec(json_schema=schema, any_whitespace=False),
        tokenizer=tok,
        temperature=0.8,
        seed=3,
    )
    text = out.sequences[0, batch["input_ids"].shape[1] :].tolist()
    assert EOS_ID in text, tok.decode(text)  # the grammar ends: only the stop token is allowed
    assert isinstance(json.loads(tok.decode(text[: text.index(EOS_ID)]))["n"], int)


def test_bad_grammar_arguments(pair):
    from specdec_kernels.hf import speculative_generate

    target, draft, tok = pair
    batch = tok(["x = "])
    with pytest.raises(ValueError, match="tokenizer"):
        speculative_generate(target, draft, **batch, max_new_tokens=2, grammar=SCHEMA)
    with pytest.raises(ValueError, match="one grammar per request"):
        speculative_generate(target, draft, **batch, max_new_tokens=2, grammar=[SCHEMA, SCHEMA], tokenizer=tok)
    with pytest.raises(ValueError, match="only with grammar"):
        speculative_generate(target, draft, **batch, max_new_tokens=2, tokenizer=tok)


@pytest.mark.slow
@pytest.mark.parametrize("tree", [{}, dict(draft_tree="dynamic", tree_width=2, num_draft_tokens=6)])
def test_sampled_first_tokens_follow_the_masked_target(pair, tree):
    """The first two emitted tokens of 1,200 sampled requests (T = 1, a regex over digits and
    letters; chains, and dynamic trees of width 2) against the exact law of generate with the
    grammar: the masked target's softmax for the first, and for the second given the first (pairs
    pooled by chi-square's rule). Power: the
    same statistic rejects the law of a verifier that saw unmasked target rows (its first token
    leaves the grammar), as a driver that masked only the draft rows would emit."""
    from scipy import stats as sps

    from specdec_kernels.hf import speculative_generate

    from ..ops._stats import ALPHA, chi_square_pvalue

    target, draft, tok = pair
    spec = GrammarSpec(regex=r"[0-9a-f]{2}[g-z]*")
    compiled = compile_grammar(spec, tok, VOCAB_SIZE, [EOS_ID])
    prompt = tok(["color = 0x"])
    n_calls, B = 6, 200
    batch = {k: v.expand(B, -1).contiguous() for k, v in prompt.items()}
    firsts, pairs = [], []
    for call in range(n_calls):
        out = speculative_generate(
            target, draft, **batch, max_new_tokens=2, grammar=compiled, temperature=1.0, seed=call,
            **({"num_draft_tokens": 3} | tree),
        )  # fmt: skip
        new = out.sequences[:, -2:]
        firsts.append(new[:, 0])
        pairs.append(new)
    first = torch.cat(firsts)
    with torch.no_grad():
        logits = target(**prompt).logits[0, -1, :VOCAB_SIZE].double()
    allowed = _fresh_mask(compiled, [])
    law = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    assert chi_square_pvalue(first, law) > ALPHA
    unmasked = torch.softmax(logits, -1)
    gen = torch.Generator().manual_seed(0)
    variant = torch.multinomial(unmasked, first.numel(), replacement=True, generator=gen)
    assert chi_square_pvalue(variant, law) < ALPHA  # power: a verifier of unmasked rows is seen
    # the second token given the first: each first token's conditional law, chi-square summed
    pairs = torch.cat(pairs)
    statistic, df = 0.0, 0
    for x in first.unique().tolist():
        seconds = pairs[pairs[:, 0] == x, 1]
        if seconds.numel() < 50:
            continue
        with torch.no_grad():
            ids = torch.cat([prompt["input_ids"], torch.tensor([[x]])], 1)
            row = target(input_ids=ids).logits[0, -1, :VOCAB_SIZE].double()
        cond = torch.softmax(row.masked_fill(~_fresh_mask(compiled, [x]), float("-inf")), -1)
        counts = torch.bincount(seconds, minlength=VOCAB_SIZE).double()
        assert not bool((counts[cond == 0] > 0).any())  # never a token the grammar forbids
        expected = cond * seconds.numel()
        big = expected >= 5
        statistic += float((((counts - expected) ** 2 / expected.clamp_min(1e-12))[big]).sum())
        df += int(big.sum()) - 1
    assert df > 0 and sps.chi2.sf(statistic, df) > ALPHA


@pytest.mark.parametrize("K, temperature", [(1, 0.0), (1, 1.0), (2, 1.0)])
def test_the_grammar_alone_hands_its_words_to_the_verifier(pair, monkeypatch, K, temperature):
    """Without other processors the target's rows reach the verifier unmasked, with the grammar's
    words as token_bitmask; the tokens are those of the processor path (the same rows masked by
    the driver: a no-op processor forces it) for the same seed."""
    from specdec_kernels.hf import speculative_generate
    from specdec_kernels.hf.drafters import base

    target, draft, tok = pair
    batch = tok(["x = ", "    ", "total = count_of("])
    compiled = [compile_grammar(g, tok, VOCAB_SIZE, [EOS_ID]) for g in GRAMMARS]
    seen = []
    verify = base.ops.verify if K == 1 else base.ops.verify_multi

    def spy(logits, *args, token_bitmask=None, **kw):
        seen.append((bool(logits.isfinite().all()), token_bitmask))
        assert token_bitmask is not None and token_bitmask.shape[:-1] == logits.shape[:-1]  # a row per target row
        return verify(logits, *args, token_bitmask=token_bitmask, **kw)

    kw = dict(num_drafts=K, num_draft_tokens=3, max_new_tokens=12, grammar=compiled, temperature=temperature, seed=5)
    with monkeypatch.context() as patch:
        patch.setattr(base.ops, "verify" if K == 1 else "verify_multi", spy)
        fused = speculative_generate(target, draft, **batch, **kw).sequences
    assert seen and all(finite and words is not None and words.dtype == torch.int32 for finite, words in seen)
    processed = speculative_generate(target, draft, **batch, **kw, logits_processor=[lambda ids, scores: scores])
    assert torch.equal(fused, processed.sequences)


# ---- dynamic draft trees (draft_tree="dynamic") under a grammar


def _dynamic_tree_run(pair, grammars, monkeypatch, **kw):
    """Batch 2 (ragged), width 2, N = 6; every tree node the verifier sees is allowed by the mask
    of the row it is a candidate at (its parent's: the draft drew it from its masked row, whose
    probabilities are 0 outside the mask), and the verifier gets the words [A, N+1, W] with
    unmasked target rows."""
    from specdec_kernels.hf import speculative_generate
    from specdec_kernels.hf.drafters import DynamicTreeDrafter, base

    target, draft, tok = pair
    batch = tok(["x = ", "total = count_of("])  # ragged
    compiled = [compile_grammar(g, tok, VOCAB_SIZE, [EOS_ID]) for g in grammars]
    verify_tree, trees = base.ops.verify_tree, []

    def spy(logits, tokens, parents, *args, token_bitmask=None, num_nodes=None, **kw):
        assert bool(logits.isfinite().all()) and token_bitmask.shape[:2] == logits.shape[:2]
        allowed_rows = allowed(token_bitmask, VOCAB_SIZE)
        for a in range(tokens.shape[0]):
            for i in range(int(num_nodes[a])):
                row = allowed_rows[a, int(parents[a, i]) + 1]
                assert bool(row[int(tokens[a, i])]), (a, i)
                if "draft_probs" in kw:  # the law it was drawn from: the masked draft row
                    assert float(kw["draft_probs"][a, i][~row].sum()) == 0.0, (a, i)
        trees.append(int(num_nodes.max()))
        return verify_tree(logits, tokens, parents, *args, token_bitmask=token_bitmask, num_nodes=num_nodes, **kw)

    monkeypatch.setattr(base.ops, "verify_tree", spy)
    looked = []  # the lookup branches' nodes per step (prompt_lookup=True)
    branch = DynamicTreeDrafter._lookup_branch

    def lookup_spy(self, session):
        made = branch(self, session)
        looked.append(sum(self.lookup_nodes))
        return made

    monkeypatch.setattr(DynamicTreeDrafter, "_lookup_branch", lookup_spy)
    out = speculative_generate(
        target, draft, **batch, draft_tree="dynamic", tree_width=2, num_draft_tokens=6, grammar=compiled,
        max_new_tokens=20, pad_token_id=EOS_ID, eos_token_id=EOS_ID, **kw,
    )  # fmt: skip
    # trees (not only chains) were verified; greedy adaptive budgets follow measured times: not checked
    assert trees and (kw.get("adaptive_draft") is True or max(trees) > 1)
    assert sum(looked) > 0 if kw.get("prompt_lookup") else not looked
    width = batch["input_ids"].shape[1]
    outputs = []
    for b in range(len(grammars)):
        ours = out.sequences[b, width:].tolist()
        ours = ours[: ours.index(EOS_ID) + 1] if EOS_ID in ours else ours
        assert _valid_prefix(compiled[b], ours), tok.decode(ours)
        outputs.append(ours)
    return batch, compiled, out, outputs


@pytest.mark.parametrize("adaptive, lookup", [(False, False), (True, False), (False, True)])
def test_dynamic_tree_greedy_equals_generate_with_xgrammars_processor(pair, monkeypatch, adaptive, lookup):
    """Batch 2, ragged, width 2, N = 6 (the pinned tree, and the adaptive budget with its chain
    arms; with the prompt-lookup branch, cut where the grammar refuses it): token for token
    generate's output with xgrammar's processor; every output valid."""
    target, _, tok = pair
    batch, compiled, out, outputs = _dynamic_tree_run(
        pair, GRAMMARS[1:], monkeypatch, adaptive_draft=adaptive, prompt_lookup=lookup
    )
    processor = [xgr.contrib.hf.LogitsProcessor(compiled)]
    want = target.generate(
        **batch, do_sample=False, logits_processor=processor, max_new_tokens=20, pad_token_id=EOS_ID,
        eos_token_id=EOS_ID,
    )  # fmt: skip
    width = batch["input_ids"].shape[1]
    for b, ours in enumerate(outputs):
        theirs = want[b, width:].tolist()
        assert ours == theirs[: len(ours)], (b, tok.decode(ours), tok.decode(theirs))
    assert out.stats.accepted > 0


@pytest.mark.parametrize("seed, lookup", [(0, False), (1, False), (0, True)])
def test_dynamic_tree_sampled_outputs_are_valid(pair, monkeypatch, seed, lookup):
    """Sampled (T = 0.9, top-p 0.95): every output a valid prefix of its grammar (the drafts are
    drawn from the masked draft rows, the lookup branch cut where the grammar refuses it: no node
    leaves the grammar), and drafts get accepted."""
    kw = dict(temperature=0.9, top_p=0.95, seed=seed, prompt_lookup=lookup)
    _, _, out, _ = _dynamic_tree_run(pair, GRAMMARS[:2], monkeypatch, **kw)
    assert out.stats.accepted > 0
