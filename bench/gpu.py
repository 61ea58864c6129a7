"""What Ripples costs on a GPU, side by side with the plain loop and DDP.

    python -m ripples.bench.gpu                      # one GPU: the ~25M GPT, bf16, AdamW
    python -m ripples.bench.gpu --configs single,plain,ddp,smart
    python -m ripples.bench.gpu --device cpu         # gloo, a tiny GPT: that it runs (CI)
    python -m ripples.bench.gpu --to-loss            # time to a loss: DDP against Ripples

Configurations (`--configs`, comma-separated), each in processes of its own
(bench/gpu_rank.py is what they run):

- ``single``: one process, the plain loop and the same loop through `ripples.Optimizer`
  (single-process mode), timed window by window in turn;
- ``plain``: `--workers` ranks sharing the device, each the plain loop, no communication:
  the step every shared-device row is compared with;
- ``ddp``: the same ranks under `DistributedDataParallel` (NCCL over the ranks' sockets on
  a GPU, gloo on the CPU): the all-reduce baseline;
- ``smart``: `ripples run --protocol ripples-smart` (a P-Reduce every step of the
  parameters and both AdamW moments);
- ``smart-overlap``: the same with `--overlap` (the P-Reduce in the background, its result
  applied at a later step boundary);
- ``smart-local-bf16`` and ``smart-local-bf16-overlap``: `--local-steps H` with the outer
  optimizer and `--outer-compression bf16`, without and with `--overlap`. bf16 on the wire
  exists only with the outer optimizer (nesterov): the group form sends the models in
  float32 and the outer momentum in bfloat16;
- ``smart-sharded``: `ripples run --ranks-per-worker 2`, the same processes as workers of
  two ranks each (`--workers` / 2 of them, at least two), the GPT sharded with FSDP2 over
  each worker's ranks, rank r of each group member averaging its shard every step
  (docs/library.md, "Models larger than one device").

A row per loop: time per step (the median over ranks of each rank's median window), its
ratio to the plain step (one process alone for ``single``, the plain ranks sharing the
device for the others), the bytes a worker feeds into collectives per step (DDP: the
gradients; Ripples: `ripples run`'s `bytes_per_worker_step`, warm-up included), host-device
synchronisations per step by two witnesses, torch's sync debug mode in the timed windows
and the blocking CUDA calls torch.profiler sees in one more window (loss read-back apart;
on a GPU only), the host's time inside `optimizer.step()` per step, and Ripples'
bookkeeping per step (StepTimes.other_seconds) as a share of the step. A goal summary
follows.

`--to-loss` asks another question: how soon each way reaches a loss, not what a step
costs. It runs `ripples bench` (bench/harness.py) on the device: the bench's Transformer
LM with AdamW, `--workers` workers sharing the GPU, to `--target-loss`, one run each of
allreduce (DDP), ripples-smart and its best local-step form on slow links
(ripples-smart-int8: H = 8, the outer Nesterov step, the groups' int8 wire), each within
a third of `--budget-seconds`; the bench's table (time to the target, compute
utilization, bytes per step, loss at equal steps) and its loss-against-time plot.

Every configuration runs against a deadline (`--config-timeout-seconds`, and the whole
script's `--budget-seconds`): one that has not ended by then is killed with every process
it started, its row reads "failed", and the next configuration starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch.distributed as dist

from ripples.bench.gpu_rank import Measured, RankSettings, result_path
from ripples.bench.gpu_report import Configuration, Outcome, report_lines, rows
from ripples.worker.devices import nccl_environment, plan_devices

CONFIGURATIONS = ("single", "plain", "ddp", "smart", "smart-overlap", "smart-local-bf16",
                  "smart-local-bf16-overlap", "smart-sharded")
"""Every configuration's name (`configurations` builds them), in the order they run."""
CPU_SETTINGS = RankSettings(device="cpu", d_model=32, layers=1, heads=2, block_size=16,
                            batch_size=4, warmup_steps=2, window_steps=4, windows=2)
