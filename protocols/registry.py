"""The protocols Ripples runs: one line each.

Adding a protocol is its own package under protocols/ (settings, spec, runtime) and its
spec below (an import and a line of PROTOCOLS); docs/architecture.md walks through it.
Everything here is pure (no torch): the coordinator, the CLI and the dashboard read the
registry, and a spec loads its runtime only when a worker asks for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ripples.protocols.allreduce.spec import ALLREDUCE
from ripples.protocols.gossip.spec import A2CID2, ADPSGD
from ripples.protocols.group_generator.spec import RIPPLES_RANDOM, RIPPLES_SMART
from ripples.protocols.hop.spec import HOP
from ripples.protocols.lpp.spec import LAP_SGD, LPP_SGD
from ripples.protocols.settings import ProtocolSettings
from ripples.protocols.spec import ProtocolSpec, Role
from ripples.protocols.static_schedule.spec import RIPPLES_STATIC

if TYPE_CHECKING:
    from ripples.worker.protocol import Protocol, ProtocolContext

PROTOCOLS: dict[str, ProtocolSpec] = {spec.name: spec for spec in (
    ALLREDUCE,
    RIPPLES_RANDOM,
    RIPPLES_SMART,
    RIPPLES_STATIC,
    ADPSGD,
    A2CID2,
    HOP,
    LAP_SGD,
    LPP_SGD,
)}
"""Protocol name -> spec, in the order help texts list them."""

DEFAULT_PROTOCOL = RIPPLES_SMART.name
"""A run's protocol when none is given."""

SETTINGS_CLASSES: tuple[type[ProtocolSettings], ...] = tuple(dict.fromkeys(
    cls for spec in PROTOCOLS.values() for cls in spec.settings))
"""Every protocol settings class, once each (a run carries all of them)."""


def get_protocol(name: str) -> ProtocolSpec:
    """The spec of a protocol; ValueError naming the choices for an unknown name."""
    spec = PROTOCOLS.get(name)
    if spec is None:
        raise ValueError(f"unknown protocol {name!r}; choose one of {', '.join(PROTOCOLS)}")
    return spec


def role_of_config(config: Any) -> Role:
    """The coordinator's role in a run, from its RunConfig message (workers, dashboard)."""
    return get_protocol(config.protocol).role_of(lambda cls: cls.of_config(config))


MAX_RANKS_PER_WORKER = 1024
"""The most processes one worker may be (a bound on what a submitted run asks of the host
agents, far above any host's devices)."""


def check_ranks_per_worker(ranks_per_worker: int, config: Any,
                           script: Sequence[str]) -> None:
    """ValueError, with the reason, for workers of `ranks_per_worker` processes that would
    not run the run of RunConfig `config` with `script`: out of bounds, the built-in task
    (whose models are unsharded), a protocol or settings that refuse them (their
    `no_sharded_workers`). One check for `ripples run`, `ripples worker run`, `ripples
    submit`, the coordinator service and the workers."""
    if not 1 <= ranks_per_worker <= MAX_RANKS_PER_WORKER:
        raise ValueError(f"ranks_per_worker must be from 1 to {MAX_RANKS_PER_WORKER}, got "
                         f"{ranks_per_worker}")
    if ranks_per_worker > 1:
        check_sharded_script(ranks_per_worker, script)
        check_sharded_run(config)


def check_sharded_script(ranks_per_worker: int, script: Sequence[str]) -> None:
    """ValueError unless workers of several ranks run a script."""
    if ranks_per_worker > 1 and not script:
        raise ValueError("--ranks-per-worker runs a script that shards its model over the "
                         "worker's ranks (fully_shard(module, mesh=worker.mesh)); the "
                         "built-in tasks train unsharded models: give the script after --")


def check_sharded_run(config: Any) -> None:
    """ValueError, with the reason, when the protocol or the settings of the run of
    RunConfig `config` do not run on workers of several ranks."""
    spec = get_protocol(config.protocol)
    if spec.no_sharded_workers:
        takers = [s.name for s in PROTOCOLS.values() if not s.no_sharded_workers]
        raise ValueError(f"{spec.name} does not run on workers of several ranks: "
                         f"{spec.no_sharded_workers}; use {' or '.join(takers)}, or one "
                         "rank per worker")
    for cls in spec.settings:
        why = cls.of_config(config).no_sharded_workers()
        if why:
            raise ValueError(why)


def create_runtime(name: str, ctx: ProtocolContext) -> Protocol:
    """The worker-side runtime of protocol `name` for this worker; ValueError for an
    unknown name."""
    from ripples.worker.protocol import Protocol

    cls = get_protocol(name).runtime_class()
    protocol = cls(ctx)
    assert isinstance(protocol, Protocol), f"{cls} is not a Protocol"
    return protocol


__all__ = ["DEFAULT_PROTOCOL", "MAX_RANKS_PER_WORKER", "PROTOCOLS", "SETTINGS_CLASSES",
           "check_ranks_per_worker", "check_sharded_run", "check_sharded_script",
           "create_runtime", "get_protocol", "role_of_config"]
