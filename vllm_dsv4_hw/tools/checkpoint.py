# SPDX-License-Identifier: Apache-2.0
"""A DeepSeek V4 checkpoint the project makes itself: official layout, tiny sizes, random weights.

``make_checkpoint(out_dir, preset, dtype, seed)`` writes a directory that loads like the official
``DeepSeek-V4-Flash`` / ``-Pro`` checkpoints:

* ``config.json`` with the official field names (``compress_ratios`` with the trailing MTP 0,
  ``num_hash_layers``, ``rope_scaling`` (YaRN), ``index_*``, ``o_groups``, ``hc_*``,
  ``swiglu_limit``, ``scoring_func``, ``topk_method``, ``expert_dtype``, ``quantization_config``...);
* ``model-0000i-of-0000n.safetensors`` shards + ``model.safetensors.index.json`` with the official
  tensor names and dtypes (``embed.weight``, ``layers.N.attn.wq_a.weight`` + ``.scale``,
  ``layers.N.ffn.experts.E.w1.weight`` ..., ``hc_head_fn``, ``mtp.0.*``): with ``dtype="fp8"`` the
  linears are FP8 e4m3 with 128x128 ue8m0 ``.scale`` blocks and the routed experts FP4 e2m1 (two per
  byte, int8) with a ue8m0 scale per 32 along K; with ``dtype="bf16"`` every one of those is a plain
  bf16 ``.weight`` and there is no ``quantization_config``. Tensors that the official checkpoints keep
  unquantized keep their official dtype in both (norms, compressor / indexer-compressor projections,
  ``weights_proj``, router ``gate.weight``: bf16; ``attn_sink``, ``ape``, ``hc_*``, ``gate.bias``:
  fp32; ``tid2eid``: int64);
* a byte-level BPE tokenizer trained offline (``tokenizer_gen``), with a chat template and BOS/EOS;
* ``generation_config.json`` and ``checkpoint_info.json`` (how it was made).

The weights are random but deterministic in ``seed`` (each tensor draws from its own generator keyed
by the seed and its name), scaled so that activations stay O(1) and the logits vary with the context.
Quantized tensors are generated once in fp32 and rounded to their FP8 / FP4 grid; the bf16
checkpoint stores those very values (exactly representable in bf16), so the ``fp8`` and ``bf16``
checkpoints of one seed describe the same network: dequantizing one gives the other bit for bit.

The MTP layer (``mtp.0.*``, one layer with ratio 0) is included, as in the official checkpoints;
transformers ignores it (``_keys_to_ignore_on_load_unexpected``) and vLLM's main model drops it
(its weight mapper maps ``mtp.`` to None).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dsv4_hw.quant.formats import (
    dequantize_fp4_experts,
    dequantize_fp8_block,
    quantize_fp4_experts,
    quantize_fp8_block,
)
from vllm_dsv4_hw.tools import tokenizer_gen
from vllm_dsv4_hw.tools.checkpoint_layout import (  # noqa: F401  (the generator's public names)
    DEFAULT_SHARD_BYTES,
    DTYPES,
    FORMAT_VERSION,
    GENERATOR,
    HEAD_LOGIT_STD,
    PRESETS,
    QUANTIZATION_CONFIG,
    SPECIAL_HEAD_SCALE,
    CheckpointError,
    TensorSpec,
    hf_config,
    hf_dict_of,
    layer_specs,
    stored_layout,
    tensor_specs,
)

logger = logging.getLogger(__name__)


# -- weights ----------------------------------------------------------------------------------------
def _generator(seed: int, name: str, device="cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(
        (seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (1 << 63)
    )


def _init_tensor(spec: TensorSpec, seed: int, special_ids: list[int], device="cpu") -> torch.Tensor:
    """The fp32 (or int64) master values of one tensor, deterministic in (seed, name, device)."""
    g = _generator(seed, spec.name, device)
    how = spec.init[0]
    kw = {"generator": g, "device": device}
    if how == "normal":
        return torch.randn(spec.shape, **kw) * spec.init[1]
    if how == "around_one":
        return (1.0 + torch.randn(spec.shape, **kw) * spec.init[1]).clamp(0.5, 1.5)
    if how == "uniform":
        lo, hi = spec.init[1], spec.init[2]
        return lo + (hi - lo) * torch.rand(spec.shape, **kw)
    if how == "head":
        w = torch.randn(spec.shape, **kw) * spec.init[1]
        ids = [i for i in special_ids if i < spec.shape[0]]
        w[ids] *= SPECIAL_HEAD_SCALE
        return w
    if how == "tid2eid":
        # Each token goes to k distinct experts.
        n_experts = spec.init[1]
        rows, k = spec.shape
        return torch.rand(rows, n_experts, **kw).argsort(dim=1)[:, :k].to(torch.int64)
    raise AssertionError(f"unknown init {spec.init!r} for {spec.name}")


def random_tensors(
    specs: list[TensorSpec], dtype: str, seed: int, device="cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, stored tensor) of ``specs`` generated and encoded on ``device`` (e.g. the
    layers of a real-size model for a benchmark, loaded through the product's loader)."""
    for spec in specs:
        yield from encode_tensor(spec, _init_tensor(spec, seed, [], device), dtype).items()


