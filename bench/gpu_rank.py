"""One process of `python -m ripples.bench.gpu`: it trains the benchmark's GPT for a fixed
number of steps and writes what it measured into the directory its parent named.

    python -m ripples.bench.gpu_rank --kind single --settings FILE --results DIR
    python -m ripples.bench.gpu_rank --kind plain|ddp --settings FILE --results DIR \\
        --rank R --world-size N --store-port PORT   # a rank the parent started
    ripples run ... -- python -m ripples.bench.gpu_rank --kind ripples --settings FILE \\
        --results DIR                               # a worker of a Ripples run

Kinds: `single` times the plain loop and the same loop through `ripples.Optimizer` in one
process, a window each in turn (the order alternating), so that both meet the same
machine; `plain` is one of several ranks training side by side on one device with no
communication (the step the shared-device rows compare with); `ddp` is a rank of
`torch.nn.parallel.DistributedDataParallel` over a process group of its own (NCCL on a
GPU, gloo on the CPU), the all-reduce baseline; `ripples` is a worker of the run `ripples
run` started, its AdamW wrapped in `ripples.Optimizer`.

Every kind trains the same step: random token batches already on the device, bf16
autocast on a GPU (none on the CPU), backward, gradient clipping, AdamW, and the loss read
back once every `LOSS_FLUSH_STEPS` steps (ripples.Optimizer's `report_loss` does that
itself; the plain loops do the same). After `warmup_steps`, `windows` windows of
`window_steps` steps are timed, the device's stream waited for at each window's ends only.
On a GPU, torch's sync debug mode warns at every host-device synchronisation inside the
windows; the warnings are counted by where they came from, the loss read-back's apart.
torch says that mode "does not yet detect all synchronizing operations", so a second
witness follows the timed windows: one more window under `torch.profiler`, in which the
CUDA runtime's blocking calls (BLOCKING_CALLS, and synchronous copies) made inside each
step are counted by name, the loss read-back's apart (bench/gpu_syncs.py). Every loop
also times its host thread inside `optimizer.step()`: a host held there (by a
collective's timed wait, say) shows in that time, though neither witness counts it as a
synchronisation.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn import functional

from ripples.bench.gpu_syncs import (
    LOSS_READ_RANGE,
    STEP_RANGE,
    SyncCounter,
    TracedCall,
    count_blocking_calls,
)
from ripples.examples.transformer_lm import VOCAB_SIZE, TinyGPT
from ripples.files import write_atomically
from ripples.worker.optimizer import LOSS_FLUSH_STEPS

KINDS = ("single", "plain", "ddp", "ripples")
@dataclass(kw_only=True)
class RankSettings:
    """What every process of one benchmark trains, and how long it measures."""

    device: str = "cuda"
    """cuda (cuda:0, shared by every rank) or cpu."""
    d_model: int = 512
    layers: int = 8
    heads: int = 8
    block_size: int = 256
    batch_size: int = 16
    warmup_steps: int = 8
    """Steps before the timed windows (communicators, allocator, kernel choices)."""
    window_steps: int = 16
    """Steps per timed window."""
    windows: int = 3
    """Timed windows per loop; its time per step is their median."""
    collective_timeout_seconds: float = 120.0
    """The ranks' own process group (DDP's, and the barriers): how long a collective
    waits for a lost peer."""

    @property
    def torch_device(self) -> str:
        """Where every rank trains: one GPU (cuda:0) shared by all, or the CPU."""
        return "cuda:0" if self.device == "cuda" else "cpu"


@dataclass(kw_only=True)
class Measured:
    """What one training loop of one process measured (a rank writes a list of these)."""

    label: str
    rank: int
    device_name: str
    parameters: int
    gradient_bytes: int
    """What DDP all-reduces per step: every trainable parameter's gradient."""
    window_seconds: list[float]
    """Seconds per step of each timed window that ran to its end."""
    timed_steps: int
    """Steps inside the windows (a window the run stopped inside included)."""
    syncs: int
    """Host-device synchronisations in the timed steps, less the loss read-back's."""
    loss_read_syncs: int
    sync_sites: dict[str, int]
    """Every synchronisation counted, by its warning's first line and its caller."""
    step_times: dict[str, float] | None = None
    """ripples.Optimizer's StepTimes over the timed steps (a Ripples run only)."""
    step_host_seconds: float = 0.0
    """The host thread's time inside optimizer.step() over the timed steps."""
    profiled_steps: int = 0
    """Steps of the profiled window (after the timed ones)."""
    blocking_calls: int | None = None
    """Blocking CUDA calls inside the profiled steps, less the loss read-back's (None: not
    counted, on the CPU or where the profiler failed)."""
    loss_read_blocking_calls: int | None = None
    blocking_sites: dict[str, int] = dataclasses.field(default_factory=dict)
    """Every blocking call counted, by name (the loss read-back's under "loss read: ...")."""
    profiler_error: str = ""


