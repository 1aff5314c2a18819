"""``specdec generate --target PATH --draft PATH --prompt TEXT``: streams text as it is committed and
ends with a stats table (local model directories only; ``--target demo`` uses the embedded pair).

The settings the driver receives (draft counts, method, sampling, seed, vocabulary size, compile) are
checked by ``speculative_generate`` itself and reported here naming the flag (``driver_checks``);
this module checks only what decides what is loaded (paths, drafter, heads) before loading it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from .._types import METHODS, VERIFY_METHODS
from ._common import UsageError, at_least, check_positions, driver_checks, quiet_transformers, resolve_device

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODELS_HINT = "pass --target demo for the embedded pair, or fetch real models with bench/models.py"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", help="speculative decoding of a prompt with local HF models, streamed")
    p.add_argument("--target", required=True, help="local HF model directory, or 'demo' for the embedded pair")
    p.add_argument("--draft", default=None, help="local HF model directory (omit for prompt lookup)")
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--num-drafts", type=int, default=1)
    method_help = "tree method (default kseq; rrs_wor with --drafter medusa)"
    p.add_argument("--method", choices=list(METHODS), default=None, help=method_help)
    p.add_argument(
        "--verification",
        choices=list(VERIFY_METHODS),
        default="token",  # the driver's default
        help="a chain's rule: token (draft by draft) or block (the accepted prefix decided jointly: at least as "
        "many tokens a step, the same output law)",
    )
    p.add_argument(
        "--drafter",
        choices=["model", "prompt_lookup", "medusa"],
        default=None,
        help="medusa: the target's Medusa heads (--medusa-heads, or the demo's with --target demo) propose a tree "
        "of --num-draft-tokens nodes with --num-drafts candidates per head",
    )
    p.add_argument(
        "--draft-tree",
        choices=["dynamic"],
        default=None,
        help="dynamic: the draft model grows a token tree of --num-draft-tokens nodes each step (verified exactly)",
    )
    p.add_argument("--tree-width", type=int, default=None, help="with --draft-tree: children per node (default 4)")
    p.add_argument(
        "--prompt-lookup",
        action="store_true",
        help="with --draft-tree dynamic: the n-gram continuation of the text so far is one more branch of the tree",
    )
    p.add_argument(
        "--tree-threshold",
        type=float,
        default=None,
        help="with --draft-tree dynamic: a shaped tree, nodes whose path score is at least this (up to 8 deep)",
    )
    p.add_argument(
        "--draft-vocab",
        type=int,
        default=None,
        help="the draft proposes from this many ids only (the tokenizer's specials, then its lowest ids): "
        "a cheaper draft forward, output unchanged in law",
    )
    p.add_argument(
        "--draft-int8",
        action="store_true",
        help="on CPU: the draft's linear layers in int8 (our kernel; fbgemm's without the native build): a cheaper "
        "draft forward, output unchanged in law "
        "(fastest with the draft's other layers in fp32: leave --draft-dtype unset)",
    )
    p.add_argument(
        "--draft-int4",
        action="store_true",
        help="on CPU: the draft's linear layers in int4 (our W4A8 kernel, half int8's bytes): a faster one-token "
        "draft forward than --draft-int8 but a few %% fewer drafts accepted (about even end to end where measured); "
        "output unchanged in law",
    )
    p.add_argument("--medusa-heads", default=None, help="directory of MedusaHeads.save_pretrained")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=None, help="real token count if embeddings are padded")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--draft-dtype", choices=list(DTYPES), default=None)
    p.add_argument(
        "--cpu-linear",
        choices=["native", "onednn", "torch"],  # hf.cpu_linear.CPU_LINEARS
        default="native",  # side by side (docs/performance.md): ours 6-19% faster than with "onednn"
        help="on CPU: linear layers by our fp32 kernel (native, the default: fp32 layers at the read bandwidth, "
        "oneDNN for the others and wherever the CPU lacks AVX-512), by oneDNN on packed weights (multi-token "
        "forwards near one token's cost), or PyTorch's",
    )
    p.add_argument("--cache", choices=["dynamic", "static"], default="dynamic", help="KV cache of both models")
    p.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target's verification forward (CUDA graphs on GPU; implies --cache static)",
    )
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    constraint = p.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        default=None,
        help="constrain the output to a JSON schema (file; compact JSON, no free whitespace)",
    )
    constraint.add_argument("--grammar", default=None, help="constrain the output to an EBNF grammar (file)")
    return p


def _check_model_path(argument: str, path: str) -> None:
    if path == "demo":
        return
    if not Path(path).is_dir():
        raise UsageError(argument, path, f"an existing local model directory ({MODELS_HINT})")
    if not (Path(path) / "config.json").is_file():
        raise UsageError(argument, path, f"a Hugging Face model directory with config.json ({MODELS_HINT})")


def _check_heads_path(path: str) -> None:
    if not (Path(path) / "config.json").is_file() or not (Path(path) / "model.safetensors").is_file():
        raise UsageError(
            "--medusa-heads", path, "a directory with config.json and model.safetensors (MedusaHeads.save_pretrained)"
        )


def _check_quantised_draft(args: argparse.Namespace, bits: int) -> None:
    """--draft-int8 / --draft-int4: a drafting model on the CPU, and the kernel's build here."""
    from ..hf.cpu_int4 import int4_linear_available
    from ..hf.cpu_int8 import int8_linear_available

    flag = f"--draft-int{bits}"
    if bits == 4 and args.draft_int8:
        raise UsageError(flag, "set", "one of --draft-int8 and --draft-int4")
    if (args.draft is None and args.target != "demo") or args.drafter in ("prompt_lookup", "medusa"):
        raise UsageError(
            flag, "set", f"a draft model that drafts (--draft DIR, or --target demo; not --drafter {args.drafter})"
        )
    if resolve_device(args.device) != "cpu":
        raise UsageError(flag, "set", f"a CPU run (--device cpu): the int{bits} layers are CPU kernels")
    if bits == 8 and not int8_linear_available():
        raise UsageError(flag, "set", "the native CPU build or a PyTorch build with fbgemm's int8 linear (x86-64)")
    if bits == 4 and not int4_linear_available():
        raise UsageError(flag, "set", "the native CPU build (a C++ compiler and ninja the first time)")


