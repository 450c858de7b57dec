"""Test helpers shared by the sweep tests: the small corpus sample and the base settings of a tiny
CPU run (random weights, two steps, no evaluation), as the lines of a sweep file's ``base:``."""

from __future__ import annotations

from pathlib import Path

SAMPLE = Path(__file__).parent / "fixtures" / "sms_spam_sample.tsv"
TINY_BASE = f"""\
  model_size: tiny
  weights: random
  device: cpu
  data_file: {SAMPLE}
  num_epochs: 1
  max_steps: 2
  warmup_steps: 1
  eval_freq: 0
  skip_final_eval: true
"""
