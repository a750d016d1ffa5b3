# SPDX-License-Identifier: Apache-2.0
"""Ascend NPU: the torch_npu / CANN probe, vllm-ascend detection, and which vLLM platform is active.

Nothing here imports ``torch_npu`` at module import; :func:`probe_torch_npu` imports it on first
call and turns every failure into one sentence (what is wrong and what to do).

Platform path (vLLM loads every ``vllm.platform_plugins`` entry point, allowed by ``VLLM_PLUGINS``,
and refuses to start when two out-of-tree plugins activate):

* **cooperate** -- vllm-ascend is installed and its ``ascend`` platform plugin is allowed: its
  ``NPUPlatform`` is the active platform (device, memory, graph mode, distributed), and this plugin
  must *not* activate a platform of its own. It still registers its ops and model through
  ``vllm.general_plugins``; where vllm-ascend's process already loaded its custom ops
  (``torch.ops._C_ascend``), the npu backend may call the ones that match our contracts
  (:func:`vllm_ascend_ops`).
* **unsupported** -- an NPU is usable but vllm-ascend is absent (or disabled through
  ``VLLM_PLUGINS``): this plugin provides no NPU platform of its own (vLLM's NPU device, memory,
  graph and HCCL hooks are vllm-ascend's), so no platform activates; the reason says to install or
  enable vllm-ascend.
* **none** -- no usable NPU: this plugin activates no platform (CUDA / CPU stay vLLM's built-ins).

:func:`choose_npu_platform` makes that decision and says why; the vLLM platform-plugin entry point
(``engine.plugin.platform_plugin``) logs the reason on NPU hosts.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import os
import sys
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# vllm-ascend's platform (activated by its ``ascend`` entry point in vllm.platform_plugins).
VLLM_ASCEND_PLATFORM = "vllm_ascend.platform.NPUPlatform"
VLLM_ASCEND_PLUGIN_NAME = "ascend"
PLATFORM_PLUGINS_GROUP = "vllm.platform_plugins"

# vllm-ascend custom ops (torch.ops._C_ascend.*) whose semantics match one of our contracts, and
# the op of ours each can serve. Only these are ever called.
VLLM_ASCEND_OPS = {
    # in-place GPT-J ("interleave") RoPE on the slice [nope, head_dim) of x [T, 1, H, D], cos/sin
    # [T, 1, 1, R] with each angle repeated for its pair; -sin gives the inverse rotation
    # (vllm_ascend.attention.dsa_v1 uses it for q, kv and the output epilogue)
    "inplace_partial_rotary_mul": "rope",
    # DeepSeek V4 shared-KV attention: sliding window (positions t-127..t through a block table)
    # + compressed entries (top-512 indices, causal limit (t+1)//cmp_ratio) + per-head fp32 sinks;
    # fed with each token's gathered rows as its own pages (ops/npu/sas.py)
    "npu_sparse_attn_sharedkv": "sparse_attention",
    # its split plan ([1024] int32), required by the attention operator
    "npu_sparse_attn_sharedkv_metadata": "sparse_attention",
    # ScatterNdUpdate written through var's strides (int8 included): both scatters of kv_insert
    "npu_scatter_nd_update_v2": "kv_insert",
    # mHC: the mixes (Sinkhorn included) and the pre-mix sub-block input of streams [T, 4, D];
    # the streams rebuilt from a sub-block output (ops/npu/mhc.py)
    "npu_hc_pre_v2": "hc_pre",
    "npu_hc_post": "hc_post",
}
# Read and not used (docs/npu-ops.md says why): compressor / compressor_metadata,
# npu_vllm_quant_lightning_indexer(+_metadata), npu_kv_quant_sparse_attn_sharedkv(+_metadata),
# kv_compress_epilog.


def _one_line(exc: object) -> str:
    return " ".join(str(exc).split())


def probe_torch_npu() -> tuple[bool, str]:
    """(usable, reason): whether torch_npu imports and sees an NPU. Never raises."""
    try:
        spec = importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return False, (
            "torch_npu is not installed (on an Ascend host: pip install torch-npu "
            f"matching torch {torch.__version__.split('+')[0]}, with the CANN toolkit)"
        )
    try:
        mod = importlib.import_module("torch_npu")
    except Exception as exc:  # CANN libraries missing, version mismatch, ...
        msg = _one_line(exc)
        if ".so" in msg or "CANN" in msg or "ascend" in msg.lower():
            hint = (
                "the CANN runtime is missing or not on the library path; run "
                "'source /usr/local/Ascend/ascend-toolkit/set_env.sh' (or your CANN "
                "install's set_env.sh) before starting"
            )
        else:
            hint = f"check that torch_npu matches torch {torch.__version__}"
        return False, f"torch_npu is installed but does not import ({msg}): {hint}"
    npu = getattr(torch, "npu", None) or getattr(mod, "npu", None)
    try:
        ok = bool(npu is not None and npu.is_available())
        count = int(npu.device_count()) if ok else 0
    except Exception as exc:
        return False, f"torch_npu imports but the NPU runtime fails ({_one_line(exc)})"
    if not ok or count == 0:
        return False, (
            "torch_npu imports but no NPU is visible (check 'npu-smi info' and "
            "ASCEND_RT_VISIBLE_DEVICES)"
        )
    version = getattr(mod, "__version__", "?")
    return True, f"torch_npu {version} with {count} NPU(s)"


def soc_name() -> str | None:
    """The SoC name of NPU 0 (e.g. 'Ascend910B2'), or None where no NPU is usable."""
    ok, _ = probe_torch_npu()
    if not ok:
        return None
    try:
        return str(torch.npu.get_device_name(0))  # type: ignore[attr-defined]
    except Exception:
        return None


# -- vllm-ascend ---------------------------------------------------------------------------------
def vllm_ascend_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm_ascend") is not None
    except (ImportError, ValueError):
        return False


def vllm_ascend_plugin() -> tuple[bool, bool, str]:
    """(installed, allowed, detail) of vllm-ascend's platform plugin, read from entry-point metadata
    and ``VLLM_PLUGINS`` (nothing is imported)."""
    try:
        eps = importlib.metadata.entry_points(group=PLATFORM_PLUGINS_GROUP)
    except Exception:  # pragma: no cover - broken metadata
        eps = ()
    ep = next((e for e in eps if e.name == VLLM_ASCEND_PLUGIN_NAME), None)
    if ep is None:
        if vllm_ascend_installed():
            return True, True, "vllm_ascend is importable (no entry-point metadata found)"
        return False, False, "vllm-ascend is not installed"
    allowed_raw = os.environ.get("VLLM_PLUGINS")
    if allowed_raw is not None:
        allowed = [p.strip() for p in allowed_raw.split(",") if p.strip()]
        if VLLM_ASCEND_PLUGIN_NAME not in allowed:
            return (
                True,
                False,
                (
                    f"vllm-ascend is installed but VLLM_PLUGINS={allowed_raw!r} does "
                    f"not enable its '{VLLM_ASCEND_PLUGIN_NAME}' platform plugin"
                ),
            )
    return True, True, f"vllm-ascend platform plugin '{ep.name}' -> {ep.value}"


def vllm_ascend_ops() -> dict[str, object]:
    """The vllm-ascend custom ops in :data:`VLLM_ASCEND_OPS` that this process has loaded.

    Only looked up when ``vllm_ascend`` is already imported (a vLLM process where vllm-ascend is
    the platform): importing it here would import vLLM, which the tools must not need.
    """
    if "vllm_ascend" not in sys.modules:
        return {}
    found = {}
    ns = getattr(torch.ops, "_C_ascend", None)
    for name in VLLM_ASCEND_OPS:
        try:
            fn = getattr(ns, name)
        except (AttributeError, RuntimeError):
            continue
        found[name] = fn
    return found


@dataclass(frozen=True)
class PlatformChoice:
    platform_class: str | None  # what the vllm.platform_plugins entry point should return
    mode: str  # "none", "cooperate" or "unsupported"
    reason: str


def choose_npu_platform(
    npu_usable: tuple[bool, str] | None = None, ascend_plugin: tuple[bool, bool, str] | None = None
) -> PlatformChoice:
    """Which platform class should be active on this host, and why (see the module docstring).

    Arguments default to :func:`probe_torch_npu` and :func:`vllm_ascend_plugin` (tests pass them).
    """
    ok, why = npu_usable if npu_usable is not None else probe_torch_npu()
    if not ok:
        return PlatformChoice(
            None, "none", f"no usable Ascend NPU ({why}); this plugin activates no platform"
        )
    plugin = ascend_plugin if ascend_plugin is not None else vllm_ascend_plugin()
    installed, allowed, detail = plugin
    if installed and allowed:
        return PlatformChoice(
            None,
            "cooperate",
            (
                f"{why}; {detail}: vllm-ascend's NPUPlatform is the active platform (only one "
                f"out-of-tree platform may activate), this plugin adds its ops and model through "
                f"vllm.general_plugins"
            ),
        )
    return PlatformChoice(
        None,
        "unsupported",
        (
            f"{why}; {detail}: DeepSeek V4 on an Ascend NPU runs under vllm-ascend's platform "
            f"(this plugin adds ops and the model to it); install vllm-ascend or enable its "
            f"'{VLLM_ASCEND_PLUGIN_NAME}' platform plugin"
        ),
    )
