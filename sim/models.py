"""What the simulator assumes of the cluster: compute times, links, and the model.

Three models, each a small dataclass with a documented formula (docs/scale.md):

- `ComputeModel`: seconds of one training iteration of worker `rank` (a base step time,
  a heterogeneity scenario, multiplicative jitter);
- `CommModel`: seconds of one P-Reduce (ring all-reduce, alpha-beta) over a group, or of
  one gossip exchange (a group of two), plus the coordinator round trip and the cost of
  building a new communicator;
- `ConsensusModel`: each worker holds a vector; a local step pulls it towards its own
  optimum (heterogeneous data) plus noise; a group sets its members to their average
  (with an outer optimizer: each member's anchor and momentum too, by OuterState's rule,
  sim/outer_step.py). The spread of the vectors (consensus distance) is what averaging
  fights.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass

import numpy as np

from ripples.sim.outer_step import OuterStep
from ripples.sim.scenarios import SCENARIOS

SIM_SCENARIOS: tuple[str, ...] = (*SCENARIOS, "lognormal", "slow-fraction")
"""Compute-time scenarios: the benchmark's (homogeneous, slow-2x/4x/5x/10x: worker 0
that many times slower; random-6x: each worker 6x slower with probability 1/n per
iteration), `lognormal` (long-tailed per-iteration times) and `slow-fraction` (a fraction
of the workers slower by a factor)."""


@dataclass(frozen=True, kw_only=True)
class ComputeModel:
    """Seconds of one iteration: `step_seconds` x the scenario's factor x jitter."""

    scenario: str = "homogeneous"
    step_seconds: float = 0.1
    """One iteration of an unslowed worker (the task's measured step time)."""
    jitter: float = 0.05
    """Relative spread of every iteration's time (log-normal, sigma = jitter)."""
    lognormal_sigma: float = 0.5
    """`lognormal`: sigma of the per-iteration log-normal factor (median 1)."""
    slow_fraction: float = 0.1
    """`slow-fraction`: this fraction of the workers (the lowest ranks) is slowed."""
    slow_factor: float = 4.0
    """`slow-fraction`: by this factor."""
    cores: float = 0.0
    """0: every worker has its own device. Above 0: the workers share this many cores
    (processor sharing: k running threads progress at min(1, cores / k) each; a
    collective of g members is g threads doing CommModel's seconds of work each, a
    gossip exchange 2), and a slowed iteration computes at the shared rate, then sleeps
    (factor - 1) x the seconds it took, as the benchmark's injected slowdown does
    (worker/slowdown.py). This is what benchmark workers on one small machine see
    (docs/scale.md, validation)."""

    def __post_init__(self) -> None:
        if self.scenario not in SIM_SCENARIOS:
            raise ValueError(f"unknown scenario {self.scenario!r}; choose one of "
                             f"{', '.join(SIM_SCENARIOS)}")
        if not self.step_seconds > 0:
            raise ValueError(f"step_seconds must be positive, got {self.step_seconds}")
        if not 0 <= self.jitter <= 2:
            raise ValueError(f"jitter must be in [0, 2], got {self.jitter}")
        if not 0 <= self.slow_fraction <= 1:
            raise ValueError(f"slow_fraction must be in [0, 1], got {self.slow_fraction}")
        if not self.slow_factor >= 1 or not self.lognormal_sigma >= 0:
            raise ValueError("slow_factor must be >= 1 and lognormal_sigma >= 0")
        if not self.cores >= 0:
            raise ValueError(f"cores must not be negative, got {self.cores}")

    def slowed(self, num_workers: int) -> frozenset[int]:
        """The ranks slowed in every iteration."""
        if self.scenario == "slow-fraction":
            return frozenset(range(math.ceil(self.slow_fraction * num_workers)))
        if self.scenario in SCENARIOS:
            return SCENARIOS[self.scenario].slowed_ranks()
        return frozenset()

    def sampler(self, num_workers: int, rng: random.Random) -> ComputeSampler:
        return ComputeSampler(self, num_workers, rng)


