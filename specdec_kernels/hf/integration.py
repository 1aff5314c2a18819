"""Speculative decoding with our kernels behind ``transformers``' own ``model.generate``.

``generate`` accepts ``custom_generate=<local directory>`` (with ``trust_remote_code=True``): the
directory's ``custom_generate/generate.py`` replaces the decoding loop and receives every argument of
the call. We ship such a directory inside the package (:data:`CUSTOM_GENERATE`), so::

    from specdec_kernels.hf import CUSTOM_GENERATE
    out = target.generate(input_ids, attention_mask=mask, assistant_model=draft, max_new_tokens=64,
                          custom_generate=CUSTOM_GENERATE, trust_remote_code=True)

runs :func:`specdec_kernels.hf.speculative_generate` with the usual ``generate`` arguments:
``assistant_model`` (or ``prompt_lookup_num_tokens`` for n-gram drafts without a draft model),
``num_assistant_tokens`` (drafts per step), ``do_sample`` / ``temperature`` / ``top_k`` / ``top_p``,
``max_new_tokens`` / ``max_length``, ``eos_token_id`` / ``pad_token_id``, ``streamer`` and
``return_dict_in_generate``. Extra keywords ``specdec_num_drafts`` (K draft chains verified as one
tree) and ``specdec_method`` ("kseq", "rrs", "rrs_wor") select multi-draft verification;
``specdec_draft_vocab`` (token ids or a ``DraftVocab``) restricts the draft's proposals
(``hf/draft_vocab.py``). Greedy output
is identical to plain ``generate``; sampled output is exactly target-distributed, with top-p
keeping the tokens ``generate``'s ``TopPLogitsWarper`` keeps (``top_p_ties="by_index"``). Sampling seeds
are drawn from torch's global generator, so ``torch.manual_seed`` makes a call reproducible.
Logits processors apply as in ``generate``, each verification and draft row with the exact prefix
it follows (``hf/processors.py``): a ``logits_processor`` list of functions of (input_ids, scores)
and the settings ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_length``,
``min_new_tokens``, ``bad_words_ids``, ``sequence_bias``, ``suppress_tokens``,
``begin_suppress_tokens``, ``forced_eos_token_id`` and, when sampling, ``min_p``, ``typical_p``,
``epsilon_cutoff``, ``eta_cutoff``. Anything our loop cannot honour is a ``ValueError`` naming it
rather than silently ignored: beam search, a ``stopping_criteria`` list, and every other
processor or stopping setting that ``generate`` would apply (``encoder_repetition_penalty``,
``forced_bos_token_id``, watermarking, ``max_time``, ...; see :data:`settings.UNSUPPORTED`), whether passed
to the call or inherited from the model's ``generation_config.json``. A setting at its no-op value
is fine, and so is a sampling-only one when greedy: ``generate`` ignores it too.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from .._params import SEED_RANGE
from .generate import speculative_generate
from .settings import reject_active_settings

CUSTOM_GENERATE = str(Path(__file__).resolve().parent / "recipe")

# num_assistant_tokens when the caller did not choose: transformers' own default (20, tuned for
# its heuristic schedule) drafts far past where a small draft is still accepted.
DEFAULT_DRAFT_TOKENS = 4
_HF_DEFAULT_ASSISTANT_TOKENS = 20


def generate_with_specdec(
    model,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus=None,
    assistant_model=None,
    streamer=None,
    negative_prompt_ids=None,
    negative_prompt_attention_mask=None,
    **kwargs,
):
    """The ``custom_generate`` entry point: ``model.generate``'s arguments -> speculative_generate."""
    num_drafts = int(kwargs.pop("specdec_num_drafts", 1))
    method = kwargs.pop("specdec_method", "kseq")
    draft_vocab = kwargs.pop("specdec_draft_vocab", None)
    input_ids = inputs if inputs is not None else kwargs.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("speculative generate needs input_ids (a [B, T] prompt, left-padded when ragged)")
    attention_mask = kwargs.pop("attention_mask", None)
    _reject_unsupported(
        stopping_criteria=stopping_criteria,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        negative_prompt_ids=negative_prompt_ids,
        negative_prompt_attention_mask=negative_prompt_attention_mask,
        synced_gpus=synced_gpus,
    )
    config = _merged_config(model, generation_config)
    explicit_draft_tokens = "num_assistant_tokens" in kwargs
    passed = set(kwargs)
    if isinstance(kwargs.get("watermarking_config"), dict):  # update() validates it as an object (5.x)
        from transformers.generation import WatermarkingConfig

        kwargs["watermarking_config"] = WatermarkingConfig.from_dict(kwargs["watermarking_config"])
    unused = config.update(**kwargs)
    unused.pop("use_cache", None)
    if unused:
        raise ValueError(f"speculative generate does not support the arguments {sorted(unused)}")
    reject_active_settings(config, input_ids.shape[1], passed)

    lookup = getattr(config, "prompt_lookup_num_tokens", None)
    if assistant_model is None and not lookup:
        raise ValueError("pass assistant_model=<draft model> or prompt_lookup_num_tokens=N")
    draft_tokens = getattr(config, "num_assistant_tokens", None)
    if lookup and assistant_model is None:
        draft_tokens = lookup
    elif not explicit_draft_tokens and draft_tokens in (None, _HF_DEFAULT_ASSISTANT_TOKENS):
        draft_tokens = DEFAULT_DRAFT_TOKENS
    sampling = _sampling(config)
    out = speculative_generate(
        model,
        assistant_model,
        input_ids,
        attention_mask,
        max_new_tokens=_max_new_tokens(config, input_ids.shape[1]),
        num_draft_tokens=int(draft_tokens),
        num_drafts=num_drafts,
        method=method,
        drafter="model" if assistant_model is not None else "prompt_lookup",
        draft_vocab=draft_vocab,
        seed=int(torch.randint(0, SEED_RANGE, (1,))),  # from torch's generator: torch.manual_seed reproduces
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        streamer=streamer,
        logits_processor=logits_processor or None,
        generation_config=config,  # its processor settings (repetition_penalty, min_p, ...) apply as in generate
        **sampling,
    )
    if config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=out.sequences)
    return out.sequences


def _merged_config(model, generation_config):
    """The call's generation config as ``generate`` builds it: a passed ``generation_config`` first,
    the model's own (``generation_config.json``) for whatever it leaves unset."""
    if generation_config is None:
        return copy.deepcopy(model.generation_config)
    config = copy.deepcopy(generation_config)
    config.update(**model.generation_config.to_dict(), defaults_only=True, allow_custom_entries=True)
    return config


def _sampling(config) -> dict:
    """temperature / top_k / top_p as generate would apply them (greedy unless do_sample)."""
    if not config.do_sample:
        return {"temperature": 0.0}
    temperature = config.temperature if config.temperature is not None else 1.0
    return {
        "temperature": float(temperature),
        "top_k": int(config.top_k or 0),
        "top_p": float(config.top_p if config.top_p is not None else 1.0),
    }


def _max_new_tokens(config, prompt_len: int) -> int:
    if config.max_new_tokens is not None:
        return int(config.max_new_tokens)
    if config.max_length is not None:
        return max(0, int(config.max_length) - prompt_len)
    raise ValueError("pass max_new_tokens (or max_length)")


def _reject_unsupported(**arguments) -> None:
    for name, value in arguments.items():
        if value is None or value is False or (isinstance(value, list) and not value):
            continue
        raise ValueError(f"speculative generate does not support {name} (got {type(value).__name__})")
