"""speculative_generate: greedy identity with target.generate, exact caches, sampled output ~ target."""

from __future__ import annotations

import copy
import time

import pytest
import torch

pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

from specdec_kernels.hf import speculative_generate  # noqa: E402
from specdec_kernels.hf.cache import cache_kwargs, cache_length  # noqa: E402
from specdec_kernels.hf.generate import open_session  # noqa: E402
from specdec_kernels.reference.sampling import processed_probs  # noqa: E402

from ..ops._stats import ALPHA, chi_square_power, chi_square_pvalue  # noqa: E402
from ._models import tiny_model  # noqa: E402

PAD = 2


def _near_copy(model, noise: float, seed: int):
    """A draft that mostly agrees with the target: its weights plus small noise."""
    draft = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * noise * p.std().clamp_min(1e-3))
    return draft


def _ragged_prompts(B=3, T=8, vocab=97, seed=0, lens=(5, 8, 3)):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (B, T), generator=gen)
    mask = (torch.arange(T)[None, :] >= T - torch.tensor(lens)[:, None]).long()  # left padding
    return ids * mask + PAD * (1 - mask), mask


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=1)
    return target, _near_copy(target, 0.3, seed=5)


def _greedy_reference(target, ids, mask, new, eos=None):
    return target.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=PAD
    )


@pytest.mark.parametrize("K, adaptive", [(1, False), (1, True), (3, False)])
def test_greedy_equals_target_generate(pair, K, adaptive):
    target, draft = pair
    ids, mask = _ragged_prompts()
    expected = _greedy_reference(target, ids, mask, 10)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=10,
        num_draft_tokens=3,
        num_drafts=K,
        eos_token_id=[],
        pad_token_id=PAD,
        adaptive_draft=adaptive,
    )
    assert torch.equal(out.sequences, expected)
    if not adaptive:  # (adaptive drafting may decide that this pair's drafts are not worth it)
        assert out.stats.accepted > 0  # the near-copy draft gets drafts accepted: the fast path is exercised
        assert out.stats.target_forwards < 10 * 1  # fewer target forwards than tokens
    assert sum(out.stats.draft_length_histogram.values()) == out.stats.steps


@pytest.mark.parametrize("B", [1, 3])
def test_confidence_stop_keeps_greedy_identity(pair, B):
    """draft_confidence cuts each chain at its first unsure draft; on the CPU drafting also stops
    once every request has met one, so fewer draft forwards run than the lengths chosen."""
    target, draft = pair
    ids, mask = _ragged_prompts(B=B, lens=(5, 8, 3)[:B])
    expected = _greedy_reference(target, ids, mask, 12)
    # cheap drafts (cost 0.05 of a target forward): the policy asks for long chains
    kwargs = dict(max_new_tokens=12, num_draft_tokens=6, eos_token_id=[], pad_token_id=PAD, draft_cost=0.05)
    plain = speculative_generate(target, draft, ids, mask, **kwargs)
    out = speculative_generate(target, draft, ids, mask, draft_confidence=0.25, **kwargs)
    assert torch.equal(out.sequences, expected) and torch.equal(plain.sequences, expected)
    assert 0 < out.stats.proposed < plain.stats.proposed  # drafts were cut
    if B == 1:
        assert out.stats.draft_forwards < plain.stats.draft_forwards  # and not drafted at all
    assert sum(out.stats.draft_length_histogram.values()) == out.stats.steps


@pytest.mark.parametrize("B", [1, 3])
def test_output_layer_rows_are_the_ones_verification_needs(pair, B):
    """The prefill's logits are never used and the draft's first forward needs only the root's:
    the output layers run on those positions only (the prompt's rows cost a prefill 15-30% on Qwen)."""
    target, draft = pair
    ids, mask = _ragged_prompts()
    ids, mask = ids[:B], mask[:B]
    rows = {"target": [], "draft": []}
    hooks = [
        model.get_output_embeddings().register_forward_pre_hook(
            lambda m, a, name=name: rows[name].append(a[0].shape[1])
        )
        for name, model in (("target", target), ("draft", draft))
    ]
    try:
        out = speculative_generate(
            target, draft, ids, mask, max_new_tokens=12, num_draft_tokens=3, eos_token_id=[], pad_token_id=PAD
        )
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(out.sequences, _greedy_reference(target, ids, mask, 12))
    assert rows["target"][0] == 1 and rows["draft"][0] == 1  # the prefills
    # Batch 1: every draft forward keeps one position; a batch whose requests feed 1 and 2 committed
    # tokens keeps both of its first forward's positions.
    assert all(n <= (1 if B == 1 else 2) for n in rows["draft"][1:])
    assert all(n <= 1 + 3 for n in rows["target"][1:])  # root + drafts


