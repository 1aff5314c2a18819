"""End-to-end benchmark: tokens/s of ``specdec_kernels.hf.speculative_generate`` against Hugging Face.

What is measured
----------------
Whole generate calls on real prompts with a target model and a draft model: the wall time from the
call to its return (prefill included; CUDA synchronised before and after), the new tokens it
produced (up to and including the first EOS, at most ``--max-new-tokens``), and tokens/s = new
tokens / wall time summed over every prompt of a prompt set. Modes (``--modes``):

* ``target_only``        -- ``target.generate`` without speculation (the baseline).
* ``hf_assisted``        -- ``target.generate(..., assistant_model=draft)``: Hugging Face assisted
                            generation with the same draft (HF's default number of assistant tokens
                            unless ``--hf-assistant-tokens``). Batch size 1 only, as HF requires;
                            skipped otherwise.
* ``ours_k1``            -- ``speculative_generate`` with one chain of G = ``--G`` draft tokens.
* ``ours_k2``, ``ours_k4`` -- K = 2 / 4 chains of G tokens (a tree) verified with ``--method``
                            (default ``kseq``, SpecTr K-SEQ).
* ``ours_dyntree``       -- ``draft_tree="dynamic"``: a token tree of N = ``--G`` nodes, ``--tree-width``
                            children per node, grown by the draft (rows: nodes per step, mean depth).
* ``ours_dyntree_lookup`` -- the same with ``prompt_lookup=True``: the request's n-gram continuation is
                            one more branch of the tree, within its N nodes.
* ``ours_dyntree_fixed`` -- ``ours_dyntree`` keeping ``--tree-threshold`` every step (no learned node
                            threshold: ``SPECDEC_FIXED_TREE_THRESHOLD=1`` around the call), for before / after.
* ``ours_k1_vocab``, ``ours_dyntree_vocab`` -- ``ours_k1`` / ``ours_dyntree`` with the draft restricted to
                            ``--draft-vocab`` token ids (``draft_vocab=``: its output layer computes those rows
                            only; the ids are the tokenizer's specials and its lowest ids, BPE merge order:
                            no corpus, so neither prompt set is favoured).
* ``ours_k1_int8``, ``ours_block_int8``, ``ours_dyntree_int8``, ``ours_dyntree_vocab_int8``,
  ``hf_assisted_int8`` --  the same modes with a copy of the draft whose linear layers are int8 (``use_int8_linears``,
                            ``--int8-keep``) and the rest in ``--int8-dtype`` (default fp32, not
                            ``--draft-dtype``: bf16 elementwise ops cost more than they save on CPUs
                            without native bf16 math): cheaper draft forwards, the same output law.
* ``ours_k1_int8fb``, ``ours_block_int8fb``, ``hf_assisted_int8fb`` -- the ``*_int8`` modes on fbgemm's
                            int8 kernel (``use_int8_linears(kernel="fbgemm")``; ``*_int8`` use the native one
                            where the native CPU build loads), for the two kernels side by side.
* ``ours_k1_int4``, ``ours_block_int4``, ``ours_dyntree_int4``, ``hf_assisted_int4`` -- the same with int4
                            linear layers (``use_int4_linears``: our W4A8 kernel, half int8's bytes), same
                            ``--int8-keep`` / ``--int8-dtype``; the rows' ``draft_int8`` column reads
                            ``int4 <dtype> keep=...``.
* ``ours_prompt_lookup`` -- ``speculative_generate(drafter="prompt_lookup")``: n-gram drafts from the
                            request's own tokens, no draft model.
* ``hf_prompt_lookup``   -- (not run by default) ``target.generate(prompt_lookup_num_tokens=G)``,
                            Hugging Face's prompt-lookup decoding, for comparison with the mode above.

Every mode runs on every batch of prompts before the next batch (interleaved, so clock or thermal
drift affects all modes alike), greedy (``--temperature 0``, the default) and/or sampled
(e.g. ``--temperature 0 0.7``; top-k/top-p off unless ``--top-k``/``--top-p``). Both models' generation
configs are reset to neutral ones (no repetition penalty, no sampling defaults) so that every mode
decodes the same distribution; the values that were dropped are printed.

On CPU every mode (baselines included) runs the models' linear layers through oneDNN on packed
weights (``--cpu-linear onednn``, the default; ``specdec_kernels.hf.cpu_linear``): PyTorch's fp32
``nn.Linear`` (MKL) can cost 2-3x a one-token forward for 2-4 tokens, which no verification forward
recovers. ``--draft-dtype bf16`` runs the draft in bf16 (acceptance may change, outputs cannot);
``--threads`` pins torch's thread count. Rows record ``draft_dtype``, ``cpu_linear`` and ``threads``.
Several kinds (``--cpu-linear native onednn``) load one copy of the models per kind and run the kinds in
turn on each prompt set and temperature: side by side in one run, each kind's speedups over its own
baselines.

Prompts: ``code`` -- the opening of the first top-level ``def``/``class`` of a fixed list of
standard-library modules (``sysconfig.get_paths()["stdlib"]``), cut at a line boundary after
``--prompt-chars`` characters; ``prose`` -- three short English paragraphs fixed in this file, cut
mid-sentence. Models: ``--target DIR --draft DIR`` (local Hugging Face directories, e.g.
``bench/models/Qwen2.5-Coder-1.5B-Instruct`` and ``bench/models/Qwen2.5-Coder-0.5B-Instruct`` from
``bench/models.py``; the tokenizer comes from the target's directory), or ``--pair demo`` (the
embedded byte-level pair of ``specdec_kernels.demo``). ``--smoke`` builds two tiny random Llama
models instead (vocabulary 100, 2 layers, hidden 64; the draft is the target plus small weight
noise) with a byte tokenizer, and needs no files.

How to read a row
-----------------
One row per (temperature, prompt set, mode):

* ``new_tokens`` / ``wall_s`` / ``tokens_per_s``: totals over the prompt set (times ``--rep``).
  On CPU, verification runs the native CPU build (``backend="auto"``), so CPU rows are real
  speedups on this machine; compare process CPU time (``cpu_s``) on a shared machine.
* ``speedup_vs_target`` = tokens_per_s / target_only's tokens_per_s; ``speedup_vs_hf_assisted`` =
  tokens_per_s / hf_assisted's; both from this run, same prompts, same temperature.
* ``prefill_s``: the prompts' prefill inside ``wall_s`` (ours: the driver's ``prefill`` phase, the
  target's and the draft's; target_only: one target forward over the prompts, timed apart);
  ``decode_speedup_vs_target``: tokens per second of wall time without the prefill, over
  target_only's (what speculative decoding changes; the prefill is the same work in both).
  ``time_prefill`` / ``time_draft`` / ... ``time_other``: the driver's phases as shares of ``wall_s``.
* ``acceptance_rate``: accepted / proposed draft tokens; ``mean_accepted_length``: tokens committed
  per request per target forward (accepted drafts + 1); ``target_forwards`` / ``draft_forwards``:
  forward passes summed over the calls (ours only; Hugging Face does not report them).
* ``greedy_equal``: at temperature 0, ``yes`` when every prompt's output equals target_only's token for
  token, else ``no``; ``greedy_equal_prompts`` = equal / compared. ``speculative_generate`` is exact,
  so in fp32 a ``no`` is a bug; in bf16/fp16 a tree forward and one-token decoding round differently,
  which can flip a near-tie and change the rest of that output (HF assisted generation has the same
  effect).
* ``G`` / ``K``: draft tokens per chain and chains (``hf`` for HF's own assistant-token schedule);
  for the dynamic trees G = N, the tree's node budget. ``--G 2 4 8 16`` sweeps it (baselines once),
  ``plot.py`` draws speedup against it, chain against tree.
* Per step (ours): ``nodes_per_step`` the draft-token slots the target scored per request (a tree's
  nodes, the step's budget; K times the drafts for chains), ``depth_mean`` (trees: draft forwards
  per target forward, i.e. the tree's depth), ``mean_accepted_length``, ``draft_ms_per_step`` /
  ``target_ms_per_step`` (the driver's draft and target-forward phases, wall milliseconds per step);
  dynamic trees: ``tree_width`` and ``tree_threshold`` (0: unshaped).
* ``status``: ``ok``, ``skipped: ...`` or ``error`` (see stderr).

Usage
-----
    python bench/bench_e2e.py --target bench/models/Qwen2.5-Coder-1.5B-Instruct \\
        --draft bench/models/Qwen2.5-Coder-0.5B-Instruct         # -> bench/results/e2e.csv
    python bench/bench_e2e.py --pair demo --temperature 0 0.7 --max-new-tokens 64
    python bench/bench_e2e.py --target DIR --draft DIR --modes target_only ours_k1 ours_k4 --G 6 --batch-size 4
    python bench/bench_e2e.py --target DIR --draft DIR --device cpu --threads 1 --draft-dtype bf16 \\
        --modes target_only hf_assisted ours_k1 --code-prompts 4 --prose-prompts 2 --G 4 8 16
    python bench/bench_e2e.py --smoke                             # tiny random models on CPU (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # `import _common` when run or imported
import _common as common  # noqa: E402
from _e2e_inputs import PROSE_PROMPTS, Pair, encode, load_pairs, prompt_sets  # noqa: E402

MODES = (
    "target_only",
    "hf_assisted",
    "ours_k1",
    "ours_block",
    "ours_k2",
    "ours_k4",
    "ours_dyntree",
    "ours_dyntree_lookup",
    "ours_dyntree_fixed",
    "ours_k1_vocab",
    "ours_dyntree_vocab",
    "ours_k1_int8",
    "ours_block_int8",
    "ours_dyntree_int8",
    "ours_dyntree_vocab_int8",
    "hf_assisted_int8",
    "ours_k1_int8fb",
    "ours_block_int8fb",
    "hf_assisted_int8fb",
    "ours_k1_int4",
    "ours_block_int4",
    "ours_dyntree_int4",
    "hf_assisted_int4",
    "ours_prompt_lookup",
    "hf_prompt_lookup",
)
# Hugging Face's generate: batch 1, no grammar
HF_MODES = ("hf_assisted", "hf_assisted_int8", "hf_assisted_int8fb", "hf_assisted_int4", "hf_prompt_lookup")
DEFAULT_MODES = ("target_only", "hf_assisted", "ours_k1", "ours_k2", "ours_k4", "ours_prompt_lookup")
SMOKE_MODES = (
    "target_only",
    "hf_assisted",
    "ours_k1",
    "ours_block",
    "ours_k2",
    "ours_k1_int8",
    "ours_k1_int4",
    "ours_prompt_lookup",
)
DRAFT_MODES = tuple(m for m in MODES if m not in ("target_only", "ours_prompt_lookup", "hf_prompt_lookup"))
PROMPT_SETS = ("code", "prose")
QUANTISED_DRAFTS = ("int8", "int8fb", "int4")  # mode suffixes: which copy of the draft runs (Pair.quantised)

AXES = {
    "G": common.Axis(
        "draft tokens per chain (the maximum with adaptive drafting) for ours and hf_prompt_lookup; several "
        "values sweep gamma in one run and report the best",
        (4,),
        (4,),
    ),
    "max_new_tokens": common.Axis("new tokens per prompt", 128, 8, many=False),
    "code_prompts": common.Axis("number of standard-library code prompts", 8, 1, many=False),
    "prose_prompts": common.Axis(f"number of prose prompts, <= {len(PROSE_PROMPTS)}", 3, 1, many=False),
    "prompt_chars": common.Axis("prompt length in characters", 800, 120, many=False),
}
WARMUP_NEW_TOKENS = 16  # max_new_tokens of the untimed warm-up calls

CSV_COLUMNS = (
    "date commit device torch triton transformers target_model draft_model model_dtype draft_dtype "
    "cpu_linear threads mode status G K method temperature top_k top_p prompt_set prompts prompt_tokens_mean "
    "batch_size max_new_tokens rep new_tokens wall_s cpu_s tokens_per_s speedup_vs_target "
    "cpu_speedup_vs_target speedup_vs_hf_assisted prefill_s decode_speedup_vs_target acceptance_rate "
    "mean_accepted_length target_forwards draft_forwards time_prefill time_draft time_target time_verify "
    "time_commit time_other drafts_per_step depth_mean "
    "nodes_per_step draft_ms_per_step target_ms_per_step tree_width tree_threshold draft_vocab "
    "draft_int8 greedy_equal greedy_equal_prompts grammar grammar_valid grammar_complete seed warmup cache compiled "
    "triton_interpret cuda python"
).split()
TABLE_COLUMNS = (
    "temperature prompt_set mode G K new_tokens wall_s cpu_s tokens_per_s speedup_vs_target cpu_speedup_vs_target "
    "speedup_vs_hf_assisted decode_speedup_vs_target acceptance_rate mean_accepted_length target_forwards "
    "time_prefill time_draft time_other greedy_equal "
    "grammar_valid status"
).split()


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


@dataclass
class Result:
    new_tokens: list[list[int]]  # per row, up to and including the first EOS
    wall_s: float
    stats: object | None = None  # SpeculativeStats (ours)
    cpu_s: float = 0.0  # process CPU time (steadier than wall time on a shared machine)
    prefill_s: float | None = None  # the prompts' prefill within wall_s (ours: stats; target_only: timed apart)


def new_tokens_per_row(sequences: torch.Tensor, prompt_width: int, eos: set[int]) -> list[list[int]]:
    out = []
    for row in sequences[:, prompt_width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append(row[:end])
    return out


def _sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn: Callable, device: str):
    """(fn(), wall seconds, process CPU seconds)."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    _sync(device)
    return out, time.perf_counter() - t0, time.process_time() - c0


