#!/usr/bin/env bash
# Device call 6 (session 2, call C): GPU tests of the kernel changes (shape-chosen capture plan, fp32
# A/B read by the fused kernels), the committed study (configs/all-vs-lora-h200.yaml into
# results/all-vs-lora), 5-epoch wall-time runs at 124M in the fastest mode, the reference-mode
# (eager fp32) 5-epoch runs of lora and lora-kernel, and the interleaved kernel bench at the 1558M
# shapes. Same preparation as device_run4.sh; call with carry [".whl", ".devdata"].
set -uo pipefail
source lora_bench/studies/device_env.sh
save() { tar czf $OUT/results.tgz -C $R --exclude trace.json.gz . ; }
t start; python3 -c "from lora_bench.kernels import lora_cpp; assert lora_cpp.module() is not None"
t ext built
timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_kernel.py tests/test_lora_cpp.py \
  "tests/test_modes.py::test_graph_replayed_evaluation_matches_eager" 2>&1 | tail -15 > $OUT/gpu_tests.log
t tests done
timeout 220 python3 -m lora_bench sweep configs/all-vs-lora-h200.yaml --isolation inline --results-dir $R/all-vs-lora \
  --data-file $DATA --no-progress 2>&1 | grep -v USDT | tail -30 > $OUT/sweep.log
t sweep done; save
TRAIN="python3 -m lora_bench train --model-size 124M --weights random --rank 16 --alpha 16 --data-file $DATA --no-progress"
for L in lora-kernel lora all; do
  timeout 30 $TRAIN --trainable-layers $L --precision bf16 --attention sdpa --ops fused --cuda-graphs --optimizer fused \
    --results-dir $R/wall-124m --run-id 124M-$L-graphs-bf16-fused-fopt-5ep 2>&1 | grep -E "^Training|^Validation|^Test|completed|step " >> $OUT/wall.log
done
t wall done; save
timeout 70 python3 -m lora_bench kernel-bench --shapes 1558m --dtypes bf16,fp32 --impls frozen,lora,lora-kernel \
  --no-progress --out $R/kernel-bench-h200/kernel_bench_1558m.csv 2>&1 | tail -5 > $OUT/kernel_bench.log
t kbench done; save
for L in lora-kernel lora; do
  timeout 75 $TRAIN --trainable-layers $L --results-dir $R/wall-124m --run-id 124M-$L-eager-fp32-5ep 2>&1 \
    | grep -E "^Training|^Validation|^Test|completed|step " >> $OUT/wall.log
done
t eager whole runs done; save