def test_greedy_qwen2_triton_attention_kernel():
    """Same identity with the Triton tree-attention kernel (interpreter) in every forward."""
    target = tiny_model("qwen2", seed=3)
    draft = _near_copy(target, 0.3, seed=6)
    ids, mask = _ragged_prompts(lens=(2, 6, 4), seed=1)
    expected = _greedy_reference(target, ids, mask, 6)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=6,
        num_draft_tokens=2,
        num_drafts=2,
        eos_token_id=[],
        pad_token_id=PAD,
        attention_backend="triton",
    )
    assert torch.equal(out.sequences, expected)


@pytest.mark.slow
@pytest.mark.parametrize("window", [4096, 9])
def test_greedy_mistral_sliding_window(window):
    """Mistral's sliding-window layers (4096 by default): with a tiny window of 9, prompts plus output
    run far past it, so every forward must drop the keys that left the window, as generate does.
    Both cache kinds, and the Triton kernel: the driver keeps full cache layers and applies the window."""
    target = tiny_model("mistral", seed=7, sliding_window=window)
    draft = _near_copy(target, 0.3, seed=8)
    ids, mask = _ragged_prompts(seed=7)
    expected = _greedy_reference(target, ids, mask, 10)
    for cache, attention in (("dynamic", "auto"), ("static", "auto"), ("dynamic", "triton")):
        out = speculative_generate(
            target,
            draft,
            ids,
            mask,
            max_new_tokens=10,
            num_draft_tokens=3,
            num_drafts=2,
            eos_token_id=[],
            pad_token_id=PAD,
            cache_implementation=cache,
            attention_backend=attention,
        )
        assert torch.equal(out.sequences, expected), (cache, attention)
    if window == 9:  # and the window matters: full attention would continue differently
        full = tiny_model("mistral", seed=7, sliding_window=None)
        assert not torch.equal(_greedy_reference(full, ids, mask, 10), expected)
    narrow = tiny_model("mistral", seed=7, sliding_window=4)
    with pytest.raises(NotImplementedError, match="narrower than the tree"):
        speculative_generate(narrow, draft, ids, mask, max_new_tokens=4, num_draft_tokens=3, num_drafts=2)


def test_greedy_prompt_lookup(pair):
    target, _ = pair
    ids, mask = _ragged_prompts(seed=2)
    expected = _greedy_reference(target, ids, mask, 10)
    out = speculative_generate(
        target,
        None,
        ids,
        mask,
        max_new_tokens=10,
        num_draft_tokens=3,
        drafter="prompt_lookup",
        eos_token_id=[],
        pad_token_id=PAD,
    )
    assert torch.equal(out.sequences, expected)
    assert out.stats.draft_forwards == 0


def test_eos_mid_batch(pair):
    """A request that emits EOS stops (padded after it) while the others continue, as in generate."""
    target, draft = pair
    ids, mask = _ragged_prompts(seed=4)
    free = _greedy_reference(target, ids, mask, 10)
    eos = int(free[1, ids.shape[1] + 2])  # request 1's third generated token becomes "EOS"
    expected = _greedy_reference(target, ids, mask, 10, eos=eos)
    out = speculative_generate(
        target, draft, ids, mask, max_new_tokens=10, num_draft_tokens=3, eos_token_id=eos, pad_token_id=PAD
    )
    assert torch.equal(out.sequences, expected)
    assert (out.sequences[1, ids.shape[1] + 3 :] == PAD).all()


def test_prefill_is_its_own_phase(pair, monkeypatch):
    """stats.time_s["prefill"] is the prompts' prefill (the target's and the draft's), nothing else
    (bench_e2e's decode-only speedup subtracts it); the phases add up to the wall time."""
    from specdec_kernels.hf import session as driver

    target, draft = pair
    ids, mask = _ragged_prompts(seed=4)
    real = driver.prefill
    seen = []

    def slow_prefill(*args, **kwargs):
        time.sleep(0.2)
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(driver, "prefill", slow_prefill)
    out = speculative_generate(target, draft, ids, mask, max_new_tokens=4, num_draft_tokens=3, pad_token_id=PAD)
    phases = out.stats.time_s
    assert seen == [1] and phases["prefill"] >= 0.2 and phases["target"] < out.stats.wall_time_s
    assert sum(phases.values()) == pytest.approx(out.stats.wall_time_s, rel=1e-6)


