"""Speculative decoding of Hugging Face causal LMs with the fused verification kernels.

One step, for the active requests of the batch (``hf/session.py``): the drafter proposes
(``hf/drafters``: draft-model chains, prompt lookup or Medusa heads), the target scores the root (last
committed token) and every draft in **one** forward, the fused kernels verify (``sk.verify`` /
``sk.verify_multi`` for chains, ``sk.verify_tree`` for trees): accepted drafts plus one
recovered-or-bonus token per request; then target and drafter commit the accepted path. The call's
settings are checked once (:class:`~specdec_kernels.hf.config.SpecConfig`); its counters are
:class:`~specdec_kernels.hf.stats.SpeculativeStats`.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch

from .attention import using_tree_attention
from .config import CACHE_IMPLEMENTATIONS, DRAFTERS, SpecConfig
from .config import vocab_rows as _vocab_rows  # noqa: F401 (cli.py and bench import it from here)
from .drafters import build_drafter
from .forwards import compiled_forward
from .session import Session
from .settings import reject_active_settings
from .stats import PHASES, PhaseTimer, SpeculativeOutput, SpeculativeStats

__all__ = [
    "CACHE_IMPLEMENTATIONS",
    "DRAFTERS",
    "PHASES",
    "SpeculativeOutput",
    "SpeculativeStats",
    "open_session",
    "speculative_generate",
]


def speculative_generate(
    target,
    draft,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 128,
    num_draft_tokens: int = 4,
    num_drafts: int = 1,
    method: str | None = None,
    drafter: str = "model",
    medusa_heads=None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    top_p_ties: str = "by_index",
    seed: int | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer=None,
    vocab_size: int | None = None,
    attention_backend: str = "auto",
    cache_implementation: str = "dynamic",
    compile_target: bool | dict = False,
    adaptive_draft: bool = True,
    draft_confidence: float = 0.0,
    exact_timing: bool = False,
    draft_cost: float | str | None = None,
    logits_processor=None,
    generation_config=None,
    grammar=None,
    tokenizer=None,
    verification: str = "token",
    draft_tree: str | None = None,
    tree_width: int | None = None,
    prompt_lookup: bool = False,
    tree_threshold: float | None = None,
    draft_vocab=None,
) -> SpeculativeOutput:
    """Generate with a draft model (or prompt lookup) and exact verification by the target.

    Args:
        target, draft: ``transformers`` causal LMs sharing a vocabulary; ``draft=None`` with
            ``drafter="prompt_lookup"`` or ``drafter="medusa"``.
        input_ids:      [B, T] int64 prompts, left-padded when ragged (as for ``generate``).
        attention_mask: [B, T], 1 for real tokens; 0s only on the left (left padding).
        num_draft_tokens: G, drafts per chain and step (the maximum when ``adaptive_draft``).
            num_drafts: K chains (K > 1: a tree, verified with ``method`` "kseq" (SpecTr K-SEQ),
            "rrs" or "rrs_wor"; default "kseq"). 1 + K*G <= 64.
        drafter: "model" (the draft model), "prompt_lookup" (n-grams of each request's own tokens) or
            "medusa" (``medusa_heads``, a :class:`specdec_kernels.hf.medusa.MedusaHeads` on the target's
            last hidden state): ``num_draft_tokens`` = N tree nodes besides the root (1 + N <= 64),
            ``num_drafts`` = s candidates per head (top-s, or s draws without replacement when sampling),
            the N best nodes of the heads' product, verified with ``method="rrs_wor"`` (``hf/medusa.py``).
        temperature, top_k, top_p: the target's sampling; temperature 0 = greedy (output identical to
            ``target.generate(do_sample=False)``). Sampled output is exactly target-distributed.
        top_p_ties: the tokens kept from the tie group at the top-p boundary (``sk.verify``):
            "by_index" (default) as ``target.generate``'s TopPLogitsWarper (the higher token index
            counts as more probable; the Triton kernels on a GPU, the CPU build on CPU tensors);
            "keep" keeps the whole group.
        seed: reproducible sampling. eos/pad_token_id: the target's generation config's. streamer: batch 1.
        vocab_size: the real token count when the models' embeddings are padded (``len(tokenizer)``).
        attention_backend: tree attention of the forwards: "auto" (Triton on CUDA, SDPA on CPU), "triton", "torch".
        cache_implementation: "dynamic" (``DynamicCache``, grown and cropped every step) or "static"
            (``StaticCache`` of max prompt + ``max_new_tokens`` + K*G + 2 slots per request, allocated
            once; the committed path is moved in place and the buffers never change address).
        compile_target: ``torch.compile`` the target's verification forward as one graph
            (``fullgraph=True``; on CUDA ``mode="reduce-overhead"``, i.e. CUDA graphs). True for those
            defaults, or a dict of ``torch.compile`` keyword arguments. Needs
            ``cache_implementation="static"`` (and fixes the draft length: one graph per shape).
        adaptive_draft: chains (K = 1, draft model) choose the drafts per step (at most
            ``num_draft_tokens``; none, a target-only step, when drafting loses) from the running
            acceptance and the draft/target cost; dynamic trees their depth, down to a chain (``draft_tree``).
        draft_confidence: with ``adaptive_draft``, a chain ends at the first draft whose top token has
            probability below this (a property of q: still exact). 0 (default) = off.
        exact_timing: synchronise the GPU around each phase of ``stats.time_s`` (slower).
        draft_cost: the cost model of ``adaptive_draft`` (``hf/draft_length.py``): ``"measured"`` (wall
            times per draft length), ``"shapes"`` (:func:`draft_cost_estimate`) or a relative cost.
            Default: measured when greedy, shapes when sampling (seeded runs stay reproducible).
        logits_processor: a ``LogitsProcessorList`` of functions of (input_ids, scores), and
            generation_config: a ``GenerationConfig`` whose processor settings apply as in ``generate``
            (each row gets exactly the prefix it follows: ``hf/processors.py``, docs/hf_driver.md); a
            setting ``generate`` would act on that cannot be honoured is a ValueError naming it.
        grammar: xgrammar constraints (``hf/grammar.py``; docs/hf_driver.md): a JSON schema, an EBNF
            str, a ``GrammarSpec``, a compiled grammar, or one per request; exactly ``generate``'s law
            with xgrammar's processor. tokenizer: what the grammar is compiled over.
        verification: the chains' rule, "token" (draft by draft) or "block" (``sk.verify(method="block")``:
            the accepted prefix decided jointly, never fewer accepted drafts in expectation).
        draft_tree: None (chains) or "dynamic": the draft grows a token tree of N = ``num_draft_tokens``
            nodes (1 + N <= 64), ``tree_width`` = k children per expanded node (default 4), verified
            by ``sk.verify_tree`` exactly; adaptive depth (or a chain) per step. Growth, exactness,
            budget and the settings it refuses (ValueError): ``hf/drafters/dynamic_tree.py``, docs/hf_driver.md.
        prompt_lookup: with ``draft_tree="dynamic"``, the n-gram continuation of each request's tokens
            (``drafter="prompt_lookup"``'s rule) is one more branch of the tree, within its N nodes; a step
            with a match is verified one-hot (exact when sampling too; ``hf/drafters/dynamic_tree.py``).
        tree_threshold: with ``draft_tree="dynamic"``, a *shaped* tree: nodes whose path score is at
            least this, k per depth, N in all, up to 8 deep (exact; docs/hf_driver.md). 0 (default):
            the N nodes fill k per depth.
        draft_vocab: the token ids the draft model may propose (a :class:`~specdec_kernels.hf.draft_vocab.DraftVocab`,
            built once and reused, or a list of ids): its output layer computes those rows only for the
            call (a cheaper draft forward; ``frequent_token_ids`` picks them). Exact: the draft's law is
            zero elsewhere and the verifier sees it (``hf/draft_vocab.py``). None (default): every id.

    One host synchronisation per step, whatever the batch. Returns ``SpeculativeOutput(sequences [B, T + new], stats)``.

    Example:
        >>> out = speculative_generate(target, draft, ids, mask, max_new_tokens=64, num_drafts=2, temperature=0.7)
        >>> print(out.stats.table())
    """
    config = _config(target, draft, input_ids, attention_mask, _settings(locals()))
    stats = SpeculativeStats(config.num_draft_tokens, config.num_drafts)
    timer = PhaseTimer(stats, config.exact_timing and input_ids.device.type == "cuda")
    if streamer is not None:
        streamer.put(input_ids.cpu())
    start = time.perf_counter()
    with open_session(
        target, draft, input_ids, attention_mask, config=config, timer=timer, keep_history=streamer is not None
    ) as session:
        depth = session.drafter.max_depth  # the deepest accepted path
        stats.accepted_length_histogram = torch.zeros(input_ids.shape[0], depth + 1, dtype=torch.long)
        _run(session, stats, streamer)
    stats.finish(time.perf_counter() - start)
    if streamer is not None:
        streamer.end()
    return SpeculativeOutput(torch.cat([input_ids.long(), session.tokens.output(config.pad)], dim=1), stats)


_POSITIONAL = ("target", "draft", "input_ids", "attention_mask")


def _settings(arguments: dict) -> dict:
    """speculative_generate's keyword arguments (its ``locals()`` on entry)."""
    return {name: value for name, value in arguments.items() if name not in _POSITIONAL}


def _config(target, draft, input_ids, attention_mask, settings: dict) -> SpecConfig:
    """The checked config of ``settings``, with speculative_generate's defaults for what they omit."""
    parameters = inspect.signature(speculative_generate).parameters
    unknown = set(settings) - set(parameters)
    if unknown:
        raise TypeError(f"unexpected keyword arguments {sorted(unknown)}")
    full = {name: p.default for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    full.update(settings)
    if full["generation_config"] is not None:  # what it sets beyond the processors is an error, never dropped
        reject_active_settings(full["generation_config"], input_ids.shape[1], set())
    return SpecConfig.from_arguments(target, draft, input_ids, attention_mask, **full)


@contextlib.contextmanager
def open_session(
    target, draft, input_ids, attention_mask=None, *, config=None, timer=None, keep_history=False, **settings
):
    """A started :class:`~specdec_kernels.hf.session.Session` (prefilled, no step run yet) for
    ``speculative_generate``'s arguments (or a ready ``config``), inside the contexts its steps need
    (no_grad, the tree-attention backend, the drafter's own); for callers that drive the steps."""
    if config is None:
        config = _config(target, draft, input_ids, attention_mask, settings)
    drafter = build_drafter(config, target, draft)
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    prompts = [input_ids[b][mask[b].bool()].tolist() for b in range(input_ids.shape[0])]
    device = input_ids.device
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.no_grad())
        stack.enter_context(using_tree_attention(target))
        drafter.enter(stack)
        target_forward = compiled_forward(target, config.compile_target, device)
        yield Session(
            target,
            drafter,
            prompts,
            config,
            device,
            timer=timer,
            target_forward=target_forward,
            keep_history=keep_history,
        )


def _run(session: Session, stats: SpeculativeStats, streamer) -> None:
    """Steps until every request has finished; the draft length from the drafter's policy, if any."""
    config = session.config
    session.drop_finished([config.max_new_tokens == 0] * len(session.prompts))
    policy = session.drafter.length_policy(session)
    while session.batch.rows:
        active = len(session.batch.rows)
        g = policy.choose(stats.accepted, stats.rejections, active) if policy else config.num_draft_tokens
        step_start = time.perf_counter()
        result = session.step(g)  # ends with the step's one host synchronisation
        if policy:  # (a confidence stop on the CPU may have drafted fewer than g)
            shape = (result.draft_forwards, result.nodes)
            policy.record(result.drafted, active, time.perf_counter() - step_start, shape)
        with session.timer("other"):
            stats.record_step(result, session.batch.rows)
            if streamer is not None and result.tokens[0]:
                streamer.put(torch.tensor(result.tokens[0]))
            session.drop_finished_rows(result.finished)
