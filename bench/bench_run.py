"""One run of `ripples bench`'s matrix: its command, its summary, its record.

A protocol or variant runs as a `ripples run` job (coordinator and spawned workers on
loopback) and leaves a summary.json; a peer system runs through bench/peers/ and returns
a summary of the same form. `RunRecord` is what the schedule keeps of it
(bench/harness.py) and the report compares (bench/report.py).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ripples.bench.matrix import (
    OUTER_EXTRAS,
    OUTER_ROUNDS,
    OUTER_VARIANTS,
    SCRIPT_WORKLOADS,
    STRETCH_VARIANT,
    VARIANTS,
    HarnessConfig,
    base_protocol,
    diloco_flags,
    stretch_flags,
    takes_topology,
)
from ripples.bench.network import link_flags
from ripples.bench.peers import PEERS
from ripples.protocols.registry import PROTOCOLS
from ripples.protocols.spec import Coordination
from ripples.sim.scenarios import Scenario


@dataclass(kw_only=True)
class RunRecord:
    """One finished run of the matrix: what its summary.json says, per iteration and as
    times; the ratios to allreduce are filled in over all records (report.add_speedups)."""

    scenario: str
    protocol: str
    repeat: int
    time_to_target_seconds: float | None
    seconds_per_epoch: float | None
    iterations_to_target: float | None
    final_loss: float | None
    """Evaluation loss of the consensus model at the end of the run (None: not evaluated)."""
    final_train_loss: float | None
    wall_seconds: float
    seconds_per_iteration: float
    """Wall time over the iterations of an average worker."""
    compute_seconds_per_iteration: float
    wait_seconds_per_iteration: float
    preduce_seconds_per_iteration: float
    speedup_vs_allreduce: float | None = None
    loss_curve: list[list[float]] = field(default_factory=list)
    consensus_distance_mean: float | None = None
    """Gossip: the coordinator's consensus-distance estimate, averaged over the run's
    samples (None for protocols without pairwise exchanges, and in older records)."""
    consensus_distance_final: float | None = None
    """Exact consensus distance of the workers' final models."""
    samples_per_second: float | None = None
    """Training throughput of all workers together (None in older records)."""
    throughput_vs_allreduce: float | None = None
    """samples_per_second over allreduce's in the same scenario and repeat."""
    others_seconds_per_iteration: float | None = None
    """Wall time over the iterations of an average worker that the scenario does not slow
    in every iteration (all workers in homogeneous and random scenarios)."""
    compute_utilization: float | None = None
    """Time in forward, backward and the optimizer over wall time, for an average worker
    (compute seconds per iteration over seconds per iteration)."""
    loss_curve_iterations: list[float] = field(default_factory=list)
    """An average worker's iterations at each point of loss_curve."""
    equal_steps: float | None = None
    """The step count at which the runs of the same scenario and repeat are compared:
    the fewest any of them reached (report.add_equal_step_losses)."""
    loss_at_equal_steps: float | None = None
    """The mean training loss when an average worker had taken equal_steps steps."""
    network: str = "loopback"
    """The links it ran on (HarnessConfig.network; "custom" with --link-mbit)."""
    bytes_per_worker_step: float | None = None
    """Bytes a worker fed into its synchronisations' collectives per optimizer step, all
    workers' over all their steps (summary.json's; None: not counted, or an older record).
    Ripples' workers count what they hand their collectives; the peers' are counted as
    bench/peers/progress.py's bytes_per_step says."""


def run_command(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int,
                out: Path) -> list[str]:
    """The `ripples run` command line of one matrix entry.

    Args:
        cfg: The bench's configuration.
        scenario: The heterogeneity scenario (its slowdown flags).
        protocol: A protocol or a variant (VARIANTS).
        repeat: The repeat's index: the run's seed is cfg.seed + repeat.
        out: The run's output folder.

    Returns:
        The argv, a script workload's (SCRIPT_WORKLOADS) after `--`.
    """
    extra = list(VARIANTS[protocol].flags) if protocol in VARIANTS else []
    if protocol in OUTER_VARIANTS:  # the peer's H and outer step, overrides included
        extra = list(diloco_flags(cfg.peer_settings.get("torchft-diloco", {}),
                                  OUTER_ROUNDS.get(protocol, 1)))
        extra += OUTER_EXTRAS.get(protocol, ((), ""))[0]
    if protocol == STRETCH_VARIANT:  # √N of this bench's workers
        extra = list(stretch_flags(cfg.workers))
    if takes_topology(protocol) and cfg.topology != "complete":
        extra += ["--topology", cfg.topology]
    if PROTOCOLS[base_protocol(protocol)].role.coordination is Coordination.GOSSIP:
        extra += ["--rate-com", f"{cfg.rate_com:g}"]
    seed = cfg.seed + repeat
    device = ["--device", cfg.device, *(["--share-gpus"] if cfg.device == "cuda" else [])]
    command = [sys.executable, "-m", "ripples.cli", "run", "--quiet", *device,
               "--workers", str(cfg.workers), "--workers-per-node", str(cfg.workers_per_node),
               "--protocol", base_protocol(protocol), *extra,
               "--target-loss", str(cfg.target_loss), "--seed", str(seed),
               "--output", str(out), "--timeout-seconds", str(cfg.run_timeout_seconds),
               *scenario.slowdown_flags(cfg.workers), *link_flags(cfg.link_rates())]
    if cfg.task in SCRIPT_WORKLOADS:
        return [*command, "--", *SCRIPT_WORKLOADS[cfg.task], "--steps", str(cfg.max_steps),
                "--seed", str(seed), "--batch-size", str(cfg.batch_size)]
    return [*command, "--task", cfg.task, "--batch-size", str(cfg.batch_size),
            "--epochs", str(cfg.max_epochs)]


