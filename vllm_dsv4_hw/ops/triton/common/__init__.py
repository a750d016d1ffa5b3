# SPDX-License-Identifier: Apache-2.0
"""Helpers every Triton family shares: launch plans from declared capabilities (``launch``),
programmatic dependent launch (``pdl``), the e4m3 / e2m1 decodes (``ptx_codecs``), the in-kernel
codecs (``quant``) and the row-wise kernels' conventions (``rows``)."""
