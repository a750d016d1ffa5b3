# SPDX-License-Identifier: Apache-2.0
"""Float64 oracle of the DeepSeek V4 lightning indexer, written from the spec (section 4) alone.

I(t, s) = sum_h w[t,h] * ReLU(q[t,h] . k[s]); entry s is visible to the token at position t
iff 4s + 3 <= t (ratio*s + ratio - 1 in general); top-k over the visible entries with
k = min(topk, visible). Explicit Python loops per token and per entry.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def visible_count(pos: int, ratio: int = 4) -> int:
    return sum(1 for s in range(pos // ratio + 2) if ratio * s + ratio - 1 <= pos)


def token_scores(
    q_t: torch.Tensor, w_t: torch.Tensor, keys: torch.Tensor, pos: int, ratio: int = 4
) -> torch.Tensor:
    """Scores of one token (q_t [H, D], w_t [H]) against its visible entries -> [visible] f64."""
    n = min(visible_count(pos, ratio), keys.shape[0])
    q_t = q_t.to(F64)
    w_t = w_t.to(F64)
    out = torch.empty(n, dtype=F64)
    for s in range(n):
        k = keys[s].to(F64)
        out[s] = (w_t * torch.relu(q_t @ k)).sum()
    return out


def expected_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys_per_req: list[torch.Tensor],
    token_req: list[int],
    token_pos: list[int],
    topk: int,
    ratio: int = 4,
):
    """Per token: (scores of its visible entries [visible] f64, k = min(topk, visible))."""
    out = []
    for t in range(q.shape[0]):
        sc = token_scores(q[t], weights[t], keys_per_req[token_req[t]], token_pos[t], ratio)
        out.append((sc, min(topk, sc.numel())))
    return out


def check_selection(selected: torch.Tensor, scores: torch.Tensor, k: int, tol: float) -> str | None:
    """Judge one token's output row against the oracle scores; None if fine, else why not.

    Requirements: the first k indices are distinct visible entries, the rest -1, in any order
    (the contract's selection is a set; the reference's descending order is tested on its own);
    the set is a top-k set: where the oracle's k-th and
    (k+1)-th scores are more than tol apart the set must equal the oracle's exactly, otherwise
    every selected score must be >= the oracle's k-th score - tol.
    """
    sel = [int(v) for v in selected.tolist()]
    head, tail = sel[:k], sel[k:]
    if any(v != -1 for v in tail):
        return f"expected -1 after the first {k} slots, got {tail}"
    n = scores.numel()
    if any(v < 0 or v >= n for v in head):
        return f"selected indices {head} not all within the {n} visible entries"
    if len(set(head)) != k:
        return f"duplicate indices in {head}"
    if k == 0:
        return None
    order = sorted(range(n), key=lambda s: -float(scores[s]))
    kth = float(scores[order[k - 1]])
    gap = kth - float(scores[order[k]]) if k < n else float("inf")
    if gap > tol:
        if set(head) != set(order[:k]):
            return f"set {sorted(head)} != oracle top-{k} {sorted(order[:k])}"
    else:
        low = min(float(scores[s]) for s in head)
        if low < kth - tol:
            return f"selected score {low} below the oracle's k-th {kth} - {tol}"
    return None