@pytest.mark.parametrize("same_draft, static", [(False, False), (True, False), (False, True)])
def test_cache_after_a_step_equals_fresh_prefill(pair, same_draft, static):
    """After each step both caches hold exactly the committed tokens (all but the last u) in slots [0, C_b).

    same_draft: the draft is the target, every draft is accepted and the draft cache misses its last
    draft (u = 2), the case that needs two tokens in the next draft forward. static: StaticCache
    buffers, which must keep their address (what CUDA graphs replay)."""
    target, draft = pair
    draft = copy.deepcopy(target) if same_draft else draft
    ids, mask = _ragged_prompts(seed=5)
    cache = "static" if static else "dynamic"
    settings = dict(num_draft_tokens=3, num_drafts=2, seed=0, cache_implementation=cache, max_new_tokens=20)
    with open_session(target, draft, ids, mask, **settings) as session:
        addresses = None
        for _ in range(2):
            result = session.step()
            if same_draft:
                assert result.accepted == [3, 3, 3] and session.drafter.uncached.tolist() == [2, 2, 2]
            assert_caches_hold_the_committed_tokens(session, target, draft)
            if static:
                now = [(layer.keys.data_ptr(), layer.keys.shape[2]) for layer in session.t_cache.layers]
                assert all(length == session.static_len for _, length in now)
                assert addresses is None or now == addresses
                addresses = now


