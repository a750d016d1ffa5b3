# SPDX-License-Identifier: Apache-2.0
"""Everything about a DeepSeek V4 launch that config.json and the flags tell, checked once, early.

:func:`check_serve_settings` is called where vLLM verifies a configuration in the first process (the
plugin's platform ``check_and_update_config``; a vendor platform calls it from its own hook) and
again when the model is built (any platform). Every problem is one :class:`UnsupportedSettingError`
line naming the field or flag and what to use instead, so ``vllm serve`` stops within seconds
instead of inside a worker traceback:

* config.json: ``validate_hf_config`` (``compress_ratios`` values and length, MoE choices, weight
  formats); a local checkpoint's ``model.safetensors.index.json`` must name every tensor of the
  official layout (``model/layout.py``; shapes and dtypes are checked when the weights load);
* a local checkpoint's files (:func:`check_shards`, headers only): every shard the index names is
  there, and each ``.safetensors`` file is as long as its header says (a truncated download, or
  bytes no tensor covers, which safetensors refuses inside a worker after the model is built);
* flags: parallelism (``--tensor-parallel-size`` must split the heads, groups and FP8 / FP4 blocks:
  ``parallel.check_split``; ``--enable-expert-parallel`` needs whole experts per rank; pipeline
  and data parallelism are refused),
  speculative decoding (the MTP layer is not served), ``--quantization`` against the checkpoint's,
  ``--kv-cache-dtype`` and ``--attention-config.indexer_kv_dtype`` against what the device holds;
* the KV cache's size, where it is known before the engine starts (``--kv-cache-memory-bytes``;
  on CPU ``VLLM_CPU_KVCACHE_SPACE``): :func:`check_kv_capacity` asks whether one request of
  ``--max-model-len`` fits by the accounting vLLM's engine applies (``engine.kv_pool``; vLLM's
  own helpers need the KV cache layout, which only the engine resolves), and says what would. Where the size comes from
  profiling (GPUs), vLLM's own check at KV cache allocation applies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from vllm_dsv4_hw.config import ConfigError, DSV4Config, validate_hf_config
from vllm_dsv4_hw.kv_cache.format_choice import FormatUnsupportedError, choose_formats
from vllm_dsv4_hw.kv_cache.specs import (
    MAIN_FORMAT_ALIASES,
    MAIN_FORMAT_NAMES,
    normalize_main_format,
)
from vllm_dsv4_hw.parallel import SplitError, check_split
from vllm_dsv4_hw.platform.device import detect_device_type

__all__ = [
    "KV_CACHE_DTYPES",
    "INDEXER_KV_DTYPES",
    "ServeSettings",
    "UnsupportedSettingError",
    "check_kv_capacity",
    "check_serve_settings",
    "check_shards",
    "raw_hf_config",
]

# vLLM --kv-cache-dtype -> our main entry format (None: from the plugin's settings): our format
# names and their aliases (kv_cache.specs), plus vLLM's spellings of the same formats.
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8_e4m3": "fp8",
    "bfloat16": "bf16",
    **{n: normalize_main_format(n) for n in (*MAIN_FORMAT_NAMES, *MAIN_FORMAT_ALIASES)},
}
# vLLM --attention-config.indexer_kv_dtype -> our indexer key format (None: the plugin's settings).
INDEXER_KV_DTYPES = {"auto": None, "bf16": "bf16", "fp8": "fp8", "mxfp4": "mxfp4"}


class UnsupportedSettingError(RuntimeError):
    """A vLLM setting or checkpoint field this model cannot run with (one line, with the fix).

    Not a ValueError: vLLM's config classes are pydantic dataclasses, which would wrap a ValueError
    raised while they verify themselves into a multi-line validation error whose last line is a
    link; this one reaches the user as the last line of the output."""


@dataclass(frozen=True)
class ServeSettings:
    cfg: DSV4Config
    main_format: str
    indexer_format: str


def raw_hf_config(model_config) -> dict:
    """The checkpoint's own config.json (official field names) when it is a local directory, else
    transformers' view of it; ``--hf-overrides`` given as a dict apply on top, as vLLM applies
    them to its own config."""
    raw = None
    path = Path(str(model_config.model)) / "config.json"
    if path.is_file():
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            pass
    if raw is None:
        raw = model_config.hf_config.to_dict()
    overrides = getattr(model_config, "hf_overrides", None)
    if isinstance(overrides, dict):
        raw.update(overrides)
    return raw


def _check_parallel(vllm_config, cfg: DSV4Config) -> None:
    pc = vllm_config.parallel_config
    if pc.pipeline_parallel_size != 1:
        raise UnsupportedSettingError(
            f"--pipeline-parallel-size {pc.pipeline_parallel_size} is not supported by DeepSeek V4 "
            f"on vllm-dsv4-hw; split the model with --tensor-parallel-size (with "
            f"--enable-expert-parallel for the experts) instead"
        )
    if pc.data_parallel_size != 1:
        raise UnsupportedSettingError(
            f"--data-parallel-size {pc.data_parallel_size} is not supported yet by DeepSeek V4 on "
            f"vllm-dsv4-hw (its MoE does not dispatch tokens across data-parallel ranks); use "
            f"--tensor-parallel-size N --enable-expert-parallel, or one server per replica"
        )
    try:
        check_split(cfg, pc.tensor_parallel_size, bool(pc.enable_expert_parallel))
    except SplitError as exc:
        raise UnsupportedSettingError(str(exc)) from None
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise UnsupportedSettingError(
            "speculative decoding (--speculative-config) is not supported by DeepSeek V4 on "
            "vllm-dsv4-hw: the MTP layer is not served; drop the flag"
        )


def _check_device() -> None:
    """The kernels compute in bf16 (tensor-core MMA from sm_80): a device without it is refused
    here rather than failing inside a kernel."""
    from vllm_dsv4_hw.platform.device import adaptor_for

    device = detect_device_type()
    adaptor = adaptor_for(device)
    if not adaptor.capabilities.bf16:
        raise UnsupportedSettingError(
            f"DeepSeek V4 on vllm-dsv4-hw needs bf16 compute, which {device} ({adaptor.name}) "
            f"lacks: CUDA GPUs from compute capability 8.0 (A100, RTX 30xx and newer), Ascend "
            f"A2/A3, AMD MI300; V100 / T4 (sm_70 / sm_75) are not supported"
        )


def _formats(vllm_config) -> tuple[str, str]:
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    if cache_dtype not in KV_CACHE_DTYPES:
        raise UnsupportedSettingError(
            f"--kv-cache-dtype {cache_dtype} is not supported by DeepSeek V4 on vllm-dsv4-hw; use "
            f"auto, fp8 (fp8_ds_mla) or bfloat16 (the indexer keys: "
            f"--attention-config.indexer_kv_dtype)"
        )
    att = getattr(vllm_config, "attention_config", None)
    idx_dtype = str(getattr(att, "indexer_kv_dtype", "auto") or "auto")
    if idx_dtype == "nvfp4":
        raise UnsupportedSettingError(
            "--attention-config.indexer_kv_dtype=nvfp4 is not supported by vllm-dsv4-hw; use "
            "mxfp4 (4-bit keys with ue8m0 block scales), fp8 or bf16"
        )
    if idx_dtype not in INDEXER_KV_DTYPES:
        raise UnsupportedSettingError(
            f"--attention-config.indexer_kv_dtype={idx_dtype} is not supported by vllm-dsv4-hw; "
            f"use one of {', '.join(INDEXER_KV_DTYPES)}"
        )
    main, idx = KV_CACHE_DTYPES[cache_dtype], INDEXER_KV_DTYPES[idx_dtype]
    try:
        choice = choose_formats(
            detect_device_type(),
            kv_format=main,
            indexer_format=idx,
            main_source="--kv-cache-dtype" if main else "VLLM_DSV4_HW_KV_FORMAT",
            indexer_source="--attention-config.indexer_kv_dtype"
            if idx
            else "VLLM_DSV4_HW_INDEXER_FORMAT",
        )
    except FormatUnsupportedError as exc:
        raise UnsupportedSettingError(str(exc)) from None
    return choice.main, choice.indexer


_MAX_LISTED = 10


INDEX = "model.safetensors.index.json"


def _weight_map(root: Path) -> dict[str, str] | None:
    """A local checkpoint's ``model.safetensors.index.json`` weight map (tensor -> shard file), or
    None where there is none."""
    index = root / INDEX
    if not index.is_file():
        return None
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise ValueError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UnsupportedSettingError(f"{index}: unreadable ({exc})") from None
    return weight_map


def _check_tensor_index(root: Path, weight_map: dict, raw: dict, cfg: DSV4Config) -> None:
    from vllm_dsv4_hw.model.layout import stored_layout

    if "compress_ratios" not in raw:
        return  # not in the official layout: the loader checks at load
    want = stored_layout(raw, "fp8" if cfg.weights.fp8_linears else "bf16", include_mtp=False)
    missing = sorted(n for n in want if n not in weight_map)
    if missing:
        more = len(missing) - _MAX_LISTED
        raise UnsupportedSettingError(
            f"{root / INDEX}: {len(missing)} tensor(s) missing from the checkpoint: "
            f"{', '.join(missing[:_MAX_LISTED])}" + (f" ... and {more} more" if more > 0 else "")
        )


# safetensors' own bound on the JSON header (MAX_HEADER_SIZE): a longer one is a damaged file.
_MAX_HEADER = 100_000_000
_TRUNCATED = "truncated (an interrupted download or copy?)"


def _shard_problem(path: Path) -> str | None:
    """What is wrong with one safetensors file, from its 8-byte header length and JSON header alone
    (the tensor data is never read), or None. safetensors refuses a file whose tensors do not end
    exactly at its last byte, so both a shorter and a longer file are damaged."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"is {size} bytes, shorter than a safetensors header: {_TRUNCATED}"
            n = int.from_bytes(head, "little")
            if n > _MAX_HEADER:
                return (
                    f"starts with a header length of {n} bytes, over safetensors' limit of "
                    f"{_MAX_HEADER}: its first bytes are damaged, or it is not a safetensors file"
                )
            if 8 + n > size:
                return f"is {size} bytes but its header alone needs {8 + n}: {_TRUNCATED}"
            header = json.loads(f.read(n))
    except OSError as exc:
        return f"unreadable ({exc.strerror or exc})"
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        return f"has a {n}-byte header that is not valid JSON ({exc}): the file is damaged"
    try:
        if not isinstance(header, dict):
            raise TypeError("not a JSON object")
        ends = [int(e["data_offsets"][1]) for k, e in header.items() if k != "__metadata__"]
    except (TypeError, KeyError, IndexError, ValueError) as exc:
        return f"has a header that is not a safetensors header ({exc}): the file is damaged"
    need = 8 + n + max(ends, default=0)
    if size < need:
        return f"is {size} bytes but its header describes {need}: {_TRUNCATED}"
    if size > need:
        return (
            f"is {size} bytes but its header describes {need}: {size - need} trailing bytes no "
            f"tensor covers (a damaged or partly overwritten file?)"
        )
    return None


