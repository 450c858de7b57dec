"""``--filter KEY=VALUE`` of ``report`` and ``compare``: keep the runs whose KEY (a setting, a label
or any results column, named as ``--group-by`` names it) holds VALUE, compared as text in any case
or as a number (16 matches 16.0). Several filters all apply; one KEY given twice keeps either value.
A filter that names no column, or that leaves no run, is a usage error naming what there is."""

from __future__ import annotations

import pandas as pd

from lora_bench.errors import UsageError
from lora_bench.report.aggregate import resolve_column
from lora_bench.report.groups import same

SHOWN_VALUES = 12  # the values a refused filter names, at most


def parse_filters(items: list[str] | None) -> list[tuple[str, str]]:
    """``KEY=VALUE`` items as (key, value) pairs; a malformed one is a usage error."""
    out = []
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise UsageError(f"--filter {item!r}: give KEY=VALUE, e.g. --filter trainable_layers=lora")
        out.append((key.strip(), value.strip()))
    return out


def filter_runs(df: pd.DataFrame, items: list[str] | None) -> pd.DataFrame:
    """The rows of ``df`` every filter keeps (see the module); ``df`` itself without filters."""
    filters = parse_filters(items)
    if not filters or df.empty:
        return df
    wanted: dict[str, list[str]] = {}
    for key, value in filters:
        wanted.setdefault(resolve_column(df, key), []).append(value)
    keep = pd.Series(True, index=df.index)
    for col, values in wanted.items():
        before = keep
        keep = keep & df[col].map(lambda v, values=values: any(same(_text(v), x) for x in values))
        if not keep.any():
            have = sorted({_text(v) for v in df.loc[before, col]})
            shown = ", ".join(have[:SHOWN_VALUES]) + (f" and {len(have) - SHOWN_VALUES} more"
                                                      if len(have) > SHOWN_VALUES else "")
            given = " ".join(f"--filter {k}={v}" for k, v in filters)
            raise UsageError(f"no run matches {given}: {col} holds {shown or 'no value'}")
    return df[keep]


def _text(v) -> str:
    return "" if v is None or (isinstance(v, float) and v != v) or v is pd.NA else str(v)
