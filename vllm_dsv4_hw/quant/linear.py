# SPDX-License-Identifier: Apache-2.0
"""vLLM linear methods that keep DeepSeek V4's weights as shipped, with their matmuls dispatched.

vLLM's linear layers (``ReplicatedLinear``, ``MergedColumnParallelLinear``, the parallel ones) own
the parameters, their sharding and their weight loaders; the method decides what the parameters
are and how the layer multiplies:

* :class:`Fp8BlockLinearMethod`: ``weight`` e4m3 ``[N, K]`` and ``scale`` ue8m0
  ``[ceil(N/bn), ceil(K/bk)]`` exactly as the checkpoint stores them (``<name>.weight`` /
  ``<name>.scale``), multiplied by ``ops.fp8_block_linear``; its activations quantized to e4m3
  per 128-column block where the device has FP8 x FP8 dots (:func:`e4m3_activations`: the
  checkpoints' dynamic activation scheme), else kept in the model dtype (weight-only);
* :class:`DenseLinearMethod`: a float ``weight`` (bf16 checkpoints, and the projections the FP8
  checkpoints ship in bf16), multiplied by ``ops.dense_linear``; optionally with fp32 output (the compressor's fused
  ``wkv | wgate`` GEMM, whose pooling runs in fp32).

vLLM's own ``UnquantizedLinearMethod`` is not used: on CPU it repacks weights for vLLM's compiled
oneDNN kernels, which vendor builds of vLLM do not have. Both methods also multiply grouped
weights (:func:`grouped_linear`, the grouped output projection ``wo_a``).
"""

from __future__ import annotations

import functools

import torch
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import (
    LinearMethodBase,
    register_weight_loader_v2_supported_method,
)
from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter
from vllm.model_executor.utils import set_weight_attrs

from vllm_dsv4_hw import envs, ops

logger = init_logger(__name__)
__all__ = [
    "DenseLinearMethod",
    "Fp8BlockLinearMethod",
    "column_linear",
    "grouped_linear",
    "merged_linear",
    "replicated_linear",
    "row_linear",
]


