# SPDX-License-Identifier: Apache-2.0
"""Load official DeepSeek V4 checkpoint tensors into ``DSV4Network`` (or any module using the
official parameter names), keeping every weight in the format the checkpoint ships.

Each official tensor goes to its own destination, never through a dequantized copy:

* ``name.weight`` float8_e4m3fn + ``name.scale`` float8_e8m0fnu: the ``weight`` / ``scale``
  parameters of a linear whose method is ``quant.linear.Fp8BlockLinearMethod``;
* ``experts.E.wN.weight`` int8 [N, K/2] + ``.scale`` [N, K/32]: slices of the stacked FP4 expert
  parameters (``model.moe.RoutedExperts``);
* anything else (bf16 / fp32 / int64) is stored as is, converted to the parameter's float dtype.

Destinations come from :func:`checkpoint_targets`: vLLM linear layers load through their own
weight loaders (merged layers take the checkpoint names in ``checkpoint_shards``), modules with a
``checkpoint_slices()`` method map tensors onto slices of their parameters, and every other tensor's
checkpoint name is its state_dict key (loaded by its ``weight_loader`` where vLLM shards it). Split
over tensor-parallel ranks (``parallel``), shapes are checked against the whole checkpoint
tensor, each rank keeps its shard, and another rank's experts are read and dropped. ``mtp.*`` tensors (the MTP layer, not served here) are skipped
with one log line.

Errors are :class:`CheckpointLoadError` (a ``ValueError``) subclasses whose message names the tensor:
:class:`UnexpectedTensorError` (a name the model does not have), :class:`ShapeMismatchError`
(name, expected and got shapes), :class:`MissingTensorError` (after every tensor was consumed: the
names never loaded, or a quantized weight without its scale), :class:`QuantFormatError` (a dtype
that does not fit the parameter's format, out-of-range ``tid2eid`` entries or scale bytes).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_dsv4_hw.config import ConfigError, DSV4Config, validate_hf_config

logger = logging.getLogger(__name__)

__all__ = [
    "SKIPPED_PREFIXES",
    "CheckpointLoadError",
    "ConfigError",
    "MissingTensorError",
    "QuantFormatError",
    "ShapeMismatchError",
    "UnexpectedTensorError",
    "checkpoint_state",
    "checkpoint_targets",
    "load_weights",
    "safetensors_weights",
    "validate_hf_config",
]

SKIPPED_PREFIXES = ("mtp.",)
_SCALE_SUFFIX = ".scale"
_WEIGHT_SUFFIX = ".weight"
_MAX_LISTED = 20
_FP8 = torch.float8_e4m3fn
_E8M0 = torch.float8_e8m0fnu
_DENSE_HINT = (
    " (the model was built for dense weights: build it from this checkpoint's "
    "config.json, whose quantization_config declares the quantized ones)"
)


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
    param_name: str  # state_dict key of the destination parameter / buffer
    dest: torch.Tensor | None  # where the tensor lands (this rank's view); None: another
    # tensor-parallel rank holds it (loaded as a no-op)
    store: Callable[[torch.Tensor], None]
    shape: tuple  # the checkpoint tensor's shape (whole, before sharding)


def _held_elsewhere(t: torch.Tensor) -> None:
    return None


def _full_linear_shape(layer: nn.Module, attr: str, rows: int) -> tuple:
    """The checkpoint shape of a vLLM linear's ``weight`` / ``scale`` with ``rows`` output rows
    (whole: vLLM's weight loaders take this rank's shard of it)."""
    if attr == "weight":
        return (rows, layer.input_size)
    bn, bk = layer.quant_method.block
    return (-(-rows // bn), -(-layer.input_size // bk))


def _linear_targets(prefix: str, layer: nn.Module, state: dict) -> dict[str, _Target]:
    """Official names of one vLLM linear layer's parameters (``weight``, ``scale``)."""
    out: dict[str, _Target] = {}
    shards = getattr(layer, "checkpoint_shards", None)
    parent = prefix.rsplit(".", 1)[0] + "." if "." in prefix else ""
    for attr in ("weight", "scale"):
        pname = f"{prefix}.{attr}"
        if pname not in state:
            continue
        param = state[pname]
        loader = getattr(param, "weight_loader", None)
        if shards is None:
            out[pname] = _Target(
                pname,
                param.data,
                (lambda t, p=param, f=loader: f(p, t))
                if loader
                else (lambda t, p=param: p.data.copy_(t)),
                _full_linear_shape(layer, attr, layer.output_size),
            )
            continue
        block = 1 if attr == "weight" else layer.quant_method.block[0]
        start = 0
        for i, (name, n) in enumerate(zip(shards, layer.output_sizes)):
            local = n // layer.tp_size  # this rank's rows of shard i
            lo, hi = start // block, -(-(start + local) // block)
            out[f"{parent}{name}.{attr}"] = _Target(
                pname,
                param.data[lo:hi],
                lambda t, p=param, f=loader, i=i: f(p, t, i),
                _full_linear_shape(layer, attr, n),
            )
            start += local
    return out


