# SPDX-License-Identifier: Apache-2.0
"""GPU checks and benchmarks of the MoE's small ops: the router (``moe_route``) at V4-Flash /
V4-Pro dimensions (256 / 384 experts, top-6, bias; and hash rows), bf16 x and gate weight as
shipped; the shared expert's activation (``swiglu``, 2 x 2048 / 2 x 3072 columns).

* ``check(device)``: the triton implementation against the reference one on the same device:
  the same experts in the same slots, where the reference's 6th and 7th values are more than 1e-4
  apart (closer pairs may swap under another summation order), weights within 1e-5.
* ``bench(device)``: CUDA-graph medians, triton against the reference composition (the PyTorch
  router the model ran before: about 11 launches), and the floor (gate weight and x at the copy
  rate).

``python -m benchmarks.gpu.moe_ops``."""

from __future__ import annotations

import sys

from benchmarks.gpu.timing import time_ms

MODELS = {"v4-flash": (256, 4096), "v4-pro": (384, 7168)}
K = 6
TOKENS = (1, 4, 32, 64)
COPY_BYTES_PER_S = 3.0e12


def _impls(op: str = "moe_route"):
    import vllm_dsv4_hw.ops  # noqa: F401
    from vllm_dsv4_hw.ops.registry import REGISTRY

    impls = REGISTRY.implementations(op)
    return impls["triton"].fn, impls["reference"].fn


SHARED_INTER = {"v4-flash": 2048, "v4-pro": 3072}


def _swiglu_rows(torch, device, gen, timed: bool) -> list[dict]:
    ours, ref = _impls("swiglu")
    rows = []
    for model, inter in SHARED_INTER.items():
        for t in TOKENS:
            h = (torch.randn(t, 2 * inter, device=device, generator=gen) * 6).bfloat16()
            if timed:
                o = time_ms(lambda: ours(h, 10.0), device)
                r = time_ms(lambda: ref(h, 10.0), device)
                floor = h.numel() * 3 / COPY_BYTES_PER_S * 1e3
                rows.append(
                    {
                        "op": "swiglu",
                        "case": f"{model} T={t}",
                        "ref_ms": r,
                        "ours_ms": o,
                        "speedup": r / o,
                        "floor_ms": floor,
                        "frac_of_floor": floor / o,
                    }
                )
                continue
            got, want = ours(h, 10.0).float(), ref(h, 10.0).float()
            err = float((got - want).abs().max() / want.abs().max())
            rows.append(
                {
                    "op": "swiglu",
                    "case": f"{model} T={t}",
                    "ok": err <= 2**-7,
                    "detail": f"max rel err {err:.3g}",
                }
            )
    return rows


def _inputs(torch, t, e, d, device, gen):
    x = torch.randn(t, d, device=device, generator=gen).bfloat16()
    gate_w = (torch.randn(e, d, device=device, generator=gen) / d**0.5).bfloat16()  # as shipped
    bias = torch.randn(e, device=device, generator=gen) * 0.1
    hash_ids = torch.stack([torch.randperm(e, device=device, generator=gen)[:K] for _ in range(t)])
    return x, gate_w, bias, hash_ids


def check(device, smoke: bool | None = None) -> list[dict]:
    import torch

    ours, ref = _impls()
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for model, (e, d) in MODELS.items():
        for t in TOKENS:
            x, gate_w, bias, hash_ids = _inputs(torch, t, e, d, device, gen)
            for how, b, h in (("top-6", bias, None), ("hash", None, hash_ids)):
                w, ids = ours(x, gate_w, b, h, K, True, 2.5)
                w_ref, ids_ref = ref(x, gate_w, b, h, K, True, 2.5)
                s = torch.nn.functional.softplus(x.float() @ gate_w.float().T).sqrt()
                top = (s + (b if b is not None else 0)).sort(-1, descending=True).values
                clear = (
                    (top[:, K - 1] - top[:, K] > 1e-4)
                    if h is None
                    else torch.ones_like(top[:, 0], dtype=torch.bool)
                )
                same = bool((ids == ids_ref).all(-1)[clear].all())
                err = float((w - w_ref).abs().max() / w_ref.abs().max())
                rows.append(
                    {
                        "op": "moe_route",
                        "case": f"{model} {how} T={t}",
                        "ok": same and err <= 1e-5,
                        "detail": f"ids equal {same} ({int(clear.sum())} of {t} clear), "
                        f"weights rel err {err:.3g}",
                    }
                )
    return rows + _swiglu_rows(torch, device, gen, timed=False)


def bench(device, smoke: bool | None = None) -> list[dict]:
    import torch

    ours, ref = _impls()
    gen = torch.Generator(device=device).manual_seed(1)
    rows = []
    for model, (e, d) in MODELS.items():
        for t in TOKENS:
            x, gate_w, bias, _ = _inputs(torch, t, e, d, device, gen)
            o = time_ms(lambda: ours(x, gate_w, bias, None, K, True, 2.5), device)
            r = time_ms(lambda: ref(x, gate_w, bias, None, K, True, 2.5), device)
            floor = (
                (gate_w.numel() * gate_w.element_size() + x.numel() * 2) / COPY_BYTES_PER_S * 1e3
            )
            rows.append(
                {
                    "op": "moe_route",
                    "case": f"{model} T={t}",
                    "ref_ms": r,
                    "ours_ms": o,
                    "speedup": r / o,
                    "floor_ms": floor,
                    "frac_of_floor": floor / o,
                }
            )
    return rows + _swiglu_rows(torch, device, gen, timed=True)


def main() -> int:
    import torch

    device = torch.device("cuda")
    rows = check(device)
    for r in rows:
        print(f"{'PASS' if r['ok'] else 'FAIL'} {r['op']} {r['case']}: {r['detail']}")
    for r in bench(device):
        print(
            f"{r['op']:9s} {r['case']:16s} ref {r['ref_ms'] * 1e3:7.1f} us  ours "
            f"{r['ours_ms'] * 1e3:6.1f} us  floor {r['floor_ms'] * 1e3:5.2f} us"
        )
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