@register_weight_loader_v2_supported_method
class DenseLinearMethod(LinearMethodBase):
    """A float weight ``[N, K]`` in the layer's params dtype; ``out_dtype=torch.float32`` gives fp32
    outputs (else the input's dtype)."""

    def __init__(self, out_dtype: torch.dtype | None = None) -> None:
        self.out_dtype = out_dtype

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        weight = ModelWeightParameter(
            data=torch.empty(
                sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype
            ),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        set_weight_attrs(weight, extra_weight_attrs)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = ops.dense_linear(
            x.reshape(-1, x.shape[-1]), layer.weight, self.out_dtype or x.dtype
        ).view(*lead, -1)
        return y if bias is None else y + bias

    def takes_e4m3_input(self, device: torch.device) -> bool:
        return False

    def apply_grouped(
        self, layer, x3: torch.Tensor, groups: int, x_scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        w = layer.weight.view(groups, -1, layer.weight.shape[-1])
        if x_scales is not None:  # e4m3 codes: their values, in the weight's dtype
            from vllm_dsv4_hw.ops.reference.linear import prequantized_values

            x3 = prequantized_values(x3, x_scales, -(-x3.shape[-1] // x_scales.shape[-1])).to(
                w.dtype
            )
        return torch.einsum("mgk,gnk->mgn", x3, w.to(x3.dtype))


@functools.lru_cache(maxsize=None)
def _e4m3_activations(device_type: str, setting: str) -> bool:
    from vllm_dsv4_hw.ops.backends import device_capabilities

    on = setting == "e4m3" or (setting == "auto" and device_capabilities(device_type).fp8_dot)
    logger.info(
        "FP8 linears on %s: %s activations (%s=%s)",
        device_type,
        "e4m3 (W8A8)" if on else "model-dtype (W8A16)",
        envs.FP8_ACTIVATIONS.name,
        setting,
    )
    return on


def e4m3_activations(device: torch.device) -> bool:
    """Whether the FP8 linears on ``device`` quantize their activations to e4m3
    (``envs.FP8_ACTIVATIONS``; auto: where the device declares ``fp8_dot``)."""
    return _e4m3_activations(device.type, envs.fp8_activations())


@register_weight_loader_v2_supported_method
class Fp8BlockLinearMethod(LinearMethodBase):
    """``weight`` float8_e4m3fn ``[N, K]`` + ``scale`` float8_e8m0fnu, one per ``block``."""

    def __init__(self, block: tuple[int, int]) -> None:
        self.block = tuple(block)

    def create_weights(
        self,
        layer,
        input_size_per_partition,
        output_partition_sizes,
        input_size,
        output_size,
        params_dtype,
        **extra_weight_attrs,
    ):
        weight_loader = extra_weight_attrs.pop("weight_loader")
        bn, bk = self.block
        n = sum(output_partition_sizes)
        if len(output_partition_sizes) > 1 and any(s % bn for s in output_partition_sizes):
            raise ValueError(
                f"{getattr(layer, 'prefix', 'linear')}: merged outputs "
                f"{output_partition_sizes} do not align to the {bn}-row FP8 block"
            )
        weight = ModelWeightParameter(
            data=torch.empty(n, input_size_per_partition, dtype=torch.float8_e4m3fn),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        scale = BlockQuantScaleParameter(
            data=torch.empty(
                -(-n // bn), -(-input_size_per_partition // bk), dtype=torch.float8_e8m0fnu
            ),
            input_dim=1,
            output_dim=0,
            weight_loader=weight_loader,
        )
        layer.register_parameter("weight", weight)
        layer.register_parameter("scale", scale)
        layer.weight_block_size = list(self.block)  # vLLM's merged loaders shard scales by it
        set_weight_attrs(weight, extra_weight_attrs)
        set_weight_attrs(scale, extra_weight_attrs)

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = ops.fp8_block_linear(
            x.reshape(-1, x.shape[-1]),
            layer.weight,
            layer.scale,
            self.block,
            quantize_x=e4m3_activations(x.device),
        )
        y = y.view(*lead, -1)
        return y if bias is None else y + bias

    def takes_e4m3_input(self, device: torch.device) -> bool:
        """Whether this layer's input may come as e4m3 codes with per-128-column scales (the
        producer's quantization, ``x_scales``) with nothing lost: it quantizes its activations
        on ``device`` anyway (W8A8) in blocks of that size."""
        return e4m3_activations(device) and self.block[1] == 128

    def apply_grouped(
        self, layer, x3: torch.Tensor, groups: int, x_scales: torch.Tensor | None = None
    ) -> torch.Tensor:
        w, s = layer.weight, layer.scale
        n = w.shape[0] // groups
        if n % self.block[0]:
            raise ValueError(
                f"{getattr(layer, 'prefix', 'linear')}: {groups} groups of {n} rows "
                f"cut the {self.block[0]}-row FP8 block"
            )
        return ops.fp8_block_linear(
            x3,
            w.view(groups, n, w.shape[1]),
            s.view(groups, n // self.block[0], s.shape[1]),
            self.block,
            out_dtype=layer.params_dtype if x_scales is not None else None,
            quantize_x=e4m3_activations(x3.device),
            x_scales=x_scales,
        )


def grouped_linear(
    layer, x3: torch.Tensor, groups: int, x_scales: torch.Tensor | None = None
) -> torch.Tensor:
    """``x3 [M, G, K]`` through a linear layer whose ``[G*N, K]`` weight holds G independent
    ``[N, K]`` matrices (group g's rows are g*N .. g*N + N - 1) -> ``[M, G, N]``. ``x_scales``
    ``[M, G, K/128]``: x3 is e4m3 codes with these scales (``ops.inv_rope_fp8_quant``)."""
    return layer.quant_method.apply_grouped(layer, x3, groups, x_scales)


# -- the model's linear layers ---------------------------------------------------------------------
def replicated_linear(
    in_features: int, out_features: int, quant_config, prefix: str, dtype: torch.dtype
):
    """A bias-free vLLM ``ReplicatedLinear`` whose method comes from ``quant_config``."""
    from vllm.model_executor.layers.linear import ReplicatedLinear

    return ReplicatedLinear(
        in_features,
        out_features,
        bias=False,
        params_dtype=dtype,
        quant_config=quant_config,
        prefix=prefix,
        return_bias=False,
    )


def column_linear(
    in_features: int,
    out_features: int,
    quant_config,
    prefix: str,
    dtype: torch.dtype,
    sharded: bool,
):
    """vLLM's ``ColumnParallelLinear``: each tensor-parallel rank holds a contiguous slice of the
    output rows (``sharded=False``: the whole weight, as ``ReplicatedLinear``)."""
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    return ColumnParallelLinear(
        in_features,
        out_features,
        bias=False,
        params_dtype=dtype,
        quant_config=quant_config,
        prefix=prefix,
        return_bias=False,
        disable_tp=not sharded,
    )


def row_linear(
    in_features: int,
    out_features: int,
    quant_config,
    prefix: str,
    dtype: torch.dtype,
    sharded: bool,
    reduce_results: bool = True,
):
    """vLLM's ``RowParallelLinear``: each rank holds a slice of the input columns and multiplies
    its slice of the input; ``reduce_results`` all-reduces the partial outputs through vLLM's
    communicator (False: the caller reduces once after adding other partial sums)."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    return RowParallelLinear(
        in_features,
        out_features,
        bias=False,
        params_dtype=dtype,
        quant_config=quant_config,
        prefix=prefix,
        return_bias=False,
        input_is_parallel=True,
        reduce_results=reduce_results,
        disable_tp=not sharded,
    )


def mergeable(quant_config, sizes) -> bool:
    """Whether linears of these output sizes can be one merged layer: FP8 block weights only
    where every shard's rows start on a block (a block of the checkpoint never spans two)."""
    if not quant_config.scheme.fp8_linears:
        return True
    bn = quant_config.scheme.block[0]
    return all(n % bn == 0 for n in sizes)


def merged_linear(
    in_features: int,
    shards: dict[str, int],
    quant_config,
    prefix: str,
    dtype: torch.dtype,
    sharded: bool = False,
):
    """Several checkpoint linears over the same input as one GEMM (vLLM's
    ``MergedColumnParallelLinear``; ``sharded``: each rank holds its slice of every shard's rows):
    ``shards`` maps each checkpoint name (relative to the parent module, e.g. ``wkv``) to its
    output rows, in order. The loader maps ``<parent>.<name>.weight`` / ``.scale`` onto shard i
    through ``checkpoint_shards``."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear

    layer = MergedColumnParallelLinear(
        in_features,
        list(shards.values()),
        bias=False,
        params_dtype=dtype,
        quant_config=quant_config,
        prefix=prefix,
        return_bias=False,
        disable_tp=not sharded,
    )
    layer.checkpoint_shards = tuple(shards)
    return layer
