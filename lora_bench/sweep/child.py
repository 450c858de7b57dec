"""A sweep's worker process: ``python -m lora_bench.sweep.child JOB.json`` runs the one job the
parent wrote (one run, or a pack of runs), in the run folders the parent claimed, and exits 0
done, 1 failed, 128 + the signal when interrupted. It dies with its parent (see
``isolation.die_with_parent``), recording the run as interrupted on the way out."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from rich.console import Console

from lora_bench.config import TrainConfig
from lora_bench.errors import EXIT_INTERRUPTED, Interrupted, SaveError
from lora_bench.results.claims import RunClaim
from lora_bench.signals import RaiseOnSignal
from lora_bench.sweep.isolation import die_with_parent
from lora_bench.train.run import Point, execute

PARENT_EXIT_S = 2.0


class _ChildSignals(RaiseOnSignal):
    """The first terminating signal raises Interrupted, naming the parent's death as the cause
    when that is what sent it."""

    def __init__(self, parent_pid: int):
        super().__init__()
        self.parent_pid = parent_pid

    def _handle(self, signum, frame) -> None:
        if self.signum is None:
            self.signum = signum
            raise Interrupted(signum, f"the sweep process {self.parent_pid} died" if self._parent_gone(signum) else "")

    def _parent_gone(self, signum: int) -> bool:
        """The parent-death signal comes when the thread that started this process ends, which
        can be a moment before the parent process is gone and this one adopted: a SIGTERM waits
        that moment out."""
        deadline = time.monotonic() + (PARENT_EXIT_S if signum == signal.SIGTERM else 0)
        while os.getppid() == self.parent_pid:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)
        return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m {__spec__.name if __spec__ else 'lora_bench.sweep.child'} JOB.json", file=sys.stderr)
        return 2
    try:
        spec = json.loads(Path(argv[0]).read_text())
        parent = int(spec["parent_pid"])
        with _ChildSignals(parent):
            die_with_parent(parent)
            console = Console(file=sys.stdout, width=120, force_terminal=False)
            results = Path(spec["results_dir"])
            points = [Point(cfg=TrainConfig.from_mapping(p["config"]), run_id=p["run_id"], extra=p.get("extra") or {})
                      for p in spec["points"]]
            claims = [RunClaim.inherit(int(fd), results / p.run_id) for fd, p in zip(spec["claim_fds"], points)]
            execute(points, results_dir=results, console=console, progress=False, cache_dir=spec.get("cache_dir"),
                    overwrite=True, claims=claims, handle_signals=False)
        return 0
    except Interrupted as e:
        return e.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except SaveError as e:  # recorded as far as it fitted; the sweep stops on this exit code
        print(f"error: {e}", flush=True)
        return e.exit_code
    except Exception:  # recorded by the run (or by the parent from this traceback in the log)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