def validate(args: argparse.Namespace) -> None:
    """What decides what is loaded, before anything loads (the rest is the driver's check)."""
    resolve_device(args.device)
    _check_model_path("--target", args.target)
    if args.draft is not None:
        if args.draft == "demo" or args.target == "demo":
            raise UsageError("--draft", args.draft, "omit --draft with --target demo (the pair ships its draft)")
        if args.drafter == "medusa":
            raise UsageError("--draft", args.draft, "omit --draft with --drafter medusa (the heads draft)")
        _check_model_path("--draft", args.draft)
    at_least("--max-new-tokens", args.max_new_tokens, 1)
    if args.draft_vocab is not None:
        at_least("--draft-vocab", args.draft_vocab, 1)
    for bits in (8, 4):
        if getattr(args, f"draft_int{bits}"):
            _check_quantised_draft(args, bits)
    if args.vocab_size is not None:  # the driver checks only the upper end (the models' logit columns)
        at_least("--vocab-size", args.vocab_size, 1)
    if args.drafter == "medusa" and args.medusa_heads is None and args.target != "demo":
        raise UsageError("--drafter", "medusa", "--medusa-heads PATH (or --target demo, which ships heads)")
    for flag, path in (("--json-schema", args.json_schema), ("--grammar", args.grammar)):
        if path is not None and not Path(path).is_file():
            raise UsageError(flag, path, "an existing file")
    if args.medusa_heads is not None:
        if args.drafter != "medusa":
            raise UsageError("--medusa-heads", args.medusa_heads, "only with --drafter medusa")
        _check_heads_path(args.medusa_heads)


class PrintStreamer:
    """Minimal streamer: prints the prompt, then the text of committed tokens as they arrive."""

    def __init__(self, tokenizer, prompt: str, out=None):
        self.tokenizer, self.prompt, self.out = tokenizer, prompt, out or sys.stdout
        self.ids: list[int] = []
        self.shown = 0
        self.prompt_seen = False

    def put(self, value) -> None:
        if not self.prompt_seen:  # the driver's first put is the prompt: its text as typed
            self.prompt_seen = True
            self.out.write(self.prompt)
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


