# SPDX-License-Identifier: Apache-2.0
"""Which weight formats a checkpoint ships, read once from its config.json (no vLLM here).

* ``quantization_config`` with ``quant_method`` ``fp8`` (the official V4 config; also vLLM's
  ``deepseek_v4_fp8`` and ours, ``dsv4_hw_fp8``): the linears the official checkpoints quantize are
  FP8 e4m3 with one ue8m0 scale per ``weight_block_size`` block (128x128 for V4, 32x32 for V4.1);
* ``expert_dtype: "fp4"``: routed experts are FP4 e2m1 with a ue8m0 scale per 32 elements along K;
* neither: every weight is a plain float tensor (the bf16 checkpoints).

Errors name the field and what would work (:class:`WeightSchemeError`, a ``ValueError``).
"""

from __future__ import annotations

from dataclasses import dataclass

QUANT_METHODS = ("fp8", "deepseek_v4_fp8", "dsv4_hw_fp8")
SUPPORTED_BLOCKS = ((128, 128), (32, 32))


class WeightSchemeError(ValueError):
    """A checkpoint's declared weight format that this plugin cannot keep resident."""


@dataclass(frozen=True)
class WeightScheme:
    linear: str = "dense"  # "fp8" | "dense"
    block: tuple[int, int] = (128, 128)  # FP8 scale block (rows, cols) of a linear weight
    experts: str = "dense"  # "fp4" | "dense"

    @property
    def fp8_linears(self) -> bool:
        return self.linear == "fp8"

    @property
    def fp4_experts(self) -> bool:
        return self.experts == "fp4"

    @classmethod
    def from_hf_config(cls, cfg: dict, name: str = "config.json") -> "WeightScheme":
        q = cfg.get("quantization_config")
        expert_dtype = cfg.get("expert_dtype")
        if not q:
            if expert_dtype not in (None, "bf16", "bfloat16"):
                raise WeightSchemeError(
                    f"{name}: expert_dtype={expert_dtype!r} without a quantization_config; an FP4 "
                    f"checkpoint declares both (quantization_config.quant_method 'fp8' and "
                    f"expert_dtype 'fp4'), a bf16 one neither"
                )
            return cls()
        if not isinstance(q, dict):
            raise WeightSchemeError(
                f"{name}: quantization_config must be an object, got {type(q).__name__}"
            )
        method = q.get("quant_method")
        if method not in QUANT_METHODS:
            raise WeightSchemeError(
                f"{name}: quantization_config.quant_method={method!r} is not supported for "
                f"DeepSeek V4 by vllm-dsv4-hw; supported: {', '.join(QUANT_METHODS)} (FP8 "
                f"block weights as the official checkpoints ship them) or no quantization_config"
            )
        fmt = q.get("fmt", "e4m3")
        if fmt != "e4m3":
            raise WeightSchemeError(
                f"{name}: quantization_config.fmt={fmt!r}; only 'e4m3' FP8 weights are supported"
            )
        scale_fmt = q.get("scale_fmt", "ue8m0")
        if scale_fmt != "ue8m0":
            raise WeightSchemeError(
                f"{name}: quantization_config.scale_fmt={scale_fmt!r}; only "
                f"'ue8m0' (power-of-two) block scales are supported"
            )
        block = q.get("weight_block_size", [128, 128])
        if (
            not isinstance(block, (list, tuple))
            or len(block) != 2
            or tuple(int(b) for b in block) not in SUPPORTED_BLOCKS
        ):
            raise WeightSchemeError(
                f"{name}: quantization_config.weight_block_size={block!r} is not supported; "
                f"supported: {', '.join(f'[{a}, {b}]' for a, b in SUPPORTED_BLOCKS)}"
            )
        if expert_dtype in (None, "fp4"):
            experts = "fp4"
        else:
            raise WeightSchemeError(
                f"{name}: expert_dtype={expert_dtype!r} is not supported by vllm-dsv4-hw; "
                f"supported: 'fp4' (MXFP4 routed experts, as DeepSeek-V4-Flash / -Pro ship them)"
            )
        return cls(linear="fp8", block=(int(block[0]), int(block[1])), experts=experts)


DENSE = WeightScheme()
# The official V4 checkpoints: FP8 128x128 linears, FP4 experts (what the model presets describe).
SHIPPED = WeightScheme(linear="fp8", block=(128, 128), experts="fp4")


def shipped(cfg):
    """A ``DSV4Config`` with the official checkpoints' weight formats."""
    from dataclasses import replace

    return replace(cfg, weights=SHIPPED)
