#!/usr/bin/env bash
# Device call 7 (session 2, call D): after reverting the fp32-A/B reads in the fused kernels (6 %
# slower at 124M in call 6), re-measure the study's four lora-kernel graph rows (the sweep resumes:
# their folders were removed from results/all-vs-lora) and the 124M 5-epoch lora-kernel run, and run
# the GPU tests that call 6's time limit cut off. Same preparation as device_run4.sh.
set -uo pipefail
source lora_bench/studies/device_env.sh
save() { tar czf $OUT/results.tgz results/all-vs-lora $R ; }
t start
timeout 95 python3 -m lora_bench sweep configs/all-vs-lora-h200.yaml --isolation inline --results-dir results/all-vs-lora \
  --data-file $DATA --no-progress 2>&1 | grep -v USDT | tail -8 > $OUT/sweep.log
t sweep done; save
timeout 25 python3 -m lora_bench train --model-size 124M --weights random --rank 16 --alpha 16 --data-file $DATA --no-progress \
  --trainable-layers lora-kernel --precision bf16 --attention sdpa --ops fused --cuda-graphs --optimizer fused \
  --results-dir $R/wall-124m --run-id 124M-lora-kernel-graphs-bf16-fused-fopt-5ep 2>&1 | grep -E "^Training|^Validation|^Test|completed|step " > $OUT/wall.log
t wall done; save
timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_cpp.py "tests/test_modes.py::test_graph_replayed_evaluation_matches_eager" \
  2>&1 | tail -8 > $OUT/gpu_tests.log
t tests done
