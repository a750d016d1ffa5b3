"""Load official DeepSeek V4 checkpoint tensors into ``DSV4Network`` (or any module using the
official parameter names).

Accepted formats, per tensor (see ``model/checkpoint.py`` and ``model/quant_formats.py``):

* ``name.weight`` float8_e4m3fn + ``name.scale`` [ceil(N/128), ceil(K/128)] ue8m0: FP8 block linear;
* ``name.weight`` int8 / uint8 [N, K/2] + ``name.scale`` [N, K/32] ue8m0: FP4 e2m1 routed expert
  (two codes per byte, low nibble first);
* anything else is stored as is (bf16 / fp32 / int64), converted to the parameter's dtype.

Quantized weights are dequantized at load to the parameter's dtype (exact in bf16 and fp32: a
power-of-two scale times a value of at most 3 mantissa bits). The weight and its scale may come
in either order. ``mtp.*`` tensors (the MTP layer, not served here) are skipped with one log line.

Errors are :class:`CheckpointLoadError` (a ``ValueError``) subclasses whose message names the tensor:
:class:`UnexpectedTensorError` (a name the model does not have), :class:`ShapeMismatchError`
(name, expected and got shapes), :class:`MissingTensorError` (after every tensor was consumed: the
names never loaded, or a quantized weight without its scale), :class:`QuantFormatError` (dtype or
scale that does not fit the format, out-of-range ``tid2eid`` entries).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_dsv4_hw.config import ConfigError, DSV4Config, validate_hf_config
from vllm_dsv4_hw.model.quant_formats import (
    dequantize_fp4_experts,
    dequantize_fp8_block,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SKIPPED_PREFIXES",
    "CheckpointLoadError",
    "ConfigError",
    "MissingTensorError",
    "QuantFormatError",
    "ShapeMismatchError",
    "UnexpectedTensorError",
    "checkpoint_targets",
    "load_weights",
    "safetensors_weights",
    "validate_hf_config",
]

SKIPPED_PREFIXES = ("mtp.",)
_SCALE_SUFFIX = ".scale"
_WEIGHT_SUFFIX = ".weight"
_MAX_LISTED = 20


class CheckpointLoadError(ValueError):
    """A checkpoint tensor that cannot be loaded into the model."""


class UnexpectedTensorError(CheckpointLoadError):
    pass


class ShapeMismatchError(CheckpointLoadError):
    pass


class MissingTensorError(CheckpointLoadError):
    pass


class QuantFormatError(CheckpointLoadError):
    pass


@dataclass
class _Target:
    param_name: str        # state_dict key of the destination tensor
    dest: torch.Tensor     # the destination (a view into it for stacked parameters)


def checkpoint_targets(model: nn.Module) -> dict[str, _Target]:
    """Official checkpoint name -> destination, for every parameter and persistent buffer.

    A module with a ``checkpoint_slices()`` method (e.g. ``moe.RoutedExperts``) maps several
    checkpoint tensors onto slices of its stacked parameters; every other tensor's checkpoint name
    is its state_dict key."""
    state = model.state_dict(keep_vars=True)
    targets: dict[str, _Target] = {}
    covered: set[str] = set()
    for mod_name, mod in model.named_modules():
        slices = getattr(mod, "checkpoint_slices", None)
        if not callable(slices):
            continue
        prefix = f"{mod_name}." if mod_name else ""
        for rel, attr, index in slices():
            pname = prefix + attr
            targets[prefix + rel] = _Target(pname, state[pname].data[index])
            covered.add(pname)
    for key, t in state.items():
        if key not in covered:
            targets[key] = _Target(key, t.data)
    return targets


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" ... and {more} more" if more > 0 else "")


def _is_quantized(t: torch.Tensor, dest: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:
        return True
    return t.dtype in (torch.int8, torch.uint8) and dest.is_floating_point()


def _dequantize(name: str, q: torch.Tensor, scale: torch.Tensor,
                expected: tuple[int, ...]) -> torch.Tensor:
    try:
        if q.dtype == torch.float8_e4m3fn:
            if tuple(q.shape) != expected:
                raise ShapeMismatchError(f"{name}: expected shape {expected}, got "
                                         f"{tuple(q.shape)} (fp8 e4m3)")
            return dequantize_fp8_block(q, scale)
        if q.dim() != 2 or len(expected) != 2 or tuple(q.shape) != (expected[0], expected[1] // 2):
            want = (expected[0], expected[1] // 2) if len(expected) == 2 else expected
            raise ShapeMismatchError(f"{name}: expected packed fp4 shape {want} (weight "
                                     f"{expected}), got {tuple(q.shape)}")
        return dequantize_fp4_experts(q, scale)
    except CheckpointLoadError:
        raise
    except ValueError as exc:
        raise QuantFormatError(f"{name} (+ {name[:-len(_WEIGHT_SUFFIX)]}{_SCALE_SUFFIX}): "
                               f"{exc}") from None


def _as_config(cfg) -> DSV4Config | None:
    if cfg is None or isinstance(cfg, DSV4Config):
        return cfg
    if isinstance(cfg, dict):
        return validate_hf_config(cfg)
    raise TypeError(f"cfg must be a DSV4Config, a config.json dict or None, got "
                    f"{type(cfg).__name__}")


@torch.no_grad()
def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                 cfg: DSV4Config | dict | None = None) -> set[str]:
    """Copy every ``(official name, tensor)`` of ``weights`` into ``model``; returns the state_dict
    keys loaded. Every model tensor must be loaded exactly once (else :class:`MissingTensorError`,
    listing the missing names); ``cfg`` (optional) enables the ``tid2eid`` range check."""
    cfg = _as_config(cfg)
    targets = checkpoint_targets(model)
    done: set[str] = set()
    pending_q: dict[str, torch.Tensor] = {}     # weight name -> quantized weight
    pending_s: dict[str, torch.Tensor] = {}     # weight name -> its scale
    skipped = 0

    def store(name: str, t: torch.Tensor) -> None:
        tgt = targets[name]
        if name in done:
            raise CheckpointLoadError(f"{name}: appears twice in the checkpoint")
        if tuple(t.shape) != tuple(tgt.dest.shape):
            raise ShapeMismatchError(f"{name}: expected shape {tuple(tgt.dest.shape)}, got "
                                     f"{tuple(t.shape)}")
        if tgt.dest.is_floating_point() != t.is_floating_point():
            raise QuantFormatError(f"{name}: dtype {t.dtype} cannot be loaded into a "
                                   f"{tgt.dest.dtype} parameter")
        if name.endswith("gate.tid2eid") and cfg is not None and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= cfg.n_routed_experts:
                raise QuantFormatError(f"{name}: expert ids must be in [0, "
                                       f"{cfg.n_routed_experts}), got values in [{lo}, {hi}]")
        tgt.dest.copy_(t.to(device=tgt.dest.device, dtype=tgt.dest.dtype))
        done.add(name)

    def store_quantized(wname: str, q: torch.Tensor, scale: torch.Tensor) -> None:
        if wname in done:
            raise CheckpointLoadError(f"{wname}: appears twice in the checkpoint")
        expected = tuple(targets[wname].dest.shape)
        store(wname, _dequantize(wname, q, scale, expected))

    for name, t in weights:
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        if name.endswith(_SCALE_SUFFIX):
            wname = name[:-len(_SCALE_SUFFIX)] + _WEIGHT_SUFFIX
            if wname not in targets:
                raise UnexpectedTensorError(
                    f"{name}: unexpected tensor (a scale for {wname}, which the model does "
                    f"not have)")
            if wname in pending_s:
                raise CheckpointLoadError(f"{name}: appears twice in the checkpoint")
            if wname in done:
                raise UnexpectedTensorError(f"{name}: unexpected scale ({wname} was stored "
                                            f"unquantized)")
            if wname in pending_q:
                store_quantized(wname, pending_q.pop(wname), t)
            else:
                pending_s[wname] = t
            continue
        if name not in targets:
            raise UnexpectedTensorError(f"{name}: unexpected tensor (the model has no parameter "
                                        f"of that name; shape {tuple(t.shape)}, {t.dtype})")
        if _is_quantized(t, targets[name].dest):
            if not name.endswith(_WEIGHT_SUFFIX):
                raise QuantFormatError(f"{name}: quantized dtype {t.dtype} on a tensor that is "
                                       f"not a linear weight")
            if name in pending_q or name in done:
                raise CheckpointLoadError(f"{name}: appears twice in the checkpoint")
            if name in pending_s:
                store_quantized(name, t, pending_s.pop(name))
            else:
                pending_q[name] = t
            continue
        if name in pending_s:
            raise UnexpectedTensorError(
                f"{name[:-len(_WEIGHT_SUFFIX)]}{_SCALE_SUFFIX}: unexpected scale ({name} is "
                f"stored unquantized, {t.dtype})")
        store(name, t)

    if pending_q:
        raise MissingTensorError(
            "quantized weight(s) without their .scale tensor: " + _listed(pending_q))
    if pending_s:
        raise MissingTensorError(
            "weight(s) missing from the checkpoint (only their .scale was found): "
            + _listed(pending_s))
    missing = set(targets) - done
    if missing:
        raise MissingTensorError(f"{len(missing)} tensor(s) missing from the checkpoint: "
                                 + _listed(missing))
    if skipped:
        logger.info("skipped %d %s tensors (the MTP layer is not loaded)", skipped,
                    "/".join(p + "*" for p in SKIPPED_PREFIXES))
    return {targets[n].param_name for n in done}


def safetensors_weights(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every tensor of a checkpoint directory (``model.safetensors.index.json``
    shard order, else every ``*.safetensors`` file in name order), read lazily shard by shard."""
    from safetensors import safe_open

    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        raise CheckpointLoadError(f"{root}: no safetensors files")
    for fname in files:
        with safe_open(str(root / fname), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (a safe_open handle, not a dict)
                yield name, f.get_tensor(name)
