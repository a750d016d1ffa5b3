"""What a device can do, declared once per device type (read by dispatch and cache-format choice)."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class DeviceCapabilities:
    device_type: str
    fp8: bool  # can store and compute with float8 e4m3 (cache entries, quantized activations)
    mxfp4: bool  # e2m1 packed storage with ue8m0 block scales can be decoded by the kernels
    bf16: bool
    fp64: bool  # float64 tensors work (oracle tests; Ascend has none)
    streams: bool  # independent execution queues with events
    graphs: bool  # capture/replay of a whole step
    max_grid: int  # largest 1-D launch grid the backend should use

    def has(self, name: str) -> bool:
        if name not in {f.name for f in fields(self)}:
            raise KeyError(f"unknown capability {name!r}")
        return bool(getattr(self, name))


CPU = DeviceCapabilities("cpu", fp8=True, mxfp4=True, bf16=True, fp64=True,
                         streams=False, graphs=False, max_grid=2**31 - 1)


def cuda_capabilities(major: int, minor: int) -> DeviceCapabilities:
    # fp8 e4m3 arithmetic needs sm_89+ (Ada/Hopper); older parts can still store bytes, but our
    # Triton kernels convert in registers, which needs the hardware cvt instructions.
    fp8 = (major, minor) >= (8, 9)
    return DeviceCapabilities("cuda", fp8=fp8, mxfp4=True, bf16=major >= 8, fp64=True,
                              streams=True, graphs=True, max_grid=2**31 - 1)


# Ascend A2/A3: no fp8 storage, no fp64; grid bound to the physical core count (see ENVIRONMENT.md).
NPU_A2_A3 = DeviceCapabilities("npu", fp8=False, mxfp4=False, bf16=True, fp64=False,
                               streams=True, graphs=True, max_grid=65535)