def mode_settings(mode: str, args) -> dict:
    """G, K, method and drafter of a mode (G/K 'hf' where Hugging Face chooses)."""
    if mode == "target_only":
        return {"G": None, "K": None, "method": None}
    quant = next((q for q in QUANTISED_DRAFTS if mode.endswith("_" + q)), None)
    quantised = {"quant": quant} if quant else {}  # which quantised copy of the draft (Pair.quantised)
    mode = mode.removesuffix("_" + quant) if quant else mode
    if mode == "hf_assisted":
        return {"G": args.hf_assistant_tokens or "hf", "K": 1, "method": "hf", **quantised}
    if mode == "hf_prompt_lookup":
        return {"G": args.G, "K": 1, "method": "hf"}
    if mode == "ours_prompt_lookup":
        return {"G": args.G, "K": 1, "method": None, "drafter": "prompt_lookup"}
    if mode == "ours_block":  # the draft model's chain under block verification
        return {"G": args.G, "K": 1, "method": "block", "drafter": "model", "verification": "block", **quantised}
    vocab = {"draft_vocab": True} if mode.endswith("_vocab") else {}
    if mode in ("ours_dyntree", "ours_dyntree_lookup", "ours_dyntree_fixed", "ours_dyntree_vocab"):  # G = nodes
        lookup = mode == "ours_dyntree_lookup"
        tree = {"draft_tree": "dynamic", "lookup": lookup}
        return {"G": args.G, "K": 1, "method": "rrs_wor", "drafter": "model", **tree, **vocab, **quantised}
    K = int(mode.removeprefix("ours_k").removesuffix("_vocab"))
    return {"G": args.G, "K": K, "method": args.method if K > 1 else None, "drafter": "model", **vocab, **quantised}


