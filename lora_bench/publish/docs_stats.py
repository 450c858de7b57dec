"""The docs table of docs/measuring.md, "Intervals and verdicts": per number of repeats, the
order-statistic interval of a median (and of a paired ratio), the confidence it reaches, and the
lower bound an unpaired ratio's interval states, from lora_bench.report.order_stats itself."""

from __future__ import annotations

from lora_bench.publish.source import md_table
from lora_bench.report.order_stats import MIN_REPEATS, median_ranks
from lora_bench.report.stats import CONFIDENCE

SHOWN = range(2, 13)


def _rank(i: int, n: int) -> str:
    return "min" if i == 0 else "max" if i == n - 1 else f"x({i + 1})"


def table_order_stats() -> str:
    rows = []
    half = 1 - (1 - CONFIDENCE) / 2
    for n in SHOWN:
        lo, hi, reached = median_ranks(n, CONFIDENCE)
        _, _, each = median_ranks(n, half)
        rows.append([str(n), f"[{_rank(lo, n)}, {_rank(hi, n)}]", f"{100 * reached:.1f} %",
                     f"≥ {100 * max(0.0, 2 * each - 1):.1f} %", "yes" if n >= MIN_REPEATS else "no: too few repeats"])
    return md_table(["repeats n (pairs, or a side)", "median's interval (sorted values)",
                     "confidence it reaches (median, paired ratio)", "unpaired ratio (n a side): at least",
                     "verdict"], rows, align="---:|---|---:|---:|---")
