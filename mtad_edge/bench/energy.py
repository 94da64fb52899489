"""GPU energy from NVML (nvidia-ml-py), or None when there is no NVIDIA GPU: never invented."""

from __future__ import annotations

import threading
import time
from typing import Any, Optional


class EnergyMeter:
    """Joules used by GPU 0 between ``start`` and ``stop``: the driver's energy counter where the
    GPU has one (Volta+), else power sampled every 20 ms and integrated. None without NVML."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handle: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self._nvml = pynvml
        except Exception:  # no package, no driver, no GPU
            self._nvml = None

    @property
    def available(self) -> bool:
        return self._nvml is not None

    def start(self) -> None:
        self._t0, self._e0 = time.perf_counter(), self._counter()
        self._samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        if self.available and self._e0 is None:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()

    def stop(self) -> Optional[float]:
        if not self.available:
            return None
        e1 = self._counter()
        if self._e0 is not None and e1 is not None:
            return (e1 - self._e0) / 1000.0  # mJ -> J
        self._stop.set()
        self._thread.join()
        pts = self._samples
        return sum((t1 - t0) * (w0 + w1) / 2 for (t0, w0), (t1, w1) in zip(pts, pts[1:])) if len(pts) > 1 else None

    def _counter(self) -> Optional[int]:
        if not self.available:
            return None
        try:
            return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)
        except Exception:
            return None

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                watts = self._nvml.nvmlDeviceGetPowerUsage(self._handle) / 1000.0
                self._samples.append((time.perf_counter(), watts))
            except Exception:
                return
            self._stop.wait(0.02)
