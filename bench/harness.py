"""`ripples bench`: the papers' protocol comparisons, side by side, as ratios.

Runs every protocol on the same task, seed and data under each heterogeneity scenario,
as full `ripples run` jobs (coordinator + spawned workers on loopback). The whole matrix
is repeated and the order of protocols rotates between repeats, so that machine noise
hits every protocol alike. Repeat r uses seed `seed + r` for every run in it: the spread
between seeds (model initialisation, data order; measured here: 106-157 iterations for
allreduce to reach the same loss) is larger than timing noise, so repeating one seed
would only measure the latter. Methodology as the papers': time to reach a target training
loss (Ripples §7.1.4), time per epoch (AD-PSGD's robustness table), iterations to the
target (statistical efficiency).

    ripples bench --quick                  # about 5 minutes: 2 scenarios, 1 repeat
    ripples bench                          # the full matrix (docs/benchmarks.md)

Writes DIR/results.json (one record per run, plus the medians), DIR/loss.png and
DIR/iteration_split.png, and prints a table. Each finished run is appended to
DIR/records.jsonl as it ends, so an interrupted matrix keeps its runs:
`ripples bench --resume` (same options) runs only the missing ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ripples.bench.peers import PEERS, missing_package
from ripples.coordinator.topology import TOPOLOGIES
from ripples.protocols.registry import PROTOCOLS
from ripples.protocols.spec import Coordination
from ripples.sim.scenarios import SCENARIOS, Scenario


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A protocol run with extra `ripples run` flags: a row of its own in the matrix."""

    protocol: str
    flags: tuple[str, ...]
    description: str


VARIANTS: dict[str, Variant] = {
    "a2cid2-no-momentum": Variant(
        protocol="a2cid2", flags=("--no-momentum",),
        description="A2CiD2's asynchronous baseline: the same FIFO gossip, no momentum"),
    "hop-backup": Variant(
        protocol="hop", flags=("--hop-mode", "backup", "--backup-workers", "1"),
        description="Hop with one backup worker (§4.3, §7.3.3)"),
    "hop-staleness": Variant(
        protocol="hop", flags=("--hop-mode", "staleness", "--staleness", "5"),
        description="Hop with bounded staleness s = 5 (§4.4, §7.3.4)"),
    "hop-skip": Variant(
        protocol="hop", flags=("--hop-mode", "backup", "--backup-workers", "1",
                               "--max-jump", "4"),
        description="Hop with one backup worker, skipping up to 4 iterations (§5, §7.3.5)"),
    "lpp-sgd-smart": Variant(
        protocol="lpp-sgd", flags=("--lpp-averaging", "ripples-smart"),
        description="LPP-SGD averaging in the smart Group Generator's groups (P-Reduce)"),
}
MATRIX_PROTOCOLS: tuple[str, ...] = (*PROTOCOLS, *VARIANTS)

SCRIPT_WORKLOADS: dict[str, tuple[str, ...]] = {
    "transformer-lm": ("python", "-m", "ripples.examples.transformer_lm", "--d-model", "64",
                       "--layers", "2", "--heads", "2", "--block-size", "64",
                       "--log-every", "1000000000"),
}
"""Workloads that are user scripts (`ripples run -- python ...`), not built-in tasks: a
small decoder-only Transformer LM (examples/transformer_lm.py: 0.13M parameters, bytes of
the standard library's source, AdamW, warm-up + cosine, bf16 autocast). The bench passes
each its step cap (`max_steps`), seed and batch size."""
"""What the matrix can run: every registered protocol, then the variants."""


PEER_NAMES: tuple[str, ...] = tuple(PEERS)
"""Peer systems (hivemind, torchft) the matrix can run next to Ripples' protocols, when
their packages are installed (`pip install 'ripples[peers]'`; `ripples bench --peers`)."""


def base_protocol(name: str) -> str:
    """The registered protocol a matrix entry runs (a variant's, or the name itself)."""
    return VARIANTS[name].protocol if name in VARIANTS else name


