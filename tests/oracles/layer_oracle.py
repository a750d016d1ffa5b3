# SPDX-License-Identifier: Apache-2.0
"""Float64 oracle of one whole DeepSeek V4 attention layer, written from the spec (sections 2-4).

One request at a time, the whole token sequence at once (causal), dense: explicit Python loops over
tokens, compressed entries and their member tokens, heads and output groups. Nothing here imports
the project's code; parameters come in by their official names as a plain dict of tensors.

Per token t (positions 0..L-1):
    q_r = RMSNorm_w(W_qa x_t); q_h = RoPE_t(RMSNorm(W_qb q_r)_h); k_t = RoPE_t(RMSNorm_w(W_kv x_t))
    candidates: window k_{max(0,t-127)..t}, then compressed entries
        ratio 128: every entry i with 128i+127 <= t
        ratio 4:   the top-k (explicit sort of the indexer scores) among entries with 4i+3 <= t
    o_h = sum_s e^(tau q.k_s - m) k_s / (sum_s e^(tau q.k_s - m) + e^(sink_h - m)), tau = 512^-0.5
    o_h <- inverse RoPE_t on its last 64 dims; y_g = W_oa[g] concat(o_h of group g); out = W_ob y
Compressed entry i (section 3): per-channel softmax pooling of its member tokens' W_kv x over
W_gate x + ape[p mod ratio], RMSNorm_w, RoPE at position ratio*i. Indexer (section 4): its own
ratio-4 compressor with d = 128; score(t, s) = sum_h w_{t,h} ReLU(q^I_{t,h} . k^I_s),
w_t = W_w x_t * 128^-0.5 * 64^-0.5.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

F64 = torch.float64


@dataclass(frozen=True)
class OracleDims:
    hidden: int
    heads: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    index_topk: int
    head_dim: int = 512
    rope_dim: int = 64
    index_heads: int = 64
    index_dim: int = 128
    window: int = 128
    eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn_factor: float = 16.0
    yarn_original_max: int = 65536
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0


@dataclass
class OracleResult:
    out: torch.Tensor  # [L, hidden] float64
    selected: list[list[int]] = field(default_factory=list)  # per token: compressed entries used
    scores: list[list[float]] = field(default_factory=list)  # per token: indexer score per entry
    margins: list[float] = field(default_factory=list)  # per token: top-k boundary gap / max|score|


def _one_thread(fn):
    """Run on one intra-op thread: the oracle is thousands of tiny ops, which extra threads only
    slow down (badly so on a loaded machine)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        n = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


# -- primitives ----------------------------------------------------------------------------------
def _rms(v: torch.Tensor, w: torch.Tensor | None, eps: float) -> torch.Tensor:
    ms = (v * v).sum(-1, keepdim=True) / v.shape[-1]
    out = v / torch.sqrt(ms + eps)
    return out * w if w is not None else out