def assert_caches_hold_the_committed_tokens(session, target, draft) -> None:
    """Both caches hold exactly request b's first C_b committed tokens in slots [0, C_b), as a fresh
    prefill of them would (C_b: the target's / the drafter's cached counts), and no slot past the longest."""
    batch, tokens = session.batch, session.tokens
    for model, cache, cached in (
        (target, session.t_cache, batch.target_cached),
        (draft, session.drafter.cache, session.drafter.cached),
    ):
        assert cache_length(cache) == int(cached.max())
        for a, b in enumerate(batch.rows):
            n = int(cached[a])
            assert n <= int(tokens.length[b])
            fresh = DynamicCache(config=model.config)
            model(input_ids=tokens.seq[b : b + 1, :n], **cache_kwargs(model, fresh))
            for layer, fresh_layer in zip(cache.layers, fresh.layers):
                torch.testing.assert_close(layer.keys[a : a + 1, :, :n], fresh_layer.keys, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(layer.values[a : a + 1, :, :n], fresh_layer.values, atol=1e-5, rtol=1e-5)


def _static_runs_equal_generate(target, draft, batch: dict, pad: int, longest: int = 13, G: int = 4):
    """Greedy static-cache runs for max_new_tokens 1..longest at K = 1 and 2 (G drafts every step)
    equal generate's tokens; returns the last run's accepted-length histogram [B, G+1]."""
    T = batch["input_ids"].shape[1]
    expected = target.generate(**batch, max_new_tokens=longest, do_sample=False, eos_token_id=[], pad_token_id=pad)
    for K in (1, 2):
        for new in range(1, longest + 1):
            out = speculative_generate(
                target,
                draft,
                **batch,
                max_new_tokens=new,
                num_draft_tokens=G,
                num_drafts=K,
                eos_token_id=[],
                pad_token_id=pad,
                adaptive_draft=False,
                cache_implementation="static",
            )
            assert torch.equal(out.sequences, expected[:, : T + new]), (K, new)
    return out.stats.accepted_length_histogram


def test_static_cache_fits_every_output_length():
    """StaticCache at every output length 1..13, K = 1 and 2: greedy output equals generate's.

    The case that overflowed the buffers: a longest-prompt request finishes with drafts accepted past
    its max_new_tokens cut while another request goes on. The draft here is the target except that it
    never proposes request 1's first token (its output row zeroed), so request 0 accepts every draft
    and request 1 lags. Before the fix the finished request kept those drafts in the caches and the
    next tree ran past the static bound (IndexError at max_new_tokens 2, 7, 12 for both K)."""
    target = tiny_model("llama", seed=1)
    ids, mask = _ragged_prompts(T=8, lens=(8, 8, 5))
    first = _greedy_reference(target, ids, mask, 13 + 4, eos=[])[:, 8:]
    draft = copy.deepcopy(target)
    with torch.no_grad():
        draft.lm_head.weight[int(first[1, 0])] = 0
    assert int(first[1, 0]) not in first[0].tolist()  # request 0's drafts are all accepted
    hist = _static_runs_equal_generate(target, draft, dict(input_ids=ids, attention_mask=mask), PAD)
    assert int(hist[0, :-1].sum()) == 0 and int(hist[1, :-1].sum()) > 0  # the scenario above


@pytest.mark.slow
def test_static_cache_fits_every_output_length_demo_pair():
    """The report's case (the demo pair's four ragged prompts, 24..98 tokens, failed at max_new_tokens=10)
    at every output length 1..13, K = 1 and 2 (about 20 s on a CPU)."""
    from specdec_kernels.demo import DEMO_PROMPTS, load_demo_pair

    target, draft, tok = load_demo_pair()
    _static_runs_equal_generate(target, draft, tok(list(DEMO_PROMPTS[:4])), tok.pad_token_id)


def test_static_cache_gives_the_same_tokens(pair):
    """cache_implementation="static": greedy equals generate, and sampling with a seed draws exactly
    the tokens of the DynamicCache run (same random stream, same logits); EOS mid-batch drops a
    request from the static buffers."""
    target, draft = pair
    ids, mask = _ragged_prompts(seed=4)
    expected = _greedy_reference(target, ids, mask, 8)
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=8,
        num_draft_tokens=3,
        num_drafts=3,
        eos_token_id=[],
        pad_token_id=PAD,
        cache_implementation="static",
    )
    assert torch.equal(out.sequences, expected)
    eos = int(expected[1, ids.shape[1] + 2])
    runs = [
        speculative_generate(
            target,
            draft,
            ids,
            mask,
            max_new_tokens=8,
            num_draft_tokens=2,
            num_drafts=2,
            temperature=0.8,
            seed=3,
            eos_token_id=eos,
            pad_token_id=PAD,
            cache_implementation=impl,
        )
        for impl in ("dynamic", "static")
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    assert runs[0].stats.accepted == runs[1].stats.accepted


@pytest.mark.parametrize("attention_backend, compiler", [("torch", "eager"), ("triton", "aot_eager")])
def test_compiled_target_forward_is_one_graph(pair, attention_backend, compiler):
    """compile_target: the verification forward traces as ONE graph (fullgraph=True: no graph break,
    which CUDA graphs need), is reused across steps (one graph per active batch size, not per step),
    and gives generate's tokens. aot_eager runs the fake of the specdec::tree_attention op."""
    from torch._dynamo.utils import counters

    target, draft = pair
    ids, mask = _ragged_prompts(seed=6)
    expected = _greedy_reference(target, ids, mask, 6)
    torch._dynamo.reset()
    counters.clear()
    out = speculative_generate(
        target,
        draft,
        ids,
        mask,
        max_new_tokens=6,
        num_draft_tokens=2,
        num_drafts=2,
        eos_token_id=[],
        pad_token_id=PAD,
        cache_implementation="static",
        attention_backend=attention_backend,
        compile_target={"backend": compiler},
    )
    assert torch.equal(out.sequences, expected)
    graphs = counters["stats"]["unique_graphs"]
    assert 1 <= graphs <= 3 < out.stats.target_forwards, (graphs, out.stats.target_forwards)
    assert not counters["graph_break"]


def _two_token_distribution(target, prompt, temperature, top_k=0, top_p=1.0):
    """Exact p(x1, x2 | prompt) of the target after temperature/top-k/top-p (the reference's
    processing), [V, V]."""
    V = target.config.vocab_size

    def probs(logits):  # [R, V] -> [R, V] float64
        return torch.stack([processed_probs(row, temperature, top_k, top_p) for row in logits.float()])

    with torch.no_grad():
        first = probs(target(input_ids=torch.tensor([prompt])).logits[:, -1])[0]
        seqs = torch.tensor([prompt + [x] for x in range(V)])
        second = probs(target(input_ids=seqs).logits[:, -1])
    return first[:, None] * second


@pytest.mark.parametrize(
    "K, method, sampling",
    [
        (1, "kseq", {}),
        (2, "kseq", {}),
        (2, "rrs", {}),
        (2, "rrs_wor", {}),
        (1, "kseq", dict(temperature=0.8, top_k=4, top_p=0.9)),
        (2, "kseq", dict(temperature=0.8, top_k=4, top_p=0.9)),
        (1, "kseq", dict(draft_confidence=0.3)),  # drafts cut at the draft's first unsure position
    ],
)
def test_sampled_output_follows_the_target(K, method, sampling):
    """Chi-square (alpha 1e-6) on the first two generated tokens (V = 6: 36 cells) of 3000 requests,
    against the target's own distribution after the same temperature/top-k/top-p processing.

    Power, asserted below: at this sample size the test rejects with probability > 0.99 both the
    draft's own distribution (a verifier that accepts everything) and, on the first token alone, a
    verifier that resamples from p instead of the residual max(p - q, 0) after a rejection.
    """
    V, n = 6, 3000
    sampling = {"temperature": 1.0, **sampling}
    confidence = sampling.pop("draft_confidence", 0.0)
    target = tiny_model("llama", vocab=V, seed=13, init_std=0.1)  # flat: p_max ~ 0.3, overlap ~ 0.7
    draft = tiny_model("llama", vocab=V, seed=14, init_std=0.1, layers=1)
    prompt = [3, 4, 5, 0]
    expected = _two_token_distribution(target, prompt, **sampling)
    draft_dist = _two_token_distribution(draft, prompt, **sampling)
    assert chi_square_power(expected.flatten(), draft_dist.flatten(), n) > 0.99
    p1, q1 = expected.sum(1), draft_dist.sum(1)
    resample_from_p = torch.minimum(p1, q1) + (1 - torch.minimum(p1, q1).sum()) * p1
    assert chi_square_power(p1, resample_from_p, n) > 0.99
    ids = torch.tensor([prompt] * n)
    out = speculative_generate(
        target,
        draft,
        ids,
        max_new_tokens=2,
        num_draft_tokens=2,
        num_drafts=K,
        method=method,
        seed=1,
        eos_token_id=[],
        draft_confidence=confidence,
        **sampling,
    )
    pairs = out.sequences[:, len(prompt) :]
    assert 0 < out.stats.acceptance_rate < 0.95  # both accept and reject paths ran
    assert chi_square_pvalue(pairs[:, 0] * V + pairs[:, 1], expected.flatten()) > ALPHA
    assert chi_square_pvalue(pairs[:, 0], p1) > ALPHA


def test_vocab_mismatch_is_a_clear_error():
    target = tiny_model("llama", vocab=97)
    draft = tiny_model("llama", vocab=101, layers=1)
    ids = torch.randint(3, 97, (1, 4))
    with pytest.raises(ValueError, match=r"draft vocabulary size \(101\) differs from the target's \(97\)"):
        speculative_generate(target, draft, ids, max_new_tokens=2)
    # Padded embedding rows of one shared tokenizer: the real ids are the first 97.
    out = speculative_generate(target, draft, ids, max_new_tokens=3, vocab_size=97, eos_token_id=[])
    assert out.sequences.shape == (1, 7) and int(out.sequences.max()) < 97


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_drafts=3, drafter="prompt_lookup", draft=None), "one chain"),
        (dict(method="nope"), "method"),
        (dict(num_draft_tokens=8, num_drafts=8), "<= 64"),
        (dict(temperature=-1.0), "temperature"),
        (dict(drafter="model", draft=None), "prompt_lookup"),
        (dict(cache_implementation="paged"), "cache_implementation"),
        (dict(compile_target=True), "static"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e300), "temperature"),
        (dict(temperature=1e-40), "temperature"),
        (dict(seed=2**64), "seed"),
        (dict(seed=-1), "seed"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(draft_confidence=2.0), "draft_confidence"),
        (dict(attention_mask=torch.tensor([[1, 1, 1, 0]])), "left-padded"),
        (dict(attention_mask=torch.tensor([[0, 1, 0, 1]])), "left-padded"),
    ],
)
def test_bad_arguments(pair, kwargs, match):
    target, draft = pair
    call = dict(draft=draft)
    call.update(kwargs)
    mask = call.pop("attention_mask", None)
    with pytest.raises(ValueError, match=match):
        speculative_generate(target, call.pop("draft"), torch.randint(3, 97, (1, 4)), mask, **call)


