"""The network a `ripples bench` runs on: loopback, or every worker a host on a shaped link.

    ripples bench --network slow      # every link at 20 Mbit/s each way
    ripples bench --network uneven    # every link at 200 Mbit/s, the last worker's at 20
    ripples bench --link-mbit 50 --link-mbit 7:5   # any rates (RATE, RANK:RATE)

Every system of the matrix, Ripples' protocols and the peers, runs each worker in a
network namespace of its own on its link, the coordinator or lighthouse on an unshaped
one (ripples/netshape.py, docs/network.md). Before the matrix starts, the bench builds the
links once, measures each one's achieved rate both ways and prints it; each run measures
its own again and keeps them in its summary.

Why 20 Mbit/s is `slow`: measured here on 8 workers (2 cores), a ring all-reduce puts
2(N-1)/N of the payload on each worker's link each step, sent and received: the
Transformer LM's 0.48 MB payload is 6.8 Mbit per step, 0.34 s at 20 Mbit/s against 0.086 s
of compute (80% of allreduce's step communicating); synthetic-cnn's 1.1 MB is 15.3 Mbit,
0.77 s against 0.135 s (85%); the preset asks for at least two thirds. `uneven` keeps one host at
that rate and gives the others ten times more: a slow host among fast ones, where a
synchronous system runs at the slowest link's pace.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from ripples.netshape import ShapedCluster, parse_link_rates, unavailable_reason

__all__ = ["NETWORKS", "SLOW_MBIT", "UNEVEN_FAST_MBIT", "link_flags", "network_rates",
           "print_links"]

SLOW_MBIT = 20.0
"""Every link of `slow`; the slow host's of `uneven` (the module says why)."""
UNEVEN_FAST_MBIT = 10 * SLOW_MBIT
"""The other hosts' links in `uneven`."""
NETWORKS = ("loopback", "slow", "uneven")
"""The presets of `--network` (`--link-mbit` sets any rates instead)."""


def network_rates(network: str, link_mbit: Sequence[str], workers: int
                  ) -> tuple[float | None, ...]:
    """One link rate per rank (Mbit/s, None: unshaped); empty for loopback.

    Args:
        network: A preset of NETWORKS.
        link_mbit: `--link-mbit` values (RATE, RANK:RATE), applied over the preset.
        workers: The bench's workers.

    Raises:
        ValueError: an unknown preset or a malformed rate, or shaped links on a machine
            where namespaces cannot be made (the message says why).
    """
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; choose from {', '.join(NETWORKS)} "
                         "(or --link-mbit for any rates)")
    fast = {"slow": SLOW_MBIT, "uneven": UNEVEN_FAST_MBIT}.get(network)
    preset: list[float | None] = [fast] * workers
    if network == "uneven":
        preset[-1] = SLOW_MBIT
    for rank, rate in enumerate(parse_link_rates(link_mbit, workers)):
        if rate is not None:
            preset[rank] = rate
    if all(rate is None for rate in preset):
        return ()
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"a shaped network runs every worker in a network namespace of its "
                         f"own, which cannot be made here: {reason}")
    return tuple(preset)


def link_flags(rates: Sequence[float | None]) -> list[str]:
    """`ripples run`'s flags for these rates (one `--link-mbit RANK:RATE` per shaped
    rank; none for loopback)."""
    flags = []
    for rank, rate in enumerate(rates):
        if rate is not None:
            flags += ["--link-mbit", f"{rank}:{rate:g}"]
    return flags


def print_links(rates: Sequence[float | None], seconds: float = 1.0) -> None:
    """Build the links once, measure each one both ways, print the rates (stderr) and
    tear them down (each run measures its own again: its summary's `network`)."""
    if not rates:
        return
    print(f"network: {len(rates)} hosts on shaped links; measuring them ...",
          file=sys.stderr, flush=True)
    with ShapedCluster(len(rates), rates) as cluster:
        measured = cluster.measure_all(seconds)
    for link in measured:
        print(f"  {link.describe()}", file=sys.stderr, flush=True)
