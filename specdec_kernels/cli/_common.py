"""What every ``specdec`` command shares: the usage error, the device choice, the driver's checks
reported as command-line errors, the model-position check and the table printer.

Where the checks live: a value that ``speculative_generate`` (or an op) receives is checked there,
once; :func:`driver_checks` reports its ``ValueError`` as a one-line error naming the flag. The
command line checks only what the driver never sees: paths, the device, which models to load, its
own limits (``--prompts``, ``--batch``), and the models' position count (no driver check yet).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch

EXIT_USAGE = 2  # what argparse exits with on a bad argument
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what shells report for Ctrl-C
# what `specdec demo` / `generate` import beyond torch: dependencies, missing only after --no-deps installs
HF_MODULES = ("transformers", "safetensors", "tqdm", "tokenizers", "huggingface_hub")

# speculative_generate's keyword -> the flag that sets it (the commands that name them differently
# pass their own map to driver_checks)
DRIVER_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "num_draft_tokens": "--num-draft-tokens",
    "num_drafts": "--num-drafts",
    "method": "--method",
    "verification": "--verification",
    "drafter": "--drafter",
    "draft_tree": "--draft-tree",
    "tree_width": "--tree-width",
    "prompt_lookup": "--prompt-lookup",
    "tree_threshold": "--tree-threshold",
    "draft_vocab": "--draft-vocab",
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "seed": "--seed",
    "vocab_size": "--vocab-size",
    "compile_target": "--compile",
    "grammar": "--json-schema / --grammar",
}


class UsageError(Exception):
    """A bad command-line value: printed as one line naming the argument, exit code 2."""

    def __init__(self, argument: str, value, allowed: str):
        super().__init__(f"{argument}: {value!r} is not allowed: {allowed}")


class DriverRefused(UsageError):
    """The driver's (or an op's) own check refused a value: its message, with its keyword names
    replaced by the flags that set them."""

    def __init__(self, message: str):
        Exception.__init__(self, message)


@contextmanager
def driver_checks(flags: Mapping[str, str] = DRIVER_FLAGS, default: str | None = None) -> Iterator[None]:
    """A ``ValueError`` raised inside names a keyword of ``flags``: re-raise it as a usage error that
    names the flag instead (``default``: the flag blamed when it names none; else it propagates)."""
    try:
        yield
    except ValueError as exc:
        message = str(exc)
        named = [kw for kw in flags if re.search(rf"\b{kw}\b", message)]
        if not named and default is None:
            raise
        for kw in sorted(named, key=len, reverse=True):  # longer names first: num_drafts vs num_draft_tokens
            message = re.sub(rf"\b{kw}\b", flags[kw], message)
        raise DriverRefused(message if named else f"{default}: {message}") from exc


def resolve_device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device", choice, "no CUDA GPU is visible to torch here; use --device cpu or auto")
    return choice


def at_least(argument: str, value, low, what: str = "") -> None:
    if value is None or value < low:
        raise UsageError(argument, value, f"an integer >= {low}{what}")


def check_sampled_temperature(value) -> None:
    """A temperature for sampled rows: the ops' own check (``_params``), and not 0 (greedy)."""
    from .._params import check_temperature_value

    try:
        check_temperature_value(value)
    except (TypeError, ValueError) as exc:
        raise UsageError("--temperature", value, "a finite float >= 0 (0 = greedy)") from exc
    if value == 0:
        raise UsageError("--temperature", value, "a float > 0 (it sets the sampled rows)")


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


def check_positions(max_new_tokens: int, prompt_len: int, lookahead: int, *models) -> None:
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


def quiet_transformers() -> None:
    """Our own progress bars and tables only: no weight-loading bars or generation-config notices."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    cells = [[c] + [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for r in rows] for c in cols]
    widths = [max(len(x) for x in col) for col in cells]
    for i in range(len(rows) + 1):
        print("  ".join(col[i].rjust(w) for col, w in zip(cells, widths, strict=False)))
