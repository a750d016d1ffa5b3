#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Run a command on the GPU machine with vLLM 0.32's Python tree importable (no vLLM wheel fits the
# H200's torch): the product's layers are vLLM layers, so the benchmarks need vLLM's modules.
#   bash benchmarks/with_vllm.sh python3 -m benchmarks.decode_stack ...
# Needs .gpuserve/ (bash ../shared/gpuserve/prepare.sh on the CPU machine; carry [".gpuserve"]).
# Installs the tree once per machine with gpuserve's own driver (stopping after its import probe),
# then runs the command with the same PYTHONPATH and settings, this checkout's package first.
set -euo pipefail
ROOT=$(pwd)
W=/tmp/gpuserve
if [ ! -d "$W/tree/vllm" ]; then
    # The driver names the plugin's entry points; give it this checkout's (pyproject.toml), so
    # that vLLM's plugin discovery loads our platform as `vllm serve` will.
    python3 benchmarks/gpuserve_entry_points.py .gpuserve/run_on_device.sh /tmp/run_on_device.sh
    # (the driver exits 1 when it stops before serving: judge by its import stage)
    GPUSERVE_STOP_AFTER=import GPUSERVE_SKIP_PLAIN=1 OUT=/tmp/gpuserve-install \
        bash /tmp/run_on_device.sh > /tmp/with_vllm_install.log 2>&1 || true
    grep "^STAGE" /tmp/with_vllm_install.log || true
    grep -q "^STAGE import ok" /tmp/with_vllm_install.log || {
        tail -30 /tmp/with_vllm_install.log; echo "with_vllm: vLLM tree install failed"; exit 1; }
fi
export PYTHONPATH="$W/shim:/tmp/site:$W/tree:$ROOT" GPUSERVE_SHIM=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
       VLLM_CACHE_ROOT=$W/vllm-cache TRITON_CACHE_DIR=$W/triton-cache PYTHONUNBUFFERED=1 \
       VLLM_USE_FLASHINFER_SAMPLER=0
unset TRITON_INTERPRET
exec "$@"
