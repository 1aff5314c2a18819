"""One compiled variant per kernel configuration, whatever the per-call scalars (seeds, batch size).

Triton's JIT specialises an int argument equal to 1 (a constant) and one that is a multiple of 16 (an
alignment hint), and types it i32 or i64 by magnitude: a serving process would compile a fresh
variant mid-stream the first time a seed is 1 or 16 or a batch has 16 requests. Without a GPU the
JIT's launch cache cannot be read, so the launches of the public calls are captured in the
interpreter (not run) and each is bound by Triton's own binder (``create_function_from_signature``,
what ``JITFunction.run`` keys its cache with) for a JITFunction of the same function and decorator
options: the specialisation keys must not depend on the seed, and every scalar that varies per
call must be in the decorator's ``do_not_specialize``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import specdec_kernels as sk
from specdec_kernels._interpreter import plan_as_gpu

from ._inputs import make_problem
from ._trees import make_tree_problem, tree_parents

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="captures the interpreter's launches")

# Scalars whose value changes from call to call in a serving process: must not be specialised.
PER_CALL = {"B", "R", "seed", "top_k", "rnd", "num_chunks", "stat_chunks", "rrs_chunks", "S", "NUM_SPLITS"}
# Scalars fixed by the model and its configuration (or always multiples of a block): specialised.
FIXED = {"G", "K", "V", "N", "D", "Hq", "Hkv", "Nq", "chunk_size", "split_len", "tree_slots", "ROWS_PER_REQUEST"}
SEEDS = [1, 16, 17, 2**40]


def _jit_twin(kernel):
    """A JITFunction of the kernel's function with its decorator options (the interpreter's
    InterpretedFunction keeps them in ``kwargs``)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    options = {k: v for k, v in kernel.kwargs.items() if k in ("do_not_specialize", "do_not_specialize_on_alignment")}
    return JITFunction(kernel.fn, **options)


def _specialisation(kernel, args, kwargs) -> tuple:
    """Triton's cache key material for this launch: (per-argument specialisation, options)."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import create_function_from_signature

    jit = _jit_twin(kernel)
    binder = create_function_from_signature(jit.signature, jit.params, BaseBackend)
    _, specialization, options = binder(*args, **kwargs)
    named = tuple((p.name, str(spec)) for p, spec in zip(jit.params, specialization, strict=True))
    return jit.__name__, named, str(sorted(options.items()))


@contextlib.contextmanager
def _captured():
    """Record every interpreted launch (kernel, args, kwargs) instead of running it."""
    from triton.runtime import interpreter

    launches = []
    original = interpreter.InterpretedFunction.run

    def capture(self, *args, grid, warmup, **kwargs):
        launches.append((self, args, kwargs))

    interpreter.InterpretedFunction.run = capture
    try:
        yield launches
    finally:
        interpreter.InterpretedFunction.run = original


def _chain(seed, B=3, V=700):
    target, tokens, draft = make_problem(B, 3, V, seed=1)
    return sk.verify(target, tokens, draft, top_k=5, top_p=0.9, seed=seed, validate=False, backend="triton")


def _tree(seed, method="kseq", B=3, V=700):
    target, tokens, parents, draft = make_tree_problem(B, 6, V, seed=2, without_replacement=method == "rrs_wor")
    kw = dict(draft_logits=draft, method=method, top_k=7, seed=seed, validate=False, backend="triton")
    return sk.verify_tree(target, tokens, parents, **kw)


def _multi(seed, method="rrs", B=3, V=700):
    target, tokens, draft = make_problem(B * 2, 3, V, seed=3)
    target, tokens, draft = target.reshape(B, 2, 4, V), tokens.reshape(B, 2, 3), draft.reshape(B, 2, 3, V)
    return sk.verify_multi(target, tokens, draft, method=method, seed=seed, validate=False, backend="triton")


def _attention(B=2, prefix=1000):
    gen = torch.Generator().manual_seed(0)
    N, S = 5, prefix + 8
    q, k, v = (torch.randn(B, n, m, 64, generator=gen) for n, m in ((4, N), (2, S), (2, S)))
    parents = torch.stack([tree_parents("random", N, gen) for _ in range(B)])
    return sk.tree_attention(q, k, v, torch.full((B,), prefix), parents, validate=False)


def _metadata(B=40):
    gen = torch.Generator().manual_seed(0)
    parents = torch.stack([tree_parents("random", 9, gen) for _ in range(B)])
    return sk.tree_metadata(parents, validate=False, backend="triton")


CALLS = {
    "verify": _chain,
    "verify_tree_kseq": _tree,
    "verify_tree_rrs": lambda seed: _tree(seed, "rrs"),
    "verify_multi_rrs_wor": lambda seed: _multi(seed, "rrs_wor"),
}


def _keys(call, gpu_plan: bool) -> list[tuple]:
    with plan_as_gpu(132) if gpu_plan else contextlib.nullcontext(), _captured() as launches:
        call()
    assert launches
    return [_specialisation(*launch) for launch in launches]


@pytest.mark.parametrize("gpu_plan", [False, True], ids=["interpreter_plan", "gpu_plan"])
@pytest.mark.parametrize("op", list(CALLS))
def test_int_seeds_share_one_compiled_variant(op, gpu_plan):
    """Int seeds 1 (a constant to Triton), 16 (divisible), 17 and 2**40 (i64): the same keys; and a
    [B] seed tensor's keys do not depend on its values either."""
    keys = {seed: _keys(lambda s=seed: CALLS[op](s), gpu_plan) for seed in SEEDS}
    for seed in SEEDS[1:]:
        assert keys[seed] == keys[SEEDS[0]], f"seed {seed} compiles another variant than seed {SEEDS[0]}"
    tensors = [_keys(lambda s=s: CALLS[op](torch.full((3,), s)), gpu_plan) for s in SEEDS]
    assert all(k == tensors[0] for k in tensors)