def takes_topology(name: str) -> bool:
    """Lockstep protocols (allreduce, ripples-static) synchronise every worker together
    and ignore a topology; the group and gossip protocols run on it (peers: none)."""
    return name not in PEERS and PROTOCOLS[base_protocol(name)].role.takes_topology


@dataclass(kw_only=True)
class HarnessConfig:
    workers: int = 8
    workers_per_node: int = 4
    protocols: tuple[str, ...] = MATRIX_PROTOCOLS
    """Every registered protocol and variant by default: protocols added later join the
    matrix."""
    scenarios: tuple[str, ...] = tuple(SCENARIOS)
    task: str = "synthetic-cnn"
    """A built-in task, or a script workload (SCRIPT_WORKLOADS: transformer-lm)."""
    batch_size: int = 16
    target_loss: float = 1.4
    """Training loss that allreduce reaches in about 50 s here (8 workers, homogeneous,
    about 4.5 epochs); lower targets make its straggler runs (10x slower) last too long."""
    max_epochs: float = 12.0
    """Cap on each run of a task; a run that does not reach the target records no time to
    target."""
    max_steps: int = 2000
    """Cap on each worker's steps in a script workload (which has no epochs)."""
    repeats: int = 2
    seed: int = 0
    """Seed of the first repeat; repeat r uses seed + r."""
    output: Path = Path("runs/bench")
    run_timeout_seconds: float = 900.0
    topology: str = "complete"
    """Graph for the protocols that take one (group and gossip protocols); allreduce and
    ripples-static always synchronise all workers."""
    rate_com: float = 1.0
    """Gossip: expected pairwise averagings per worker per gradient step, equal for every
    gossip protocol of the matrix."""
    peer_settings: dict[str, dict[str, object]] = field(default_factory=dict)
    """peer -> knob -> value, over the peer's tuned defaults (PEERS[peer].defaults)."""

    def validate(self) -> None:
        unknown = [p for p in self.protocols if p not in MATRIX_PROTOCOLS + PEER_NAMES]
        if unknown:
            raise ValueError(f"unknown protocol(s) {unknown}; choose from "
                             f"{', '.join(MATRIX_PROTOCOLS + PEER_NAMES)}")
        missing = {p: m for p in self.protocols if p in PEERS
                   for m in [missing_package(p)] if m}
        if missing:
            raise ValueError(
                f"peer(s) {', '.join(missing)} need(s) {', '.join(sorted(set(missing.values())))}"
                ", which is not installed: pip install 'ripples[peers]'")
        for peer, knobs in self.peer_settings.items():
            if peer not in PEERS:
                raise ValueError(f"--peer-setting names {peer!r}, not a peer ({', '.join(PEERS)})")
            unknown = sorted(set(knobs) - set(PEERS[peer].defaults))
            if unknown:
                raise ValueError(f"{peer} has no setting {', '.join(unknown)}; its settings: "
                                 f"{', '.join(PEERS[peer].defaults)}")
        if self.topology not in TOPOLOGIES or self.topology == "file":
            raise ValueError(f"unknown topology {self.topology!r}; choose one of "
                             f"{', '.join(t for t in TOPOLOGIES if t != 'file')}")
        if not 0 < self.rate_com <= 100:
            raise ValueError(f"rate_com must be in (0, 100], got {self.rate_com}")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; choose from {sorted(SCENARIOS)}")
        if self.workers < 2 or self.repeats < 1 or self.target_loss <= 0 or self.max_epochs <= 0:
            raise ValueError("need workers >= 2, repeats >= 1, target_loss > 0, max_epochs > 0")


# About 5 minutes here: two scenarios, one repeat, an easier target, and the baseline
# against one protocol of each family (the full matrix runs them all).
QUICK_SCENARIOS = ("homogeneous", "slow-5x")
QUICK_PROTOCOLS = ("allreduce", "ripples-smart", "adpsgd", "a2cid2")
QUICK = HarnessConfig(protocols=QUICK_PROTOCOLS, scenarios=QUICK_SCENARIOS, repeats=1,
                      max_epochs=4.0, target_loss=2.0)


