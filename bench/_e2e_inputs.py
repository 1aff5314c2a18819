"""What ``bench_e2e.py`` runs on: its prompt sets and its model pair (local Hugging Face directories,
the embedded demo pair, or two tiny random Llama models for ``--smoke``), with neutral generation
configs so that every mode decodes the same distribution."""

from __future__ import annotations

import argparse
import copy
import ctypes
import dataclasses
import functools
import gc
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Standard-library modules whose first top-level def/class opens a code prompt (in this order;
# modules missing from an unusual Python are skipped).
STDLIB_MODULES = (
    "heapq.py bisect.py textwrap.py fnmatch.py shlex.py colorsys.py glob.py string.py fractions.py statistics.py "
    "graphlib.py difflib.py"
).split()

PROSE_PROMPTS = (
    (
        "The harbour town woke slowly on winter mornings. Fishing boats knocked against the pier while the "
        "gulls argued over scraps, and the baker on the corner lifted the first trays of bread from the oven "
        "before the sun had cleared the hills. By eight o'clock the market square was full of"
    ),
    (
        "Photosynthesis is the process by which green plants turn light into chemical energy. Inside the "
        "chloroplasts, chlorophyll absorbs mostly red and blue light, and that energy is used to split water "
        "molecules and release oxygen. The hydrogen that remains is then combined with carbon dioxide to"
    ),
    (
        "Dear members of the committee, thank you for the opportunity to present our proposal for the new "
        "community library. Over the past year we have spoken with parents, teachers and local businesses "
        "about what they would like the library to offer, and three themes came up again and again. First,"
    ),
)

# Smoke models: tiny random Llama models (the peaked init gives few argmax near-ties in fp32).
SMOKE_VOCAB, SMOKE_LAYERS, SMOKE_HIDDEN, SMOKE_HEADS, SMOKE_KV_HEADS = 100, 2, 64, 4, 2
SMOKE_INIT_STD, SMOKE_DRAFT_NOISE = 0.5, 0.01
SMOKE_BOS, SMOKE_EOS, SMOKE_PAD = 0, 1, 2


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------


def code_snippet(path: Path, chars: int) -> str | None:
    """From the first top-level ``def``/``class`` line, whole lines until at least ``chars`` characters."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    except OSError:
        return None
    start = next((i for i, line in enumerate(lines) if line.startswith(("def ", "class "))), None)
    if start is None:
        return None
    out = ""
    for line in lines[start:]:
        out += line
        if len(out) >= chars:
            break
    return out


def code_prompts(n: int, chars: int) -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    prompts = []
    for name in STDLIB_MODULES:
        if len(prompts) == n:
            break
        snippet = code_snippet(stdlib / name, chars)
        if snippet:
            prompts.append(snippet)
    if len(prompts) < n:
        print(f"[warn] only {len(prompts)} of {n} code prompts found under {stdlib}", file=sys.stderr)
    return prompts


def prose_prompts(n: int, chars: int) -> list[str]:
    """The first n paragraphs, each cut to at most ``chars`` characters at a word boundary."""
    out = []
    for text in PROSE_PROMPTS[:n]:
        out.append(text if len(text) <= chars else text[:chars].rsplit(" ", 1)[0])
    return out


def prompt_sets(args) -> dict[str, list[str]]:
    sets = {}
    if "code" in args.prompts and args.code_prompts > 0:
        sets["code"] = code_prompts(args.code_prompts, args.prompt_chars)
    if "prose" in args.prompts and args.prose_prompts > 0:
        sets["prose"] = prose_prompts(args.prose_prompts, args.prompt_chars)
    return {k: v for k, v in sets.items() if v}


# --------------------------------------------------------------------------------------------
# Models and tokenizers
# --------------------------------------------------------------------------------------------


class SmokeTokenizer:
    """Bytes -> ids 3 + byte % 97 (0 = BOS, 1 = EOS, 2 = padding), left padding like a HF tokenizer."""

    pad_token_id, eos_token_id, bos_token_id = SMOKE_PAD, SMOKE_EOS, SMOKE_BOS

    @property
    def raw_vocab(self) -> list[bytes]:
        """For --json-schema (xgrammar): id 3 + k stands for the printable byte 32 + k."""
        return [b"", b"", b""] + [bytes([32 + k]) for k in range(SMOKE_VOCAB - 3)]

    def encode(self, text: str) -> list[int]:
        return [3 + b % (SMOKE_VOCAB - 3) for b in text.encode("utf-8")]

    def __call__(self, texts: list[str], return_tensors: str = "pt") -> dict:
        seqs = [self.encode(t) for t in texts]
        width = max(len(s) for s in seqs)
        ids = [[self.pad_token_id] * (width - len(s)) + s for s in seqs]
        mask = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
        return {"input_ids": torch.tensor(ids), "attention_mask": torch.tensor(mask)}


@dataclass
class Pair:
    target: object
    draft: object | None
    tokenizer: object
    target_name: str
    draft_name: str
    eos_token_id: list[int]
    pad_token_id: int
    vocab_size: int | None  # passed to speculative_generate when the models' output rows differ
    dropped_generation_settings: dict = field(default_factory=dict)
    draft_int8: object | None = None  # the *_int8 modes' draft: a copy with int8 linear layers
    draft_int4: object | None = None  # the *_int4 modes' draft: a copy with int4 linear layers
    draft_int8fb: object | None = None  # the *_int8fb modes' draft: int8 layers on fbgemm's kernel

    def quantised(self, quant: str | None):
        """The draft a mode runs: its int8 / int4 copy, or the draft as loaded (quant None)."""
        return {None: self.draft, "int8": self.draft_int8, "int8fb": self.draft_int8fb, "int4": self.draft_int4}[quant]

    def quantised_drafts(self) -> list:
        return [m for m in (self.draft_int8, self.draft_int8fb, self.draft_int4) if m is not None]


def smoke_models(device: str, dtype) -> tuple[object, object]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=SMOKE_VOCAB,
        hidden_size=SMOKE_HIDDEN,
        intermediate_size=2 * SMOKE_HIDDEN,
        num_hidden_layers=SMOKE_LAYERS,
        num_attention_heads=SMOKE_HEADS,
        num_key_value_heads=SMOKE_KV_HEADS,
        max_position_embeddings=512,
        initializer_range=SMOKE_INIT_STD,
        bos_token_id=SMOKE_BOS,
        eos_token_id=SMOKE_EOS,
        pad_token_id=SMOKE_PAD,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    draft = copy.deepcopy(target)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # the draft is the target plus small noise: acceptance well above zero
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * SMOKE_DRAFT_NOISE * p.std().clamp_min(1e-3))
    return target.to(device=device, dtype=dtype), draft.to(device=device, dtype=dtype)


def _eos_list(eos) -> list[int]:
    if eos is None:
        return []
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


NEUTRAL_KEYS = (
    "do_sample temperature top_k top_p min_p typical_p repetition_penalty no_repeat_ngram_size num_beams min_length "
    "min_new_tokens max_length max_new_tokens"
).split()


def neutralize_generation_config(model, eos: list[int], pad: int) -> dict:
    """Give ``model`` a neutral generation config (plain greedy/sampling); return the settings dropped."""
    from transformers import GenerationConfig

    old = getattr(model, "generation_config", None)
    defaults = GenerationConfig()
    dropped = {}
    if old is not None:
        for key in NEUTRAL_KEYS:
            value = getattr(old, key, None)
            if value is not None and value != getattr(defaults, key, None):
                dropped[key] = value
    model.generation_config = GenerationConfig(
        eos_token_id=eos or None, pad_token_id=pad, bos_token_id=getattr(old, "bos_token_id", None)
    )
    return dropped


def load_pair(args, dtype, draft_dtype=None) -> Pair:
    """The models and tokenizer of this run (smoke / demo / local directories)."""
    device = args.device
    if args.smoke:
        target, draft = smoke_models(device, dtype)
        tok = SmokeTokenizer()
        names = (
            f"smoke-tiny-llama-V{SMOKE_VOCAB}-L{SMOKE_LAYERS}-h{SMOKE_HIDDEN}",
            f"smoke-tiny-llama+noise{SMOKE_DRAFT_NOISE:g}",
        )
        eos, pad = [], SMOKE_PAD  # no EOS: a random model would stop at a random point; always max_new_tokens
    elif args.pair == "demo":
        from specdec_kernels.demo import load_demo_pair

        target, draft, tok = load_demo_pair(device=device, dtype=dtype)
        names = ("demo-target", "demo-draft")
        eos, pad = [tok.eos_token_id], tok.pad_token_id
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.target)
        tok.padding_side = "left"
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        target = AutoModelForCausalLM.from_pretrained(args.target, dtype=dtype).to(device).eval()
        draft = AutoModelForCausalLM.from_pretrained(args.draft, dtype=dtype).to(device).eval() if args.draft else None
        names = (Path(args.target).name, Path(args.draft).name if args.draft else "none")
        eos = _eos_list(getattr(target.generation_config, "eos_token_id", None)) or _eos_list(tok.eos_token_id)
        pad = tok.pad_token_id
    draft_int8 = quantised_draft(draft, args, bits=8)  # from the draft as loaded, in --int8-dtype
    draft_int4 = quantised_draft(draft, args, bits=4)
    draft_int8fb = quantised_draft(draft, args, bits=8, kernel="fbgemm")
    if draft is not None and draft_dtype is not None:
        draft = draft.to(draft_dtype)  # the draft's precision never changes what is accepted, only how often
    _swap_linears([target, draft, draft_int8, draft_int4, draft_int8fb], getattr(args, "cpu_linear", "torch"), device)
    dropped = neutralize_generation_config(target, eos, pad)
    for m in (draft, draft_int8, draft_int4, draft_int8fb):
        if m is not None:
            neutralize_generation_config(m, eos, pad)
    from specdec_kernels.hf.generate import _vocab_rows

    vocab = args.vocab_size
    if vocab is None and draft is not None and _vocab_rows(target) != _vocab_rows(draft):
        vocab = len(tok)  # the models pad their embedding matrices differently: compare real tokens only
    return Pair(target, draft, tok, names[0], names[1], eos, pad, vocab, dropped, draft_int8, draft_int4, draft_int8fb)


def _swap_linears(models: list, kind: str, device, what: str = "every model") -> None:
    """``use_cpu_linears(model, kind)`` on each CPU model given (None: skipped), with a summary line."""
    if kind == "torch" or not str(device).startswith("cpu"):
        return
    from specdec_kernels.hf.cpu_linear import use_cpu_linears

    counts = [use_cpu_linears(m, kind) for m in models if m is not None]
    if not counts:  # e.g. the drafts of a run without one
        return
    native, onednn = (sum(n) for n in zip(*counts, strict=True))
    print(
        f"# {kind} linears, {what}: {native} layers -> native fp32, {onednn} -> oneDNN (every mode, baselines included)"
    )


def load_pairs(args, dtype, draft_dtype, kinds: list[str]) -> dict[str, Pair]:
    """One Pair per CPU linear kind (``--cpu-linear`` with several kinds): the models load once; each
    kind but the last gets a copy of the target, the last the target itself, each swapped to its
    kind. The drafts are shared and run the first kind's kernels (a bf16 or int8 draft runs the same
    ones under "native" and "onednn": only fp32 layers differ)."""
    if len(kinds) == 1 or not str(args.device).startswith("cpu"):
        return {kinds[0]: load_pair(argparse.Namespace(**{**vars(args), "cpu_linear": kinds[0]}), dtype, draft_dtype)}
    base = load_pair(argparse.Namespace(**{**vars(args), "cpu_linear": "torch"}), dtype, draft_dtype)
    _swap_linears([base.draft, *base.quantised_drafts()], kinds[0], args.device, "the drafts (shared by every kind)")
    _release_freed_memory()  # (loading leaves ~1.5 GB of freed heap with the Qwen pair: two targets need it)
    pairs = {}
    for i, kind in enumerate(kinds):
        target = base.target if i == len(kinds) - 1 else copy.deepcopy(base.target)
        _swap_linears([target], kind, args.device, "its copy of the target")
        _release_freed_memory()
        pairs[kind] = dataclasses.replace(base, target=target)
    return pairs


def _release_freed_memory() -> None:
    """Hand the heap's freed pages back to the system (glibc's malloc_trim; elsewhere nothing)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def quantised_draft(draft, args, bits: int, kernel: str | None = None):
    """A copy of the draft with int8 (``bits=4``: int4) linear layers (:func:`quantised_copy`, keeping
    ``--int8-keep``; int8: ``kernel``, None for the default), the rest of it in ``--int8-dtype``, when
    a ``*_int8`` (``*_int4``; ``kernel="fbgemm"``: ``*_int8fb``) mode runs, else None."""
    suffix = f"_int{bits}" + ("fb" if kernel == "fbgemm" else "")
    if draft is None or not any(m.endswith(suffix) for m in getattr(args, "modes", None) or ()):
        return None
    made = quantised_copy(
        draft,
        bits,
        kernel,
        dtype=getattr(args, "int8_dtype", None) or "fp32",
        keep=tuple(getattr(args, "int8_keep", None) or ()),
    )
    if made is None:
        return None
    quantized, swapped = made
    print(f"# *{suffix} modes: a draft copy with {swapped} int{bits} linear layers ({kernel or 'default'} kernel)")
    return quantized


