"""The cells of lora-bench's results tables read back as the schema's types: numbers, counts and
flags from runs.csv's text, a cell its column cannot hold read as blank and named, and the backend
column under the plans' names."""

from __future__ import annotations

import math
from typing import Callable

import pandas as pd

from lora_bench.results.schema import column_index

# The backend column of runs recorded when three plans had other names there: read as the plans' names.
RENAMED_BACKENDS = {"triton": "fused", "cpp-direct": "direct", "cublas-streams": "streams"}


def runs_frame(df: pd.DataFrame, *, source: str = "runs.csv",
               warn: Callable[[str], None] = lambda message: None) -> pd.DataFrame:
    """Rows as text (runs.csv's cells) -> the schema's dtypes. A cell its column cannot hold (text
    in a number column, a fraction, inf or a number past int64 in a count) is read as blank, and
    ``warn`` names the column, the runs and the values."""
    for name, col in column_index().items():
        if name in df.columns:
            df[name], bad = _convert(df[name], col.dtype)
            if bad:
                runs = df["run_id"] if "run_id" in df.columns else pd.Series("?", index=df.index)
                shown = ", ".join(f"{runs[i]}: {v[:40]!r}" for i, v in bad[:3]) + (" ..." if len(bad) > 3 else "")
                what = {"Int64": "a whole number", "float64": "a number", "boolean": "True or False"}[col.dtype]
                warn(f"{source}: column {name} holds {len(bad)} value(s) that are not {what} ({shown}); "
                     "read as blank")
    if "backend" in df.columns:  # backend names as the plans'
        df["backend"] = df["backend"].map(plan_names)
    return df


def plan_names(backend: str) -> str:
    """A backend cell ('cpp+triton') with every plan under its name ('cpp+fused')."""
    if not isinstance(backend, str) or not backend:
        return backend
    return "+".join(sorted(RENAMED_BACKENDS.get(p, p) for p in backend.split("+")))


INT64 = (-(2**63), 2**63 - 1)


def _convert(s: pd.Series, dtype: str) -> tuple[pd.Series, list[tuple[object, str]]]:
    """The column as ``dtype``, and the (index, text) of the cells it cannot hold (read as blank)."""
    if dtype not in ("float64", "Int64", "boolean"):
        return s, []
    values, bad = [], []
    for i, text in s.items():
        value = _cell(text, dtype)
        if value is _BAD:
            bad.append((i, str(text)))
            value = None
        values.append(value)
    if dtype == "float64":
        return pd.Series([math.nan if v is None else v for v in values], index=s.index, dtype="float64"), bad
    return pd.Series(pd.array(values, dtype=dtype), index=s.index), bad


_BAD = object()


def _cell(text, dtype: str):
    """One cell's value (None for blank), or _BAD."""
    if text is None or (isinstance(text, float) and math.isnan(text)):
        return None
    text = str(text).strip()
    if text == "":
        return None
    if dtype == "boolean":
        return {"true": True, "false": False}.get(text.lower(), _BAD)
    try:
        number = float(text)
    except ValueError:
        return _BAD
    if dtype == "float64":  # inf stays: a diverged run's loss may be
        return None if math.isnan(number) else number
    if not math.isfinite(number):
        return _BAD
    try:
        whole = int(text)  # exact, for counts beyond float's 53 bits
    except ValueError:
        if not number.is_integer():
            return _BAD
        whole = int(number)
    return whole if INT64[0] <= whole <= INT64[1] else _BAD
