# SPDX-License-Identifier: Apache-2.0
"""The model split over two tensor-parallel ranks (``vllm_dsv4_hw.parallel``) equals the whole model:
two processes join one vLLM tensor-parallel group (gloo, as vLLM's CPU workers do), each builds
its shard of the fp32 network and the whole network from the same checkpoint, and runs one prompt
(crossing the 4 / 8 / 128 / 256 boundaries) in one shot and chunked. Logprobs agree to fp32 sum
order (the split reorders the sums of wo_b, the shared expert and the MoE), for bf16 and FP8/FP4
checkpoints, with the experts split by intermediate rows and by expert (EP). A reordered sum may
flip a router or indexer top-k at a near-tie, which moves later logprobs by tenths of a nat: the
prompt is drawn until every top-k decision of the whole model clears MIN_MARGIN. Through
``vllm serve``: ``tests/serve/test_tensor_parallel.py``."""

from __future__ import annotations

import json
import os
import socket
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from tests.conftest import SESSION_SEED
from vllm_dsv4_hw.tools import checkpoint as ck

TP = 2
LENGTH = 257  # test_network.MAX_LEN: positions 0..256
CHUNKS = (100, 29, 124, 1, 1, 1, 1)
TOL = 1e-4  # max |logprob diff| split vs whole, fp32 (sum order only; observed 1.4e-5)
MIN_MARGIN = 2e-5  # smallest relative top-k gap of a drawn prompt (as tests/model/test_network)
DRAWS = 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, port: int) -> None:
    # The suite's torch_npu stub names the PrivateUse1 device, which torch.distributed's barrier
    # then asks for hooks: these ranks are plain CPU processes.
    sys.path[:] = [p for p in sys.path if not p.endswith(os.path.join("tests", "stubs"))]
    assert "torch_npu" not in sys.modules
    os.environ["VLLM_DSV4_HW_BACKEND"] = "reference"
    torch.set_num_threads(1)
    from benchmarks.vllm_state import tensor_parallel_rank

    tensor_parallel_rank(TP, rank, f"tcp://127.0.0.1:{port}")


@contextmanager
def _topk_margins(gaps: list[float]):
    """Records, for every ``torch.topk`` (the MoE router's and the reference indexer's), the
    smallest gap between its k-th and (k+1)-th largest value relative to the largest; rows whose
    (k+1)-th value is -inf (entries not yet visible) decide nothing."""
    topk = torch.topk

    def recording(x, k, dim=-1, *args, **kwargs):
        if x.shape[dim] > k:
            v = x.detach().movedim(dim, -1).sort(-1, descending=True).values
            nxt = v[..., k]
            gap = (v[..., k - 1] - nxt) / v[..., 0].abs().clamp_min(1e-30)
            gap = gap[torch.isfinite(nxt)]
            if gap.numel():
                gaps.append(float(gap.min()))
        return topk(x, k, dim, *args, **kwargs)

    torch.topk = recording
    try:
        yield
    finally:
        torch.topk = topk


