# SPDX-License-Identifier: Apache-2.0
"""``torch.ops._C_ascend.npu_scatter_nd_update_v2(var, indices, update)``, in PyTorch.

Read from vllm-ascend ``csrc/moe/scatter_nd_update_v2/op_host/scatter_nd_update_v2_def.cpp`` and
``csrc/torch_binding.cpp``: ScatterNd semantics written in place into ``var``,
``var[indices[i, 0], ..., indices[i, K-1]] = update[i]``, with ``var``'s strides handed to the
kernel (the difference from torch_npu's ``npu_scatter_nd_update_``: ``var`` may be a strided view,
e.g. the data part of every cache page). var / update dtypes: float16, float32, bfloat16, bool,
int64, int32, int16, int8 (no uint8); indices int32 or int64; SoCs ascend910b (A2), ascend910_93
(A3). The stub also refuses out-of-range indices (the kernel's behaviour there is not documented).
"""

from __future__ import annotations

import torch

from vllm_ascend_ops_stub._common import called, need

SCHEMA = "(Tensor(a!) var, Tensor indices, Tensor update) -> ()"
_DTYPES = (
    torch.float16,
    torch.float32,
    torch.bfloat16,
    torch.bool,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
)


def npu_scatter_nd_update_v2(
    var: torch.Tensor, indices: torch.Tensor, update: torch.Tensor
) -> None:
    op = "npu_scatter_nd_update_v2"
    called(op)
    need(var.dtype in _DTYPES, op, f"var dtype {var.dtype} is not supported (no uint8)")
    need(update.dtype == var.dtype, op, f"update dtype {update.dtype} != var dtype {var.dtype}")
    need(
        indices.dtype in (torch.int32, torch.int64),
        op,
        f"indices dtype {indices.dtype} must be int32 or int64",
    )
    need(indices.dim() >= 1, op, "indices must have a last dim K")
    k = indices.shape[-1]
    need(1 <= k <= var.dim(), op, f"indices' last dim {k} must be in [1, var.dim()]")
    want = tuple(indices.shape[:-1]) + tuple(var.shape[k:])
    need(
        tuple(update.shape) == want,
        op,
        f"update shape {tuple(update.shape)} must be indices.shape[:-1] + var.shape[K:] {want}",
    )
    flat = indices.reshape(-1, k).long()
    if flat.shape[0] == 0:
        return
    for j in range(k):
        col = flat[:, j]
        need(
            bool(((col >= 0) & (col < var.shape[j])).all()),
            op,
            f"indices column {j} out of range [0, {var.shape[j]})",
        )
    var[tuple(flat.t())] = update.reshape((-1,) + tuple(var.shape[k:]))
