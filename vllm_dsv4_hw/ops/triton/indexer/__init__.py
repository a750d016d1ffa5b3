# SPDX-License-Identifier: Apache-2.0
"""The ``indexer_topk`` family: the score pass (``score``), its launch rules (``launch``), the radix
top-k (``topk``, its state words in ``topk_digits``) and the op, scoring then selecting (``select``)."""
