# SPDX-License-Identifier: Apache-2.0
"""The radix top-k's warps and block size at decode rows
(``python -m benchmarks.decode_kernels --only topk_sync``), the product's ``radix_topk`` bounded
as the indexer calls it (k = 512, each row's visible entries from its position).

Why: at B=1 and 128K the one-launch select (32,768 scores) takes ~20 us in the decode graph, four
times the score pass before it, and sits on the indexer branch, the longest path of a c4a layer.
Its work is small; its five row barriers and its histograms are what the sweep's knobs spread:
the scores per program (which picks the form: one launch where every program fits on the SMs,
else six) and the warps (``WARPS``: besides ``topk.one_launch_warps``; 8 spreads each histogram's
per-key ballots over more warps). (The 256-bin histograms and the early stop at a one-key bin
were removed untimed, issue 44: git history has them.)
``topk.HIST_RELAXED`` (relaxed or acq_rel histogram atomics) was decided by this sweep on
2026-12-04 (relaxed) and stays as it is. Every config's output must equal the default's bit for bit
(the same tie order): a config that differs is reported as such and never best. (2026-12-04 18:52
UTC the sweep also had volatile-load barrier polling, within 2% of the atomic polls, and 4 / 8
warps at every block: ``results/topk_sync-h200-2026-12-04.json``.)
"""

from __future__ import annotations

import itertools

import torch

from benchmarks.sweep_common import HBM, _f, _summary, _try

K = 512
# warps swept besides each block's default (``one_launch_warps``): none since 2026-12-06 (8
# warps lost at 512 / 1,024 scores a program on 2026-12-04; 2,048 takes 8 already), nor 4,096
# scores a program (1M B=4: 68.3 against 57.4 us at 2,048), to keep the sweep within one device
# call beside the decode_stack pairs
WARPS = (None,)
# scores per program swept (None: the launch rule's); ``decode_kernels --topk-blocks auto`` keeps
# the rule's only, for a short device call
BLOCKS = (None, 512, 1024, 2048)
# (label, table width in scores, visible entries per row): 128K and 1M contexts under tables as
# wide as the context, and 128K under a 1M model length
CASES = (("128K", 32768, 32768), ("1M", 262144, 262144), ("128K in 1M table", 262144, 32768))


def _cfg_label(block, warps=None):
    return f"block={block or 'auto'}" + (f" warps={warps}" if warps else "")


def sweep_topk_sync(dev, batches):
    from vllm_dsv4_hw.ops.triton.indexer import topk as tk

    default = _cfg_label(None)
    rows = []
    for (name, n, visible), b in itertools.product(CASES, batches):
        if b * n > (1 << 20):  # the indexer takes torch.topk past 1M scores per call
            continue
        gen = torch.Generator(device=dev).manual_seed(b * 7 + n)
        sets = [torch.randn(b, n, device=dev, generator=gen) for _ in range(3)]
        pos = torch.full((b,), visible * 4 - 1, dtype=torch.int64, device=dev)
        req = torch.zeros(b, dtype=torch.int64, device=dev)
        bound = dict(row_pos=pos, row_req=req, ratio=4)

        def fresh():
            return torch.full((b, K), -1, dtype=torch.int32, device=dev)

        want = tk.radix_topk(sets[0], K, fresh(), **bound)
        outs = [fresh() for _ in range(3)]
        res = {}
        for block, warps in itertools.product(BLOCKS, WARPS):
            label = _cfg_label(block, warps)
            try:
                got = tk.radix_topk(sets[0], K, fresh(), block=block, num_warps=warps, **bound)
            except Exception as exc:  # out of resources at this block
                res[label] = f"{type(exc).__name__}: {str(exc)[:100]}"
                continue
            if not torch.equal(got, want):
                res[label] = "differs from the default's output"
                continue
            res[label] = _try(
                lambda i, block=block, warps=warps: tk.radix_topk(
                    sets[i], K, outs[i], block=block, num_warps=warps, **bound
                ),
                3,
            )
        rows.append(
            _summary("topk_sync", f"{name} B={b}", res, default, b * visible * 4 / HBM * 1e6)
        )
        print("    " + "; ".join(f"{k}: {_f(v)}" for k, v in res.items()), flush=True)
    return rows
