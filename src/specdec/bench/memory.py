"""Peak memory while a block of work runs: resident set size on CPU, allocated bytes on CUDA."""

from __future__ import annotations

import threading
from types import TracebackType

import psutil
import torch


def current_bytes() -> int:
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated()
    return psutil.Process().memory_info().rss


class PeakMemory:
    """Context manager recording the peak of :func:`current_bytes` inside the block."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakMemory:
        self.peak = current_bytes()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        else:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, current_bytes())

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else current_bytes()
        self.peak = max(self.peak, peak)