def run_one(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int) -> RunRecord:
    """Run one matrix entry (a protocol, a variant or a peer) and read its record.

    Args:
        cfg: The bench's configuration; the run goes under cfg.output/runs/.
        scenario: The heterogeneity scenario.
        protocol: A protocol, a variant or a peer (PEERS).
        repeat: The repeat's index.

    Returns:
        The run's record.
    """
    out = cfg.output / "runs" / f"{scenario.name}-{protocol}-{repeat}"
    summary = (peer_summary(cfg, scenario, protocol, repeat, out) if protocol in PEERS
               else run_summary(cfg, scenario, protocol, repeat, out))
    return record_from_summary(summary, scenario, repeat, protocol, cfg.network_name)


def peer_summary(cfg: HarnessConfig, scenario: Scenario, peer: str, repeat: int,
                 out: Path) -> dict:
    """Run one matrix entry of a peer system (same task, seed, data, batch, slowdowns).

    Returns:
        Its summary, in the form of `ripples run`'s summary.json.
    """
    from ripples.bench.peers.launch import PeerRunConfig, run_peer

    script = SCRIPT_WORKLOADS.get(cfg.task)
    return run_peer(PeerRunConfig(
        peer=peer, workload=cfg.task,
        script_args=tuple(script[3:]) if script else (),
        num_workers=cfg.workers, seed=cfg.seed + repeat, batch_size=cfg.batch_size,
        max_epochs=cfg.max_epochs, max_steps=cfg.max_steps, target_loss=cfg.target_loss,
        slowdowns=scenario.slowdowns(cfg.workers),
        settings=dict(cfg.peer_settings.get(peer, {})), output=out,
        timeout_seconds=cfg.run_timeout_seconds, link_mbit=cfg.link_rates()))


def run_summary(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int,
                out: Path) -> dict:
    """Run one matrix entry's `ripples run` into `out`.

    Returns:
        Its summary.json.

    Raises:
        RuntimeError: the run exited with an error (its stderr's end is in the message).
    """
    cmd = run_command(cfg, scenario, protocol, repeat, out)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=cfg.run_timeout_seconds + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def record_from_summary(summary: dict, scenario: Scenario, repeat: int,
                        protocol: str | None = None, network: str = "loopback") -> RunRecord:
    """One run's record from its summary.

    Args:
        summary: The run's summary.json.
        scenario: Its scenario (which ranks it slows).
        repeat: The repeat's index.
        protocol: The matrix entry (a variant) when it is not the summary's protocol.
        network: The links it ran on.

    Returns:
        The record, its ratios to allreduce not yet filled in.
    """
    workers = summary["workers"]
    total = max(sum(w["iterations"] for w in workers), 1)
    others = [w["iterations"] for w in workers if w["rank"] not in scenario.slowed_ranks()]

    def per_iteration(key: str) -> float:
        return sum(w[key] for w in workers) / total

    seconds_per_iteration = summary["wall_seconds"] / (total / len(workers))
    return RunRecord(
        network=network,
        compute_utilization=(per_iteration("compute_seconds") / seconds_per_iteration
                             if seconds_per_iteration > 0 else None),
        loss_curve_iterations=list(summary.get("loss_curve_iterations") or []),
        scenario=scenario.name, protocol=protocol or summary["protocol"], repeat=repeat,
        time_to_target_seconds=summary["time_to_target_seconds"],
        seconds_per_epoch=summary["seconds_per_epoch"],
        iterations_to_target=summary["iterations_to_target"],
        final_loss=summary["final_loss"], final_train_loss=summary["final_train_loss"],
        wall_seconds=summary["wall_seconds"],
        seconds_per_iteration=seconds_per_iteration,
        compute_seconds_per_iteration=per_iteration("compute_seconds"),
        wait_seconds_per_iteration=per_iteration("wait_seconds"),
        preduce_seconds_per_iteration=per_iteration("preduce_seconds"),
        loss_curve=summary["loss_curve"],
        consensus_distance_mean=summary.get("consensus_distance_mean"),
        consensus_distance_final=summary.get("consensus_distance_final"),
        others_seconds_per_iteration=(summary["wall_seconds"] / (sum(others) / len(others))
                                      if others and sum(others) else None),
        samples_per_second=summary.get("samples_per_second"),
        bytes_per_worker_step=summary.get("bytes_per_worker_step"),
    )

