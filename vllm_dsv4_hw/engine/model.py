# SPDX-License-Identifier: Apache-2.0
"""``DeepseekV4ForCausalLM`` for vLLM, registered by the plugin in place of the built-in one.

The network (embeddings, mHC, MoE, norm, head: ``network.py``) is plain PyTorch over our dispatch
ops; its attention layers are :class:`~vllm_dsv4_hw.engine.attention_layer.VllmDSV4Attention`, whose
caches vLLM's hybrid KV cache manager allocates. Nothing here calls vLLM's compiled operators
(``torch.ops._C*``): a vendor fork of vLLM does not ship them, and the CPU builds of vLLM lack the
DeepSeek V4 ones on machines without AMX / AVX-512 BF16.

Weights stay as the checkpoint ships them (FP8 block linears, FP4 experts, or bf16): the linears
are vLLM layers with our quantization methods (``quant``), resolved by vLLM through the
``dsv4_hw_fp8`` config that the plugin registers; the resident bytes are logged after loading.

Cache entry formats: ``--kv-cache-dtype auto`` takes ``VLLM_DSV4_HW_KV_FORMAT`` (auto: the most
compact the device holds); ``fp8`` / ``fp8_ds_mla`` and ``bfloat16`` pick the main format; the
indexer keys follow ``--attention-config.indexer_kv_dtype`` (mxfp4, fp8, bf16; auto:
``VLLM_DSV4_HW_INDEXER_FORMAT``). All launch checks: ``serve_checks.py``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger

from vllm_dsv4_hw.engine.attention_layer import VllmDSV4Attention
from vllm_dsv4_hw.engine.serve_checks import (
    UnsupportedSettingError,
    check_kv_capacity,
    check_serve_settings,
)
from vllm_dsv4_hw.kv_cache.specs import layer_cache_specs
from vllm_dsv4_hw.model.loader import load_weights
from vllm_dsv4_hw.model.network import DSV4Network
from vllm_dsv4_hw.model.resident import resident_summary
from vllm_dsv4_hw.parallel import current_layout
from vllm_dsv4_hw.quant.config import model_quant_config

logger = init_logger(__name__)


class DSV4ForCausalLM(nn.Module):
    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        mc = vllm_config.model_config
        settings = check_serve_settings(vllm_config)  # again here: any platform builds the model
        check_kv_capacity(vllm_config, settings)
        cfg = settings.cfg
        self.cfg = cfg
        self.dtype = mc.dtype
        main_fmt, idx_fmt = settings.main_format, settings.indexer_format
        self.main_format, self.indexer_format = main_fmt, idx_fmt
        max_pos = int(mc.max_model_len)
        qc = model_quant_config(vllm_config.quant_config, cfg.weights)
        # vLLM's workers set up the tensor-parallel group; serve_checks validated the split.
        layout = current_layout(vllm_config.parallel_config.enable_expert_parallel)
        self.layout = layout

        def make_attention(layer_id: int, ratio: int) -> nn.Module:
            return VllmDSV4Attention(
                cfg,
                layer_id,
                f"layers.{layer_id}.attn",
                main_fmt,
                idx_fmt,
                mc.dtype,
                max_pos,
                quant_config=qc,
                layout=layout,
            )

        self.model = DSV4Network(
            cfg, make_attention, dtype=mc.dtype, quant_config=qc, layout=layout
        )
        kv_layout = ", ".join(
            f"{s.kind} {s.format} {s.entries_per_page}x{s.entry_bytes}B/"
            f"{s.page_bytes}B page ({s.bucket})"
            for s in layer_cache_specs(cfg, main_fmt, idx_fmt)
        )
        logger.info(
            "dsv4-hw: %s (vllm_dsv4_hw) with %d layers, compress ratios %s; KV layout: %s",
            type(self).__name__,
            cfg.num_layers,
            list(cfg.compress_ratios),
            kv_layout,
        )
        if layout.sharded:
            logger.info(
                "dsv4-hw: split over vLLM's tensor-parallel group: %s (%d of %d query "
                "heads, %d of %d experts here); KV cache replicated",
                layout.describe(),
                layout.local_heads(cfg),
                cfg.num_heads,
                len(layout.local_experts(cfg)),
                cfg.n_routed_experts,
            )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise UnsupportedSettingError(
                "DeepSeek V4 on vllm-dsv4-hw takes token ids, not prompt embeddings"
            )
        return self.model(input_ids)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        shipped = _CountedTensors(weights)
        loaded = load_weights(self.model, shipped, self.cfg)
        self.resident = resident_summary(self.model, shipped.nbytes)
        logger.info(
            "dsv4-hw: %s%s",
            self.resident.line(),
            f" ({self.layout.describe()})" if self.layout.sharded else "",
        )
        return {f"model.{name}" for name in loaded}


class _CountedTensors:
    """Passes the checkpoint's tensors through, adding up the bytes of those the model holds."""

    def __init__(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        self._weights = weights
        self.nbytes = 0

    def __iter__(self):
        from vllm_dsv4_hw.model.loader import SKIPPED_PREFIXES

        for name, t in self._weights:
            if not name.startswith(SKIPPED_PREFIXES):
                self.nbytes += t.numel() * t.element_size()
            yield name, t