def quantised_label(quant: str | None, args) -> str | None:
    """The rows' draft_int8 column: the quantised draft's other layers' dtype and kept layers, int8
    ones followed by their kernel (``native`` / ``fbgemm``; rows before 2026-11-28 name none: fbgemm),
    int4 ones prefixed ``int4``; None for the draft as loaded."""
    if quant is None:
        return None
    label = f"{args.int8_dtype} keep={','.join(args.int8_keep)}"
    if quant == "int4":
        return f"int4 {label}"
    from specdec_kernels.hf.cpu_int8 import native_int8_available

    return f"{label} {'native' if quant == 'int8' and native_int8_available() else 'fbgemm'}"


def sampling_kwargs_hf(temperature: float, args) -> dict:
    if temperature == 0.0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": args.top_k, "top_p": args.top_p}


def run_mode(mode: str, pair: Pair, ids, mask, temperature: float, max_new: int, seed: int, args) -> Result:
    """One generate call of ``mode`` on one batch; returns the new tokens, wall time and stats."""
    eos = set(pair.eos_token_id)
    width = ids.shape[1]
    if mode == "target_only" or mode in HF_MODES:
        kwargs = dict(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            eos_token_id=pair.eos_token_id or None,
            pad_token_id=pair.pad_token_id,
            repetition_penalty=1.0,
            **sampling_kwargs_hf(temperature, args),
        )
        if mode in ("hf_assisted", "hf_assisted_int8", "hf_assisted_int8fb", "hf_assisted_int4"):
            kwargs["assistant_model"] = pair.quantised(mode_settings(mode, args).get("quant"))
        elif mode == "hf_prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = args.G
        if args.compiled_grammar is not None:  # xgrammar's transformers processor (one per call: it keeps state)
            from xgrammar.contrib.hf import LogitsProcessor

            kwargs["logits_processor"] = [LogitsProcessor(args.compiled_grammar)]
        torch.manual_seed(seed)
        with torch.no_grad():
            seqs, wall, cpu = timed(lambda: pair.target.generate(**kwargs), args.device)
            prefill_s = None
            if mode == "target_only":  # its prefill, timed apart: one forward over the prompts
                prefill_s = timed(lambda: pair.target(input_ids=ids, attention_mask=mask), args.device)[1]
        return Result(new_tokens_per_row(seqs, width, eos), wall, cpu_s=cpu, prefill_s=prefill_s)

    from specdec_kernels.hf.tree_budget import FIXED_THRESHOLD_ENV  # lazy: TRITON_INTERPRET decided first

    s = mode_settings(mode, args)
    use_draft = s["drafter"] == "model"
    # ours_dyntree_fixed: the shaped tree keeps --tree-threshold (no learned node threshold)
    fixed = mock.patch.dict(os.environ, {FIXED_THRESHOLD_ENV: "1"})
    with fixed if mode == "ours_dyntree_fixed" else contextlib.nullcontext():
        out, wall, cpu = _timed_ours(pair, ids, mask, temperature, max_new, seed, args, s, use_draft)
    return Result(new_tokens_per_row(out.sequences, width, eos), wall, out.stats, cpu, out.stats.time_s["prefill"])