@pytest.mark.parametrize("kwargs", [dict(max_new_tokens=2.5), dict(num_draft_tokens=2.0), dict(num_drafts="2")])
def test_non_int_arguments_are_type_errors(pair, kwargs):
    target, draft = pair
    with pytest.raises(TypeError, match=next(iter(kwargs))):
        speculative_generate(target, draft, torch.randint(3, 97, (1, 4)), **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("cache, compile_target", [("dynamic", False), ("static", False), ("static", True)])
def test_greedy_on_cuda(pair, cache, compile_target):
    """On a GPU: the Triton tree-attention kernel in every forward, and the performance path
    (static cache, compiled verification forward captured as a CUDA graph) give generate's tokens."""
    target, draft = (copy.deepcopy(m).cuda() for m in pair)
    ids, mask = (t.cuda() for t in _ragged_prompts(seed=9))
    expected = _greedy_reference(target, ids, mask, 10)
    for _ in range(2 if compile_target else 1):  # the second run replays the captured graphs
        out = speculative_generate(
            target,
            draft,
            ids,
            mask,
            max_new_tokens=10,
            num_draft_tokens=3,
            num_drafts=3,
            eos_token_id=[],
            pad_token_id=PAD,
            cache_implementation=cache,
            compile_target=compile_target,
        )
        assert torch.equal(out.sequences, expected)