def _slice_store(view: torch.Tensor, src: tuple) -> Callable[[torch.Tensor], None]:
    return lambda t: view.copy_(t[src])


def checkpoint_targets(model: nn.Module) -> dict[str, _Target]:
    """Official checkpoint name -> destination, for every parameter and persistent buffer (and,
    split over ranks, for the tensors another rank holds)."""
    from vllm.model_executor.layers.linear import LinearBase

    state = model.state_dict(keep_vars=True)
    targets: dict[str, _Target] = {}
    covered: set[str] = set()
    for mod_name, mod in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        if isinstance(mod, LinearBase):
            t = _linear_targets(mod_name, mod, state)
            targets.update(t)
            covered.update(x.param_name for x in t.values())
            continue
        slices = getattr(mod, "checkpoint_slices", None)
        if not callable(slices):
            continue
        for sl in slices():
            if sl.attr is None:
                targets[prefix + sl.name] = _Target("", None, _held_elsewhere, tuple(sl.shape))
                continue
            pname = prefix + sl.attr
            view = state[pname].data[sl.dest]
            targets[prefix + sl.name] = _Target(
                pname, view, _slice_store(view, sl.src), tuple(sl.shape)
            )
            covered.add(pname)
    for key, t in state.items():
        if key in covered:
            continue
        loader = getattr(t, "weight_loader", None)  # vLLM's sharded parameters (vocabulary, ...)
        store = (lambda x, p=t, f=loader: f(p, x)) if loader else t.data.copy_
        targets[key] = _Target(key, t.data, store, tuple(getattr(t, "checkpoint_shape", t.shape)))
    return targets


