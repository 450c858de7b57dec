"""lora-bench: a benchmark and ablation harness for LoRA fine-tuning of GPT-2."""

__version__ = "0.1.0"
