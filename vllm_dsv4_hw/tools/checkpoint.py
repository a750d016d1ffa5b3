# SPDX-License-Identifier: Apache-2.0
"""A DeepSeek V4 checkpoint the project makes itself: official layout, random weights.

``make_checkpoint(out_dir, preset, dtype, seed, layers=N)`` writes a directory that loads like the
official ``DeepSeek-V4-Flash`` / ``-Pro`` checkpoints, at tiny sizes (``tiny-flash`` / ``tiny-pro``)
or at the real dimensions (``v4-flash`` / ``v4-pro``: the model's first N layers in its own order,
hash-routed first, then the MTP block; about 3.2 / 12.5 GiB per layer in fp8):

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

The weights are random but deterministic in ``seed`` and the device they are drawn on (each tensor
draws from its own generator keyed by the seed and its name; a tensor of more than
``CHUNK_ELEMENTS`` elements, only at the real dimensions, draws each block of rows from its own),
scaled so that activations stay O(1) and the logits vary with the context (fan-in scaled linears,
norms near 1: the same scheme at every size). Tensors are generated on a thread pool (one per core,
or on a CUDA device) and written in place into their shards (``checkpoint_writer``).
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
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_dsv4_hw.numerics import FP8_WEIGHT_BLOCK
from vllm_dsv4_hw.tools import tokenizer_gen
from vllm_dsv4_hw.tools.checkpoint_layout import (  # noqa: F401  (the generator's public names)
    ALL_PRESETS,
    DEFAULT_SHARD_BYTES,
    DTYPES,
    FORMAT_VERSION,
    GENERATOR,
    HEAD_LOGIT_STD,
    PRESETS,
    QUANTIZATION_CONFIG,
    REAL_PRESETS,
    REAL_SHARD_BYTES,
    SPECIAL_HEAD_SCALE,
    CheckpointError,
    TensorSpec,
    check_layers,
    hf_config,
    hf_dict_of,
    layer_specs,
    stored_layout,
    tensor_specs,
)
from vllm_dsv4_hw.tools.checkpoint_weights import (  # noqa: F401  (public names)
    CHUNK_ELEMENTS,
    checkpoint_tensors,
    encode_rows,
    encode_tensor,
    master_rows,
    master_tensor,
    master_weights,
    random_tensors,
    row_chunks,
)
from vllm_dsv4_hw.tools.checkpoint_writer import (
    CheckpointPlan,
    WorkItem,
    plan_checkpoint,
    store,
    write_shards,
)

logger = logging.getLogger(__name__)


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
    layers: int = 0  # main layers (num_hidden_layers)

    def as_dict(self) -> dict:
        return {
            "path": str(self.path),
            "preset": self.preset,
            "dtype": self.dtype,
            "seed": self.seed,
            "layers": self.layers,
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


def _check_device(device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise CheckpointError(f"--device {device}: not a device (use cpu or cuda)") from None
    if dev.type not in ("cpu", "cuda"):
        raise CheckpointError(f"--device {device}: weights are generated on cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise CheckpointError(f"--device {device}: torch sees no CUDA device here")
    return dev


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


def checkpoint_plan(
    preset: str = "tiny-flash",
    dtype: str = "fp8",
    layers: int | None = None,
    shard_bytes: int | None = None,
) -> CheckpointPlan:
    """What :func:`make_checkpoint` would write (config, every tensor's name, dtype, shape, shard
    and offset), without drawing a weight: ``make-checkpoint --dry-run``."""
    cfg = hf_config(preset, dtype, layers)
    if shard_bytes is None:
        shard_bytes = REAL_SHARD_BYTES if preset in REAL_PRESETS else DEFAULT_SHARD_BYTES
    if shard_bytes <= 0:
        raise CheckpointError(f"shard_bytes must be positive, got {shard_bytes}")
    return plan_checkpoint(cfg, dtype, shard_bytes)


def make_checkpoint(
    out_dir: str | os.PathLike,
    preset: str = "tiny-flash",
    dtype: str = "fp8",
    seed: int = 0,
    *,
    layers: int | None = None,
    overwrite: bool = False,
    shard_bytes: int | None = None,
    progress: Callable[[str], None] | None = None,
    device: str | torch.device = "cpu",
    workers: int | None = None,
) -> CheckpointSummary:
    """Write a checkpoint directory (see the module docstring); returns what was written.

    ``layers``: the model's first ``layers`` layers (required for the real presets; a tiny preset
    defaults to all of its own). ``shard_bytes``: default 8 MiB (tiny) / 4 GiB (real). ``device``:
    where the weights are drawn and encoded (cpu, or cuda: other random values). ``workers``:
    generating threads (default: one per core on cpu, 4 on cuda).

    The directory is built next to ``out_dir`` and renamed into place at the end, so an
    interrupted run never leaves a directory that looks complete.
    """
    t0 = time.monotonic()
    say = progress or logger.info
    plan = checkpoint_plan(preset, dtype, layers, shard_bytes)
    seed = _check_seed(seed)
    dev = _check_device(device)
    if workers is None:
        workers = len(os.sched_getaffinity(0)) if dev.type == "cpu" else 4
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise CheckpointError(f"workers must be a positive integer, got {workers!r}")
    out = Path(out_dir).expanduser().absolute()
    _prepare_out(out, overwrite)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    # One intra-op thread per generating thread: no OpenMP stalls on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = _write(tmp, plan, preset, seed, dev, workers, say)
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


_BUFFERS = threading.local()


def _buffer(numel: int, device: torch.device) -> torch.Tensor | None:
    """This thread's reused fp32 draw buffer (cpu only)."""
    if device.type != "cpu":
        return None
    buf = getattr(_BUFFERS, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _BUFFERS.buf = torch.empty(numel, dtype=torch.float32)
    return buf


def _work_items(plan: CheckpointPlan, seed: int, device: torch.device) -> Iterator[WorkItem]:
    """One item per tensor (per block of rows of the largest): draw, encode, write."""
    special = tokenizer_gen.special_token_ids(plan.cfg["vocab_size"])
    for spec in plan.specs:
        in_block = spec.name.startswith(("layers.", "mtp."))
        label = ".".join(spec.name.split(".")[:2]) if in_block else None
        for i, rows in enumerate(row_chunks(spec)):

            def run(fds, spec=spec, i=i, rows=rows) -> int:
                numel = (rows[1] - rows[0]) * (spec.numel // max(spec.shape[0], 1))
                buf = _buffer(numel, device) if spec.init[0] in ("normal", "head") else None
                master = master_rows(spec, seed, special, device, i, rows, buf)
                step = encode_rows(spec, tuple(master.shape))
                written = 0
                for b0 in range(0, master.shape[0], step):
                    part = master[b0 : b0 + step]
                    for name, t in encode_tensor(spec, part, plan.dtype).items():
                        written += _store_rows(fds, plan.tensors[name], spec, t, rows[0] + b0)
                return written

            yield WorkItem(run, label)


def _store_rows(fds, whole, spec: TensorSpec, t: torch.Tensor, row: int) -> int:
    """Write ``t``, the encoded master rows from ``row`` on, into its place in ``whole``."""
    if spec.kind == "fp8" and whole.name.endswith(".scale"):
        row //= FP8_WEIGHT_BLOCK
    rows_whole = whole.shape[0]
    if t.dtype != whole.dtype or t.shape[1:] != whole.shape[1:] or row + t.shape[0] > rows_whole:
        raise AssertionError(f"{whole.name}: encoded {t.dtype} {tuple(t.shape)} at row {row}")
    store(fds[whole.shard], t, whole.offset + row * (whole.nbytes // rows_whole))
    return t.numel() * t.element_size()


def _write(
    tmp: Path,
    plan: CheckpointPlan,
    preset: str,
    seed: int,
    device: torch.device,
    workers: int,
    say: Callable[[str], None],
) -> CheckpointSummary:
    cfg, dtype = plan.cfg, plan.dtype
    n = cfg["num_hidden_layers"]
    say(
        f"{preset} ({dtype}, seed {seed}): {n} layers + {cfg['num_nextn_predict_layers']} MTP, "
        f"ratios {cfg['compress_ratios']}, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}"
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
    say(
        f"writing {len(plan.files)} shard file(s), {plan.tensor_bytes / 2**30:.2f} GiB of "
        f"tensors, on {device} with {workers} thread(s)"
    )
    write_shards(tmp, plan, _work_items(plan, seed, device), workers, say)
    files += plan.files
    weight_map = plan.weight_map()
    (tmp / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": plan.tensor_bytes}, "weight_map": weight_map}, indent=2
        )
        + "\n"
    )
    files.append("model.safetensors.index.json")
    from vllm_dsv4_hw import __version__

    remake = f"--preset {preset}"
    if preset in REAL_PRESETS or n != hf_config(preset, dtype)["num_hidden_layers"]:
        remake += f" --layers {n}"
    remake += f" --dtype {dtype} --seed {seed}" + (
        " --device cuda" if device.type == "cuda" else ""
    )
    info = {
        "generator": GENERATOR,
        "generator_version": __version__,
        "format_version": FORMAT_VERSION,
        "preset": preset,
        "dtype": dtype,
        "seed": seed,
        "layers": n,
        "device": device.type,
        "remake_args": remake,
        "num_params": plan.num_params,
        "num_params_main": plan.num_params_main,
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
        num_params=plan.num_params,
        num_params_main=plan.num_params_main,
        num_tensors=len(weight_map),
        size_bytes=size_bytes,
        files=files,
        seconds=0.0,
        layers=n,
    )


def read_checkpoint_info(path: str | os.PathLike) -> dict | None:
    """The ``checkpoint_info.json`` of a generated checkpoint, or None (e.g. a real checkpoint)."""
    p = Path(path) / "checkpoint_info.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None
