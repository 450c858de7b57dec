"""Which phase a profiled kernel counts in (lora_bench.train.profiling.kernel_summary), on events
shaped as torch.profiler's ``prof.events()`` gives them: CPU events, each with the device kernels
the profiler linked to it by correlation id."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

from lora_bench.train.profiling import kernel_summary


def _event(name: str, start: float, end: float, kernels=(), parent=None):
    return SimpleNamespace(name=name, device_type=DeviceType.CPU, time_range=SimpleNamespace(start=start, end=end),
                           kernels=[SimpleNamespace(name=k, duration=us) for k, us in kernels], cpu_parent=parent)


def _device(name: str, start: float, end: float, annotation: bool = False):
    """A device kernel as its own event, as the profiler lists every one beside the CPU events it
    links them to (``annotation``: a user range's device-side span, not a kernel)."""
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA, time_range=SimpleNamespace(start=start, end=end),
                           kernels=[], cpu_parent=None, is_user_annotation=annotation)


class _Prof:
    def __init__(self, events):
        self._events = events

    def events(self):
        return self._events


def _by_phase(events, steps=1):
    rows, top = kernel_summary(_Prof(events), steps=steps, cuda=True)
    return {r["phase"]: (r["launches_per_step"], r["kernel_ms_per_step"]) for r in rows}, top


def test_a_kernel_counts_in_the_phase_its_launching_op_started_in():
    events = [_event("phase:forward", 0, 100), _event("phase:backward", 100, 300),
              _event("aten::mm", 10, 20, [("gemm_fwd", 30.0)]),
              _event("aten::mm", 150, 160, [("gemm_bwd", 50.0), ("gemm_bwd", 50.0)])]
    got, _ = _by_phase(events)
    assert got["forward"] == (1, pytest.approx(0.030))
    assert got["backward"] == (2, pytest.approx(0.100))


def test_kernels_linked_to_a_phase_range_itself_count_in_that_phase():
    """A Triton kernel launched from an autograd Function's forward, no aten op open around it: the
    profiler links it to the innermost range open, the phase's own; it must not be dropped."""
    events = [_event("phase:forward", 0, 100, [("_lora_mm_kernel", 40.0)] * 3),
              _event("phase:backward", 100, 300, [("_lora_mm_kernel", 20.0)]),
              _event("aten::mm", 150, 160, [("gemm_bwd", 10.0)])]
    got, top = _by_phase(events)
    assert got["forward"] == (3, pytest.approx(0.120))
    assert got["backward"] == (2, pytest.approx(0.030))
    fwd = [t for t in top if t["phase"] == "forward"]
    assert fwd == [{"phase": "forward", "kernel": "_lora_mm_kernel", "calls_per_step": 3,
                    "ms_per_step": pytest.approx(0.120)}]


def test_counts_are_per_step_and_kernels_outside_every_phase_are_other():
    events = [_event("phase:forward", 0, 100), _event("aten::add", 10, 11, [("add", 4.0)] * 4),
              _event("aten::copy_", 500, 501, [("Memcpy HtoD", 2.0)])]
    got, _ = _by_phase(events, steps=2)
    assert got["forward"] == (2, pytest.approx(0.008))
    assert got["other"] == (0.5, pytest.approx(0.001))


def test_a_kernel_linked_to_no_cpu_event_counts_where_it_ran_on_the_device():
    """A kernel C++ code launched through the driver API (the ``direct`` plan's forward GEMM) comes
    as a device event linked to no CPU event: it counts in the phase whose range holds its start on
    the device. A device event linked to a CPU op counts once, through that op; a range's own
    device-side span counts not at all."""
    events = [_event("phase:forward", 0, 100), _event("phase:backward", 100, 300),
              _event("aten::mm", 150, 160, [("gemm_bwd", 10.0)]),
              _device("_lora_mm_kernel", 20, 60), _device("_lora_mm_kernel", 120, 140),
              _device("gemm_bwd", 161, 171), _device("phase:forward", 20, 60, annotation=True),
              _device("phase:backward", 120, 171)]  # a span not flagged, named as its CPU range
    got, top = _by_phase(events)
    assert got["forward"] == (1, pytest.approx(0.040))
    assert got["backward"] == (2, pytest.approx(0.030))
    assert {(t["phase"], t["kernel"]) for t in top} == {("forward", "_lora_mm_kernel"), ("backward", "_lora_mm_kernel"),
                                                        ("backward", "gemm_bwd")}


def test_linkage_by_correlation_id_keeps_a_twin_kernel_in_its_own_phase():
    """Where the events carry the profiler's ids (a CPU event's ``id``, a device event's
    ``linked_correlation_id``), a device kernel is linked exactly when its id names a CPU event
    holding kernels: an unlinked forward kernel with the name and the duration of a linked backward
    one still counts in the forward, and the linked one once, in the backward."""
    def cpu(name, start, end, kernels=(), id_=0):
        return SimpleNamespace(**vars(_event(name, start, end, kernels)), id=id_)

    def dev(name, start, end, linked=0):
        return SimpleNamespace(**vars(_device(name, start, end)), linked_correlation_id=linked)

    events = [cpu("phase:forward", 0, 100, id_=1), cpu("phase:backward", 100, 300, id_=2),
              cpu("aten::mm", 150, 160, [("_lora_mm_kernel", 40.0)], id_=3),
              dev("_lora_mm_kernel", 20, 60, linked=0),       # the direct plan's forward: linked to none
              dev("_lora_mm_kernel", 160, 200, linked=3)]     # the backward's, linked to aten::mm
    got, top = _by_phase(events)
    assert got["forward"] == (1, pytest.approx(0.040))
    assert got["backward"] == (1, pytest.approx(0.040))
    assert {(t["phase"], t["calls_per_step"]) for t in top} == {("forward", 1), ("backward", 1)}
