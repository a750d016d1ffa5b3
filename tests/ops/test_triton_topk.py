"""``ops.triton.topk.radix_topk`` (the indexer's selection) against ``torch.topk`` on fresh random
rows, under the Triton interpreter: distinct scores (the exact set), heavy ties (a valid top-k set:
every selected score >= the k-th, all strictly larger ones taken), -inf entries (never selected;
rows with fewer finite scores than k end in -1), an all -inf row, k = n, negative scores, several
blocks per row."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllm_dsv4_hw.ops.triton import topk as tk  # noqa: E402


def _check(scores: torch.Tensor, k: int, out: torch.Tensor) -> None:
    for r in range(scores.shape[0]):
        row = scores[r]
        fin = int(torch.isfinite(row).sum())
        want = min(k, fin)
        sel = out[r, :k].tolist()
        head, tail = sel[:want], sel[want:]
        assert all(v == -1 for v in tail), f"row {r}: -1 expected after {want}: {tail[:8]}"
        assert all(0 <= v < row.numel() for v in head) and len(set(head)) == want
        if want == 0:
            continue
        kth = float(torch.topk(row, want).values[-1])
        got = row[torch.tensor(head)]
        assert float(got.min()) >= kth
        # every score strictly above the k-th is selected
        assert int((got > kth).sum()) == int((row > kth).sum())


@pytest.mark.parametrize("t,n,k,block", [(3, 5000, 64, 1024), (2, 262144, 512, 1 << 16),
                                         (1, 300, 300, 128), (4, 2048, 100, 512)])
def test_radix_topk_distinct_scores_exact_set(gen, monkeypatch, t, n, k, block):
    monkeypatch.setattr(tk, "INTERP_BLOCK", block)
    scores = torch.randn(t, n, generator=gen) * 10
    scores[0, n // 2:] = float("-inf")                 # half the row invisible
    out = torch.full((t, k), -1, dtype=torch.int32)
    tk.radix_topk(scores, k, out)
    _check(scores, k, out)
    fin = torch.isfinite(scores[-1])
    if t > 1 and int(fin.sum()) >= k:                  # distinct finite scores: the exact set
        assert set(out[-1].tolist()) == set(torch.topk(scores[-1], k).indices.tolist())


def test_radix_topk_ties_inf_rows_and_negative(gen, monkeypatch):
    monkeypatch.setattr(tk, "INTERP_BLOCK", 256)
    n, k = 3000, 77
    scores = torch.randint(-3, 4, (5, n), generator=gen).float()    # 7 levels: heavy ties
    scores[1] = float("-inf")                                         # nothing visible
    scores[2, 40:] = float("-inf")                                    # 40 < k finite
    scores[3] = -torch.rand(n, generator=gen) - 1.0                   # all negative
    scores[4, ::3] = float("-inf")
    out = torch.full((5, k), -1, dtype=torch.int32)
    tk.radix_topk(scores, k, out)
    _check(scores, k, out)
    assert (out[1] == -1).all()
    assert int((out[2] >= 0).sum()) == 40


def test_radix_topk_rejects_bad_arguments():
    s = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="k=9"):
        tk.radix_topk(s, 9, torch.full((2, 9), -1, dtype=torch.int32))
    with pytest.raises(ValueError, match="fp32"):
        tk.radix_topk(s.double(), 4, torch.full((2, 4), -1, dtype=torch.int32))


def _deterministic_topk(row: torch.Tensor, k: int) -> list[int]:
    """The contract's exact output: entries above the k-th score in index order, then entries equal
    to it, lowest indices first, then -1 (never -inf entries)."""
    fin = torch.isfinite(row)
    if int(fin.sum()) <= k:
        picked = torch.nonzero(fin).flatten().tolist()
        return picked + [-1] * (k - len(picked))
    kth = float(row.sort(descending=True).values[k - 1])
    above = torch.nonzero(row > kth).flatten().tolist()
    equal = torch.nonzero(row == kth).flatten().tolist()[:k - len(above)]
    return above + equal


@pytest.mark.parametrize("levels", [7, None])
def test_radix_topk_output_is_deterministic_index_order(gen, monkeypatch, levels):
    # Several blocks per row (256 scores each), so that slots come from the cross-block prefix:
    # the same bits as the rule above, heavy ties (7 levels) or distinct scores.
    monkeypatch.setattr(tk, "INTERP_BLOCK", 256)
    n, k = 3000, 77
    scores = (torch.randint(-3, 4, (4, n), generator=gen).float() if levels else
              torch.randn(4, n, generator=gen))
    scores[1, 100:] = float("-inf")
    scores[2, :2900] = float("-inf")                                  # 100 finite, at the end
    out = torch.full((4, k), -1, dtype=torch.int32)
    tk.radix_topk(scores, k, out)
    for r in range(4):
        assert out[r].tolist() == _deterministic_topk(scores[r], k), r


@pytest.mark.parametrize("one_launch", [True, False])
@pytest.mark.parametrize("levels", [7, None])
def test_one_launch_and_multi_launch_forms_give_the_rule(gen, monkeypatch, one_launch, levels):
    """The one-launch form (its row barriers: trivially met with one program per row, as the
    interpreter runs it) and the six-launch form give the contract's exact output, ties and -inf
    rows included; on the GPU tier both run with many programs per row and are compared bit for
    bit (benchmarks/gpu/indexer.py)."""
    monkeypatch.setattr(tk, "INTERP_BLOCK", 4096)
    n, k = 3000, 77
    scores = (torch.randint(-3, 4, (4, n), generator=gen).float() if levels else
              torch.randn(4, n, generator=gen))
    scores[1] = float("-inf")
    scores[2, :2950] = float("-inf")                                  # 50 < k finite
    out = torch.full((4, k), -1, dtype=torch.int32)
    tk.radix_topk(scores, k, out, one_launch=one_launch)
    for r in range(4):
        assert out[r].tolist() == _deterministic_topk(scores[r], k), r


def test_one_launch_form_only_where_programs_can_wait_on_each_other():
    cpu = torch.device("cpu")
    assert tk._one_launch(cpu, 4, 1)            # one program per row: nothing to wait for
    assert not tk._one_launch(cpu, 8, 2)        # the interpreter runs programs one by one