@dataclass(kw_only=True)
class RunRecord:
    scenario: str
    protocol: str
    repeat: int
    time_to_target_seconds: float | None
    seconds_per_epoch: float | None
    iterations_to_target: float | None
    final_loss: float
    """Evaluation loss of the consensus model at the end of the run."""
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


def run_command(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int,
                out: Path) -> list[str]:
    """The `ripples run` command line of one matrix entry."""
    extra = list(VARIANTS[protocol].flags) if protocol in VARIANTS else []
    if takes_topology(protocol) and cfg.topology != "complete":
        extra += ["--topology", cfg.topology]
    if PROTOCOLS[base_protocol(protocol)].role.coordination is Coordination.GOSSIP:
        extra += ["--rate-com", f"{cfg.rate_com:g}"]
    seed = cfg.seed + repeat
    command = [sys.executable, "-m", "ripples.cli", "run", "--quiet",
               "--workers", str(cfg.workers), "--workers-per-node", str(cfg.workers_per_node),
               "--protocol", base_protocol(protocol), *extra,
               "--target-loss", str(cfg.target_loss), "--seed", str(seed),
               "--output", str(out), "--timeout-seconds", str(cfg.run_timeout_seconds),
               *scenario.slowdown_flags(cfg.workers)]
    if cfg.task in SCRIPT_WORKLOADS:
        return [*command, "--", *SCRIPT_WORKLOADS[cfg.task], "--steps", str(cfg.max_steps),
                "--seed", str(seed), "--batch-size", str(cfg.batch_size)]
    return [*command, "--task", cfg.task, "--batch-size", str(cfg.batch_size),
            "--epochs", str(cfg.max_epochs)]


def run_one(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int) -> RunRecord:
    out = cfg.output / "runs" / f"{scenario.name}-{protocol}-{repeat}"
    summary = (peer_summary(cfg, scenario, protocol, repeat, out) if protocol in PEERS
               else run_summary(cfg, scenario, protocol, repeat, out))
    return record_from_summary(summary, scenario, repeat, protocol)


def peer_summary(cfg: HarnessConfig, scenario: Scenario, peer: str, repeat: int,
                 out: Path) -> dict:
    """Run one matrix entry of a peer system (same task, seed, data, batch, slowdowns)."""
    from ripples.bench.peers.launch import PeerRunConfig, run_peer

    script = SCRIPT_WORKLOADS.get(cfg.task)
    return run_peer(PeerRunConfig(
        peer=peer, workload=cfg.task,
        script_args=tuple(script[3:]) if script else (),
        num_workers=cfg.workers, seed=cfg.seed + repeat, batch_size=cfg.batch_size,
        max_epochs=cfg.max_epochs, max_steps=cfg.max_steps, target_loss=cfg.target_loss,
        slowdowns=scenario.slowdowns(cfg.workers),
        settings=dict(cfg.peer_settings.get(peer, {})), output=out,
        timeout_seconds=cfg.run_timeout_seconds))


