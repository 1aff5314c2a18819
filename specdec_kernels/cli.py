"""Command line: ``specdec demo`` shows the fused verification kernels against theory.

Until the Hugging Face driver lands, the demo draws random target/draft distributions with a
chosen closeness, samples genuine drafts from the draft, verifies them with ``sk.verify`` and
``sk.verify_multi`` (K-SEQ), and prints measured acceptance next to its theoretical value:
  first-draft acceptance  alpha = sum_x min(p(x), q(x))
  tokens per step         E = sum_{k=0..G} prod_{i<k} alpha_i   (chain; exact for sampled drafts)
  K-SEQ acceptance        1 - (1 - beta(rho*))^K
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def _device(choice: str) -> str:
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


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
    alpha = torch.minimum(p[:, :G], q).sum(-1)  # [B, G]
    expected = torch.cumprod(torch.cat([torch.ones(B, 1), alpha], 1), 1).sum(1).mean()

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
    kseq_alpha = _kseq_theory(p[:, 0], q[:, 0], K).mean()
    return {
        "setting": name,
        "alpha theory": float(alpha[:, 0].mean()),
        "alpha measured": float((accepted >= 1).float().mean()),
        "tokens/step theory": float(expected),
        "tokens/step measured": float((accepted + 1).float().mean()),
        f"K={K} accept theory": float(kseq_alpha),
        f"K={K} accept measured": float((multi_accepted >= 1).float().mean()),
        f"K={K} tokens/step": float((multi_accepted + 1).float().mean()),
        "verify ms": chain_s * 1e3,
        "verify_multi ms": multi_s * 1e3,
    }


def _print_table(rows: list[dict]) -> None:
    cols = list(rows[0])
    cells = [[c] + [f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for r in rows] for c in cols]
    widths = [max(len(x) for x in col) for col in cells]
    for i in range(len(rows) + 1):
        print("  ".join(col[i].rjust(w) for col, w in zip(cells, widths)))


def demo(args: argparse.Namespace) -> int:
    device = _device(args.device)
    backend = "Triton on CUDA" if device == "cuda" else "Triton interpreter on CPU (slow but exact)"
    B = args.batch or (8192 if device == "cuda" else 512)
    V = args.vocab or (32000 if device == "cuda" else 64)
    G, K = args.num_draft_tokens, args.num_drafts
    print(f"specdec demo: B={B} requests, G={G} drafts, V={V}, K={K} chains for K-SEQ, temperature={args.temperature}")
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
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specdec", description="specdec_kernels command line")
    sub = parser.add_subparsers(dest="command")
    p_demo = sub.add_parser("demo", help="verification kernels on random distributions vs theory")
    p_demo.add_argument("--batch", type=int, default=None)
    p_demo.add_argument("--vocab", type=int, default=None)
    p_demo.add_argument("--num-draft-tokens", type=int, default=4)
    p_demo.add_argument("--num-drafts", type=int, default=4)
    p_demo.add_argument("--temperature", type=float, default=1.0)
    p_demo.add_argument("--seed", type=int, default=0)
    p_demo.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    if args.command == "demo":
        return demo(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    sys.exit(main())
