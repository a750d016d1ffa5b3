# SPDX-License-Identifier: Apache-2.0
"""The vLLM attention backend of our cache layers: one metadata builder per KV cache group.

vLLM's hybrid KV cache manager puts every cache kind of every layer into KV cache groups (one block
table per group) and calls each group's builder once per step. Our builder only hands over what the
group knows: its block table, the positions per page and the step's request layout, as views of
vLLM's persistent input buffers (no copies, no host synchronization). The attention layer
(``engine/attention_layer.py``) combines the groups of its cache kinds into one
:class:`~vllm_dsv4_hw.attention.metadata.StepMetadata` per layer kind and step: for decode batches
with device ops only (``attention.decode_metadata``), which is what lets vLLM capture decode steps
in CUDA graphs (``AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE``: vLLM replays them after
refreshing its buffers in place); mixed and prefill steps run eagerly through the general builder.
``VLLM_DSV4_HW_CUDA_GRAPHS=0`` sends every step through the general builder and declares no graph
support.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)

from vllm_dsv4_hw import envs

logger = init_logger(__name__)

__all__ = ["DSV4CacheBackend", "DSV4CacheMetadata", "DSV4CacheMetadataBuilder"]

BACKEND_NAME = "DSV4_HW_PAGED"
# vLLM's BlockPool reserves block 0 as the null block (released / never allocated positions).
NULL_BLOCK = 0


@dataclass
class DSV4CacheMetadata:
    """One KV cache group's view of a step (device tensors are views of vLLM's buffers)."""

    block_table: torch.Tensor  # [R, B] int32 page ids; vLLM's null block 0 = no page
    block_size: int  # positions per page of this group
    query_start_loc_cpu: torch.Tensor  # [R+1] int (host)
    seq_lens: torch.Tensor  # [R] int (device): tokens cached after the step
    num_reqs: int
    num_tokens: int
    decode: bool  # one new token per request (graph-capturable step)

    @property
    def null_page(self) -> int:
        return NULL_BLOCK

    def host_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(seq_starts [R], num_new [R]) int64 on the host, for the general builder (this syncs:
        only eager steps call it)."""
        qsl = self.query_start_loc_cpu[: self.num_reqs + 1].to(torch.int64)
        num_new = qsl[1:] - qsl[:-1]
        return self.seq_lens.to(device="cpu", dtype=torch.int64) - num_new, num_new


class DSV4CacheMetadataBuilder(AttentionMetadataBuilder[DSV4CacheMetadata]):
    # Decode steps: device-only metadata over vLLM's persistent buffers (captured and replayed).
    _cudagraph_support: ClassVar[AttentionCGSupport] = (
        AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    )

    @classmethod
    def get_cudagraph_support(cls, vllm_config, kv_cache_spec) -> AttentionCGSupport:
        if not envs.cuda_graphs():
            return AttentionCGSupport.NEVER
        return cls._cudagraph_support

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size
        kinds = sorted({name.rsplit(".", 1)[-1] for name in layer_names})
        logger.info(
            "dsv4-hw: KV cache group of %d layer caches (%s): %d positions per page, page %d B",
            len(layer_names),
            ", ".join(kinds),
            self.block_size,
            kv_cache_spec.page_size_bytes,
        )

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> DSV4CacheMetadata:
        m = common_attn_metadata
        r = m.num_reqs
        n = int(m.num_actual_tokens)
        decode = envs.cuda_graphs() and m.max_query_len <= 1 and n == r
        return DSV4CacheMetadata(
            block_table=m.block_table_tensor[:r],
            block_size=self.block_size,
            query_start_loc_cpu=m.query_start_loc_cpu,
            seq_lens=m.seq_lens[:r],
            num_reqs=r,
            num_tokens=n,
            decode=decode,
        )


class DSV4CacheBackend(AttentionBackend):
    """Backend of every DeepSeek V4 cache layer of this plugin (window, compressed, indexer,
    compressor state). Kernels run through the plugin's op dispatch, not through an impl class."""

    accept_output_buffer: bool = False
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = []  # any: the plugin picks entry formats itself

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @classmethod
    def supported_kv_cache_layouts(cls):
        # Block-outermost: vLLM packs the pages of every layer of a KV cache group into one block
        # (mixed page sizes allowed), which is how one 256-position logical block holds the c4a,
        # c128a and indexer pages of a request. Our ops address pages through their stride.
        from vllm.v1.kv_cache_layout import KVCacheLayout

        return (KVCacheLayout.BLNHC,)

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError(
            f"{BACKEND_NAME} has no attention impl: the DeepSeek V4 layer runs its own ops"
        )

    @staticmethod
    def get_builder_cls() -> type[DSV4CacheMetadataBuilder]:
        return DSV4CacheMetadataBuilder
