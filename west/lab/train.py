"""west-train with lab observers on every step: ``python -m west.lab.train [--phase_marks] [--host_clock]
WEST-TRAIN ARGS``. ``--phase_marks``: each step's phases with the host's and the GPU's ms and how far
the host was ahead (west.lab.phase_marks; on CUDA one wait per step for the optimizer's kernels);
``--host_clock``: the launching thread's time on a core, in the kernel and waiting for one, autograd's
threads, the hypervisor's steal and the cgroup's throttling (west.lab.host_clock). Both go into
train_log.jsonl, where ``tools/step_summary.py`` reads them. The run is otherwise west-train's own."""
from __future__ import annotations

import contextlib
import inspect
import sys
from typing import Iterator, Optional, Sequence

LAB_FLAGS = ("--phase_marks", "--host_clock")


@contextlib.contextmanager
def observed(phase_marks: bool, host_clock: bool) -> Iterator[None]:
    """Every Trainer built in the block gets the asked-for observers."""
    from west.train import loop  # heavy

    original = loop.Trainer.__init__

    def init(self, *args, **kwargs):
        info = inspect.signature(original).bind(self, *args, **kwargs).arguments["info"]
        extra = []
        if phase_marks:
            from west.lab.phase_marks import StepClock  # heavy (torch), only when asked for

            extra.append(StepClock(info.device.type == "cuda"))
        if host_clock:
            from west.lab.host_clock import HostClockObserver  # only when asked for

            extra.append(HostClockObserver())
        kwargs["observers"] = [*kwargs.get("observers", ()), *extra]
        original(self, *args, **kwargs)

    loop.Trainer.__init__ = init
    try:
        yield
    finally:
        loop.Trainer.__init__ = original


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = {f for f in LAB_FLAGS if f in argv}
    rest = [a for a in argv if a not in LAB_FLAGS]
    from west.bin.train import main as train_main  # heavy

    with observed("--phase_marks" in flags, "--host_clock" in flags):
        return train_main(rest)


if __name__ == "__main__":
    sys.exit(main())