def run_summary(cfg: HarnessConfig, scenario: Scenario, protocol: str, repeat: int,
                out: Path) -> dict:
    """Run one matrix entry's `ripples run` into `out`; its summary.json."""
    cmd = run_command(cfg, scenario, protocol, repeat, out)
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          timeout=cfg.run_timeout_seconds + 120)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}\nexited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def record_from_summary(summary: dict, scenario: Scenario, repeat: int,
                        protocol: str | None = None) -> RunRecord:
    """One run's record; `protocol` names the matrix entry (a variant) when it is not
    the summary's protocol."""
    workers = summary["workers"]
    total = max(sum(w["iterations"] for w in workers), 1)
    others = [w["iterations"] for w in workers if w["rank"] not in scenario.slowed_ranks()]

    def per_iteration(key: str) -> float:
        return sum(w[key] for w in workers) / total

    return RunRecord(
        scenario=scenario.name, protocol=protocol or summary["protocol"], repeat=repeat,
        time_to_target_seconds=summary["time_to_target_seconds"],
        seconds_per_epoch=summary["seconds_per_epoch"],
        iterations_to_target=summary["iterations_to_target"],
        final_loss=summary["final_loss"], final_train_loss=summary["final_train_loss"],
        wall_seconds=summary["wall_seconds"],
        seconds_per_iteration=summary["wall_seconds"] / (total / len(workers)),
        compute_seconds_per_iteration=per_iteration("compute_seconds"),
        wait_seconds_per_iteration=per_iteration("wait_seconds"),
        preduce_seconds_per_iteration=per_iteration("preduce_seconds"),
        loss_curve=summary["loss_curve"],
        consensus_distance_mean=summary.get("consensus_distance_mean"),
        consensus_distance_final=summary.get("consensus_distance_final"),
        others_seconds_per_iteration=(summary["wall_seconds"] / (sum(others) / len(others))
                                      if others and sum(others) else None),
        samples_per_second=summary.get("samples_per_second"),
    )


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def add_speedups(records: list[RunRecord]) -> None:
    """speedup_vs_allreduce = allreduce's time to target / this run's, in the same scenario
    and repeat (so with the same seed), and throughput_vs_allreduce = this run's samples
    per second / allreduce's; the median over repeats goes in the table."""
    for rec in records:
        same = [r for r in records if (r.scenario, r.repeat) == (rec.scenario, rec.repeat)
                and r.protocol == "allreduce"]
        base = _median([r.time_to_target_seconds for r in same])
        if base is not None and rec.time_to_target_seconds:
            rec.speedup_vs_allreduce = base / rec.time_to_target_seconds
        base = _median([r.samples_per_second for r in same])
        if base and rec.samples_per_second is not None:
            rec.throughput_vs_allreduce = rec.samples_per_second / base


def medians(records: list[RunRecord]) -> list[dict]:
    """One row per (scenario, protocol): medians over repeats of every numeric field."""
    keys = list(dict.fromkeys((r.scenario, r.protocol) for r in records))
    numeric = ["time_to_target_seconds", "seconds_per_epoch", "iterations_to_target",
               "final_loss", "final_train_loss", "seconds_per_iteration",
               "compute_seconds_per_iteration", "wait_seconds_per_iteration",
               "preduce_seconds_per_iteration", "speedup_vs_allreduce",
               "consensus_distance_mean", "consensus_distance_final",
               "others_seconds_per_iteration", "samples_per_second",
               "throughput_vs_allreduce"]
    rows = []
    for scenario, protocol in keys:
        runs = [r for r in records if (r.scenario, r.protocol) == (scenario, protocol)]
        row: dict[str, object] = {"scenario": scenario, "protocol": protocol,
                                  "runs": len(runs),
                                  "reached_target": sum(r.time_to_target_seconds is not None
                                                        for r in runs)}
        for name in numeric:
            row[name] = _median([getattr(r, name) for r in runs])
        rows.append(row)
    for name, ratio in (("seconds_per_epoch", "epoch_time_vs_homogeneous"),
                        ("others_seconds_per_iteration", "others_iteration_time_vs_homogeneous")):
        homogeneous = {row["protocol"]: row[name] for row in rows
                       if row["scenario"] == "homogeneous"}
        for row in rows:
            base, value = homogeneous.get(row["protocol"]), row[name]
            row[ratio] = (value / base if isinstance(base, float) and isinstance(value, float)
                          else None)
    return rows


RECORDS_FILE = "records.jsonl"
CONFIG_FILE = "config.json"


def config_dict(cfg: HarnessConfig) -> dict[str, object]:
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(cfg).items()}


