# SPDX-License-Identifier: Apache-2.0
"""What a device can do, declared once per device type (read by dispatch and cache-format choice)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DeviceCapabilities:
    device_type: str
    fp8: bool  # float8 e4m3 bytes the backends encode and decode (cache entries, FP8 weights)
    fp8_cvt: bool  # e4m3 <-> fp32 conversion instructions (sm_89+); else integer bit operations
    mxfp4: bool  # e2m1 packed storage with ue8m0 block scales can be decoded by the kernels
    bf16: bool
    fp64: bool  # float64 tensors work (oracle tests; Ascend has none)
    streams: bool  # independent execution queues with events
    graphs: bool  # capture/replay of a whole step
    max_grid: int  # largest 1-D launch grid the backend should use
    # shared memory one kernel block may use (bytes, opt-in maximum); 0 = unknown (small tiles)
    shared_mem: int = 0
    # Launch-plan limits of the device's Triton (ops/triton/common/launch.py reads them):
    # the smallest M, N and K of a tl.dot (NVIDIA 16-bit operands need K >= 16; triton-ascend 3.2
    # asserts M, N, K >= 16, and so does its interpreter, which runs the kernels for CPU tensors)
    dot_min: int = 16
    # the grid is bound to the physical cores (Ascend): at most one program per core, the kernels'
    # grid-stride loops cover the rest; False = the hardware schedules any grid up to max_grid
    grid_cores: bool = False
    # the Triton backend emits NVIDIA PTX and takes inline PTX (tl.inline_asm_elementwise): the
    # packed e4m3 decode of ops/triton/common/ptx_codecs.py (CUDA sm_80+, not ROCm)
    ptx_inline: bool = False
    # the programs of one launch that fit the device at once all run concurrently, so they may
    # wait on each other through global atomics (the one-launch radix top-k, ops/triton/indexer/topk.py);
    # False where programs may run one after another (Ascend's core-bound grid, the interpreter)
    spin_sync: bool = False
    # tensor-core dots of two e4m3 operands with fp32 accumulation (CUDA sm_89+: Ada's mma, Hopper's
    # wgmma, Blackwell's): the FP8 linears' W8A8 kernel (ops/triton/linear/w8a8.py). ROCm's
    # gfx942 e4m3 is the fnuz variant, not the checkpoint's bytes: no.
    fp8_dot: bool = False
    # programmatic dependent launch (CUDA sm_90+, griddepcontrol): a kernel may be launched while
    # its predecessor in the stream finishes, and waits for it in its first instruction
    # (ops/triton/common/pdl.py); saves part of the launch gap between the decode step's ~1,300 kernels
    pdl: bool = False

    def has(self, name: str) -> bool:
        if name not in {f.name for f in fields(self)}:
            raise KeyError(f"unknown capability {name!r}")
        return bool(getattr(self, name))


CPU = DeviceCapabilities(
    "cpu",
    fp8=True,
    fp8_cvt=False,
    mxfp4=True,
    bf16=True,
    fp64=True,
    streams=False,
    graphs=False,
    max_grid=2**31 - 1,
)


KIB = 1024
# Opt-in shared memory per block by compute capability (CUDA programming guide, "Technical
# specifications per compute capability"); the launch plans pick larger tiles only where they fit.
_CUDA_SHARED = {
    (8, 0): 163 * KIB,
    (8, 7): 163 * KIB,
    (9, 0): 227 * KIB,
    (10, 0): 227 * KIB,
    (10, 3): 227 * KIB,
}
_CUDA_SHARED_BY_MAJOR = {8: 99 * KIB, 9: 227 * KIB, 10: 227 * KIB, 11: 99 * KIB, 12: 99 * KIB}
HIP_SHARED = 64 * KIB  # LDS per workgroup on MI200 / MI300 (gfx90a, gfx942)


def cuda_capabilities(major: int, minor: int, hip: bool = False) -> DeviceCapabilities:
    # e4m3 conversion instructions exist from sm_89 (Ada, Hopper, Blackwell); on sm_80 / sm_86 the
    # Triton kernels encode and decode e4m3 with integer bit operations (ops/triton/common/quant.py), so
    # every CUDA part keeps the fp8 cache formats and FP8 weights as shipped.
    return DeviceCapabilities(
        "cuda",
        fp8=True,
        fp8_cvt=(major, minor) >= (8, 9),
        mxfp4=True,
        bf16=major >= 8,
        fp64=True,
        streams=True,
        graphs=True,
        max_grid=2**31 - 1,
        ptx_inline=not hip and major >= 8,
        spin_sync=True,
        fp8_dot=not hip and (major, minor) >= (8, 9),
        pdl=not hip and major >= 9,
        shared_mem=HIP_SHARED
        if hip
        else _CUDA_SHARED.get((major, minor), _CUDA_SHARED_BY_MAJOR.get(major, 48 * KIB)),
    )


# Ascend A2/A3: no fp8 storage, no fp64; grid bound to the physical core count (see ENVIRONMENT.md).
NPU_A2_A3 = DeviceCapabilities(
    "npu",
    fp8=False,
    fp8_cvt=False,
    mxfp4=False,
    bf16=True,
    fp64=False,
    streams=True,
    graphs=True,
    max_grid=65535,
    grid_cores=True,
)
