# SPDX-License-Identifier: Apache-2.0
"""Peer rows for sparse attention: decode and prefill over the window + compressed candidates.

Upstream's Triton path (its XPU backend): FP8 caches are dequantized into a bf16 workspace by
``dequant_gather_slots`` and attended by ``triton_bf16_mla_sparse_interface``
(``xpu_sparse_decode_fp8``); bf16 rows time ``triton_bf16_mla_sparse_interface`` alone over the
entries laid out flat (the layout its prefill path gathers into). Upstream's path takes
``attn_sink`` but does not apply it, so its error column is measured against the model's
semantics (with sinks) and says so.
"""

from __future__ import annotations

import torch

from benchmarks.gpu.sparse_attention import make_inputs
from benchmarks.peer import oracles, upstream
from benchmarks.peer.run import Row

CHECK_TOKENS = 128  # the float64 oracle runs on the first tokens of a large case


def _oracle(args, n):
    q, win, ws, comp, cs, fmt, sink, scale = args
    ref = oracles.ref("sparse_attention")
    return ref(q[:n].double(), win, ws[:n], comp, cs[:n], fmt, sink.double(), scale)


def sparse_rows(device, cases, gen) -> list[Row]:
    """cases: (format name, tokens, compressed-cache entries, label)."""
    from vllm_dsv4_hw import ops

    out = []
    for fmt_name, t, entries, label in cases:
        args, fmt = make_inputs(
            device,
            fmt_name,
            t,
            cache_entries=entries,
            seed=int(torch.randint(0, 2**31, (1,), generator=gen)),
        )
        q, win, ws, comp, cs, _, sink, scale = args
        h, d = q.shape[1], q.shape[2]  # noqa: F841
        k, w = cs.shape[1], ws.shape[1]

        def run_ours():
            return ops.sparse_attention(*args)

        run_up, up_out = _upstream(fmt_name, fmt, args)
        row = Row("sparse_attention", f"{fmt_name} {label}")
        row.time(run_ours, run_up, device)
        n = min(t, CHECK_TOKENS)
        want = _oracle(args, n)
        run_up()
        row.errors(
            "o",
            oracles.rel_err(run_ours()[:n], want),
            oracles.rel_err(up_out()[:n], want),
            tol=2**-6,
        )
        row.note = f"K {k} + W {w} candidates, H {h}; upstream applies no sink"
        out.append(row)
    return out


def _upstream(fmt_name, fmt, args):
    q, win, ws, comp, cs, _, sink, scale = args
    t, h, d = q.shape
    if fmt_name == "fp8_ds_mla":
        fn = upstream.kernel("sparse_decode_fp8")
        e = fmt.entries_per_page
        kv = comp.view(comp.shape[0], e, fmt.entry_bytes)
        swa = win.view(win.shape[0], e, fmt.entry_bytes)
        top, top_lens = (
            cs.unsqueeze(1),
            torch.full((t,), cs.shape[1], dtype=torch.int32, device=q.device),
        )
        swa_i, swa_lens = (
            ws.unsqueeze(1),
            torch.full((t,), ws.shape[1], dtype=torch.int32, device=q.device),
        )
        o = torch.empty_like(q)

        def run():
            fn(q, kv, swa, False, top, top_lens, swa_i, swa_lens, sink, scale, d, d - 64, 64, o)

        return run, lambda: o
    fn = upstream.kernel("bf16_mla_sparse")
    flat_comp = comp.view(torch.bfloat16).reshape(-1, 1, d)
    flat = torch.cat([flat_comp, win.view(torch.bfloat16).reshape(-1, 1, d)])
    idx = torch.cat([cs, torch.where(ws >= 0, ws + flat_comp.shape[0], ws)], 1).unsqueeze(1)
    idx = idx.to(torch.int32).contiguous()
    res = {}

    def run():
        res["o"] = fn(q, flat, idx, scale, d, 0)[0]

    return run, lambda: res["o"]
