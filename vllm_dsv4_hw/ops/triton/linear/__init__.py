# SPDX-License-Identifier: Apache-2.0
"""The linear family: ``fp8_block_linear`` (the op, ``fp8_block_linear``: the W8A16 tiles in
``block``, the W8A8 tiles in ``w8a8``, the one-row GEMV in ``gemv``), ``dense_linear`` (``dense``)
and the split-K partial sums every GEMM shares (``split_k``)."""