def master_weights(
    cfg: dict, seed: int, include_mtp: bool = True
) -> Iterator[tuple[TensorSpec, torch.Tensor]]:
    """(spec, fp32 master values) for every logical tensor, before any quantization."""
    special = tokenizer_gen.special_token_ids(cfg["vocab_size"])
    for spec in tensor_specs(cfg, include_mtp):
        yield spec, _init_tensor(spec, seed, special)


def encode_tensor(spec: TensorSpec, master: torch.Tensor, dtype: str) -> dict[str, torch.Tensor]:
    """The on-disk tensors of one logical tensor in checkpoint ``dtype``."""
    if spec.kind in ("fp8", "fp4"):
        fp8 = spec.kind == "fp8"
        q, s = (quantize_fp8_block if fp8 else quantize_fp4_experts)(master)
        if dtype == "fp8":
            return {spec.name + ".weight": q, spec.name + ".scale": s}
        # bf16 checkpoint: the very values the quantized one encodes (exact in bf16).
        deq = (dequantize_fp8_block if fp8 else dequantize_fp4_experts)(q, s)
        w = deq.to(torch.bfloat16)
        if not torch.equal(w.float(), deq):
            raise AssertionError(f"{spec.name}: dequantized weight is not exact in bf16")
        return {spec.name + ".weight": w}
    if spec.kind == "bf16":
        return {spec.name: master.to(torch.bfloat16)}
    if spec.kind == "f32":
        return {spec.name: master.float().contiguous()}
    return {spec.name: master.to(torch.int64)}


