"""A draft model that proposes from part of the vocabulary: its output layer computes those rows only.

Why. A small draft's output layer is a large share of each draft forward: Qwen2.5-Coder-0.5B's
896 x 151,936 layer reads 272 MB in bf16 for every drafted token, and on the 2-core AMD EPYC
(1 thread, oneDNN linears) the draft's one-token forward fell from 81 ms to 68 ms with the layer cut
to 32,768 rows (62 ms at 16,384). The text a model writes uses few of its tokens (13,885 distinct
ids in 394k tokens of Python's standard library; the 32,768 ids Qwen's BPE merged first cover 94%),
so a draft restricted to the frequent ones loses few accepted drafts (FR-Spec's frequency-ranked
drafting, SGLang's hot-token map for EAGLE-3 drafters).

Exactness. The restricted draft is just another draft model: its logits are the full model's on
the kept ids and ``OFF_VOCAB_LOGIT`` elsewhere, and every downstream step (temperature, top-k/top-p,
logits processors, grammar masks, the draws, the q rows the verifier gets) reads those logits, so
the verifier sees the law the drafts were drawn from and the output stays exactly the target's
(greedy: identical to ``generate``). A token outside the kept ids is never drafted; the target
still emits it (a recovered or bonus token).

Usage::

    vocab = DraftVocab(frequent_token_ids(tokenizer, texts, 32768))  # build once, reuse across calls
    out = speculative_generate(target, draft, ids, mask, draft_vocab=vocab)

The call swaps the draft's output layer for the restricted one (built once per draft and kept by
the ``DraftVocab``) and puts the original back when it returns, an exception included.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable

import torch
from torch import nn

from .cpu_f32 import NativeLinear
from .cpu_int4 import Int4Linear
from .cpu_int8 import Int8Linear
from .cpu_linear import OneDnnLinear

__all__ = ["OFF_VOCAB_LOGIT", "DraftVocab", "DraftVocabHead", "frequent_token_ids"]

# The logit of a token outside the kept ids. Finite, not -inf: a row whose kept tokens are all
# masked (a grammar, a processor's -inf) must still be a distribution (softmax of all -inf is NaN);
# the draft then proposes among the masked-in tokens uniformly, which is still a valid draft law.
# Low enough that exp(OFF - kept) is 0 in fp32 at temperature 1 for any kept logit above -9,900.
OFF_VOCAB_LOGIT = -1.0e4


class DraftVocabHead(nn.Module):
    """An output layer over ``token_ids`` only, returning full-width logits.

    ``kept``: the original layer's rows at ``token_ids`` (an ``nn.Linear``, or an ``OneDnnLinear`` /
    ``Int8Linear`` / ``Int4Linear`` where the original was one). Input ``[..., in_features]``; output
    ``[..., out_features]`` with the kept rows' logits at ``token_ids`` and ``OFF_VOCAB_LOGIT`` elsewhere.
    """

    def __init__(self, kept: nn.Module, token_ids: torch.Tensor, out_features: int):
        super().__init__()
        self.kept = kept
        self.in_features, self.out_features = int(kept.in_features), int(out_features)
        self.register_buffer("token_ids", token_ids, persistent=False)  # [K] int64, sorted, unique
        # ids 0..K-1 (a BPE-order prefix): one slice copy instead of an index_copy
        self.prefix = bool(token_ids.numel()) and int(token_ids[-1]) == token_ids.numel() - 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kept(x)  # [..., K]
        out = y.new_full((*y.shape[:-1], self.out_features), OFF_VOCAB_LOGIT)  # [..., V]
        if self.prefix:
            out[..., : y.shape[-1]] = y
        else:
            out.index_copy_(-1, self.token_ids, y)
        return out

    def extra_repr(self) -> str:
        return f"kept={self.token_ids.numel()}, out_features={self.out_features}"


class DraftVocab:
    """The token ids a draft may propose (sorted, unique) and the output layers built for them (one
    per draft model, kept while the model lives). Pass it as ``speculative_generate(draft_vocab=)``."""

    def __init__(self, token_ids):
        ids = torch.as_tensor(token_ids)
        if ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"draft_vocab must be a non-empty 1-D list of token ids, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise ValueError(f"draft_vocab's token ids must be integers, got {ids.dtype}")
        ids = ids.to(torch.long).cpu()
        if int(ids.min()) < 0:
            raise ValueError(f"draft_vocab's token ids must be >= 0, got {int(ids.min())}")
        ids = ids.sort().values
        if ids.numel() > 1 and bool((ids[1:] == ids[:-1]).any()):
            raise ValueError("draft_vocab's token ids must be unique")
        self.token_ids = ids  # [K] int64, sorted
        self._heads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # draft model -> DraftVocabHead

    def __len__(self) -> int:
        return self.token_ids.numel()

    def check(self, vocab_size: int) -> None:
        """A ValueError unless every id is a token the verifier sees (< ``vocab_size``)."""
        if int(self.token_ids[-1]) >= vocab_size:
            raise ValueError(f"draft_vocab has token id {int(self.token_ids[-1])} >= the vocabulary size {vocab_size}")

    def head_for(self, model) -> DraftVocabHead:
        """``model``'s restricted output layer (built on first use, from its current output layer)."""
        head = self._heads.get(model)
        if head is None:
            head = self._heads[model] = _restricted_head(model, self.token_ids)
        return head

    @contextlib.contextmanager
    def installed(self, model):
        """Inside the block ``model``'s output layer is the restricted one (yielded); the original
        is put back on exit."""
        original = model.get_output_embeddings()
        head = self.head_for(model)
        model.set_output_embeddings(head)
        if model.get_output_embeddings() is not head:
            model.set_output_embeddings(original)
            raise ValueError(f"draft_vocab: {type(model).__name__} did not take a new output layer")
        try:
            yield head
        finally:
            model.set_output_embeddings(original)


