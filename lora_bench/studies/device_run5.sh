#!/usr/bin/env bash
# Device call 5 (session 2, call B): the 1558M modes (fused AdamW, compile inside graphs), kernel
# profiles of 1558M bf16 steps (eager: per-kernel device times), and issue 3's acceptance figures on
# a pinned process (taskset, 300 steps, 2 interleaved events/off repeats per trainable set).
# Same preparation as device_run4.sh; call with carry [".whl", ".devdata"].
set -uo pipefail
source lora_bench/studies/device_env.sh
t start
MODES="python3 -m lora_bench.studies.modes --data-file $DATA"
timeout 230 $MODES --out $R/modes --sizes 1558M --steps 50 --modes graphs-bf16-fused-fopt compile-graphs-bf16-fused-fopt \
  --skip compile-graphs-bf16-fused-fopt:lora-kernel compile-graphs-bf16-fused-fopt:all 2>&1 | grep -v USDT | tail -20 > $OUT/modes1558.log
t modes1558 done
timeout 90 $MODES --out $R/prof --sizes 1558M --steps 25 --modes eager-bf16-fused --layers lora-kernel lora --profile torch \
  2>&1 | grep -v USDT | tail -8 > $OUT/prof1558.log
for d in $R/prof/*/; do echo "== $d"; cat $d/kernels_by_phase.csv; head -25 $d/top_kernels.csv; done >> $OUT/prof1558.log 2>&1
t prof done
taskset -c 2-5 timeout 230 python3 -m lora_bench.studies.phase_timing --data-file $DATA --out $R/phase-timing-pinned \
  --steps 300 --repeats 2 --no-profiles 2>&1 | grep -v USDT | tail -12 > $OUT/phase_timing_pinned.log
t phase timing done
tar czf $OUT/results.tgz -C $R --exclude trace.json.gz .
