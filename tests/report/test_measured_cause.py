"""One meaning of a bound phase: the GPU's busy fraction measured in a profiled repeat of the same
settings, or "not measured". Nothing the project publishes (a committed row as `show` renders it,
a committed report, a figure's text, the docs) labels a phase host- or GPU-bound without it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from rich.console import Console

from lora_bench.report.load import load_results, result_dirs
from lora_bench.report.phase_table import phase_table
from lora_bench.report.run_cause import measured_cause
from lora_bench.report.study_model import GPU_BOUND, cause_of
from lora_bench.timing import PHASES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"
# a cause named: host-/GPU-/launch-/device-/arithmetic-bound, or the GPU waiting for the host
LABEL = re.compile(r"\b(host|gpu|launch|device|arithmetic|cpu)[- ]bound\b|waits? for (python|the host)|"
                   r"\bbound(s|ed)? (by|each)\b", re.I)
# what a measured label carries with it: the busy fraction, or the kernel time a profile saw
MEASURED = re.compile(r"\bbusy\b|kernels for|not measured", re.I)
GENERATED_SCHEMA = "results-schema.md"


def _sentences(text: str) -> list[str]:
    text = re.sub(r"<[^>]+>", " ", text)  # HTML tags and Markdown comments
    return [s for s in re.split(r"(?<=\.)\s+|\n\s*\n|\n#+ |\n\|", text) if s.strip()]


def unmeasured_labels(text: str) -> list[str]:
    """Sentences of ``text`` that name a phase's cause without a measured busy fraction."""
    return [" ".join(s.split())[:200] for s in _sentences(text) if LABEL.search(s) and not MEASURED.search(s)]


def test_the_rule_catches_an_inferred_label_and_passes_a_measured_one():
    assert unmeasured_labels("Host time equals device time. The backward phase is host-bound.") == [
        "The backward phase is host-bound."]
    assert unmeasured_labels("a host segment as long as its device segment: that phase is host-bound") != []
    assert unmeasured_labels("The GPU waits for Python here.") != []
    assert unmeasured_labels("At 124M forward is host-bound (the GPU busy for 48 % of it).") == []
    assert unmeasured_labels("Its cause is not measured, so no phase is named GPU-bound.") == []


def _docs() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("path", _docs(), ids=lambda p: p.name)
def test_docs_name_no_cause_without_a_measured_busy_fraction(path):
    assert unmeasured_labels(path.read_text(encoding="utf-8")) == []


def _reports() -> list[Path]:
    return sorted(p for p in RESULTS.rglob("report*") if p.suffix in (".md", ".html", ".txt", ".json"))


def test_committed_reports_name_no_cause_without_a_measured_busy_fraction():
    reports = _reports()
    assert reports, "no committed report found"
    bad = {str(p.relative_to(ROOT)): unmeasured_labels(p.read_text(encoding="utf-8")) for p in reports}
    assert {k: v for k, v in bad.items() if v} == {}


def test_the_phase_figure_names_no_cause_without_a_measured_busy_fraction():
    from lora_bench.report.figures import close, phase_figure
    from lora_bench.report.study import build_study

    fig = phase_figure(build_study(load_results([RESULTS / "answer" / "study"])))
    try:
        texts = [fig._suptitle.get_text() if fig._suptitle else ""] + [t.get_text() for t in fig.texts]
        texts += [t.get_text() for ax in fig.axes for t in (ax.title, *ax.texts, *ax.get_yticklabels())]
    finally:
        close(fig)
    assert any("busy" in t for t in texts)  # the title says where the measured cause is
    assert [t for t in texts if unmeasured_labels(t)] == []


def _render(row: dict, busy: dict, profile: str) -> str:
    console = Console(width=400, record=True, file=open("/dev/null", "w"))  # noqa: SIM115 (closed below)
    try:
        console.print(phase_table(row, busy=busy, profile=profile))
        return console.export_text()
    finally:
        console.file.close()


def _folders() -> list[Path]:
    return sorted({d for p in RESULTS.rglob("runs.csv") if "superseded" not in p.parts for d in result_dirs(p)})


@pytest.mark.slow
def test_every_committed_row_shows_a_measured_cause_or_not_measured():
    """Each committed run as `show` renders it: a phase's cause cell holds the busy fraction a
    profiled repeat measured, with the cause it gives, or "not measured"; the recorded bound_*
    verdicts ('host'/'device') appear nowhere."""
    checked = measured = 0
    for folder in _folders():
        df = load_results([folder])
        for row in df[(df["status"] == "done") & df["timing_clock"].astype(str).str.startswith("cuda")].to_dict("records"):
            cause = measured_cause(df, row)
            text = _render(row, cause.busy, cause.profile)
            for ph in PHASES:
                line = next(ln for ln in text.splitlines() if ln.strip("│┃ ").startswith(ph + " "))
                cell = line.rstrip(" │").rsplit("│", 1)[-1].strip()
                if ph in cause.busy:
                    assert cell == f"{100 * cause.busy[ph]:.0f} % {cause_of(cause.busy[ph])}", (folder, row["run_id"])
                    measured += 1
                else:
                    assert cell == "not measured", (folder, row["run_id"], ph, cell)
            checked += 1
    assert checked > 100 and measured > 0


