"""``specdec verify-demo``: the verification kernels alone on random distributions against theory.

It draws random target/draft distributions with a chosen closeness, samples genuine drafts from the
draft, verifies them with ``sk.verify`` and ``sk.verify_multi`` (K-SEQ), and prints measured
acceptance next to its theoretical value:

  first-draft acceptance  alpha = sum_x min(p(x), q(x))
  tokens per step         E = sum_{k=0..G} prod_{i<k} alpha_i   (chain; exact for sampled drafts)
  K-SEQ acceptance        1 - (1 - beta(rho*))^K

each with the standard error the theory gives its mean over the batch (not the sample's, which is
0 when every draft passed), so ``--batch`` must be at least 100.
"""

from __future__ import annotations

import argparse
import time

import torch

from ._common import at_least, check_sampled_temperature, driver_checks, print_table, resolve_device

Z_PASS = 4.0  # measured vs theory within 4 standard errors (a false FAIL ~ 1 in 16,000)
# fewer requests make the measured means too coarse (a handful of 0/1 outcomes) for the normal
# approximation behind |z| < 4; the batch-1 default of a laptop would test nothing
MIN_VERIFY_BATCH = 100


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("verify-demo", help="verification kernels on random distributions vs theory")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--vocab", type=int, default=None)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    return p


def validate(args: argparse.Namespace) -> None:
    """The demo's own limits; the tree-size limit is ``sk.verify_multi``'s (reported by the run)."""
    resolve_device(args.device)
    if args.batch is not None:
        at_least("--batch", args.batch, MIN_VERIFY_BATCH, " (fewer requests are too few to test against theory)")
    if args.vocab is not None:
        at_least("--vocab", args.vocab, 2)
    at_least("--num-draft-tokens", args.num_draft_tokens, 1, " (the demo verifies drafts)")
    at_least("--num-drafts", args.num_drafts, 1)
    check_sampled_temperature(args.temperature)


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
    with driver_checks({}, default="--num-drafts x --num-draft-tokens"):  # the op's tree-size limit
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


def verify_demo(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
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
    print_table(rows)

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