def _timed_ours(pair: Pair, ids, mask, temperature: float, max_new: int, seed: int, args, s: dict, use_draft: bool):
    """One timed ``speculative_generate`` call of a mode's settings ``s``: (output, wall s, CPU s)."""
    from specdec_kernels.hf import speculative_generate  # lazy: TRITON_INTERPRET must be decided first

    return timed(
        lambda: speculative_generate(
            pair.target,
            pair.quantised(s.get("quant")) if use_draft else None,
            ids,
            mask,
            max_new_tokens=max_new,
            num_draft_tokens=s["G"],
            num_drafts=s["K"],
            method=s["method"] if s["K"] > 1 or "draft_tree" in s else "kseq",
            **(
                {
                    "draft_tree": "dynamic",
                    "tree_width": args.tree_width,
                    "prompt_lookup": s["lookup"],
                    "tree_threshold": args.tree_threshold,
                }
                if "draft_tree" in s
                else {}
            ),
            verification=s.get("verification", "token"),
            drafter=s["drafter"],
            temperature=temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=seed,
            eos_token_id=pair.eos_token_id,
            pad_token_id=pair.pad_token_id,
            vocab_size=pair.vocab_size,
            cache_implementation=args.cache,
            compile_target=args.compile,
            grammar=args.compiled_grammar,
            draft_vocab=getattr(args, "draft_vocab_ids", None) if s.get("draft_vocab") else None,
            **({} if args.draft_confidence is None else {"draft_confidence": args.draft_confidence}),
        ),
        args.device,
    )


def mode_unavailable(mode: str, pair: Pair, batch_size: int, json_schema: str | None = None) -> str | None:
    if mode in DRAFT_MODES and pair.draft is None:
        return "no draft model (--draft)"
    if mode.endswith("_int8") and pair.draft_int8 is None:
        return "no int8 draft (no int8 kernel here, or the models are not on the CPU)"
    if mode.endswith("_int8fb") and pair.draft_int8fb is None:
        return "no fbgemm int8 draft (this PyTorch has no fbgemm int8 linear, or the models are not on the CPU)"
    if mode.endswith("_int4") and pair.draft_int4 is None:
        return "no int4 draft (the native CPU build does not load, or the models are not on the CPU)"
    if json_schema and mode in HF_MODES:
        # measured: its __call__ asserts on the candidate tokens assisted decoding hands it
        return "xgrammar's transformers processor accepts one token per call; assisted generation passes several"
    if mode in HF_MODES and batch_size != 1:
        return "Hugging Face assisted generation supports batch size 1 only"
    return None


def configure_hf_assistant(pair: Pair, args) -> None:
    for draft in (pair.draft, *pair.quantised_drafts()):
        if args.hf_assistant_tokens and draft is not None:
            draft.generation_config.num_assistant_tokens = args.hf_assistant_tokens
            draft.generation_config.num_assistant_tokens_schedule = "constant"


# --------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------


