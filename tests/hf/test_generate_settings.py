"""generate(custom_generate=...) never drops a logits-processor, decoding-mode or stopping setting:
each one that plain ``generate`` would apply and the driver does not implement is a ValueError naming
it, whether passed to the call or inherited from the model's generation config; at its no-op value
it is accepted. (The processors the driver applies: tests/hf/test_logits_processors.py.)"""

import pytest
import torch

from specdec_kernels.hf import CUSTOM_GENERATE

from ._models import tiny_model

pytest.importorskip("transformers")

PROMPT = torch.tensor([[5, 9, 14, 5, 9, 22]])  # width 6; the tiny models' EOS is 1

# (setting, a value generate would act on, its no-op value, whether the call samples)
SETTINGS = [
    ("encoder_repetition_penalty", 1.5, 1.0, False),
    ("encoder_no_repeat_ngram_size", 2, 0, False),
    ("forced_bos_token_id", 0, None, False),
    ("remove_invalid_values", True, False, False),
    ("exponential_decay_length_penalty", (2, 1.5), None, False),
    ("guidance_scale", 1.5, 1.0, False),
    ("watermarking_config", {"bias": 2.0}, None, False),
    ("top_h", 0.5, None, True),
    ("num_beams", 2, 1, False),
    ("num_beam_groups", 2, 1, False),
    ("diversity_penalty", 0.5, 0.0, False),
    ("num_return_sequences", 2, 1, True),  # greedy: transformers itself refuses it,
    ("penalty_alpha", 0.6, None, False),
    ("dola_layers", "low", None, False),
    ("force_words_ids", [[7]], None, False),
    ("token_healing", True, False, False),
    ("max_time", 5.0, None, False),
    ("stop_strings", ["ab"], None, False),
    ("output_scores", True, False, False),
    ("output_logits", True, False, False),
    ("output_attentions", True, False, False),
    ("output_hidden_states", True, False, False),
]
IDS = [s[0] for s in SETTINGS]
# warpers: generate applies them only when sampling
SAMPLING_ONLY = [
    ("min_p", 0.5, None, True),
    ("typical_p", 0.5, 1.0, True),
    ("epsilon_cutoff", 0.01, 0.0, True),
    ("eta_cutoff", 0.01, 0.0, True),
    ("top_h", 0.5, None, True),
]


def _spec(model, **kw):
    kw.setdefault("prompt_lookup_num_tokens", 2)
    kw.setdefault("max_new_tokens", 3)
    return model.generate(PROMPT, custom_generate=CUSTOM_GENERATE, trust_remote_code=True, **kw)


def _sampling(needs_sample: bool) -> dict:
    return {"do_sample": True, "temperature": 1.0, "top_k": 0} if needs_sample else {}


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=1, layers=1)


@pytest.fixture(scope="module")
def greedy(model):
    return model.generate(PROMPT, max_new_tokens=3, do_sample=False)


@pytest.mark.parametrize("name, value, off, needs_sample", SETTINGS, ids=IDS)
def test_setting_passed_to_generate_is_a_clear_error(model, name, value, off, needs_sample):
    with pytest.raises(ValueError, match=rf"{name}=.*passed to generate"):
        _spec(model, **{name: value}, **_sampling(needs_sample))


@pytest.mark.parametrize("name, value, off, needs_sample", SETTINGS, ids=IDS)
def test_setting_from_the_generation_config_is_a_clear_error(name, value, off, needs_sample):
    """As if read from the model's generation_config.json: the call does not mention it."""
    model = tiny_model("llama", seed=1, layers=1)
    if name == "watermarking_config":  # generation_config.json loads it as this object (update() before
        from transformers.generation import WatermarkingConfig  # transformers 5.17 kept a dict as is)

        value = WatermarkingConfig(**value)
    model.generation_config.update(**_sampling(needs_sample), **{name: value})
    with pytest.raises(ValueError, match=rf"{name}=.*generation_config"):
        _spec(model, **_sampling(needs_sample))


@pytest.mark.parametrize("name, value, off, needs_sample", SETTINGS, ids=IDS)
def test_no_op_value_is_accepted(model, greedy, name, value, off, needs_sample):
    out = _spec(model, **{name: off})
    assert torch.equal(out, greedy)


@pytest.mark.parametrize("name, value, off, needs_sample", SAMPLING_ONLY, ids=[s[0] for s in SAMPLING_ONLY])
def test_sampling_only_setting_is_ignored_when_greedy_as_by_generate(model, name, value, off, needs_sample):
    expected = model.generate(PROMPT, max_new_tokens=3, do_sample=False, **{name: value})
    assert torch.equal(_spec(model, do_sample=False, **{name: value}), expected)


def test_min_length_within_the_prompt_or_without_eos_is_a_no_op(model, greedy):
    """generate counts min_length over the padded prompt too, and only ever forbids EOS."""
    assert torch.equal(_spec(model, min_length=PROMPT.shape[1]), greedy)
    expected = model.generate(PROMPT, max_new_tokens=3, do_sample=False, eos_token_id=[])
    assert torch.equal(_spec(model, min_new_tokens=24, eos_token_id=[]), expected)


def test_call_overrides_the_generation_config(greedy):
    model = tiny_model("llama", seed=1, layers=1)
    model.generation_config.update(repetition_penalty=5.0)
    assert torch.equal(_spec(model, repetition_penalty=1.0), greedy)


def test_renormalize_logits_changes_no_token(model):
    expected = model.generate(PROMPT, max_new_tokens=3, do_sample=False, renormalize_logits=True)
    assert torch.equal(_spec(model, renormalize_logits=True), expected)


# Processor settings the driver applies: greedy output equals generate's with them
APPLIED = [
    ("repetition_penalty", 5.0),
    ("no_repeat_ngram_size", 2),
    ("bad_words_ids", [[7]]),
    ("sequence_bias", {(7,): -10.0}),
    ("min_length", 30),
    ("min_new_tokens", 24),
    ("forced_eos_token_id", 1),
    ("suppress_tokens", [7]),
    ("begin_suppress_tokens", [7]),
]


@pytest.mark.parametrize("name, value", APPLIED, ids=[a[0] for a in APPLIED])
def test_applied_setting_equals_generate(model, name, value):
    expected = model.generate(PROMPT, max_new_tokens=3, do_sample=False, **{name: value})
    assert torch.equal(_spec(model, **{name: value}), expected)


def test_logits_processor_list_is_applied(model):
    from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

    procs = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(5.0)])
    expected = model.generate(PROMPT, max_new_tokens=3, do_sample=False, logits_processor=procs)
    assert torch.equal(_spec(model, logits_processor=procs), expected)
