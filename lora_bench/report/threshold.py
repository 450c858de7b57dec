"""The verdict threshold, apart from the statistics so that the command line reads it without
importing NumPy: a ratio must clear 1 ± 2 % with its whole interval to count as a difference (the one band of
every table, report and comparison; lora_bench.report.stats states the rule)."""

THRESHOLD = 0.02
