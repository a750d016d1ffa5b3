# SPDX-License-Identifier: Apache-2.0
"""The ``sparse_attention`` family: the kernel and its op (``kernel``), the launch plan (``launch``)
and the tile helpers (``tiles``)."""
