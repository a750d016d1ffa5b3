#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU measurements of the next device session, in device calls of under ten minutes each
# (H200, from the project root, carry [".gpuserve"]):
#
#   bash benchmarks/experiments/pending_ab.sh tier    # GPU tier (checks + AOT launch records, native and sm_80)
#   bash benchmarks/experiments/pending_ab.sh e4m3    # the indexer's e4m3 query: GPU check, FP8-dot sweep,
#                                         # decode_stack at 1M, --indexer-q model / e4m3
#   bash benchmarks/experiments/pending_ab.sh ab      # the knobs on the H200: read-ahead 0 / 256 interleaved,
#                                         # flat inv_rope; the kernel sweeps; the L2 probe
#   bash benchmarks/experiments/pending_ab.sh final   # streams on / off, V4-Flash 128K / 1M; V4-Pro 1M B=1; peer
#   bash benchmarks/experiments/pending_ab.sh targets # the rows "final" has that the topk / GEMV pairs do not:
#                                         # V4-Flash 1M B=32, V4-Pro 1M B=1, the inv_rope peer row
#   bash benchmarks/experiments/pending_ab.sh select  # 32 x 262,144 scores (1M B=32): radix blocks vs torch.topk,
#                                         # decode_stack 1M B=32 --indexer-select auto / radix
#   bash benchmarks/experiments/pending_ab.sh index-ab  # this checkout against .gpuserve/base, interleaved:
#                                         # the score pass's default launch (decode_kernels
#                                         # --only index_ab, with digests), decode_stack 1M B=1,32
#   bash benchmarks/experiments/pending_ab.sh gemv    # the GEMV (fp8_gemv) against the W8A8 tiles on every
#                                         # projection at 1 / 4 rows (same bits twice, error, us),
#                                         # then its knob sweep (gemv_probe --rows 1,4)
#   bash benchmarks/experiments/pending_ab.sh gemv-stack  # decode_stack 128K / 1M B=1,4: this checkout and
#                                         # .gpuserve/base's package, interleaved (BATCHES=1,4)
#   bash benchmarks/experiments/pending_ab.sh ncu     # Nsight Compute (full set) of the decode GEMMs at M=1
#                                         # (W8A8, as the layers call them) and the score pass at
#                                         # B=1 and 32 (benchmarks.experiments.ncu_decode); CSV under $OUT/ncu
# .gpuserve/base holds the package of an earlier commit, prepared on the CPU machine (after
# prepare.sh) with: bash benchmarks/experiments/pending_ab.sh base COMMIT
#
# Knobs (docs/performance.md, "The 2026-12-05 knobs decided on an H100"):
#   VLLM_DSV4_HW_WEIGHT_PREFETCH / decode_stack --weight-prefetch N: on (256) since 2026-12-05,
#       timed on an H100 only (0.5-1.5% of a decode step); the H200 pair confirms or reverts it;
# Everything lands under $OUT (one folder per run, its log beside its JSON).
set -u
PHASE=${1:?usage: pending_ab.sh tier|e4m3|ab|final|targets|select|index-ab|gemv|gemv-stack|ncu|base COMMIT}
OUT=${OUT:-out}
W="bash benchmarks/with_vllm.sh"
DS="python3 -m benchmarks.decode_stack --model v4-flash --contexts 128k,1m --batches 1,4,32
    --no-prefill --graphs on --streams on --steps 8 --reps 3"
DS1M="python3 -m benchmarks.decode_stack --model v4-flash --contexts 1m --batches 1,4,32
    --no-prefill --graphs on --streams on --steps 8 --reps 3"
stamp() { echo "=== $(date -u +%H:%M:%S) $*"; }
run() {  # run NAME CMD...: output in $OUT/NAME/
    local name=$1; shift
    mkdir -p "$OUT/$name"
    stamp "$name"
    "$@" --out "$OUT/$name" > "$OUT/$name/log.txt" 2>&1
    echo "rc=$?"; tail -4 "$OUT/$name/log.txt"
}
base_run() {  # base_run NAME CMD...: as run, with .gpuserve/base's package (this benchmarks/)
    local name=$1 dir; shift
    mkdir -p "$OUT/$name"
    dir=$(cd "$OUT/$name" && pwd)
    stamp "$name (base $(cat .gpuserve/base/COMMIT))"
    (cd .gpuserve/base && "$@" --out "$dir") > "$dir/log.txt" 2>&1
    echo "rc=$?"; tail -4 "$OUT/$name/log.txt"
}
case $PHASE in
base)
    C=${2:?usage: pending_ab.sh base COMMIT}
    rm -rf .gpuserve/base && mkdir -p .gpuserve/base
    git archive "$C" vllm_dsv4_hw | tar -x -C .gpuserve/base
    cp -r benchmarks .gpuserve/base/
    git rev-parse --short "$C" > .gpuserve/base/COMMIT
    echo "base: $(cat .gpuserve/base/COMMIT) in .gpuserve/base"; exit 0
    ;;
index-ab)
    test -f .gpuserve/base/COMMIT || { echo "no .gpuserve/base: pending_ab.sh base COMMIT"; exit 2; }
    WB="bash ../../benchmarks/with_vllm.sh"
    IX="python3 -m benchmarks.decode_kernels --only index_ab --batches 1,4,32"
    S1M="python3 -m benchmarks.decode_stack --model v4-flash --contexts 1m --batches 1,32
        --no-prefill --graphs on --streams on --steps 8 --reps 3"
    run ix-new-a $W $IX
    base_run ix-base-a $WB $IX
    run ix-new-b $W $IX
    base_run ix-base-b $WB $IX
    grep -hE "^index_ab|digest" "$OUT"/ix-*/log.txt || true
    run st-new $W $S1M
    base_run st-base $WB $S1M
    ;;
