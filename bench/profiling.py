"""Shared by the bench scripts: the GPU's busy time in a torch.profiler trace."""

from __future__ import annotations


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
