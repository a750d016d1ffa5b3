# SPDX-License-Identifier: Apache-2.0
"""The vocabulary-parallel embedding (``embed.weight``) and output head (``head.weight``).

Both are vLLM's layers (``VocabParallelEmbedding`` / ``ParallelLMHead``): each tensor-parallel
rank holds a contiguous slice of the (padded) vocabulary, loaded by vLLM's weight loader. Two
things are ours: the weights stay plain (vLLM's default embedding method repacks them for its
compiled CPU GEMM at load, a second copy and a ``_C`` op), and the lookup masks out-of-shard ids
in plain PyTorch (vLLM's masking helper is ``torch.compile``-d, which a CPU without a compiler
or a vendor backend may not run). The partial embeddings are all-reduced, the head's logit
slices all-gathered, through vLLM's communicator.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.distributed import tensor_model_parallel_all_gather, tensor_model_parallel_all_reduce
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    UnquantizedEmbeddingMethod,
    VocabParallelEmbedding,
)

__all__ = ["DSV4Embedding", "DSV4Head", "PlainEmbeddingMethod"]


class PlainEmbeddingMethod(UnquantizedEmbeddingMethod):
    """The weight as loaded: no repacking after loading, ``F.linear`` / ``F.embedding``."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        return None

    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, layer.weight, bias)


def _full_shape(layer: VocabParallelEmbedding) -> None:
    # The checkpoint's shape of the weight (the loader checks against it; vLLM's weight loader
    # takes this rank's rows and zero-fills the padding).
    layer.weight.checkpoint_shape = (layer.org_vocab_size, layer.embedding_dim)


class DSV4Embedding(VocabParallelEmbedding):
    """``embed.weight [V, D]``, this rank's vocabulary slice; ``forward(ids [T]) -> [T, D]``."""

    def __init__(
        self, vocab: int, dim: int, dtype: torch.dtype, sharded: bool, prefix: str = "embed"
    ) -> None:
        super().__init__(
            vocab,
            dim,
            params_dtype=dtype,
            prefix=prefix,
            disable_tp=not sharded,
            quant_method=PlainEmbeddingMethod(),
        )
        _full_shape(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.long()
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        s = self.shard_indices
        mine = (ids >= s.org_vocab_start_index) & (ids < s.org_vocab_end_index)
        local = torch.where(mine, ids - s.org_vocab_start_index, torch.zeros_like(ids))
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class DSV4Head(ParallelLMHead):
    """``head.weight [V, D]``, this rank's vocabulary slice; :meth:`logits` gives every rank the
    whole ``[T, V]`` float32 logits."""

    def __init__(
        self, vocab: int, dim: int, dtype: torch.dtype, sharded: bool, prefix: str = "head"
    ) -> None:
        super().__init__(vocab, dim, params_dtype=dtype, prefix=prefix, disable_tp=not sharded)
        self.quant_method = PlainEmbeddingMethod()
        _full_shape(self)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        y = F.linear(hidden.to(self.weight.dtype), self.weight)
        if self.tp_size > 1:
            y = tensor_model_parallel_all_gather(y, dim=-1)
        return y[..., : self.org_vocab_size].float()
