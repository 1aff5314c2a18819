"""A tiny embedded draft/target pair for ``specdec demo``: byte-level Llama models trained on Python.

The two models ship inside the package (``weights/target`` and ``weights/draft``, fp16
safetensors, a few MB in all) and were trained by ``scripts/train_demo_pair.py`` on the
CPython standard library's ``.py`` files; ``weights/README.md`` and ``weights/training.json``
record how, with held-out bits per byte and the draft/target greedy agreement rate.

Both models share one vocabulary of 258 ids: the 256 byte values, ``BOS = 256`` and
``EOS = 257`` (EOS doubles as the padding id). :class:`ByteTokenizer` maps text to those ids and
can stand in for a Hugging Face tokenizer (``__call__`` with left padding, ``decode``, the
special-token ids).

Loading needs ``transformers`` (and ``safetensors``) but no network::

    from specdec_kernels.demo import load_demo_pair, DEMO_PROMPTS
    target, draft, tok = load_demo_pair()
    batch = tok(DEMO_PROMPTS[:2])
    out = target.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=tok.pad_token_id)
    print(tok.decode(out[0]))

Medusa heads for the target (``weights/medusa``, trained by ``scripts/train_medusa_heads.py``)::

    from specdec_kernels.demo import load_medusa_heads
    from specdec_kernels.hf import speculative_generate
    heads = load_medusa_heads()
    out = speculative_generate(target, None, **batch, drafter="medusa", medusa_heads=heads,
                               num_draft_tokens=16, num_drafts=3, max_new_tokens=32)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

__all__ = [
    "BOS_ID",
    "DEMO_PROMPTS",
    "EOS_ID",
    "VOCAB_SIZE",
    "WEIGHTS_DIR",
    "ByteTokenizer",
    "load_demo_pair",
    "load_medusa_heads",
]

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BOS_ID = 256
EOS_ID = 257
VOCAB_SIZE = 258

# Short openings of Python code for the demo: each invites a few dozen predictable bytes.
DEMO_PROMPTS: tuple[str, ...] = (
    "import os\nimport sys\n\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n    ',
    "    for i in range(len(",
    "if __name__ == '__main__':\n    ",
    "    def __repr__(self):\n        return '%s(%r)' % (self.__class__.__name__, ",
)


class ByteTokenizer:
    """Byte-level tokenizer: ids 0..255 are UTF-8 bytes, 256 is BOS, 257 is EOS (and padding).

    ``encode`` prepends BOS unless ``add_special_tokens=False``; ``decode`` drops special ids and
    decodes UTF-8 with ``errors="replace"``. Calling the tokenizer on a string or a list of
    strings returns ``input_ids`` and ``attention_mask`` padded on the LEFT (as decoder-only
    generation wants), as torch tensors by default.
    """

    bos_token_id: int = BOS_ID
    eos_token_id: int = EOS_ID
    pad_token_id: int = EOS_ID
    vocab_size: int = VOCAB_SIZE
    bos_token: str = "<bos>"
    eos_token: str = "<eos>"
    pad_token: str = "<eos>"
    padding_side: str = "left"

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def raw_vocab(self) -> list[bytes]:
        """The bytes of every id (b"" for BOS / EOS): what grammar engines (xgrammar) match text with."""
        return [bytes([i]) for i in range(256)] + [b"", b""]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_special_tokens else ids

    def decode(self, ids: Iterable[int] | torch.Tensor, skip_special_tokens: bool = True) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.reshape(-1).tolist()
        out = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                out.append(i)
            elif not skip_special_tokens:
                out.extend((self.bos_token if i == self.bos_token_id else self.eos_token).encode())
        return out.decode("utf-8", errors="replace")

    def batch_decode(self, sequences: Sequence[Iterable[int]] | torch.Tensor, skip_special_tokens: bool = True):
        return [self.decode(s, skip_special_tokens=skip_special_tokens) for s in sequences]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]):
        if isinstance(ids, int):
            return self.decode([ids], skip_special_tokens=False)
        return [self.decode([i], skip_special_tokens=False) for i in ids]

    def __call__(
        self,
        texts: str | Sequence[str],
        return_tensors: str | None = "pt",
        padding: bool | str = True,
        add_special_tokens: bool = True,
    ) -> dict:
        single = isinstance(texts, str)
        batch = [texts] if single else list(texts)
        seqs = [self.encode(t, add_special_tokens=add_special_tokens) for t in batch]
        if padding and seqs:
            width = max(len(s) for s in seqs)
            masks = [[0] * (width - len(s)) + [1] * len(s) for s in seqs]
            seqs = [[self.pad_token_id] * (width - len(s)) + s for s in seqs]
        else:
            if return_tensors is not None and len({len(s) for s in seqs}) > 1:
                raise ValueError("sequences of different lengths need padding=True to become one tensor")
            masks = [[1] * len(s) for s in seqs]
        if return_tensors is None:
            if single:
                return {"input_ids": seqs[0], "attention_mask": masks[0]}
            return {"input_ids": seqs, "attention_mask": masks}
        if return_tensors != "pt":
            raise ValueError(f"return_tensors={return_tensors!r}: only 'pt' or None")
        return {
            "input_ids": torch.tensor(seqs, dtype=torch.long),
            "attention_mask": torch.tensor(masks, dtype=torch.long),
        }

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos=pad={self.eos_token_id})"


def load_demo_pair(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load the embedded ``(target, draft, tokenizer)``: two ``LlamaForCausalLM`` in eval mode.

    The weights are read from this package's directory with ``from_pretrained(local_path)``
    (never the network), cast to ``dtype`` and moved to ``device``.
    """
    from transformers import LlamaForCausalLM

    models = []
    for name in ("target", "draft"):
        path = WEIGHTS_DIR / name
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"demo weights missing at {path}: reinstall specdec_kernels or run scripts/train_demo_pair.py"
            )
        model = LlamaForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=dtype)
        models.append(model.to(device=device).eval())
    target, draft = models
    return target, draft, ByteTokenizer()


def load_medusa_heads(device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32):
    """Load the embedded Medusa heads of the demo target (``weights/medusa``, fp16 safetensors
    read from this package's directory), cast to ``dtype``, on ``device``, in eval mode."""
    from ..hf.medusa import MedusaHeads

    path = WEIGHTS_DIR / "medusa"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"Medusa heads missing at {path}: reinstall specdec_kernels or run scripts/train_medusa_heads.py"
        )
    return MedusaHeads.from_pretrained(path, dtype=dtype, device=device)
