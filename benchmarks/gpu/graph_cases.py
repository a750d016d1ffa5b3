# SPDX-License-Identifier: Apache-2.0
"""CUDA-graph capture/replay of the decode-path ops (V4-Flash decode shapes, batch 8).

Each case builds static inputs, captures one call of the dispatched op (the triton backend on CUDA)
in a graph, then writes fresh random values into the captured input buffers, replays, and compares
the outputs and every cache the op writes with an eager call on the same inputs and the same
starting cache contents. Same kernels and same inputs: results must be bit-identical.
"""

from __future__ import annotations

B, H, D, R = 8, 64, 512, 64
Q_LORA, HIDDEN = 1024, 4096


def _rand_(t, gen):
    """Refill a float tensor in place with fresh N(0,1) values (the 'new step's inputs')."""
    import torch

    t.copy_(torch.randn(t.shape, generator=gen, device=t.device).to(t.dtype))


def _common(torch, gen):
    from vllm_dsv4_hw.config import YarnParams
    from vllm_dsv4_hw.kv_cache.formats import make_format
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    dev = torch.device("cuda")
    cos_sin = rope_cos_sin(160000.0, R, 1 << 20, YarnParams(), device=dev)
    pos = torch.randint(0, 1 << 20, (B,), generator=gen, device=dev)
    fmt = make_format("fp8", "main", 64)
    pages = 64
    cache = fmt.new_cache(pages, device=dev)
    return dev, cos_sin, pos, fmt, cache


def case_sparse_attention(torch, gen):
    from vllm_dsv4_hw import ops

    dev, _, _, fmt, cache = _common(torch, gen)
    rows = torch.randn(64 * 64, D, generator=gen, device=dev)
    ops.kv_insert(cache, torch.arange(rows.shape[0], device=dev), rows, fmt)
    q = torch.randn(B, H, D, generator=gen, device=dev).to(torch.bfloat16)
    wslots = torch.randint(0, 4096, (B, 128), generator=gen, device=dev)
    cslots = torch.randint(-1, 4096, (B, 512), generator=gen, device=dev)
    sink = torch.randn(H, generator=gen, device=dev)

    def fn():
        return (ops.sparse_attention(q, cache, wslots, cache, cslots, fmt, sink, D**-0.5),)

    def refresh():
        _rand_(q, gen)
        wslots.copy_(torch.randint(0, 4096, wslots.shape, generator=gen, device=dev))
        cslots.copy_(torch.randint(-1, 4096, cslots.shape, generator=gen, device=dev))

    return fn, [], refresh


def case_qnorm_rope_kv_insert(torch, gen):
    from vllm_dsv4_hw import ops

    dev, cos_sin, pos, fmt, cache = _common(torch, gen)
    q = torch.randn(B, H, D, generator=gen, device=dev).to(torch.bfloat16)
    kv = torch.randn(B, D, generator=gen, device=dev).to(torch.bfloat16)
    slots = torch.randperm(64 * 64, generator=gen, device=dev)[:B]

    def fn():
        return (ops.qnorm_rope_kv_insert(q, kv, pos, cos_sin, 1e-6, cache, slots, fmt),)

    def refresh():
        _rand_(q, gen)
        _rand_(kv, gen)
        pos.copy_(torch.randint(0, 1 << 20, pos.shape, generator=gen, device=dev))
        slots.copy_(torch.randperm(64 * 64, generator=gen, device=dev)[:B])

    return fn, [cache], refresh


def case_inv_rope_fp8_quant(torch, gen):
    from vllm_dsv4_hw import ops

    dev, cos_sin, pos, _, _ = _common(torch, gen)
    o = torch.randn(B, H, D, generator=gen, device=dev).to(torch.bfloat16)

    def fn():
        o8, s = ops.inv_rope_fp8_quant(o, pos, cos_sin)
        return (o8.view(torch.uint8), s)

    def refresh():
        _rand_(o, gen)
        pos.copy_(torch.randint(0, 1 << 20, pos.shape, generator=gen, device=dev))

    return fn, [], refresh


def case_qkv_rms_norm(torch, gen):
    from vllm_dsv4_hw import ops

    dev = torch.device("cuda")
    qr = torch.randn(B, Q_LORA, generator=gen, device=dev).to(torch.bfloat16)
    kv = torch.randn(B, D, generator=gen, device=dev).to(torch.bfloat16)
    qw = torch.rand(Q_LORA, generator=gen, device=dev).to(torch.bfloat16)
    kw = torch.rand(D, generator=gen, device=dev).to(torch.bfloat16)

    def fn():
        return tuple(ops.qkv_rms_norm(qr, qw, kv, kw, 1e-6))

    def refresh():
        _rand_(qr, gen)
        _rand_(kv, gen)

    return fn, [], refresh


def case_indexer_topk(torch, gen):
    from benchmarks.gpu.indexer import _decode_reqs, make_inputs
    from vllm_dsv4_hw import ops

    args, fmt = make_inputs("cuda", "fp8", _decode_reqs(B, 131072), seed=7)
    q, w = args[0], args[1]

    def fn():
        # the selection is a set: the radix select writes it in atomic (run-dependent) order
        return (torch.sort(ops.indexer_topk(*args, 512), dim=-1).values,)

    def refresh():
        _rand_(q, gen)
        w.copy_(torch.rand(w.shape, generator=gen, device=w.device) * w.abs().max())

    return fn, [], refresh


def case_compressor_store(torch, gen):
    from benchmarks.gpu.compressor import make_step
    from vllm_dsv4_hw import ops

    cpu_gen = torch.Generator().manual_seed(11)
    reqs = [(4 * int(torch.randint(1024, 32768, (1,), generator=cpu_gen)) + 3, 1) for _ in range(B)]
    step = make_step("cuda", "c4a", "fp8", reqs, seed=11)
    args = step["args"]
    kv, score, state, cache = args[0], args[1], args[4], args[12]

    def fn():
        ops.compressor_store(*args)
        return ()

    def refresh():
        _rand_(kv, gen)
        _rand_(score, gen)

    return fn, [state, cache], refresh


CASES = {
    "sparse_attention": case_sparse_attention,
    "qnorm_rope_kv_insert": case_qnorm_rope_kv_insert,
    "inv_rope_fp8_quant": case_inv_rope_fp8_quant,
    "qkv_rms_norm": case_qkv_rms_norm,
    "indexer_topk": case_indexer_topk,
    "compressor_store": case_compressor_store,
}


def _bit_equal(torch, a, b) -> bool:
    """Byte equality: NaN poison (state pages owned by nobody) must compare equal to itself."""
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


def run_case(torch, make) -> tuple[bool, str]:
    from benchmarks.stack.timing import capture_cuda_graph

    gen = torch.Generator(device="cuda").manual_seed(20261129)
    fn, mutated, refresh = make(torch, gen)
    graph, static_out = capture_cuda_graph(fn)  # warmed up (compile, autotune) outside the capture
    refresh()  # new step: fresh inputs written into the captured buffers
    before = [m.clone() for m in mutated]
    graph.replay()
    torch.cuda.synchronize()
    got = [t.clone() for t in static_out] + [m.clone() for m in mutated]
    for m, b in zip(mutated, before):
        m.copy_(b)
    eager = list(fn()) + [m.clone() for m in mutated]
    torch.cuda.synchronize()
    bad = [i for i, (g, e) in enumerate(zip(got, eager)) if not _bit_equal(torch, g, e)]
    return (not bad), (
        "replay == eager, bit-identical"
        if not bad
        else f"outputs {bad} differ between replay and eager"
    )
