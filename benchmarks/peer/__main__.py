# SPDX-License-Identifier: Apache-2.0
"""python -m benchmarks.peer [--smoke] [--out DIR]: the peer table (see the package docstring)."""

from __future__ import annotations

import sys

from benchmarks.gpu.table import prepare_smoke_env

prepare_smoke_env(sys.argv)

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

FULL = dict(
    kv_insert=[1, 32, 4096, 16384],
    kv_gather=[(1, 4096), (8, 8192), (1, 131072)],
    qnorm=[1, 32, 4096, 16384],
    inv_rope=[1, 4, 32, 4096, 16384],
    indexer_q=[1, 4, 32, 4096, 16384],
    sparse=[
        (f, t, 131072, lbl)
        for f in ("fp8_ds_mla", "bf16")
        for t, lbl in (
            (1, "decode B=1"),
            (8, "decode B=8"),
            (64, "decode B=64"),
            (4096, "prefill T=4096"),
        )
    ],
)
SMOKE = dict(
    kv_insert=[1, 70],
    kv_gather=[(1, 70)],
    qnorm=[3],
    inv_rope=[2],
    indexer_q=[3],
    sparse=[("fp8_ds_mla", 2, 512, "decode B=2"), ("bf16", 2, 512, "decode B=2")],
)


def _groups(sizes):
    from benchmarks.peer import cases_cache as cc
    from benchmarks.peer import cases_dense as cd
    from benchmarks.peer import cases_sparse as cs

    return [
        ("kv_insert", lambda dev, gen, tab: cc.kv_insert_rows(dev, sizes["kv_insert"], gen)),
        ("kv_gather", lambda dev, gen, tab: cc.kv_gather_rows(dev, sizes["kv_gather"], gen)),
        (
            "qnorm_rope_kv_insert",
            lambda dev, gen, tab: cc.qnorm_rope_insert_rows(dev, sizes["qnorm"], gen, tab),
        ),
        (
            "inv_rope_fp8_quant",
            lambda dev, gen, tab: cd.inv_rope_rows(dev, sizes["inv_rope"], gen, tab),
        ),
        (
            "indexer q prep",
            lambda dev, gen, tab: cd.indexer_q_rows(dev, sizes["indexer_q"], gen, tab),
        ),
        ("sparse_attention", lambda dev, gen, tab: cs.sparse_rows(dev, sizes["sparse"], gen)),
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes (CPU: Triton interpreter)")
    p.add_argument("--only", default="", help="comma-separated row groups")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args(argv)
    import torch

    from benchmarks.peer import upstream
    from benchmarks.peer.run import Row, markdown
    from vllm_dsv4_hw.config import YarnParams
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(int(time.time_ns() % 2**31))
    table = rope_cos_sin(160000.0, 64, 65536, YarnParams(), device=device).float().contiguous()
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    rows: list[Row] = []
    for name, build in _groups(SMOKE if a.smoke else FULL):
        if only and name not in only:
            continue
        t0 = time.perf_counter()
        try:
            got = build(device, gen, table)
        except upstream.Unavailable as exc:
            got = [Row(name, "all", upstream_reason=str(exc))]
        rows += got
        print(f"peer: {name}: {len(got)} rows in {time.perf_counter() - t0:.1f} s", flush=True)
    text = markdown(rows)
    print(text)
    os.makedirs(a.out, exist_ok=True)
    meta = dict(
        device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        upstream_vllm=upstream.version(),
        date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        smoke=a.smoke,
    )
    with open(os.path.join(a.out, "peer.json"), "w") as f:
        json.dump(dict(meta=meta, rows=[r.as_dict() for r in rows]), f, indent=1)
    with open(os.path.join(a.out, "peer.md"), "w") as f:
        f.write(text + "\n")
    wrong = [r for r in rows if r.correct(1) is False]
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
