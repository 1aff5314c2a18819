"""hf/grammar.py: xgrammar masks per position, rollback to the committed state, spec parsing."""

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from specdec_kernels.demo import EOS_ID, VOCAB_SIZE, ByteTokenizer  # noqa: E402
from specdec_kernels.hf.grammar import (  # noqa: E402
    GrammarSpec,
    GrammarState,
    as_spec,
    compile_grammar,
    unpack_bitmask,
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
    return unpack_bitmask(words[0], VOCAB_SIZE)


def test_unpack_bitmask_agrees_with_xgrammar_apply():
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (3, 9), generator=gen, dtype=torch.int64).to(torch.int32)
    logits = torch.zeros(3, VOCAB_SIZE)
    xgr.apply_token_bitmask_inplace(logits, words)
    assert torch.equal(unpack_bitmask(words, VOCAB_SIZE), logits == 0)


def test_masks_along_a_path_and_the_rollback_leave_the_committed_state():
    compiled = _compiled()
    state = GrammarState(compiled, 2, VOCAB_SIZE)
    committed = list(b'{"name": "a')
    state.commit(0, committed)
    path = list(b'b", "n": 1')
    masks, valid = state.masks_along(0, path)
    assert valid == len(path)
    for i in range(len(path) + 1):
        assert torch.equal(masks[i], _fresh_mask(compiled, committed + path[:i])), i
    assert torch.equal(state.masks_along(0, [])[0][0], _fresh_mask(compiled, committed))  # rolled back
    bad, valid = state.masks_along(0, list(b'b"}x'))  # "n" is required: no '}' after the name
    assert valid == 2 and not bad[valid + 1 :].any()
    assert torch.equal(state.masks_along(1, [])[0][0], _fresh_mask(compiled, []))  # other requests untouched


def test_a_finished_grammar_allows_only_the_stop_token():
    compiled = _compiled('root ::= "yes" | "no"')
    state = GrammarState(compiled, 1, VOCAB_SIZE)
    masks, valid = state.masks_along(0, list(b"no") + [EOS_ID])
    assert valid == 3
    assert masks[2].nonzero().flatten().tolist() == [EOS_ID]
    assert not masks[3].any()  # terminated


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