def _prompt(whole, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(ids, whole's logprobs, its smallest top-k margin): the first of DRAWS prompts whose
    margin clears MIN_MARGIN."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(DRAWS):
        ids = torch.randint(0, vocab, (LENGTH,), generator=gen)
        gaps: list[float] = []
        with _topk_margins(gaps):
            ref = whole.logprobs(ids)
        assert gaps, "no top-k decision was recorded"
        if min(gaps) >= MIN_MARGIN:
            return ids, ref, min(gaps)
    raise AssertionError(f"{DRAWS} prompts all had a top-k near-tie < {MIN_MARGIN} (seed {seed})")


def _rank_main(rank: int, port: int, ckpt: str, out_dir: str, ep: bool, seed: int) -> None:
    try:
        _join(rank, port)
        from tests.model.test_network import SingleSequenceRunner
        from vllm_dsv4_hw.parallel import current_layout

        layout = current_layout(expert_parallel=ep)
        assert layout.tp_size == TP and layout.tp_rank == rank and layout.expert_parallel == ep
        path = Path(ckpt)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        whole = SingleSequenceRunner(path, torch.float32, "fp32", "fp32")
        split = SingleSequenceRunner(path, torch.float32, "fp32", "fp32", layout=layout)
        ids, ref, margin = _prompt(whole, vocab, seed)
        got = split.logprobs(ids)
        chunked = split.logprobs(ids, CHUNKS)
        top2 = ref.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * TOL
        nbytes = [
            sum(p.numel() * p.element_size() for p in r.net.parameters()) for r in (whole, split)
        ]
        res = {
            "oneshot": float((got - ref).abs().max()),
            "chunked": float((chunked - ref).abs().max()),
            # where the whole model's best two tokens are further apart than the split may
            # move them (2 TOL: an exact tie's order is the sum order's)
            "greedy_equal": bool(torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])),
            "clear": int(clear.sum()),
            "bytes": nbytes,
            "margin": margin,
        }
    except BaseException:  # noqa: BLE001 (reported to the parent)
        res = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for dtype in ("bf16", "fp8"):
        out[dtype] = root / f"tiny-flash-{dtype}"
        ck.make_checkpoint(
            out[dtype], "tiny-flash", dtype, SESSION_SEED % 1000, progress=lambda _m: None
        )
    return out


@pytest.mark.parametrize("dtype,ep", [("bf16", False), ("fp8", False), ("fp8", True)])
def test_split_model_equals_whole_model(ckpts, tmp_path, dtype, ep):
    mp.start_processes(
        _rank_main,
        args=(_free_port(), str(ckpts[dtype]), str(tmp_path), ep, SESSION_SEED),
        nprocs=TP,
        start_method="spawn",
        join=True,
    )
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(TP)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert res["oneshot"] < TOL and res["chunked"] < TOL, (r, res)
        assert res["greedy_equal"] and res["clear"] > LENGTH // 2, (r, res)
        whole, split = res["bytes"]
        assert split < 0.8 * whole, (r, res)  # the shards are not replicated copies


def _shipped_bytes_main(rank: int, port: int, out_dir: str) -> None:
    """Parameter bytes of the whole and of this rank's V4-Flash (real dimensions, FP8 linears and
    FP4 experts as shipped), built on the meta device."""
    try:
        _join(rank, port)
        from vllm_dsv4_hw.attention.layer import DSV4Attention
        from vllm_dsv4_hw.config import V4_FLASH
        from vllm_dsv4_hw.model.network import DSV4Network
        from vllm_dsv4_hw.parallel import ParallelLayout, current_layout
        from vllm_dsv4_hw.quant.scheme import shipped

        cfg = shipped(V4_FLASH)
        res = {}
        for name, layout in (
            ("whole", ParallelLayout()),
            ("tp", current_layout()),
            ("ep", current_layout(expert_parallel=True)),
        ):
            with torch.device("meta"):
                net = DSV4Network(
                    cfg,
                    lambda i, r, lo=layout: DSV4Attention(
                        cfg, i, dtype=torch.bfloat16, max_positions=256, layout=lo
                    ),
                    layout=layout,
                )
            res[name] = sum(p.numel() * p.element_size() for p in net.parameters())
    except BaseException:  # noqa: BLE001 (reported to the parent)
        res = {"error": traceback.format_exc()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(res))


def test_each_rank_of_v4_flash_holds_about_half(tmp_path):
    """The tiny checkpoints keep the real head geometry, so their replicated part (KV vector,
    compressors, indexer: one shared head) weighs a quarter of them; in V4-Flash the sharded
    experts dominate and each of two ranks holds about half."""
    mp.start_processes(
        _shipped_bytes_main,
        args=(_free_port(), str(tmp_path)),
        nprocs=TP,
        start_method="spawn",
        join=True,
    )
    for r in range(TP):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "error" not in res, f"rank {r}:\n{res['error']}"
        assert 140 * 2**30 < res["whole"] < 160 * 2**30, res  # ~150 GiB as shipped
        for split in ("tp", "ep"):
            assert abs(res[split] / res["whole"] - 0.5) < 0.05, (split, res)
