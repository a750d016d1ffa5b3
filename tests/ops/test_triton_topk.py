# SPDX-License-Identifier: Apache-2.0
"""``ops.triton.topk.radix_topk`` (the indexer's selection) against ``torch.topk`` on fresh random
rows, under the Triton interpreter: distinct scores (the exact set), heavy ties (a valid top-k set:
every selected score >= the k-th, all strictly larger ones taken), -inf entries (never selected;
rows with fewer finite scores than k end in -1), an all -inf row, k = n, negative scores, several
blocks per row; the per-row bound (``row_pos`` / ``row_req``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from vllm_dsv4_hw.ops.triton.indexer import topk as tk  # noqa: E402


def _unfilled(t: int, k: int) -> torch.Tensor:
    """An output as ``torch.empty`` may leave it: the call writes every slot of [0, k) (the -1
    tail included), so nothing may survive from before."""
    return torch.full((t, k), 0x5A5A5A5A, dtype=torch.int32)


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


@pytest.mark.parametrize(
    "t,n,k,block",
    [(3, 5000, 64, 1024), (2, 262144, 512, 1 << 16), (1, 300, 300, 128), (4, 2048, 100, 512)],
)
def test_radix_topk_distinct_scores_exact_set(gen, monkeypatch, t, n, k, block):
    monkeypatch.setattr(tk, "INTERP_BLOCK", block)
    scores = torch.randn(t, n, generator=gen) * 10
    scores[0, n // 2 :] = float("-inf")  # half the row invisible
    out = _unfilled(t, k)
    tk.radix_topk(scores, k, out)
    _check(scores, k, out)
    fin = torch.isfinite(scores[-1])
    if t > 1 and int(fin.sum()) >= k:  # distinct finite scores: the exact set
        assert set(out[-1].tolist()) == set(torch.topk(scores[-1], k).indices.tolist())


def test_radix_topk_ties_inf_rows_and_negative(gen, monkeypatch):
    monkeypatch.setattr(tk, "INTERP_BLOCK", 256)
    n, k = 3000, 77
    scores = torch.randint(-3, 4, (5, n), generator=gen).float()  # 7 levels: heavy ties
    scores[1] = float("-inf")  # nothing visible
    scores[2, 40:] = float("-inf")  # 40 < k finite
    scores[3] = -torch.rand(n, generator=gen) - 1.0  # all negative
    scores[4, ::3] = float("-inf")
    out = _unfilled(5, k)
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
    equal = torch.nonzero(row == kth).flatten().tolist()[: k - len(above)]
    return above + equal


@pytest.mark.parametrize("levels", [7, None])
def test_radix_topk_output_is_deterministic_index_order(gen, monkeypatch, levels):
    # Several blocks per row (256 scores each), so that slots come from the cross-block prefix:
    # the same bits as the rule above, heavy ties (7 levels) or distinct scores.
    monkeypatch.setattr(tk, "INTERP_BLOCK", 256)
    n, k = 3000, 77
    scores = (
        torch.randint(-3, 4, (4, n), generator=gen).float()
        if levels
        else torch.randn(4, n, generator=gen)
    )
    scores[1, 100:] = float("-inf")
    scores[2, :2900] = float("-inf")  # 100 finite, at the end
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
    scores = (
        torch.randint(-3, 4, (4, n), generator=gen).float()
        if levels
        else torch.randn(4, n, generator=gen)
    )
    scores[1] = float("-inf")
    scores[2, :2950] = float("-inf")  # 50 < k finite
    out = torch.full((4, k), -1, dtype=torch.int32)
    tk.radix_topk(scores, k, out, one_launch=one_launch)
    for r in range(4):
        assert out[r].tolist() == _deterministic_topk(scores[r], k), r


def test_one_launch_form_only_where_programs_can_wait_on_each_other():
    cpu = torch.device("cpu")
    assert tk._one_launch(cpu, 4, 1)  # one program per row: nothing to wait for
    assert not tk._one_launch(cpu, 8, 2)  # the interpreter runs programs one by one


def _bounded_rows(gen, n: int, k: int, ratio: int, levels: int | None):
    """Rows whose bounds cross 4, 8, k, 128, 256 and the row's end (one past it: clamped), 0 by
    request -1 (at a long position) and by position; token positions giving them at ``ratio``
    (any of the ratio positions per bound); random scores, one row with -inf inside its prefix.
    Returns scores, row_pos, row_req, the bounds."""
    lens = [
        ln
        for ln in (0, 0, 1, 3, 4, 5, 7, 8, 9, k - 1, k + 1, 127, 128, 129, 255, 256, 257, n - 1, n)
        if ln <= n
    ] + [n + 50]
    t = len(lens)
    pos = torch.tensor(
        [ratio * ln - 1 + int(torch.randint(0, ratio, (1,), generator=gen)) for ln in lens]
    )
    req = torch.randint(0, 3, (t,), generator=gen, dtype=torch.int32)
    req[0], pos[0] = -1, ratio * n  # no request: nothing
    scores = (
        torch.randint(-3, 4, (t, n), generator=gen).float()
        if levels
        else torch.randn(t, n, generator=gen) * 10
    )
    scores[-3, 5:200:7] = float("-inf")  # holes in a prefix
    return scores, pos, req, [0] + [min(n, ln) for ln in lens[1:]]


# (one_launch, block, n, k): one program per row, 3 per row, 3 and 6 small ones per short row
FORMS = [
    (True, None, 300, 40),
    (False, None, 300, 40),
    (False, 128, 300, 40),
    (False, 4, 24, 6),
    (False, 8, 24, 6),
]


@pytest.mark.parametrize("one_launch,block,n,k", FORMS)
@pytest.mark.parametrize("ratio,levels", [(4, None), (1, None), (4, 7)])
def test_bounded_equals_unbounded_on_inf_tails(gen, one_launch, block, n, k, ratio, levels):
    """Rows whose scores past their bound are -inf (what the indexer's full stores leave): the
    bounded call gives the unbounded call's output bit for bit, in the one-launch form (one
    program per row here; a row of bound 0 has no live program) and the multi-launch form with 1,
    3 and 3-6 programs per row (the arrival counts wait for the live blocks only)."""
    scores, pos, req, lens = _bounded_rows(gen, n, k, ratio, levels)
    for r, ln in enumerate(lens):
        scores[r, ln:] = float("-inf")
    want = _unfilled(len(lens), k)
    tk.radix_topk(scores, k, want, block=block, one_launch=one_launch)
    got = _unfilled(len(lens), k)
    tk.radix_topk(
        scores, k, got, block=block, one_launch=one_launch, row_pos=pos, row_req=req, ratio=ratio
    )
    assert torch.equal(got, want)
    for r in range(len(lens)):
        assert got[r].tolist() == _deterministic_topk(scores[r], k), r


@pytest.mark.parametrize("one_launch,block,n,k", FORMS)
@pytest.mark.parametrize("poison", [1e30, float("nan"), float("inf")])
def test_bounded_never_reads_past_the_bound(gen, one_launch, block, n, k, poison):
    """Scores past each row's bound poisoned (large finite, NaN, +inf: each would be selected or
    break the select if read): the bounded call still returns the exact top-k of the first
    row_len scores (as a set: torch.topk of the prefix; and the contract's exact order)."""
    ratio = 4
    scores, pos, req, lens = _bounded_rows(gen, n, k, ratio, None)
    clean = scores.clone()
    for r, ln in enumerate(lens):
        scores[r, ln:] = poison
        clean[r, ln:] = float("-inf")
    out = _unfilled(len(lens), k)
    tk.radix_topk(
        scores, k, out, block=block, one_launch=one_launch, row_pos=pos, row_req=req, ratio=ratio
    )
    for r, ln in enumerate(lens):
        prefix = clean[r, :ln]
        want = min(k, int(torch.isfinite(prefix).sum()))
        top = set(torch.topk(prefix, want).indices.tolist()) if want else set()
        assert set(out[r, :want].tolist()) == top and (out[r, want:] == -1).all(), (r, ln)
        assert out[r].tolist() == _deterministic_topk(clean[r], k), (r, ln)


def test_bounded_rejects_bad_arguments():
    s = torch.zeros(2, 8)
    out = torch.full((2, 4), -1, dtype=torch.int32)
    with pytest.raises(ValueError, match="together"):
        tk.radix_topk(s, 4, out, row_pos=torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="int32 or int64"):
        tk.radix_topk(
            s,
            4,
            out,
            row_pos=torch.zeros(3, dtype=torch.long),
            row_req=torch.zeros(3, dtype=torch.int32),
        )


@pytest.mark.parametrize("relaxed", [True, False])
@pytest.mark.parametrize("one_launch", [True, False])
def test_histogram_atomic_order_changes_no_bit(gen, monkeypatch, relaxed, one_launch):
    """``HIST_RELAXED`` (the histogram atomics relaxed or acq_rel; the sweep compares them) gives
    the contract's exact output in both forms, bounded and not, ties and -inf rows included.
    (The interpreter runs programs one by one: the multi-launch form here has 3 per row; the
    GPU sweep compares every config's output with the default's.)"""
    monkeypatch.setattr(tk, "HIST_RELAXED", relaxed)
    monkeypatch.setattr(tk, "INTERP_BLOCK", 4096 if one_launch else 1024)
    t, n, k = 3, 3000, 64
    scores = torch.randn(t, n, generator=gen)
    scores[1, ::3] = scores[1, 0]  # ties
    scores[2] = float("-inf")
    out = _unfilled(t, k)
    tk.radix_topk(scores, k, out, one_launch=one_launch)
    for r in range(t):
        assert out[r].tolist() == _deterministic_topk(scores[r], k), r
    pos, req = torch.tensor([4 * 2500 - 1, 4 * n, 7]), torch.tensor([0, 0, -1])
    out = _unfilled(t, k)
    tk.radix_topk(scores, k, out, one_launch=one_launch, row_pos=pos, row_req=req, ratio=4)
    assert out[0].tolist() == _deterministic_topk(scores[0, :2500], k)
    assert out[1].tolist() == _deterministic_topk(scores[1], k)
    assert (out[2] == -1).all()


def test_block_rule_fits_one_launch_first():
    """The GPU block rule: the smallest of 512 / 1,024 / 2,048 scores per program whose programs
    all fit one launch, else 2,048 (the multi-launch form); warps 4 up to 1,024, 8 above."""
    assert tk.auto_block(1, 32768, 132) == 512
    assert tk.auto_block(4, 32768, 132) == 1024
    assert tk.auto_block(1, 262144, 132) == 2048
    assert tk.auto_block(32, 32768, 132) == 2048 and tk.auto_block(1, 32768, 0) == 2048
    assert tk.auto_block(1, 2048, 132) == 512
    assert [tk.one_launch_warps(b) for b in (512, 1024, 2048)] == [4, 4, 8]


@pytest.mark.parametrize("one_launch,block", [(True, None), (False, None), (False, 64)])
def test_writes_every_slot_below_k_and_none_past_it(gen, one_launch, block):
    """No fill before the call: rows with fewer finite scores than k, an all -inf row and a row
    of bound 0 get their -1 tails from the kernels; columns >= k of a wider output are kept."""
    t, n, k = 4, 300, 40
    scores = torch.randn(t, n, generator=gen)
    scores[0, 25:] = float("-inf")
    scores[1] = float("-inf")
    out = torch.full((t, k + 5), 77, dtype=torch.int32)
    tk.radix_topk(scores, k, out, block=block, one_launch=one_launch)
    for r in range(t):
        assert out[r, :k].tolist() == _deterministic_topk(scores[r], k), r
    assert (out[:, k:] == 77).all()
    pos, req = torch.tensor([2, 4 * n, 4 * n, 4 * 30 - 1]), torch.tensor([0, 0, -1, 0])
    out.fill_(77)
    tk.radix_topk(
        scores, k, out, block=block, one_launch=one_launch, row_pos=pos, row_req=req, ratio=4
    )
    assert (out[0, :k] == -1).all() and (out[2, :k] == -1).all()  # bound 0: no live block
    assert out[3, :k].tolist() == _deterministic_topk(scores[3, :30], k)
    assert (out[:, k:] == 77).all()