class LossReadBack:
    """The plain loops' loss reporting: the device's losses read back once every
    LOSS_FLUSH_STEPS steps, as ripples.Optimizer.report_loss does."""

    def __init__(self) -> None:
        self.pending: list[torch.Tensor] = []

    def __call__(self, loss: torch.Tensor) -> None:
        self.pending.append(loss)
        if len(self.pending) >= LOSS_FLUSH_STEPS:
            torch.stack(self.pending).tolist()  # what a script logs; the read is the cost
            self.pending.clear()


@dataclass
class Loop:
    """One model's training loop: its step, its timed windows and what they counted."""

    label: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    report: Callable[[torch.Tensor], None]
    batches: list[torch.Tensor]
    device: torch.device
    counter: SyncCounter
    stopped: Callable[[], bool] = lambda: False
    """Whether the run stopped this worker (a Ripples run's `opt.stopped`)."""
    settle: Callable[[], None] = lambda: None
    """Land whatever collective the loop left in flight (--overlap's background
    P-Reduce): the profiled window does so before the profiler stops."""
    steps: int = 0
    timed_steps: int = 0
    window_seconds: list[float] = dataclasses.field(default_factory=list)
    step_host_seconds: float = 0.0
    profiled_steps: int = 0
    blocking_sites: Counter[str] | None = None
    loss_read_blocking_calls: int | None = None
    profiler_error: str = ""

    def step(self, *, timed: bool = False) -> None:
        tokens = self.batches[self.steps % len(self.batches)]
        self.steps += 1
        x, y = tokens[:, :-1], tokens[:, 1:]
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=torch.bfloat16,
                            enabled=self.device.type == "cuda"):
            loss = functional.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        started = time.perf_counter()
        self.optimizer.step()
        if timed:
            self.step_host_seconds += time.perf_counter() - started
        with self.counter.loss_read(), torch.profiler.record_function(LOSS_READ_RANGE):
            self.report(loss.detach())

    def warm_up(self, steps: int) -> None:
        for _ in range(steps):
            if self.stopped():
                return
            self.step()

    def window(self, steps: int) -> None:
        """Time `steps` steps, the device's stream waited for at both ends (a window the
        run stopped inside is not timed)."""
        _wait_for_device(self.device)
        started = time.perf_counter()
        with self.counter.counting():
            for _ in range(steps):
                if self.stopped():
                    return
                self.step(timed=True)
                self.timed_steps += 1
        _wait_for_device(self.device)
        self.window_seconds.append((time.perf_counter() - started) / steps)

    def profiled_window(self, steps: int) -> None:
        """`steps` more steps under torch.profiler (not timed: the profiler slows them),
        counting the blocking CUDA calls made inside each (on a GPU; on the CPU the
        window runs, as a check of its path, and nothing is counted). A profiler that
        fails leaves the count unknown and says why; the steps still run."""
        from torch.profiler import ProfilerActivity, profile, record_function

        cuda = self.device.type == "cuda"
        activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
        _wait_for_device(self.device)
        try:
            with profile(activities=activities) as prof:
                for _ in range(steps):
                    if self.stopped():
                        break
                    with record_function(STEP_RANGE):
                        self.step()
                    self.profiled_steps += 1
                # A collective started under the profiler carries its record of the
                # profile and closes it when it completes, in the backend's thread: one
                # completing after the profiler has stopped writes into freed memory (a
                # segfault, seen with gloo). So it lands here, outside every step.
                self.settle()
                _wait_for_device(self.device)
            events = [TracedCall(e.name, e.time_range.start, e.time_range.end)
                      for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CPU]
        except Exception as err:  # the profiler (CUPTI) is a witness, not the benchmark
            self.profiler_error = f"{type(err).__name__}: {err}"[:300]
            while self.profiled_steps < steps and not self.stopped():
                self.step()
                self.profiled_steps += 1
            return
        if cuda:
            self.blocking_sites, self.loss_read_blocking_calls = count_blocking_calls(events)

    def _blocking_calls(self) -> int | None:
        """The profiled steps' blocking calls less the loss read-back's (None: not
        counted)."""
        if self.blocking_sites is None or self.loss_read_blocking_calls is None:
            return None
        return sum(self.blocking_sites.values()) - self.loss_read_blocking_calls

    def measured(self, rank: int, step_times: dict[str, float] | None = None) -> Measured:
        parameters = list(self.model.parameters())
        return Measured(
            label=self.label, rank=rank,
            device_name=(torch.cuda.get_device_name(self.device)
                         if self.device.type == "cuda" else "cpu"),
            parameters=sum(p.numel() for p in parameters),
            gradient_bytes=sum(p.numel() * p.element_size() for p in parameters
                               if p.requires_grad),
            window_seconds=self.window_seconds, timed_steps=self.timed_steps,
            syncs=self.counter.syncs, loss_read_syncs=self.counter.loss_reads,
            sync_sites=dict(self.counter.sites), step_times=step_times,
            step_host_seconds=self.step_host_seconds, profiled_steps=self.profiled_steps,
            blocking_calls=self._blocking_calls(),
            loss_read_blocking_calls=self.loss_read_blocking_calls,
            blocking_sites=dict(self.blocking_sites or {}),
            profiler_error=self.profiler_error)


