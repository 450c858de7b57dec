"""How long a run will take on this device, said before its first step: the run's work counted
from its settings and its data (``Work``: training steps and the forward batches of its
evaluations) times the time of one step and one forward measured on the run's own model at the
run's batch shape (``probe``). The probe leaves no trace in the run: the random number generators
are restored after it, no optimizer steps, the gradients it made are dropped and the model's mode
is put back, so the run's numbers are those it has without it. Its time is not: what a first step
pays once (lazy set-up, allocator growth) the probe pays instead of the loop's first (warm-up)
steps, so ``train`` probes only with its progress display on (``--no-progress`` measures as a
sweep's runs do). On a CPU, a long run gets a suggestion of a short one."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from lora_bench.kernels.policy import use_policy

LONG_ON_CPU_S = 10 * 60  # a CPU run longer than this gets the suggestion of a short one
SHORT_STEPS = 10  # the short run suggested
# The first step pays once for what later steps reuse (a few seconds of lazy set-up on a CPU; on a
# GPU the kernels' compilation and tuning, up to tens of seconds): the step is probed again, the
# fastest kept, up to PROBE_TRIES times while the probe has taken less than PROBE_BUDGET_S in all,
# and on a GPU at least twice.
PROBE_TRIES = 3
PROBE_BUDGET_S = 5.0


@dataclass(frozen=True)
class Work:
    """A run's work: its training steps, and the batches its evaluations run forward (periodic
    losses, each epoch's accuracies and, unless skipped, the final accuracies)."""

    steps: int
    eval_batches: int


def run_work(cfg, *, train_batches: int, val_batches: int, test_batches: int) -> Work:
    """The work of a run of settings ``cfg`` over splits of these many batches, counted as the loop
    (``lora_bench.train.loop``) and the final evaluation run it."""
    steps = cfg.num_epochs * train_batches
    if cfg.max_steps is not None:
        steps = min(steps, cfg.max_steps)
    epochs = math.ceil(steps / train_batches) if train_batches else 0
    per_eval = min(cfg.eval_iter, train_batches) + min(cfg.eval_iter, val_batches)
    evals = (steps - 1) // cfg.eval_freq + 1 if cfg.eval_freq and steps else 0
    batches = evals * per_eval + epochs * per_eval
    if not cfg.skip_final_eval:
        batches += train_batches + val_batches + test_batches
    return Work(steps, batches)


@dataclass(frozen=True)
class StepTimes:
    """One training step's forward and backward, and one forward, in seconds."""

    step_s: float
    forward_s: float

    def seconds(self, work: Work) -> float:
        return work.steps * self.step_s + work.eval_batches * self.forward_s


def probe(context) -> StepTimes:
    """Time a forward and backward of the run's model (``context``: a ``RunContext``) at its batch
    shape, without changing anything the run computes (see the module's docstring). The eager
    model is probed, never a compiled or data-parallel one: its compilation or its collectives
    would be the run's."""
    model, device = context.model, context.device
    cfg = context.cfg
    objective = context.loop_settings().objective(context.n)
    training = model.training
    best = StepTimes(math.inf, math.inf)
    cuda = [device] if device.type == "cuda" else []
    start = time.perf_counter()
    try:
        with torch.random.fork_rng(devices=cuda), use_policy(context.kernel_policy):
            # random tokens and labels (drawn inside fork_rng: the run's generators are untouched)
            inputs = torch.randint(0, context.mcfg.vocab_size, (cfg.batch_size, context.loaders.max_length),
                                   device=device)
            targets = torch.randint(0, 2, (cfg.batch_size,), device=device)
            model.train()
            for tries in range(1, PROBE_TRIES + 1):
                t0 = time.perf_counter()
                with context.amp():
                    losses = objective.losses(inputs, targets, model)
                _sync(device)
                t1 = time.perf_counter()
                objective.objective(losses).backward()
                _sync(device)
                t2 = time.perf_counter()
                best = StepTimes(min(best.step_s, t2 - t0), min(best.forward_s, t1 - t0))
                if not probe_again(tries, t2 - start, device.type):
                    break
    finally:
        for p in model.parameters():
            p.grad = None
        model.train(training)
    return best


def probe_again(tries: int, elapsed_s: float, device_type: str) -> bool:
    """Whether the probe takes another try after ``tries`` of them in ``elapsed_s``: while under its
    budget, and on a GPU at least twice (the first try compiles and tunes the kernels: Triton's,
    cuBLAS's, tens of seconds that no later step pays)."""
    if tries >= PROBE_TRIES:
        return False
    return elapsed_s < PROBE_BUDGET_S or (device_type == "cuda" and tries < 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def duration(seconds: float) -> str:
    """'about 3 h 20 min', '4 min', '40 s': the figure of a forecast, rounded."""
    if seconds >= 3600:
        h, m = divmod(round(seconds / 60), 60)
        return f"{h} h {m} min" if m else f"{h} h"
    if seconds >= 90:
        return f"{round(seconds / 60)} min"
    return f"{max(1, round(seconds))} s"


def estimate_lines(cfg, *, times: StepTimes, work: Work, short: list[tuple[str, Work]],
                   device: torch.device) -> list[str]:
    """What ``train`` says before its first step: the estimate, and on a CPU where it is long, a
    short run's (``short``: its flags and its work; the second, without the final evaluation, is
    said where that evaluation would take most of the first)."""
    total = times.seconds(work)
    where = "this CPU" if device.type == "cpu" else str(device)
    evals = f", evaluation {duration(work.eval_batches * times.forward_s)}" if work.eval_batches else ""
    lines = [f"estimate: about {duration(total)} on {where} ({work.steps} steps at {times.step_s:.3g} s{evals}; "
             "timed on a probe step of this model)"]
    if device.type == "cpu" and total > LONG_ON_CPU_S and short:
        flags, quick = short[0]
        if len(short) > 1 and times.seconds(short[1][1]) < times.seconds(quick) / 2:
            flags, quick = short[1]
        lines.append(f"that is long for a CPU: {flags} takes about {duration(times.seconds(quick))}")
    return lines


def announce(context, say) -> None:
    """Probe the run's model and ``say`` each line of its estimate (``estimate_lines``). A compiled
    run is not probed: the probe would compile the model, and its time would be the compiler's."""
    cfg = context.cfg
    if cfg.compile:
        say("estimate: after the first steps, on the progress line (a probe step would compile the model)")
        return
    loaders = context.loaders
    sizes = dict(train_batches=len(loaders.train), val_batches=len(loaders.val), test_batches=len(loaders.test))
    work = run_work(cfg, **sizes)
    short = []
    if work.steps > SHORT_STEPS:
        short.append((f"--max-steps {SHORT_STEPS}", run_work(cfg.replace(max_steps=SHORT_STEPS), **sizes)))
        if not cfg.skip_final_eval:
            short.append((f"--max-steps {SHORT_STEPS} --skip-final-eval",
                          run_work(cfg.replace(max_steps=SHORT_STEPS, skip_final_eval=True), **sizes)))
    for line in estimate_lines(cfg, times=probe(context), work=work, short=short, device=context.device):
        say(line)
