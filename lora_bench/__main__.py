"""``python -m lora_bench`` = the ``lora-bench`` command."""

from lora_bench.cli import main

main()