@dataclass
class Totals:
    new_tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    time_s: dict = field(default_factory=dict)  # driver phases (ours), summed
    drafts_per_step: dict = field(default_factory=dict)
    accepted: int = 0
    proposed: int = 0
    request_steps: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    nodes: int = 0  # draft-token slots the target scored, summed over requests and steps
    has_stats: bool = False
    compared: int = 0
    equal: int = 0
    rows: int = 0
    grammar_valid: int = 0  # rows whose tokens the grammar accepts (a valid prefix)
    grammar_complete: int = 0  # rows that reached the grammar's end (its stop token)
    prefill_s: float | None = 0.0  # None once a call had no prefill time
    status: str = "ok"

    def check_grammar(self, compiled, new_tokens: list[list[int]]) -> None:
        import xgrammar

        for tokens in new_tokens:
            matcher = xgrammar.GrammarMatcher(compiled)
            self.rows += 1
            self.grammar_valid += all(matcher.accept_token(t) for t in tokens)
            self.grammar_complete += matcher.is_terminated()

    def add(self, result: Result) -> None:
        self.new_tokens += sum(len(r) for r in result.new_tokens)
        self.wall_s += result.wall_s
        self.cpu_s += result.cpu_s
        known = result.prefill_s is not None and self.prefill_s is not None
        self.prefill_s = self.prefill_s + result.prefill_s if known else None
        st = result.stats
        if st is not None:
            self.has_stats = True
            for phase, seconds in getattr(st, "time_s", {}).items():
                self.time_s[phase] = self.time_s.get(phase, 0.0) + seconds
            for g, steps in getattr(st, "draft_length_histogram", {}).items():
                self.drafts_per_step[g] = self.drafts_per_step.get(g, 0) + steps
            self.accepted += st.accepted
            self.proposed += st.proposed
            self.request_steps += st.request_steps
            self.target_forwards += st.target_forwards
            self.draft_forwards += st.draft_forwards
            self.nodes += st.nodes


def batches(prompts: list[str], size: int) -> list[list[str]]:
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


def warm_up(pair: Pair, modes: list[str], prompts: list[str], run: common.Run) -> None:
    """Untimed calls of every mode on the first batch: Triton compilation, cuBLAS handles, allocator."""
    args = run.args
    ids, mask = encode(pair.tokenizer, prompts[: args.batch_size], args.device)
    new = min(WARMUP_NEW_TOKENS, args.max_new_tokens)
    for _ in range(args.warmup):
        for mode in modes:
            for temperature in args.temperature:
                try:
                    run_mode(mode, pair, ids, mask, temperature, new, args.seed, args)
                except Exception as e:  # the timed run reports it again
                    run.error(f"warm-up of {mode} (temperature {temperature})", e)


def measure_set(
    pair: Pair,
    set_name: str,
    prompts: list[str],
    temperature: float,
    modes: list[str],
    run: common.Run,
    references: dict | None = None,
) -> dict[str, Totals]:
    """Every mode on every batch of ``prompts``. ``references`` keeps target_only's outputs per
    (batch, rep) across calls, so the later values of a --G sweep are compared with them too."""
    args, errors = run.args, run.errors
    references = {} if references is None else references
    totals = {m: Totals() for m in modes}
    greedy = temperature == 0.0
    for bi, texts in enumerate(batches(prompts, args.batch_size)):
        ids, mask = encode(pair.tokenizer, texts, args.device)
        for rep in range(args.rep):
            seed = args.seed + 1000 * bi + rep
            for mode in modes:
                t = totals[mode]
                if t.status != "ok":
                    continue
                label = f"{mode} {set_name} batch {bi} temperature {temperature:g}"
                try:
                    result = run_mode(mode, pair, ids, mask, temperature, args.max_new_tokens, seed, args)
                except Exception as e:
                    run.error(label, e)
                    t.status = "error"
                    continue
                t.add(result)
                if args.compiled_grammar is not None:
                    t.check_grammar(args.compiled_grammar, result.new_tokens)
                reference = references.get((bi, rep))
                if mode == "target_only":
                    references[(bi, rep)] = result.new_tokens
                elif greedy and reference is not None:
                    same = [a == b for a, b in zip(result.new_tokens, reference, strict=True)]
                    t.compared += len(same)
                    t.equal += sum(same)
                    if not all(same) and args.strict_greedy:
                        errors.append(
                            f"{label}: greedy output differs from target_only "
                            f"({len(same) - sum(same)} of {len(same)} rows)"
                        )
                tps = sum(len(r) for r in result.new_tokens) / result.wall_s if result.wall_s else 0.0
                print(
                    f"[done] {label}: {sum(len(r) for r in result.new_tokens)} tokens in {result.wall_s:.2f} s "
                    f"({tps:.1f} tok/s)",
                    file=sys.stderr,
                )
    return totals


def make_rows(
    totals: dict[str, Totals],
    set_name: str,
    prompts: list[str],
    prompt_tokens_mean: float,
    temperature: float,
    skipped: dict[str, str],
    args,
    base: dict,
) -> list[dict]:
    rows = []
    for mode in args.modes:
        s = mode_settings(mode, args)
        row = {
            **base,
            "mode": mode,
            "G": s["G"],
            "K": s["K"],
            "method": s["method"],
            "temperature": temperature,
            "top_k": args.top_k,
            "top_p": args.top_p,
            "prompt_set": set_name,
            "prompts": len(prompts),
            "prompt_tokens_mean": prompt_tokens_mean,
            "batch_size": args.batch_size,
            "max_new_tokens": args.max_new_tokens,
            "rep": args.rep,
            "seed": args.seed,
            "warmup": args.warmup,
            "cache": args.cache if mode.startswith("ours") else None,
            "compiled": args.compile if mode.startswith("ours") else None,
            "draft_vocab": len(args.draft_vocab_ids) if s.get("draft_vocab") and args.draft_vocab_ids else None,
            "draft_int8": quantised_label(s.get("quant"), args),
        }
        if mode in skipped:
            rows.append({**row, "status": f"skipped: {skipped[mode]}"})
            continue
        t = totals[mode]
        row.update(
            status=t.status,
            new_tokens=t.new_tokens,
            wall_s=t.wall_s,
            cpu_s=t.cpu_s,
            tokens_per_s=t.new_tokens / t.wall_s if t.wall_s and t.status == "ok" else None,
            prefill_s=t.prefill_s if t.new_tokens else None,
        )
        if t.has_stats:
            row.update({f"time_{phase}": seconds / t.wall_s for phase, seconds in t.time_s.items() if t.wall_s})
            row["drafts_per_step"] = " ".join(f"{g}:{n}" for g, n in sorted(t.drafts_per_step.items()))
            row.update(
                acceptance_rate=t.accepted / t.proposed if t.proposed else 0.0,
                mean_accepted_length=(t.accepted + t.request_steps) / t.request_steps if t.request_steps else 0.0,
                target_forwards=t.target_forwards,
                draft_forwards=t.draft_forwards,
            )
            row.update(per_step(t))
            if "draft_tree" in s and t.target_forwards:  # one target forward and `depth` draft ones per step
                row["depth_mean"] = t.draft_forwards / t.target_forwards
            if "draft_tree" in s:
                row.update(tree_width=args.tree_width, tree_threshold=args.tree_threshold or 0.0)
        if temperature == 0.0 and t.compared:
            row.update(
                greedy_equal="yes" if t.equal == t.compared else "no", greedy_equal_prompts=f"{t.equal}/{t.compared}"
            )
        if t.rows:
            row.update(
                grammar=Path(args.json_schema).name,
                grammar_valid=f"{t.grammar_valid}/{t.rows}",
                grammar_complete=f"{t.grammar_complete}/{t.rows}",
            )
        rows.append(row)
    fill_speedups(rows, {r["mode"]: r for r in rows if r.get("tokens_per_s")})
    return rows