def checkpoint_tensors(
    cfg: dict, dtype: str, seed: int, include_mtp: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, on-disk tensor) of a checkpoint, in order."""
    for spec, master in master_weights(cfg, seed, include_mtp):
        yield from encode_tensor(spec, master, dtype).items()


# -- writing ----------------------------------------------------------------------------------------
@dataclass
class CheckpointSummary:
    path: Path
    preset: str
    dtype: str
    seed: int
    num_params: int  # logical parameters (elements), including the MTP layer
    num_params_main: int  # without the MTP layer
    num_tensors: int  # on-disk tensors (weights + scales)
    size_bytes: int  # bytes of all files written
    files: list[str]
    seconds: float

    def as_dict(self) -> dict:
        return {
            "path": str(self.path),
            "preset": self.preset,
            "dtype": self.dtype,
            "seed": self.seed,
            "num_params": self.num_params,
            "num_params_main": self.num_params_main,
            "num_tensors": self.num_tensors,
            "size_bytes": self.size_bytes,
            "files": self.files,
            "seconds": round(self.seconds, 3),
        }


def _check_seed(seed) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CheckpointError(f"seed must be an integer, got {seed!r}")
    if not 0 <= seed < (1 << 63):
        raise CheckpointError(f"seed must be in [0, 2^63), got {seed}")
    return seed


def _prepare_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"{out} exists and is not empty (overwrite it with --force)")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"cannot create {parent}: {exc.strerror or exc}") from None
    if not os.access(parent, os.W_OK):
        raise CheckpointError(f"{parent} is not writable")


def make_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny-flash",
    dtype: str = "fp8",
    seed: int = 0,
    *,
    overwrite: bool = False,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: Callable[[str], None] | None = None,
) -> CheckpointSummary:
    """Write a checkpoint directory (see the module docstring); returns what was written.

    The directory is built next to ``out_dir`` and renamed into place at the end, so an
    interrupted run never leaves a directory that looks complete.
    """
    t0 = time.monotonic()
    say = progress or logger.info
    cfg = hf_config(preset, dtype)
    seed = _check_seed(seed)
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes must be positive, got {shard_bytes}")
    out = Path(out_dir).expanduser().absolute()
    _prepare_out(out, overwrite)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # The tensors are small: one thread is fastest, and immune to OpenMP stalls on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = _write(tmp, cfg, preset, dtype, seed, shard_bytes, say)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        torch.set_num_threads(threads)
    summary.path = out
    summary.seconds = time.monotonic() - t0
    say(
        f"wrote {out} ({summary.size_bytes / 2**20:.1f} MiB, {summary.num_params / 1e6:.2f}M params, "
        f"{summary.seconds:.1f} s)"
    )
    return summary


def _write(
    tmp: Path,
    cfg: dict,
    preset: str,
    dtype: str,
    seed: int,
    shard_bytes: int,
    say: Callable[[str], None],
) -> CheckpointSummary:
    from safetensors.torch import save_file

    say(
        f"{preset} ({dtype}, seed {seed}): {cfg['num_hidden_layers']} layers, ratios "
        f"{cfg['compress_ratios']}, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}"
    )
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    say("training the tokenizer")
    files = ["config.json"]
    files += tokenizer_gen.write_tokenizer(tmp, cfg["vocab_size"], cfg["max_position_embeddings"])
    # No sampling defaults: vLLM would apply them to every request that does not set its own.
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}, indent=2
        )
        + "\n"
    )
    files.append("generation_config.json")

    # Generate and group into shards of about shard_bytes, in checkpoint order.
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    num_params = num_params_main = 0
    last_layer = None
    for spec, master in master_weights(cfg, seed):
        in_layer = spec.name.startswith(("layers.", "mtp."))
        layer = ".".join(spec.name.split(".")[:2]) if in_layer else None
        if layer != last_layer and layer is not None:
            say(f"generating {layer}")
            last_layer = layer
        num_params += spec.numel
        if not spec.name.startswith("mtp."):
            num_params_main += spec.numel
        for name, t in encode_tensor(spec, master, dtype).items():
            nbytes = t.numel() * t.element_size()
            if shards[-1] and size + nbytes > shard_bytes:
                shards.append({})
                size = 0
            shards[-1][name] = t.contiguous()
            size += nbytes
    n = len(shards)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        say(f"writing shard {i}/{n} ({len(shard)} tensors)")
        save_file(shard, str(tmp / fname), metadata={"format": "pt"})
        os.chmod(tmp / fname, 0o644)  # safetensors creates it 0600
        files.append(fname)
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n"
    )
    files.append("model.safetensors.index.json")
    from vllm_dsv4_hw import __version__

    info = {
        "generator": GENERATOR,
        "generator_version": __version__,
        "format_version": FORMAT_VERSION,
        "preset": preset,
        "dtype": dtype,
        "seed": seed,
        "num_params": num_params,
        "num_params_main": num_params_main,
        "num_tensors": len(weight_map),
        "mtp_included": True,
        "note": "random weights; the bf16 and fp8 checkpoints of one seed hold the same values",
    }
    (tmp / "checkpoint_info.json").write_text(json.dumps(info, indent=2) + "\n")
    files.append("checkpoint_info.json")
    size_bytes = sum((tmp / f).stat().st_size for f in files)
    return CheckpointSummary(
        path=tmp,
        preset=preset,
        dtype=dtype,
        seed=seed,
        num_params=num_params,
        num_params_main=num_params_main,
        num_tensors=len(weight_map),
        size_bytes=size_bytes,
        files=files,
        seconds=0.0,
    )


def read_checkpoint_info(path: str | os.PathLike) -> dict | None:
    """The ``checkpoint_info.json`` of a generated checkpoint, or None (e.g. a real checkpoint)."""
    p = Path(path) / "checkpoint_info.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
