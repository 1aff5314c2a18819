"""Every class of bad input gets a clear Python error naming the argument (issue 14's table).

One row per case: (id, a function making the bad call, the exception type, a regex its message must
match). Int seeds of any size are valid (hashed to 62 bits, documented), so only non-int seeds
are errors for the ops. The calls are tiny (B = 2, G = 3, V = 50) and run on the reference backend unless the case
is about a backend, so the table runs in seconds. The positive control at the end makes sure the
table's builders produce *valid* calls when nothing is broken (a test that cannot fail is a defect).
"""

from __future__ import annotations

import re

import pytest
import torch

import specdec_kernels as sk

B, G, V, N = 2, 3, 50, 4


def _chain(**over):
    """Arguments of a valid sk.verify call, with `over` replacing some of them."""
    gen = torch.Generator().manual_seed(0)
    kw = dict(
        target_logits=torch.randn(B, G + 1, V, generator=gen),
        draft_tokens=torch.randint(0, V, (B, G), generator=gen),
        draft_logits=torch.randn(B, G, V, generator=gen),
        temperature=0.8,
        seed=1,
        backend="torch",
    )
    kw.update(over)
    return kw


def _verify(**over):
    return lambda: sk.verify(**_chain(**over))


def _tree(**over):
    gen = torch.Generator().manual_seed(1)
    kw = dict(
        target_logits=torch.randn(B, N + 1, V, generator=gen),
        tree_tokens=torch.randint(0, V, (B, N), generator=gen),
        parents=torch.tensor([[-1, 0, 0, 1], [-1, -1, 1, 2]]),
        temperature=0.8,
        seed=1,
        backend="torch",
    )
    kw.update(over)
    return lambda: sk.verify_tree(**kw)


def _multi(**over):
    gen = torch.Generator().manual_seed(2)
    K = 2
    kw = dict(
        target_logits=torch.randn(B, K, G + 1, V, generator=gen),
        draft_tokens=torch.randint(0, V, (B, K, G), generator=gen),
        draft_logits=torch.randn(B, K, G, V, generator=gen),
        temperature=0.8,
        seed=1,
        backend="torch",
    )
    kw.update(over)
    return lambda: sk.verify_multi(**kw)


def _metadata(parents, num_nodes=None):
    return lambda: sk.tree_metadata(torch.tensor(parents), None if num_nodes is None else torch.tensor(num_nodes))


def _attention(**over):
    Hq, Hkv, D, S = 4, 2, 16, 12
    gen = torch.Generator().manual_seed(3)
    kw = dict(
        q=torch.randn(B, Hq, N, D, generator=gen),
        k=torch.randn(B, Hkv, S, D, generator=gen),
        v=torch.randn(B, Hkv, S, D, generator=gen),
        prefix_lens=torch.tensor([5, 7]),
        parents=torch.tensor([[-1, 0, 0, 1], [-1, -1, 1, 2]]),
    )
    kw.update(over)
    return lambda: sk.tree_attention(**kw)


_PAIR: list = []  # built once, on first use


def _generate(**over):
    from tests.hf._models import tiny_model

    target, draft = _PAIR or _PAIR.extend([tiny_model("llama", seed=1), tiny_model("llama", seed=2, layers=1)]) or _PAIR
    kw = dict(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4)
    kw.update(over)
    from specdec_kernels.hf import speculative_generate

    return lambda: speculative_generate(target, draft, **kw)


NAN_ROW = torch.randn(B, G, V)
NAN_ROW[0, 1, 3] = float("nan")

