"""Terminal rendering of one run's phase breakdown (device vs host, median and spread, and each
phase's measured cause: the GPU's busy fraction from a profiled repeat, or "not measured"), and
the run's summary under it (tokens/s, TFLOP/s, …), wrapped between its items, never inside one."""

from __future__ import annotations

import math

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

from lora_bench.config.setting_rules import VARIANT_DEFAULTS
from lora_bench.escaping import terminal
from lora_bench.report.study_model import NOT_MEASURED, cause_of
from lora_bench.results.schema import SETTING_PREFIX
from lora_bench.timing import PHASES


def _num(v) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _fmt(v, digits: int = 2) -> str:
    f = _num(v)
    return "-" if f is None else f"{f:.{digits}f}"


class Summary:
    """Items such as 'tokens/s 1241' on as few lines as the console's width allows, separated by
    ' · ': a line breaks between two items, never inside one (rich would wrap a caption at the
    table's width, in the middle of a label)."""

    SEP = "  ·  "

    def __init__(self, items: list[str]):
        self.items = items

    def lines(self, width: int) -> list[str]:
        out: list[str] = []
        for item in self.items:
            if out and len(out[-1]) + len(self.SEP) + len(item) <= width:
                out[-1] += self.SEP + item
            else:
                out.append(item)
        return out

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        for line in self.lines(options.max_width):
            yield Text(line, no_wrap=True, overflow="fold")


def variant_text(row: dict) -> str:
    """The run's LoRA variant settings that differ from the reference's LoRA ("lora_variant=dora,
    dora_norm=detached"), or "" for plain LoRA and for rows that predate them."""
    defaults = {**VARIANT_DEFAULTS, "dora_norm": "exact"}
    out = []
    for name in ("lora_variant", "dora_norm", *(k for k in VARIANT_DEFAULTS if k != "lora_variant")):
        plain = defaults[name]
        value = row.get(SETTING_PREFIX + name)
        if value is None or str(value) in ("", "nan"):
            continue
        number = _num(value) if isinstance(plain, float) else None
        if (number if number is not None else str(value)) != plain:
            out.append(f"{name}={value}")
    return ", ".join(out)


def cause_cell(busy: float | None) -> str:
    """'93 % GPU-bound' from a measured busy fraction; 'not measured' without one."""
    return NOT_MEASURED if busy is None else f"{100 * busy:.0f} % {cause_of(busy)}"


def phase_table(row: dict, *, busy: dict[str, float] | None = None, profile: str = "") -> Group:
    """Median [p10–p90] per phase, device and host, with each phase's measured cause (``busy``: the
    GPU's busy fraction per phase from the profiled repeat ``profile``); the run's summary under it."""
    clock = row.get("timing_clock") or "off"
    variant = variant_text(row)
    title = (f"{row.get('run_id', '')}  ·  {row.get('model_size')} {row.get('trainable_layers')}"
             + (f" ({variant})" if variant else "")
             + f"  ·  {row.get('device', '')} {row.get('gpu_name') or ''}  ·  clock: {clock}")
    status = row.get("status")
    if status not in (None, "", "done"):  # a failed or interrupted run: say so before any number
        title += f"  ·  {status}" + (f": {row.get('error')}" if row.get("error") else "")
    t = Table(title=Text(terminal(title)), title_justify="left")
    two_clocks = clock != "host"  # on a CPU the host clock is the only one: no device columns
    t.add_column("phase")
    if two_clocks:
        t.add_column("device ms (median)", justify="right")
        t.add_column("p10–p90", justify="right")
    t.add_column("host ms (median)", justify="right")
    t.add_column("p10–p90", justify="right")
    t.add_column("share", justify="right")
    if two_clocks:
        t.add_column("GPU busy (cause)")
    step = _num(row.get("step_ms_median"))
    for ph in (*PHASES, "step"):
        med = _num(row.get(f"{ph}_ms_median"))
        share = "" if ph == "step" or not step or med is None else f"{100 * med / step:.0f}%"
        device = [_fmt(med), f"{_fmt(row.get(f'{ph}_ms_p10'))}–{_fmt(row.get(f'{ph}_ms_p90'))}"]
        host = [_fmt(row.get(f"host_{ph}_ms_median")),
                f"{_fmt(row.get(f'host_{ph}_ms_p10'))}–{_fmt(row.get(f'host_{ph}_ms_p90'))}"]
        cause = [cause_cell((busy or {}).get(ph)) if ph != "step" else ""]
        t.add_row(ph, *(device if two_clocks else []), *host, share, *(cause if two_clocks else []))
    extras = []
    for key, label, d in (("tokens_per_s", "tokens/s", 0), ("achieved_tflops", "TFLOP/s", 2), ("mfu", "MFU", 3),
                          ("eval_s", "eval s", 2), ("training_time_s", "train s", 2),
                          ("peak_mem_allocated_mib", "peak MiB", 0), ("measured_steps", "steps measured", 0),
                          ("phase_sum_pct", "Σ phase medians vs step %", 1)):
        if _num(row.get(key)) is not None:
            extras.append(f"{label} {_fmt(row.get(key), d)}")
    if two_clocks:  # what the cause column rests on, where a reader sees it
        extras.append(f"GPU busy: kernel ms of profiled repeat {terminal(profile)} ÷ this run's device ms" if profile
                      else f"GPU busy {NOT_MEASURED}: no profiled repeat of these settings (--profile kernels); "
                           "host ≈ device time does not say which side waits")
    return Group(t, Summary(extras)) if extras else Group(t)
