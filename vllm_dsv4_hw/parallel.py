# SPDX-License-Identifier: Apache-2.0
"""How the model is split over vLLM's tensor-parallel ranks: what each rank holds, and which splits
a checkpoint allows.

The ranks are vLLM's (``vllm.distributed.parallel_state``, set up by vLLM's workers; standalone
benchmarks and tests call ``benchmarks.vllm_state.single_rank()``), and every collective is
vLLM's (``tensor_model_parallel_all_reduce`` / ``_all_gather`` over the communicator its platform
provides: NCCL, HCCL, gloo / shared memory on CPU). With ``T = --tensor-parallel-size``:

* sharded T ways: query heads (``wq_b`` rows, ``attn_sink``), the grouped output projection
  (``wo_a``: whole groups per rank; ``wo_b``: its input, all-reduced), the shared expert (w1 | w3
  rows, w2 input), the vocabulary (embedding and head); the routed experts either by their
  intermediate dimension (tensor parallel) or, with ``--enable-expert-parallel``, by expert
  (``n_routed_experts / T`` whole experts per rank); the MoE output is all-reduced once;
* replicated: ``wq_a``, the shared KV vector (``wkv``, one head) and therefore the KV cache, both
  compressors, the indexer (its top-k is then the same on every rank without a collective),
  the router, the norms and the mHC mixes.

:func:`check_split` refuses, before any worker starts, a size that does not divide the heads or
groups, or whose shards would cut an FP8 weight block or an FP4 scale block; the message names the
dimension, the block, and the sizes that would work.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_dsv4_hw.config import DSV4Config
from vllm_dsv4_hw.numerics import FP4_BLOCK

__all__ = [
    "ParallelLayout",
    "SplitError",
    "check_split",
    "current_layout",
    "shard_rows",
    "working_sizes",
]


class SplitError(ValueError):
    """A tensor-parallel size this checkpoint cannot be split into (one line, with the fix)."""


@dataclass(frozen=True)
class ParallelLayout:
    """This rank's place: ``tp_size`` ranks share every layer; ``expert_parallel`` splits the
    routed experts by expert instead of by their intermediate dimension."""

    tp_size: int = 1
    tp_rank: int = 0
    expert_parallel: bool = False

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1

    @property
    def ep_size(self) -> int:
        return self.tp_size if self.expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.expert_parallel else 0

    @property
    def expert_tp_size(self) -> int:
        """Ranks that share each routed expert (its intermediate dimension)."""
        return 1 if self.expert_parallel else self.tp_size

    def local_heads(self, cfg: DSV4Config) -> int:
        return cfg.num_heads // self.tp_size

    def local_groups(self, cfg: DSV4Config) -> int:
        return cfg.o_groups // self.tp_size

    def local_experts(self, cfg: DSV4Config) -> range:
        """Global ids of the routed experts this rank holds."""
        n = cfg.n_routed_experts // self.ep_size
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def expert_inter_slice(self, cfg: DSV4Config) -> slice:
        """The rows of each routed expert's intermediate dimension this rank holds."""
        n = cfg.moe_intermediate_size // self.expert_tp_size
        r = 0 if self.expert_parallel else self.tp_rank
        return slice(r * n, (r + 1) * n)

    def check_matches_vllm(self) -> None:
        """vLLM's parallel layers read the rank from vLLM's state: a split layout must be it."""
        if not self.sharded:
            return
        got = current_layout()
        if (got.tp_size, got.tp_rank) != (self.tp_size, self.tp_rank):
            raise ValueError(
                f"layout TP rank {self.tp_rank} of {self.tp_size} does not match "
                f"vLLM's tensor-parallel group (rank {got.tp_rank} of "
                f"{got.tp_size}); build split models with current_layout()"
            )

    def describe(self) -> str:
        if not self.sharded:
            return "one rank"
        experts = "experts by expert (EP)" if self.expert_parallel else "experts by intermediate"
        return f"TP rank {self.tp_rank} of {self.tp_size}, {experts}"


def current_layout(expert_parallel: bool = False) -> ParallelLayout:
    """This process's layout from vLLM's parallel state (one rank when it is not initialised)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return ParallelLayout(expert_parallel=False)
    tp = ps.get_tensor_model_parallel_world_size()
    return ParallelLayout(tp, ps.get_tensor_model_parallel_rank(), expert_parallel and tp > 1)


def shard_rows(param, layout: ParallelLayout, full_rows: int):
    """Mark ``param`` (this rank's rows of a ``[full_rows, ...]`` checkpoint tensor, e.g. the
    per-head sinks) for the loader: it checks the whole shape and keeps this rank's rows."""
    n = param.shape[0]

    def load(p, t):
        p.data.copy_(t.narrow(0, layout.tp_rank * n, n))

    param.weight_loader = load
    param.checkpoint_shape = (full_rows, *param.shape[1:])
    return param


def _split_problems(cfg: DSV4Config, tp: int, expert_parallel: bool) -> list[str]:
    """Why ``tp`` ranks cannot hold this checkpoint (empty: they can)."""
    if tp == 1:
        return []
    out = []

    def need(name: str, n: int, what: str = "") -> bool:
        if n % tp:
            out.append(f"{name} {n} is not divisible by {tp}{what}")
            return False
        return True

    need("num_attention_heads", cfg.num_heads)
    need("o_groups", cfg.o_groups, " (each rank takes whole output groups)")
    w = cfg.weights
    if w.fp8_linears:
        bn, bk = w.block
        shards = [
            ("wq_b rows per rank", cfg.num_heads * cfg.head_dim, bn),
            ("wo_a rows per rank", cfg.o_groups * cfg.o_lora_rank, bn),
            ("wo_b input per rank", cfg.o_groups * cfg.o_lora_rank, bk),
        ]
        if cfg.n_shared_experts:
            inter = cfg.moe_intermediate_size * cfg.n_shared_experts
            shards += [("shared expert intermediate per rank", inter, max(bn, bk))]
        for name, n, block in shards:
            if n % tp == 0 and (n // tp) % block:
                out.append(f"{name} {n}/{tp} = {n // tp} cuts the {block}-wide FP8 block")
    if expert_parallel:
        need(
            "n_routed_experts",
            cfg.n_routed_experts,
            " (expert parallelism: whole experts per rank)",
        )
    else:
        i = cfg.moe_intermediate_size
        if need("moe_intermediate_size", i) and w.fp4_experts and (i // tp) % FP4_BLOCK:
            out.append(
                f"routed expert intermediate per rank {i}/{tp} = {i // tp} cuts the "
                f"{FP4_BLOCK}-wide FP4 scale block (or use --enable-expert-parallel)"
            )
    return out


def working_sizes(cfg: DSV4Config, expert_parallel: bool, limit: int = 64) -> list[int]:
    return [t for t in range(1, limit + 1) if not _split_problems(cfg, t, expert_parallel)]


def check_split(cfg: DSV4Config, tp: int, expert_parallel: bool = False) -> None:
    """Raise :class:`SplitError` naming the first problem of splitting ``cfg`` over ``tp`` ranks
    and the tensor-parallel sizes that would work."""
    problems = _split_problems(cfg, tp, expert_parallel)
    if problems:
        ok = ", ".join(str(t) for t in working_sizes(cfg, expert_parallel))
        ep = " with --enable-expert-parallel" if expert_parallel else ""
        raise SplitError(
            f"--tensor-parallel-size {tp}{ep}: {problems[0]}; sizes that split this "
            f"checkpoint: {ok}"
        )