class ComputeSampler:
    """Draws iteration times of one simulated run (seeded)."""

    def __init__(self, model: ComputeModel, num_workers: int, rng: random.Random) -> None:
        self.model = model
        self.rng = rng
        self.slowed = model.slowed(num_workers)
        bench = SCENARIOS.get(model.scenario)
        self.factor = model.slow_factor if model.scenario == "slow-fraction" else (
            bench.factor if bench is not None else 1.0)
        self.random_slowdown = bench is not None and bench.random
        self.p_random = 1.0 / num_workers

    def draw(self, rank: int) -> tuple[float, float]:
        """One iteration of `rank`: its unslowed seconds (its work, with jitter and the
        long tail) and the slowdown factor of this iteration."""
        m = self.model
        t = m.step_seconds
        factor = 1.0
        if rank in self.slowed:
            factor = self.factor
        elif self.random_slowdown and self.rng.random() < self.p_random:
            factor = self.factor
        if m.scenario == "lognormal":
            t *= self.rng.lognormvariate(0.0, m.lognormal_sigma)
        if m.jitter:
            t *= self.rng.lognormvariate(0.0, m.jitter)
        return t, factor


class SharedCores:
    """Processor sharing of `cores` among the threads running now: each of k runs at
    min(1, cores / k). A job is `weight` threads that progress together (a collective of
    g workers: g threads, each doing the job's work). A virtual clock `v` advances at
    that rate; a job started at v0 with work w ends when v reaches v0 + w (one heap,
    O(log n) per start and end)."""

    def __init__(self, cores: float) -> None:
        self.cores = cores
        self.v = 0.0
        self.t = 0.0
        self.jobs: list[tuple[float, int, int, int]] = []  # (v at the end, seq, key, weight)
        self.threads = 0
        self._seq = 0

    def rate(self) -> float:
        k = self.threads
        return min(1.0, self.cores / k) if k else 1.0

    def advance(self, now: float) -> None:
        self.v += (now - self.t) * self.rate()
        self.t = now

    def start(self, now: float, key: int, work: float, weight: int = 1) -> None:
        self.advance(now)
        self._seq += 1
        self.threads += weight
        heapq.heappush(self.jobs, (self.v + work, self._seq, key, weight))

    def next_end(self) -> float | None:
        """Real seconds from the last advance until the next job ends (None: no job)."""
        if not self.jobs:
            return None
        return max(0.0, self.jobs[0][0] - self.v) / self.rate()

    def finish(self, now: float) -> list[int]:
        """Advance to `now` and take the jobs that ended by then."""
        self.advance(now)
        done = []
        while self.jobs and self.jobs[0][0] <= self.v + 1e-9:
            _, _, key, weight = heapq.heappop(self.jobs)
            self.threads -= weight
            done.append(key)
        return done


def shared_finish_times(works: list[float], cores: float) -> list[float]:
    """Seconds until each job ends when all start together on `cores` shared cores."""
    order = sorted(range(len(works)), key=works.__getitem__)
    out = [0.0] * len(works)
    t = done_work = 0.0
    for i, j in enumerate(order):
        k = len(works) - i
        t += (works[j] - done_work) / min(1.0, cores / k)
        done_work = works[j]
        out[j] = t
    return out


