"""Logits processors under speculation: every row processed with the exact prefix it follows.

``generate`` samples position t from f(prefix_t, logits_t): its processors (repetition penalty,
n-gram bans, min length, ...), then, when sampling, its warpers (temperature, top-k, top-p, min-p,
typical, epsilon, eta), in ``generate``'s order. Under speculation, row t of the target's
verification forward follows the committed tokens plus the drafts before it (for K chains or a
tree: its own path), so :class:`RowProcessor` calls the processors once per row with exactly that
prefix, as ``generate`` lays it out (the prompt as given, left padding included, then the generated
tokens). The draft model's rows are processed the same way with the prefix the draft sampled under,
and the draft samples from that processed law and hands exactly it to the verifier (``draft_probs``).
The kernels then see already-processed logits: temperature 1 (0 when greedy), no top-k / top-p.

A call without processors keeps the fused path: no RowProcessor is built and nothing here runs.
Cost when used: one processor call per row on the host prefix (a host read of the drafts per
draft depth and per step): settings such as these are for correctness first.
"""

from __future__ import annotations

import torch

# Settings of a GenerationConfig that the driver applies as generate does (when each is on: ``_on``,
# the conditions of transformers' _get_logits_processor); the warpers only when sampling.
PROCESSOR_SETTINGS = (
    "sequence_bias",
    "repetition_penalty",
    "no_repeat_ngram_size",
    "bad_words_ids",
    "min_length",
    "min_new_tokens",
    "forced_eos_token_id",
    "suppress_tokens",
    "begin_suppress_tokens",
)
WARPER_SETTINGS = ("min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")


# Processors whose output depends on more than (the row's prefix, its scores): a batch index, other
# rows, a model call or a random key. The driver cannot call them row by row exactly.
_ROW_UNSAFE = (
    "PrefixConstrainedLogitsProcessor",  # its function takes the batch index
    "UnbatchedClassifierFreeGuidanceLogitsProcessor",  # runs the model on its own cache
    "ClassifierFreeGuidanceLogitsProcessor",  # pairs rows of the batch
    "WatermarkLogitsProcessor",  # keyed on a random seed state
    "SynthIDTextWatermarkLogitsProcessor",
)


def check_processors(logits_processor, cfg) -> None:
    """A ValueError naming what the driver cannot apply row by row exactly."""
    if logits_processor is None:
        return
    if not isinstance(logits_processor, (list, tuple)):
        raise TypeError(f"logits_processor must be a list (LogitsProcessorList), got {type(logits_processor).__name__}")
    for proc in logits_processor:
        name = type(proc).__name__
        if not callable(proc):
            raise TypeError(f"logits_processor entries must be callables (input_ids, scores) -> scores, got {name}")
        if name in _ROW_UNSAFE:
            raise ValueError(
                f"logits_processor: {name} is not a function of (the row's prefix, its scores); "
                "speculative decoding cannot apply it exactly"
            )


