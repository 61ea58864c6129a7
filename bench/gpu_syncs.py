"""The two witnesses of host-device synchronisations in a benchmark's training loop on a
GPU (bench/gpu_rank.py): torch's sync debug mode, which warns at each synchronising CUDA
call inside the timed windows, and torch.profiler, whose trace of one more window is
searched for the CUDA runtime's blocking calls made inside each step. torch says the
debug mode "does not yet detect all synchronizing operations", hence the second. Both
count the loss read-back apart.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

SYNC_WARNING = "called a synchronizing CUDA operation"
"""How torch's sync debug mode words its warning."""
BLOCKING_CALLS = frozenset({
    "cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize",
    "cuStreamSynchronize", "cuEventSynchronize", "cuCtxSynchronize"})
"""CUDA runtime and driver calls that hold the host until the device is done. Besides
these, every copy without "Async" in its name (cudaMemcpy, cuMemcpyDtoH, ...) blocks."""
STEP_RANGE, LOSS_READ_RANGE = "ripples_bench.step", "ripples_bench.loss_read"
"""The profiler ranges the profiled window marks each step and each loss read-back with."""


class SyncCounter:
    """Host-device synchronisations of a loop on a GPU, by site, the loss read-back's apart.

    torch's sync debug mode ("warn") warns at each CUDA call that makes the host wait for
    the device; the warnings are recorded while `counting()` is open (from every thread:
    the recording is process-wide). Those raised inside `loss_read()` are the loss
    read-back's. On the CPU nothing waits for a device, and nothing is counted."""

    def __init__(self, device: torch.device) -> None:
        self.enabled = device.type == "cuda"
        self.sites: Counter[str] = Counter()
        self.loss_reads = 0
        self._caught: list[warnings.WarningMessage] | None = None

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self._caught = caught
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self._caught = None
        for w in caught:
            if SYNC_WARNING in str(w.message):
                first_line = str(w.message).splitlines()[0][:100]
                self.sites[f"{first_line} @ {w.filename}:{w.lineno}"] += 1

    @contextlib.contextmanager
    def loss_read(self) -> Iterator[None]:
        caught = self._caught
        before = len(caught) if caught is not None else 0
        yield
        if caught is not None:
            self.loss_reads += sum(SYNC_WARNING in str(w.message) for w in caught[before:])

    @property
    def syncs(self) -> int:
        return sum(self.sites.values()) - self.loss_reads


def is_blocking_call(name: str) -> bool:
    """Whether a CUDA runtime or driver call of this name holds the host for the device."""
    name = re.sub(r"(_v\d+|_ptsz|_ptds)+$", "", name)
    if name in BLOCKING_CALLS:
        return True
    return name.startswith(("cudaMemcpy", "cuMemcpy")) and "Async" not in name


@dataclass(frozen=True)
class TracedCall:
    """One event of a profile: its name and host time range (microseconds)."""

    name: str
    start_us: float
    end_us: float


def count_blocking_calls(events: list[TracedCall]) -> tuple[Counter[str], int]:
    """The blocking calls made inside STEP_RANGE ranges, by name, and how many of them
    fell inside LOSS_READ_RANGE ranges (included in the counter under "loss read: NAME").
    Calls outside every step (a window's own waits) are not counted."""

    def ranges(name: str) -> list[tuple[float, float]]:
        return [(e.start_us, e.end_us) for e in events if e.name == name]

    def inside(event: TracedCall, spans: list[tuple[float, float]]) -> bool:
        return any(start <= event.start_us and event.end_us <= end for start, end in spans)

    steps, loss_reads = ranges(STEP_RANGE), ranges(LOSS_READ_RANGE)
    sites: Counter[str] = Counter()
    loss_read_calls = 0
    for event in events:
        if not is_blocking_call(event.name) or not inside(event, steps):
            continue
        if inside(event, loss_reads):
            loss_read_calls += 1
            sites[f"loss read: {event.name}"] += 1
        else:
            sites[event.name] += 1
    return sites, loss_read_calls
