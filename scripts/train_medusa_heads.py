#!/usr/bin/env python
"""Train Medusa heads for the embedded demo target (``specdec_kernels/demo/weights/medusa``).

The target is frozen; only the heads train, on the target's last hidden state (what its LM head
reads) over the same corpus as ``scripts/train_demo_pair.py`` (the CPython standard library's
``.py`` files, same held-out split). Head k at position i learns the token at i + 1 + k with
0.3 * cross-entropy + 0.7 * KL(target || head), the teacher being the target's own next-token
distribution at position i + k (computed in the same frozen forward): what speculative
verification accepts. Each head is one residual SiLU block plus a linear layer to the 258 ids,
initialised from the target's LM head. A few minutes on 2 CPU threads; stored as fp16 safetensors.

    python scripts/train_medusa_heads.py                      # defaults (<= 9 min on 2 threads)
    python scripts/train_medusa_heads.py --steps 5 --out /tmp/medusa   # smoke test

Writes ``config.json``, ``model.safetensors``, ``training.json`` and ``README.md`` (held-out top-1
accuracy of every head, against the true token and against the target's argmax).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_demo_pair import VOCAB_SIZE, batch_iter, eval_windows, load_corpus, load_saved, lr_at  # noqa: E402

from specdec_kernels.hf.medusa import MedusaHeads  # noqa: E402

WEIGHTS = REPO / "specdec_kernels" / "demo" / "weights"
DEFAULT_OUT = WEIGHTS / "medusa"


@torch.no_grad()
def target_states(target, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(last hidden state [B, T, H] as the LM head reads it, target logits [B, T, V])."""
    hidden = target.model(input_ids=ids).last_hidden_state
    return hidden, target.lm_head(hidden).float()


def head_loss(heads, hidden, t_logits, labels, ce_weight: float, decay: float):
    """Sum over heads k of decay^(k-1) * (w CE + (1 - w) KL(target || head)); head k at position i
    predicts labels[:, i + k] (= the token i + 1 + k), taught by the target's row i + k."""
    logits = heads(hidden).float()  # [B, T, K, V]
    T = hidden.shape[1]
    total, parts = 0.0, []
    for k in range(1, heads.num_heads + 1):
        pred = logits[:, : T - k, k - 1].reshape(-1, VOCAB_SIZE)
        ce = F.cross_entropy(pred, labels[:, k:].reshape(-1))
        teacher = t_logits[:, k:].reshape(-1, VOCAB_SIZE).log_softmax(-1)
        kl = F.kl_div(pred.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1).mean()
        total = total + decay ** (k - 1) * (ce_weight * ce + (1 - ce_weight) * kl)
        parts.append(ce.item())
    return total, parts


@torch.no_grad()
def evaluate(target, heads, windows: torch.Tensor, batch: int = 16) -> list[dict]:
    """Per head on held-out windows: top-1 accuracy against the true token, agreement with the
    target's argmax (greedy acceptance of a one-node chain), and E[sum min(p, q)] at T = 1."""
    K = heads.num_heads
    acc = torch.zeros(K, dtype=torch.float64)
    agree = torch.zeros(K, dtype=torch.float64)
    overlap = torch.zeros(K, dtype=torch.float64)
    top3 = torch.zeros(K, dtype=torch.float64)
    count = torch.zeros(K, dtype=torch.float64)
    for i in range(0, windows.shape[0], batch):
        w = windows[i : i + batch]
        x, y = w[:, :-1], w[:, 1:]
        hidden, t_logits = target_states(target, x)
        logits = heads(hidden).float()
        T = x.shape[1]
        for k in range(1, K + 1):
            pred = logits[:, : T - k, k - 1]
            truth = y[:, k:]
            teacher = t_logits[:, k:]
            acc[k - 1] += (pred.argmax(-1) == truth).sum().item()
            top3[k - 1] += (pred.topk(3, dim=-1).indices == truth[..., None]).any(-1).sum().item()
            agree[k - 1] += (pred.argmax(-1) == teacher.argmax(-1)).sum().item()
            overlap[k - 1] += torch.minimum(pred.softmax(-1), teacher.softmax(-1)).sum(-1).sum().item()
            count[k - 1] += truth.numel()
    return [
        {
            "head": k + 1,
            "predicts": f"token t+{k + 2} from the hidden state at t",
            "top1_accuracy": acc[k].item() / count[k].item(),
            "top3_accuracy": top3[k].item() / count[k].item(),
            "target_argmax_agreement": agree[k].item() / count[k].item(),
            "sampling_overlap_t1": overlap[k].item() / count[k].item(),
            "positions": int(count[k].item()),
        }
        for k in range(K)
    ]