def _wait_for_device(device: torch.device) -> None:
    """The work queued on this device's current stream is done (not NCCL's streams:
    waiting for those would make each window's end a barrier with the peers)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def build_model(settings: RankSettings) -> TinyGPT:
    """The benchmark's GPT (every rank starts from the same one)."""
    torch.manual_seed(0)
    return TinyGPT(block_size=settings.block_size, d_model=settings.d_model,
                   layers=settings.layers, heads=settings.heads)


def _loop(label: str, settings: RankSettings, device: torch.device, seed: int, *,
          wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
          through_ripples: bool = False) -> Loop:
    model: torch.nn.Module = build_model(settings).to(device)
    if wrap is not None:
        model = wrap(model)
    optimizer: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4,
                                                         betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    batches = [torch.randint(0, VOCAB_SIZE, (settings.batch_size, settings.block_size + 1),
                             generator=generator).to(device) for _ in range(4)]
    loop = Loop(label, model, optimizer, LossReadBack(), batches, device, SyncCounter(device))
    if through_ripples:
        import ripples

        wrapped = ripples.Optimizer(optimizer, model)
        loop.optimizer = wrapped
        loop.report = lambda loss: wrapped.report_loss(loss, num_samples=settings.batch_size)
        loop.stopped = lambda: wrapped.stopped

        def settle() -> None:
            if wrapped._sync is not None:  # the bench reaches in: settle() is not public
                wrapped._sync.protocol.settle()
        loop.settle = settle
    return loop


def _device(settings: RankSettings) -> torch.device:
    device = torch.device(settings.torch_device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)  # the ranks share the cores, one each where there are enough
    return device


