"""The names of the files a results folder holds, declared once."""

RUNS_CSV = "runs.csv"  # the index of the folder's runs (lora_bench.results.store)
TORN_CSV = "runs-torn.csv"  # rows cut mid-way, set aside verbatim when runs.csv is rebuilt
LOCK_SUFFIX = ".lock"  # ``<name>.lock`` beside a file that processes read-modify-write in turn
MANIFEST = "manifest.json"  # the folder's provenance (lora_bench.results.manifest)
RUN_RECORD = "run.json"  # a run's record, in its own folder (lora_bench.results.records)
STEPS_CSV = "steps.csv"  # a run's measured steps, beside its record
RESULTS_FILES = (RUNS_CSV, MANIFEST, RUN_RECORD, STEPS_CSV, TORN_CSV)  # what no report or export writes over