"""`--device cpu`: a GPT of 21k parameters and a few steps; what the CPU mode is for is
running every part end to end, not its figures."""
LOCAL_STEPS = {"cuda": 8, "cpu": 2}
"""The H of the local-step rows, by device."""
STOP_GRACE_SECONDS = 10.0
"""A configuration past its deadline: SIGTERM, this long to leave, then SIGKILL."""
MIN_CONFIG_SECONDS = 20.0
"""A configuration starts only with this long left of the budget."""


def configurations(workers: int, local_steps: int) -> dict[str, Configuration]:
    """Every configuration, by name, in CONFIGURATIONS' order."""
    local = ("--local-steps", str(local_steps), "--outer-optimizer", "nesterov",
             "--outer-compression", "bf16")
    local_label = f"ripples-smart H={local_steps} bf16"
    return {c.name: c for c in (
        Configuration("single", "single", "1 process"),
        Configuration("plain", "plain", f"{workers} ranks: plain, no communication"),
        Configuration("ddp", "ddp", f"{workers} ranks: DDP"),
        Configuration("smart", "ripples", f"{workers} ranks: ripples-smart"),
        Configuration("smart-overlap", "ripples", f"{workers} ranks: ripples-smart overlap",
                      ("--overlap",)),
        Configuration("smart-local-bf16", "ripples", f"{workers} ranks: {local_label}", local),
        Configuration("smart-local-bf16-overlap", "ripples",
                      f"{workers} ranks: {local_label} overlap", (*local, "--overlap")),
        Configuration("smart-sharded", "ripples",
                      f"{max(2, workers // 2)} workers x 2 ranks: ripples-smart FSDP2",
                      ("--ranks-per-worker", "2"), ranks_per_worker=2),
    )}


@dataclass(kw_only=True)
class GpuBenchConfig:
    settings: RankSettings
    configs: tuple[str, ...]
    workers: int = 4
    """Ranks sharing the device in every configuration but `single`."""
    local_steps: int = 8
    """H of the local-step configurations."""
    config_timeout_seconds: float = 120.0
    """One configuration's deadline, start-up included."""
    budget_seconds: float = 320.0
    """The whole script's: a configuration's deadline never passes it, and one that
    would start with under MIN_CONFIG_SECONDS left is skipped."""
    work_dir: Path
    """Each configuration's settings, results, logs and Ripples run directory."""


# ---------------------------------------------------------------------- processes


