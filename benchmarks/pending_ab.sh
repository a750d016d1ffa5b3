#!/usr/bin/env bash
# The GPU measurements that decide the knobs built but still off until timed, in device calls of
# under ten minutes each (H200, from the project root, carry [".gpuserve"]):
#
#   bash benchmarks/pending_ab.sh tier    # GPU tier (checks + AOT launch records, native and sm_80)
#   bash benchmarks/pending_ab.sh ab      # decode stack with each knob off / on, its kernel sweeps
#
# Knobs (each off by default, docs/performance.md "Built, not yet timed"):
#   VLLM_DSV4_HW_WEIGHT_PREFETCH / decode_stack --weight-prefetch N: GEMM weight lines asked of L2
#       before the PDL wait (benchmarks/l2_prefetch_probe.py: the same on one GEMM);
#   inv_rope_quant.FLAT / decode_stack --inv-rope-flat on: the flat row form
#       (decode_kernels --only inv_rope: per call, bit-equal; benchmarks.peer: the T=32 row).
# And one question for the next change: decode_kernels --only gemm_codes (the W8A8 GEMM with x's
# codes handed over, as a q norm that emits codes would hand them to wq_b and the indexer's wq_b).
# Everything lands under $OUT (one folder per run, its log beside its JSON).
set -u
PHASE=${1:?usage: pending_ab.sh tier|ab}
OUT=${OUT:-out}
W="bash benchmarks/with_vllm.sh"
DS="python3 -m benchmarks.decode_stack --model v4-flash --contexts 128k,1m --batches 1,4,32
    --no-prefill --graphs on --streams on --steps 8 --reps 3"
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }
run() {  # run NAME CMD...: output in $OUT/NAME/
    local name=$1; shift
    mkdir -p "$OUT/$name"
    stamp "$name"
    "$@" --out "$OUT/$name" > "$OUT/$name/log.txt" 2>&1
    echo "rc=$?"; tail -4 "$OUT/$name/log.txt"
}
case $PHASE in
tier)
    mkdir -p "$OUT/tier"
    stamp "tier native"
    DSV4_RECORD_LAUNCHES=$OUT/tier/launches-h200-native.json \
        $W python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider > "$OUT/tier/native.txt" 2>&1
    echo "rc=$?"; tail -3 "$OUT/tier/native.txt"
    stamp "tier sm_80 declared"
    VLLM_DSV4_HW_CUDA_CAPABILITY=8.0 DSV4_RECORD_LAUNCHES=$OUT/tier/launches-h200-declared-sm80.json \
        $W python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider > "$OUT/tier/sm80.txt" 2>&1
    echo "rc=$?"; tail -3 "$OUT/tier/sm80.txt"
    ;;
ab)
    run base $W $DS
    run prefetch-256 $W $DS --weight-prefetch 256
    run prefetch-1024 $W $DS --weight-prefetch 1024
    run flat $W $DS --inv-rope-flat on
    run kernels $W python3 -m benchmarks.decode_kernels --only inv_rope,topk_sync,gemm_codes --batches 1,4,32
    mkdir -p "$OUT/l2"
    stamp l2_prefetch_probe
    OUT=$OUT/l2 $W python3 -m benchmarks.l2_prefetch_probe > "$OUT/l2/log.txt" 2>&1
    echo "rc=$?"; tail -25 "$OUT/l2/log.txt"
    ;;
*)
    echo "pending_ab.sh: unknown phase $PHASE (tier or ab)"; exit 2 ;;
esac
stamp end