def quantised_copy(draft, bits: int = 8, kernel: str | None = None, dtype: str = "fp32", keep: tuple = ()):
    """(A copy of ``draft`` in ``dtype`` with int8 (``bits=4``: int4) linear layers but those whose name
    contains one of ``keep``, how many were swapped); None where that kernel does not load or the
    draft is not on the CPU. int8: ``kernel`` "fbgemm", or None for the default."""
    from _common import torch_dtype

    from specdec_kernels.hf import cpu_int4, cpu_int8

    if bits == 8 and kernel == "fbgemm":
        available, swap = cpu_int8._fbgemm_available, functools.partial(cpu_int8.use_int8_linears, kernel=kernel)
    elif bits == 8:
        available, swap = cpu_int8.int8_linear_available, cpu_int8.use_int8_linears
    else:
        available, swap = cpu_int4.int4_linear_available, cpu_int4.use_int4_linears
    if not available() or next(draft.parameters()).device.type != "cpu":
        return None
    quantized = copy.deepcopy(draft).to(torch_dtype(dtype))
    return quantized, swap(quantized, keep=keep)


def encode(tokenizer, texts: list[str], device: str) -> tuple[torch.Tensor, torch.Tensor]:
    batch = (
        tokenizer(texts, return_tensors="pt")
        if isinstance(tokenizer, SmokeTokenizer)
        else tokenizer(texts, return_tensors="pt", padding=True)
    )
    return batch["input_ids"].to(device), batch["attention_mask"].to(device)
