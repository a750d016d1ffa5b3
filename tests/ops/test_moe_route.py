# SPDX-License-Identifier: Apache-2.0
"""``moe_route`` (DeepSeek V4's router) on every CPU backend against a float64 oracle written per
token: scores, top-k by repeated maximum with the lower expert id first among equal values (the
contract's tie rule), hash rows, renormalisation and scaling.

Inputs are redrawn until every token's k-th and (k+1)-th selection values differ by more than
``MIN_GAP`` (the fp32 / bf16 paths err far less), so ids compare exactly; the tie rule is checked
on exact ties made by duplicated gate rows (equal rows give equal scores in any summation order)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.backends import cpu_backends, impl
from vllm_dsv4_hw.ops.api import MOE_ROUTE

MIN_GAP = 1e-3
TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 1e-5}


def _oracle(x, gate_w, bias, hash_ids, k, norm, scaling):
    t, e = x.shape[0], gate_w.shape[0]
    ws, ids = [], []
    for i in range(t):
        logits = [float((x[i].double() * gate_w[j].double()).sum()) for j in range(e)]
        s = [math.sqrt(math.log1p(math.exp(v)) if v < 20 else v) for v in logits]
        if hash_ids is not None:
            pick = [int(v) for v in hash_ids[i]]
        else:
            sel = [s[j] + (float(bias[j]) if bias is not None else 0.0) for j in range(e)]
            pick = []
            for _ in range(k):
                best = max(v for j, v in enumerate(sel) if j not in pick)
                pick.append(min(j for j, v in enumerate(sel) if v == best and j not in pick))
        w = [s[j] for j in pick]
        if norm:
            total = sum(w) + 1e-20
            w = [v / total for v in w]
        ws.append([v * scaling for v in w])
        ids.append(pick)
    return (
        torch.tensor(ws, dtype=torch.float64).view(t, k),
        torch.tensor(ids, dtype=torch.int64).view(t, k),
    )


def _gap_ok(x, gate_w, bias, k) -> bool:
    s = torch.nn.functional.softplus(x.double() @ gate_w.double().T).sqrt()
    sel = s + (bias.double() if bias is not None else 0)
    if sel.shape[0] == 0 or k >= sel.shape[1]:
        return True
    top = sel.sort(dim=-1, descending=True).values
    return bool((top[:, k - 1] - top[:, k] > MIN_GAP).all())


def _case(gen, t, e, d, k, dtype, with_bias):
    for _ in range(50):
        x = (torch.randn(t, d, generator=gen, dtype=torch.float64)).to(dtype)
        gate_w = (torch.randn(e, d, generator=gen, dtype=torch.float64) / math.sqrt(d)).float()
        bias = (
            (torch.randn(e, generator=gen, dtype=torch.float64) * 0.1).float()
            if with_bias
            else None
        )
        if _gap_ok(x, gate_w, bias, k):
            return x, gate_w, bias
    raise AssertionError("could not draw well-separated router inputs")


def _check(got, want, dtype):
    (w, ids), (w_ref, ids_ref) = got, want
    assert ids.dtype == torch.int64 and torch.equal(ids, ids_ref), (ids, ids_ref)
    assert w.shape == w_ref.shape
    if w_ref.numel():
        err = float((w.double() - w_ref).abs().max() / w_ref.abs().max())
        assert err <= TOL[dtype], err


@pytest.mark.parametrize("backend", cpu_backends(MOE_ROUTE))
@pytest.mark.parametrize(
    "t,e,d,k", [(0, 12, 64, 6), (1, 12, 64, 6), (5, 256, 96, 6), (33, 16, 64, 1), (4, 16, 128, 8)]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias,norm", [(True, True), (False, False)])
def test_topk_routing_matches_oracle(backend, t, e, d, k, dtype, with_bias, norm, gen):
    x, gate_w, bias = _case(gen, t, e, d, k, dtype, with_bias)
    got = impl(MOE_ROUTE, backend)(x, gate_w, bias, None, k, norm, 1.5)
    _check(got, _oracle(x, gate_w, bias, None, k, norm, 1.5), dtype)


@pytest.mark.parametrize("backend", cpu_backends(MOE_ROUTE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hash_routing_keeps_the_rows_order(backend, dtype, gen):
    x, gate_w, _ = _case(gen, 7, 12, 64, 6, dtype, False)
    hash_ids = torch.stack([torch.randperm(12, generator=gen)[:6] for _ in range(7)])
    got = impl(MOE_ROUTE, backend)(x, gate_w, None, hash_ids, 6, True, 2.5)
    _check(got, _oracle(x, gate_w, None, hash_ids, 6, True, 2.5), dtype)


@pytest.mark.parametrize("backend", cpu_backends(MOE_ROUTE))
def test_equal_values_select_the_lower_expert_id_first(backend, gen):
    """Gate rows 3, 7 and 9 equal (so their scores are equal bit for bit), the largest: slots
    0..2 are experts 3, 7, 9 in that order."""
    x = torch.randn(4, 64, generator=gen).abs()
    gate_w = torch.randn(12, 64, generator=gen) * 0.01
    for j in (9, 3, 7):
        gate_w[j] = 0.05  # logits ~ 0.05 * sum|x| ~ 2.5, far above the others' ~ 0.1
    w, ids = impl(MOE_ROUTE, backend)(x, gate_w, None, None, 4, True, 1.0)
    assert ids[:, :3].tolist() == [[3, 7, 9]] * 4, ids


@pytest.mark.parametrize("backend", cpu_backends(MOE_ROUTE))
def test_bad_arguments_are_named(backend, gen):
    x, gate_w, bias = _case(gen, 2, 12, 64, 6, torch.float32, True)
    fn = impl(MOE_ROUTE, backend)
    with pytest.raises(ValueError, match="top_k"):
        fn(x, gate_w, bias, None, 13, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        fn(x, gate_w, bias[:-1], None, 6, True, 1.0)
    with pytest.raises(ValueError, match="hash_ids"):
        fn(x, gate_w, None, torch.zeros(2, 5, dtype=torch.int64), 6, True, 1.0)