def _descendants(pid: int) -> list[int]:
    """Every process below `pid`, from /proc (read before signalling: an orphan's parent
    becomes init)."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children = [int(c) for c in f.read().split()]
        except OSError:
            continue
        for child in children:
            found += [child, *_descendants(child)]
    return found


class Command(NamedTuple):
    argv: list[str]
    env: dict[str, str]
    log: Path
    """Its stdout and stderr."""


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End `process` and every process it started: SIGTERM (ripples run passes it on to
    its workers), then SIGKILL to whatever is left after STOP_GRACE_SECONDS."""
    below = _descendants(process.pid)
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    for pid in [process.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        process.wait(timeout=STOP_GRACE_SECONDS)
    except subprocess.TimeoutExpired:  # stuck in the kernel (a GPU driver call): let it be
        print(f"pid {process.pid} outlived SIGKILL by {STOP_GRACE_SECONDS:g} s",
              file=sys.stderr)


def run_processes(commands: Sequence[Command], cwd: Path, deadline: float) -> str:
    """Run the commands side by side until every one has exited: "" when all exited with
    0, else why not. At the deadline (time.monotonic()), or as soon as one fails, every
    process left is stopped with the processes it started."""
    processes = []
    for command in commands:
        with open(command.log, "wb") as out:
            processes.append(subprocess.Popen(command.argv, env=command.env, cwd=cwd,
                                              stdout=out, stderr=subprocess.STDOUT))
    failure = ""
    try:
        while not failure and any(p.returncode is None for p in processes):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                failure = "timed out"
                break
            waiting = next(p for p in processes if p.returncode is None)
            try:
                waiting.wait(timeout=min(0.5, remaining))
            except subprocess.TimeoutExpired:
                pass
            for command, p in zip(commands, processes, strict=True):
                if p.poll() not in (None, 0):
                    failure = f"{command.log.stem} exited with code {p.returncode}"
    finally:
        for p in processes:
            if p.poll() is None:
                _stop(p)
    return failure


def _log_tail(commands: Sequence[Command], lines: int = 12) -> str:
    text = []
    for command in commands:
        if command.log.exists():
            tail = command.log.read_text(errors="replace").splitlines()[-lines:]
            text += [f"  {command.log.name}: {line}" for line in tail]
    return "\n".join(text)


def has_overlap() -> bool:
    """Whether this Ripples' `ripples run` takes --overlap."""
    help_text = subprocess.run([sys.executable, "-m", "ripples.cli", "run", "--help"],
                               capture_output=True, text=True, timeout=120).stdout
    return "--overlap" in help_text


def _commands(cfg: GpuBenchConfig, config: Configuration, work: Path, store_port: int,
              deadline: float) -> list[Command]:
    """The processes of one configuration: the one process of `single`, the ranks of
    `plain` and `ddp` (meeting on the parent's store), or `ripples run` and its workers."""
    settings_path = work / "settings.json"
    settings_path.write_text(json.dumps(dataclasses.asdict(cfg.settings)))
    rank_argv = [sys.executable, "-m", "ripples.bench.gpu_rank", "--kind", config.kind,
                 "--settings", str(settings_path), "--results", str(work / "results")]
    env = dict(os.environ)
    if config.kind == "single":
        return [Command(rank_argv, env, work / "single.log")]
    if config.kind in ("plain", "ddp"):
        devices = plan_devices(cfg.workers, cfg.settings.torch_device, share_gpus=True)
        return [Command([*rank_argv, "--rank", str(rank), "--world-size", str(cfg.workers),
                         "--store-port", str(store_port)],
                        {**env, "GLOO_SOCKET_IFNAME": env.get("GLOO_SOCKET_IFNAME", "lo"),
                         **nccl_environment(devices, rank, f"bench-{config.name}",
                                            loopback=True)},
                        work / f"rank{rank}.log")
                for rank in range(cfg.workers)]
    # ripples run's own deadline comes first, so that it can end its workers itself.
    run_seconds = max(1.0, deadline - time.monotonic() - STOP_GRACE_SECONDS)
    workers = str(config.run_workers(cfg.workers))
    return [Command([sys.executable, "-m", "ripples.cli", "run", "--quiet",
                     "--workers", workers, "--workers-per-node", workers,
                     "--protocol", "ripples-smart", "--device", cfg.settings.torch_device,
                     *(["--share-gpus"] if cfg.settings.device == "cuda" else []),
                     "--output", str(work / "run"), "--timeout-seconds", f"{run_seconds:.0f}",
                     *config.run_options, "--", *rank_argv],
                    env, work / "ripples-run.log")]


def run_configuration(cfg: GpuBenchConfig, config: Configuration, deadline: float) -> Outcome:
    """Start the configuration's processes, wait for them up to `deadline`, and read
    what they measured."""
    started = time.monotonic()
    work = cfg.work_dir / config.name
    (work / "results").mkdir(parents=True)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(
                              seconds=cfg.settings.collective_timeout_seconds))
    commands = _commands(cfg, config, work, store.port, deadline)
    failure = run_processes(commands, work, deadline)
    outcome = Outcome(config=config, seconds=time.monotonic() - started)
    if failure:
        outcome.status = f"failed: {failure} after {outcome.seconds:.0f} s"
        print(f"{config.name}: the end of its logs ({work}):\n{_log_tail(commands)}",
              file=sys.stderr)
        return outcome
    for rank in range(config.processes(cfg.workers)):
        path = result_path(work / "results", config.kind, rank)
        if not path.exists():
            outcome.status = f"failed: rank {rank} wrote no results"
            return outcome
        outcome.measured += [Measured(**m) for m in json.loads(path.read_text())]
    if config.kind == "ripples":
        summary = json.loads((work / "run" / "summary.json").read_text())
        outcome.bytes_per_step = summary.get("bytes_per_worker_step")
    return outcome