@torch.no_grad()
def _restricted_head(model, ids: torch.Tensor) -> DraftVocabHead:
    out = model.get_output_embeddings()
    if isinstance(out, DraftVocabHead):
        raise ValueError("draft_vocab: the draft's output layer is already restricted")
    if type(out) not in (nn.Linear, OneDnnLinear, NativeLinear, Int8Linear, Int4Linear):
        raise ValueError(
            "draft_vocab needs a draft whose output layer is an nn.Linear (or OneDnnLinear, NativeLinear, "
            f"Int8Linear, Int4Linear), got {type(out).__name__}"
        )
    if int(ids[-1]) >= out.out_features:
        raise ValueError(f"draft_vocab has token id {int(ids[-1])} >= the draft's output rows ({out.out_features})")
    if isinstance(out, Int4Linear):  # the packed rows themselves: the same int4 values, nothing dequantised
        return DraftVocabHead(out.select_rows(ids), ids, out.out_features)
    weight = out.weight.detach()  # [V, in_features] (OneDnnLinear, NativeLinear: unpacked; Int8Linear: dequantised)
    index = ids.to(weight.device)
    kept = nn.Linear(weight.shape[1], ids.numel(), bias=out.bias is not None, device=weight.device, dtype=weight.dtype)
    kept.weight.copy_(weight.index_select(0, index))
    if out.bias is not None:
        kept.bias.copy_(out.bias.detach().index_select(0, index))
    kept.requires_grad_(False)
    if isinstance(out, OneDnnLinear):
        kept = OneDnnLinear.from_linear(kept)
    elif isinstance(out, NativeLinear):
        kept = NativeLinear.from_linear(kept)
    elif isinstance(out, Int8Linear):  # requantised: the same int8 values, scales to rounding
        kept = Int8Linear.from_linear(kept, out.kernel)
    return DraftVocabHead(kept, index, weight.shape[0])


def frequent_token_ids(
    tokenizer, texts: Iterable[str], size: int, *, include: Iterable[int] = (), vocab_size: int | None = None
) -> torch.Tensor:
    """The ``size`` token ids a draft should keep: ``include`` and the tokenizer's special ids, then
    the ids most frequent in ``texts``, then (ties, and ids no text used) the lowest ids (a BPE
    tokenizer's merge order, roughly its training frequency). Ids below ``vocab_size`` (default
    ``len(tokenizer)``); sorted, int64.

    Example::

        ids = frequent_token_ids(tokenizer, [open(p).read() for p in corpus_files], 32768)
    """
    V = len(tokenizer) if vocab_size is None else int(vocab_size)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"size must be an int >= 1, got {size!r}")
    counts = torch.zeros(V, dtype=torch.float64)
    for text in texts:
        ids = torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
        counts += torch.bincount(ids[ids < V], minlength=V).to(torch.float64)
    forced = [int(i) for i in (*include, *getattr(tokenizer, "all_special_ids", ())) if 0 <= int(i) < V]
    counts[forced] = float("inf")
    # by count, then by id: a stable sort of the ids by descending count keeps the lower id first
    order = torch.sort(-counts, stable=True).indices
    return order[: min(size, V)].sort().values
