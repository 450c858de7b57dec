"""Micro-benchmarks: one LoRA layer timed against the frozen layer."""
