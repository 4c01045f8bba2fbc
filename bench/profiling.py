"""Shared by the bench scripts: the GPU's busy time in a torch.profiler trace, its utilisation
sampled while a block runs, the median time of a call, and the card a run's rows came from."""

from __future__ import annotations

import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch


def device_busy_seconds(prof) -> float:
    """Seconds in which at least one GPU kernel or copy ran (union of their intervals)."""
    from torch.autograd import DeviceType

    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == DeviceType.CUDA)
    busy, end = 0.0, float("-inf")
    for lo, hi in spans:
        if hi > end:
            busy += hi - max(lo, end)
            end = hi
    return busy / 1e6


class GpuSampler:
    """GPU utilisation (NVML / nvidia-smi, every 200 ms) while a block runs, each sample with its
    time; `mean_between` averages a span of it. None without a GPU."""

    def __init__(self, device: torch.device):
        self.device = device
        self.samples: list[tuple[float, float]] = []  # (perf_counter, percent)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _query(self) -> float | None:
        try:
            return float(torch.cuda.utilization(self.device))
        except Exception:
            pass
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                 f"--id={self.device.index or 0}"], capture_output=True, text=True, timeout=5)
            return float(out.stdout.strip().splitlines()[0])
        except Exception:
            return None

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            v = self._query()
            if v is not None:
                self.samples.append((time.perf_counter(), v))

    def __enter__(self) -> GpuSampler:
        if self.device.type == "cuda":
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def mean_between(self, start: float, end: float) -> float | None:
        """Mean of the samples taken in [start, end] (perf_counter times). A sample covers the
        driver's last sampling period (up to 1 s), so the first second of the span is left out."""
        vals = [v for t, v in self.samples if start + 1.0 <= t <= end]
        return sum(vals) / len(vals) if vals else None


def timed(fn, device: torch.device, repeats: int) -> float:
    """Median ms of `repeats` calls after two warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def report_rows(bench: str, device: torch.device, rows: list[dict], path: str | None) -> None:
    """Print the card the rows were measured on and, with `path`, write them there as JSON lines
    (each with the bench's name and the card)."""
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {card}")
    if path:
        Path(path).write_text("".join(json.dumps({"bench": bench, "card": card, **r}) + "\n" for r in rows))