CASES = [
    # ---- verify: shapes, dtypes, vocabulary, ids, values
    ("verify target 2-D", _verify(target_logits=torch.randn(B, V)), ValueError, "target_logits"),
    ("verify target int", _verify(target_logits=torch.zeros(B, G + 1, V, dtype=torch.int64)), TypeError, "target"),
    ("verify tokens float", _verify(draft_tokens=torch.zeros(B, G)), TypeError, "draft_tokens"),
    ("verify tokens G mismatch", _verify(draft_tokens=torch.zeros(B, G + 1, dtype=torch.int64)), ValueError, "G"),
    ("verify vocab mismatch", _verify(draft_logits=torch.randn(B, G, V + 1)), ValueError, "vocab|V"),
    ("verify id >= V", _verify(draft_tokens=torch.full((B, G), V)), ValueError, "draft_tokens"),
    ("verify both drafts", _verify(draft_probs=torch.rand(B, G, V)), ValueError, "draft_logits|draft_probs"),
    ("verify temperature inf", _verify(temperature=float("inf")), ValueError, "temperature"),
    ("verify temperature nan", _verify(temperature=float("nan")), ValueError, "temperature"),
    ("verify temperature 1e300", _verify(temperature=1e300), ValueError, "temperature"),
    ("verify temperature negative", _verify(temperature=-1.0), ValueError, "temperature"),
    ("verify top_k negative", _verify(top_k=-1), ValueError, "top_k"),
    ("verify top_p > 1", _verify(top_p=1.5), ValueError, "top_p"),
    ("verify top_p 0", _verify(top_p=0.0), ValueError, "top_p"),
    ("verify seed float", _verify(seed=1.5), TypeError, "seed"),
    ("verify num_draft_tokens > G", _verify(num_draft_tokens=torch.tensor([G + 1, 0])), ValueError, "num_draft"),
    ("verify num_draft_tokens < 0", _verify(num_draft_tokens=torch.tensor([-1, 0])), ValueError, "num_draft"),
    ("verify per-request T shape", _verify(temperature=torch.ones(B + 1)), ValueError, "temperature"),
    ("verify backend name", _verify(backend="fast"), ValueError, "backend"),
    ("verify out_dtype", _verify(out_dtype=torch.float32), TypeError, "out_dtype"),
    (
        "verify devices differ",
        _verify(draft_tokens=torch.zeros(B, G, dtype=torch.int64, device="meta")),
        ValueError,
        "draft_tokens is on meta",
    ),
    ("verify probs shape", _verify(draft_logits=None, draft_probs=torch.rand(B, G + 1, V)), ValueError, "draft_probs"),
    # ---- flattened layout
    (
        "flat cu not increasing",
        _verify(
            target_logits=torch.randn(7, V),
            draft_tokens=torch.zeros(4, dtype=torch.int64),
            draft_logits=torch.randn(4, V),
            cu_num_draft_tokens=torch.tensor([0, 3, 2, 4]),
            max_num_draft_tokens=3,
        ),
        ValueError,
        "cu_num_draft_tokens",
    ),
    # ---- verify_tree / verify_multi
    ("tree forward parent", _tree(parents=torch.tensor([[-1, 0, 3, 1], [-1, -1, 1, 2]])), ValueError, "parents"),
    ("tree parent out of range", _tree(parents=torch.tensor([[-1, 99, 0, 1], [-1, -1, 1, 2]])), ValueError, "parents"),
    ("tree num_nodes > N", _tree(num_nodes=torch.tensor([N + 1, 1])), ValueError, "num_nodes"),
    ("tree num_nodes < 0", _tree(num_nodes=torch.tensor([-1, 1])), ValueError, "num_nodes"),
    ("tree method", _tree(method="beam"), ValueError, "method"),
    ("tree token >= V", _tree(tree_tokens=torch.full((B, N), V)), ValueError, "tree_tokens"),
    ("tree temperature inf", _tree(temperature=float("inf")), ValueError, "temperature"),
    ("multi tokens K mismatch", _multi(draft_tokens=torch.zeros(B, 3, G, dtype=torch.int64)), ValueError, "K|draft"),
    ("multi vocab mismatch", _multi(draft_logits=torch.randn(B, 2, G, V - 1)), ValueError, "vocab|V"),
    # ---- tree_metadata
    ("metadata forward parent", _metadata([[-1, 0, 3, 1, 2]]), ValueError, "parents"),
    ("metadata parent 99", _metadata([[-1, 99]]), ValueError, "parents"),
    ("metadata num_nodes > N", _metadata([[-1, 0]], [3]), ValueError, "num_nodes"),
    ("metadata num_nodes < 0", _metadata([[-1, 0]], [-1]), ValueError, "num_nodes"),
    # ---- tree_attention
    (
        "attention GQA mismatch",
        _attention(k=torch.randn(B, 3, 12, 16), v=torch.randn(B, 3, 12, 16)),
        ValueError,
        "head",
    ),
    ("attention prefix too long", _attention(prefix_lens=torch.tensor([12, 7])), ValueError, "prefix_lens"),
    (
        "attention forward parent",
        _attention(parents=torch.tensor([[-1, 2, 0, 1], [-1, -1, 1, 2]])),
        ValueError,
        "parents",
    ),
    # ---- the Hugging Face driver
    ("generate max_new_tokens float", _generate(max_new_tokens=2.5), TypeError, "max_new_tokens"),
    ("generate seed 2**64", _generate(seed=2**64), ValueError, "seed"),
    ("generate temperature nan", _generate(temperature=float("nan")), ValueError, "temperature"),
    ("generate num_draft_tokens 0", _generate(num_draft_tokens=0), ValueError, "num_draft_tokens"),
    (
        "generate right padding",
        _generate(input_ids=torch.tensor([[1, 2, 0], [1, 2, 3]]), attention_mask=torch.tensor([[1, 1, 0], [1, 1, 1]])),
        ValueError,
        "pad",
    ),
]


