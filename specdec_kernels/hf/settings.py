"""``generate``'s settings that the driver does not implement: which are active in a generation
config (transformers' own conditions), so that each is a ValueError naming it, never a silent change.
Read by ``generate(custom_generate=...)`` (``integration.py``) and by ``speculative_generate`` for a
``generation_config=`` it is handed."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Call:
    """What decides whether a setting takes effect in ``generate``."""

    sampling: bool  # do_sample: the warpers (min_p, typical_p, ...) apply only then
    has_eos: bool  # min_length / min_new_tokens only forbid EOS
    prompt_width: int  # generate counts min_length over the padded prompt width


def _set(value) -> bool:
    """Not None and not an empty collection."""
    return value is not None and not (isinstance(value, (list, tuple, dict)) and len(value) == 0)


def _differs(default):
    return lambda value, call: value is not None and value != default


def _positive(value, call) -> bool:
    return value is not None and value > 0


def _when_sampling(active):
    return lambda value, call: call.sampling and active(value, call)


# Every generation-config setting that makes ``generate`` add a logits processor, a stopping
# criterion or another decoding mode that the driver does not implement, with when it takes effect
# (the conditions of transformers' ``_get_logits_processor`` / ``_get_stopping_criteria``) and the
# value that turns it off: an active one is a ValueError naming it, never a silent change. The
# processors of ``processors.PROCESSOR_SETTINGS`` / ``WARPER_SETTINGS`` are applied (exactly, row
# by row). (``renormalize_logits`` is not here: a log-softmax of the final scores changes no token.)
UNSUPPORTED = {
    "encoder_repetition_penalty": (_differs(1.0), 1.0),  # decoder-only: the prompt is its "encoder input"
    "encoder_no_repeat_ngram_size": (_positive, 0),
    "forced_bos_token_id": (lambda v, call: v is not None, None),
    "remove_invalid_values": (lambda v, call: v is True, False),
    "exponential_decay_length_penalty": (lambda v, call: v is not None, None),
    "guidance_scale": (_differs(1.0), 1.0),
    "watermarking_config": (lambda v, call: v is not None, None),
    "top_h": (_when_sampling(lambda v, call: v is not None), None),
    # other decoding modes
    "num_beams": (_differs(1), 1),
    "num_beam_groups": (_differs(1), 1),
    "diversity_penalty": (_differs(0.0), 0.0),
    "num_return_sequences": (_differs(1), 1),
    "penalty_alpha": (_positive, None),  # contrastive search
    "dola_layers": (lambda v, call: v is not None, None),
    "constraints": (lambda v, call: _set(v), None),
    "force_words_ids": (lambda v, call: _set(v), None),
    "token_healing": (lambda v, call: v is True, False),
    # stopping criteria
    "max_time": (lambda v, call: v is not None, None),
    "stop_strings": (lambda v, call: _set(v), None),
    # outputs only sequences come back
    "output_scores": (lambda v, call: v is True, False),
    "output_logits": (lambda v, call: v is True, False),
    "output_attentions": (lambda v, call: v is True, False),
    "output_hidden_states": (lambda v, call: v is True, False),
}


def reject_active_settings(config, prompt_width: int, passed: set[str]) -> None:
    call = _Call(
        sampling=bool(config.do_sample),
        has_eos=bool(eos_ids(config.eos_token_id)),
        prompt_width=prompt_width,
    )
    for name, (active, off) in UNSUPPORTED.items():
        value = getattr(config, name, None)
        if active(value, call):
            source = "passed to generate" if name in passed else "from generation_config or generation_config.json"
            raise ValueError(
                f"speculative generate does not support {name}={value!r} ({source}) yet; "
                f"pass {name}={off!r} to generate without it"
            )


def eos_ids(eos) -> list:
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor):
        return eos.flatten().tolist()
    return [eos] if isinstance(eos, int) else list(eos)
