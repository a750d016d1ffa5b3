"""``python benchmarks/pdl_probe.py`` (CUDA sm_90+; ``OUT`` = where the JSON goes): what
programmatic dependent launch (PDL, ``griddepcontrol``) would save per launch in a CUDA graph, on a
chain of 100 dependent copy kernels of three sizes (1 program, one per SM, 528 programs over 32
MB), each result checked. A measurement for deciding whether the product's kernels should take
PDL, not a product path (``docs/performance.md``, 2026-12-04)."""
import json
import os
import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait, gdc_launch_dependents


@triton.jit
def chain(src, dst, n, ITERS: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
          BLOCK: tl.constexpr):
    if PDL:
        if EARLY:
            gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    for it in range(ITERS):
        offs = (pid + it * nprog) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(src + offs, mask=m)
        tl.store(dst + offs, x + 1.0, mask=m)
    if PDL:
        if not EARLY:
            gdc_launch_dependents()


def run_chain(bufs, n, grid, iters, L, pdl, early, torch_every=0):
    for i in range(L):
        a, b = bufs[i % 2], bufs[(i + 1) % 2]
        if torch_every and i % torch_every == torch_every - 1:
            torch.add(a, 1.0, out=b)
        else:
            chain[(grid,)](a, b, n, ITERS=iters, PDL=pdl, EARLY=early, BLOCK=1024,
                           num_warps=4, launch_pdl=pdl)


def time_graph(fn, reps=20):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(); fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        fn()
    g.replay(); torch.cuda.synchronize()
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    ev[0].record()
    for i in range(reps):
        g.replay(); ev[i + 1].record()
    torch.cuda.synchronize()
    ts = sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))
    return g, ts[reps // 2] * 1e3


def main():
    dev = torch.device("cuda")
    L = 100
    rows = []
    for n, grid, iters in ((1024, 1, 1), (132 * 1024, 132, 1), (8 << 20, 528, 16)):
        for mode in ("off", "pdl_early", "pdl_late", "pdl_early_torch5"):
            pdl = mode != "off"
            early = "early" in mode
            te = 5 if "torch" in mode else 0
            bufs = [torch.zeros(n, device=dev), torch.zeros(n, device=dev)]
            fn = lambda: run_chain(bufs, n, grid, iters, L, pdl, early, te)
            g, us = time_graph(fn)
            bufs[0].zero_(); bufs[1].zero_(); torch.cuda.synchronize()
            g.replay(); torch.cuda.synchronize()
            # after L steps from zeros: bufs[L % 2] holds L (each step adds 1 to the other buffer)
            want = float(L)
            got = bufs[L % 2]
            ok = bool((got == want).all())
            rows.append(dict(n=n, grid=grid, mode=mode, us_per_kernel=us / L, correct=ok))
            print(f"n={n:>9} grid={grid:4d} {mode:18s} {us / L:7.2f} us/kernel  correct={ok}", flush=True)
    out = os.environ.get("OUT", ".")
    json.dump(rows, open(os.path.join(out, "pdl_probe.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
