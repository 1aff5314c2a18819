"""The settings of one ``speculative_generate`` call, checked in one place (:class:`SpecConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .._params import SEED_RANGE, check_temperature_value, check_top_p_ties
from .._types import MAX_NODES, METHODS, VERIFY_METHODS
from . import medusa as _medusa
from .processors import RowProcessor
from .processors import check_processors as _check_processors

DRAFTERS = ("model", "prompt_lookup", "medusa")
DRAFT_TREES = (None, "dynamic")
DEFAULT_TREE_WIDTH = 4  # children per expanded node of a dynamic tree (EAGLE-2's default top-k is 10;
# 4 keeps ceil(N / 4) draft forwards per step for N = 16, the demo's budget)
DEFAULT_TREE_THRESHOLD = 0.0  # a dynamic tree's node threshold (0: the N nodes fill k per depth)
CACHE_IMPLEMENTATIONS = ("dynamic", "static")


@dataclass
class SpecConfig:
    """Everything ``speculative_generate`` was asked for, validated, with the defaults resolved
    (``method``, ``eos``/``pad`` from the target's generation config, the seed, the vocabulary the
    verifier sees). Build it with :meth:`from_arguments`; the arguments are documented at
    :func:`specdec_kernels.hf.speculative_generate`."""

    num_draft_tokens: int
    num_drafts: int
    method: str
    drafter: str
    vocab_size: int  # the vocabulary the verifier sees (logits past it are dropped)
    max_new_tokens: int
    seed: int
    eos: set = field(default_factory=set)
    pad: int = 0
    medusa_heads: object = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    top_p_ties: str = "by_index"
    attention_backend: str = "auto"
    cache_implementation: str = "dynamic"
    compile_target: bool | dict = False
    adaptive_draft: bool = True  # in effect: asked for and possible (draft-model chains, K = 1, eager)
    draft_confidence: float = 0.0  # in effect (0 unless adaptive_draft)
    exact_timing: bool = False
    draft_cost: float | str | None = None
    row_processor: object = None  # processors.RowProcessor, or None: no logits processor (the fused path)
    grammar: list | None = None  # one xgrammar.CompiledGrammar per request (hf/grammar.py), or None
    verification: str = "token"  # the chains' rule (sk.verify's method): "token" or "block"
    draft_tree: str | None = None  # "dynamic": the draft model grows a token tree (drafters/dynamic_tree.py)
    tree_width: int = DEFAULT_TREE_WIDTH  # children per expanded node of a dynamic tree
    prompt_lookup: bool = False  # a dynamic tree's n-gram lookup branch (drafters/dynamic_tree.py)
    tree_threshold: float = DEFAULT_TREE_THRESHOLD  # a dynamic tree's least path score (drafters/dynamic_tree.py)
    draft_vocab: object = None  # draft_vocab.DraftVocab: the ids the draft model may propose, or None (all)

    @property
    def sampling(self) -> dict:
        """The sampling the verifier applies to the target's rows (and the draft's law follows): the
        call's temperature / top-k / top-p, or, where a RowProcessor has already applied them with
        the processors, temperature 1 (0 when greedy) and nothing else."""
        if self.row_processor is not None:
            return dict(temperature=0.0 if self.greedy else 1.0, top_k=0, top_p=1.0)
        return dict(temperature=float(self.temperature), top_k=int(self.top_k), top_p=float(self.top_p))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_arguments(cls, target, draft, input_ids, attention_mask, **kw) -> SpecConfig:
        """Checks ``speculative_generate``'s keyword arguments (a ValueError / TypeError naming the
        first bad one) and resolves their defaults."""
        G, K = _as_int("num_draft_tokens", kw["num_draft_tokens"]), _as_int("num_drafts", kw["num_drafts"])
        max_new_tokens = _as_int("max_new_tokens", kw["max_new_tokens"])
        cache_implementation, compile_target = kw["cache_implementation"], kw["compile_target"]
        seed, draft_cost, draft_confidence = kw["seed"], kw["draft_cost"], kw["draft_confidence"]
        if cache_implementation not in CACHE_IMPLEMENTATIONS:
            raise ValueError(
                f"cache_implementation must be one of {CACHE_IMPLEMENTATIONS}, got {cache_implementation!r}"
            )
        if compile_target and cache_implementation != "static":
            raise ValueError("compile_target needs cache_implementation='static' (fixed cache buffers)")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**64):
            raise ValueError(f"seed must be an int in [0, 2**64), got {seed!r}")
        if not (draft_cost in (None, "measured", "shapes") or is_number(draft_cost) and draft_cost >= 0):
            raise ValueError(f"draft_cost must be 'measured', 'shapes', None or a number >= 0, got {draft_cost!r}")
        check_top_p_ties(kw["top_p_ties"])
        if not (isinstance(draft_confidence, (int, float)) and 0.0 <= draft_confidence <= 1.0):
            raise ValueError(f"draft_confidence must be in [0, 1], got {draft_confidence!r}")
        drafter, method = kw["drafter"], kw["method"]
        draft_tree = kw["draft_tree"]
        if method is None:
            method = "rrs_wor" if drafter == "medusa" or draft_tree == "dynamic" else "kseq"
        if drafter == "medusa":
            _check_medusa(draft, kw["medusa_heads"], method, compile_target)
        cfg = cls(G, K, method, drafter, 0, max_new_tokens, 0, **_passed(kw))
        cfg.vocab_size = _check_inputs(target, draft, input_ids, attention_mask, cfg, kw["vocab_size"], kw["streamer"])
        gen_cfg = getattr(target, "generation_config", None)
        eos_token_id, pad = kw["eos_token_id"], kw["pad_token_id"]
        cfg.eos = _as_set(eos_token_id if eos_token_id is not None else getattr(gen_cfg, "eos_token_id", None))
        pad = pad if pad is not None else getattr(gen_cfg, "pad_token_id", None)
        cfg.pad = pad if pad is not None else (min(cfg.eos) if cfg.eos else 0)
        cfg.seed = seed if seed is not None else int(torch.randint(0, SEED_RANGE, (1,)))
        cfg.adaptive_draft = bool(kw["adaptive_draft"]) and drafter == "model" and K == 1 and not compile_target
        cfg.draft_confidence = draft_confidence if cfg.adaptive_draft else 0.0
        cfg.verification = _check_verification(kw["verification"], cfg)
        cfg.draft_tree, cfg.tree_width = _check_draft_tree(draft_tree, kw["tree_width"], kw, cfg)
        cfg.draft_vocab = _check_draft_vocab(kw["draft_vocab"], cfg, shared=draft is target)
        if kw["grammar"] is not None:
            from .grammar import compile_grammars

            B = input_ids.shape[0]
            cfg.grammar = compile_grammars(kw["grammar"], kw["tokenizer"], cfg.vocab_size, sorted(cfg.eos), B)
        elif kw["tokenizer"] is not None:
            raise ValueError("tokenizer= is read only with grammar= (to compile the grammar over the vocabulary)")
        processors, settings = kw["logits_processor"], kw["generation_config"]
        _check_processors(processors, cfg)
        cfg.row_processor = RowProcessor.build(processors, settings, cfg, input_ids, attention_mask)
        if cfg.row_processor is not None and cfg.draft_tree is not None:
            raise ValueError(
                "draft_tree='dynamic' does not support logits processors (logits_processor= or "
                "generation_config= processor settings) yet"
            )
        if cfg.row_processor is not None and not cfg.greedy and cfg.top_p < 1.0 and cfg.top_p_ties != "by_index":
            raise ValueError(
                "logits processors run generate's TopPLogitsWarper (top_p_ties='by_index'); "
                f"top_p_ties={cfg.top_p_ties!r} cannot be honoured with them"
            )
        return cfg


_PASSED = (
    "medusa_heads",
    "temperature",
    "top_k",
    "top_p",
    "top_p_ties",
    "attention_backend",
    "cache_implementation",
    "compile_target",
    "exact_timing",
    "draft_cost",
)


def _passed(kw: dict) -> dict:
    return {name: kw[name] for name in _PASSED}


def _check_verification(verification, cfg: SpecConfig) -> str:
    """verification=: block verification decides a chain's accepted prefix jointly (sk.verify's
    method="block"); trees (K > 1 chains, Medusa) have their own methods."""
    if verification not in VERIFY_METHODS:
        raise ValueError(f"verification must be one of {VERIFY_METHODS}, got {verification!r}")
    if verification == "block" and (cfg.num_drafts > 1 or cfg.drafter == "medusa"):
        raise ValueError("verification='block' verifies chains: num_drafts=1 and a chain drafter (not medusa)")
    return verification


def _check_draft_tree(draft_tree, tree_width, kw: dict, cfg: SpecConfig) -> tuple[str | None, int]:
    """draft_tree= / tree_width=: a ValueError naming every setting dynamic trees cannot honour yet."""
    if draft_tree not in DRAFT_TREES:
        raise ValueError(f"draft_tree must be one of {DRAFT_TREES}, got {draft_tree!r}")
    lookup = kw["prompt_lookup"]
    if not isinstance(lookup, bool):
        raise TypeError(f"prompt_lookup must be a bool, got {lookup!r}")
    cfg.prompt_lookup = lookup
    threshold = kw["tree_threshold"]
    if draft_tree is None:
        if tree_width is not None:
            raise ValueError("tree_width= is read only with draft_tree='dynamic'")
        if threshold is not None:
            raise ValueError("tree_threshold= is read only with draft_tree='dynamic'")
        if lookup:
            raise ValueError(
                "prompt_lookup=True adds a lookup branch to draft_tree='dynamic'; for lookup chains use "
                "drafter='prompt_lookup'"
            )
        return None, DEFAULT_TREE_WIDTH
    width = DEFAULT_TREE_WIDTH if tree_width is None else _as_int("tree_width", tree_width)
    if width < 1:
        raise ValueError(f"tree_width must be >= 1, got {width}")
    threshold = DEFAULT_TREE_THRESHOLD if threshold is None else threshold
    if not (is_number(threshold) and 0.0 <= threshold < 1.0):
        raise ValueError(f"tree_threshold must be a number in [0, 1), got {threshold!r}")
    cfg.tree_threshold = float(threshold)
    refused = [
        (cfg.drafter != "model", f"drafter={cfg.drafter!r} (dynamic trees are grown by a draft model)"),
        (cfg.num_drafts != 1, "num_drafts > 1 (a dynamic tree's width is tree_width=)"),
        (cfg.method != "rrs_wor", f"method={cfg.method!r} (children are drawn without replacement: 'rrs_wor')"),
        (cfg.verification != "token", f"verification={cfg.verification!r} (block verification verifies chains)"),
        (kw["draft_confidence"] != 0.0, "draft_confidence (chains only)"),
    ]
    for bad, setting in refused:
        if bad:
            raise ValueError(f"draft_tree='dynamic' does not support {setting} yet")
    return draft_tree, width


def _check_draft_vocab(draft_vocab, cfg: SpecConfig, shared: bool):
    """draft_vocab=: None, or a DraftVocab (ids are made into one) for a draft model's proposals
    (``shared``: the draft is the target object, whose output layer the call must not restrict)."""
    if draft_vocab is None:
        return None
    from .draft_vocab import DraftVocab

    if cfg.drafter != "model":
        raise ValueError(f"draft_vocab= restricts a draft model's proposals; drafter={cfg.drafter!r} has none")
    if shared:
        raise ValueError(
            "draft_vocab= needs a draft that is not the target itself (its output layer would be restricted)"
        )
    vocab = draft_vocab if isinstance(draft_vocab, DraftVocab) else DraftVocab(draft_vocab)
    vocab.check(cfg.vocab_size)
    return vocab


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_medusa(draft, heads, method, compile_target) -> None:
    if heads is None:
        raise ValueError("drafter='medusa' needs medusa_heads= (e.g. specdec_kernels.demo.load_medusa_heads())")
    if not isinstance(heads, _medusa.MedusaHeads):
        raise TypeError(f"medusa_heads must be a MedusaHeads, got {type(heads).__name__}")
    if draft is not None:
        raise ValueError("drafter='medusa' drafts with the heads: pass draft=None")
    if method != "rrs_wor":
        raise ValueError(
            f"drafter='medusa' samples each node's children without replacement: method must be 'rrs_wor' "
            f"(the default), got {method!r}"
        )
    if compile_target:
        raise ValueError("compile_target is not supported with drafter='medusa' yet")


def _as_set(eos) -> set[int]:
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    return {int(e) for e in (eos.tolist() if isinstance(eos, torch.Tensor) else eos)}


def _as_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    return value


def vocab_rows(model) -> int:
    """Rows of the model's output layer (its logits' width); ``out_features`` first because the
    ``weight`` of an output layer swapped for :class:`~specdec_kernels.hf.cpu_linear.OneDnnLinear` is
    an unpacked copy."""
    emb = model.get_output_embeddings()
    if emb is None:
        return model.config.vocab_size
    rows = getattr(emb, "out_features", None)
    return int(rows) if rows is not None else emb.weight.shape[0]


def _check_shapes(cfg: SpecConfig, draft) -> None:
    G, K, method, drafter = cfg.num_draft_tokens, cfg.num_drafts, cfg.method, cfg.drafter
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be one of {DRAFTERS}, got {drafter!r}")
    if drafter == "model" and draft is None:
        raise ValueError("draft=None needs drafter='prompt_lookup'")
    if drafter == "prompt_lookup" and K != 1:
        raise ValueError("drafter='prompt_lookup' proposes one chain: use num_drafts=1")
    if method not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {method!r}")
    if G < 1 or K < 1:
        raise ValueError(f"num_draft_tokens and num_drafts must be >= 1, got {G} and {K}")
    if drafter == "medusa":
        if 1 + G > MAX_NODES:
            raise ValueError(f"drafter='medusa': 1 + num_draft_tokens (tree nodes) must be <= {MAX_NODES}, got 1 + {G}")
    elif 1 + K * G > MAX_NODES or (drafter == "model" and 2 + (G - 1) * K > MAX_NODES):
        raise ValueError(f"1 + num_drafts * num_draft_tokens must be <= {MAX_NODES}, got 1 + {K} * {G}")


def _check_sampling(cfg: SpecConfig) -> None:
    temperature, top_k, top_p, K = cfg.temperature, cfg.top_k, cfg.top_p, cfg.num_drafts
    check_temperature_value(temperature)  # finite, >= 0, and 0 or >= 2**-126 (1/T fits float32)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not isinstance(top_p, (int, float)) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if cfg.method == "rrs_wor" and K > 1 and 0 < top_k < K and temperature > 0 and cfg.drafter != "medusa":
        raise ValueError(f"method='rrs_wor' samples {K} distinct first drafts: top_k={top_k} leaves too few")


def _check_prompts(input_ids, attention_mask) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError("input_ids must be a non-empty [B, T] tensor")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have input_ids' shape {tuple(input_ids.shape)}")
    if attention_mask is not None:
        # Left padding only: a request's real tokens are one run that ends at the last column.
        monotone = attention_mask.bool().long().diff(dim=1) >= 0
        if not bool(monotone.all()):
            raise ValueError(
                "attention_mask must be left-padded (0s then 1s in every row, as for generate with "
                "tokenizer.padding_side='left'); got right padding or holes"
            )
    lens = (attention_mask if attention_mask is not None else torch.ones_like(input_ids)).sum(1)
    if bool((lens < 1).any()):
        raise ValueError("every prompt needs at least one token")


def _drafter_vocab(target, draft, cfg: SpecConfig, vocab_size) -> int:
    """The vocabulary target and drafter share (a ValueError where they differ unexplained)."""
    V_t = vocab_rows(target)
    if cfg.drafter == "model":
        V_d = vocab_rows(draft)
        if V_d != V_t and vocab_size is None:
            raise ValueError(
                f"draft vocabulary size ({V_d}) differs from the target's ({V_t}); if both use one tokenizer and "
                f"only pad their embedding matrices differently, pass vocab_size=len(tokenizer)"
            )
        return min(V_t, V_d)
    if cfg.drafter == "medusa":
        heads = cfg.medusa_heads
        if heads.vocab_size != V_t and vocab_size is None:
            raise ValueError(
                f"the Medusa heads' vocabulary ({heads.vocab_size}) differs from the target's ({V_t}); pass "
                f"vocab_size= (the real token count) if only the embedding matrices are padded differently"
            )
        hidden = target.config.get_text_config(decoder=True).hidden_size
        if heads.hidden_size != hidden:
            raise ValueError(f"the Medusa heads read hidden size {heads.hidden_size}, the target has {hidden}")
        return min(V_t, heads.vocab_size)
    return V_t


def _check_inputs(target, draft, input_ids, attention_mask, cfg: SpecConfig, vocab_size, streamer) -> int:
    """Validate models, shapes and prompts up front; returns the vocabulary size the verifier sees."""
    _check_shapes(cfg, draft)
    _check_sampling(cfg)
    if cfg.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
    _check_prompts(input_ids, attention_mask)
    if streamer is not None and input_ids.shape[0] != 1:
        raise ValueError("streamer needs batch size 1")
    V = _drafter_vocab(target, draft, cfg, vocab_size)
    if vocab_size is not None:
        if vocab_size > V:
            raise ValueError(f"vocab_size={vocab_size} exceeds the models' vocabulary ({V})")
        V = int(vocab_size)
    if int(input_ids.max()) >= V or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids must lie in [0, {V})")
    return V