@dataclass(frozen=True, kw_only=True)
class CommModel:
    """Seconds of a collective over `g` members (ring all-reduce, alpha-beta):

        2 (g - 1) alpha + 2 (g - 1) / g x model_bytes / bandwidth

    with the inter-host bandwidth when the group spans hosts, the intra-host one when
    it does not; plus `setup_seconds` when the group builds a new communicator and the
    coordinator's round trip `rpc_seconds` before it starts. A collective that carries
    `vectors` model-sized vectors (the outer optimizer's group form: the provisional
    anchor and the momentum: 2; 1.5 with the momentum in bf16, 1 with outer momentum 0)
    sends `vectors x model_bytes`."""

    model_bytes: float = 4 * 25_000_000
    """Bytes averaged (parameters and, by default, the optimizer state): ResNet-50-like.
    The outer optimizer's group form sends twice this (anchor and momentum)."""
    inter_host_bandwidth: float = 1.25e9
    """Bytes per second between hosts (10 Gbit/s)."""
    intra_host_bandwidth: float = 50e9
    """Bytes per second between workers of one host (NVLink/PCIe class)."""
    alpha_seconds: float = 50e-6
    """Latency of one ring step."""
    setup_seconds: float = 0.0
    """Building a new communicator (0: communicators are cached, as after warm-up)."""
    rpc_seconds: float = 0.001
    """The coordinator's round trip for one group request."""

    def __post_init__(self) -> None:
        for name in ("model_bytes", "inter_host_bandwidth", "intra_host_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("alpha_seconds", "setup_seconds", "rpc_seconds"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must not be negative")

    def allreduce_seconds(self, g: int, *, spans_hosts: bool, vectors: float = 1.0) -> float:
        if g < 2:
            return 0.0
        bandwidth = self.inter_host_bandwidth if spans_hosts else self.intra_host_bandwidth
        payload = vectors * self.model_bytes
        return 2 * (g - 1) * self.alpha_seconds + 2 * (g - 1) / g * payload / bandwidth


@dataclass(frozen=True, kw_only=True)
class ConsensusModel:
    """Each worker i holds x_i in R^dim. A local step is

        x_i <- x_i - lr (x_i - b_i) + noise N(0, noise^2 I)

    (SGD on 1/2 ||x - b_i||^2 with gradient noise), with b_i ~ N(0, heterogeneity^2 I)
    fixed per worker: the optimum of the whole run is mean(b). A group replaces each
    member's vector by the members' average (of the values at the collective's start,
    as a delta, so that steps taken meanwhile by a gossip worker stay). The consensus
    distance is mean_i ||x_i - mean(x)||^2."""

    dim: int = 8
    lr: float = 0.05
    noise: float = 0.01
    heterogeneity: float = 1.0
    """Spread of the workers' own optima (non-i.i.d. data)."""
    data_skew: float = 0.0
    """The share of that spread that a block of hosts has in common (data that differs by
    rack or by source): b_i = sqrt(1 - s) e_i + sqrt(s) u_block(i), e and u drawn alike,
    so every worker's spread stays `heterogeneity`. 0: every worker's own; 1: a block's
    workers share one optimum. The blocks: SimConfig.data_blocks."""

    def __post_init__(self) -> None:
        if self.dim < 1:
            raise ValueError("dim must be at least 1")
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr}")
        if self.noise < 0 or self.heterogeneity < 0:
            raise ValueError("noise and heterogeneity must not be negative")
        if not 0 <= self.data_skew <= 1:
            raise ValueError(f"data_skew must be in [0, 1], got {self.data_skew}")


@dataclass(frozen=True)
class GroupSnapshot:
    """A group's members as its collective starts (what their collective carries)."""

    x: np.ndarray
    """Their vectors (one row per member)."""
    steps: np.ndarray
    """Their local steps so far (outer optimizer: whether each has progress to spend)."""
    own: np.ndarray
    """Whether the synchronisation is each member's own (it spends its progress), not a
    partner's that picked it mid-round (gossip)."""


