"""Where sk.verify's host time goes on a GPU: enqueue time per call (no synchronisation), synced
time per call, and the cProfile top functions by own time. Usage (a CUDA machine):

    python scripts/host_overhead.py [--B 1] [--G 4] [--V 151936] [--mode stochastic|greedy|topk_topp]
"""

import argparse
import cProfile
import pstats
import time

import torch

import specdec_kernels as sk


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--G", type=int, default=4)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument("--mode", default="stochastic", choices=["stochastic", "greedy", "topk_topp"])
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--top", type=int, default=30)
    a = p.parse_args()
    dev = "cuda"
    gen = torch.Generator(device=dev).manual_seed(0)
    tl_ = torch.randn(a.B, a.G + 1, a.V, device=dev, generator=gen).bfloat16()
    dl = torch.randn(a.B, a.G, a.V, device=dev, generator=gen).bfloat16()
    toks = torch.randint(0, a.V, (a.B, a.G), device=dev, generator=gen)
    seeds = torch.arange(a.B, device=dev, dtype=torch.int64)
    kw = dict(seed=seeds, validate=False, backend="triton")
    if a.mode == "greedy":
        kw.update(temperature=0.0)
        fn = lambda: sk.verify(tl_, toks, None, **kw)  # noqa: E731
    else:
        if a.mode == "topk_topp":
            kw.update(top_k=50, top_p=0.9)
        fn = lambda: sk.verify(tl_, toks, dl, **kw)  # noqa: E731
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(a.calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    synced = []
    for _ in range(20):
        s = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        synced.append(time.perf_counter() - s)
    synced.sort()
    print(f"# B={a.B} G={a.G} V={a.V} mode={a.mode} calls={a.calls}")
    print(
        f"enqueue_us_per_call {1e6 * (t1 - t0) / a.calls:.1f}  drained_us_per_call {1e6 * (t2 - t0) / a.calls:.1f}"
        f"  synced_median_us {1e6 * synced[len(synced) // 2]:.1f}"
    )
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(a.top)
    stats.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
