"""One peer-system worker of a benchmark run: `python -m ripples.bench.peers.worker
CONFIG.json RANK`, started by `ripples.bench.peers.launch`.

The loop is the Ripples runner's (worker/runner.py): its own data shard, forward,
backward, clipping, then the straggler's injected sleep ((factor - 1) x the step's
compute, seeded per rank as a Ripples worker seeds it), then the optimizer step, which is
where each peer system synchronises. Every step appends a line to the worker's step log
(progress.py), with the bytes the step fed into the peer system's collectives. Before
the first step every worker waits until all are ready (their peer system joined), as a
Ripples run starts when all its workers are; it stops at its step cap or when the
launcher writes the stop file (the target was reached).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from pathlib import Path

import torch

from ripples.bench.peers.backends import make_backend
from ripples.bench.peers.config import PeerRunFiles, PeerWorkerConfig
from ripples.bench.peers.progress import StepRecord
from ripples.bench.peers.workloads import build_workload
from ripples.worker.slowdown import Slowdown, SlowdownSpec
from ripples.worker.stats import LOSS_WINDOW

CLOSE_TIMEOUT_SECONDS = 30.0
"""A peer system's shutdown that takes longer is abandoned (the process exits anyway)."""


def wait_for_everyone(files: PeerRunFiles, num_workers: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        ready = files.ready_ranks()
        if len(ready) >= num_workers:
            return
        if files.stop.exists():
            raise SystemExit("the launcher stopped the run before it started")
        if time.monotonic() > deadline:
            missing = sorted(set(range(num_workers)) - ready)
            raise TimeoutError(f"ranks {missing} were not ready within {timeout:.0f} s")
        time.sleep(0.02)


def train(cfg: PeerWorkerConfig) -> int:
    torch.set_num_threads(1)
    files = PeerRunFiles(Path(cfg.directory))
    work = build_workload(cfg.workload, list(cfg.script_args), seed=cfg.seed,
                          batch_size=cfg.batch_size, rank=cfg.rank,
                          num_workers=cfg.num_workers, max_epochs=cfg.max_epochs,
                          max_steps=cfg.max_steps)
    backend = make_backend(cfg, work, files)
    files.mark_ready(cfg.rank, cfg.incarnation)
    if cfg.incarnation == 0:
        wait_for_everyone(files, cfg.num_workers, cfg.start_timeout_seconds)
    slowdown = Slowdown(SlowdownSpec.parse(cfg.slowdown, seed=cfg.seed * 1000 + cfg.rank)
                        if cfg.slowdown else SlowdownSpec())
    scheduler = (torch.optim.lr_scheduler.LambdaLR(backend.optimizer, work.lr_factor)
                 if work.lr_factor is not None else None)
    model = backend.model
    model.train()
    recent: deque[float] = deque(maxlen=LOSS_WINDOW)
    compute_total = sync_total = 0.0
    samples = 0
    log = files.step_log(cfg.rank).open("a", buffering=1)
    if cfg.incarnation:  # end the line the killed worker may have left half-written
        log.write("\n")
    step = backend.start_step
    last = sys.maxsize if cfg.until_stopped else work.planned_steps
    stop_seen = False
    try:
        while step < last:
            if not stop_seen and files.stop.exists():
                stop_seen, last = True, min(last, backend.last_step(step))
                if step >= last:
                    break
            began = time.perf_counter()
            sent_before = backend.sent_bytes
            inputs, targets = next(work.batches)
            synced = time.perf_counter()
            backend.zero_grad()
            sync = time.perf_counter() - synced
            loss = work.loss(model, inputs, targets)
            loss.backward()
            if work.grad_clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), work.grad_clip_norm)
            inside = backend.backward_sync_seconds()
            sync += inside
            compute = time.perf_counter() - began - sync
            compute += slowdown.after_compute(compute)
            synced = time.perf_counter()
            backend.step()
            sync += time.perf_counter() - synced
            if scheduler is not None:
                scheduler.step()
            step += 1
            samples += len(inputs)
            compute_total += compute
            sync_total += sync
            recent.append(float(loss.detach()))
            sent = (backend.sent_bytes - sent_before
                    if backend.sent_bytes is not None and sent_before is not None else None)
            log.write(StepRecord(rank=cfg.rank, time=time.time(), iteration=step,
                                 loss=sum(recent) / len(recent), samples=samples,
                                 compute_seconds=compute_total,
                                 sync_seconds=sync_total, sent_bytes=sent).line() + "\n")
        torch.save({k: v.detach().clone() for k, v in backend.model_state().items()},
                   files.model(cfg.rank))
    finally:
        log.close()
        _close_within(backend.close, CLOSE_TIMEOUT_SECONDS)
    return 0


def _close_within(close: object, seconds: float) -> None:
    """Shut the peer system down, but never hang on it: its threads are not ours."""
    thread = threading.Thread(target=close, daemon=True)  # type: ignore[arg-type]
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        print(f"the peer system did not shut down within {seconds:.0f} s; exiting anyway",
              file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (2, 3):
        print("usage: python -m ripples.bench.peers.worker CONFIG.json RANK [INCARNATION]",
              file=sys.stderr)
        return 2
    cfg = PeerWorkerConfig.from_json(json.loads(Path(args[0]).read_text()), rank=int(args[1]),
                                     incarnation=int(args[2]) if len(args) == 3 else 0)
    code = train(cfg)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # peer systems leave non-daemon threads and child daemons behind


if __name__ == "__main__":
    sys.exit(main())
