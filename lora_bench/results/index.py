"""The name of the generated index of a folder of results folders (``results/README.md``, written by
lora_bench.publish.results_index): a file of the results, so no run may take its name."""

INDEX = "README.md"
