"""Hardware-utilisation samplers behind one interface: ``start() / read() / stop()``.

``read()`` returns the metrics accumulated since the previous ``read()`` (one
training step) and starts a new window. On CUDA, :class:`NvmlSampler` polls
NVML in a background thread: ``gpu_busy_pct`` is ``nvmlDeviceGetUtilizationRates
().gpu``, the percentage of the driver's sample period during which AT LEAST ONE
kernel was running (what ``nvidia-smi`` shows as GPU-Util). It is NOT DCGM's
SM activity (``DCGM_FI_PROF_SM_ACTIVE``: fraction of SMs with a resident warp)
and NOT the PyTorch profiler's estimated SM efficiency; a single tiny kernel
keeps it at 100 %. Where the driver provides them, ``gpu_sm_pct`` is the mean of NVML's
per-process SM utilisation samples (``nvmlDeviceGetProcessUtilization().smUtil``). On CPU, :class:`CpuSampler` reports this process's CPU use.
pynvml (package ``nvidia-ml-py``, extra ``gpu``) is imported only when needed. The host's own
clocks per step are a lab observer (west.lab.host_clock), not part of these samplers.
"""
from __future__ import annotations

import threading
import warnings
from types import ModuleType
from typing import Optional, Protocol

import psutil


class Monitor(Protocol):
    def start(self) -> None: ...
    def read(self) -> dict[str, float]: ...
    def stop(self) -> None: ...


class NullMonitor:
    """Used when monitoring is off or unavailable."""

    def start(self) -> None:
        pass

    def read(self) -> dict[str, float]:
        return {}

    def stop(self) -> None:
        pass


class CpuSampler:
    """Process CPU utilisation over each window (100 = one core fully busy)."""

    def __init__(self) -> None:
        self._proc = psutil.Process()

    def start(self) -> None:
        self._proc.cpu_percent(None)  # first call only sets the reference point

    def read(self) -> dict[str, float]:
        return {"cpu_util_pct": float(self._proc.cpu_percent(None)),
                "cpu_count": float(psutil.cpu_count() or 1)}

    def stop(self) -> None:
        pass


class NvmlSampler:
    """Background thread polling one GPU every ``interval_s``; ``read()`` gives the window's
    mean GPU-busy %, mean memory-controller busy %, and max used memory (MiB)."""

    def __init__(self, device_index: int = 0, interval_s: float = 0.2,
                 nvml: Optional[ModuleType] = None, uuid: Optional[str] = None) -> None:
        if nvml is None:
            import pynvml as nvml  # lazy: only on GPU machines with the `gpu` extra
        self._nvml = nvml
        self._interval = interval_s
        self._index = device_index
        self._uuid = uuid
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._sm_ok: Optional[bool] = None
        self._sm_seen = 0
        self._reset()

    def _reset(self) -> None:
        self._n = 0
        self._busy = 0.0
        self._mem_busy = 0.0
        self._mem_max = 0.0
        self._sm: list[float] = []

    def _sm_samples(self) -> list[float]:
        """NVML's per-process SM utilisation samples since the last call (the % of the driver's
        sample period in which this GPU's SMs ran the process's kernels); none where the driver
        does not provide them."""
        if self._sm_ok is False:
            return []
        try:
            rows = self._nvml.nvmlDeviceGetProcessUtilization(self._handle, self._sm_seen)
        except Exception:
            self._sm_ok = self._sm_ok or False   # never worked: stop asking; worked once: no new samples
            return []
        self._sm_ok = True
        for r in rows:
            self._sm_seen = max(self._sm_seen, int(r.timeStamp))
        return [float(r.smUtil) for r in rows]

    def sample(self) -> None:
        """Take one sample now (the thread calls this; tests call it directly). The driver is
        queried before the lock is taken: ``read()``, once per training step on the launching
        thread, never waits for an NVML call."""
        util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle)
        mem = self._nvml.nvmlDeviceGetMemoryInfo(self._handle)
        sm = self._sm_samples()
        with self._lock:
            self._sm.extend(sm)
            self._n += 1
            self._busy += float(util.gpu)
            self._mem_busy += float(util.memory)
            self._mem_max = max(self._mem_max, mem.used / 2**20)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                self.sample()
            except Exception:  # a driver hiccup must not kill training
                pass

    def start(self, thread: bool = True) -> None:
        self._nvml.nvmlInit()
        # NVML numbers GPUs by PCI order and ignores CUDA_VISIBLE_DEVICES: match by UUID.
        self._handle = None
        if self._uuid:
            try:
                self._handle = self._nvml.nvmlDeviceGetHandleByUUID(self._uuid)
            except Exception:
                self._handle = None
        if self._handle is None:
            self._handle = self._nvml.nvmlDeviceGetHandleByIndex(self._index)
        self.sample()
        self._sm.clear()   # SM samples from before start() belong to nobody's window
        if thread:
            self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)
            self._thread.start()

    def read(self) -> dict[str, float]:
        with self._lock:
            if self._n == 0:
                out: dict[str, float] = {}
            else:
                out = {"gpu_busy_pct": self._busy / self._n,
                       "gpu_mem_busy_pct": self._mem_busy / self._n,
                       "gpu_mem_used_mb": self._mem_max,
                       "gpu_samples": float(self._n)}
                if self._sm:
                    out["gpu_sm_pct"] = sum(self._sm) / len(self._sm)
            self._reset()
        return out

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self._interval + 1)
            self._thread = None
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


def build_monitor(device_type: str, device_index: int = 0, nvml: bool = True,
                  interval_s: float = 0.2) -> Monitor:
    """NVML sampler on CUDA when ``nvml`` (falls back to the CPU sampler if pynvml is
    missing); the process CPU sampler otherwise."""
    if device_type == "cuda" and nvml:
        try:
            return NvmlSampler(device_index, interval_s, uuid=_cuda_uuid(device_index))
        except ImportError:
            warnings.warn("train.nvml: pynvml not installed (pip install -e '.[gpu]' in west's checkout); "
                          "recording process CPU use instead")
    return CpuSampler()


def _cuda_uuid(index: int) -> Optional[str]:
    """NVML-style UUID ("GPU-...") of CUDA device ``index`` as torch numbers it, if known."""
    try:
        import torch  # heavy

        uuid = str(torch.cuda.get_device_properties(index).uuid)
    except Exception:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