def _refetch(root: Path) -> str:
    """How to get a good copy: a checkpoint ``make-checkpoint`` wrote is made again (its
    ``checkpoint_info.json`` says how), any other is downloaded again."""
    try:
        info = json.loads((root / "checkpoint_info.json").read_text())
        if str(info.get("generator", "")).startswith("vllm-dsv4-hw make-checkpoint"):
            if isinstance(info.get("remake_args"), str):  # with --layers / --device where needed
                return (
                    f"make it again: vllm-dsv4-hw make-checkpoint {root} {info['remake_args']} "
                    f"--force"
                )
            return (
                f"make it again: vllm-dsv4-hw make-checkpoint {root} --preset {info['preset']} "
                f"--dtype {info['dtype']} --seed {info['seed']} --force"
            )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass
    return "download the file again (or the checkpoint, e.g. with huggingface-cli download)"


def check_shards(root: Path, weight_map: dict[str, str] | None = None) -> None:
    """Every safetensors file a local checkpoint directory is loaded from (the shards its
    ``model.safetensors.index.json`` names, else each ``*.safetensors`` file, as vLLM's loader
    picks them) exists and is exactly as long as its header describes; else one
    :class:`UnsupportedSettingError` line naming the file, what is wrong and the fix."""
    if weight_map is None:
        weight_map = _weight_map(root)
    if weight_map is not None:
        counts: dict[str, int] = {}
        for fname in weight_map.values():
            counts[str(fname)] = counts.get(str(fname), 0) + 1
        files = sorted(counts)
        absent = [f for f in files if not (root / f).is_file()]
        if len(absent) == 1:
            (f,) = absent
            raise UnsupportedSettingError(
                f"{root / f} is missing ({INDEX} puts {counts[f]} tensor(s) in it); "
                f"{_refetch(root)}"
            )
        if absent:
            more = len(absent) - _MAX_LISTED
            raise UnsupportedSettingError(
                f"{root}: {len(absent)} shard files that {INDEX} names are missing: "
                + ", ".join(absent[:_MAX_LISTED])
                + (f" ... and {more} more" if more > 0 else "")
                + f"; {_refetch(root)}"
            )
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    bad = [(f, why) for f in files if (why := _shard_problem(root / f)) is not None]
    if bad:
        (first, why), others = bad[0], [f for f, _ in bad[1:]]
        also = f" ({len(others)} more damaged: {', '.join(others[:_MAX_LISTED])})" if others else ""
        raise UnsupportedSettingError(f"{root / first} {why}{also}; {_refetch(root)}")