gemv)
    mkdir -p "$OUT/gemv"
    stamp "gemv check"
    timeout 150 $W python3 -m benchmarks.experiments.gemv_probe --product-check --out "$OUT/gemv" \
        > "$OUT/gemv/log.txt" 2>&1
    echo "rc=$?"; grep -E "^gemv_check" "$OUT/gemv/log.txt" || tail -5 "$OUT/gemv/log.txt"
    stamp "gemv sweep"
    timeout 270 $W python3 -m benchmarks.experiments.gemv_probe --rows ${ROWS:-1,4} --out "$OUT/gemv" \
        > "$OUT/gemv/sweep.txt" 2>&1
    echo "rc=$?"; grep -E " M=[0-9] floor" "$OUT/gemv/sweep.txt" || tail -5 "$OUT/gemv/sweep.txt"
    ;;
gemv-stack)
    test -f .gpuserve/base/COMMIT || { echo "no .gpuserve/base: pending_ab.sh base COMMIT"; exit 2; }
    WB="bash ../../benchmarks/with_vllm.sh"
    G="python3 -m benchmarks.decode_stack --model v4-flash --contexts 128k,1m --batches ${BATCHES:-1,4}
        --no-prefill --graphs on --streams on --steps 8 --reps 3"
    run new-a $W $G
    base_run base-a $WB $G
    run new-b $W $G
    base_run base-b $WB $G
    ;;
ncu)
    mkdir -p "$OUT/ncu"
    stamp "ncu gemm M=1"
    $W ncu --clock-control none --set full --kernel-name regex:'block_linear|quantize' --csv \
        --page details python3 -m benchmarks.experiments.ncu_decode --only gemm --batches 1 --calls 1 \
        > "$OUT/ncu/gemm-m1.csv" 2> "$OUT/ncu/gemm-m1.log"
    echo "rc=$?"; tail -3 "$OUT/ncu/gemm-m1.log"
    stamp "ncu index B=1,32"
    $W ncu --clock-control none --set full --kernel-name regex:'indexer_score' --csv \
        --page details python3 -m benchmarks.experiments.ncu_decode --only index --batches 1,32 --calls 1 \
        > "$OUT/ncu/index.csv" 2> "$OUT/ncu/index.log"
    echo "rc=$?"; tail -3 "$OUT/ncu/index.log"
    ;;
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
e4m3)
    mkdir -p "$OUT/check"
    stamp "gpu indexer check"
    $W python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k indexer -rA \
        > "$OUT/check/indexer.txt" 2>&1
    echo "rc=$?"; grep -E "e4m3|FAIL|passed|failed" "$OUT/check/indexer.txt" | tail -12
    run kernels-e4m3 $W python3 -m benchmarks.decode_kernels --only index_e4m3 --batches 1,4,32
    cat "$OUT/kernels-e4m3/log.txt" | grep -E "^index" || true
    run q-model $W $DS1M --indexer-q model
    run q-e4m3 $W $DS1M --indexer-q e4m3
    ;;
ab)
    run pf0-a $W $DS --weight-prefetch 0
    run pf256-a $W $DS --weight-prefetch 256
    run pf0-b $W $DS --weight-prefetch 0
    run pf256-b $W $DS --weight-prefetch 256
    run kernels $W python3 -m benchmarks.decode_kernels --only inv_rope,topk_sync,gemm_codes --batches 1,4,32
    mkdir -p "$OUT/l2"
    stamp l2_prefetch_probe
    OUT=$OUT/l2 $W python3 -m benchmarks.experiments.l2_prefetch_probe > "$OUT/l2/log.txt" 2>&1
    echo "rc=$?"; tail -25 "$OUT/l2/log.txt"
    ;;
final)
    run final $W python3 -m benchmarks.decode_stack --model v4-flash --contexts 128k,1m \
        --batches 1,4,32 --no-prefill --graphs on --streams on,off --steps 8 --reps 3 --profile
    run pro $W python3 -m benchmarks.decode_stack --model v4-pro --contexts 1m --batches 1 \
        --no-prefill --graphs on --streams on --steps 8 --reps 3
    run peer $W python3 -m benchmarks.peer
    ;;
targets)
    run b32 $W python3 -m benchmarks.decode_stack --model v4-flash --contexts 1m --batches 32 \
        --no-prefill --graphs on --streams on --steps 8 --reps 3
    run pro $W python3 -m benchmarks.decode_stack --model v4-pro --contexts 1m --batches 1 \
        --no-prefill --graphs on --streams on --steps 8 --reps 3
    run peer $W python3 -m benchmarks.peer --only inv_rope_fp8_quant
    ;;
select)
    run topk32 $W python3 -m benchmarks.decode_kernels --only topk --batches 32
    grep -E "^topk" "$OUT/topk32/log.txt" || true
    B32="python3 -m benchmarks.decode_stack --model v4-flash --contexts 1m --batches 32
        --no-prefill --graphs on --streams on --steps 8 --reps 3"
    run sel-auto $W $B32 --indexer-select auto
    run sel-radix $W $B32 --indexer-select radix
    ;;
*)
    echo "pending_ab.sh: unknown phase $PHASE (tier, e4m3, ab, final, select, index-ab, gemv, ncu or base)"
    exit 2 ;;
esac
stamp end
