# SPDX-License-Identifier: Apache-2.0
"""The indexer score pass with an e4m3 query (``decode_kernels --only index_e4m3``): FP8 dots
against bf16 dots on the same query values, at decode and prefill shapes.

Why: at 1M context and batch 32 the score pass is most of a c4a layer (512 of 831 us on the H200,
2026-12-03) and compute-bound on bf16 dots; the product's default on devices with FP8 dots
(``VLLM_DSV4_HW_INDEXER_Q=auto``) scores e4m3 q^I codes on FP8 dots. Each shape times the bf16
query holding exactly the codes' values (``q=bf16``, the model-dtype path's kernel) and the
codes with their scales (``q=e4m3``) at a few tiles; every e4m3 config is checked against the bf16
scores (relative error < 1e-3 of the largest score, same -inf mask) before it is timed. Timing as
every decode_kernels sweep (CUDA-graph replays rotating over input sets, ``sweep_common``).
Floors: decode, the keys once / 4.3 TB/s; prefill, the dot FLOPs / 790 TFLOP/s (bf16 rate).
"""

from __future__ import annotations

import torch

from benchmarks.sweep_common import HBM, _summary, _try


def decode_floor_us(b: int, ctx: int, fmt) -> float:
    """A decode batch's score-pass floor: every token's keys read once / HBM."""
    return b * (ctx // 4) * fmt.entry_bytes / HBM * 1e6


def prefill_floor_us(ctx: int, t: int, n_max: int) -> float:
    """A prefill chunk's floor: the dot FLOPs of its t tokens' visible entries / 790 TFLOP/s."""
    visible = sum(min(n_max, (ctx - t + i + 1) // 4) for i in range(t))
    return 2 * 64 * 128 * visible / 790e12 * 1e6


DECODE_CONFIGS = (
    (64, None, 4, 2),
    (128, None, 4, 2),
    (128, None, 8, 2),
    (64, None, 8, 2),
    (32, None, 4, 2),
    (64, 4, 4, 2),
    (64, None, 4, 3),
    (128, None, 8, 3),
)
PREFILL_CONFIGS = ((1, 4, 64), (4, 4, 64), (4, 8, 64), (4, 8, 128), (8, 8, 64), (2, 4, 64))


def _same_values(dev, fmt_name, reqs):
    """(bf16 args, e4m3 args, scales): the e4m3 codes and a bf16 q of exactly their values."""
    from benchmarks.gpu.indexer import e4m3_query, make_inputs

    args = make_inputs(dev, fmt_name, reqs)[0]
    e_args, qs = e4m3_query(args)
    vals = (e_args[0].float() * qs[..., None]).to(torch.bfloat16)  # exact: e4m3 x 2^k
    return (vals,) + tuple(e_args[1:]), e_args, qs


def _checked(ti, b_args, e_args, qs, buf, want, **kw):
    """The e4m3 scores' error against the bf16 scores of the same values, or a failure text."""
    try:
        got = ti.indexer_scores(*e_args, 4, out=buf, q_scales=qs, **kw)
    except Exception as exc:  # out of shared memory / registers for a tile
        torch.cuda.synchronize()
        return f"{type(exc).__name__}"
    fin = torch.isfinite(want)
    if not torch.equal(torch.isfinite(got), fin):
        return "wrong: -inf mask differs"
    err = float((got[fin] - want[fin]).abs().max() / want[fin].abs().max())
    return None if err < 1e-3 else f"wrong: rel err {err:.2e}"


def sweep_index_e4m3(dev, batches):
    from benchmarks.gpu.indexer import _decode_reqs
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    rows = []
    for ctx in (131072, 1048576):
        for b in batches:
            n_sets = 3 if b * ctx <= 4 * 1048576 else 1
            sets = [_same_values(dev, "mxfp4", _decode_reqs(b, ctx)) for _ in range(n_sets)]
            fmt = sets[0][0][3]
            n_max = sets[0][0][4].shape[1] * fmt.entries_per_page
            bufs = [torch.empty(b, n_max, device=dev) for _ in range(n_sets)]
            want = ti.indexer_scores(*sets[0][0], 4).clone()
            res = {
                "q=bf16 default": _try(
                    lambda i: ti.indexer_scores(*sets[i][0], 4, out=bufs[i]), n_sets
                )
            }
            for bs, it, nw, st in DECODE_CONFIGS:
                kw = dict(block_s=bs, iters=it, num_warps=nw, num_stages=st)
                key = (
                    "q=e4m3 default"
                    if (bs, it, nw, st) == DECODE_CONFIGS[0]
                    else f"q=e4m3 block_s={bs} iters={it or 'auto'} warps={nw} stages={st}"
                )
                bad = _checked(ti, *sets[0][:2], sets[0][2], bufs[0], want, **kw)
                res[key] = bad or _try(
                    lambda i, kw=kw: ti.indexer_scores(
                        *sets[i][1], 4, out=bufs[i], q_scales=sets[i][2], **kw
                    ),
                    n_sets,
                )
            rows.append(
                _summary(
                    "index_e4m3",
                    f"ctx={ctx} B={b}",
                    res,
                    "q=e4m3 default",
                    decode_floor_us(b, ctx, fmt),
                )
            )
            del sets, bufs, want
            torch.cuda.empty_cache()
    for ctx, t in ((131072, 8192), (1048576, 2048)):
        b_args, e_args, qs = _same_values(dev, "mxfp4", [(ctx - t, t, ctx // 4)])
        n_max = b_args[4].shape[1] * b_args[3].entries_per_page
        buf = torch.empty(t, n_max, device=dev)
        want = ti.indexer_scores(*b_args, 4).clone()
        res = {"q=bf16 default": _try(lambda i: ti.indexer_scores(*b_args, 4, out=buf), 1, 1, 3)}
        for tb, nw, bs in PREFILL_CONFIGS:
            kw = dict(tokens_per_program=tb, num_warps=nw, block_s=bs)
            key = (
                "q=e4m3 default"
                if (tb, nw, bs) == PREFILL_CONFIGS[1]
                else f"q=e4m3 tb={tb} warps={nw} block_s={bs}"
            )
            bad = _checked(ti, b_args, e_args, qs, buf, want, **kw)
            res[key] = bad or _try(
                lambda i, kw=kw: ti.indexer_scores(*e_args, 4, out=buf, q_scales=qs, **kw), 1, 1, 3
            )
        rows.append(
            _summary(
                "index_e4m3_prefill",
                f"ctx={ctx} T={t}",
                res,
                "q=e4m3 default",
                prefill_floor_us(ctx, t, n_max),
            )
        )
        del b_args, e_args, buf, want
        torch.cuda.empty_cache()
    return rows


def _digest(t: torch.Tensor) -> str:
    """The score buffer's bits as a short hex digest (an A/B across package versions compares
    them: the same scores bit for bit, or not)."""
    import hashlib

    return hashlib.sha1(t.contiguous().view(torch.int32).cpu().numpy().tobytes()).hexdigest()[:12]


def sweep_index_ab(dev, batches):
    """The score pass's default launch only, decode (128K / 1M x ``batches``) and prefill (8,192
    tokens at the end of 128K, 2,048 at the end of 1M), each row with its scores' digest: the
    lean form for timing two versions of the package on one machine (``pending_ab.sh
    index-ab``). Inputs from fixed seeds, so both versions score the same keys."""
    from benchmarks.gpu.indexer import _decode_reqs, make_inputs
    from vllm_dsv4_hw.ops.triton.indexer import score as ti

    rows = []
    cases = [(ctx, b, None) for ctx in (131072, 1048576) for b in batches]
    cases += [(131072, 1, 8192), (1048576, 1, 2048)]
    for ctx, b, t in cases:
        reqs = _decode_reqs(b, ctx) if t is None else [(ctx - t, t, ctx // 4)]
        n_sets = 3 if t is None and b * ctx <= 4 * 1048576 else 1
        sets = [make_inputs(dev, "mxfp4", reqs, seed=i)[0] for i in range(n_sets)]
        fmt = sets[0][3]
        n_max = sets[0][4].shape[1] * fmt.entries_per_page
        bufs = [torch.empty(sets[0][0].shape[0], n_max, device=dev) for _ in range(n_sets)]
        digest = _digest(ti.indexer_scores(*sets[0], 4))
        res = {
            "default": _try(
                lambda i: ti.indexer_scores(*sets[i], 4, out=bufs[i]),
                n_sets,
                *((1, 3) if t else ()),
            )
        }
        if t is None:
            floor, shape = decode_floor_us(b, ctx, fmt), f"ctx={ctx} B={b}"
        else:
            floor, shape = prefill_floor_us(ctx, t, n_max), f"ctx={ctx} T={t}"
        row = _summary("index_ab", shape, res, "default", floor)
        row["digest"] = digest
        print(f"         digest {digest}", flush=True)
        rows.append(row)
        del sets, bufs
        torch.cuda.empty_cache()
    return rows
