"""Bytes per worker per step in `ripples bench`'s table: the peers' step logs carry each
step's bytes (bench/peers/progress.py), summed as a Ripples run's summary sums its
workers' preduce_bytes, and every system's row shows the figure, or "-" where it was not
counted."""

from __future__ import annotations

import json

import pytest

from ripples.bench import harness
from ripples.bench.peers import DILOCO_DEFAULTS, PEERS
from ripples.bench.peers.progress import StepRecord, bytes_per_step, sent_bytes
from ripples.bench.report import format_bytes
from ripples.sim.scenarios import SCENARIOS

P = 1_000  # parameters of a made-up model: 4P bytes of fp32


def steps(rank: int, count: int, every: int, payload: int, first: int = 1) -> list[StepRecord]:
    """`count` steps of one worker that hand `payload` bytes to a collective every
    `every`-th step."""
    return [StepRecord(rank=rank, time=float(i), iteration=i, loss=1.0, samples=16 * i,
                       compute_seconds=0.1 * i, sync_seconds=0.01 * i,
                       sent_bytes=payload if i % every == 0 else 0)
            for i in range(first, first + count)]


def test_each_systems_pattern_gives_its_bytes_per_step() -> None:
    # torchft DDP: a gradient all-reduce of 4P every step.
    assert bytes_per_step(steps(0, 12, 1, 4 * P) + steps(1, 12, 1, 4 * P)) == 4 * P
    # torchft-diloco, H = 4: one pseudo-gradient all-reduce of 4P per round.
    assert bytes_per_step(steps(0, 16, 4, 4 * P) + steps(1, 16, 4, 4 * P)) == P
    # hivemind-sync: every epoch (here every 3 local steps) 4P of gradients and 4P of
    # parameters (no buffers): 8P x global steps / local steps.
    assert bytes_per_step(steps(0, 9, 3, 8 * P)) == pytest.approx(8 * P / 3)
    # A straggler that did fewer steps sends as often per round: all bytes over all steps.
    ranks = steps(0, 8, 4, 4 * P) + steps(1, 4, 4, 4 * P)
    assert bytes_per_step(ranks) == pytest.approx(3 * 4 * P / 12)


def test_a_replacement_and_an_uncounted_step() -> None:
    killed = steps(1, 5, 1, 4 * P)
    replacement = steps(1, 3, 1, 4 * P, first=6)  # its own count, its peers' iterations
    assert sent_bytes(killed + replacement) == 8 * 4 * P
    assert bytes_per_step(killed + replacement) == 4 * P
    unknown = StepRecord(rank=0, time=1.0, iteration=1, loss=1.0, samples=16,
                         compute_seconds=0.1, sync_seconds=0.0)
    assert bytes_per_step([*killed, unknown]) is None and sent_bytes([unknown]) is None
    assert bytes_per_step([]) is None


def test_the_step_log_line_carries_the_bytes_and_reads_older_lines() -> None:
    [record] = steps(2, 1, 1, 4 * P)
    assert json.loads(record.line())["b"] == 4 * P
    assert StepRecord.parse(2, record.line()) == record
    older = '{"t": 1.0, "i": 1, "loss": 2.0, "n": 16, "c": 0.1, "s": 0.0}'
    assert StepRecord.parse(0, older).sent_bytes is None


def test_every_system_gets_the_column_and_an_uncounted_one_shows_a_dash() -> None:
    def summary(protocol: str, per_step: float | None) -> dict:
        out = {"protocol": protocol, "workers": [
                   {"rank": r, "iterations": 10, "compute_seconds": 1.0, "wait_seconds": 0.0,
                    "preduce_seconds": 0.1} for r in range(2)],
               "time_to_target_seconds": 5.0, "seconds_per_epoch": 1.0,
               "iterations_to_target": 10.0, "final_loss": 1.0, "final_train_loss": 1.0,
               "wall_seconds": 6.0, "loss_curve": []}
        if per_step is not None:
            out["bytes_per_worker_step"] = per_step
        return out

    homogeneous = SCENARIOS["homogeneous"]
    records = [harness.record_from_summary(summary("allreduce", 4.0 * 62_000), homogeneous, 0),
               harness.record_from_summary(summary("torchft-diloco", 4.0 * 62_000 / 8),
                                           homogeneous, 0),
               harness.record_from_summary(summary("hivemind-local", None), homogeneous, 0)]
    assert [r.bytes_per_worker_step for r in records] == [248_000.0, 31_000.0, None]
    rows = harness.medians(records)
    table = harness.format_table(rows).splitlines()
    assert "bytes/step" in table[0]
    bytes_column = table[0].index("bytes/step") + len("bytes/step")
    assert [line[:bytes_column].rstrip().rsplit(" ", 2)[-2:] for line in table[1:]] == [
        ["248", "kB"], ["31", "kB"], ["", "-"]]
    markdown = harness.format_markdown(rows).splitlines()
    assert "bytes per worker per step" in markdown[0]
    assert "| 248 kB |" in markdown[2] and "| 31 kB |" in markdown[3]
    # bytes (not counted), compute utilization (0.1 of 0.6 s), loss at equal steps (no curve)
    assert markdown[4].endswith("| - | 17% | - |")
    assert [format_bytes(v) for v in (None, 12, 999.4, 1_500, 2.5e6, 7.25e9)] == [
        "-", "12 B", "999 B", "1.5 kB", "2.5 MB", "7.25 GB"]


def test_the_diloco_peer_and_variant_share_their_algorithm() -> None:
    spec = PEERS["torchft-diloco"]
    assert spec.package == "torchft"
    assert {k: spec.defaults[k] for k in DILOCO_DEFAULTS} == DILOCO_DEFAULTS
    assert spec.defaults["sync_every"] in spec.sweep["sync_every"]
    assert spec.defaults["outer_lr"] in spec.sweep["outer_lr"]
    # The manager and lighthouse knobs are the torchft peer's (no DDP mode here).
    assert {k for k in PEERS["torchft"].defaults if k != "mode"} <= set(spec.defaults)
    assert harness.VARIANTS["allreduce-diloco"].protocol == "allreduce"


def test_the_diloco_peers_outer_step_takes_momentum_zero_as_a_plain_step() -> None:
    # torch's Nesterov SGD refuses momentum 0; the sweep and --peer-setting may ask for it
    # (a bench with outer_momentum=0 crashed at the first torchft-diloco worker).
    import torch

    from ripples.bench.peers.backends import outer_sgd

    for momentum in (0.0, 0.5):
        weight = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
        step = outer_sgd([weight], lr=2.0, momentum=momentum)
        weight.grad = torch.tensor([0.5, 0.25])
        step.step()
        # The first Nesterov step moves by lr * (1 + momentum) * g; momentum 0: lr * g.
        torch.testing.assert_close(weight.detach(),
                                   torch.tensor([1.0, -2.0]) - 2.0 * (1 + momentum)
                                   * torch.tensor([0.5, 0.25]))
