"""Each kernel's GPU time per sk.verify call (torch.profiler), to find the launch that a static
estimate misses. Usage (a CUDA machine; run_gpu.sh's `profile` stage):

    python scripts/kernel_profile.py [--B 1 64] [--G 4] [--V 151936] [--modes greedy sampled topk_topp]

Found on an H200 (2026-11-27, c23d175): the chunk merge's serial loop at B = 1 (42 of 58 us) and
the row-stats launches of top-k + top-p at B = 64 (6 ms a call, 40x their estimate)."""

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import specdec_kernels as sk

MODES = {
    "greedy": dict(temperature=0.0),
    "sampled": dict(temperature=1.0),
    "topk_topp": dict(temperature=0.7, top_k=50, top_p=0.9),
}


def kernel_times(fn, calls: int) -> list[tuple[str, float, int]]:
    """(kernel, us per call, launches per call) of `calls` calls after a warm-up, slowest first."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us > 0 and e.count >= calls:
            rows.append((e.key, us / calls, e.count // calls))
    return sorted(rows, key=lambda r: -r[1])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, nargs="+", default=[1, 64])
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES))
    p.add_argument("--calls", type=int, default=5)
    a = p.parse_args()
    dev = "cuda"
    for B in a.B:
        g = torch.Generator(device=dev).manual_seed(0)
        target = torch.randn(B, a.G + 1, a.V, device=dev, generator=g).mul_(3).bfloat16()
        draft = (target[:, : a.G].float() + torch.randn(B, a.G, a.V, device=dev, generator=g)).bfloat16()
        tokens = torch.randint(0, a.V, (B, a.G), device=dev, generator=g)
        seeds = torch.arange(B, device=dev)
        for mode in a.modes:
            kw = dict(MODES[mode], seed=seeds, validate=False, backend="triton")
            drafts = None if mode == "greedy" else draft
            rows = kernel_times(lambda: sk.verify(target, tokens, drafts, **kw), a.calls)  # noqa: B023
            total = sum(us for _, us, _ in rows)
            print(f"# B={B} G={a.G} V={a.V} {mode}: {total:.1f} us of kernels per call")
            for name, us, n in rows:
                print(f"  {us:9.1f} us  x{n}  {name}")


if __name__ == "__main__":
    main()