def _check_checkpoint_files(model_config, raw: dict, cfg: DSV4Config) -> None:
    root = Path(str(model_config.model))
    if not root.is_dir():
        return  # a hub name: vLLM downloads the files later
    weight_map = _weight_map(root)
    if weight_map is not None:
        _check_tensor_index(root, weight_map, raw, cfg)
    check_shards(root, weight_map)


def check_serve_settings(vllm_config) -> ServeSettings:
    """Validate the launch (see the module docstring); returns the config and cache formats."""
    mc = vllm_config.model_config
    raw = raw_hf_config(mc)
    try:
        cfg = validate_hf_config(raw, name=f"{mc.model}/config.json")
    except ConfigError as exc:
        raise UnsupportedSettingError(str(exc)) from None
    _check_checkpoint_files(mc, raw, cfg)
    _check_device()
    _check_parallel(vllm_config, cfg)
    from vllm_dsv4_hw.quant.config import model_quant_config

    try:
        model_quant_config(vllm_config.quant_config, cfg.weights)
    except ValueError as exc:
        raise UnsupportedSettingError(str(exc)) from None
    main, idx = _formats(vllm_config)
    return ServeSettings(cfg, main, idx)


def _kv_memory_source(vllm_config) -> str:
    import os

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("VLLM_CPU_KVCACHE_SPACE", "") != "":
        return f"VLLM_CPU_KVCACHE_SPACE={os.environ['VLLM_CPU_KVCACHE_SPACE']}"
    return "--kv-cache-memory-bytes"


