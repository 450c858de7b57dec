# Sourced by the device scripts (device_run4-7.sh, device_next.sh): the set-up every call needs on
# the lent GPU machine, run from the root of the copied working tree.
#  - the commit, from .devdata/COMMIT (the copy has no git history)
#  - the wheels the GPU image lacks (.whl/), installed to /tmp/site, and the package on PYTHONPATH
#  - DATA (the SMS corpus in .devdata/), R (scratch results), t (a timeline line into $OUT)
export LORA_BENCH_GIT_COMMIT=$(cat .devdata/COMMIT 2>/dev/null || echo unknown)
export PYTHONUNBUFFERED=1 LORA_BENCH_EXT_DIR=/tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
DATA=$PWD/.devdata/SMSSpamCollection.tsv; R=/tmp/res; mkdir -p $R
export LORA_BENCH_SMS_FILE=$DATA  # for the GPU tests
T0=$SECONDS; t() { echo "[$((SECONDS - T0)) s] $*" | tee -a $OUT/timeline.log; }
