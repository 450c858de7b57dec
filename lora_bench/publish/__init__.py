"""What the repository publishes from its committed results: the reports each results folder
declares (committed), the index of a folder of results folders (results_index), and the generated
tables of README.md and docs/*.md and docs/results-schema.md (docs and its docs_* table modules),
all read from the runs through lora_bench.report and lora_bench.results."""
