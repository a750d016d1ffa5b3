# SPDX-License-Identifier: Apache-2.0
"""Triton kernels: the `triton` backend of the dispatch layer (NVIDIA GPUs; triton-ascend; the
Triton interpreter on CPU with TRITON_INTERPRET=1 for tests).

Kernel modules import `triton` at their top, so they are imported only when it is installed; whether
the backend can run on a given device is decided later by ops/backends.py. What only shows when a
kernel is compiled for the GPU it meets (an unsupported dtype on that architecture, too much shared
memory, a ptxas error) is the run-time failure policy of ops/fallback.py, put around every kernel
here.
"""

import importlib.util
import logging

logger = logging.getLogger(__name__)

if importlib.util.find_spec("triton") is not None:
    try:  # one module (or sub-package) per op family; each op's module registers it
        from vllm_dsv4_hw.ops.triton import compressor as _compressor  # noqa: F401
        from vllm_dsv4_hw.ops.triton import decode_metadata as _decode_metadata  # noqa: F401
        from vllm_dsv4_hw.ops.triton import fused_prologue as _fused_prologue  # noqa: F401
        from vllm_dsv4_hw.ops.triton import kv_cache as _kv_cache  # noqa: F401
        from vllm_dsv4_hw.ops.triton import mhc as _mhc  # noqa: F401
        from vllm_dsv4_hw.ops.triton import moe as _moe  # noqa: F401
        from vllm_dsv4_hw.ops.triton import norm as _norm  # noqa: F401
        from vllm_dsv4_hw.ops.triton import rope as _rope  # noqa: F401
        from vllm_dsv4_hw.ops.triton.indexer import select as _indexer  # noqa: F401
        from vllm_dsv4_hw.ops.triton.linear import dense as _dense  # noqa: F401
        from vllm_dsv4_hw.ops.triton.linear import fp8_block_linear as _fp8  # noqa: F401
        from vllm_dsv4_hw.ops.triton.sparse_attention import kernel as _sparse  # noqa: F401
    except ImportError as exc:  # a broken triton install must not break the reference path
        logger.warning("dsv4-hw: Triton kernels unavailable (%s); using other backends", exc)


def _guard_kernels() -> None:
    """Every triton implementation under ops/fallback.py's policy: Triton's compile-time errors
    mean "this kernel cannot run on this GPU" (the interpreter's errors are not among them)."""
    from triton.compiler.errors import CompilationError
    from triton.runtime import errors as runtime_errors

    from vllm_dsv4_hw.ops import fallback
    from vllm_dsv4_hw.ops.registry import REGISTRY

    failures = (CompilationError, runtime_errors.OutOfResources)
    if hasattr(runtime_errors, "PTXASError"):
        failures += (runtime_errors.PTXASError,)
    for op in REGISTRY.ops():
        impls = REGISTRY.implementations(op)
        kernel, reference = impls.get("triton"), impls.get("reference")
        if kernel is None or hasattr(kernel.fn, "unguarded"):
            continue
        if reference is None:  # every op has one (tests/ops/test_registry.py)
            raise RuntimeError(f"op {op} has a triton kernel but no reference implementation")
        guarded = fallback.guard(op, "triton", reference.fn, failures, "Triton kernel")(kernel.fn)
        REGISTRY.register(op, "triton", guarded, tuple(kernel.requires))


if importlib.util.find_spec("triton") is not None:
    _guard_kernels()