@pytest.mark.parametrize("make_call, error, pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_is_a_clear_error(make_call, error, pattern):
    with pytest.raises(error) as info:
        make_call()
    assert re.search(pattern, str(info.value), re.IGNORECASE), f"{error.__name__}: {info.value}"


def test_nan_draft_probs_are_flagged_not_an_error():
    """Documented behaviour, not an error: an unusable draft_probs entry counts as q = 0 and flags
    only its request."""
    probs = torch.softmax(torch.randn(B, G, V), -1)
    probs[0, 0, 5] = float("nan")
    out = sk.verify(**_chain(draft_logits=None, draft_probs=probs))
    assert out.nonfinite.tolist() == [True, False]


def test_the_builders_make_valid_calls():
    """Positive control: unchanged, every builder above is a valid call."""
    for call in (_verify(), _tree(), _multi(), _metadata([[-1, 0, 0, 1]]), _attention(), _generate()):
        call()


def _triton_on_cpu_calls():
    gen = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(B, G + 1, V, generator=gen), torch.randint(0, V, (B, G), generator=gen)
    parents = torch.tensor([[-1, 0, 1, 2]] * B)
    tree_logits, tree_tokens = torch.randn(B, N + 1, V, generator=gen), torch.randint(0, V, (B, N), generator=gen)
    q = torch.randn(B, 2, N, 16, generator=gen)
    kv = torch.randn(B, 1, N + 5, 16, generator=gen)
    return {
        "verify": lambda: sk.verify(logits, tokens, seed=1, backend="triton"),
        "verify_tree": lambda: sk.verify_tree(tree_logits, tree_tokens, parents, backend="triton"),
        "tree_attention": lambda: sk.tree_attention(q, kv, kv, torch.tensor([5] * B), parents),
        "tree_metadata": lambda: sk.tree_metadata(parents, backend="triton"),
    }


@pytest.mark.parametrize("op", sorted(_triton_on_cpu_calls()))
def test_triton_kernels_on_cpu_tensors_with_cuda_present_say_so(op, monkeypatch):
    """On a machine with CUDA the interpreter is off, and a CPU tensor handed to a Triton kernel failed
    inside Triton's launcher ("cannot be accessed from Triton"); seen on an H200. A clear ValueError instead."""
    from specdec_kernels import _interpreter

    call = _triton_on_cpu_calls()[op]
    if _interpreter.interpreter_requested():
        call()  # the interpreter runs it (no CUDA here, or TRITON_INTERPRET=1)
    monkeypatch.setattr(_interpreter, "interpreter_requested", lambda: False)  # as on a GPU machine
    with pytest.raises(ValueError, match=r"need CUDA tensors, got cpu tensors"):
        call()
