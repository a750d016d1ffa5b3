# SPDX-License-Identifier: Apache-2.0
"""vLLM's quantization extension point for DeepSeek V4 checkpoints as shipped: ``dsv4_hw_fp8``.

Registered by the plugin (``engine.plugin.register``) with vLLM's ``register_quantization_config``.
Its ``override_quantization_method`` claims the official FP8 checkpoints of ``model_type``
``deepseek_v4`` (``quant_method: fp8``, ``deepseek_v4_fp8``), as plugins' custom methods are tried
before vLLM's built-in ones, so vLLM never builds its CUDA-only FP8 methods for our model.

``get_quant_method`` returns our linear methods (``quant.linear``): FP8 block weights for the
linears the checkpoint quantizes, dense ones for everything passed :meth:`DSV4HwQuantConfig.dense`
(the model says which linears ship unquantized). Routed experts are the model's own module
(``model.moe``); they are not vLLM layers and need no method here.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig

from vllm_dsv4_hw.quant.scheme import DENSE, QUANT_METHODS, WeightScheme

__all__ = ["QUANT_METHOD", "DSV4HwQuantConfig", "model_quant_config"]

QUANT_METHOD = "dsv4_hw_fp8"


class DSV4HwQuantConfig(QuantizationConfig):
    def __init__(self, scheme: WeightScheme = DENSE, out_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.scheme = scheme
        self.out_dtype = out_dtype

    @classmethod
    def dense(cls, out_dtype: torch.dtype | None = None) -> "DSV4HwQuantConfig":
        """For linears the checkpoint ships unquantized (and for bf16 checkpoints)."""
        return cls(DENSE, out_dtype)

    # -- vLLM's interface ---------------------------------------------------------------------
    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # bf16 tensor cores; e4m3 is decoded with integer ops where there is no FP8

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "DSV4HwQuantConfig":
        cfg = {"quantization_config": dict(config, quant_method="fp8")}
        return cls(WeightScheme.from_hf_config(cfg, "quantization_config"))

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant, hf_config=None) -> str | None:
        if (
            not isinstance(hf_quant_cfg, dict)
            or hf_quant_cfg.get("quant_method") not in QUANT_METHODS
        ):
            return None
        if user_quant == QUANT_METHOD or getattr(hf_config, "model_type", None) == "deepseek_v4":
            return QUANT_METHOD
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        # imported here: the plugin registers this class in every vLLM process (API server too)
        from vllm.model_executor.layers.linear import LinearBase

        from vllm_dsv4_hw.quant.linear import DenseLinearMethod, Fp8BlockLinearMethod

        if isinstance(layer, LinearBase):
            if self.scheme.fp8_linears:
                return Fp8BlockLinearMethod(self.scheme.block)
            return DenseLinearMethod(self.out_dtype)
        return None


def model_quant_config(vllm_quant_config, scheme: WeightScheme) -> DSV4HwQuantConfig:
    """The config our model's quantized linears get: vLLM's resolved one when it is ours, a dense
    one for unquantized checkpoints; anything else (e.g. ``--quantization fp8`` on a bf16
    checkpoint) is refused with the fix."""
    if isinstance(vllm_quant_config, DSV4HwQuantConfig):
        got = vllm_quant_config.scheme
        if (got.linear, got.block) != (scheme.linear, scheme.block):
            raise ValueError(
                f"quantization config {got} disagrees with the checkpoint's config.json {scheme}"
            )
        return vllm_quant_config
    if vllm_quant_config is None:
        if scheme.fp8_linears:
            return DSV4HwQuantConfig(scheme)
        return DSV4HwQuantConfig.dense()
    raise ValueError(
        f"DeepSeek V4 on vllm-dsv4-hw keeps the checkpoint's weights as shipped and does not "
        f"support --quantization {vllm_quant_config.get_name()}; drop the flag (FP8 checkpoints "
        f"are served through {QUANT_METHOD} automatically)"
    )
