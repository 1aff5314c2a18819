"""A driver step synchronises with the host at most twice, whatever the batch size.

On CPU nothing is asynchronous, so we count the calls that would synchronise a GPU: reading a
tensor's value on the host (.item, .tolist, .cpu, bool/int/float conversion) and explicit device
synchronisation, during the steps of speculative_generate (not the prefill or the final output).
"""

import contextlib

import pytest
import torch

from specdec_kernels.hf import session as driver
from specdec_kernels.hf import speculative_generate

from ._models import tiny_model

SYNCING = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _count_syncs(counter: list):
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}

    def counting(name):
        original = originals[name]

        def wrapper(self, *args, **kwargs):
            if counter[1] and not torch.compiler.is_compiling():
                counter[0] += 1
            return original(self, *args, **kwargs)

        return wrapper

    for name in SYNCING:
        setattr(torch.Tensor, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@contextlib.contextmanager
def syncs_per_step(monkeypatch):
    """Counts the host synchronisations of every driver step (prefill and output excluded); yields
    the list that receives one count per step."""
    counter, per_step = [0, False], []  # syncs, counting on
    step = driver.Session.step

    def counted_step(self, g=None):
        counter[0], counter[1] = 0, True
        try:
            return step(self, g)
        finally:
            counter[1] = False
            per_step.append(counter[0])

    monkeypatch.setattr(driver.Session, "step", counted_step)
    with _count_syncs(counter):
        yield per_step


@pytest.mark.parametrize("B", [1, 4])
@pytest.mark.parametrize(
    "options",
    [
        dict(num_drafts=1, temperature=0.0),
        dict(num_drafts=1, temperature=0.8, top_k=20),
        dict(num_drafts=3, temperature=0.9, method="rrs"),
        dict(num_drafts=1, temperature=0.0, adaptive_draft=False),
    ],
)
def test_at_most_two_host_syncs_per_step(B, options, monkeypatch):
    target = tiny_model("llama", seed=1)
    draft = tiny_model("llama", seed=2, layers=1)
    ids = torch.randint(3, 97, (B, 6), generator=torch.Generator().manual_seed(B))
    with syncs_per_step(monkeypatch) as per_step:
        out = speculative_generate(
            target, draft, ids, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[], **options
        )
    assert out.stats.steps == len(per_step) > 0
    assert max(per_step) <= 2, per_step


def test_the_counter_sees_syncs(monkeypatch):
    """Power: the counter catches a step that reads values per request."""
    counter = [0, True]
    with _count_syncs(counter):
        x = torch.arange(4)
        [int(v) for v in x]
        x.tolist()
    assert counter[0] >= 5