def write_readme(out: Path, record: dict) -> None:
    c = record["config"]
    lines = [
        "# Medusa heads for the embedded demo target",
        "",
        "Written by `scripts/train_medusa_heads.py` (this file and `training.json` are generated;"
        " do not edit by hand).",
        "Load with `specdec_kernels.demo.load_medusa_heads()`; use with"
        ' `speculative_generate(target, None, ..., drafter="medusa", medusa_heads=heads)`.',
        "",
        f"- {c['num_heads']} heads on the frozen target's last hidden state (size {c['hidden_size']}), each"
        f" {c['num_layers']} residual SiLU block(s) + a linear layer to {c['vocab_size']} ids;"
        f" {record['params'] / 1e6:.2f} M parameters, {record['file_bytes'] / 1e6:.2f} MB in fp16.",
        f"- Training: {record['steps']} head updates on {record['batch']} x {record['seq_len']} bytes of the demo"
        f" corpus (each frozen target batch used for {record['updates_per_target_batch']} updates),"
        f" loss {record['loss']}, {record['train_seconds'] / 60:.1f} min on {record['threads']} CPU threads.",
        f"- Held-out: {record['eval']['windows']} windows of {record['eval']['seq_len']} bytes"
        " (the demo pair's held-out files).",
        "",
        "| head | predicts | top-1 | top-3 | = target argmax | sum min(p, q) at T=1 |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for h in record["heldout"]:
        lines.append(
            f"| {h['head']} | {h['predicts']} | {h['top1_accuracy']:.3f} | {h['top3_accuracy']:.3f} |"
            f" {h['target_argmax_agreement']:.3f} | {h['sampling_overlap_t1']:.3f} |"
        )
    lines += [
        "",
        '"= target argmax" compares head k with the target\'s own argmax at the position it predicts (what a'
        " greedy tree accepts when the path to it was accepted).",
        "",
        f"Trained on {record['machine']}, torch {record['torch']}, transformers {record['transformers']}.",
        "",
    ]
    (out / "README.md").write_text("\n".join(lines))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--target", type=Path, default=WEIGHTS / "target")
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-layers", type=int, default=1)
    p.add_argument("--steps", type=int, default=500, help="head updates")
    p.add_argument("--reuse", type=int, default=2, help="head updates per frozen target forward (its states are kept)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ce-weight", type=float, default=0.3)
    p.add_argument("--head-decay", type=float, default=0.8, help="loss weight of head k: decay^(k-1)")
    p.add_argument("--minutes", type=float, default=8.0, help="cap on the training time (the whole run stays < 10 min)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--log-every", type=int, default=25)
    args = p.parse_args(argv)

    import transformers

    torch.set_num_threads(args.threads)
    t0 = time.monotonic()
    corpus = load_corpus()
    windows = eval_windows(corpus["heldout"], args.seq_len, args.eval_windows)
    target = load_saved(args.target)
    for param in target.parameters():
        param.requires_grad_(False)
    torch.manual_seed(args.seed)
    heads = MedusaHeads(target.config.hidden_size, VOCAB_SIZE, args.num_heads, args.num_layers).float()
    heads.init_from_lm_head(target.lm_head)
    heads.train()
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    batches = batch_iter(corpus["train"], args.batch, args.seq_len, gen)
    params = sum(x.numel() for x in heads.parameters())
    print(
        f"medusa: {args.num_heads} heads, {params / 1e6:.2f}M params, {args.steps} steps of {args.batch}x{args.seq_len}"
    )
    start, done, smooth, truncated = time.monotonic(), 0, None, False
    for step in range(args.steps):
        if time.monotonic() - start > args.minutes * 60:
            truncated = True
            print(f"time cap of {args.minutes} min reached after {step} steps", flush=True)
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        if step % args.reuse == 0:  # the frozen target's forward dominates the cost: reuse its states
            w = next(batches)
            x, y = w[:, :-1], w[:, 1:]
            hidden, t_logits = target_states(target, x)
        loss, ces = head_loss(heads, hidden, t_logits, y, args.ce_weight, args.head_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        done = step + 1
        bpb = [c / math.log(2) for c in ces]
        smooth = bpb if smooth is None else [0.9 * s + 0.1 * b for s, b in zip(smooth, bpb, strict=True)]
        if done % args.log_every == 0 or done == args.steps:
            el = time.monotonic() - start
            heads_bpb = " ".join(f"{s:.2f}" for s in smooth)
            print(
                f"step {done}/{args.steps}  head CE bits/byte {heads_bpb}  {el:.0f}s ({el / done:.2f}s/step)",
                flush=True,
            )
    train_seconds = time.monotonic() - start
    heads.eval()
    out: Path = args.out
    file_bytes = heads.save_pretrained(out, dtype=torch.float16)
    shipped = MedusaHeads.from_pretrained(out)  # evaluate what ships (fp16 weights)
    heldout = evaluate(target, shipped, windows)
    for h in heldout:
        print(
            f"head {h['head']}: top-1 {h['top1_accuracy']:.3f}  top-3 {h['top3_accuracy']:.3f}  "
            f"= target argmax {h['target_argmax_agreement']:.3f}  overlap {h['sampling_overlap_t1']:.3f}"
        )
    record = {
        "generated_by": "scripts/train_medusa_heads.py",
        "config": shipped.config,
        "params": params,
        "file_bytes": file_bytes,
        "storage_dtype": "float16",
        "steps": done,
        "steps_planned": args.steps,
        "updates_per_target_batch": args.reuse,
        "truncated": truncated,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "peak_lr": args.lr,
        "seed": args.seed,
        "loss": f"sum_k {args.head_decay}^(k-1) ({args.ce_weight} CE + {1 - args.ce_weight} KL(target || head k))",
        "train_seconds": round(train_seconds, 1),
        "heldout": heldout,
        "eval": {"windows": windows.shape[0], "seq_len": args.seq_len},
        "threads": args.threads,
        "machine": f"{platform.machine()} {platform.system()}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    write_readme(out, record)
    print(f"wrote {out} ({file_bytes / 1e6:.2f} MB); total {(time.monotonic() - t0) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
