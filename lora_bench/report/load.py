"""Reading results for a report: every run under the given folders (results folders found at any
depth below each, ``find_results_folders``), one row per (folder, run id),
with four derived columns — ``results_dir`` (the folder the row came from), ``run_dir`` (the folder
holding the run's own files), ``mode`` (the human name of its execution mode) and ``shared_gpu``
(its folder's runs shared their GPU: their timed columns are read blank, ``shared_gpu_note``) —
and the kernel counts a profiled run wrote.

Within one folder (reached twice, e.g. as a folder and as its runs.csv) a run id keeps one row: a
done row beats a failed one, otherwise the later start wins. Rows of one run id from different
folders (the same sweep run on two machines) are all kept, and ``shared_ids_note`` says so.

A setting added after some rows were written is blank in those rows; where other rows set it, the
blank reads as the default the row ran (``config.recorded``), which keeps the behaviour that came
before the setting, so that the old rows and the new group as the same settings."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pandas as pd

from lora_bench.config import DEFAULTS, TrainConfig
from lora_bench.config.recorded import FORMER_DEFAULTS, as_recorded
from lora_bench.errors import UsageError
from lora_bench.escaping import SHOWN_CHARS, clip
from lora_bench.report.labels import is_blank, mode_name
from lora_bench.results.folder_files import RUN_RECORD, RUNS_CSV
from lora_bench.results.guarded_read import read_results_file
from lora_bench.results.manifest import timings_shared
from lora_bench.results.prune import SUPERSEDED
from lora_bench.results.schema import SETTING_PREFIX, timed_columns
from lora_bench.results.store import read_run_table, read_runs, result_rows, text_value

RUN_DIR = "run_dir"
RESULTS_DIR = "results_dir"
MODE = "mode"
SHARED_GPU = "shared_gpu"  # True for a row whose folder's manifest says its runs shared their GPU
KERNELS_FILE = "kernels_by_phase.csv"  # written by ``--profile torch``: launches and kernel ms per phase
KERNELS_MAX_BYTES = 1 << 20  # one row per phase


def result_dirs(path: Path) -> list[Path]:
    """The results folders at ``path``: a runs.csv file's folder, or every results folder at any
    depth below a folder, itself included (``find_results_folders``)."""
    path = Path(path)
    if path.is_file():
        return [path.parent]
    if not path.is_dir():
        raise UsageError(f"no such results folder: {path}")
    return find_results_folders(path)


# -- finding results folders ------------------------------------------------------------------
SKIPPED = (SUPERSEDED,)  # rows a newer run replaced, kept for the record: read only where named


def find_results_folders(top: Path) -> list[Path]:
    """Every results folder at ``top`` or below it, in path order. The walk does not enter a run's
    own folder, a hidden folder, a link, or a ``superseded/`` folder below ``top`` (whose rows a
    newer run replaced); ``top`` itself is read whatever its name."""
    top = Path(top)
    found = []
    for here, dirs, files in os.walk(top):
        folder = Path(here)
        if RUNS_CSV in files or any((folder / d / RUN_RECORD).is_file() for d in dirs):
            found.append(folder)
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIPPED
                         and not (folder / d).is_symlink() and not (folder / d / RUN_RECORD).is_file())
    return sorted(found)


def load_results(paths: list[Path]) -> pd.DataFrame:
    """Every run under ``paths`` (folders, runs.csv files, or a folder of result folders), one row
    per (folder, run id) (see the module), schema dtypes."""
    merged: dict[tuple[str, str], dict] = {}
    header: dict[str, None] = {}  # every column the folders' runs.csv files write
    timed = timed_columns()
    for path in paths:
        for d in result_dirs(Path(path)):
            if (d / "runs.csv").is_file():  # an unreadable runs.csv is one clear error
                header.update(dict.fromkeys(read_run_table(d / "runs.csv").header))
            shared = timings_shared(d)
            for row in result_rows(d):
                key = (str(d.resolve()), row["run_id"])
                old = merged.get(key)
                if old is None or _rank(row) >= _rank(old):
                    if shared:  # its clocks measured the other runs on its GPU too: not a measurement
                        row = row | dict.fromkeys((c for c in timed if c in row), "")
                    merged[key] = row | {RESULTS_DIR: str(d), RUN_DIR: str(d / row["run_id"]), SHARED_GPU: shared}
    if not merged:
        shown = " ".join(str(p) for p in paths)
        raise UsageError(f"nothing to report: no results under {shown} "
                         "(run `lora-bench sweep FILE` or `lora-bench train` first)")
    rows = pd.DataFrame(list(merged.values()))
    # a run.json holds only the keys its run set (no test_acc when the final evaluation was skipped);
    # the columns of runs.csv stay, blank where unset
    missing = [c for c in header if c not in rows.columns]
    rows = pd.concat([rows, pd.DataFrame("", index=rows.index, columns=missing)], axis=1)
    rows = with_setting_defaults(rows)
    buf = io.StringIO()
    rows.to_csv(buf, index=False)
    buf.seek(0)
    df = read_runs(buf)
    df[MODE] = [mode_name(r) for r in df.to_dict("records")]
    df[SHARED_GPU] = df[SHARED_GPU].astype(str) == "True"  # read back from the text above
    return clipped(df)


def clipped(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` with every text cell longer than ``escaping.SHOWN_CHARS`` cut (``escaping.clip``): a
    report echoes its cells, and one value of thousands of characters would flood every table. The
    folders' paths stay whole: they are read from."""
    for col in df.columns:
        if col in (RUN_DIR, RESULTS_DIR) or not (df[col].dtype == object or pd.api.types.is_string_dtype(df[col])):
            continue
        long = df[col].map(lambda v: isinstance(v, str) and len(v) > SHOWN_CHARS)
        if long.any():
            df[col] = df[col].astype(object).where(~long, df[col].map(clip))
    return df


