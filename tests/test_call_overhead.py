"""The cheap paths of a plain sk.verify call (issue 28 goal 1) decide as the general ones do.

Not timed (bench/bench_overhead.py measures the cost): these tests pin what the shortcuts must
keep. ``_validation._validate_values`` checks a call whose requests use all G drafts with one
min/max of the ids and no [B] copies of scalar parameters; for a table of values it must raise
exactly what the general checks (``per_request_cpu`` + ``check_values``, forced here by making the
id shortcut decline) raise, or pass where they pass. ``SamplingParams.flat_args`` / ``op_args``
give the csrc calls and custom ops the numbers they always got.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels import _validation
from specdec_kernels._params import SamplingParams

B, G, V = 3, 4, 16


def _args(tokens=None, temperature=0.7, top_k=0, top_p=1.0, num_draft_tokens=None):
    gen = torch.Generator().manual_seed(0)
    target = torch.randn(B, G + 1, V, generator=gen)
    tokens = torch.randint(0, V, (B, G), generator=gen) if tokens is None else tokens
    return _validation.check_verify_args(
        target, tokens, None, None, temperature, top_k, top_p, num_draft_tokens, 5, validate=False
    )


def _verdict(check) -> tuple | None:
    try:
        check()
    except (TypeError, ValueError, RuntimeError, OverflowError) as error:
        return type(error), str(error)
    return None


NAN = float("nan")
CASES = {
    "valid": {},
    "valid tensors": dict(
        temperature=torch.tensor([0.0, 0.5, 2.0]), top_k=torch.tensor([0, 3, 99]), top_p=torch.tensor([1.0, 0.5, 0.01])
    ),  # fmt: skip
    "id -1": dict(tokens=torch.tensor([[0, 1, 2, 3], [0, -1, 2, 3], [0, 1, 2, 3]])),
    "id V": dict(tokens=torch.full((B, G), V)),
    "id V int32": dict(tokens=torch.full((B, G), V, dtype=torch.int32)),
    "temperature NaN": dict(temperature=torch.tensor([0.5, NAN, 1.0])),
    "temperature < 0": dict(temperature=torch.tensor([0.5, -1.0, 1.0])),
    "temperature subnormal": dict(temperature=torch.tensor([0.5, 1e-40, 1.0])),
    "temperature int": dict(temperature=torch.tensor([0, 1, -2])),
    "top_k < 0": dict(top_k=torch.tensor([1, -3, 0])),
    "top_p 0": dict(top_p=torch.tensor([0.5, 0.0, 1.0])),
    "top_p > 1": dict(top_p=torch.tensor([0.5, 1.5, 1.0])),
    "bad id and bad temperature": dict(tokens=torch.full((B, G), -1), temperature=torch.tensor([NAN, 1.0, 1.0])),
    "scalar top_p below float32": dict(top_p=1e-300),  # passes the scalar check, 0 in float32
    "scalar top_k past int64": dict(top_k=2**70),
    "counts given": dict(num_draft_tokens=torch.tensor([0, 2, 4])),
    "counts out of range": dict(num_draft_tokens=torch.tensor([0, 5, 4])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_value_checks_shortcut_decides_as_the_general_checks(case, monkeypatch):
    args = _args(**CASES[case])
    fast = _verdict(lambda: _validation._validate_values(args))
    monkeypatch.setattr(_validation, "_ids_in_range", lambda tokens, V: False)  # the general checks only
    general = _verdict(lambda: _validation._validate_values(args))
    assert fast == general
    assert (fast is None) == case.startswith(("valid", "counts given")), fast


def test_scalars_the_shortcut_cannot_judge_go_to_the_general_checks():
    assert not SamplingParams.check(B, torch.device("cpu"), 0.7, 0, 1e-300, 1).check_tensor_values()
    assert not SamplingParams.check(B, torch.device("cpu"), 0.7, 2**70, 1.0, 1).check_tensor_values()
    assert SamplingParams.check(B, torch.device("cpu"), 0.7, 2**63 - 1, 2.0**-149, 1).check_tensor_values()


def test_flat_args_hold_the_numbers_the_kernels_took():
    t, k = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1, 2, 3])
    params = SamplingParams(1e10, k, 0.9, 2**64 + 3, "by_index")
    assert params.flat_args() == (None, 2147483647.0, k, 0, None, 0.9, None, (2**64 + 3) % 2**62)
    tensors, floats, seed_t, seed = params.op_args(with_ties=True)
    assert tensors == [None, k, None] and floats == [2147483647.0, 0.0, 0.9, 1.0] and seed_t is None
    assert SamplingParams.from_op_args(tensors, floats, seed_t, seed).top_p_ties == "by_index"
    params = SamplingParams(t, 2**40, 1.0, k)
    assert params.flat_args() == (t, 0.0, None, 2**31 - 1, None, 1.0, k, 0)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_validated_and_unvalidated_calls_emit_the_same_tokens(temperature):
    args = _args()
    gen = torch.Generator().manual_seed(1)
    draft_probs = torch.softmax(torch.randn(B, G, V, generator=gen), -1)
    calls = [
        sk.verify(args.target_logits, args.draft_tokens, draft_probs=draft_probs, temperature=temperature, seed=3,
                  validate=validate, backend=backend)
        for validate in (True, False) for backend in ("auto", "torch")
    ]  # fmt: skip
    for out in calls[1:]:
        assert torch.equal(out.tokens, calls[0].tokens) and torch.equal(out.num_accepted, calls[0].num_accepted)


def test_the_sm_count_is_asked_once_per_device(monkeypatch):
    """Launch plans ask for the SM count on every call; the device properties are read once per
    device index (``_interpreter._sm_count``), for "cuda" and "cuda:N" alike."""
    from specdec_kernels import _interpreter

    asked = []

    def properties(index):
        asked.append(index)
        return SimpleNamespace(multi_processor_count=132 + index)

    _interpreter._sm_count.cache_clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        counts = [_interpreter.multiprocessors(d) for d in ("cuda", torch.device("cuda:1"), "cuda:0", "cuda")]
    finally:
        _interpreter._sm_count.cache_clear()
    assert counts == [133, 133, 132, 133]
    assert asked == [1, 0]


def test_the_cuda_builds_chunks_fill_the_accept_launch(monkeypatch):
    """The CUDA build's vocabulary chunks (ops.csrc._num_chunks) on a 132-SM device: ~4 row-stats blocks
    per SM over the rows and ~2 accept blocks per SM over the requests; filtered calls one chunk."""
    from specdec_kernels.ops import csrc

    monkeypatch.setattr(csrc, "multiprocessors", lambda device: 132)

    def chunks(B, G=4, V=151936, **kw):
        args = SimpleNamespace(B=B, G=G, V=V, has_filter=kw.get("has_filter", False), target_logits=torch.empty(0))
        return csrc._num_chunks(args, 256)

    assert chunks(1) == 38  # V / (4 quads x 256 threads x 4): the rows would take 106
    assert chunks(64) == 5 and chunks(64, G=8) == 5  # 320 / 320 accept blocks (was 2 / 1 chunks)
    assert chunks(256) == 2 and chunks(1024) == 1
    assert chunks(64, has_filter=True) == 1
