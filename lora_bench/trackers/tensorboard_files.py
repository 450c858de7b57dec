"""Runs written as TensorBoard event files: one subfolder per run (``OUTPUT/<run_id>``, by default
``FOLDER/tensorboard/<run_id>``) holding scalars (the metrics, at their steps), the settings as
hyperparameters (the HParams dashboard) and the tags as text, in one event file written at once
with TensorBoard's own record writer and protocol buffers (which, unlike its threaded file writer,
never load TensorFlow). A run exported before with the same record
digest (``DIGEST_FILE`` in its subfolder) is skipped; otherwise its old event files are deleted and
written anew, so re-exporting never doubles a curve."""

from __future__ import annotations

import io
from pathlib import Path

from lora_bench.fileio import atomic_write_bytes, atomic_write_text
from lora_bench.optional import require
from lora_bench.trackers.exported_run import RunExport

EXTRA = "trackers"
OUTPUT = "tensorboard"  # FOLDER/tensorboard: the default output
DIGEST_FILE = ".lora-bench-record"
EVENTS = "events.out.tfevents.*"  # what TensorBoard reads as an event file: a name holding "tfevents"
PURPOSE = "lora-bench's export to TensorBoard"


def modules():
    """TensorBoard's record writer and protocol buffers, or the UsageError naming the extra."""
    require("tensorboard", purpose=PURPOSE, extra=EXTRA)
    return (require("tensorboard.summary.writer.record_writer", purpose=PURPOSE, extra=EXTRA),
            require("tensorboard.compat.proto.event_pb2", purpose=PURPOSE, extra=EXTRA),
            require("tensorboard.compat.proto.summary_pb2", purpose=PURPOSE, extra=EXTRA),
            require("tensorboard.compat.proto.tensor_pb2", purpose=PURPOSE, extra=EXTRA),
            require("tensorboard.compat.proto.types_pb2", purpose=PURPOSE, extra=EXTRA),
            require("tensorboard.plugins.hparams.plugin_data_pb2", purpose=PURPOSE, extra=EXTRA))


def _events(run: RunExport) -> bytes:
    """The run's event file: its version record, the hyperparameters, the tags, the scalars."""
    records, event_pb2, summary_pb2, tensor_pb2, types_pb2, hparams_pb2 = modules()
    when = (run.start_ms or 0) / 1000
    out = io.BytesIO()
    writer = records.RecordWriter(out)
    writer.write(event_pb2.Event(wall_time=when, file_version="brain.Event:2").SerializeToString())

    def add(value, step: int = 0) -> None:
        event = event_pb2.Event(wall_time=when, step=step, summary=summary_pb2.Summary(value=[value]))
        writer.write(event.SerializeToString())

    start = hparams_pb2.HParamsPluginData(version=0, session_start_info=hparams_pb2.SessionStartInfo(
        start_time_secs=when))
    for k, v in run.params.items():
        start.session_start_info.hparams[k].string_value = v
    add(summary_pb2.Summary.Value(tag="_hparams_/session_start_info", metadata=summary_pb2.SummaryMetadata(
        plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="hparams",
                                                           content=start.SerializeToString()))))
    text = summary_pb2.SummaryMetadata(plugin_data=summary_pb2.SummaryMetadata.PluginData(plugin_name="text"))
    for k, v in run.tags.items():
        add(summary_pb2.Summary.Value(tag=k, metadata=text, tensor=tensor_pb2.TensorProto(
            dtype=types_pb2.DT_STRING, string_val=[v.encode()])))
    for m in run.metrics:
        add(summary_pb2.Summary.Value(tag=m.name, simple_value=m.value), m.step)
    return out.getvalue()


def export_tensorboard(runs: list[RunExport], *, output: Path) -> list[tuple[str, str]]:
    """Write ``runs`` under ``output``; returns (run id, 'written', 'replaced' or 'unchanged') per run."""
    done = []
    for run in runs:
        logdir = Path(output) / run.run_id
        marker = logdir / DIGEST_FILE
        old = sorted(logdir.glob(EVENTS))
        if old and marker.is_file() and marker.read_text() == run.digest:
            done.append((run.run_id, "unchanged"))
            continue
        for f in old:
            f.unlink()
        marker.unlink(missing_ok=True)
        logdir.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(logdir / f"events.out.tfevents.{(run.start_ms or 0) // 1000}.lora-bench", _events(run))
        atomic_write_text(marker, run.digest)
        done.append((run.run_id, "replaced" if old else "written"))
    return done
