"""What `ripples bench` runs: the matrix's entries and its configuration.

The entries are the registered protocols, their variants (a protocol with extra `ripples
run` flags: a row of its own), the peer systems (bench/peers/) and the script workloads;
`HarnessConfig` says which of them run, on which task, scenarios and seeds, and how often
(`QUICK`: the five-minute matrix). Running one entry is bench/bench_run.py's part, the
schedule and the command line bench/harness.py's, the table bench/report.py's.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ripples.bench.network import network_rates
from ripples.bench.peers import DILOCO_DEFAULTS, PEERS, missing_package
from ripples.cli.arguments import scalar
from ripples.coordinator.topology import TOPOLOGIES
from ripples.protocols.registry import PROTOCOLS
from ripples.sim.scenarios import SCENARIOS


@dataclass(frozen=True, kw_only=True)
class Variant:
    """A protocol run with extra `ripples run` flags: a row of its own in the matrix."""

    protocol: str
    flags: tuple[str, ...]
    description: str


def diloco_flags(settings: dict[str, object], rounds: int = 1) -> tuple[str, ...]:
    """The `ripples run` flags of DiLoCo with torchft-diloco's knobs (sync_every, outer_lr,
    outer_momentum; the others are ignored), with rounds of `rounds` times its H."""
    knobs = {**DILOCO_DEFAULTS, **{k: v for k, v in settings.items() if k in DILOCO_DEFAULTS}}
    steps = int(knobs["sync_every"]) * rounds
    return ("--local-steps", str(steps), "--outer-optimizer", "nesterov",
            "--outer-lr", f"{float(knobs['outer_lr']):g}",  # type: ignore[arg-type]
            "--outer-momentum", f"{float(knobs['outer_momentum']):g}")  # type: ignore[arg-type]


def stretch_flags(workers: int) -> tuple[str, ...]:
    """The `ripples run` flags of the all-worker form without local steps, its averaged
    step stretched by √N: the models averaged after each worker's own optimizer step,
    every step, with the outer lr √workers and no momentum. Each worker's AdamW step
    follows its own batch's noise as much as the gradient; the noise cancels in the
    average, which shortens the step by up to √N (docs/local-steps.md, "Loss per step on
    equal workers, with AdamW")."""
    return ("--local-steps", "1", "--outer-optimizer", "nesterov",
            "--outer-lr", f"{math.sqrt(workers):.4g}", "--outer-momentum", "0")


STRETCH_VARIANT = "allreduce-stretch"
"""The variant bench_run.run_command gives `stretch_flags` of the bench's workers."""

DILOCO_VARIANT = "allreduce-diloco"
"""The variant that runs torchft-diloco's algorithm in Ripples: bench_run.run_command
gives it the peer's H and outer step, --peer-setting overrides included."""
OUTER_VARIANTS: dict[str, str] = {DILOCO_VARIANT: "allreduce",
                                  "ripples-smart-outer": "ripples-smart",
                                  "ripples-smart-int8": "ripples-smart",
                                  "ripples-smart-int8-overlap": "ripples-smart",
                                  "ripples-smart-link": "ripples-smart",
                                  "ripples-random-outer": "ripples-random",
                                  "adpsgd-outer": "adpsgd"}
"""Variants with local steps and the outer Nesterov step (docs/local-steps.md), each on
its protocol, all with the torchft-diloco peer's H and outer step (its --peer-setting
overrides included), so that every such row runs the same H, outer lr and momentum."""

_INT8 = ("--outer-compression", "int8")
OUTER_EXTRAS: dict[str, tuple[tuple[str, ...], str]] = {
    "ripples-smart-int8": (_INT8, ", the anchors' low bits in one byte a parameter "
                                  "(--outer-compression int8)"),
    "ripples-smart-int8-overlap": ((*_INT8, "--overlap"),
                                   ", int8, rounds of 2H steps, each synchronised in the "
                                   "background while the next round's steps run "
                                   "(--overlap)"),
    "ripples-smart-link": ((*_INT8, "--sync-share", "0.1"),
                           ", int8, and rounds sized to the link: H to 8H steps, so that "
                           "synchronising takes at most a tenth of the time (--sync-share "
                           "0.1)"),
}
"""Outer variants with flags of their own after the shared H and outer step: their
flags and the description's ending."""
OUTER_ROUNDS: dict[str, int] = {"ripples-smart-int8-overlap": 2}
"""Outer variants whose rounds are a multiple of the shared H: a synchronisation in the
background hides behind the next round's compute, and more of it hides behind a longer
round (at H from 4 to 16 the LM ends at the same loss: docs/local-steps.md)."""

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
    "ripples-smart-overlap": Variant(
        protocol="ripples-smart", flags=("--overlap",),
        description="ripples-smart with each group's P-Reduce in the background, applied "
                    "at a later step boundary (docs/gpu.md, \"Averaging off the critical "
                    "path\")"),
    STRETCH_VARIANT: Variant(
        protocol="allreduce", flags=stretch_flags(8),
        description="allreduce of the models after every step, the average stretched by "
                    "√N (--local-steps 1 --outer-optimizer nesterov --outer-lr √N "
                    "--outer-momentum 0; docs/local-steps.md)"),
    DILOCO_VARIANT: Variant(
        protocol="allreduce", flags=diloco_flags(DILOCO_DEFAULTS),
        description="DiLoCo: allreduce of the pseudo-gradients every H steps and an outer "
                    "Nesterov step, with the H and outer step of the torchft-diloco peer "
                    "(its --peer-setting overrides apply here too; docs/local-steps.md)"),
    **{name: Variant(
        protocol=protocol, flags=diloco_flags(DILOCO_DEFAULTS),
        description=f"{protocol} with local steps and the outer Nesterov step in its "
                    "groups (the torchft-diloco peer's H and outer step, its --peer-setting "
                    "overrides too; docs/local-steps.md)"
                    + OUTER_EXTRAS.get(name, ((), ""))[1])
       for name, protocol in OUTER_VARIANTS.items() if name != DILOCO_VARIANT},
}
MATRIX_PROTOCOLS: tuple[str, ...] = (*PROTOCOLS, *VARIANTS)
"""What the matrix can run: every registered protocol, then the variants."""

