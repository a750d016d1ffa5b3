# SPDX-License-Identifier: Apache-2.0
"""The kv_insert case both npu scatter paths run: fp8 entries into padded, 0xAB-filled pages with a
-1 slot, byte for byte against ``kv_cache.paged.insert_rows``."""

from __future__ import annotations

import torch

from tests.backends import impl
from vllm_dsv4_hw.kv_cache import paged
from vllm_dsv4_hw.kv_cache.formats import make_format
from vllm_dsv4_hw.ops import api


def assert_npu_insert_matches_paged(gen) -> None:
    fmt = make_format("fp8", "main", 4)
    cache = fmt.new_cache(3, page_bytes=fmt.min_page_bytes + 7).fill_(0xAB)
    want = cache.clone()
    x = torch.randn(3, 512, generator=gen)
    slots = torch.tensor([11, -1, 2])
    paged.insert_rows(want, slots, x, fmt)
    impl(api.KV_INSERT, "npu")(cache, slots, x, fmt)
    assert torch.equal(cache, want)
