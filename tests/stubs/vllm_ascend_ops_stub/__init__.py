# SPDX-License-Identifier: Apache-2.0
"""A CPU stand-in for the vllm-ascend custom operators the npu backend may call, for tests only.

vllm-ascend compiles its operators into ``torch.ops._C_ascend``; the npu backend looks them up only
in a process where ``vllm_ascend`` is imported (``platform/npu.py: vllm_ascend_ops``). This stub
registers, once per process, a ``_C_ascend`` torch library on the CPU dispatch key with the
schemas of the operators we use (argument names, types and defaults as in vllm-ascend's
``csrc/torch_binding.cpp``), each written in PyTorch from the operator's README and kernel source
(docs/npu-ops.md names the files and the commit) and enforcing the documented constraints.

Switch: :func:`enable` puts a marker module under ``sys.modules["vllm_ascend"]`` (what the backend's
detection keys on), :func:`disable` removes it; :func:`active` is both as a context manager. With
the switch off the registered operators stay in ``torch.ops`` but the backend never looks at them,
exactly as in a process without vllm-ascend. The marker has no ``__spec__``, so
``importlib.util.find_spec("vllm_ascend")`` does not report vllm-ascend as installed.

Every operator counts its calls and takes injected failures through ``torch_npu._control`` (the
torch_npu stub's controls), so tests assert that the vendor path really ran.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types

import torch

from vllm_ascend_ops_stub import _mhc, _rotary, _sas, _scatter

NAMESPACE = "_C_ascend"
_MARKER = types.ModuleType("vllm_ascend")
_MARKER.IS_STUB = True
_MARKER.__spec__ = None
_LIB = None
_LOCK = threading.Lock()

# name -> (schema, implementation); the schemas state vllm-ascend's signatures in our spelling
OPERATORS = {
    "npu_sparse_attn_sharedkv": (_sas.SCHEMA, _sas.npu_sparse_attn_sharedkv),
    "npu_sparse_attn_sharedkv_metadata": (
        _sas.METADATA_SCHEMA,
        _sas.npu_sparse_attn_sharedkv_metadata,
    ),
    "npu_scatter_nd_update_v2": (_scatter.SCHEMA, _scatter.npu_scatter_nd_update_v2),
    "inplace_partial_rotary_mul": (_rotary.SCHEMA, _rotary.inplace_partial_rotary_mul),
    "npu_hc_pre_v2": (_mhc.PRE_SCHEMA, _mhc.npu_hc_pre_v2),
    "npu_hc_post": (_mhc.POST_SCHEMA, _mhc.npu_hc_post),
}


def _register() -> None:
    global _LIB
    with _LOCK:
        if _LIB is not None:
            return
        lib = torch.library.Library(NAMESPACE, "DEF")
        for name, (schema, fn) in OPERATORS.items():
            lib.define(f"{name}{schema}")
            # the metadata op may be called without any tensor argument: no CPU key to dispatch on
            lib.impl(name, fn, "CompositeExplicitAutograd" if name.endswith("_metadata") else "CPU")
        _LIB = lib


def enable() -> None:
    """vllm-ascend's ops 'loaded in this process' (the npu backend will find and prefer them)."""
    _register()
    sys.modules["vllm_ascend"] = _MARKER


def disable() -> None:
    if sys.modules.get("vllm_ascend") is _MARKER:
        del sys.modules["vllm_ascend"]


def is_enabled() -> bool:
    return sys.modules.get("vllm_ascend") is _MARKER


@contextlib.contextmanager
def active(on: bool = True):
    """``with active(on):`` the stub ops are visible (on) or not (off) for the block."""
    was = is_enabled()
    enable() if on else disable()
    try:
        yield
    finally:
        enable() if was else disable()
