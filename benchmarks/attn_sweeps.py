# SPDX-License-Identifier: Apache-2.0
"""Sweeps of ``sparse_attention``'s candidate loop (``benchmarks.decode_kernels --only
attn_loop``): one loop over both caches against one loop per cache, Triton's software pipelining
(``num_stages``) and the 64-entry tiles that the single loop made the better choice, at the
decode and prefill shapes of the stack.

Why: the sm_90 build of the 64-head tile (prefill chunks, long decode lists) spilled the state
of its second loop (85 local reloads per 32-entry tile); the single loop is spill-free, and with
``num_stages`` >= 2 Triton moves the slot and entry loads to asynchronous copies (``LDGSTS``)
ahead of the compute. Every config's output is compared with the two-loop kernel at the rule's
tiles: the same bits where only the loop differs, within bf16 rounding for other tiles.
"""

from __future__ import annotations

import torch

from benchmarks.sweep_common import HBM, _summary, _try

# (tokens, compressed candidates, cache entries, input sets): c4a top-k 512, c128a at 128K
# (1,024) and at 1M (8,192)
PREFILL_CASES = ((8192, 512, 1 << 17, 1), (8192, 1024, 1 << 17, 1), (2048, 8192, 1 << 20, 1))
DECODE_K = (512, 8192)


def _variants(cfg: dict, n_cand: int, wide: dict) -> dict:
    """Named option sets over the launch rule's tiles ``cfg`` -> (options, same bits expected as
    the two-loop kernel at the rule's tiles). For the 64-head tiles: the 32-entry tile without
    stages (before 2026-12-03 night, with one or two loops) and the 64-entry one at 2 / 3
    stages; for the 16-head tiles: no register prefetch, and the 64-head tiles (``wide``) in
    splits of 256 / 512 candidates."""
    out = {"two loops": (dict(one_loop=False), True), "one loop": ({}, True)}
    if cfg["block_h"] >= 64:
        before = dict(block_n=32, num_stages=1)
        out["bn=32 stages=1, two loops (before)"] = (dict(before, one_loop=False), False)
        out["bn=32 stages=1, one loop"] = (before, False)
        out["bn=64 stages=2"] = (dict(block_n=64, num_stages=2), False)
        out["bn=64 stages=3"] = (dict(block_n=64, num_stages=3), False)
    else:
        out["prefetch=0"] = (dict(prefetch=False), False)
        for chunk in (256, 512):
            if n_cand > chunk:
                out[f"64 heads, splits of {chunk}"] = (
                    dict(wide, num_splits=-(-n_cand // chunk)),
                    False,
                )
    return out


def _compare(got: torch.Tensor, want: torch.Tensor, same_tiles: bool) -> str | None:
    """None if ``got`` is as expected against the two-loop output, else why not."""
    if same_tiles:
        return (
            None
            if torch.equal(got, want)
            else (f"differs: {float((got.float() - want.float()).abs().max()):.2e}")
        )
    err = float((got.float() - want.float()).abs().max() / want.float().abs().max())
    return None if err < 2**-6 else f"wrong: {err:.2e}"


def _sweep_case(tsa, launch, sets, outs, label, floor_us, t, n_cand):
    cfg = launch._config(sets[0][0].device, t, 64, "fp8_ds_mla", n_cand=n_cand)
    want = tsa.sparse_attention_triton(*sets[0], one_loop=False)
    res = {}
    for name, (kw, same) in _variants(cfg, n_cand, launch.FP8_WIDE_TILES[0].tiles).items():
        try:
            got = tsa.sparse_attention_triton(*sets[0], **kw)
        except Exception as exc:  # out of shared memory / registers for a config
            res[name] = f"{type(exc).__name__}: {str(exc)[:100]}"
            torch.cuda.synchronize()
            continue
        bad = _compare(got, want, same)
        res[name] = bad or _try(
            lambda i, kw=kw: tsa.sparse_attention_triton(*sets[i], out=outs[i], **kw),
            len(sets),
            1 if t > 1024 else 8,
            5,
        )
        if bad is None and same:
            res[name + ": same bits as two loops"] = "True"
    return _summary("attn_loop", label, res, "one loop", floor_us)


def sweep_attn_loop(dev, batches):
    from benchmarks.gpu.sparse_attention import make_inputs
    from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as tsa
    from vllm_dsv4_hw.ops.triton.sparse_attention import launch as launch

    rows = []
    for k_comp in DECODE_K:
        for b in batches:
            sets = [
                make_inputs(dev, "fp8_ds_mla", b, topk=k_comp, cache_entries=1 << 20)[0]
                for _ in range(3)
            ]
            outs = [torch.empty_like(a[0]) for a in sets]
            n_cand = 128 + k_comp
            rows.append(
                _sweep_case(
                    tsa,
                    launch,
                    sets,
                    outs,
                    f"decode W=128 K={k_comp} B={b}",
                    b * n_cand * 584 / HBM * 1e6,
                    b,
                    n_cand,
                )
            )
            del sets, outs
            torch.cuda.empty_cache()
    for t, k_comp, entries, n_sets in PREFILL_CASES:
        sets = [
            make_inputs(dev, "fp8_ds_mla", t, topk=k_comp, cache_entries=entries)[0]
            for _ in range(n_sets)
        ]
        outs = [torch.empty_like(a[0]) for a in sets]
        flops = 4 * t * 64 * (128 + k_comp) * 512
        rows.append(
            _sweep_case(
                tsa,
                launch,
                sets,
                outs,
                f"prefill T={t} W=128 K={k_comp}",
                flops / 790e12 * 1e6,
                t,
                128 + k_comp,
            )
        )
        del sets, outs
        torch.cuda.empty_cache()
    return rows
