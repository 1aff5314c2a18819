"""Grammar constraints with xgrammar (the ``grammar`` extra): masks per position, exact rollback.

A grammar constrains generation as a logits processor does: the target's row at each position is
masked (disallowed tokens to -inf) before temperature / top-k / top-p - the order ``generate``
applies a ``logits_processor`` such as ``xgrammar.contrib.hf.LogitsProcessor`` in. The mask of a
position is a function of the token prefix, so under speculation every row gets the mask of the
exact prefix it follows: the committed tokens plus the drafts before it on its own path. The draft
samples under the same masks (a draft row i follows the same prefix as target row i), so the
drafts are valid by construction and the verifier sees exactly the distribution they came from.

Masks are xgrammar's own int32 bitmask words (``_bitmask``'s layout). Without other processors the
target's logits are not touched: the words go to the verifier as ``token_bitmask=`` (the kernels
apply them before temperature / top-k / top-p), and only the draft's rows are masked here (the
draft samples from its masked law). With other processors the mask sits between them and the
warpers inside ``processors.RowProcessor``, which masks the target's rows too.

``GrammarState`` keeps one ``xgrammar.GrammarMatcher`` per request at its committed tokens: the
masks along a path are filled by accepting the path's tokens one by one and rolling them back
(``rollback``), so the matcher always ends in the state of the committed tokens. ``GrammarMasker``
keeps the words of every prefix it filled until the next commit, so the target's rows reuse the
draft's (a prefix is filled once per step).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from .._bitmask import BITS_PER_WORD, allowed, num_words, pack

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


class GrammarState:
    """One matcher per request at its committed tokens; the mask words of any path from there."""

    def __init__(self, compiled: list, vocab_size: int):
        """compiled: one compiled grammar per request."""
        xgr = _xgrammar()
        self.V = vocab_size
        self.matchers = [xgr.GrammarMatcher(c) for c in compiled]
        self._words = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32: _bitmask's layout
        stops = sorted({t for c in compiled for t in c.tokenizer_info.stop_token_ids if 0 <= t < vocab_size})
        # Rows past a request's stop token (drafts after an EOS) are cut by the commit; they allow
        # the stop tokens so that they stay distributions.
        after_end = torch.zeros(vocab_size, dtype=torch.bool)
        after_end[stops] = True
        self._after_end = pack(after_end)

    def fill(self, b: int) -> torch.Tensor:
        """int32 [W]: the words of request b's matcher in its current state."""
        matcher = self.matchers[b]
        if matcher.is_terminated():  # past its stop token: rows the commit cuts at the EOS
            return self._after_end.clone()
        matcher.fill_next_token_bitmask(self._words)
        return self._words[0].clone()

    def words_along(self, b: int, tokens: list[int], known: dict | None = None) -> tuple[torch.Tensor, int]:
        """(int32 [len(tokens) + 1, W] words after each prefix of `tokens`, valid): `valid` = how many
        of the tokens the grammar accepts in a row; words past them are 0 (nothing allowed). The
        matcher ends where it started (the committed tokens). known: prefix (tuple) -> words, read
        instead of filling and completed with what is filled."""
        known = {} if known is None else known
        words = torch.zeros((len(tokens) + 1, num_words(self.V)), dtype=torch.int32)
        matcher, valid = self.matchers[b], 0
        try:
            for i in range(len(tokens) + 1):
                prefix = tuple(tokens[:i])
                if prefix not in known:
                    known[prefix] = self.fill(b)
                words[i] = known[prefix]
                if i == len(tokens) or matcher.is_terminated() or not _allows(words[i], tokens[i], self.V):
                    break
                if not matcher.accept_token(int(tokens[i])):
                    break
                valid += 1
        finally:
            if valid:
                matcher.rollback(valid)
        return words, valid

    def commit(self, b: int, tokens: list[int]) -> None:
        """Advance request b's matcher over its emitted tokens (verified: each is allowed)."""
        matcher = self.matchers[b]
        for token in tokens:
            if matcher.is_terminated():
                return
            if not matcher.accept_token(int(token)):
                raise RuntimeError(f"grammar: emitted token {token} is not allowed (a verification bug)")


def _allows(words: torch.Tensor, token: int, V: int) -> bool:
    """Token ``token`` is allowed by mask words [W] (ids outside [0, V) never are)."""
    return 0 <= token < V and bool((int(words[token // BITS_PER_WORD]) >> (token % BITS_PER_WORD)) & 1)


class GrammarMasker:
    """The grammar's masks of the session's rows: ``words(session, paths)`` gives the int32 words
    [A, R, W] of row (a, r), the mask after active request a's committed tokens plus ``paths[a][r]``
    (the verifier's ``token_bitmask``); ``masker(session, logits, paths)`` masks logits [A, R, V]
    with them (disallowed -> -inf: the draft's rows, and the target's inside a RowProcessor);
    ``commit`` advances the matchers after each step.

    A path the grammar refuses (a draft token it does not allow) leads to a row no verification can
    reach (that token has probability 0 in its own row): such rows allow everything."""

    def __init__(self, compiled: list, vocab_size: int):
        self.state = GrammarState(compiled, vocab_size)
        self._known: list[dict] = [{} for _ in compiled]  # per request: prefix -> words, until the next commit
        self._all = torch.full((num_words(vocab_size),), -1, dtype=torch.int32)  # every bit set

    def masks(self, b: int, paths: list[list[int]]) -> torch.Tensor:
        """int32 [len(paths), W]: the words after each path (all bits set where the path is refused)."""
        out = self._all.expand(len(paths), -1).clone()
        for r, path in enumerate(paths):
            words, valid = self.state.words_along(b, path, self._known[b])
            if valid == len(path):
                out[r] = words[valid]
        return out

    def valid_prefix(self, b: int, tokens: list[int]) -> int:
        """How many of ``tokens`` (after request b's committed ones) the grammar accepts in a row."""
        return self.state.words_along(b, list(tokens), self._known[b])[1]

    def words(self, session, paths: list[list[list[int]]]) -> torch.Tensor:
        """int32 [A, R, W] on the session's device: the words of every row (see the class)."""
        rows = [self.masks(b, paths[a]) for a, b in enumerate(session.batch.rows)]
        return torch.stack(rows).to(session.device)

    def __call__(self, session, logits: torch.Tensor, paths: list[list[list[int]]]) -> torch.Tensor:
        keep = allowed(self.words(session, paths), self.state.V).to(logits.device)
        return logits.masked_fill(~keep, float("-inf"))

    def commit(self, rows: list[int], emitted: list[list[int]]) -> None:
        for b, tokens in zip(rows, emitted, strict=True):
            self.state.commit(b, tokens)
            self._known[b].clear()
