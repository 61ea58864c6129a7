"""A benchmark's member processes: spawned, meeting on a fresh TCPStore, answering on a
queue (bench/preduce.py, bench/outer_sync.py, and tests/integration/test_preduce.py)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
from collections.abc import Callable
from typing import Any

import torch.distributed as dist


def run_members(target: Callable[..., None], count: int, config: object, *, replies: int,
                timeout_seconds: float) -> list[Any]:
    """Run target(rank, store_port, config, queue) in `count` spawned processes, and
    return the first `replies` items they put on the queue (waiting up to
    `timeout_seconds` for each). Every process is joined (killed after 60 s more); one
    that exited non-zero raises RuntimeError."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout_seconds))
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, store.port, config, out))
             for rank in range(count)]
    for p in procs:
        p.start()
    try:
        answers = [out.get(timeout=timeout_seconds) for _ in range(replies)]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    failed = [p.exitcode for p in procs if p.exitcode != 0]
    if failed:
        raise RuntimeError(f"benchmark members exited with {failed}")
    return answers
