# SPDX-License-Identifier: Apache-2.0
"""Typed settings: every ``VLLM_DSV4_HW_*`` environment variable, in one place.

Each variable is read through a small parser so that a bad value fails with a message naming the
variable and the accepted values, instead of silently meaning "default".
Values are read at call time (not import time) so tests and launchers can set them late.

A setting with ``developer=True`` is a developer-only switch: an A/B or debugging lever whose
default is what a user wants (a settings table shows it apart from the user settings,
:data:`USER_VARS` / :data:`DEVELOPER_VARS`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Generic, TypeVar

T = TypeVar("T")

BACKEND_NAMES = ("reference", "triton", "npu")
MAIN_KV_FORMATS = ("bf16", "fp8")
INDEXER_KV_FORMATS = ("bf16", "fp8", "mxfp4")


class SettingError(ValueError):
    """A ``VLLM_DSV4_HW_*`` variable holds a value we cannot use."""


@dataclass(frozen=True)
class _Var(Generic[T]):
    name: str
    default: str
    parse: Callable[[str, str], T]
    doc: str
    developer: bool = False  # a developer-only switch (A/B, debugging), not a user setting

    def get(self) -> T:
        raw = os.environ.get(self.name, self.default)
        return self.parse(self.name, raw.strip())


def _choice(*allowed: str) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        value = raw.lower()
        if value not in allowed:
            raise SettingError(f"{name}={raw!r} is not supported; use one of: {', '.join(allowed)}")
        return value

    return parse


def _bool(name: str, raw: str) -> bool:
    value = raw.lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise SettingError(f"{name}={raw!r} is not a boolean; use 1/0, true/false, on/off")


def _nonnegative_int(name: str, raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise SettingError(f"{name}={raw!r} is not a whole number >= 0 (bytes; 0 turns it off)")
    return value


def _op_backends(name: str, raw: str) -> dict[str, str]:
    """``op=backend,op=backend`` -> dict. Op names are checked later, against the registry."""
    out: dict[str, str] = {}
    if not raw:
        return out
    for item in raw.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise SettingError(
                f"{name}: entry {item!r} is not of the form op=backend "
                f"(example: {name}=sparse_attention=triton,rms_norm=reference)"
            )
        op, backend = (part.strip() for part in item.split("=", 1))
        if backend not in BACKEND_NAMES:
            raise SettingError(
                f"{name}: backend {backend!r} for op {op!r} is unknown; "
                f"use one of: {', '.join(BACKEND_NAMES)}"
            )
        out[op] = backend
    return out


BACKEND = _Var(
    "VLLM_DSV4_HW_BACKEND",
    "auto",
    _choice("auto", *BACKEND_NAMES),
    "Backend for every op: auto (best available on the device) or an explicit one, which must run.",
)
OP_BACKENDS = _Var(
    "VLLM_DSV4_HW_OP_BACKENDS",
    "",
    _op_backends,
    "Per-op override, e.g. 'sparse_attention=triton,rms_norm=reference'; wins over BACKEND.",
)
KV_FORMAT = _Var(
    "VLLM_DSV4_HW_KV_FORMAT",
    "auto",
    _choice("auto", *MAIN_KV_FORMATS),
    "Main KV cache entry format (auto: the best the device supports).",
)
INDEXER_FORMAT = _Var(
    "VLLM_DSV4_HW_INDEXER_FORMAT",
    "auto",
    _choice("auto", *INDEXER_KV_FORMATS),
    "Indexer key cache entry format (auto: the best the device supports).",
)
MULTI_STREAM = _Var(
    "VLLM_DSV4_HW_MULTI_STREAM",
    "1",
    _bool,
    "Run the indexer and compressors on auxiliary streams where the device has streams.",
    developer=True,
)
CUDA_GRAPHS = _Var(
    "VLLM_DSV4_HW_CUDA_GRAPHS",
    "1",
    _bool,
    "Decode steps build their metadata with device ops only and the attention backend declares "
    "UNIFORM_SINGLE_TOKEN_DECODE graph support to vLLM (1); 0: every step through the general "
    "builder and no graph support (vLLM runs eagerly).",
    developer=True,
)

DEVICE = _Var(
    "VLLM_DSV4_HW_DEVICE",
    "auto",
    _choice("auto", "cpu", "cuda", "npu"),
    "Device type to plan and run for (auto: cuda, then npu, else cpu).",
)


def parse_capability(name: str, raw: str) -> tuple[int, int] | None:
    if not raw:
        return None
    try:
        major, minor = (int(part) for part in raw.split("."))
    except ValueError:
        raise SettingError(
            f"{name}={raw!r} is not a compute capability; use major.minor, "
            f"e.g. 8.0 (A100), 8.6, 8.9, 9.0, 10.0, 12.0"
        ) from None
    if not 7 <= major <= 12 or not 0 <= minor <= 9:
        raise SettingError(f"{name}={raw!r}: compute capability outside 7.0 .. 12.x")
    return major, minor


CUDA_CAPABILITY = _Var(
    "VLLM_DSV4_HW_CUDA_CAPABILITY",
    "",
    parse_capability,
    "Declare this CUDA compute capability (major.minor) instead of the GPU's, e.g. 8.0 to run the "
    "sm_80 paths (integer e4m3 encode / decode) on a newer GPU; kernels still compile for the GPU "
    "present. Empty: the GPU's own.",
    developer=True,
)

PLATFORM = _Var(
    "VLLM_DSV4_HW_PLATFORM",
    "auto",
    _choice("auto", "on", "off"),
    "Whether the plugin provides vLLM's platform: auto (only on CPU-only machines, where no "
    "built-in platform can run DeepSeek V4), on (always), off (never; the model is still "
    "registered).",
)
MODEL_OWNER = _Var(
    "VLLM_DSV4_HW_MODEL_OWNER",
    "ours",
    _choice("ours", "vendor"),
    "Whose DeepseekV4ForCausalLM serves where a vendor plugin (vllm-ascend) registers its own: "
    "ours (whatever the plugin load order; the vendor's other models stay) or vendor (ours, its "
    "launch rules and dsv4_hw_fp8 are not registered; the vendor's class and quantization serve).",
)
KERNEL_FAILURES = _Var(
    "VLLM_DSV4_HW_KERNEL_FAILURES",
    "fallback",
    _choice("fallback", "raise"),
    "When a kernel cannot run on this device at run time (a Triton compile error or out of "
    "resources; a torch_npu operator error): fallback (one warning, the op's reference "
    "implementation for the rest of the process) or raise (vendor CI, the GPU test tier).",
)
FP8_ACTIVATIONS = _Var(
    "VLLM_DSV4_HW_FP8_ACTIVATIONS",
    "auto",
    _choice("auto", "e4m3", "model"),
    "Activations of the FP8 linears: auto (e4m3 where the device has FP8 x FP8 tensor-core dots, "
    "capability fp8_dot: the checkpoints' dynamic activation scheme, as upstream vLLM's W8A8 "
    "kernels; else the model dtype), e4m3 (quantized on every device: the same numbers "
    "everywhere, slower where the device has no FP8 dots) or model (weight-only W8A16).",
)
INDEXER_Q = _Var(
    "VLLM_DSV4_HW_INDEXER_Q",
    "model",
    _choice("auto", "e4m3", "model"),
    "The indexer's query q^I: model (the model dtype, bf16 dots; the default, see "
    "docs/tuning.md), auto (e4m3 codes with one "
    "power-of-two scale per token and head, on FP8 tensor-core dots where the device has them, "
    "capability fp8_dot, as upstream vLLM's indexer quantizes q^I) or e4m3 (on every device).",
    developer=True,
)
PDL = _Var(
    "VLLM_DSV4_HW_PDL",
    "1",
    _bool,
    "The Triton kernels launch with programmatic dependent launch where the device has it "
    "(capability pdl: CUDA sm_90+): each kernel's launch overlaps its predecessor's tail, and "
    "waits for it before touching memory (1); 0: plain launches (A/B measurements).",
    developer=True,
)
WEIGHT_PREFETCH = _Var(
    "VLLM_DSV4_HW_WEIGHT_PREFETCH",
    "256",
    _nonnegative_int,
    "Bytes of each weight row a GEMM's programs ask L2 for before they wait for the kernel "
    "before them (with PDL: CUDA sm_90+), so the weight starts streaming while that kernel "
    "finishes; 0: none. Default 256 (two 128-column K blocks of an FP8 weight; see "
    "docs/tuning.md).",
    developer=True,
)

ALL_VARS = (
    DEVICE,
    BACKEND,
    OP_BACKENDS,
    KV_FORMAT,
    INDEXER_FORMAT,
    MULTI_STREAM,
    CUDA_GRAPHS,
    CUDA_CAPABILITY,
    PLATFORM,
    MODEL_OWNER,
    KERNEL_FAILURES,
    FP8_ACTIVATIONS,
    INDEXER_Q,
    PDL,
    WEIGHT_PREFETCH,
)
USER_VARS = tuple(v for v in ALL_VARS if not v.developer)
DEVELOPER_VARS = tuple(v for v in ALL_VARS if v.developer)


def device() -> str:
    return DEVICE.get()


def backend() -> str:
    return BACKEND.get()


def op_backends() -> dict[str, str]:
    return OP_BACKENDS.get()


def fp8_activations() -> str:
    return FP8_ACTIVATIONS.get()


def indexer_q() -> str:
    return INDEXER_Q.get()


def kv_format() -> str:
    return KV_FORMAT.get()


def indexer_format() -> str:
    return INDEXER_FORMAT.get()


def multi_stream() -> bool:
    return MULTI_STREAM.get()


def cuda_graphs() -> bool:
    return CUDA_GRAPHS.get()


def platform() -> str:
    return PLATFORM.get()


def model_owner() -> str:
    return MODEL_OWNER.get()


def pdl() -> bool:
    return PDL.get()


def weight_prefetch() -> int:
    return WEIGHT_PREFETCH.get()