def checkpoint_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Official name -> the model's tensor (views for stacked / merged parameters): what
    :func:`load_weights` would overwrite, e.g. to copy one model's weights into another (only the
    tensors this rank holds whole)."""
    return {
        name: t.dest
        for name, t in checkpoint_targets(model).items()
        if t.dest is not None and tuple(t.dest.shape) == t.shape
    }


def _listed(names: Iterable[str]) -> str:
    names = sorted(names)
    more = len(names) - _MAX_LISTED
    return ", ".join(names[:_MAX_LISTED]) + (f" ... and {more} more" if more > 0 else "")


def _as_config(cfg) -> DSV4Config | None:
    if cfg is None or isinstance(cfg, DSV4Config):
        return cfg
    if isinstance(cfg, dict):
        return validate_hf_config(cfg)
    raise TypeError(
        f"cfg must be a DSV4Config, a config.json dict or None, got {type(cfg).__name__}"
    )


def _converted(name: str, t: torch.Tensor, dest: torch.Tensor) -> torch.Tensor:
    """``t`` in the destination's format, or an error naming the tensor: quantized data only into
    quantized parameters (no dequantization at load, no quantization of float weights)."""
    dd = dest.dtype
    if dd == _FP8:
        if t.dtype != _FP8:
            raise QuantFormatError(
                f"{name}: {t.dtype} cannot be loaded into an FP8 e4m3 weight "
                f"(the checkpoint's config.json declares FP8 linears)"
            )
        return t
    if dd == _E8M0:
        if t.dtype == torch.uint8:
            t = t.view(_E8M0)
        elif t.dtype == torch.float32:
            e = torch.log2(t)
            if not torch.equal(e, e.round()) or bool((e.abs() > 127).any()):
                raise QuantFormatError(
                    f"{name}: fp32 scales must be powers of two in "
                    f"[2^-127, 2^127] to be stored as ue8m0"
                )
            t = t.to(_E8M0)
        elif t.dtype != _E8M0:
            raise QuantFormatError(
                f"{name}: scale dtype {t.dtype}; expected float8_e8m0fnu (ue8m0)"
            )
        if t.numel() and int(t.view(torch.uint8).max()) == 255:
            raise QuantFormatError(f"{name}: ue8m0 scale byte 255 (NaN)")
        return t
    if dd == torch.uint8:  # packed FP4 codes (int8 on disk: the same bytes)
        if t.dtype not in (torch.int8, torch.uint8):
            raise QuantFormatError(f"{name}: packed FP4 weight must be int8 / uint8, got {t.dtype}")
        return t.view(torch.uint8)
    if dest.is_floating_point() != t.is_floating_point() or t.dtype in (_FP8, _E8M0):
        hint = _DENSE_HINT if t.dtype in (_FP8, _E8M0, torch.int8) else ""
        raise QuantFormatError(
            f"{name}: dtype {t.dtype} cannot be loaded into a {dd} parameter{hint}"
        )
    return t


@torch.no_grad()
def load_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: DSV4Config | dict | None = None,
) -> set[str]:
    """Copy every ``(official name, tensor)`` of ``weights`` into ``model``; returns the state_dict
    keys loaded. Every model tensor must be loaded exactly once (else :class:`MissingTensorError`,
    listing the missing names); ``cfg`` (optional) enables the ``tid2eid`` range check."""
    cfg = _as_config(cfg)
    targets = checkpoint_targets(model)
    done: set[str] = set()
    skipped = 0
    for name, t in weights:
        if name.startswith(SKIPPED_PREFIXES):
            skipped += 1
            continue
        tgt = targets.get(name)
        if tgt is None:
            if name.endswith(_SCALE_SUFFIX):
                wname = name[: -len(_SCALE_SUFFIX)] + _WEIGHT_SUFFIX
                if t.dtype == _E8M0 and wname in targets and targets[wname].dest.dim() >= 2:
                    raise QuantFormatError(
                        f"{name}: a ue8m0 block scale, but {wname} is a dense "
                        f"parameter here{_DENSE_HINT}"
                    )
                what = (
                    f"{wname} is stored unquantized"
                    if wname in targets
                    else f"a scale for {wname}, which the model does not have"
                )
                raise UnexpectedTensorError(f"{name}: unexpected scale ({what})")
            raise UnexpectedTensorError(
                f"{name}: unexpected tensor (the model has no parameter "
                f"of that name; shape {tuple(t.shape)}, {t.dtype})"
            )
        if name in done:
            raise CheckpointLoadError(f"{name}: appears twice in the checkpoint")
        if tuple(t.shape) != tgt.shape:
            packed = (
                " (packed fp4: two codes per byte)"
                if tgt.dest is not None and tgt.dest.dtype == torch.uint8
                else ""
            )
            raise ShapeMismatchError(
                f"{name}: expected shape {tgt.shape}{packed}, got {tuple(t.shape)}"
            )
        if tgt.dest is None:  # another rank's expert
            done.add(name)
            continue
        t = _converted(name, t, tgt.dest)
        if name.endswith("gate.tid2eid") and cfg is not None and t.numel():
            lo, hi = int(t.min()), int(t.max())
            if lo < 0 or hi >= cfg.n_routed_experts:
                raise QuantFormatError(
                    f"{name}: expert ids must be in [0, "
                    f"{cfg.n_routed_experts}), got values in [{lo}, {hi}]"
                )
        tgt.store(t.to(device=tgt.dest.device))
        done.add(name)

    missing = set(targets) - done
    scales = {n for n in missing if n.endswith(_SCALE_SUFFIX)}
    orphans = sorted(
        n[: -len(_SCALE_SUFFIX)] + _WEIGHT_SUFFIX
        for n in scales
        if n[: -len(_SCALE_SUFFIX)] + _WEIGHT_SUFFIX in done
    )
    if orphans:
        raise MissingTensorError(
            "quantized weight(s) without their .scale tensor: " + _listed(orphans)
        )
    if missing:
        raise MissingTensorError(
            f"{len(missing)} tensor(s) missing from the checkpoint: " + _listed(missing)
        )
    if skipped:
        logger.info(
            "skipped %d %s tensors (the MTP layer is not loaded)",
            skipped,
            "/".join(p + "*" for p in SKIPPED_PREFIXES),
        )
    return {targets[n].param_name for n in done if targets[n].dest is not None}


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