def _processors_for(config, pad_len: int, width: int, max_length: int, eos: list[int]) -> list:
    """generate's processors for one request (``pad_len`` left pads in a prompt of ``width``
    columns), in generate's order."""
    from transformers.generation import logits_process as lp

    out = []
    if config is None:
        return out
    if config.sequence_bias is not None:
        out.append(lp.SequenceBiasLogitsProcessor(sequence_bias=config.sequence_bias))
    if config.repetition_penalty is not None and config.repetition_penalty != 1.0:
        # generate ignores the left padding (prompt_ignore_length = the row's pad count)
        out.append(lp.RepetitionPenaltyLogitsProcessor(config.repetition_penalty, prompt_ignore_length=pad_len))
    if config.no_repeat_ngram_size is not None and config.no_repeat_ngram_size > 0:
        out.append(lp.NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    if config.bad_words_ids is not None:
        out.append(lp.NoBadWordsLogitsProcessor(config.bad_words_ids, eos or None))
    if eos and config.min_length is not None and config.min_length > 0:
        out.append(lp.MinLengthLogitsProcessor(config.min_length, eos))
    if eos and config.min_new_tokens is not None and config.min_new_tokens > 0:
        out.append(lp.MinNewTokensLengthLogitsProcessor(width, config.min_new_tokens, eos))
    if config.forced_eos_token_id is not None:
        out.append(lp.ForcedEOSTokenLogitsProcessor(max_length, config.forced_eos_token_id))
    if config.suppress_tokens is not None:
        out.append(lp.SuppressTokensLogitsProcessor(config.suppress_tokens))
    if config.begin_suppress_tokens is not None:
        out.append(lp.SuppressTokensAtBeginLogitsProcessor(config.begin_suppress_tokens, width))
    return out


def _warpers(config, temperature: float, top_k: int, top_p: float) -> list:
    """generate's warpers (sampling only), in its order; min_tokens_to_keep = 1 (no beams)."""
    from transformers.generation import logits_process as lp

    out = []
    if temperature != 1.0:
        out.append(lp.TemperatureLogitsWarper(temperature))
    if top_k != 0:
        out.append(lp.TopKLogitsWarper(top_k=top_k))
    if top_p < 1.0:
        out.append(lp.TopPLogitsWarper(top_p=top_p))
    if config is None:
        return out
    if config.min_p is not None:
        out.append(lp.MinPLogitsWarper(min_p=config.min_p))
    if config.typical_p is not None and config.typical_p < 1.0:
        out.append(lp.TypicalLogitsWarper(mass=config.typical_p))
    if config.epsilon_cutoff is not None and 0.0 < config.epsilon_cutoff < 1.0:
        out.append(lp.EpsilonLogitsWarper(epsilon=config.epsilon_cutoff))
    if config.eta_cutoff is not None and 0.0 < config.eta_cutoff < 1.0:
        out.append(lp.EtaLogitsWarper(epsilon=config.eta_cutoff))
    return out


def _active_settings(config, sampling: bool) -> list[str]:
    if config is None:
        return []
    names = [name for name in PROCESSOR_SETTINGS if _on(name, getattr(config, name, None))]
    if sampling:
        names += [name for name in WARPER_SETTINGS if _on(name, getattr(config, name, None))]
    return names


def _on(name: str, value) -> bool:
    if value is None:
        return False
    if name == "repetition_penalty":
        return value != 1.0
    if name == "typical_p":
        return value < 1.0
    if name in ("epsilon_cutoff", "eta_cutoff"):
        return 0.0 < value < 1.0
    if name in ("no_repeat_ngram_size", "min_length", "min_new_tokens"):
        return value > 0
    return not (isinstance(value, (list, tuple, dict)) and len(value) == 0)


class RowProcessor:
    """Applies each request's processor list to rows of logits, each with its own prefix."""

    def __init__(self, lists: dict, keys: list[int], padded: list[list[int]], prompt_lens: list[int], warp=None):
        self.lists = lists  # key -> LogitsProcessorList (requests with the same left padding share one)
        self.warp = warp  # the warpers (sampling only), after the lists and the session's grammar mask
        self.keys = keys  # [B] request b's key (its pad count)
        self.padded = padded  # [B] the prompt as given (left padding included): what generate's rows start with
        self.prompt_lens = prompt_lens  # [B] real prompt tokens (the history's prompt part)

    @classmethod
    def build(cls, logits_processor, generation_config, cfg, input_ids, attention_mask):
        """None when no processor is active (the fused path; a grammar alone is applied by the
        session, its words handed to the verifier); else the per-request processors followed (when
        sampling) by the warpers, with generate's layout of each row's prefix."""
        sampling = not cfg.greedy
        user = list(logits_processor or [])
        if not user and not _active_settings(generation_config, sampling):
            return None
        from transformers import LogitsProcessorList

        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        width = input_ids.shape[1]
        pads = (width - mask.bool().long().sum(dim=1)).tolist()
        eos = sorted(cfg.eos)
        max_length = width + cfg.max_new_tokens
        warp = _warpers(generation_config, cfg.temperature, cfg.top_k, cfg.top_p) if sampling else []
        lists = {
            pad: LogitsProcessorList(_processors_for(generation_config, pad, width, max_length, eos) + user)
            for pad in sorted(set(pads))
        }
        return cls(lists, pads, input_ids.tolist(), [width - p for p in pads], LogitsProcessorList(warp))

    def prefix(self, session, b: int) -> list[int]:
        """Request b's committed tokens as generate holds them: padded prompt + generated."""
        return self.padded[b] + session.tokens.history[b][self.prompt_lens[b] :]

    def __call__(self, session, logits: torch.Tensor, paths: list[list[list[int]]]) -> torch.Tensor:
        """Processed fp32 logits [A, R, V] of ``logits`` [A, R, V]; row (a, r) follows the committed
        tokens of active request a plus ``paths[a][r]``. Rows of one processor list and one prefix
        length go through it as one batch (each processor is row-wise, as in generate)."""
        out = logits.float().clone()
        groups: dict[tuple[int, int], list] = {}
        for a, b in enumerate(session.batch.rows):
            base = self.prefix(session, b)
            for r, path in enumerate(paths[a]):
                ids = base + path
                groups.setdefault((self.keys[b], len(ids)), []).append((a, r, ids))
        for (key, _), members in groups.items():
            a_idx = torch.tensor([m[0] for m in members], device=logits.device)
            r_idx = torch.tensor([m[1] for m in members], device=logits.device)
            ids = torch.tensor([m[2] for m in members], dtype=torch.long, device=logits.device)
            out[a_idx, r_idx] = self.lists[key](ids, out[a_idx, r_idx]).float()
        if session.grammar is not None:  # where generate applies xgrammar's processor: before the warpers
            out = session.grammar(session, out, paths)
        if self.warp:  # row-wise: they read the scores only
            A, R, V = out.shape
            out = self.warp(torch.zeros((A * R, 1), dtype=torch.long, device=out.device), out.view(A * R, V))
            out = out.view(A, R, V).float()
        return out


def node_paths(tokens: torch.Tensor, parents: torch.Tensor) -> list[list[list[int]]]:
    """Per request, the draft tokens on the path to each forward node (root: []): tokens [A, N] below
    the root, parents [A, 1 + N] forward indices (root first, -1)."""
    tok, par = tokens.tolist(), parents.tolist()
    paths = []
    for t_row, p_row in zip(tok, par, strict=True):
        rows: list[list[int]] = [[]]
        for j in range(1, len(p_row)):
            rows.append(rows[max(p_row[j], 0)] + [t_row[j - 1]])
        paths.append(rows)
    return paths
