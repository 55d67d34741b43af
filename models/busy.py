"""A fixed amount of device-side work per step, to emulate compute (as DLIO does)."""

from __future__ import annotations

import time

import torch


class DeviceBusy:
    """Keeps the device busy for `ms` milliseconds per call: a spin kernel on CUDA (so the host
    stays free and the delay sits on the compute stream), a host sleep on CPU."""

    def __init__(self, ms: float):
        self.ms = float(ms)
        self._cycles_per_ms = None

    def __call__(self, device: torch.device) -> None:
        if self.ms <= 0:
            return
        if device.type != "cuda":
            time.sleep(self.ms / 1000)
            return
        if self._cycles_per_ms is None:
            self._cycles_per_ms = _calibrate(device)
        torch.cuda._sleep(int(self.ms * self._cycles_per_ms))


def _calibrate(device: torch.device) -> float:
    """Spin-kernel cycles per millisecond, measured once (clock rates vary with boost)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1_000_000)  # warm up clocks and the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 20_000_000
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()  # one-time, outside any timed region
        return cycles / start.elapsed_time(end)