SCRIPT_WORKLOADS: dict[str, tuple[str, ...]] = {
    "transformer-lm": ("python", "-m", "ripples.examples.transformer_lm", "--d-model", "64",
                       "--layers", "2", "--heads", "2", "--block-size", "64",
                       "--log-every", "1000000000"),
}
"""Workloads that are user scripts (`ripples run -- python ...`), not built-in tasks: a
small decoder-only Transformer LM (examples/transformer_lm.py: 0.13M parameters, bytes of
the standard library's source, AdamW, warm-up + cosine, bf16 autocast). The bench passes
each its step cap (`max_steps`), seed and batch size."""

PEER_NAMES: tuple[str, ...] = tuple(PEERS)
"""Peer systems (hivemind, torchft) the matrix can run next to Ripples' protocols, when
their packages are installed (`pip install 'ripples[peers]'`; `ripples bench --peers`)."""


def base_protocol(name: str) -> str:
    """The registered protocol a matrix entry runs: a variant's, or the name itself."""
    return VARIANTS[name].protocol if name in VARIANTS else name


def takes_topology(name: str) -> bool:
    """Lockstep protocols (allreduce, ripples-static) synchronise every worker together
    and ignore a topology; the group and gossip protocols run on it (peers: none)."""
    return name not in PEERS and PROTOCOLS[base_protocol(name)].role.takes_topology


