# SPDX-License-Identifier: Apache-2.0
"""A CPU stand-in for ``torch_npu``, for tests only.

Importable only while ``tests/stubs`` is on ``sys.path`` (``tests/conftest.py`` puts it there for
the test session); nothing outside the tests can import it, so a real ``import torch_npu`` elsewhere
still fails (or finds the real package).

It is not Ascend. Every operator here is written in PyTorch from the public torch_npu API
documentation (Ascend/op-plugin ``docs/zh/custom_APIs/torch_npu``), runs on CPU tensors, and
enforces the documented constraints the npu backend relies on. Tests therefore check the npu
backend's *composition* (argument layouts, reshapes, masks, post-processing and fallbacks), not the
hardware: numerics, performance and undocumented behaviour of the real operators are unknown here.

Like the real package, importing it names the PrivateUse1 device ``npu`` (so ``torch.device("npu")``
parses) and registers ``torch.npu``; ``torch.npu.is_available()`` stays False until a test sets
``torch_npu._control.available = True``.
"""

from __future__ import annotations

import torch

from torch_npu import (
    _control,  # noqa: F401  (tests: torch_npu._control)
    npu,  # noqa: F401
)
from torch_npu._ops import (  # noqa: F401
    npu_fused_infer_attention_score,
    npu_lightning_indexer,
    npu_rms_norm,
    npu_rotary_mul,
    npu_scatter_nd_update,
    npu_scatter_nd_update_,
)

__version__ = "0.0.0+stub"
IS_STUB = True

if torch._C._get_privateuse1_backend_name() in ("privateuse1", "privateuseone"):
    torch.utils.rename_privateuse1_backend("npu")
if not hasattr(torch, "npu"):
    torch._register_device_module("npu", npu)
