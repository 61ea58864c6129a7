"""The runs' worker output: kept per run and worker, read back by `ripples logs`.

Host agents send their processes' output in batches (Agents.PushLogs); each batch is
appended to `<state dir>/runs/<run id>/logs/<HOST>__<LOCAL_RANK>.log` (a host too long
for a file name is cut, with a digest: `file_name`), at most
LOG_FILE_LIMIT bytes per worker and run (later lines are dropped, with one line saying
so). Runs.GetLogs reads them back: once, or following the files while the run is active.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path

import grpc

from ripples.coordinator.run_queue import RunQueue
from ripples.coordinator.state_store import StoreWriteError
from ripples.v1 import coordinator_pb2 as pb

logger = logging.getLogger(__name__)

LOG_FILE_LIMIT = 64 * 1024 * 1024
"""Bytes kept per worker and run; later lines are dropped (one notice says so)."""
WORKER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,252}/[0-9]{1,6}")
"""HOST/LOCAL_RANK: it names a log file, so no path separator or '..' can be in it."""
FILE_NAME_LIMIT = 200
"""Longest log file name before its host is cut (file_name; a file name has 255 bytes)."""
LOG_BATCH_BYTES = 1024 * 1024
"""A GetLogs message holds about this much (the messages' limit is 16 MiB; a log 64)."""
FOLLOW_SECONDS = 0.5
"""How often a followed log is read again (the agents send every 0.5 s too)."""


class RunLogs:
    """The worker output of every run of the queue, in its state dir."""

    def __init__(self, queue: RunQueue) -> None:
        self.queue = queue
        self._dropped: set[Path] = set()

    def path(self, run_id: str, worker: str) -> Path:
        """The file of one worker's output in one run."""
        return self.queue.run_dir(run_id) / "logs" / file_name(worker)

    async def push(self, batch: pb.LogBatch, context: grpc.aio.ServicerContext) -> None:
        """Append an agent's batch (refused: a malformed worker name, an unknown run; the
        run is named by its exact id, never a prefix)."""
        if not WORKER_NAME.fullmatch(batch.worker):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"worker {batch.worker!r}: name it HOST/LOCAL_RANK"))
        known = self.queue.history.get(batch.run_id) if batch.run_id else None
        if known is None or known.run_id != batch.run_id:  # the exact id, no prefix
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no run {batch.run_id!r}")
        try:
            await asyncio.to_thread(self._append, self.path(batch.run_id, batch.worker),
                                    list(batch.lines))
        except OSError as err:  # the operator reads the file in the log, the agent the cause
            refused = StoreWriteError(self.path(batch.run_id, batch.worker), err,
                                      f"the output of worker {batch.worker}")
            logger.error("%s", refused)
            await context.abort(grpc.StatusCode[refused.status],
                                f"the coordinator cannot store this output: {refused.reason}")

    def _append(self, path: Path, lines: list[str]) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        size = path.stat().st_size if path.exists() else 0
        text = "".join(line.rstrip("\n") + "\n" for line in lines)
        if size + len(text.encode("utf-8", errors="replace")) > LOG_FILE_LIMIT:
            if path not in self._dropped:
                self._dropped.add(path)
                with path.open("a", encoding="utf-8") as f:
                    f.write(f"[ripples: this worker's log reached {LOG_FILE_LIMIT} bytes; "
                            "later lines are dropped]\n")
            return
        with path.open("a", encoding="utf-8") as f:
            f.write(text)

    async def read(self, info: pb.RunInfo, request: pb.GetLogsRequest,
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LogBatch]:
        """A run's output (every worker's, or one's), its last `tail` lines per worker if
        asked; `follow`: then what comes while the run is active, and the agents' last
        batches after its end."""
        directory = self.queue.run_dir(info.run_id) / "logs"
        if request.worker and not WORKER_NAME.fullmatch(request.worker):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, (
                f"worker {request.worker!r}: name it HOST/LOCAL_RANK (`ripples status RUN` "
                "lists them)"))
        offsets: dict[Path, int] = {}
        first, last_pass = True, False
        while True:
            files = sorted(directory.glob("*.log")) if directory.is_dir() else []
            if request.worker:
                files = [f for f in files if f.name == file_name(request.worker)]
                if not files and first and not self.queue.is_active(info.run_id):
                    await context.abort(grpc.StatusCode.NOT_FOUND, (
                        f"run {info.run_id} has no output from worker {request.worker}"))
            active = self.queue.is_active(info.run_id)
            if request.follow and not active and not first and not last_pass:
                last_pass = True  # the run just ended: the agents' last batches (0.5 s)
                await asyncio.sleep(2 * FOLLOW_SECONDS)
            for path in files:
                lines, offsets[path] = await asyncio.to_thread(
                    _read_from, path, offsets.get(path, 0), request.tail if first else 0)
                worker = "/".join(path.name[:-len(".log")].rsplit("__", 1))
                for batch in _batches(lines):
                    yield pb.LogBatch(run_id=info.run_id, worker=worker, lines=batch)
            first = False
            if not request.follow or not active:  # read once more after the run's end
                return
            await asyncio.sleep(FOLLOW_SECONDS)


def file_name(worker: str) -> str:
    """The log file's name for HOST/LOCAL_RANK: HOST__LOCAL_RANK.log. A host name too long
    for a file name (DNS allows 253 characters, a file name 255 bytes) is cut, and a
    digest of the whole worker name keeps the names distinct ('~' is in no host name);
    `ripples logs` then shows the cut name."""
    name = worker.replace("/", "__")
    if len(name) > FILE_NAME_LIMIT:  # WORKER_NAME is ASCII: characters are bytes
        host, _, rank = worker.rpartition("/")
        digest = hashlib.sha256(worker.encode()).hexdigest()[:16]
        name = f"{host[:FILE_NAME_LIMIT - 32]}~{digest}__{rank}"
    return name + ".log"


def _batches(lines: list[str]) -> list[list[str]]:
    """Lines in messages of about LOG_BATCH_BYTES each."""
    batches: list[list[str]] = []
    size = LOG_BATCH_BYTES
    for line in lines:
        if size + len(line) >= LOG_BATCH_BYTES:
            batches.append([])
            size = 0
        batches[-1].append(line)
        size += len(line) + 8
    return batches


def _read_from(path: Path, offset: int, tail: int) -> tuple[list[str], int]:
    """The whole lines of `path` after byte `offset` (the last `tail` of them if > 0), and
    the offset after them."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    end = data.rfind(b"\n") + 1
    lines = data[:end].decode("utf-8", errors="replace").splitlines()
    return (lines[-tail:] if tail else lines), offset + end