@dataclass(kw_only=True)
class HarnessConfig:
    """What `ripples bench` runs: the matrix (protocols x scenarios x repeats), the task
    and its target, the caps, the seeds and the output folder."""

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
    network: str = "loopback"
    """The links every system's workers run on: a preset of bench/network.py's NETWORKS
    (loopback, slow, uneven)."""
    link_mbit: tuple[str, ...] = ()
    """`--link-mbit` values (RATE, RANK:RATE) over the preset's rates."""
    device: str = "cpu"
    """Where Ripples' workers train: cpu, or cuda (`ripples run --device cuda
    --share-gpus`: every worker on the machine's GPUs, several to a GPU where there are
    fewer GPUs than workers, NCCL between them). The peers train on the CPU only."""

    def link_rates(self) -> tuple[float | None, ...]:
        """One link rate per rank (Mbit/s; None: unshaped); empty on loopback.

        Raises:
            ValueError: an unknown preset, a malformed rate, or shaped links where
                namespaces cannot be made.
        """
        return network_rates(self.network, self.link_mbit, self.workers)

    @property
    def network_name(self) -> str:
        """The preset's name, or "custom" where --link-mbit changed its rates."""
        return "custom" if self.link_mbit else self.network

    def validate(self) -> None:
        """Check the configuration before anything runs.

        Raises:
            ValueError: an unknown protocol, scenario, topology or peer setting, a peer
                whose package is not installed, or a value out of its range (the
                message says which).
        """
        unknown = [p for p in self.protocols if p not in MATRIX_PROTOCOLS + PEER_NAMES]
        if unknown:
            raise ValueError(f"unknown protocol(s) {unknown}; choose from "
                             f"{', '.join(MATRIX_PROTOCOLS + PEER_NAMES)}")
        self._validate_device()
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
        self.link_rates()

    def _validate_device(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if self.device == "cpu":
            return
        peers = [p for p in self.protocols if p in PEERS]
        if peers:
            raise ValueError(f"device cuda runs Ripples' protocols only: the peers "
                             f"({', '.join(peers)}) train on the CPU in the bench")
        import torch  # only here: the CPU bench never needs to ask

        if not torch.cuda.is_available():
            raise ValueError("device cuda: this machine has no CUDA device torch can use")


DEVICES = ("cpu", "cuda")
"""Where the bench's Ripples workers may train (HarnessConfig.device)."""


# About 5 minutes here: two scenarios, one repeat, an easier target, and the baseline
# against one protocol of each family (the full matrix runs them all).
QUICK_SCENARIOS = ("homogeneous", "slow-5x")
QUICK_PROTOCOLS = ("allreduce", "ripples-smart", "adpsgd", "a2cid2")
QUICK = HarnessConfig(protocols=QUICK_PROTOCOLS, scenarios=QUICK_SCENARIOS, repeats=1,
                      max_epochs=4.0, target_loss=2.0)
"""`ripples bench --quick`."""


def config_dict(cfg: HarnessConfig) -> dict[str, object]:
    """A configuration as JSON holds it (paths as strings, tuples as lists).

    Args:
        cfg: The configuration.

    Returns:
        Its fields by name: what DIR/config.json and results.json record.
    """
    return {k: (str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v)
            for k, v in asdict(cfg).items()}


def installed_peers(exclude: tuple[str, ...] = ()) -> list[str]:
    """The peers whose packages are installed; says on stderr which are skipped.

    Args:
        exclude: Peers not to consider (already in the matrix).

    Returns:
        The installed peers' names, in PEERS' order.
    """
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
    """Parse `--peer-setting` items.

    Args:
        items: PEER:KEY=VALUE strings.

    Returns:
        peer -> knob -> value, a value that reads as an int or a float parsed as one.

    Raises:
        ValueError: a malformed item (the message says what to write).
    """
    out: dict[str, dict[str, object]] = {}
    for item in items:
        peer, sep, rest = item.partition(":")
        key, eq, text = rest.partition("=")
        if not sep or not eq or not key:
            raise ValueError(f"malformed --peer-setting {item!r}: write PEER:KEY=VALUE, e.g. "
                             "hivemind-local:target_batch_size=1024")
        out.setdefault(peer, {})[key] = scalar(text)
    return out