class ConsensusState:
    """The vectors of one simulated run (numpy, one row per rank).

    With an outer optimizer (`outer`: local-step training, docs/local-steps.md) each worker
    also holds an anchor φ_i (its vector as it left its last synchronisation) and an
    outer momentum m_i, both zero at the start as the vectors are, and a group applies
    `OuterStep.group` (sim/outer_step.py; OuterState's rule) instead of the plain average:

        spend_j = own_j and (steps taken since j's last spent synchronisation > 0)
        Δ_j = φ_j − x_j,   m̂_j = μ m_j + Δ_j,   φ̂_j = φ_j − η (Δ_j + μ m̂_j)   (spend_j)
        φ̂_j = φ_j,   m̂_j = m_j                                               (otherwise)
        φ_j, m_j ← mean φ̂, mean m̂;   x_j += φ' − x_j^seen (spend_j) or φ' − φ_j^old

    with x_j^seen the vector at the collective's start: a group protocol's member leaves
    with x_j = φ'; a gossip worker keeps the steps it took during the exchange."""

    def __init__(self, model: ConsensusModel, num_workers: int, seed: int,
                 blocks: list[list[int]] | None = None, outer: OuterStep | None = None
                 ) -> None:
        """`blocks`: the ranks of each block of hosts (for `data_skew`); `outer`: the run's
        outer optimizer (None: plain averaging)."""
        self.model = model
        self.outer = outer
        self.rng = np.random.default_rng(seed)
        self.x = np.zeros((num_workers, model.dim))
        self.optimum = self.rng.normal(0.0, model.heterogeneity, (num_workers, model.dim))
        if model.data_skew and blocks:
            shared = self.rng.normal(0.0, model.heterogeneity, (len(blocks), model.dim))
            self.optimum *= math.sqrt(1 - model.data_skew)
            for b, ranks in enumerate(blocks):
                self.optimum[ranks] += math.sqrt(model.data_skew) * shared[b]
        self.target = self.optimum.mean(axis=0)
        self.anchor = self.x.copy()
        self.momentum = np.zeros_like(self.x)
        self.steps = np.zeros(num_workers, dtype=np.int64)
        """Local steps of each rank so far."""
        self.spent_at = np.zeros(num_workers, dtype=np.int64)
        """Outer optimizer: each rank's step count at its last spent synchronisation."""
        self._noise = np.empty(0)
        self._noise_at = 0

    def step(self, rank: int) -> None:
        m = self.model
        row = self.x[rank]
        row += m.lr * (self.optimum[rank] - row)
        if m.noise:
            row += m.noise * self._next_noise()
        self.steps[rank] += 1

    def _next_noise(self) -> np.ndarray:
        # Drawn in blocks: one numpy call per step costs more than the step itself.
        dim = self.model.dim
        if self._noise_at + dim > self._noise.size:
            self._noise = self.rng.standard_normal(dim * 4096)
            self._noise_at = 0
        out = self._noise[self._noise_at:self._noise_at + dim]
        self._noise_at += dim
        return out

    def snapshot(self, ranks: list[int], own: list[bool] | None = None) -> GroupSnapshot:
        """The members as their collective starts; `own`: per member, whether the
        synchronisation is its own (default: everyone's)."""
        return GroupSnapshot(
            x=self.x[ranks].copy(), steps=self.steps[ranks].copy(),
            own=np.ones(len(ranks), dtype=bool) if own is None else np.array(own, dtype=bool))

    def average(self, ranks: list[int], snapshot: GroupSnapshot) -> None:
        """The group's synchronisation, as a move of each member: plainly by (the mean of
        the snapshot - its own snapshot); with the outer optimizer, its outer step."""
        if self.outer is None:
            self.x[ranks] += snapshot.x.mean(axis=0) - snapshot.x
            return
        spend = snapshot.own & (snapshot.steps > self.spent_at[ranks])
        anchor, momentum, moves = self.outer.group(
            self.anchor[ranks], self.momentum[ranks], snapshot.x, spend)
        self.x[ranks] += moves
        self.anchor[ranks] = anchor
        self.momentum[ranks] = momentum
        self.spent_at[ranks] = np.where(spend, snapshot.steps, self.spent_at[ranks])

    def set_all_to_mean(self) -> None:
        """Every vector to the mean of all (the anchors and momenta stay: a stop inside a
        round of local steps ends so, with no outer step on the partial round)."""
        self.x[:] = self.x.mean(axis=0)

    def distance(self) -> float:
        return float(((self.x - self.x.mean(axis=0)) ** 2).sum(axis=1).mean())

    def gap(self) -> float:
        """||mean(x) - optimum||^2: how far the average model is from the run's optimum."""
        return float(((self.x.mean(axis=0) - self.target) ** 2).sum())

    def loss(self, rank: int) -> float:
        return float(0.5 * ((self.x[rank] - self.optimum[rank]) ** 2).sum())