def per_step(t: Totals) -> dict:
    """nodes_per_step (draft-token slots the target scored per request and step: a tree's nodes, K
    times the drafts for chains) and the draft / target phases in wall milliseconds per step."""
    steps = sum(t.drafts_per_step.values())
    if not steps or not t.request_steps:
        return {}
    nodes = t.nodes / t.request_steps
    ms = {f"{phase}_ms_per_step": 1e3 * t.time_s.get(phase, 0.0) / steps for phase in ("draft", "target")}
    return {"nodes_per_step": nodes, **ms}


def fill_speedups(rows: list[dict], by_mode: dict[str, dict]) -> None:
    """Speedups against the baselines measured in this run (wall time, and process CPU time)."""
    for r in rows:
        if not r.get("tokens_per_s"):
            continue
        for col, base_mode in (("speedup_vs_target", "target_only"), ("speedup_vs_hf_assisted", "hf_assisted")):
            if base_mode in by_mode:
                r[col] = r["tokens_per_s"] / by_mode[base_mode]["tokens_per_s"]
        base = by_mode.get("target_only")
        if base and base.get("cpu_s") and r.get("cpu_s"):
            r["cpu_speedup_vs_target"] = (r["new_tokens"] / r["cpu_s"]) / (base["new_tokens"] / base["cpu_s"])
        if base and base.get("prefill_s") is not None and r.get("prefill_s") is not None:
            # decode only: the wall time without each mode's prefill of the prompts
            decode, base_decode = r["wall_s"] - r["prefill_s"], base["wall_s"] - base["prefill_s"]
            if decode > 0 and base_decode > 0:
                r["decode_speedup_vs_target"] = (r["new_tokens"] / decode) / (base["new_tokens"] / base_decode)


def compile_schema(pair: Pair, args) -> None:
    """args.compiled_grammar: --json-schema compiled over the pair's vocabulary (compact JSON), or None."""
    args.compiled_grammar = None
    if args.json_schema is None:
        return
    from specdec_kernels.hf.grammar import GrammarSpec, compile_grammar

    spec = GrammarSpec(json_schema=Path(args.json_schema).read_text(), any_whitespace=False)
    vocab = pair.vocab_size or pair.target.config.vocab_size
    args.compiled_grammar = compile_grammar(spec, pair.tokenizer, vocab, sorted(set(pair.eos_token_id)))


def draft_vocab_ids(pair: Pair, args):
    """The DraftVocab of the *_vocab modes (--draft-vocab ids: the specials and the lowest ids), its
    restricted output layer built now (outside the timed calls), or None when no mode asks for it."""
    if pair.draft is None or not any("_vocab" in m for m in args.modes):
        return None
    from specdec_kernels.hf.draft_vocab import DraftVocab, frequent_token_ids

    vocab = pair.vocab_size or pair.target.config.vocab_size
    ids = frequent_token_ids(pair.tokenizer, [], args.draft_vocab, include=pair.eos_token_id, vocab_size=vocab)
    vocab_ids = DraftVocab(ids)
    vocab_ids.head_for(pair.draft)
    for quantised in pair.quantised_drafts():
        vocab_ids.head_for(quantised)
    return vocab_ids


def run_pairs(pairs: dict[str, Pair], sets: dict[str, list[str]], run: common.Run) -> list[dict]:
    """Every mode on every prompt set and temperature, for each linear kind's copy of the models
    (``--cpu-linear``: one or several) in turn on each set; speedups and greedy comparisons within a
    kind (its own target_only and HF assisted)."""
    args, meta = run.args, run.meta
    # the pairs share their tokenizer and drafts (load_pairs): the schema, the draft-vocabulary heads
    # and which modes can run are decided once; each pair's target is warmed up
    first = next(iter(pairs.values()))
    compile_schema(first, args)
    args.draft_vocab_ids = draft_vocab_ids(first, args)
    skipped = {m: why for m in args.modes if (why := mode_unavailable(m, first, args.batch_size, args.json_schema))}
    for mode, why in skipped.items():
        print(f"[skip] {mode}: {why}", file=sys.stderr)
    modes = [m for m in args.modes if m not in skipped]
    if args.warmup:
        for pair in pairs.values():
            warm_up(pair, modes, next(iter(sets.values())), run)
    bases = {kind: _base_row(pair, meta, kind, args) for kind, pair in pairs.items()}
    rows: dict[str, list[dict]] = {kind: [] for kind in pairs}
    for temperature in args.temperature:
        for set_name, prompts in sets.items():
            for kind, pair in pairs.items():
                rows[kind] += _measure_sweep(pair, set_name, prompts, temperature, modes, skipped, bases[kind], run)
                report_best_g(rows[kind], set_name, temperature)
    return [row for kind in pairs for row in rows[kind]]


