"""Test helpers shared by the sweep tests: the small corpus sample, the base settings of a tiny
CPU run (random weights, two steps, no evaluation), as the lines of a sweep file's ``base:``, and a
sweep interrupted with SIGINT while one of its runs trains."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
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
# a run's settings (the inside of a YAML mapping) that train until a signal or a kill stops it: no
# step limit (TINY_BASE's two steps lifted) and more epochs than a test waits for
UNTIL_SIGNAL = "max_steps: null, num_epochs: 100000"


def interrupt_sweep(path: Path, results: Path, cache: Path, *, once: Path, timeout: float) -> tuple[int, str]:
    """``lora-bench sweep path`` in a child process, sent SIGINT 2.5 s after the file ``once``
    appears (the child of the run it marks imports torch first: either moment must work); its exit
    code and output."""
    proc = subprocess.Popen([sys.executable, "-c", "from lora_bench.cli import main; main()", "sweep", str(path),
                             "--results-dir", str(results), "--cache-dir", str(cache), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    while not once.is_file():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.1)
    time.sleep(2.5)
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=timeout)[0]
    return proc.returncode, out
