"""``python -m lora_bench`` = the ``lora-bench`` command."""

from .cli import main

main()