def check_kv_capacity(vllm_config, settings: ServeSettings) -> None:
    """One request of ``--max-model-len`` must fit the KV cache, by the accounting vLLM's engine
    applies when it allocates (``engine.kv_pool``: its KV cache groups of our layers' pages,
    the null block held back; checked against vLLM's logged capacity by the serve tests), when the
    size is already known (``cache_config.kv_cache_memory_bytes``); else nothing to check. Called
    once the platform has settled that size (the plugin's platform after vLLM's CPU hook read
    ``VLLM_CPU_KVCACHE_SPACE``; the model's constructor on any platform)."""
    available = getattr(vllm_config.cache_config, "kv_cache_memory_bytes", None)
    sched = getattr(vllm_config, "scheduler_config", None)
    if not available or sched is None:
        return
    from vllm_dsv4_hw.engine.kv_pool import longest_fitting_len, one_request_bytes, plan_vllm_pool

    cfg, main, idx = settings.cfg, settings.main_format, settings.indexer_format
    max_len, chunk = int(vllm_config.model_config.max_model_len), int(sched.max_num_batched_tokens)
    needed = one_request_bytes(plan_vllm_pool(cfg, main, idx, available, max_len, chunk))
    if needed <= available:
        return
    best = longest_fitting_len(cfg, main, idx, available, max_len, chunk)
    gib = 1 << 30
    fix = f"lower --max-model-len to at most {best} or give" if best > 0 else "give"
    raise UnsupportedSettingError(
        f"--max-model-len {max_len} needs {needed / gib:.3f} GiB of KV cache for one request "
        f"({main} main and {idx} indexer caches, chunks of up to {chunk} tokens), but the KV "
        f"cache has {available / gib:.3f} GiB ({_kv_memory_source(vllm_config)}): {fix} the KV "
        f"cache at least {needed / gib:.3f} GiB (vllm-dsv4-hw kv-plan --memory plans it)"
    )