def _freqs(dims: OracleDims, ratio: int) -> list[float]:
    r = dims.rope_dim
    theta = dims.rope_theta if ratio == 0 else dims.compress_rope_theta
    base = [theta ** (-(2.0 * j) / r) for j in range(r // 2)]
    if ratio == 0:
        return base

    def corr(rotations: float) -> float:
        return (
            r
            * math.log(dims.yarn_original_max / (rotations * 2.0 * math.pi))
            / (2.0 * math.log(theta))
        )

    lo = max(math.floor(corr(dims.yarn_beta_fast)), 0)
    hi = min(math.ceil(corr(dims.yarn_beta_slow)), r - 1)
    out = []
    for j in range(r // 2):
        ramp = min(max((j - lo) / ((hi - lo) if hi != lo else 0.001), 0.0), 1.0)
        out.append(base[j] * (1.0 - ramp) + base[j] / dims.yarn_factor * ramp)
    return out


def _rope(v: torch.Tensor, pos: int, freqs: list[float], inverse: bool = False) -> torch.Tensor:
    """Rotate pairs (2j, 2j+1) of the last 2*len(freqs) dims of v [..., D] by +-pos*f_j."""
    r = 2 * len(freqs)
    sign = -1.0 if inverse else 1.0
    cos = torch.tensor([math.cos(pos * f) for f in freqs], dtype=F64)
    sin = torch.tensor([sign * math.sin(pos * f) for f in freqs], dtype=F64)
    out = v.clone()
    d = v.shape[-1]
    a = v[..., d - r :: 2]
    b = v[..., d - r + 1 :: 2]
    out[..., d - r :: 2] = a * cos - b * sin
    out[..., d - r + 1 :: 2] = a * sin + b * cos
    return out


def _compressed_entries(
    x: torch.Tensor, p: dict, prefix: str, ratio: int, d: int, freqs: list[float], eps: float
) -> list[torch.Tensor]:
    """Every complete entry of the sequence x [L, hidden] (explicit loops over entries and
    member tokens; per-channel softmax)."""
    wkv = p[f"{prefix}.wkv.weight"]
    wgate = p[f"{prefix}.wgate.weight"]
    ape = p[f"{prefix}.ape"]
    norm = p[f"{prefix}.norm.weight"]
    entries = []
    for i in range(x.shape[0] // ratio):
        kvs, gates = [], []
        if ratio == 4:
            for tok in range(4 * i - 4, 4 * i):  # previous group: channels [0, d)
                if tok < 0:
                    continue  # absent: weight exp(-inf) = 0
                kvs.append((wkv @ x[tok])[:d])
                gates.append((wgate @ x[tok] + ape[tok % ratio])[:d])
            for tok in range(4 * i, 4 * i + 4):  # own group: channels [d, 2d)
                kvs.append((wkv @ x[tok])[d:])
                gates.append((wgate @ x[tok] + ape[tok % ratio])[d:])
        else:
            for tok in range(ratio * i, ratio * i + ratio):
                kvs.append(wkv @ x[tok])
                gates.append(wgate @ x[tok] + ape[tok % ratio])
        g = torch.stack(gates)  # [M, d]
        e = torch.exp(g - g.max(dim=0).values)
        wts = e / e.sum(dim=0)
        pooled = (wts * torch.stack(kvs)).sum(dim=0)
        entries.append(_rope(_rms(pooled, norm, eps), ratio * i, freqs))
    return entries


# -- the indexer ---------------------------------------------------------------------------------
def _params64(params: dict) -> dict:
    return {k: v.detach().to("cpu", F64) for k, v in params.items()}


def _indexer_scores(
    p: dict,
    dims: OracleDims,
    x: torch.Tensor,
    q_r: list[torch.Tensor],
    freqs: list[float],
    ikeys=None,
) -> list[list[float]]:
    """score(t, s) for every token t and every entry s visible to it (4s+3 <= t)."""
    if ikeys is None:
        ikeys = _compressed_entries(x, p, "indexer.compressor", 4, dims.index_dim, freqs, dims.eps)
    out = []
    for t in range(x.shape[0]):
        visible = (t + 1) // 4
        qi = (p["indexer.wq_b.weight"] @ q_r[t]).reshape(dims.index_heads, dims.index_dim)
        qi = _rope(qi, t, freqs)
        w = (p["indexer.weights_proj.weight"] @ x[t]) * (
            dims.index_dim**-0.5 * dims.index_heads**-0.5
        )
        scores = []
        for s in range(visible):  # heads summed as one vector op
            scores.append(float((w * torch.clamp(qi @ ikeys[s], min=0.0)).sum()))
        out.append(scores)
    return out


def _top_k(scores: list[float], k: int) -> tuple[list[int], float]:
    """(the k best entries by explicit sort, boundary gap / max|score|; inf if nothing competes)."""
    order = sorted(range(len(scores)), key=lambda s: -scores[s])
    k = min(k, len(scores))
    if len(scores) <= k:
        return order, math.inf
    top = max(abs(v) for v in scores) or 1.0
    return order[:k], (scores[order[k - 1]] - scores[order[k]]) / top


@_one_thread
def indexer_choices(
    params: dict, dims: OracleDims, x: torch.Tensor, keys: torch.Tensor | None = None
) -> tuple[list[list[int]], list[list[float]], list[float]]:
    """(selected entries sorted, scores, margins) per token of a c4a layer for one request.

    ``keys`` [N, index_dim] replaces the oracle's own indexer keys (e.g. by keys read back from a
    quantized cache) to see which choice those keys imply."""
    p = _params64(params)
    x = x.detach().to("cpu", F64)
    freqs = _freqs(dims, 4)
    q_r = [_rms(p["wq_a.weight"] @ x[t], p["q_norm.weight"], dims.eps) for t in range(x.shape[0])]
    ikeys = None if keys is None else list(keys.detach().to("cpu", F64))
    scores = _indexer_scores(p, dims, x, q_r, freqs, ikeys)
    sel, margins = [], []
    for sc in scores:
        chosen, margin = _top_k(sc, dims.index_topk)
        sel.append(sorted(chosen))
        margins.append(margin)
    return sel, scores, margins


# -- the layer -----------------------------------------------------------------------------------
@_one_thread
def layer_oracle(
    params: dict,
    dims: OracleDims,
    ratio: int,
    x: torch.Tensor,
    forced_selection: dict[int, list[int]] | None = None,
) -> OracleResult:
    """Outputs of the layer for one request's tokens x [L, hidden] (positions 0..L-1).

    ``forced_selection`` {t: entries} replaces the indexer's choice at token t (used only where a
    test has shown that the choices differ at a near-tie of the oracle's own scores).
    """
    p = _params64(params)
    x = x.detach().to("cpu", F64)
    n_tok = x.shape[0]
    h_n, d, eps = dims.heads, dims.head_dim, dims.eps
    freqs = _freqs(dims, ratio)
    tau = d**-0.5

    q_r = [_rms(p["wq_a.weight"] @ x[t], p["q_norm.weight"], eps) for t in range(n_tok)]
    keys = [
        _rope(_rms(p["wkv.weight"] @ x[t], p["kv_norm.weight"], eps), t, freqs)
        for t in range(n_tok)
    ]
    entries = _compressed_entries(x, p, "compressor", ratio, d, freqs, eps) if ratio else []
    iscores = _indexer_scores(p, dims, x, q_r, freqs) if ratio == 4 else []

    res = OracleResult(out=torch.zeros(n_tok, dims.hidden, dtype=F64))
    g_n = dims.o_groups
    heads_per_group = h_n // g_n
    wo_a = p["wo_a.weight"].reshape(g_n, dims.o_lora_rank, heads_per_group * d)
    for t in range(n_tok):
        qh = (p["wq_b.weight"] @ q_r[t]).reshape(h_n, d)
        qh = torch.stack([_rope(_rms(qh[h], None, eps), t, freqs) for h in range(h_n)])

        # Window candidates (t included), then compressed ones, no de-duplication.
        cands = [keys[s] for s in range(max(0, t - dims.window + 1), t + 1)]
        chosen: list[int] = []
        if ratio == 128:
            chosen = [i for i in range(len(entries)) if 128 * i + 127 <= t]
        elif ratio == 4:
            visible = [i for i in range(len(entries)) if 4 * i + 3 <= t]
            assert len(visible) == len(iscores[t])
            chosen, margin = _top_k(iscores[t], dims.index_topk)
            res.scores.append(iscores[t])
            res.margins.append(margin)
            if forced_selection is not None and t in forced_selection:
                chosen = list(forced_selection[t])
            assert all(i in visible for i in chosen)
        res.selected.append(sorted(chosen))
        cands += [entries[i] for i in chosen]
        kmat = torch.stack(cands)  # [N, D]; K = V

        o = torch.zeros(h_n, d, dtype=F64)
        for h in range(h_n):
            logits = tau * (kmat @ qh[h])  # [N]
            sink = p["attn_sink"][h]
            m = torch.maximum(logits.max(), sink)
            ex = torch.exp(logits - m)
            o[h] = (ex @ kmat) / (ex.sum() + torch.exp(sink - m))
        o = torch.stack([_rope(o[h], t, freqs, inverse=True) for h in range(h_n)])

        ys = []
        for g in range(g_n):
            og = o[g * heads_per_group : (g + 1) * heads_per_group].reshape(-1)
            ys.append(wo_a[g] @ og)
        res.out[t] = p["wo_b.weight"] @ torch.cat(ys)
    return res
