# SPDX-License-Identifier: Apache-2.0
"""A torch_npu operator that raises at run time (documented in ops/npu/_vendor.py and
docs/npu-ops.md): under automatic selection the op logs one warning naming the op and the error and
falls back to the reference for the rest of the process (the failed call is served too); when the
npu backend was requested explicitly the error is raised with what to do. Our own input
validation errors are never swallowed."""

from __future__ import annotations

import logging

import pytest
import torch

from tests.backends import impl
from vllm_dsv4_hw import ops
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api
from vllm_dsv4_hw.ops.npu import NpuOpFailedError, disabled_ops, reset_fallbacks

AICORE = "EZ9999: Inner Error! aicore exception, errorStr: timeout or trap error"


def _warnings(caplog):
    return [r for r in caplog.records if r.levelno == logging.WARNING]


def test_vendor_failure_falls_back_once_with_one_warning(stub, gen, caplog):
    stub._control.fail("npu_rms_norm", RuntimeError(AICORE))
    f = impl(api.RMS_NORM, "npu")
    x = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    w = torch.rand(512, generator=gen).to(torch.bfloat16)
    want = impl(api.RMS_NORM, "reference")(x, w, 1e-6)
    with caplog.at_level(logging.WARNING):
        first = f(x, w, 1e-6)
        later = [f(x, w, 1e-6) for _ in range(3)]
    assert torch.equal(first, want) and all(torch.equal(y, want) for y in later)
    warnings = _warnings(caplog)
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "npu op rms_norm" in msg and "npu_rms_norm failed" in msg and "EZ9999" in msg
    assert "reference implementation" in msg
    assert stub._control.calls["npu_rms_norm"] == 1  # never tried again
    assert set(disabled_ops()) == {api.RMS_NORM}


def test_fallback_is_per_op(stub, gen, caplog):
    stub._control.fail("npu_fused_infer_attention_score", RuntimeError(AICORE))
    # a failing attention operator leaves the other ops on their vendor paths
    x = torch.randn(3, 2, 512, generator=gen).to(torch.bfloat16)
    fmt = make_format("bf16", "main", 64)
    cache = fmt.new_cache(2)
    ops_npu = {op: impl(op, "npu") for op in (api.SPARSE_ATTENTION, api.ROPE)}
    ops_npu[api.SPARSE_ATTENTION](
        x, cache, torch.zeros(3, 4, dtype=torch.long), None, None, fmt, torch.zeros(2), 0.05
    )
    ops_npu[api.ROPE](x, torch.tensor([1, 2, 3]), torch.randn(8, 64))
    assert set(disabled_ops()) == {api.SPARSE_ATTENTION}
    assert stub._control.calls["npu_rotary_mul"] == 1


def test_failed_composite_still_correct(stub, gen):
    """qnorm_rope_kv_insert composes npu rms_norm / rope / kv_insert: a failing scatter leaves
    q_out on the vendor path and the insert on the reference, with the same bytes."""
    from vllm_dsv4_hw.ops.reference.rope import rope_cos_sin

    stub._control.fail("npu_scatter_nd_update_", RuntimeError(AICORE), times=1)
    fmt = make_format("bf16", "main", 8)
    tab = rope_cos_sin(10000.0, 64, 64)
    q = torch.randn(4, 2, 512, generator=gen).to(torch.bfloat16)
    kv = torch.randn(4, 512, generator=gen).to(torch.bfloat16)
    pos, slots = torch.tensor([0, 5, 9, 63]), torch.tensor([3, -1, 7, 12])
    got_cache, want_cache = fmt.new_cache(2), fmt.new_cache(2)
    got = impl(api.QNORM_ROPE_KV_INSERT, "npu")(q, kv, pos, tab, 1e-6, got_cache, slots, fmt)
    want = impl(api.QNORM_ROPE_KV_INSERT, "reference")(
        q, kv, pos, tab, 1e-6, want_cache, slots, fmt
    )
    assert torch.equal(got_cache, want_cache)
    torch.testing.assert_close(got.double(), want.double(), rtol=2**-7, atol=1e-5)
    assert set(disabled_ops()) == {api.KV_INSERT}


@pytest.mark.parametrize(
    "var,value", [("VLLM_DSV4_HW_BACKEND", "npu"), ("VLLM_DSV4_HW_OP_BACKENDS", "rope=npu")]
)
def test_explicit_request_raises_instead_of_falling_back(stub, gen, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    stub._control.fail("npu_rotary_mul", RuntimeError(AICORE))
    x = torch.randn(2, 512, generator=gen)
    with pytest.raises(NpuOpFailedError) as exc:
        impl(api.ROPE, "npu")(x, torch.tensor([1, 2]), torch.randn(4, 64))
    msg = str(exc.value)
    assert "npu op rope" in msg and "npu_rotary_mul failed" in msg and "EZ9999" in msg
    assert var in msg and "no fallback" in msg and f"unset {var}" in msg
    assert disabled_ops() == {}


def test_dispatched_call_on_an_npu_device_falls_back(npu_device, gen, monkeypatch, caplog):
    """Through the dispatcher, with 'npu' resolving to the npu backend (device type from a
    string: the stub's tensors stay on the CPU, so the resolved function is called directly)."""
    res = ops.REGISTRY.resolve(api.RMS_NORM, "npu")
    assert res.impl.backend == "npu"
    npu_device._control.fail("npu_rms_norm", RuntimeError(AICORE))
    x = torch.randn(3, 64, generator=gen)
    with caplog.at_level(logging.WARNING):
        y = res.impl.fn(x, None, 1e-6)
    torch.testing.assert_close(y, impl(api.RMS_NORM, "reference")(x, None, 1e-6))
    assert len(_warnings(caplog)) == 1


def test_validation_errors_are_not_vendor_failures(stub):
    with pytest.raises(ValueError, match="weight shape"):
        impl(api.RMS_NORM, "npu")(torch.ones(2, 8), torch.ones(7), 1e-6)
    fmt = make_format("fp8", "main", 4)
    with pytest.raises(ValueError, match="slots must be -1 or in"):
        impl(api.KV_INSERT, "npu")(fmt.new_cache(1), torch.tensor([9]), torch.zeros(1, 512), fmt)
    assert disabled_ops() == {}


def test_reset_fallbacks_reenables_the_vendor_path(stub, gen):
    stub._control.fail("npu_rms_norm", RuntimeError(AICORE), times=1)
    f = impl(api.RMS_NORM, "npu")
    x = torch.randn(2, 16, generator=gen)
    f(x, None, 1e-6)
    assert api.RMS_NORM in disabled_ops()
    reset_fallbacks()
    f(x, None, 1e-6)
    assert stub._control.calls["npu_rms_norm"] == 2 and disabled_ops() == {}
