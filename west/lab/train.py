"""west-train with lab observers on every step: ``python -m west.lab.train [--phase_marks] [--host_clock]
WEST-TRAIN ARGS``. ``--phase_marks``: each step's phases with the host's and the GPU's ms and how far
the host was ahead (west.lab.phase_marks; on CUDA one wait per step for the optimizer's kernels);
``--host_clock``: the launching thread's time on a core, in the kernel and waiting for one, autograd's
threads, the hypervisor's steal and the cgroup's throttling (west.lab.host_clock). Both go into
train_log.jsonl, where ``tools/step_summary.py`` reads them. The run is otherwise west-train's own."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

LAB_FLAGS = ("--phase_marks", "--host_clock")


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    observers = []
    if "--phase_marks" in argv:
        from west.lab.phase_marks import StepClock  # heavy (torch), only when asked for

        observers.append(StepClock())
    if "--host_clock" in argv:
        from west.lab.host_clock import HostClockObserver  # only when asked for

        observers.append(HostClockObserver())
    from west.bin.train import main as train_main  # heavy

    return train_main([a for a in argv if a not in LAB_FLAGS], observers=observers)


if __name__ == "__main__":
    sys.exit(main())
