"""Where the suite's files are: the checkout, the tests folder and its fixtures (the test files sit
in folders named like the package's, so each takes these from here rather than from its own path)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
FIXTURES = TESTS / "fixtures"
SAMPLE = FIXTURES / "sms_spam_sample.tsv"
