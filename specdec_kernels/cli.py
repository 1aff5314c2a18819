"""Command line: ``specdec demo``, ``specdec generate`` and ``specdec verify-demo``.

* ``specdec demo`` (no arguments): the embedded byte-level draft/target pair generates Python code
  four ways, side by side: target alone, chain speculative decoding, K-draft SpecTr, and the
  target's own Medusa heads (a token tree, no draft model); it prints
  tokens/s, acceptance, mean accepted length, and whether the greedy outputs equal the target's.
* ``specdec generate --target PATH --draft PATH --prompt TEXT``: streams text as it is committed
  and ends with a stats table (local model directories only; ``--target demo`` uses the embedded pair).
* ``specdec verify-demo``: the kernels alone on random distributions against theory. It draws
  random target/draft distributions with a chosen closeness, samples genuine drafts from the draft,
  verifies them with ``sk.verify`` and ``sk.verify_multi`` (K-SEQ), and prints measured acceptance
  next to its theoretical value:
  first-draft acceptance  alpha = sum_x min(p(x), q(x))
  tokens per step         E = sum_{k=0..G} prod_{i<k} alpha_i   (chain; exact for sampled drafts)
  K-SEQ acceptance        1 - (1 - beta(rho*))^K
  each with the standard error the theory gives its mean over the batch (not the sample's, which is
  0 when every draft passed), so ``--batch`` must be at least 100.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from ._types import METHODS

MAX_TREE_NODES = 64  # root + drafts of one verification tree (the kernels' node masks)
Z_PASS = 4.0  # verify-demo: measured vs theory within 4 standard errors (a false FAIL ~ 1 in 16,000)
# verify-demo: fewer requests make the measured means too coarse (a handful of 0/1 outcomes) for the
# normal approximation behind |z| < 4; the batch-1 default of a laptop would test nothing
MIN_VERIFY_BATCH = 100
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# what `specdec demo` / `generate` import beyond torch: dependencies, missing only after --no-deps installs
HF_MODULES = ("transformers", "safetensors", "tqdm", "tokenizers", "huggingface_hub")


class UsageError(Exception):
    """A bad command-line value: printed as one line naming the argument, exit code 2."""

    def __init__(self, argument: str, value, allowed: str):
        super().__init__(f"{argument}: {value!r} is not allowed: {allowed}")


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", choice, "no CUDA GPU is visible to torch here; use --device cpu or auto")
    return choice


def _at_least(argument: str, value, low, what: str = "") -> None:
    if value is None or value < low:
        raise UsageError(argument, value, f"an integer >= {low}{what}")


def _check_medusa_tree(nodes: int, candidates: int, nodes_arg: str, candidates_arg: str) -> None:
    _at_least(nodes_arg, nodes, 1)
    _at_least(candidates_arg, candidates, 1)
    if 1 + nodes > MAX_TREE_NODES:
        raise UsageError(nodes_arg, nodes, f"an integer in [1, {MAX_TREE_NODES - 1}] (tree nodes besides the root)")


def _check_drafts(G: int, K: int) -> None:
    _at_least("--num-draft-tokens", G, 1)
    _at_least("--num-drafts", K, 1)
    if 1 + K * G > MAX_TREE_NODES:
        raise UsageError("--num-drafts", K, f"1 + num_drafts * num_draft_tokens <= {MAX_TREE_NODES} (G={G})")


def _check_temperature(value, *, positive: bool = False) -> None:
    from ._params import check_temperature_value

    try:
        check_temperature_value(value)
    except (TypeError, ValueError) as exc:
        raise UsageError("--temperature", value, "a finite float >= 0 (0 = greedy)") from exc
    if positive and value == 0:
        raise UsageError("--temperature", value, "a float > 0 (it sets the sampled rows)")


def _check_model_path(argument: str, path: str) -> None:
    from pathlib import Path

    if path == "demo":
        return
    hint = "pass --target demo for the embedded pair, or fetch real models with bench/models.py"
    if not Path(path).is_dir():
        raise UsageError(argument, path, f"an existing local model directory ({hint})")
    if not (Path(path) / "config.json").is_file():
        raise UsageError(argument, path, f"a Hugging Face model directory with config.json ({hint})")


def _check_heads_path(path: str) -> None:
    from pathlib import Path

    if not (Path(path) / "config.json").is_file() or not (Path(path) / "model.safetensors").is_file():
        raise UsageError(
            "--medusa-heads", path, "a directory with config.json and model.safetensors (MedusaHeads.save_pretrained)"
        )


def _validate(args: argparse.Namespace) -> None:
    """Every argument, before any model loads."""
    _device(args.device)
    if args.command == "demo":
        from .demo import DEMO_PROMPTS

        if not 1 <= args.prompts <= len(DEMO_PROMPTS):
            raise UsageError("--prompts", args.prompts, f"an integer in [1, {len(DEMO_PROMPTS)}]")
        _at_least("--max-new-tokens", args.max_new_tokens, 1)
        _check_drafts(args.num_draft_tokens, args.num_drafts)
        _check_medusa_tree(args.medusa_nodes, args.medusa_candidates, "--medusa-nodes", "--medusa-candidates")
        _check_temperature(args.temperature, positive=True)
        _at_least("--threads", args.threads, 0, " (0 = default)")
    elif args.command == "generate":
        _check_model_path("--target", args.target)
        if args.draft is not None:
            if args.draft == "demo" or args.target == "demo":
                raise UsageError("--draft", args.draft, "omit --draft with --target demo (the pair ships its draft)")
            _check_model_path("--draft", args.draft)
        _at_least("--max-new-tokens", args.max_new_tokens, 1)
        if args.drafter == "medusa":
            _check_medusa_tree(args.num_draft_tokens, args.num_drafts, "--num-draft-tokens", "--num-drafts")
            if args.draft is not None:
                raise UsageError("--draft", args.draft, "omit --draft with --drafter medusa (the heads draft)")
            if args.medusa_heads is None and args.target != "demo":
                raise UsageError("--drafter", "medusa", "--medusa-heads PATH (or --target demo, which ships heads)")
            if args.method not in (None, "rrs_wor"):
                raise UsageError("--method", args.method, "rrs_wor (or omit it) with --drafter medusa")
            if args.compile:
                raise UsageError("--compile", True, "not with --drafter medusa")
        else:
            _check_drafts(args.num_draft_tokens, args.num_drafts)
        if args.medusa_heads is not None:
            if args.drafter != "medusa":
                raise UsageError("--medusa-heads", args.medusa_heads, "only with --drafter medusa")
            _check_heads_path(args.medusa_heads)
        _check_temperature(args.temperature)
        _at_least("--top-k", args.top_k, 0, " (0 = off)")
        if not 0.0 < args.top_p <= 1.0:
            raise UsageError("--top-p", args.top_p, "a float in (0, 1] (1 = off)")
        if args.seed is not None and not 0 <= args.seed < 2**64:
            raise UsageError("--seed", args.seed, "an integer in [0, 2**64)")
        if args.vocab_size is not None:
            _at_least("--vocab-size", args.vocab_size, 1)
        if args.drafter == "prompt_lookup" and args.num_drafts != 1:
            raise UsageError("--num-drafts", args.num_drafts, "1 with --drafter prompt_lookup (one chain)")
    elif args.command == "verify-demo":
        if args.batch is not None:
            _at_least("--batch", args.batch, MIN_VERIFY_BATCH, " (fewer requests are too few to test against theory)")
        if args.vocab is not None:
            _at_least("--vocab", args.vocab, 2)
        _check_drafts(args.num_draft_tokens, args.num_drafts)
        _check_temperature(args.temperature, positive=True)


def _kseq_theory(p: torch.Tensor, q: torch.Tensor, k: int) -> torch.Tensor:
    """Per-row 1 - (1 - beta(rho*))^k, rho* by bisection in float64 (p, q: [R, V])."""
    p, q = p.double(), q.double()
    lo = torch.ones(p.shape[0], dtype=torch.float64, device=p.device)
    hi = torch.full_like(lo, float(k))
    for _ in range(60):
        mid = (lo + hi) / 2
        beta = torch.minimum(q, p / mid[:, None]).sum(-1)
        f = 1 - (1 - beta) ** k - mid * beta
        lo, hi = torch.where(f > 0, mid, lo), torch.where(f > 0, hi, mid)
    beta = torch.minimum(q, p / hi[:, None]).sum(-1)
    return 1 - (1 - beta) ** k


def _setting(name, closeness, B, G, V, K, temperature, seed, device):
    import specdec_kernels as sk

    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(B, G + 1, V, generator=gen) * 2.0
    draft = target[:, :G] + torch.randn(B, G, V, generator=gen) * 2.0 * closeness
    p = torch.softmax(target / temperature, -1)
    q = torch.softmax(draft / temperature, -1)
    tokens = torch.multinomial(q.reshape(-1, V), 1, generator=gen).reshape(B, G)
    seeds = torch.randint(0, 2**62, (B,), generator=gen)
    alpha = torch.minimum(p[:, :G], q).double().sum(-1)  # [B, G]
    reach = torch.cumprod(alpha, 1)  # [B, G]: P(at least k drafts accepted), k = 1..G
    expected = 1 + reach.sum(1)  # tokens per step, per request
    # its variance per request: E[N^2] - E[N]^2 with E[N^2] = sum_k (2k - 1) P(N >= k)
    steps_var = ((2 * torch.arange(1, G + 1, dtype=torch.float64) - 1) * reach).sum(1) - reach.sum(1) ** 2

    args = [t.to(device) for t in (target, tokens, draft, seeds)]
    start = time.perf_counter()
    out = sk.verify(args[0], args[1], args[2], temperature=temperature, seed=args[3])
    accepted = out.num_accepted.cpu()
    chain_s = time.perf_counter() - start

    # K-SEQ: K chains sampled independently from the same (prefix-independent) draft rows
    multi_tokens = torch.stack([torch.multinomial(q[:, d], K, replacement=True, generator=gen) for d in range(G)], 2)
    t_multi = target[:, None].expand(B, K, G + 1, V).contiguous().to(device)
    d_multi = draft[:, None].expand(B, K, G, V).contiguous().to(device)
    start = time.perf_counter()
    multi = sk.verify_multi(t_multi, multi_tokens.to(device), d_multi, temperature=temperature, seed=args[3])
    multi_accepted = multi.num_accepted.cpu()
    multi_s = time.perf_counter() - start
    kseq = _kseq_theory(p[:, 0], q[:, 0], K)
    kseq_alpha = float(kseq.mean())
    first = (accepted >= 1).double()
    steps = (accepted + 1).double()
    multi_first = (multi_accepted >= 1).double()

    def theory_se(variance: torch.Tensor) -> float:  # of a mean over B independent requests
        return float(variance.clamp_min(0).sum().sqrt() / B)

    a0 = alpha[:, 0]
    checks = [  # (measured mean, the theory's standard error of that mean, theory)
        (float(first.mean()), theory_se(a0 * (1 - a0)), float(a0.mean())),
        (float(steps.mean()), theory_se(steps_var), float(expected.mean())),
        (float(multi_first.mean()), theory_se(kseq * (1 - kseq)), kseq_alpha),
    ]
    # a theory with no variance (every draft certain to pass) must be met exactly
    worst = max(abs(m - t) / se if se > 0 else (0.0 if abs(m - t) < 1e-9 else float("inf")) for m, se, t in checks)
    return {
        "setting": name,
        "alpha theory": checks[0][2],
        "alpha measured": f"{checks[0][0]:.3f}+-{checks[0][1]:.3f}",
        "tokens/step theory": checks[1][2],
        "tokens/step measured": f"{checks[1][0]:.3f}+-{checks[1][1]:.3f}",
        f"K={K} accept theory": kseq_alpha,
        f"K={K} accept measured": f"{checks[2][0]:.3f}+-{checks[2][1]:.3f}",
        "max |z|": worst,
        f"|z|<{Z_PASS:g}": "PASS" if worst < Z_PASS else "FAIL",
        "verify ms": chain_s * 1e3,
        "verify_multi ms": multi_s * 1e3,
    }


def _print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    cells = [[c] + [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for r in rows] for c in cols]
    widths = [max(len(x) for x in col) for col in cells]
    for i in range(len(rows) + 1):
        print("  ".join(col[i].rjust(w) for col, w in zip(cells, widths, strict=False)))


def verify_demo(args: argparse.Namespace) -> int:
    device = _device(args.device)
    backend = "Triton on CUDA" if device == "cuda" else "the native CPU backend (csrc, OpenMP)"
    B = args.batch if args.batch is not None else (8192 if device == "cuda" else 512)
    V = args.vocab if args.vocab is not None else (32000 if device == "cuda" else 64)
    G, K = args.num_draft_tokens, args.num_drafts
    print(f"specdec verify-demo: B={B} requests, G={G} drafts, V={V}, K={K} chains for K-SEQ, T={args.temperature}")
    print(f"backend: {backend}\n")
    rows = []
    for name, closeness in (("close", 0.3), ("medium", 0.7), ("far", 1.5)):
        print(f"  running setting '{name}' ...", flush=True)
        rows.append(_setting(name, closeness, B, G, V, K, args.temperature, args.seed, device))
    print()
    _print_table(rows)

    import specdec_kernels as sk

    gen = torch.Generator().manual_seed(args.seed)
    target = torch.randn(B, G + 1, V, generator=gen)
    argmax = target[:, :G].argmax(-1)
    tokens = torch.where(torch.rand(B, G, generator=gen) < 0.8, argmax, (argmax + 1) % V)
    out = sk.verify(target.to(device), tokens.to(device), temperature=0.0)
    n = out.num_accepted.cpu()
    ok = all(
        out.tokens[b, : n[b]].cpu().tolist() == argmax[b, : n[b]].tolist()
        and int(out.tokens[b, n[b]]) == int(target[b, n[b]].argmax())
        for b in range(B)
    )
    print(f"\ngreedy: accepted tokens equal the target argmax chain for all {B} requests: {ok}")
    passed = all(row[f"|z|<{Z_PASS:g}"] == "PASS" for row in rows)
    print(f"measured vs theory: {'PASS' if passed else 'FAIL'} (every figure within {Z_PASS:g} standard errors)")
    return 0 if ok and passed else 1


# ---------------------------------------------------------------------------------------------
# specdec demo / specdec generate: the Hugging Face driver on real models
# ---------------------------------------------------------------------------------------------


class _PrintStreamer:
    """Minimal streamer: prints the text of committed tokens as they arrive (skips the prompt)."""

    def __init__(self, tokenizer, out=None):
        self.tokenizer, self.out = tokenizer, out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self.ids.extend(int(t) for t in value.flatten().tolist())
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the rest
            return
        self.out.write(text[self.shown :])
        self.out.flush()
        self.shown = len(text)

    def end(self) -> None:
        self.out.write("\n")
        self.out.flush()


def _quiet_transformers() -> None:
    """Our own progress bars and tables only: no weight-loading bars or generation-config notices."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _load_pair(target_path: str, draft_path: str | None, device: str, dtype: torch.dtype):
    _quiet_transformers()
    if target_path == "demo":
        from .demo import load_demo_pair

        return load_demo_pair(device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()

    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    return load(target_path), (load(draft_path) if draft_path else None), tokenizer


def _dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def generate_command(args: argparse.Namespace) -> int:
    from .hf import speculative_generate

    device = _device(args.device)
    target, draft, tok = _load_pair(args.target, args.draft, device, _dtype(args.dtype))
    if draft is not None and args.draft_dtype:
        draft = draft.to(_dtype(args.draft_dtype))  # changes acceptance, never the output's distribution
    if args.cpu_linear == "onednn" and device == "cpu":
        from .hf.cpu_linear import use_onednn_linears

        use_onednn_linears(target)
        if draft is not None:
            use_onednn_linears(draft)
    drafter = args.drafter or ("model" if draft is not None else "prompt_lookup")
    if args.vocab_size is not None:
        from .hf.generate import _vocab_rows

        rows = min(_vocab_rows(m) for m in (target, draft) if m is not None)
        if args.vocab_size > rows:
            raise UsageError("--vocab-size", args.vocab_size, f"an integer in [1, {rows}] (the models' logit columns)")
    heads = None
    if drafter == "medusa":
        from .hf.medusa import MedusaHeads

        if args.medusa_heads is not None:
            heads = MedusaHeads.from_pretrained(args.medusa_heads, dtype=_dtype(args.dtype), device=device)
        else:
            from .demo import load_medusa_heads

            heads = load_medusa_heads(device=device, dtype=_dtype(args.dtype))
    batch = tok([args.prompt], return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    lookahead = heads.num_heads if heads is not None else args.num_draft_tokens  # the deepest draft
    _check_positions(args.max_new_tokens, ids.shape[1], lookahead, target, draft)
    sys.stdout.write(args.prompt)
    out = speculative_generate(
        target,
        draft if drafter == "model" else None,
        ids,
        mask,
        max_new_tokens=args.max_new_tokens,
        num_draft_tokens=args.num_draft_tokens,
        num_drafts=args.num_drafts,
        method=args.method,
        drafter=drafter,
        medusa_heads=heads,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
        eos_token_id=getattr(tok, "eos_token_id", None),
        pad_token_id=getattr(tok, "pad_token_id", None),
        streamer=_PrintStreamer(tok),
        vocab_size=args.vocab_size,
        cache_implementation="static" if args.compile else args.cache,
        compile_target=args.compile,
    )
    print()
    print(out.stats.table())
    return 0


def _position_limit(*models) -> int | None:
    """The fewest positions any of the models was built for (None when their configs do not say)."""
    limits = []
    for model in models:
        if model is None:
            continue
        config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if isinstance(limit, int) and limit > 0:
            limits.append(limit)
    return min(limits) if limits else None


def _check_positions(max_new_tokens: int, prompt_len: int, lookahead: int, *models) -> None:
    """Prompt + new tokens + the drafts of the last step fit the models' positions (past them a model
    reads positions it never saw and writes garbage)."""
    limit = _position_limit(*models)
    if limit is None or prompt_len + max_new_tokens + lookahead <= limit:
        return
    room = limit - prompt_len - lookahead
    why = f"the model has {limit} positions; the prompt takes {prompt_len} and the last drafts {lookahead}"
    if room < 1:
        raise UsageError("--prompt", f"<{prompt_len} tokens>", f"a shorter prompt ({why})")
    raise UsageError("--max-new-tokens", max_new_tokens, f"an integer in [1, {room}] ({why})")


def demo(args: argparse.Namespace) -> int:
    """Target alone vs chain speculative decoding vs K-draft SpecTr on the embedded pair, greedy and
    sampled, one prompt at a time (batch 1, as on a laptop), torch pinned to a fixed thread count."""
    from tqdm.auto import tqdm

    from .demo import DEMO_PROMPTS, load_demo_pair, load_medusa_heads, timing

    device = _device(args.device)
    threads = args.threads or min(2, os.cpu_count() or 1)
    torch.set_num_threads(threads)  # oversubscribed threads made this demo 4-6x slower under load
    _quiet_transformers()
    target, draft, tok = load_demo_pair(device=device)
    heads = load_medusa_heads(device=device)
    prompts = list(DEMO_PROMPTS[: args.prompts])
    longest = max(tok([p], return_tensors="pt")["input_ids"].shape[1] for p in prompts)
    _check_positions(args.max_new_tokens, longest, max(args.num_draft_tokens, heads.num_heads), target, draft)
    new, G, K, T = args.max_new_tokens, args.num_draft_tokens, args.num_drafts, args.temperature
    where = "CUDA" if device == "cuda" else f"CPU, torch pinned to {threads} thread(s)"
    print(
        f"specdec demo: embedded byte-level pair, {len(prompts)} prompts one at a time, {new} new tokens each, {where}"
    )
    N, S = args.medusa_nodes, args.medusa_candidates
    medusa = dict(drafter="medusa", medusa_heads=heads, num_draft_tokens=N, num_drafts=S)
    medusa_name = f"Medusa {heads.num_heads} heads, N={N}, s={S}"
    modes = [  # (name, speculative kwargs or None for the target alone, sampled)
        ("target only (greedy)", None, False),
        (f"chain, G<={G} (greedy)", dict(num_drafts=1), False),
        (f"SpecTr K={K}, G={G} (greedy)", dict(num_drafts=K, method="kseq"), False),
        (f"{medusa_name} (greedy)", medusa, False),
        (f"target only (T={T})", None, True),
        (f"chain, G<={G} (T={T})", dict(num_drafts=1), True),
        (f"SpecTr K={K}, G={G} (T={T})", dict(num_drafts=K, method="kseq"), True),
        (f"{medusa_name} (T={T})", medusa, True),
    ]
    timing.prepare_native_backend(device)  # the build, if any, before anything is timed
    if warning := timing.load_warning():
        print(warning, file=sys.stderr)
    _warm_up(target, draft, tok, device, G, K, medusa)
    progress = lambda m: tqdm(m, desc="specdec demo", unit="mode", disable=not sys.stderr.isatty())  # noqa: E731
    settings = dict(max_new_tokens=new, temperature=T, num_draft_tokens=G, seed=args.seed)
    rows, outputs = timing.demo_rows(target, draft, tok, device, prompts, modes, settings, progress)
    print()
    _print_table(rows)
    print(
        "\nspeedup: per prompt, wall (cpu speedup: process CPU) time of the target alone in the same sampling mode / "
        "this mode's, the two timed back to back; the median over prompts [lowest-highest] (draft forwards, "
        "or Medusa heads and tree building, included); greedy rows must equal the target's own greedy output. "
        "accept: accepted drafts / drafts offered (Medusa: / the tree's depth, one path is accepted per step)."
    )
    chain = modes[1][0]
    print(f"\nfirst prompt | {chain} continuation (cut at a byte boundary):")
    print(_show(prompts[0], tok.decode(outputs[chain][0])))
    return 0 if all(r["greedy = target"] in ("True", "(baseline)", "n/a (sampled)") for r in rows) else 1


def _warm_up(target, draft, tok, device, G: int, K: int, medusa: dict) -> None:
    """One short untimed run of every path (first calls pay for lazy initialisation and, once per
    machine, the build of the CPU backend)."""
    from .hf import speculative_generate

    batch = tok(["def f(x):\n    return "], return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    with torch.no_grad():
        target.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id
        )
    for kwargs in (dict(num_drafts=1), dict(num_drafts=K, temperature=0.7, seed=0)):
        speculative_generate(target, draft, ids, mask, max_new_tokens=8, num_draft_tokens=G, **kwargs)
    for sampling in (dict(), dict(temperature=0.7, seed=0)):
        speculative_generate(target, None, ids, mask, max_new_tokens=8, **medusa, **sampling)


def _show(prompt: str, continuation: str) -> str:
    """Prompt and continuation, visibly separated: the continuation after a '>>>' marker line."""
    return f"{prompt.rstrip()}\n{'-' * 20} >>> generated {'-' * 20}\n{continuation}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="specdec_kernels command line")
    sub = parser.add_subparsers(dest="command")

    p_demo = sub.add_parser("demo", help="target alone vs speculative decoding on the embedded model pair")
    p_demo.add_argument("--prompts", type=int, default=5, help="how many of the demo prompts (README: 5)")
    p_demo.add_argument("--max-new-tokens", type=int, default=64)
    p_demo.add_argument("--num-draft-tokens", type=int, default=4)
    p_demo.add_argument("--num-drafts", type=int, default=2)
    p_demo.add_argument("--medusa-nodes", type=int, default=16, help="Medusa rows: tree nodes besides the root")
    p_demo.add_argument("--medusa-candidates", type=int, default=3, help="Medusa rows: candidates per head")
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--temperature", type=float, default=0.7, help="for the sampled rows")
    p_demo.add_argument("--threads", type=int, default=0, help="torch threads (default: 2, or 1 on one core)")
    p_demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")

    p_gen = sub.add_parser("generate", help="speculative decoding of a prompt with local HF models, streamed")
    p_gen.add_argument("--target", required=True, help="local HF model directory, or 'demo' for the embedded pair")
    p_gen.add_argument("--draft", default=None, help="local HF model directory (omit for prompt lookup)")
    p_gen.add_argument("--prompt", required=True)
    p_gen.add_argument("--max-new-tokens", type=int, default=128)
    p_gen.add_argument("--num-draft-tokens", type=int, default=4)
    p_gen.add_argument("--num-drafts", type=int, default=1)
    p_gen.add_argument(
        "--method",
        choices=list(METHODS),
        default=None,
        help="tree method (default kseq; rrs_wor with --drafter medusa)",
    )
    p_gen.add_argument(
        "--drafter",
        choices=["model", "prompt_lookup", "medusa"],
        default=None,
        help="medusa: the target's Medusa heads (--medusa-heads, or the demo's with --target demo) propose a tree "
        "of --num-draft-tokens nodes with --num-drafts candidates per head",
    )
    p_gen.add_argument("--medusa-heads", default=None, help="directory of MedusaHeads.save_pretrained")
    p_gen.add_argument("--temperature", type=float, default=0.0)
    p_gen.add_argument("--top-k", type=int, default=0)
    p_gen.add_argument("--top-p", type=float, default=1.0)
    p_gen.add_argument("--seed", type=int, default=None)
    p_gen.add_argument("--vocab-size", type=int, default=None, help="real token count if embeddings are padded")
    p_gen.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    p_gen.add_argument("--draft-dtype", choices=["float32", "float16", "bfloat16"], default=None)
    p_gen.add_argument(
        "--cpu-linear",
        choices=["onednn", "torch"],
        default="onednn",
        help="on CPU: linear layers by oneDNN on packed weights (multi-token forwards near one token's cost)",
    )
    p_gen.add_argument("--cache", choices=["dynamic", "static"], default="dynamic", help="KV cache of both models")
    p_gen.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target's verification forward (CUDA graphs on GPU; implies --cache static)",
    )
    p_gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")

    p_vd = sub.add_parser("verify-demo", help="verification kernels on random distributions vs theory")
    p_vd.add_argument("--batch", type=int, default=None)
    p_vd.add_argument("--vocab", type=int, default=None)
    p_vd.add_argument("--num-draft-tokens", type=int, default=4)
    p_vd.add_argument("--num-drafts", type=int, default=4)
    p_vd.add_argument("--temperature", type=float, default=1.0)
    p_vd.add_argument("--seed", type=int, default=0)
    p_vd.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    for sub_parser in (p_demo, p_gen, p_vd):
        sub_parser.add_argument("--debug", action="store_true", help="show the traceback of an error")

    args = parser.parse_args(argv)
    commands = {"demo": demo, "generate": generate_command, "verify-demo": verify_demo}
    if args.command not in commands:
        parser.print_help()
        return 0
    try:
        _validate(args)
        return commands[args.command](args)
    except UsageError as exc:
        if args.debug:
            raise
        print(f"specdec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        if args.debug or (exc.name or "").split(".")[0] not in HF_MODULES:
            raise
        print(
            f"specdec {args.command}: error: {exc.name} is not installed (a dependency that a --no-deps install "
            'skips): pip install "transformers>=5.4" "safetensors>=0.4" "tqdm>=4"',
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        if args.debug:
            raise
        sys.stdout.write("\n")  # end a half-streamed line
        sys.stdout.flush()
        print(f"specdec {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
