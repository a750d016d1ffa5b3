"""Launch-shape sweep of the separate query-row launch of qnorm_rope_kv_insert at prefill sizes
(programs per SM before rows are looped over, warps per program), with the bits of each variant
against the default. python -m benchmarks.gpu.qnorm_sweep (CUDA; writes $OUT/qnorm_sweep.json)."""
import json, os, torch
from benchmarks.gpu.timing import time_ms
from vllm_dsv4_hw import ops
from vllm_dsv4_hw.ops.triton.common import rows as common
from vllm_dsv4_hw.ops.triton import fused_prologue as fused_qkv
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin
dev = torch.device("cuda")
tab = rope_cos_sin(10000.0, 64, 65536, device=dev)
fmt = make_format("fp8", "main", 64)
rows = []
for t in (4096, 16384):
    q = torch.randn(t, 64, 512, device=dev, dtype=torch.bfloat16)
    kv = torch.randn(t, 512, device=dev, dtype=torch.bfloat16)
    pos = torch.randint(0, 65536, (t,), device=dev)
    cache = fmt.new_cache(t // 64 + 2, device=dev)
    slots = torch.randperm((t // 64 + 2) * 64, device=dev)[:t]
    want = ops.qnorm_rope_kv_insert(q, kv, pos, tab, 1e-6, cache, slots, fmt)
    for pps in (None, 8, 32):
        for w in (1, 2, 4, 8):
            common.CUDA_PROGRAMS_PER_SM, fused_qkv.SEPARATE_Q_WARPS = pps, w
            got = ops.qnorm_rope_kv_insert(q, kv, pos, tab, 1e-6, cache, slots, fmt)
            same = bool(torch.equal(got, want))
            us = time_ms(lambda: ops.qnorm_rope_kv_insert(q, kv, pos, tab, 1e-6, cache, slots, fmt), dev) * 1e3
            rows.append(dict(t=t, programs_per_sm=pps, q_warps=w, us=us, same_bits=same))
            print(rows[-1], flush=True)
json.dump(rows, open(os.environ["OUT"] + "/qnorm_sweep.json", "w"), indent=1)