def run(cfg: GpuBenchConfig) -> list[Outcome]:
    """Every configuration of `cfg` in turn, each against its deadline, with a progress
    line on stderr as each starts and ends."""
    started = time.monotonic()
    budget_deadline = started + cfg.budget_seconds
    known = configurations(cfg.workers, cfg.local_steps)
    overlap_available: bool | None = None
    outcomes = []

    def progress(text: str) -> None:
        print(f"[{time.monotonic() - started:6.1f} s] {text}", file=sys.stderr, flush=True)

    for name in cfg.configs:
        config = known[name]
        if config.overlap and overlap_available is None:
            overlap_available = has_overlap()
        now = time.monotonic()
        if config.overlap and not overlap_available:
            outcome = Outcome(config=config, status="skipped: this ripples has no --overlap")
        elif budget_deadline - now < MIN_CONFIG_SECONDS:
            outcome = Outcome(config=config, status="skipped: out of the time budget "
                              f"(--budget-seconds {cfg.budget_seconds:g})")
        else:
            deadline = min(now + cfg.config_timeout_seconds, budget_deadline)
            progress(f"{name}: {config.label} (deadline {deadline - now:.0f} s)")
            outcome = run_configuration(cfg, config, deadline)
        progress(f"{name}: {outcome.status or 'done'} ({outcome.seconds:.1f} s)")
        outcomes.append(outcome)
    return outcomes


TO_LOSS_PROTOCOLS = ("allreduce", "ripples-smart", "ripples-smart-int8")
"""`--to-loss`: DDP, ripples-smart, and its best local-step form (docs/benchmarks.md,
"Slow links")."""
TO_LOSS_TARGET = {"cuda": 2.2, "cpu": 5.0}
"""`--to-loss`'s default target: the bench's LM target, or on the CPU one its first
steps reach (what the CPU mode is for is running every part end to end)."""
TO_LOSS_MAX_STEPS = {"cuda": 800, "cpu": 40}


