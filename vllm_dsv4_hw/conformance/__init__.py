# SPDX-License-Identifier: Apache-2.0
"""The conformance kit: one command that certifies a backend on a device.

    vllm-dsv4-hw conformance --device {cpu,cuda,npu}[:N] [--shapes {small,real}] [--report FILE]
    python -m vllm_dsv4_hw conformance ...        (same; imports nothing from vLLM)

For every op it runs the backend the dispatcher selects on the device, and every other registered
backend that can run there, on fresh random inputs against a float64 oracle (poisoned caches and
allocator blocks, error budgets per output dtype and per cache format); checks each cache format's
byte layout on the device and the page buckets of the preset models; measures that two branches on
the stream layer overlap where the device has streams; prints a pass/fail table; writes a JSON or
markdown report (by the file's suffix); exits 1 on any failure. docs/vendor-ci.md tells a vendor
how to wire it into CI.
"""

from vllm_dsv4_hw.conformance.runner import ConformanceSetupError, run  # noqa: F401