def load_finished(cfg: HarnessConfig) -> list[RunRecord]:
    """The runs an earlier, interrupted `ripples bench` with the same options finished."""
    config_path, records_path = cfg.output / CONFIG_FILE, cfg.output / RECORDS_FILE
    if not records_path.exists():
        return []
    if config_path.exists():
        before = json.loads(config_path.read_text())
        now, defaults = config_dict(cfg), config_dict(HarnessConfig())
        # An option newer than the interrupted bench had its default there.
        before = {k: before.get(k, defaults[k]) for k in now}
        changed = sorted(k for k in now if k != "output" and before[k] != now[k])
        if changed:
            raise ValueError(f"cannot resume {cfg.output}: it was run with other options "
                             f"({', '.join(f'{k}={before[k]!r}' for k in changed)})")
    records = []
    for number, line in enumerate(records_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(RunRecord(**json.loads(line)))
        except (ValueError, TypeError) as err:  # a line cut short by the interruption
            print(f"{records_path}:{number}: skipped an unreadable record ({err})",
                  file=sys.stderr)
    return records


def run_matrix(cfg: HarnessConfig, finished: list[RunRecord] | None = None) -> list[RunRecord]:
    """Run every (repeat, scenario, protocol) not in `finished`, appending each record to
    DIR/records.jsonl as it ends."""
    cfg.validate()
    records = list(finished or [])
    have = {(r.scenario, r.protocol, r.repeat) for r in records}
    cfg.output.mkdir(parents=True, exist_ok=True)
    (cfg.output / CONFIG_FILE).write_text(json.dumps(config_dict(cfg), indent=2) + "\n")
    records_path = cfg.output / RECORDS_FILE
    if not records:
        records_path.write_text("")
    total = cfg.repeats * len(cfg.scenarios) * len(cfg.protocols)
    if records:
        print(f"resuming: {len(records)} of {total} runs already in {records_path}",
              file=sys.stderr, flush=True)
    started, ran, position = time.monotonic(), 0, 0
    for repeat in range(cfg.repeats):
        for scenario_name in cfg.scenarios:
            shift = (repeat + position) % len(cfg.protocols)
            order = cfg.protocols[shift:] + cfg.protocols[:shift]  # rotate: no fixed first
            for protocol in order:
                position += 1
                if (scenario_name, protocol, repeat) in have:
                    continue
                done = len(records)
                eta = ((time.monotonic() - started) / ran * (total - done)) if ran else None
                print(f"[{done + 1}/{total}] {scenario_name} {protocol} (repeat {repeat + 1})"
                      + (f", about {eta / 60:.0f} min left" if eta else ""),
                      file=sys.stderr, flush=True)
                rec = run_one(cfg, SCENARIOS[scenario_name], protocol, repeat)
                ttt = (f"{rec.time_to_target_seconds:.1f} s" if rec.time_to_target_seconds
                       else "not reached")
                print(f"    target {ttt}, {rec.seconds_per_iteration:.3f} s/iteration",
                      file=sys.stderr, flush=True)
                with records_path.open("a") as f:
                    f.write(json.dumps(asdict(rec)) + "\n")
                records.append(rec)
                ran += 1
    add_speedups(records)
    return records


def installed_peers(exclude: tuple[str, ...] = ()) -> list[str]:
    """The peers whose packages are installed; says on stderr which are skipped."""
    chosen = []
    for peer in PEERS:
        if peer in exclude:
            continue
        package = missing_package(peer)
        if package:
            print(f"skipping peer {peer}: {package} is not installed "
                  "(pip install 'ripples[peers]')", file=sys.stderr, flush=True)
        else:
            chosen.append(peer)
    return chosen


def parse_peer_settings(items: list[str]) -> dict[str, dict[str, object]]:
    """PEER:KEY=VALUE items (numbers parsed as numbers); ValueError saying what to write."""
    out: dict[str, dict[str, object]] = {}
    for item in items:
        peer, sep, rest = item.partition(":")
        key, eq, text = rest.partition("=")
        if not sep or not eq or not key:
            raise ValueError(f"malformed --peer-setting {item!r}: write PEER:KEY=VALUE, e.g. "
                             "hivemind-local:target_batch_size=1024")
        value: object = text
        for kind in (int, float):
            try:
                value = kind(text)
                break
            except ValueError:
                continue
        out.setdefault(peer, {})[key] = value
    return out


def _fmt(value: object, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def format_table(rows: list[dict]) -> str:
    """The medians as a text table; a consensus-distance column (mean of the run's
    estimates) when some protocol gossiped. 'vs homog': epoch time over the protocol's
    own homogeneous one; 'others': the same for the iteration time of the workers that
    the scenario does not slow in every iteration; 'thruput': samples per second over
    allreduce's."""
    gossip = any(row.get("consensus_distance_mean") is not None for row in rows)
    lines = [f"{'scenario':<12} {'protocol':<18} {'to target':>10} {'speedup':>8} "
             f"{'s/epoch':>8} {'vs homog':>8} {'others':>7} {'iters':>7} {'s/iter':>7} "
             f"{'compute':>8} {'wait':>6} {'preduce':>8} {'samples/s':>9} {'thruput':>7}"
             + (f" {'consensus':>10}" if gossip else "")]
    for row in rows:
        lines.append(
            f"{row['scenario']:<12} {row['protocol']:<18} "
            f"{_fmt(row['time_to_target_seconds'], '.1f'):>9}s "
            f"{_ratio(row['speedup_vs_allreduce']):>8} "
            f"{_fmt(row['seconds_per_epoch'], '.2f'):>8} "
            f"{_ratio(row['epoch_time_vs_homogeneous']):>8} "
            f"{_ratio(row.get('others_iteration_time_vs_homogeneous')):>7} "
            f"{_fmt(row['iterations_to_target'], '.0f'):>7} "
            f"{_fmt(row['seconds_per_iteration'], '.3f'):>7} "
            f"{_fmt(row['compute_seconds_per_iteration'], '.3f'):>8} "
            f"{_fmt(row['wait_seconds_per_iteration'], '.3f'):>6} "
            f"{_fmt(row['preduce_seconds_per_iteration'], '.3f'):>8} "
            f"{_fmt(row.get('samples_per_second'), '.0f'):>9} "
            f"{_ratio(row.get('throughput_vs_allreduce')):>7}"
            + (f" {_fmt(row.get('consensus_distance_mean'), '.3g'):>10}" if gossip else ""))
    return "\n".join(lines)


def format_markdown(rows: list[dict]) -> str:
    """The medians as the Markdown table of docs/benchmarks.md."""
    gossip = any(row.get("consensus_distance_mean") is not None for row in rows)
    head = ["scenario", "protocol", "to target", "iterations", "s/iter", "compute", "wait",
            "P-Reduce", "speedup vs allreduce", "epoch time vs own homogeneous",
            "others' s/iter vs own homogeneous", "samples/s", "throughput vs allreduce"]
    head += ["consensus distance (mean)"] if gossip else []
    lines = ["| " + " | ".join(head) + " |",
             "|---|---|" + "---:|" * (len(head) - 2)]
    for row in rows:
        ttt = row["time_to_target_seconds"]
        cells = [row["scenario"], row["protocol"],
                 f"{ttt:.1f} s" if ttt is not None else
                 f"not reached ({row['reached_target']}/{row['runs']})",
                 _fmt(row["iterations_to_target"], ".0f"),
                 _fmt(row["seconds_per_iteration"], ".3f"),
                 _fmt(row["compute_seconds_per_iteration"], ".3f"),
                 _fmt(row["wait_seconds_per_iteration"], ".3f"),
                 _fmt(row["preduce_seconds_per_iteration"], ".3f"),
                 _ratio(row["speedup_vs_allreduce"]),
                 _ratio(row["epoch_time_vs_homogeneous"]),
                 _ratio(row.get("others_iteration_time_vs_homogeneous")),
                 _fmt(row.get("samples_per_second"), ".0f"),
                 _ratio(row.get("throughput_vs_allreduce"))]
        if gossip:
            cells.append(_fmt(row.get("consensus_distance_mean"), ".3g"))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_results(cfg: HarnessConfig, records: list[RunRecord], rows: list[dict]) -> Path:
    path = cfg.output / "results.json"
    path.write_text(json.dumps({"config": config_dict(cfg), "medians": rows,
                                "records": [asdict(r) for r in records]}, indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> int:
    defaults = HarnessConfig()
    parser = argparse.ArgumentParser(prog="ripples bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"scenarios {', '.join(QUICK_SCENARIOS)}, one repeat, target loss "
                             f"{QUICK.target_loss} (about 5 minutes)")
    parser.add_argument("--workers", type=int, default=defaults.workers)
    parser.add_argument("--workers-per-node", type=int, default=defaults.workers_per_node)
    parser.add_argument("--protocols", help=f"comma-separated (default: all of "
                                            f"{', '.join(defaults.protocols)}; with --quick: "
                                            f"{', '.join(QUICK.protocols)})")
    parser.add_argument("--scenarios", help=f"comma-separated, from {', '.join(SCENARIOS)} "
                                            "(default: all)")
    parser.add_argument("--topology", default=defaults.topology,
                        help="graph for the group and gossip protocols: "
                             f"{', '.join(t for t in TOPOLOGIES if t != 'file')} "
                             "(allreduce and ripples-static ignore it; default %(default)s)")
    parser.add_argument("--rate-com", type=float, default=defaults.rate_com,
                        help="gossip averagings per worker per step, the same for every "
                             "gossip protocol (default %(default)s)")
    parser.add_argument("--task", default=defaults.task,
                        help="a built-in task, or a script workload: "
                             f"{', '.join(SCRIPT_WORKLOADS)} (default %(default)s)")
    parser.add_argument("--batch-size", type=int, default=defaults.batch_size)
    parser.add_argument("--target-loss", type=float,
                        help=f"default {defaults.target_loss} ({QUICK.target_loss} with --quick)")
    parser.add_argument("--max-epochs", type=float,
                        help=f"default {defaults.max_epochs} ({QUICK.max_epochs} with --quick)")
    parser.add_argument("--max-steps", type=int, default=defaults.max_steps,
                        help="per-worker step cap of a script workload (default %(default)s)")
    parser.add_argument("--repeats", type=int, help=f"default {defaults.repeats}")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--output", type=Path, default=defaults.output)
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as Markdown (docs/benchmarks.md); with --resume "
                             "on a finished bench, re-prints it without running anything")
    parser.add_argument("--peers", action="store_true",
                        help=f"also run the peer systems ({', '.join(PEERS)}) whose packages "
                             "are installed (pip install 'ripples[peers]'); the others are "
                             "skipped with a message")
    parser.add_argument("--peer-setting", action="append", default=[], metavar="PEER:KEY=VALUE",
                        help="a peer's knob instead of its tuned default (repeatable), e.g. "
                             "hivemind-local:target_batch_size=1024")
    parser.add_argument("--resume", action="store_true",
                        help="keep the runs already in OUTPUT/records.jsonl (an interrupted "
                             "bench with the same options) and run only the missing ones")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else defaults
    try:
        peer_settings = parse_peer_settings(args.peer_setting)
    except ValueError as err:
        parser.error(str(err))
    cfg = replace(
        base, workers=args.workers, workers_per_node=args.workers_per_node,
        protocols=(tuple(p for p in args.protocols.split(",") if p) if args.protocols
                   else base.protocols),
        scenarios=(tuple(s for s in args.scenarios.split(",") if s) if args.scenarios
                   else base.scenarios),
        task=args.task, batch_size=args.batch_size,
        target_loss=args.target_loss or base.target_loss,
        max_epochs=args.max_epochs or base.max_epochs, repeats=args.repeats or base.repeats,
        max_steps=args.max_steps,
        seed=args.seed, output=args.output, topology=args.topology, rate_com=args.rate_com,
        peer_settings=peer_settings,
    )
    if args.peers:
        cfg.protocols += tuple(installed_peers(exclude=cfg.protocols))
    try:
        cfg.validate()
        finished = load_finished(cfg) if args.resume else []
    except ValueError as err:
        parser.error(str(err))
    records = run_matrix(cfg, finished)
    rows = medians(records)
    print(format_markdown(rows) if args.markdown else format_table(rows))
    path = write_results(cfg, records, rows)
    from ripples.bench.plots import plot_iteration_split, plot_loss_curves

    plots = [plot_loss_curves(records, cfg.output / "loss.png", cfg.target_loss),
             plot_iteration_split(rows, cfg.output / "iteration_split.png")]
    print(f"wrote {path}, {', '.join(str(p) for p in plots)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