def _load_pair(target_path: str, draft_path: str | None, device: str, dtype: torch.dtype):
    quiet_transformers()
    if target_path == "demo":
        from ..demo import load_demo_pair

        return load_demo_pair(device=device, dtype=dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def load(path):
        return AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).to(device).eval()

    tokenizer = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    return load(target_path), (load(draft_path) if draft_path else None), tokenizer


def _load_heads(args: argparse.Namespace, device: str):
    if args.medusa_heads is not None:
        from ..hf.medusa import MedusaHeads

        return MedusaHeads.from_pretrained(args.medusa_heads, dtype=DTYPES[args.dtype], device=device)
    from ..demo import load_medusa_heads

    return load_medusa_heads(device=device, dtype=DTYPES[args.dtype])


def _draft_vocab(args: argparse.Namespace, tok, target):
    """--draft-vocab N: the tokenizer's specials and its lowest ids, N in all (None: every id)."""
    if args.draft_vocab is None:
        return None
    from ..hf.config import vocab_rows
    from ..hf.draft_vocab import frequent_token_ids

    vocab = args.vocab_size or vocab_rows(target)
    eos = getattr(tok, "eos_token_id", None)
    return frequent_token_ids(tok, [], args.draft_vocab, include=[] if eos is None else [eos], vocab_size=vocab)


def _grammar(args: argparse.Namespace):
    """The grammar= of --json-schema / --grammar (a file's text), or None."""
    from ..hf.grammar import GrammarSpec

    if args.json_schema is not None:
        import json

        text = Path(args.json_schema).read_text()
        try:
            json.loads(text)
        except ValueError as exc:
            raise UsageError("--json-schema", args.json_schema, f"a file holding a JSON schema ({exc})") from exc
        return GrammarSpec(json_schema=text, any_whitespace=False)
    if args.grammar is not None:
        return GrammarSpec(ebnf=Path(args.grammar).read_text())
    return None


def generate_command(args: argparse.Namespace) -> int:
    from .. import hf

    device = resolve_device(args.device)
    target, draft, tok = _load_pair(args.target, args.draft, device, DTYPES[args.dtype])
    if draft is not None and args.draft_dtype:
        draft = draft.to(DTYPES[args.draft_dtype])  # changes acceptance, never the output's distribution
    if draft is not None and args.draft_int8:
        from ..hf.cpu_int8 import use_int8_linears

        use_int8_linears(draft)  # as --draft-dtype: acceptance may change, the output's law cannot
    if draft is not None and args.draft_int4:
        from ..hf.cpu_int4 import use_int4_linears

        use_int4_linears(draft)  # likewise
    if args.cpu_linear != "torch" and device == "cpu":
        from ..hf.cpu_linear import use_cpu_linears

        for model in (target, draft):
            if model is not None:
                use_cpu_linears(model, args.cpu_linear)
    drafter = args.drafter or ("model" if draft is not None else "prompt_lookup")
    heads = _load_heads(args, device) if drafter == "medusa" else None
    batch = tok([args.prompt], return_tensors="pt")
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    lookahead = heads.num_heads if heads is not None else args.num_draft_tokens  # the deepest draft
    check_positions(args.max_new_tokens, ids.shape[1], lookahead, target, draft)
    grammar = _grammar(args)
    with driver_checks():
        out = hf.speculative_generate(
            target,
            draft if drafter == "model" else None,
            ids,
            mask,
            max_new_tokens=args.max_new_tokens,
            num_draft_tokens=args.num_draft_tokens,
            num_drafts=args.num_drafts,
            method=args.method,
            verification=args.verification,
            drafter=drafter,
            draft_tree=args.draft_tree,
            tree_width=args.tree_width,
            prompt_lookup=args.prompt_lookup,
            tree_threshold=args.tree_threshold,
            draft_vocab=_draft_vocab(args, tok, target) if drafter == "model" else args.draft_vocab,
            medusa_heads=heads,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            eos_token_id=getattr(tok, "eos_token_id", None),
            pad_token_id=getattr(tok, "pad_token_id", None),
            streamer=PrintStreamer(tok, args.prompt),
            vocab_size=args.vocab_size,
            cache_implementation="static" if args.compile else args.cache,
            compile_target=args.compile,
            grammar=grammar,
            tokenizer=tok if grammar is not None else None,
        )
    print()
    print(out.stats.table())
    return 0
