#!/usr/bin/env python
"""Train the tiny byte-level draft/target pair embedded in ``specdec_kernels/demo/weights``.

Both models are Hugging Face ``LlamaForCausalLM`` built from a ``LlamaConfig``, over 258 ids
(256 bytes, BOS=256, EOS=257), trained on the ``.py`` files of the CPython standard library
of the interpreter running this script (found with ``sysconfig``), so the corpus is on every
machine. Files are split by a hash of their relative path: about 3% are held out, never
trained on, and used for bits/byte and the draft/target agreement rates.

* target: 8 layers, hidden 320, 10 query heads over 2 key/value heads (GQA), MLP 864 (8.8M
  parameters, 17.5 MB in fp16); trained with next-byte cross-entropy.
* draft: 1 layer, hidden 192, 6 query heads over 2 key/value heads, MLP 512 (0.49M parameters; a
  forward costs about 0.09 of the target's at batch 1 on a CPU); trained on a mix of next-byte
  cross-entropy and distillation
  (KL(target || draft) on the target's full next-byte distribution), so that its argmax agrees
  with the target's as often as possible: that is what greedy speculative decoding accepts.

Weights are stored as fp16 safetensors with ``save_pretrained``; ``training.json`` and
``README.md`` beside them record the run. Deterministic for a given seed, step counts, thread
count and Python version (the stdlib is the corpus); ``--minutes`` is only a safety cap on each
model's training time, and a run it cuts short is marked ``"truncated": true``.

    python scripts/train_demo_pair.py                     # both, defaults (~35 + ~15 min on 2 cores)
    python scripts/train_demo_pair.py --which draft       # retrain the draft against the saved target
    python scripts/train_demo_pair.py --target-steps 20 --draft-steps 20 --out /tmp/w   # smoke test
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "specdec_kernels" / "demo" / "weights"

BOS_ID, EOS_ID, VOCAB_SIZE = 256, 257, 258
HELDOUT_PERCENT = 3
LN2 = math.log(2.0)


# ----------------------------------------------------------------------------------------------
# Corpus


def stdlib_files() -> tuple[Path, list[Path]]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for f in root.rglob("*.py"):
        rel = f.relative_to(root).parts
        if "site-packages" in rel or "dist-packages" in rel or "__pycache__" in rel:
            continue
        if f.is_file():
            files.append(f)
    files.sort(key=lambda f: f.relative_to(root).as_posix())
    return root, files


def is_heldout(rel: str) -> bool:
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 100 < HELDOUT_PERCENT


def load_corpus() -> dict:
    """Byte streams ``BOS file EOS BOS file EOS ...`` for the train and held-out files (int16)."""
    root, files = stdlib_files()
    parts = {"train": [], "heldout": []}
    counts = {"train": 0, "heldout": 0}
    for f in files:
        rel = f.relative_to(root).as_posix()
        data = f.read_bytes()
        if not data:
            continue
        split = "heldout" if is_heldout(rel) else "train"
        t = torch.empty(len(data) + 2, dtype=torch.int16)
        t[0] = BOS_ID
        t[1:-1] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int16)
        t[-1] = EOS_ID
        parts[split].append(t)
        counts[split] += 1
    out = {k: torch.cat(v) for k, v in parts.items()}
    out["root"] = str(root)
    out["files"] = counts
    return out


def batch_iter(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator):
    """Random windows of ``seq_len + 1`` ids from the stream, forever."""
    n = stream.numel() - seq_len - 1
    offs = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(0, n, (batch,), generator=gen)
        yield stream[starts[:, None] + offs].long()


def eval_windows(stream: torch.Tensor, seq_len: int, max_windows: int) -> torch.Tensor:
    """Disjoint, evenly spaced held-out windows of ``seq_len + 1`` ids (deterministic)."""
    total = (stream.numel() - 1) // seq_len
    count = min(total, max_windows)
    stride = total // count
    idx = torch.arange(count) * stride * seq_len
    return stream[idx[:, None] + torch.arange(seq_len + 1)].long()


# ----------------------------------------------------------------------------------------------
# Models


def make_config(kind: str, seq_len: int):
    from transformers import LlamaConfig

    shapes = {
        # Deep target, one-layer draft: on a CPU at batch 1 a forward's cost grows with the number of
        # layers (per-layer overhead) more than with width, so the draft costs ~0.09 of a target forward.
        "target": dict(
            hidden_size=320, intermediate_size=864, num_hidden_layers=8, num_attention_heads=10, num_key_value_heads=2
        ),
        "draft": dict(
            hidden_size=192, intermediate_size=512, num_hidden_layers=1, num_attention_heads=6, num_key_value_heads=2
        ),
    }[kind]
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=EOS_ID,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        initializer_range=0.02,
        use_cache=True,
        **shapes,
    )


def count_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress))))


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int = 32) -> dict:
    """Held-out cross-entropy in bits per byte (every next-id position) and top-1 accuracy."""
    model.eval()
    nll, correct, count = 0.0, 0, 0
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        logits = model(input_ids=w[:, :-1]).logits.float()
        labels = w[:, 1:]
        nll += F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), labels.reshape(-1), reduction="sum").item()
        correct += (logits.argmax(-1) == labels).sum().item()
        count += labels.numel()
    model.train()
    return {"bits_per_byte": nll / count / LN2, "top1_accuracy": correct / count, "positions": count}


@torch.no_grad()
def agreement(target, draft, windows: torch.Tensor, batch: int = 32) -> dict:
    """Draft vs target on held-out text: greedy argmax agreement, and E[sum_v min(p, q)] at T=1.

    The first is the per-position acceptance rate of greedy speculative decoding (the draft's
    proposal is accepted iff it is the target's argmax); the second is the per-position
    acceptance probability of exact speculative sampling at temperature 1.
    """
    target.eval()
    draft.eval()
    agree, overlap, count = 0, 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i : i + batch, :-1]
        lt = target(input_ids=x).logits.float()
        ld = draft(input_ids=x).logits.float()
        agree += (lt.argmax(-1) == ld.argmax(-1)).sum().item()
        overlap += torch.minimum(lt.softmax(-1), ld.softmax(-1)).sum(-1).sum().item()
        count += x.numel()
    return {"greedy_agreement": agree / count, "sampling_acceptance_t1": overlap / count, "positions": count}


def save_model(model, path: Path) -> int:
    from transformers import GenerationConfig

    path.mkdir(parents=True, exist_ok=True)
    half = model.to(torch.float16)
    half.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=EOS_ID, do_sample=False
    )
    half.save_pretrained(str(path), safe_serialization=True)
    model.to(torch.float32)
    return (path / "model.safetensors").stat().st_size


def load_saved(path: Path):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(path), local_files_only=True, dtype=torch.float32).eval()


# ----------------------------------------------------------------------------------------------
# Training


def train(kind: str, args, corpus: dict, teacher=None) -> tuple[object, dict]:
    from transformers import LlamaForCausalLM

    steps = args.target_steps if kind == "target" else args.draft_steps
    peak_lr = args.target_lr if kind == "target" else args.draft_lr
    seed = args.seed + (0 if kind == "target" else 1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(make_config(kind, args.seq_len)).float()
    model.config._attn_implementation = "sdpa"
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=peak_lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(seed)
    batches = batch_iter(corpus["train"], args.batch, args.seq_len, gen)
    alpha = 1.0 if teacher is None else args.ce_weight
    print(
        f"[{kind}] {count_params(model) / 1e6:.3f}M params, {steps} steps of {args.batch}x{args.seq_len} bytes, "
        f"peak lr {peak_lr}" + ("" if teacher is None else f", loss = {alpha} CE + {1 - alpha} KL(target||draft)"),
        flush=True,
    )
    t0 = time.monotonic()
    truncated = False
    done = 0
    smooth = None
    for step in range(steps):
        if time.monotonic() - t0 > args.minutes * 60:
            truncated = True
            print(f"[{kind}] time cap of {args.minutes} min reached after {step} steps", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, args.warmup)
        w = next(batches)
        x, y = w[:, :-1], w[:, 1:]
        logits = model(input_ids=x).logits.float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), y.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                t_logp = teacher(input_ids=x).logits.float().log_softmax(-1)
            kl = F.kl_div(logits.log_softmax(-1), t_logp, log_target=True, reduction="none").sum(-1).mean()
            loss = alpha * ce + (1 - alpha) * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        done = step + 1
        bpb = ce.item() / LN2
        smooth = bpb if smooth is None else 0.95 * smooth + 0.05 * bpb
        if done % args.log_every == 0 or done == steps:
            el = time.monotonic() - t0
            print(
                f"[{kind}] step {done}/{steps}  train bits/byte {smooth:.3f}  lr {opt.param_groups[0]['lr']:.2e}  "
                f"{el:.0f}s ({el / done:.2f}s/step)",
                flush=True,
            )
    elapsed = time.monotonic() - t0
    model.eval()
    info = {
        "params": count_params(model),
        "config": {
            k: getattr(model.config, k)
            for k in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
        "steps": done,
        "steps_planned": steps,
        "truncated": truncated,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "bytes_seen": done * args.batch * args.seq_len,
        "peak_lr": peak_lr,
        "seed": seed,
        "train_seconds": round(elapsed, 1),
        "final_train_bits_per_byte_smoothed": round(smooth, 4) if smooth is not None else None,
    }
    if teacher is not None:
        info["loss"] = f"{alpha} * cross-entropy + {1 - alpha} * KL(target || draft)"
    else:
        info["loss"] = "cross-entropy"
    return model, info


def write_readme(out: Path, record: dict) -> None:
    t, d = record["models"]["target"], record["models"]["draft"]
    a = record.get("agreement", {})

    def shape(m):
        c = m["config"]
        return (
            f"{c['num_hidden_layers']} layers, hidden {c['hidden_size']}, MLP {c['intermediate_size']}, "
            f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads"
        )

    lines = [
        "# Embedded demo pair",
        "",
        "Two byte-level `LlamaForCausalLM` models for `specdec demo`, written by `scripts/train_demo_pair.py`"
        " (this file and `training.json` are generated by it; do not edit by hand).",
        "",
        f"- Vocabulary: {VOCAB_SIZE} ids = 256 bytes + BOS ({BOS_ID}) + EOS ({EOS_ID}, also padding);"
        " `specdec_kernels.demo.ByteTokenizer`.",
        "- Storage: fp16 safetensors (`save_pretrained`); `load_demo_pair()` casts to float32 by default.",
        f"- Corpus: the `.py` files of the CPython {record['corpus']['python']} standard library"
        f" ({record['corpus']['train_files']} train files, {record['corpus']['train_bytes'] / 1e6:.1f} MB;"
        f" {record['corpus']['heldout_files']} held-out files, {record['corpus']['heldout_bytes'] / 1e6:.2f} MB,"
        f" chosen by sha1(relative path) % 100 < {HELDOUT_PERCENT}).",
        f"- Evaluation: {record['eval']['windows']} evenly spaced held-out windows of {record['eval']['seq_len']}"
        " bytes (every next-id position counted).",
        "",
        "| model | shape | params | file | steps x batch x seq | train time | held-out bits/byte | held-out top-1 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, m in (("target", t), ("draft", d)):
        lines.append(
            f"| {name} | {shape(m)} | {m['params'] / 1e6:.2f} M | {m['file_bytes'] / 1e6:.2f} MB |"
            f" {m['steps']} x {m['batch']} x {m['seq_len']} | {m['train_seconds'] / 60:.1f} min |"
            f" {m['heldout']['bits_per_byte']:.3f} | {m['heldout']['top1_accuracy']:.3f} |"
        )
    lines += [
        "",
        f"Draft loss: {d['loss']}.",
        "",
    ]
    if a:
        lines += [
            "Draft vs target on the held-out windows:",
            "",
            f"- greedy agreement (argmax equal; the per-position acceptance rate of greedy speculative decoding):"
            f" **{a['greedy_agreement']:.3f}**",
            f"- E[sum_v min(p, q)] at temperature 1 (per-position acceptance probability of speculative sampling):"
            f" **{a['sampling_acceptance_t1']:.3f}**",
            "",
        ]
    lines += [
        f"Trained on {record['machine']} with {record['threads']} threads, torch {record['torch']},"
        f" transformers {record['transformers']}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--which", choices=["both", "target", "draft"], default="both")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--target-steps", type=int, default=500)
    p.add_argument("--draft-steps", type=int, default=600)
    p.add_argument("--target-lr", type=float, default=2.5e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--ce-weight",
        type=float,
        default=0.3,
        help="draft loss = w * CE + (1 - w) * KL(target || draft); 1 disables distillation",
    )
    p.add_argument("--minutes", type=float, default=40.0, help="safety cap on each model's training time")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=96)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args(argv)

    import transformers

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    t0 = time.monotonic()
    corpus = load_corpus()
    print(
        f"corpus: {corpus['root']}: {corpus['files']['train']} train files ({corpus['train'].numel() / 1e6:.1f} MB), "
        f"{corpus['files']['heldout']} held-out files ({corpus['heldout'].numel() / 1e6:.2f} MB), "
        f"loaded in {time.monotonic() - t0:.1f}s",
        flush=True,
    )
    windows = eval_windows(corpus["heldout"], args.seq_len, args.eval_windows)

    record_path = out / "training.json"
    record = json.loads(record_path.read_text()) if record_path.is_file() else {}
    record.setdefault("models", {})
    record.update(
        {
            "generated_by": "scripts/train_demo_pair.py",
            "vocab": {"size": VOCAB_SIZE, "bos": BOS_ID, "eos": EOS_ID, "pad": EOS_ID, "bytes": "0..255"},
            "storage_dtype": "float16",
            "corpus": {
                "source": "CPython standard library *.py (sysconfig stdlib path, site-packages excluded)",
                "python": platform.python_version(),
                "train_files": corpus["files"]["train"],
                "train_bytes": corpus["train"].numel(),
                "heldout_files": corpus["files"]["heldout"],
                "heldout_bytes": corpus["heldout"].numel(),
                "heldout_rule": f"int(sha1(relative_path), 16) % 100 < {HELDOUT_PERCENT}",
            },
            "eval": {"windows": windows.shape[0], "seq_len": args.seq_len},
            "threads": args.threads,
            "machine": f"{platform.machine()} {platform.processor() or platform.system()}",
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        }
    )

    if args.which in ("both", "target"):
        target, info = train("target", args, corpus)
        info["file_bytes"] = save_model(target, out / "target")
        target = load_saved(out / "target")  # evaluate what ships (fp16 weights)
        info["heldout"] = evaluate(target, windows)
        print(f"[target] held-out: {info['heldout']}", flush=True)
        record["models"]["target"] = info
    else:
        target = load_saved(out / "target")

    if args.which in ("both", "draft"):
        teacher = target if args.ce_weight < 1.0 else None
        draft, info = train("draft", args, corpus, teacher=teacher)
        info["file_bytes"] = save_model(draft, out / "draft")
        draft = load_saved(out / "draft")
        info["heldout"] = evaluate(draft, windows)
        print(f"[draft] held-out: {info['heldout']}", flush=True)
        record["models"]["draft"] = info

    if "target" in record["models"] and "draft" in record["models"]:
        draft = load_saved(out / "draft")
        record["agreement"] = agreement(target, draft, windows)
        print(f"draft vs target on held-out: {record['agreement']}", flush=True)
        write_readme(out, record)
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    total = sum(
        (out / n / "model.safetensors").stat().st_size
        for n in ("target", "draft")
        if (out / n / "model.safetensors").is_file()
    )
    print(f"wrote {out}: weights {total / 1e6:.2f} MB in all; total time {(time.monotonic() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
