"""``specdec demo`` (no arguments): the embedded byte-level draft/target pair generates Python code
four ways, side by side: target alone, chain speculative decoding, K-draft SpecTr, and the target's
own Medusa heads (a token tree, no draft model); it prints tokens/s, acceptance, mean accepted
length, and whether the greedy outputs equal the target's.

The draft and tree settings are checked by ``speculative_generate`` in the untimed warm-up (the
first driver calls), and reported naming the flag.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ._common import (
    DRIVER_FLAGS,
    UsageError,
    at_least,
    check_positions,
    check_sampled_temperature,
    driver_checks,
    print_table,
    quiet_transformers,
    resolve_device,
)

# the Medusa rows pass --medusa-nodes / --medusa-candidates as the driver's num_draft_tokens / num_drafts
MEDUSA_FLAGS = {**DRIVER_FLAGS, "num_draft_tokens": "--medusa-nodes", "num_drafts": "--medusa-candidates"}
# the dynamic-tree rows pass --tree-nodes as num_draft_tokens
TREE_FLAGS = {**DRIVER_FLAGS, "num_draft_tokens": "--tree-nodes"}


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("demo", help="target alone vs speculative decoding on the embedded model pair")
    p.add_argument("--prompts", type=int, default=5, help="how many of the demo prompts (README: 5)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--num-drafts", type=int, default=2)
    p.add_argument("--medusa-nodes", type=int, default=16, help="Medusa rows: tree nodes besides the root")
    p.add_argument("--medusa-candidates", type=int, default=3, help="Medusa rows: candidates per head")
    p.add_argument("--tree-nodes", type=int, default=16, help="dynamic-tree rows: tree nodes besides the root")
    p.add_argument("--tree-width", type=int, default=4, help="dynamic-tree rows: children per node")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.7, help="for the sampled rows")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: 2, or 1 on one core)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument(
        "--json",
        action="store_true",
        help="instead: a JSON-schema-constrained generation (xgrammar, the grammar extra), target alone vs chain",
    )
    return p


def validate(args: argparse.Namespace) -> None:
    """The demo's own limits, before the pair loads (draft and tree sizes: the driver's, in the warm-up)."""
    from ..demo import DEMO_PROMPTS

    resolve_device(args.device)
    if not 1 <= args.prompts <= len(DEMO_PROMPTS):
        raise UsageError("--prompts", args.prompts, f"an integer in [1, {len(DEMO_PROMPTS)}]")
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    check_sampled_temperature(args.temperature)  # the target-only rows run before any driver call
    at_least("--threads", args.threads, 0, " (0 = default)")


def demo(args: argparse.Namespace) -> int:
    """Target alone vs chain speculative decoding vs K-draft SpecTr on the embedded pair, greedy and
    sampled, one prompt at a time (batch 1, as on a laptop), torch pinned to a fixed thread count."""
    device = resolve_device(args.device)
    threads = args.threads or min(2, os.cpu_count() or 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)  # oversubscribed threads made this demo 4-6x slower under load
    try:
        return _demo(args, device, threads)
    finally:  # a caller in the same process (a test, a notebook) keeps its own thread count
        torch.set_num_threads(previous)


def _demo(args: argparse.Namespace, device: str, threads: int) -> int:
    """``demo`` with its device resolved and torch pinned to ``threads``."""
    from tqdm.auto import tqdm

    from ..demo import DEMO_PROMPTS, load_demo_pair, load_medusa_heads, timing

    quiet_transformers()
    target, draft, tok = load_demo_pair(device=device)
    if args.json:
        return _json_demo(target, draft, tok, device, args)
    heads = load_medusa_heads(device=device)
    prompts = list(DEMO_PROMPTS[: args.prompts])
    longest = max(tok([p], return_tensors="pt")["input_ids"].shape[1] for p in prompts)
    check_positions(args.max_new_tokens, longest, max(args.num_draft_tokens, heads.num_heads), target, draft)
    new, G, K, T = args.max_new_tokens, args.num_draft_tokens, args.num_drafts, args.temperature
    where = "CUDA" if device == "cuda" else f"CPU, torch pinned to {threads} thread(s)"
    print(
        f"specdec demo: embedded byte-level pair, {len(prompts)} prompts one at a time, {new} new tokens each, {where}"
    )
    N, S = args.medusa_nodes, args.medusa_candidates
    medusa = dict(drafter="medusa", medusa_heads=heads, num_draft_tokens=N, num_drafts=S)
    medusa_name = f"Medusa {heads.num_heads} heads, N={N}, s={S}"
    tree = dict(draft_tree="dynamic", num_draft_tokens=args.tree_nodes, tree_width=args.tree_width)
    tree_name = f"dynamic tree N={args.tree_nodes}, k={args.tree_width}"
    modes = [  # (name, speculative kwargs or None for the target alone, sampled)
        ("target only (greedy)", None, False),
        (f"chain, G<={G} (greedy)", dict(num_drafts=1), False),
        (f"SpecTr K={K}, G={G} (greedy)", dict(num_drafts=K, method="kseq"), False),
        (f"{medusa_name} (greedy)", medusa, False),
        (f"{tree_name} (greedy)", tree, False),
        (f"target only (T={T})", None, True),
        (f"chain, G<={G} (T={T})", dict(num_drafts=1), True),
        (f"SpecTr K={K}, G={G} (T={T})", dict(num_drafts=K, method="kseq"), True),
        (f"{medusa_name} (T={T})", medusa, True),
        (f"{tree_name} (T={T})", tree, True),
    ]
    _warm_up(target, draft, tok, device, G, K, medusa, tree)  # the driver's checks first: a refused setting is one line
    timing.prepare_native_backend(device)  # the build, if any, before anything is timed
    if warning := timing.load_warning():
        print(warning, file=sys.stderr)
    progress = lambda m: tqdm(m, desc="specdec demo", unit="mode", disable=not sys.stderr.isatty())  # noqa: E731
    settings = dict(max_new_tokens=new, temperature=T, num_draft_tokens=G, seed=args.seed)
    rows, outputs = timing.demo_rows(target, draft, tok, device, prompts, modes, settings, progress)
    print()
    print_table(rows)
    print(
        "\nspeedup: per prompt, wall (cpu speedup: process CPU) time of the target alone in the same sampling mode / "
        "this mode's, the two timed back to back; the median over prompts [lowest-highest] (draft forwards, "
        "or Medusa heads and tree building, included); greedy rows must equal the target's own greedy output. "
        "accept: accepted drafts / drafts offered (trees, Medusa's and dynamic: / the tree's depth, one path is "
        "accepted per step)."
    )
    chain = modes[1][0]
    print(f"\nfirst prompt | {chain} continuation (cut at a byte boundary):")
    print(_show(prompts[0], tok.decode(outputs[chain][0])))
    return 0 if all(r["greedy = target"] in ("True", "(baseline)", "n/a (sampled)") for r in rows) else 1


# A small schema: what structure-heavy output looks like to a drafter (the keys and punctuation).
JSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
    },
    "required": ["name", "count", "tags"],
}


def _json_demo(target, draft, tok, device, args) -> int:
    """Greedy JSON-schema-constrained generation: generate with xgrammar's transformers processor
    vs speculative_generate(grammar=...), timed back to back; equal output, and valid JSON."""
    import json

    try:
        from xgrammar.contrib.hf import LogitsProcessor
    except ImportError as exc:
        raise UsageError("--json", True, 'the grammar extra: pip install -e ".[grammar]"') from exc
    from ..demo import EOS_ID, VOCAB_SIZE
    from ..hf import speculative_generate
    from ..hf.grammar import GrammarSpec, compile_grammar

    grammar = compile_grammar(GrammarSpec(json_schema=JSON_SCHEMA, any_whitespace=False), tok, VOCAB_SIZE, [EOS_ID])
    batch = tok(["record = "], return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    kw = dict(max_new_tokens=args.max_new_tokens, pad_token_id=EOS_ID, eos_token_id=EOS_ID)
    speculative_generate(target, draft, ids, mask, grammar=grammar, **{**kw, "max_new_tokens": 4})  # warm-up
    start = time.perf_counter()
    with torch.no_grad():
        want = target.generate(
            ids, attention_mask=mask, do_sample=False, logits_processor=[LogitsProcessor(grammar)], **kw
        )
    alone = time.perf_counter() - start
    start = time.perf_counter()
    out = speculative_generate(target, draft, ids, mask, grammar=grammar, num_draft_tokens=args.num_draft_tokens, **kw)
    ours = time.perf_counter() - start
    text = tok.decode(out.sequences[0, ids.shape[1] :])
    same = torch.equal(out.sequences, want[:, : out.sequences.shape[1]])
    try:
        json.loads(text)
        valid = "yes"
    except ValueError:
        valid = "no (cut by --max-new-tokens)"
    print(f"JSON schema: {json.dumps(JSON_SCHEMA)}")
    print(f"output: {text}")
    print(f"target alone + xgrammar: {alone:.2f} s; chain + grammar=: {ours:.2f} s ({alone / ours:.2f}x); "
          f"equal: {same}; valid JSON: {valid}; accepted drafts {out.stats.acceptance_rate:.2f}")  # fmt: skip
    return 0 if same else 1


def _warm_up(target, draft, tok, device, G: int, K: int, medusa: dict, tree: dict) -> None:
    """One short untimed run of every path (first calls pay for lazy initialisation and, once per
    machine, the build of the CPU backend)."""
    from ..hf import speculative_generate

    batch = tok(["def f(x):\n    return "], return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with torch.no_grad():
        target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id
        )
    with driver_checks(DRIVER_FLAGS):  # the driver's own checks of --num-draft-tokens / --num-drafts
        for kwargs in (dict(num_drafts=1), dict(num_drafts=K, temperature=0.7, seed=0)):
            speculative_generate(target, draft, ids, mask, max_new_tokens=8, num_draft_tokens=G, **kwargs)
    with driver_checks(TREE_FLAGS):  # ... of --tree-nodes / --tree-width
        for sampling in (dict(), dict(temperature=0.7, seed=0)):
            speculative_generate(target, draft, ids, mask, max_new_tokens=8, **tree, **sampling)
    with driver_checks(MEDUSA_FLAGS):  # ... and of --medusa-nodes / --medusa-candidates
        for sampling in (dict(), dict(temperature=0.7, seed=0)):
            speculative_generate(target, None, ids, mask, max_new_tokens=8, **medusa, **sampling)


def _show(prompt: str, continuation: str) -> str:
    """Prompt and continuation, visibly separated: the continuation after a '>>>' marker line."""
    return f"{prompt.rstrip()}\n{'-' * 20} >>> generated {'-' * 20}\n{continuation}"
