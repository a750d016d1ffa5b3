# SPDX-License-Identifier: Apache-2.0
"""The decode-stack benchmark's --smoke path on CPU (reference ops), end to end, plus its parts.

``benchmarks/decode_stack.py --smoke`` builds a 3-layer stack (window, c4a, c128a) of the product's
``DSV4Attention`` with the real head geometry and FP8 weights as shipped (random tensors in the
checkpoint format through the product's loader), allocates bucket pools for 2 sequences of 512
positions, prefills them in chunks, verifies against a one-shot prefill of the same inputs into
fresh caches, then times decode steps with the product's graph-safe decode metadata; ``--network``
adds the whole network (mHC, MoE with FP4 experts, head). Asserted here:

* the run succeeds and every output is finite;
* chunked prefill equals one-shot prefill (last chunk's outputs and two decode steps after it) to
  1e-2 relative (observed: exactly equal on CPU); a perturbed one-shot input is caught;
* the pools hold exactly ``plan_kv``'s allocated bytes per sequence (within 1%, observed 0) and the
  plan's pages per bucket;
* the floor arithmetic of each row;
* the random fill writes decodable entries; the whole-network row runs and is finite;
* under the Triton interpreter, the GPU decode path (triton ops incl. the Triton decode metadata
  and FP8 block GEMM) gives the reference path's decode step (observed: equal up to a last bf16
  bit).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import decode_stack as ds
from benchmarks.stack.decode_inputs import DecodeInputs
from benchmarks.stack.floor import HBM_BYTES_PER_S
from benchmarks.stack.pools import StackCaches
from vllm_dsv4_hw.kv_cache.paged import gather_rows
from vllm_dsv4_hw.kv_cache.sizing import plan_kv

pytestmark = pytest.mark.usefixtures("vllm_single_rank")


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("decode_stack")
    rc = ds.main(["--smoke", "--network", "--out", str(out)])
    with open(out / "decode_stack.json") as f:
        return rc, json.load(f)


def test_smoke_runs_and_is_finite(smoke):
    rc, data = smoke
    assert rc == 0, data["errors"]
    assert not data["errors"]
    assert data["rows"], "no decode row"
    for row in data["rows"]:
        assert row["finite"]
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0
        assert set(row["per_layer_ms"]) == {"window", "c4a", "c128a"}
        assert all(v > 0 for v in row["per_layer_ms"].values())
        assert row["cache_init"] == "prefill"
        # streams on / off (inline on CPU) replay the same positions on the same caches
        assert row["equal_to_first"], row["max_abs_diff_vs_first"]
    assert {r["multi_stream"] for r in data["rows"]} == {True, False}
    assert data["prefill"] and data["prefill"][0]["tokens_per_s"] > 0


def test_chunked_prefill_matches_one_shot(smoke):
    _, data = smoke
    rows = {v["what"]: v for v in data["verify"]}
    v = rows["chunked_vs_oneshot_prefill"]
    assert v["ok"] and v["finite"]
    assert v["last_chunk_rel_err"] <= 1e-2
    assert v["decode_rel_err"] <= 1e-2


def test_kv_bytes_match_plan(smoke):
    _, data = smoke
    cfg = ds.smoke_config()
    for kv in data["kv"]:
        plan = plan_kv(cfg, kv["context"], "fp8", "mxfp4")
        measured = kv["measured_bytes_total"] / kv["batch"]
        assert abs(measured - plan.allocated_bytes) <= 0.01 * plan.allocated_bytes
        assert kv["ok_1pct"]
        for bp in plan.page_buckets:
            for name in bp.name.split("+"):
                assert kv["pools"][name]["pages_per_seq"] == bp.pages_per_sequence


def test_floor_arithmetic(smoke):
    _, data = smoke
    for row in data["rows"]:
        total = sum(row["floor_bytes"].values())
        assert total == row["floor_total_bytes"]
        assert math.isclose(row["floor_ms"], total / HBM_BYTES_PER_S * 1e3, rel_tol=1e-9)
        assert math.isclose(row["x_floor"], row["step_ms"] / row["floor_ms"], rel_tol=1e-9)
        # weights once per step: every layer's projections, norms, sink, compressor
        assert row["floor_bytes"]["weights"] == data["models"]["smoke"]["weight_bytes_total"]


def test_verify_catches_a_perturbed_prompt(tmp_path, monkeypatch):
    """The chunked-vs-one-shot comparison is not vacuous: change one prompt token of the one-shot
    run and it fails."""
    orig = ds.Runner._prefill_inputs
    calls = {"n": 0}

    def perturbed(self, b, p0, hidden, seed=11):
        calls["n"] += 1
        x = orig(self, b, p0, hidden, seed)
        if calls["n"] == 2:  # the one-shot run's inputs
            x[:, -3] += 0.5
        return x

    monkeypatch.setattr(ds.Runner, "_prefill_inputs", perturbed)
    rc = ds.main(
        ["--smoke", "--out", str(tmp_path), "--contexts", "384", "--batches", "1", "--steps", "1"]
    )
    data = json.loads((tmp_path / "decode_stack.json").read_text())
    v = {r["what"]: r for r in data["verify"]}["chunked_vs_oneshot_prefill"]
    assert rc == 1 and not v["ok"]
    assert v["last_chunk_rel_err"] > 1e-2


def test_network_row(smoke):
    rc, data = smoke
    (row,) = data["network"]
    assert row["finite"] and row["step_ms"] > 0
    assert set(row["per_layer_ms"]) == {"window", "c4a", "c128a"}
    assert row["full_model_step_ms"] > 0 and row["full_model_tokens_per_s"] > 0


def test_random_fill(gen):
    """The random fill writes entries every format decodes to finite values."""
    cfg = ds.smoke_config()
    caches = StackCaches(cfg, 3, 1024, torch.device("cpu"), seed=int(gen.initial_seed()) % 1000)
    caches.fill_random(seed=1, template_pages=8)
    for lc in caches.layers:
        n = lc.window.shape[0] * lc.main_format.entries_per_page
        assert torch.isfinite(gather_rows(lc.window, torch.arange(n), lc.main_format)).all()
        if lc.comp is not None:
            n = lc.comp.shape[0] * lc.comp_format.entries_per_page
            assert torch.isfinite(gather_rows(lc.comp, torch.arange(n), lc.comp_format)).all()
            assert torch.isfinite(lc.main_state).all()
        if lc.indexer is not None:
            n = lc.indexer.shape[0] * lc.indexer_format.entries_per_page
            rows = gather_rows(lc.indexer, torch.arange(n), lc.indexer_format)
            assert torch.isfinite(rows).all() and rows.abs().amax() > 0
            assert torch.isfinite(lc.indexer_state).all()


def test_triton_decode_path_matches_reference(monkeypatch):
    """The GPU decode path, run by the Triton interpreter on CPU: the dispatched ops on the triton
    backend, the Triton metadata kernels (padded compressor plans: tokens that complete no group
    carry rows -1 and cache slot -1) and the Triton FP8 block GEMM. One decode step of the whole
    stack must equal the reference path (tile-dequantized FP8 weights, torch metadata) on the same
    caches, at positions that complete c4a and c128a groups and at ones that do not."""
    import os

    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (TRITON_INTERPRET=1, set on machines w/o GPU)")
    from benchmarks.stack.model import AttentionStack
    from vllm_dsv4_hw.config import DSV4Config
    from vllm_dsv4_hw.ops.registry import REGISTRY

    # the triton indexer wants >= 16 power-of-two heads
    cfg = DSV4Config(
        name="smoke16",
        hidden_size=256,
        num_heads=2,
        q_lora_rank=128,
        o_groups=2,
        o_lora_rank=128,
        index_topk=32,
        compress_ratios=(0, 4, 128),
        index_n_heads=16,
        max_position_embeddings=512,
    )
    dev = torch.device("cpu")
    stack = AttentionStack(cfg, dev, 512, seed=3)
    caches = StackCaches(cfg, 2, 512, dev)
    caches.fill_random(seed=5, template_pages=4096)  # distinct entries: no top-k ties
    h = torch.randn(2, 256, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = {}
    for backend in ("reference", "triton"):
        monkeypatch.setenv("VLLM_DSV4_HW_BACKEND", backend)
        REGISTRY.clear_cache()
        dm = DecodeInputs(caches, dev)
        res = []
        for pos in ([383, 381], [384, 386]):  # 383: c4a + c128a groups; 381: none; 384/386: none
            dm.seq_lens.copy_(torch.tensor(pos) + 1)
            res.append(stack.run(h, dm.derive(), caches.layers).float())
        outs[backend] = torch.stack(res)
    ref, got = outs["reference"], outs["triton"]
    assert torch.isfinite(got).all()
    # bf16 outputs: a last-bit difference somewhere is ~1e-3 of max|out|
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-2


def test_model_len_widens_the_tables_not_the_step(gen):
    """``--model-len`` (vLLM's tables span the model length): the full kinds' tables get
    unallocated columns past the context and the decode layouts the model length's candidate
    width; the step's metadata is the narrow one's plus -1 padding, so the same entries are read."""
    cfg = ds.smoke_config()
    narrow = StackCaches(cfg, 2, 512, torch.device("cpu"), seed=3)
    wide = StackCaches(cfg, 2, 512, torch.device("cpu"), seed=3, model_len=2048)
    metas = []
    for caches in (narrow, wide):
        dm = DecodeInputs(caches, torch.device("cpu"))
        dm.set_position(300)
        metas.append(dm.derive())
    for r in narrow.tables:
        for kind, t in vars(narrow.tables[r]).items():
            if t is None:
                continue
            w = vars(wide.tables[r])[kind]
            assert torch.equal(w[:, : t.shape[1]], t), (r, kind)
            assert w.shape[1] >= t.shape[1] * 4 or t.shape[1] == w.shape[1] == 1, (r, kind)
            if kind in ("comp", "indexer"):
                assert (w[:, t.shape[1] :] == -1).all(), (r, kind)
        n, m = metas[0][r], metas[1][r]
        assert torch.equal(n.window_slots, m.window_slots)
        if n.comp_slots is not None:  # c128a: the model length's width, -1 past 512 / 128
            k = n.comp_slots.shape[1]
            assert m.comp_slots.shape[1] == 2048 // r
            assert torch.equal(m.comp_slots[:, :k], n.comp_slots)
            assert (m.comp_slots[:, k:] == -1).all()
        if r == 4:  # the indexer's bound: the wide table
            assert m.max_visible_entries == 4 * n.max_visible_entries


def test_error_text_keeps_the_exception_a_failed_capture_hides():
    """A failed CUDA-graph capture raises "capturing stream has unjoined work" while handling the
    error of the captured call: the results file keeps both."""
    from benchmarks.stack.timing import error_text

    try:
        try:
            raise ValueError("radix_topk: row_pos must be int32 or int64")
        except ValueError:
            raise RuntimeError("CUDA error: capturing stream has unjoined work")
    except RuntimeError as exc:
        text = error_text(exc)
    assert text.startswith("RuntimeError: CUDA error: capturing stream has unjoined work")
    assert "ValueError: radix_topk: row_pos must be int32 or int64" in text
    assert error_text(KeyError("x")) == "KeyError: 'x'"