def with_setting_defaults(rows: pd.DataFrame) -> pd.DataFrame:
    """``rows`` with each blank setting cell holding the default its run ran where other rows set
    that setting (the module says why), and a setting whose default changed reading as its default
    where it does not apply (``config.recorded.as_recorded``); a setting blank in every row stays
    blank."""
    rows = rows.copy()
    for name in TrainConfig.field_names():
        col = SETTING_PREFIX + name
        if col not in rows:
            continue
        blank = rows[col].map(is_blank)
        if blank.all():
            continue
        if name in FORMER_DEFAULTS:
            rows[col] = rows.apply(lambda r: text_value(as_recorded(name, r[col], lambda k: r.get(SETTING_PREFIX + k))),
                                   axis=1).astype(object)
        elif blank.any() and text_value(DEFAULTS[name]) != "":
            rows[col] = rows[col].astype(object).where(~blank, text_value(DEFAULTS[name]))
    return rows


def shared_ids_note(df: pd.DataFrame) -> str:
    """A note when one run id came from several folders: their rows are all kept (as repeats of
    the same settings) rather than one hiding the others; '' otherwise."""
    if RESULTS_DIR not in df or df.empty:
        return ""
    folders = df.groupby("run_id")[RESULTS_DIR].nunique()
    shared = folders[folders > 1]
    if shared.empty:
        return ""
    where = sorted(set(df.loc[df["run_id"].isin(shared.index), RESULTS_DIR]))
    return (f"{len(shared)} run id(s) appear in more than one folder ({', '.join(where)}): every folder's row is "
            "kept and counts as a repeat of its settings; `lora-bench compare` sets two folders side by side")


def shared_gpu_note(df: pd.DataFrame) -> str:
    """A note naming the folders whose runs shared their GPU, so that their times are left out; ''
    where there are none."""
    if SHARED_GPU not in df or not df[SHARED_GPU].any():
        return ""
    where = sorted(set(df.loc[df[SHARED_GPU], RESULTS_DIR]))
    return (f"times left out for {', '.join(where)}: its runs ran side by side on one GPU (its manifest.json: "
            "timings shared), so each run's clock measured the others too")


def _rank(row: dict) -> tuple:
    return (row.get("status") == "done", row.get("started_at") or "")


def kernel_counts(run_dir: str | Path) -> dict[str, tuple[float, float]]:
    """{phase: (kernel launches per step, kernel device ms per step)} from a profiled run's folder;
    empty when the run wrote no profile."""
    path = Path(run_dir) / KERNELS_FILE
    data = read_results_file(path, limit=KERNELS_MAX_BYTES, root=Path(run_dir).parent)
    if data is None:
        return {}
    df = pd.read_csv(io.BytesIO(data))
    if not {"phase", "launches_per_step", "kernel_ms_per_step"} <= set(df.columns):
        return {}
    return {str(r.phase): (float(r.launches_per_step), float(r.kernel_ms_per_step)) for r in df.itertuples()}
