"""Grammar constraints with xgrammar (the ``grammar`` extra): masks per position, exact rollback.

A grammar constrains generation as a logits processor does: the target's row at each position is
masked (disallowed tokens to -inf) before temperature / top-k / top-p - the order ``generate``
applies a ``logits_processor`` such as ``xgrammar.contrib.hf.LogitsProcessor`` in. The mask of a
position is a function of the token prefix, so under speculation every row gets the mask of the
exact prefix it follows: the committed tokens plus the drafts before it on its own path. The draft
samples under the same masks (a draft row i follows the same prefix as target row i), so the
drafts are valid by construction and the verifier sees exactly the distribution they came from.

``GrammarState`` keeps one ``xgrammar.GrammarMatcher`` per request at its committed tokens: the
masks along a path are filled by accepting the path's tokens one by one and rolling them back
(``rollback``), so the matcher always ends in the state of the committed tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

GRAMMAR_EXTRA = 'pip install -e ".[grammar]"  (or: pip install xgrammar)'


def _xgrammar():
    try:
        import xgrammar
    except ImportError as err:  # pragma: no cover - the grammar extra is installed in CI
        raise ImportError(f"grammar= needs xgrammar: {GRAMMAR_EXTRA}") from err
    return xgrammar


@dataclass(frozen=True)
class GrammarSpec:
    """An explicit grammar: exactly one of a JSON schema, an EBNF (GBNF) text, or a regex."""

    json_schema: dict | str | None = None
    ebnf: str | None = None
    regex: str | None = None
    any_whitespace: bool = True  # JSON schemas: xgrammar's default (False: compact JSON only)

    def __post_init__(self):
        given = [name for name in ("json_schema", "ebnf", "regex") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"GrammarSpec takes exactly one of json_schema, ebnf, regex; got {given or 'none'}")


def as_spec(grammar) -> GrammarSpec | object:
    """A GrammarSpec from what ``grammar=`` accepts (a compiled grammar is returned as it is):
    a dict (JSON schema), a string holding a JSON object (JSON schema), a string with a ``::=``
    rule (EBNF); anything else is ambiguous and raises (wrap it: ``GrammarSpec(regex=...)``)."""
    xgr = _xgrammar()
    if isinstance(grammar, GrammarSpec | xgr.CompiledGrammar):
        return grammar
    if isinstance(grammar, dict):
        return GrammarSpec(json_schema=grammar)
    if isinstance(grammar, str):
        try:
            parsed = json.loads(grammar)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            return GrammarSpec(json_schema=grammar)
        if "::=" in grammar:
            return GrammarSpec(ebnf=grammar)
        raise ValueError(
            "grammar: a string must be a JSON schema (a JSON object) or an EBNF grammar (with '::=' rules); "
            "for a regex pass GrammarSpec(regex=...)"
        )
    raise ValueError(
        f"grammar must be a JSON schema (dict or str), an EBNF str, a GrammarSpec or an xgrammar.CompiledGrammar, "
        f"got {type(grammar).__name__}"
    )


def tokenizer_info(tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """xgrammar's view of the vocabulary: a tokenizer's ``raw_vocab`` (the bytes of every id, b""
    for special ids; the demo pair's ``ByteTokenizer`` has one) or a Hugging Face tokenizer's."""
    xgr = _xgrammar()
    raw = getattr(tokenizer, "raw_vocab", None)
    if raw is not None:
        vocab = list(raw) + [b""] * max(0, vocab_size - len(raw))  # ids past it: special, never text
        return xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    # no EOS known: xgrammar reads the tokenizer's own
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None)


def compile_grammar(grammar, tokenizer, vocab_size: int, stop_token_ids: list[int]):
    """An ``xgrammar.CompiledGrammar`` for ``grammar=`` (see ``as_spec``) over the model's vocabulary."""
    xgr = _xgrammar()
    spec = as_spec(grammar)
    if isinstance(spec, xgr.CompiledGrammar):
        if spec.tokenizer_info.vocab_size != vocab_size:
            compiled_for = spec.tokenizer_info.vocab_size
            raise ValueError(f"grammar: compiled for a vocabulary of {compiled_for} ids, the model has {vocab_size}")
        return spec
    if tokenizer is None:
        raise ValueError("grammar= needs the tokenizer (tokenizer=...) to compile the grammar over the vocabulary")
    compiler = xgr.GrammarCompiler(tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads=1)
    try:
        if spec.json_schema is not None:
            schema = spec.json_schema if isinstance(spec.json_schema, str) else json.dumps(spec.json_schema)
            return compiler.compile_json_schema(schema, any_whitespace=spec.any_whitespace)
        if spec.ebnf is not None:
            return compiler.compile_grammar(spec.ebnf)
        return compiler.compile_regex(spec.regex)
    except (RuntimeError, ValueError) as err:  # xgrammar's parse errors
        raise ValueError(f"grammar: xgrammar cannot compile it: {str(err).strip().splitlines()[0]}") from err


def compile_grammars(grammar, tokenizer, vocab_size: int, stop_token_ids: list[int], batch: int) -> list:
    """One compiled grammar per request: ``grammar`` for all, or a list of ``batch`` grammars."""
    if isinstance(grammar, list | tuple):
        if len(grammar) != batch:
            raise ValueError(f"grammar: a list needs one grammar per request ({batch}), got {len(grammar)}")
        return [compile_grammar(g, tokenizer, vocab_size, stop_token_ids) for g in grammar]
    return [compile_grammar(grammar, tokenizer, vocab_size, stop_token_ids)] * batch


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [..., V] from int32 bitmask words [..., ceil(V / 32)]: bit j of word w = token 32 w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    bits = (words[..., :, None] >> shifts) & 1
    return bits.reshape(*words.shape[:-1], -1)[..., :vocab_size].bool()


class GrammarState:
    """One matcher per request at its committed tokens; masks of any path from there."""

    def __init__(self, compiled: list, vocab_size: int):
        """compiled: one compiled grammar per request."""
        xgr = _xgrammar()
        self.V = vocab_size
        self.matchers = [xgr.GrammarMatcher(c) for c in compiled]
        self._words = xgr.allocate_token_bitmask(1, vocab_size)
        stops = sorted({t for c in compiled for t in c.tokenizer_info.stop_token_ids if 0 <= t < vocab_size})
        # Rows past a request's stop token (drafts after an EOS) are cut by the commit; they allow
        # the stop tokens so that they stay distributions.
        self._after_end = torch.zeros(vocab_size, dtype=torch.bool)
        self._after_end[stops] = True

    def _fill(self, b: int) -> torch.Tensor:
        matcher = self.matchers[b]
        if matcher.is_terminated():  # past its stop token: rows the commit cuts at the EOS
            return self._after_end.clone()
        matcher.fill_next_token_bitmask(self._words)
        return unpack_bitmask(self._words[0], self.V)

    def masks_along(self, b: int, tokens: list[int]) -> tuple[torch.Tensor, int]:
        """(bool [len(tokens) + 1, V] masks after each prefix of `tokens`, valid): `valid` = how many
        of the tokens the grammar accepts in a row; masks past them are all False. The matcher ends
        where it started (the committed tokens)."""
        masks = torch.zeros((len(tokens) + 1, self.V), dtype=torch.bool)
        matcher, valid = self.matchers[b], 0
        masks[0] = self._fill(b)
        for token in tokens:
            if matcher.is_terminated() or not (0 <= token < self.V and bool(masks[valid, token])):
                break
            if not matcher.accept_token(int(token)):
                break
            valid += 1
            masks[valid] = self._fill(b)
        if valid:
            matcher.rollback(valid)
        return masks, valid

    def commit(self, b: int, tokens: list[int]) -> None:
        """Advance request b's matcher over its emitted tokens (verified: each is allowed)."""
        matcher = self.matchers[b]
        for token in tokens:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(int(token)):
                raise RuntimeError(f"grammar: emitted token {token} is not allowed (a verification bug)")


class GrammarMasker:
    """The grammar as a row processor of the session: ``masker(session, logits, paths)`` masks row
    (a, r) of logits [A, R, V] with the mask of active request a's committed tokens plus
    ``paths[a][r]`` (disallowed -> -inf); ``commit`` advances the matchers after each step.

    A path the grammar refuses (a draft token it does not allow) leads to a row no verification can
    reach (that token has probability 0 in its own row): such rows are left as they are."""

    def __init__(self, compiled: list, vocab_size: int):
        self.state = GrammarState(compiled, vocab_size)

    def masks(self, b: int, paths: list[list[int]]) -> torch.Tensor:
        """bool [len(paths), V]: the mask after each path (all True where the path is refused)."""
        known: dict[tuple, torch.Tensor] = {}
        out = torch.ones((len(paths), self.state.V), dtype=torch.bool)
        for r in sorted(range(len(paths)), key=lambda r: -len(paths[r])):  # longest first: prefixes reuse
            path = tuple(paths[r])
            if path not in known:
                masks, valid = self.state.masks_along(b, list(path))
                for i in range(valid + 1):
                    known.setdefault(path[:i], masks[i])
            if path in known:
                out[r] = known[path]
        return out

    def valid_prefix(self, b: int, tokens: list[int]) -> int:
        """How many of ``tokens`` (after request b's committed ones) the grammar accepts in a row."""
        return self.state.masks_along(b, list(tokens))[1]

    def __call__(self, session, logits: torch.Tensor, paths: list[list[list[int]]]) -> torch.Tensor:
        allowed = torch.stack([self.masks(b, paths[a]) for a, b in enumerate(session.batch.rows)])
        return logits.masked_fill(~allowed.to(logits.device), float("-inf"))

    def commit(self, rows: list[int], emitted: list[list[int]]) -> None:
        for b, tokens in zip(rows, emitted, strict=True):
            self.state.commit(b, tokens)