def to_loss(args: argparse.Namespace, work_dir: Path) -> int:
    """`--to-loss`: the bench's LM on the device, DDP against Ripples, to a loss."""
    from ripples.bench.harness import run_bench
    from ripples.bench.matrix import HarnessConfig

    cfg = HarnessConfig(
        workers=args.workers, workers_per_node=args.workers, protocols=TO_LOSS_PROTOCOLS,
        scenarios=("homogeneous",), task="transformer-lm", repeats=1,
        target_loss=args.target_loss or TO_LOSS_TARGET[args.device],
        max_steps=args.max_steps or TO_LOSS_MAX_STEPS[args.device], output=work_dir,
        run_timeout_seconds=max(MIN_CONFIG_SECONDS,
                                args.budget_seconds / len(TO_LOSS_PROTOCOLS)),
        device=args.device)
    cfg.validate()
    records = run_bench(cfg, markdown=True)
    return 0 if all(r.time_to_target_seconds is not None for r in records) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ripples.bench.gpu",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: every rank on cuda:0, NCCL; cpu: gloo and a tiny GPT")
    parser.add_argument("--configs", default=",".join(CONFIGURATIONS),
                        help="comma-separated configurations, run in the order given "
                             "(default: all)")
    parser.add_argument("--workers", type=int, default=4,
                        help="ranks sharing the device (default: 4)")
    parser.add_argument("--local-steps", type=int, default=None,
                        help="H of the local-step rows (default: 8 on cuda, 2 on cpu)")
    for name in ("d_model", "layers", "heads", "block_size", "batch_size", "warmup_steps",
                 "window_steps", "windows"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                            help="default: the device's preset")
    parser.add_argument("--config-timeout-seconds", type=float,
                        default=GpuBenchConfig.config_timeout_seconds)
    parser.add_argument("--budget-seconds", type=float, default=GpuBenchConfig.budget_seconds,
                        help="the whole script's time: no configuration runs past it")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="keep each configuration's logs, results and run here "
                             "(default: a temporary directory, removed at the end)")
    parser.add_argument("--json", type=Path, default=None,
                        help="also write the rows and the raw measurements here")
    parser.add_argument("--to-loss", action="store_true",
                        help="time to a loss instead: DDP, ripples-smart and "
                             "ripples-smart-int8 on the bench's LM, a third of "
                             "--budget-seconds each (the bench's results, plots and runs "
                             "go to --work-dir)")
    parser.add_argument("--target-loss", type=float, default=None,
                        help="--to-loss: the target (default: 2.2 on cuda, 5.0 on cpu)")
    parser.add_argument("--max-steps", type=int, default=None,
                        help="--to-loss: each run's step cap (default: 800 on cuda, 40 on cpu)")
    args = parser.parse_args(argv)
    if args.to_loss:
        if args.workers < 2:
            parser.error("--workers must be at least 2")
        if args.json is not None or args.configs != parser.get_default("configs"):
            parser.error("--to-loss runs its own three protocols and writes the bench's "
                         "results.json to --work-dir: leave out --configs and --json")
        if args.work_dir is not None and (args.work_dir / "results.json").exists():
            parser.error(f"--work-dir {args.work_dir} already holds an earlier bench's "
                         "results: give a new or empty directory")
        try:
            with tempfile.TemporaryDirectory(prefix="ripples-bench-gpu-") as tmp:
                return to_loss(args, (args.work_dir or Path(tmp)).resolve())
        except ValueError as err:
            parser.error(str(err))
    preset = RankSettings() if args.device == "cuda" else CPU_SETTINGS
    settings = dataclasses.replace(preset, **{
        f.name: getattr(args, f.name) for f in dataclasses.fields(RankSettings)
        if getattr(args, f.name, None) is not None})
    names = tuple(n.strip() for n in args.configs.split(",") if n.strip())
    unknown = [n for n in names if n not in CONFIGURATIONS]
    if unknown or not names:
        parser.error(f"--configs: unknown {', '.join(unknown) or 'empty list'}; choose from "
                     f"{', '.join(CONFIGURATIONS)}")
    local_steps = args.local_steps or LOCAL_STEPS[args.device]
    sizes = (settings.d_model, settings.layers, settings.heads, settings.block_size,
             settings.batch_size, settings.window_steps, settings.windows, local_steps)
    if min(sizes) < 1 or settings.warmup_steps < 0 or settings.d_model % settings.heads:
        parser.error("sizes, steps and windows must be at least 1 (warm-up at least 0), "
                     "and --d-model a multiple of --heads")
    if args.workers < 2:
        parser.error("--workers must be at least 2")
    try:
        plan_devices(args.workers, settings.torch_device, share_gpus=True)
    except ValueError as err:
        parser.error(str(err))
    if args.work_dir is not None:
        earlier = [n for n in names if (args.work_dir / n).exists()]
        if earlier:  # its results would be read as this run's
            parser.error(f"--work-dir {args.work_dir} already holds an earlier run's "
                         f"{', '.join(earlier)}: give a new or empty directory")
    with tempfile.TemporaryDirectory(prefix="ripples-bench-gpu-") as tmp:
        work_dir = (args.work_dir or Path(tmp)).resolve()  # the processes' cwd is theirs
        cfg = GpuBenchConfig(settings=settings, configs=names, workers=args.workers,
                             local_steps=local_steps,
                             config_timeout_seconds=args.config_timeout_seconds,
                             budget_seconds=args.budget_seconds, work_dir=work_dir)
        outcomes = run(cfg)
    table = rows(outcomes, cfg.workers, settings.device)
    print("\n".join(report_lines(settings, cfg.workers, outcomes, table)))
    if args.json is not None:
        args.json.write_text(json.dumps({
            "settings": dataclasses.asdict(settings), "workers": cfg.workers,
            "local_steps": local_steps, "rows": [dataclasses.asdict(r) for r in table],
            "outcomes": [dataclasses.asdict(o) for o in outcomes]}, indent=1) + "\n")
    return 1 if any(o.status.startswith("failed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