def _base_row(pair: Pair, meta: dict, kind: str, args) -> dict:
    return {
        **meta,
        "target_model": pair.target_name,
        "draft_model": pair.draft_name if pair.draft is not None else "none",
        "model_dtype": args.dtype,
        "draft_dtype": args.draft_dtype or args.dtype,
        "cpu_linear": kind if args.device.startswith("cpu") else "",
        "threads": torch.get_num_threads(),
    }


def _measure_sweep(pair: Pair, set_name, prompts, temperature, modes, skipped, base, run) -> list[dict]:
    """One prompt set at one temperature: the baselines once (first G), ours at every G of the sweep."""
    args, rows = run.args, []
    lengths = [int(m.sum()) for t in prompts for m in encode(pair.tokenizer, [t], "cpu")[1]]
    baselines: dict[str, dict] = {}
    references: dict = {}  # target_only's outputs, for the greedy comparison at every G
    for gi, g in enumerate(args.G_sweep):
        args.G = g
        run_modes = modes if gi == 0 else [m for m in modes if m.startswith("ours")]
        totals = measure_set(pair, set_name, prompts, temperature, run_modes, run, references)
        mode_args = argparse.Namespace(
            **{**vars(args), "modes": [m for m in args.modes if m in run_modes or m in skipped]}
        )
        new = make_rows(totals, set_name, prompts, sum(lengths) / len(lengths), temperature, skipped, mode_args, base)
        if gi == 0:
            baselines = {r["mode"]: r for r in new if r.get("tokens_per_s") and not r["mode"].startswith("ours")}
        fill_speedups(new, {**baselines, **{r["mode"]: r for r in new if r.get("tokens_per_s")}})
        rows += new
    return rows