def run_single(settings: RankSettings) -> list[Measured]:
    """The plain loop and ripples.Optimizer's in one process (single-process mode),
    window by window, the order alternating."""
    import ripples

    device = _device(settings)
    ripples.init(device=str(device))  # no launch environment: single-process mode
    loops = [_loop("plain", settings, device, seed=0),
             _loop("ripples.Optimizer", settings, device, seed=0, through_ripples=True)]
    for loop in loops:
        loop.warm_up(settings.warmup_steps)
    for index in range(settings.windows):
        for loop in loops if index % 2 == 0 else loops[::-1]:
            loop.window(settings.window_steps)
    for loop in loops:
        loop.profiled_window(settings.window_steps)
    return [loop.measured(0) for loop in loops]


def run_rank(kind: str, settings: RankSettings, rank: int, world_size: int,
             store_port: int) -> list[Measured]:
    """A rank of `world_size` on one device: the plain loop, or DDP's."""
    device = _device(settings)
    timeout = datetime.timedelta(seconds=settings.collective_timeout_seconds)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timeout)
    ddp = kind == "ddp"
    dist.init_process_group("nccl" if ddp and device.type == "cuda" else "gloo",
                            store=dist.PrefixStore(kind, store), rank=rank,
                            world_size=world_size, timeout=timeout)
    wrap = None
    if ddp:
        def wrap(model: torch.nn.Module) -> torch.nn.Module:
            ids = [device.index] if device.type == "cuda" else None
            return torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    loop = _loop(kind, settings, device, seed=rank, wrap=wrap)
    loop.warm_up(settings.warmup_steps)
    _wait_for_device(device)
    dist.barrier()  # every rank warm: the windows meet the same neighbours
    for _ in range(settings.windows):
        loop.window(settings.window_steps)
    loop.profiled_window(settings.window_steps)
    dist.destroy_process_group()
    return [loop.measured(rank)]


def run_ripples(settings: RankSettings) -> tuple[int, list[Measured]]:
    """A worker of the run `ripples run` started: (its process's index, what it
    measured). On a worker of G ranks the GPT is sharded with FSDP2 over them, and rank
    r of worker k is process kG + r."""
    import ripples

    worker = ripples.init()
    g = worker.ranks_per_worker
    index = worker.rank * g + worker.rank_in_worker
    wrap = None
    if g > 1:
        from torch.distributed.fsdp import fully_shard

        def wrap(model: torch.nn.Module) -> torch.nn.Module:
            assert isinstance(model, TinyGPT)
            for block in model.blocks:
                fully_shard(block, mesh=worker.mesh)
            fully_shard(model, mesh=worker.mesh)
            return model
    loop = _loop("ripples", settings, worker.device, seed=index, wrap=wrap,
                 through_ripples=True)
    optimizer = loop.optimizer
    assert isinstance(optimizer, ripples.Optimizer)
    loop.warm_up(settings.warmup_steps)
    before = dataclasses.asdict(optimizer.step_times)
    for _ in range(settings.windows):
        loop.window(settings.window_steps)
    after = dataclasses.asdict(optimizer.step_times)
    loop.profiled_window(settings.window_steps)
    return index, [loop.measured(index, {k: after[k] - before[k] for k in after})]


def result_path(results: Path, kind: str, rank: int) -> Path:
    return results / f"{kind}-rank{rank}.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.gpu_rank",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--settings", type=Path, required=True,
                        help="a JSON file of RankSettings' fields")
    parser.add_argument("--results", type=Path, required=True,
                        help="the directory this process writes KIND-rankR.json into")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--store-port", type=int, default=0,
                        help="plain, ddp: the parent's TCPStore on 127.0.0.1")
    args = parser.parse_args(argv)
    settings = RankSettings(**json.loads(args.settings.read_text()))
    if args.kind == "single":
        rank, measured = 0, run_single(settings)
    elif args.kind == "ripples":
        rank, measured = run_ripples(settings)
    else:
        rank = args.rank
        measured = run_rank(args.kind, settings, rank, args.world_size, args.store_port)
    text = json.dumps([dataclasses.asdict(m) for m in measured]) + "\n"
    write_atomically(result_path(args.results, args.kind, rank), text.encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
