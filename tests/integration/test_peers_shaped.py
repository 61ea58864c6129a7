"""The peer systems (hivemind, torchft) on a shaped network, as `ripples bench --network`
runs them: every worker a host in a network namespace of its own on a link of its rate,
torchft's lighthouse in the hub on an unshaped one (ripples/netshape.py). Each peer trains
the bench's task to a loss over its links, its summary records the links' achieved
rates, and no namespace is left.

Skipped where namespaces cannot be made (not root) or the peer is not installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ripples.bench.peers import PEERS, missing_package
from ripples.bench.peers.launch import PeerRunConfig, run_peer
from ripples.netshape import unavailable_reason

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(unavailable_reason() is not None,
                                 reason=f"no network namespaces: {unavailable_reason()}")]

RATES = (20.0, 5.0)


def _mine() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"ripples-{os.getpid()}-")]


@pytest.mark.parametrize("peer", list(PEERS))
def test_a_peer_trains_over_shaped_links_and_leaves_no_namespace(
        peer: str, tmp_path: Path) -> None:
    package = missing_package(peer)
    if package:
        pytest.skip(f"{package} is not installed (pip install 'ripples[peers]')")
    summary = run_peer(PeerRunConfig(
        peer=peer, workload="digits", num_workers=2, batch_size=16, max_epochs=3.0,
        target_loss=2.0, output=tmp_path, timeout_seconds=300, link_mbit=RATES))
    assert not _mine()
    assert summary["time_to_target_seconds"] is not None, summary
    assert all(w["iterations"] > 0 for w in summary["workers"])
    network = summary["network"]
    assert network["link_mbit"] == list(RATES)
    for link, rate in zip(network["measured"], RATES, strict=True):
        # At least half the rate (a loaded machine reads late), never well above it.
        assert 0.5 * rate <= link["up_mbit"] <= 1.25 * rate, network
        assert 0.5 * rate <= link["down_mbit"] <= 1.25 * rate, network
    if peer != "hivemind-local":  # hivemind-local averages only past its target batch
        assert summary["bytes_per_worker_step"] > 0
