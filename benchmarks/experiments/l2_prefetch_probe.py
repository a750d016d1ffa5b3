# SPDX-License-Identifier: Apache-2.0
"""``python -m benchmarks.experiments.l2_prefetch_probe`` (CUDA sm_90+; ``OUT`` = where the JSON goes).

Should a decode GEMM's weight be read into L2 while the small kernels before it run?

At batch 1 a decode layer spends about 17 us of its 66 us in small kernels that hardly use HBM
(norms, rope, the cache insert, the attention's combine), and 43 us in FP8 GEMMs streaming 107 MB
of weights at ~57% of the HBM rate (``docs/performance.md``, 2026-12-04). If the next GEMM's weight
went into L2 during the small kernels, the GEMM would read part of it from L2.

The probe times, in a CUDA graph, the product's W8A8 GEMM (``ops.fp8_block_linear``, ``quantize_x``)
at the wq_b shape (N = 32,768, K = 1,024: 33.5 MB of e4m3). Before it run ``n_small`` of the
product's ``rms_norm`` on one 4,096-wide row (~2 us each). The GEMM runs:

* ``base``: with nothing read ahead;
* ``bulk``: after a side-stream kernel that issues ``cp.async.bulk.prefetch.L2`` over the weight,
  1 MiB per program (the prefetch is fire-and-forget: the kernel ends at once);
* ``load``: after a side-stream kernel that reads the weight with ``evict_last`` and keeps
  nothing.

* ``pdl N``: the product's own read-ahead (``VLLM_DSV4_HW_WEIGHT_PREFETCH``): each GEMM program
  asks L2 for the first N bytes of its weight rows before its PDL wait, so they stream while
  the kernel before it runs (the GEMM's ``prefetch`` knob; ``base`` is ``pdl 0``).

Four weight copies rotate (134 MB > the 50 MB L2), so each GEMM starts cold. Every variant's
output is compared with ``base``'s, bit for bit. This is a measurement for deciding whether the
product should read ahead, not a product path.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

from benchmarks.sweep_common import graph_us

N, K = 32768, 1024
COPIES = 4
CHUNK = 1 << 20


@triton.jit
def _bulk_prefetch_kernel(ptr, n_bytes, CHUNK: tl.constexpr):
    off = tl.program_id(0).to(tl.int64) * CHUNK
    p = ptr + off + tl.zeros([1], dtype=tl.int64)
    size = (tl.minimum(n_bytes - off, CHUNK) + tl.zeros([1], dtype=tl.int64)).to(tl.int32)
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
        "=r,l,r",
        [p, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _load_kernel(ptr, n_words, sink_ptr, flag, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for it in range(ITERS):
        offs = (pid.to(tl.int64) * ITERS + it) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(ptr + offs, mask=offs < n_words, other=0, eviction_policy="evict_last")
    if flag != 0:  # never at run time (flag = 0), unknown to the compiler: the loads stay
        tl.store(sink_ptr + tl.arange(0, BLOCK), acc)


def main() -> None:
    from benchmarks.vllm_state import single_rank
    from vllm_dsv4_hw import ops
    from vllm_dsv4_hw.ops.triton.linear.fp8_block_linear import (
        fp8_block_linear as tri_linear,  # the knobs
    )

    single_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=dev).manual_seed(0)
    ws = [
        torch.randn(N, K, device=dev, generator=gen).clamp(-400, 400).to(torch.float8_e4m3fn)
        for _ in range(COPIES)
    ]
    sc = torch.full((N // 128, K // 128), 120, dtype=torch.uint8, device=dev)
    x = torch.randn(1, K, device=dev, generator=gen).to(torch.bfloat16)
    row = torch.randn(1, 4096, device=dev, generator=gen).to(torch.bfloat16)
    nw = torch.ones(4096, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(1024, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    outs = [torch.empty(1, N, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
    n_bytes = N * K

    def read_ahead(kind, w):
        if kind == "bulk":
            _bulk_prefetch_kernel[(triton.cdiv(n_bytes, CHUNK),)](
                w.view(torch.uint8), n_bytes, CHUNK=CHUNK, num_warps=1
            )
        elif kind == "load":
            words = n_bytes // 4
            _load_kernel[(264,)](
                w.view(torch.int32),
                words,
                sink,
                0,
                BLOCK=1024,
                ITERS=triton.cdiv(words, 264 * 1024),
                num_warps=4,
            )

    def seq(kind, n_small):
        def fn(i):  # one step on weight copy i (graph_us cycles over the copies)
            if kind in ("bulk", "load"):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    read_ahead(kind, ws[i])
            for _ in range(n_small):
                ops.rms_norm(row, nw, 1e-6)
            if kind in ("bulk", "load"):
                torch.cuda.current_stream().wait_stream(side)
            pf = {"prefetch": int(kind.split()[1])} if kind.startswith("pdl") else {}
            outs[i].copy_(tri_linear(x, ws[i], sc, (128, 128), quantize_x=True, **pf))

        return fn

    rows = []
    for n_small in (0, 2, 6):
        ref = None
        for kind in ("base", "bulk", "load", "pdl 256", "pdl 512", "pdl 1024", "chain only"):
            if kind == "chain only":
                us = (
                    graph_us(
                        lambda i: [ops.rms_norm(row, nw, 1e-6) for _ in range(n_small)],
                        1,
                        inner=1,
                        reps=30,
                    )
                    if n_small
                    else 0.0
                )
                same = None
            else:
                us = graph_us(seq(kind, n_small), COPIES, inner=COPIES, reps=30)
                got = torch.stack(outs).clone()
                ref = got if kind == "base" else ref
                same = bool(torch.equal(got, ref))
            rows.append(dict(n_small=n_small, kind=kind, us_per_gemm_step=us, same_bits=same))
            print(f"n_small={n_small} {kind:10s} {us:8.2f} us  same_bits={same}", flush=True)
    floor = n_bytes / 4.3e12 * 1e6
    print(f"floor (weight bytes / 4.3 TB/s): {floor:.2f} us", flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "l2_prefetch_probe.json"), "w") as f:
        json.dump(
            {
                "machine": torch.cuda.get_device_name(),
                "N": N,
                "K": K,
                "floor_us": floor,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