def test_show_prints_the_measured_cause_of_a_1558m_study_run(run_cli):
    study = RESULTS / "answer" / "study"
    df = load_results([study])
    eager = df[(df["model_size"] == "1558M") & (df["trainable_layers"] == "all") & (df["cfg_profile"] == "none")
               & (df["cfg_cuda_graphs"].astype(str) == "False")]
    run_id = sorted(eager["run_id"])[0]
    code, out = run_cli("show", study, run_id)
    assert code == 0
    cause = measured_cause(df, eager[eager["run_id"] == run_id].iloc[0].to_dict())
    assert cause.profile and set(cause.busy) == set(PHASES)
    for ph in ("forward", "backward", "optimizer"):  # `all` at 1558M keeps the GPU busy: measured, 96–97 %
        assert cause.busy[ph] >= GPU_BOUND and f"{100 * cause.busy[ph]:.0f} % GPU-bound" in out
    assert f"profiled repeat {cause.profile}" in out
    assert not re.search(r"│ *(host|device) *│", out)  # the recorded bound_* verdicts are not shown


def test_show_says_not_measured_without_a_profiled_repeat(run_cli):
    study = RESULTS / "answer" / "study"
    df = load_results([study])
    graphed = df[(df["model_size"] == "1558M") & (df["cfg_cuda_graphs"].astype(str) == "True")]
    code, out = run_cli("show", study, sorted(graphed["run_id"])[0])
    assert code == 0 and out.count("not measured") == len(PHASES) + 1  # each phase, and the note under the table
    assert "GPU-bound" not in out and "waits for the host" not in out


def test_a_profile_describes_only_runs_that_launch_its_kernels():
    """A profiled DoRA (or peer, or stored-base) repeat is not taken for plain LoRA's step, while a
    row written before a setting existed (a blank cell) reads as that setting's default."""
    import pandas as pd

    from lora_bench.report.study import same_step
    from lora_bench.results.schema import SETTING_PREFIX as P

    lora = pd.Series({"model_size": "124M", "trainable_layers": "lora", P + "lora_rank": 16,
                      P + "lora_variant": "lora", P + "dora_norm": "exact", P + "implementation": "book",
                      P + "base_dtype": "precision"})
    assert same_step(lora, lora.copy())
    for column, other in ((P + "lora_variant", "dora"), (P + "dora_norm", "detached"),
                          (P + "implementation", "hf"), (P + "base_dtype", "nf4")):
        changed = lora.copy()
        changed[column] = other
        assert not same_step(lora, changed), column
        older = lora.copy()
        older[column] = ""  # a row that predates the setting ran its default
        assert same_step(lora, older), column
        assert not same_step(changed, older), column


def test_the_phase_table_names_a_runs_lora_variant():
    """A DoRA, rsLoRA or LoRA+ run's table says so in its title; plain LoRA's and an older row's
    (no variant columns) say nothing more."""
    import io

    from lora_bench.report.phase_table import variant_text
    from lora_bench.results.schema import SETTING_PREFIX as P

    plain = {P + "lora_variant": "lora", P + "dora_norm": "exact", P + "lora_scaling": "alpha",
             P + "loraplus_lr_ratio": 1.0, P + "lora_init": "kaiming"}
    assert variant_text(plain) == "" and variant_text({}) == ""
    assert variant_text(plain | {P + "loraplus_lr_ratio": "1.0"}) == ""
    dora = plain | {P + "lora_variant": "dora", P + "dora_norm": "detached", P + "loraplus_lr_ratio": 16.0}
    assert variant_text(dora) == "lora_variant=dora, dora_norm=detached, loraplus_lr_ratio=16.0"
    row = {"run_id": "r", "model_size": "124M", "trainable_layers": "lora-kernel", "timing_clock": "host",
           "status": "done", **dora}
    buf = io.StringIO()
    Console(file=buf, width=200, color_system=None).print(phase_table(row))
    title = " ".join(buf.getvalue().split())  # the title wraps to the table's width
    assert "124M lora-kernel (lora_variant=dora, dora_norm=detached, loraplus_lr_ratio=16.0)" in title