def test_per_call_scalars_are_not_specialised():
    """Every int scalar of every launch (chains, trees, multi-draft, attention with splits, metadata;
    both plans) is classified: per-call ones are in ``do_not_specialize``, the others are fixed by
    the model. A new per-call argument must be added to PER_CALL (and to its decorator)."""
    calls = [lambda op=op: CALLS[op](5) for op in CALLS] + [_attention, _metadata]
    seen = set()
    for gpu_plan in (False, True):
        for call in calls:
            with plan_as_gpu(132) if gpu_plan else contextlib.nullcontext(), _captured() as launches:
                call()
            for kernel, args, kwargs in launches:
                jit = _jit_twin(kernel)
                bound = dict(zip(jit.arg_names, args, strict=False)) | kwargs
                for p in jit.params:
                    value = bound.get(p.name)
                    if p.is_constexpr or isinstance(value, bool) or not isinstance(value, int):
                        continue
                    name = f"{jit.__name__}.{p.name}"
                    seen.add(name)
                    if p.name.startswith("stride"):
                        assert not p.do_not_specialize, f"{name}: strides stay specialised (alignment)"
                    elif p.name in PER_CALL:
                        assert p.do_not_specialize, f"{name} varies per call: add it to do_not_specialize"
                    else:
                        assert p.name in FIXED, f"{name}: classify it (PER_CALL or FIXED)"
                        assert not p.do_not_specialize, f"{name} is fixed per model: keep it specialised"
    # the launches above did cover the arguments this test is about
    for name in ("_verify_accept_kernel.seed", "_tree_walk_kernel.seed", "_tree_race_kernel.seed"):
        assert name in seen, name
    for name in ("_tree_rrs_kernel.rnd", "_tree_attention_kernel.S", "_tree_attention_combine_kernel.NUM_SPLITS"):
        assert name in seen, name
    assert "_tree_metadata_kernel.B" in seen and "_combine_row_stats_kernel.R" in seen


@pytest.mark.parametrize("B", [1, 16, 17])
def test_batch_size_is_not_a_variant_of_its_own(B):
    """A batch of 1 (a constant to Triton), 16 (divisible) or 17 requests: B, and the rows R it
    gives, are specialised as for any other batch size (tile sizes may differ: they are constexprs)."""
    keys = [_keys(lambda b=b: _chain(7, B=b), False) for b in (B, 2 * B + 1)]
    for (name, spec, _), (name2, spec2, _) in zip(*keys, strict=True):
        assert name == name2
        per_call = {k: v for k, v in spec if k in ("B", "R")}
        assert per_call == {k: v for k, v in spec2 if k in ("B", "R")}, name
