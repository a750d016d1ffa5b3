"""grouped_o_proj conformance against an explicit per-group, per-head float64 oracle."""

import pytest
import torch

from tests.backends import cpu_backends, impl
from tests.oracles import grouped_o_proj_oracle
from vllm_dsv4_hw.ops.api import GROUPED_O_PROJ


def _inputs(gen, t, h, d, g, r, hidden, dtype):
    o = torch.randn(t, h, d, generator=gen, dtype=torch.float64).to(dtype)
    wo_a = (torch.randn(g, r, (h // g) * d, generator=gen, dtype=torch.float64)
            * ((h // g) * d) ** -0.5).to(dtype)
    wo_b = (torch.randn(hidden, g * r, generator=gen, dtype=torch.float64) * (g * r) ** -0.5).to(dtype)
    return o, wo_a, wo_b


@pytest.mark.parametrize("backend", cpu_backends(GROUPED_O_PROJ))
@pytest.mark.parametrize("t,h,d,g,r,hidden", [
    (1, 1, 4, 1, 3, 5),
    (3, 4, 8, 2, 5, 7),
    (5, 6, 16, 3, 4, 9),
    (4, 8, 512, 8, 64, 96),     # real head dim, one head per group
    (2, 8, 512, 2, 128, 256),   # real head dim, four heads per group
    (0, 4, 8, 2, 5, 7),         # empty batch
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_grouped_o_proj_matches_oracle(backend, t, h, d, g, r, hidden, dtype, gen):
    o, wo_a, wo_b = _inputs(gen, t, h, d, g, r, hidden, dtype)
    out = impl(GROUPED_O_PROJ, backend)(o, wo_a, wo_b)
    ref = grouped_o_proj_oracle(o, wo_a, wo_b)
    assert out.shape == (t, hidden) and out.dtype == dtype
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", cpu_backends(GROUPED_O_PROJ))
def test_grouped_o_proj_bf16(backend, gen):
    o, wo_a, wo_b = _inputs(gen, 3, 8, 512, 4, 64, 128, torch.bfloat16)
    out = impl(GROUPED_O_PROJ, backend)(o, wo_a, wo_b)
    ref = grouped_o_proj_oracle(o, wo_a, wo_b)  # exact math on the same bf16 values
    assert out.dtype == torch.bfloat16
    # fp32 accumulation, one bf16 rounding of the result (plus any bf16 rounding of y).
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()))


@pytest.mark.parametrize("backend", cpu_backends(GROUPED_O_PROJ))
def test_grouped_o_proj_group_assignment(backend, gen):
    # Heads are grouped contiguously: only heads of group 1 are nonzero -> only y_1 contributes.
    t, h, d, g, r = 2, 6, 4, 3, 5
    o, wo_a, _ = _inputs(gen, t, h, d, g, r, 1, torch.float64)
    o[:, :2] = 0
    o[:, 4:] = 0
    eye = torch.eye(g * r, dtype=torch.float64)
    y = impl(GROUPED_O_PROJ, backend)(o, wo_a, eye)  # wo_b = I exposes concat_g y_g
    assert torch.count_nonzero(y[:, :r]) == 0 and torch.count_nonzero(y[:, 2 * r:]) == 0
    torch.testing.assert_close(y[:, r:2 * r], o[:, 2:4].reshape(t, 2 * d) @ wo_a[1].t())
