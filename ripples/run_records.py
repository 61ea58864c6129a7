"""Runs, agents and hosts as people read them: the names of run states, a run's and an
agent's record as JSON-ready data, host names in natural order.

Shared by the coordinator (its history), the `ripples runs` and `ripples status`
commands and the dashboard, which all show the proto's RunInfo and AgentInfo the same way.
"""

from __future__ import annotations

import re

from ripples.v1 import coordinator_pb2 as pb

ENDED = frozenset({pb.RUN_STATE_FINISHED, pb.RUN_STATE_FAILED, pb.RUN_STATE_STOPPED,
                   pb.RUN_STATE_CANCELLED})
"""The states of a run that is over."""
STATE_NAMES: dict[int, str] = {
    pb.RUN_STATE_QUEUED: "queued",
    pb.RUN_STATE_RUNNING: "running",
    pb.RUN_STATE_FINISHED: "finished",
    pb.RUN_STATE_FAILED: "failed",
    pb.RUN_STATE_STOPPED: "stopped",
    pb.RUN_STATE_CANCELLED: "cancelled",
}


def state_name(state: int) -> str:
    return STATE_NAMES.get(state, "unknown")


def ranks_per_worker(info: pb.RunInfo) -> int:
    """The processes each of the run's workers is (RunInfo.ranks_per_worker; 0, as in a
    run recorded before the field existed, is 1)."""
    return max(1, info.ranks_per_worker)


def summary(info: pb.RunInfo) -> dict[str, object]:
    """A run's row as JSON-ready data (`ripples runs --json`, the dashboard's list)."""
    return {
        "run_id": info.run_id, "name": info.name, "state": state_name(info.state),
        "protocol": info.protocol, "workers": info.num_workers,
        "ranks_per_worker": ranks_per_worker(info),
        "task": info.task, "command": list(info.command),
        "submitted_at": info.submitted_at, "started_at": info.started_at or None,
        "ended_at": info.ended_at or None, "stop_reason": info.stop_reason,
        "model_path": info.model_path, "queue_position": info.queue_position or None,
        "mean_loss": info.mean_loss, "mean_iterations": info.mean_iterations,
        "elapsed_seconds": info.elapsed_seconds,
    }


def agent_summary(agent: pb.AgentInfo) -> dict[str, object]:
    """A host agent as JSON-ready data (`ripples runs --json`, the dashboard)."""
    return {"agent_id": agent.agent_id, "host": agent.host, "slots": agent.slots,
            "devices": list(agent.devices), "memory_bytes": agent.memory_bytes,
            "run_id": agent.run_id, "processes": agent.processes,
            "seen_seconds_ago": round(agent.seen_seconds_ago, 1), "draining": agent.draining}


def printable(text: str) -> str:
    """`text` with every character a terminal or a log reader would act on (a newline, an
    escape sequence, a bidirectional override) written as Python writes it in a repr
    (`\\n`, `\\x1b`): a host's or a run's name cannot forge a log line or recolour a
    terminal. Printable text comes back as it is (so twice is once)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def natural_key(text: str) -> list[int | str]:
    """Sort key of host names in natural order: node2 before node10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]