def report_best_g(rows: list[dict], set_name: str, temperature: float) -> None:
    """One line per mode of ours: the G of the sweep with the highest tokens/s."""
    for mode in sorted({r["mode"] for r in rows if r["mode"].startswith("ours")}):
        mine = [
            r for r in rows if r["mode"] == mode and r["prompt_set"] == set_name and r["temperature"] == temperature
        ]
        mine = [r for r in mine if r.get("tokens_per_s")]
        if mine:
            best = max(mine, key=lambda r: r["tokens_per_s"])
            print(
                f"[best G] {mode} {set_name} T={temperature:g}: G={best['G']} "
                f"{best['tokens_per_s']:.1f} tok/s, {best.get('speedup_vs_target') or 0:.2f}x target "
                f"(CPU time {best.get('cpu_speedup_vs_target') or 0:.2f}x)",
                file=sys.stderr,
            )


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = common.make_parser(
        "e2e",
        "End-to-end tokens/s: specdec_kernels.hf.speculative_generate vs target.generate and HF assisted "
        "generation. See the module docstring for the columns.",
        dtype_help="model dtype (default: bf16 on CUDA, fp32 on CPU)",
        smoke_help="tiny random Llama models on CPU, batch 1, 8 new tokens; exits non-zero on any error",
        seed_help="seed of the sampled runs",
        axes=AXES,
        timing=False,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--target", help="target model: a local Hugging Face directory (tokenizer read from it)")
    src.add_argument("--pair", choices=("demo",), help="demo: the embedded byte-level pair of specdec_kernels.demo")
    p.add_argument("--draft", help="draft model: a local Hugging Face directory (with --target)")
    p.add_argument("--modes", nargs="+", choices=MODES, help=f"default: {' '.join(DEFAULT_MODES)}")
    p.add_argument(
        "--cache",
        choices=["dynamic", "static"],
        default="dynamic",
        help="KV caches of ours (static: StaticCache, needed by --compile)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target's verification forward in ours (CUDA graphs on GPU; implies --cache static)",
    )
    p.add_argument(
        "--draft-dtype",
        choices=sorted(common.DTYPES),
        help="the draft model's dtype (default: --dtype); a bf16 draft halves its weight reads on CPU",
    )
    p.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: PyTorch's, one per core); pin it on a shared machine",
    )
    p.add_argument(
        "--draft-confidence",
        type=float,
        help="ours (K = 1): stop a chain at the draft's first position whose top probability is below this "
        "(default: speculative_generate's)",
    )
    p.add_argument(
        "--cpu-linear",
        nargs="+",
        choices=["native", "onednn", "torch"],  # specdec_kernels.hf.cpu_linear.CPU_LINEARS
        default=["onednn"],
        help="CPU runs: nn.Linear layers of every model (every mode, baselines included) run oneDNN on "
        "packed weights (specdec_kernels.hf.cpu_linear), our fp32 kernel (native: fp32 layers; oneDNN for "
        "bf16 ones; specdec_kernels.hf.cpu_f32), or PyTorch's default (MKL in fp32); several: one copy of "
        "the models per kind, the kinds in turn on each prompt set (side by side in one run)",
    )
    p.add_argument("--tree-width", type=int, default=4, help="ours_dyntree: children per tree node")
    p.add_argument(
        "--tree-threshold",
        type=float,
        default=None,
        help="ours_dyntree: a shaped tree's least path score (speculative_generate's tree_threshold)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=65536,
        help="*_vocab modes: the draft proposes from this many ids (the tokenizer's specials, then its lowest ids)",
    )
    p.add_argument(
        "--int8-keep",
        nargs="*",
        default=[],
        help="*_int8 modes: draft layers whose name contains one of these stay in the draft's dtype (e.g. down_proj)",
    )
    p.add_argument(
        "--int8-dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="*_int8 modes: the int8 draft's other layers (norms, attention, embeddings); its linears compute in fp32",
    )
    p.add_argument("--method", default="kseq", help="verification method of ours_k2/ours_k4 (kseq, rrs, rrs_wor)")
    p.add_argument(
        "--hf-assistant-tokens",
        type=int,
        help="fixed number of assistant tokens for hf_assisted (default: HF's own schedule)",
    )
    p.add_argument("--temperature", type=float, nargs="+", help="0 = greedy (default: 0); e.g. --temperature 0 0.7")
    p.add_argument(
        "--json-schema",
        help="constrain every mode to this JSON schema (file; compact JSON): xgrammar's processor in generate, "
        "grammar= in ours; rows count outputs the grammar accepts (grammar_valid) and completes",
    )
    p.add_argument("--top-k", type=int, default=0, help="sampled runs: top-k (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="sampled runs: top-p (1 = off)")
    p.add_argument("--batch-size", type=int, default=1, help="prompts per generate call (hf_assisted: 1 only)")
    p.add_argument("--prompts", nargs="+", choices=PROMPT_SETS, help="prompt sets (default: code prose)")
    p.add_argument("--vocab-size", type=int, help="real token count, if the models pad their vocabularies differently")
    p.add_argument("--warmup", type=int, help="untimed rounds of every mode before timing (default 1; smoke: 0)")
    p.add_argument("--rep", type=int, default=1, help="timed calls per batch and mode (default 1)")
    p.add_argument(
        "--strict-greedy",
        action="store_true",
        help="count a greedy output that differs from target_only as an error (on in --smoke)",
    )
    args = p.parse_args(argv)
    return resolve_defaults(args, p)


def resolve_defaults(args, parser):
    """Fill unset options: smoke defaults in --smoke, sweep defaults otherwise; explicit flags win."""
    smoke = args.smoke
    for name, axis in AXES.items():
        axis.resolve(args, name)
    if not smoke and not args.target and not args.pair:
        parser.error("choose the models: --target DIR [--draft DIR], --pair demo, or --smoke")
    if args.draft and not args.target:
        parser.error("--draft goes with --target")
    args.modes = args.modes or list(SMOKE_MODES if smoke else DEFAULT_MODES)
    args.G_sweep, args.G = args.G, args.G[0]
    args.temperature = args.temperature or [0.0]
    args.prompts = args.prompts or list(PROMPT_SETS)
    args.warmup = args.warmup if args.warmup is not None else (0 if smoke else 1)
    args.strict_greedy = args.strict_greedy or smoke
    if args.compile:
        args.cache = "static"
    # Smoke models are tiny: CPU, where CI runs, unless --device says otherwise.
    args.device = args.device or ("cpu" if smoke else common.default_device())
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") and not smoke else "fp32")
    if args.rep < 1 or args.warmup < 0 or args.batch_size < 1 or args.max_new_tokens < 1 or min(args.G_sweep) < 1:
        parser.error("need --rep >= 1, --warmup >= 0, --batch-size >= 1, --max-new-tokens >= 1, --G >= 1")
    if min(args.temperature) < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        parser.error("need temperature >= 0, top_k >= 0 and 0 < top_p <= 1")
    if not 0 <= args.prose_prompts <= len(PROSE_PROMPTS) or args.code_prompts < 0:
        parser.error(f"need 0 <= --prose-prompts <= {len(PROSE_PROMPTS)} and --code-prompts >= 0")
    return args


def sweep(run: common.Run) -> list[dict]:
    """Load the models and prompts (setup errors: exit code 2), then every mode on every prompt set."""
    args = run.args
    try:
        draft_dtype = common.torch_dtype(args.draft_dtype) if args.draft_dtype else None
        kinds = list(dict.fromkeys(args.cpu_linear))
        pairs = load_pairs(args, common.torch_dtype(args.dtype), draft_dtype, kinds)
    except (OSError, ValueError, ImportError) as e:
        raise common.SetupError(f"could not load the models: {e}") from e
    for loaded in pairs.values():
        configure_hf_assistant(loaded, args)
    pair = next(iter(pairs.values()))
    sets = prompt_sets(args)
    if not sets:
        raise common.SetupError("no prompts selected")
    print(
        f"# target {pair.target_name}  draft {pair.draft_name}  {args.dtype}  eos {pair.eos_token_id}  "
        f"pad {pair.pad_token_id}"
    )
    print(
        f"# prompts: {', '.join(f'{k} x{len(v)}' for k, v in sets.items())}  batch {args.batch_size}  "
        f"max_new_tokens {args.max_new_tokens}  G {args.G}  method {args.method}  temperature {args.temperature}  "
        f"warmup {args.warmup}  rep {args.rep}"
    )
    if pair.dropped_generation_settings:
        print(f"# target generation config reset to neutral; dropped: {pair.dropped_generation_settings}")
    sys.stdout.flush()
    return run_pairs(pairs, sets, run)


def transformers_version() -> dict:
    import transformers

    return {"transformers": transformers.__version__}


def main(argv=None) -> int:
    return common.bench_main(
        "e2e",
        parse_args(argv),
        sweep,
        table_columns=TABLE_COLUMNS,
        csv_columns=CSV_COLUMNS,
        bandwidth=False,
        extra_meta=transformers_version,
        modules=("transformers", "specdec_kernels.hf", "specdec_kernels.demo"),  # what the modes import lazily
    )


if __name__ == "__main__":
    sys.exit(main())
