"""The peer systems (hivemind, torchft) on a shaped network, as `ripples bench --network`
runs them: every worker a host in a network namespace of its own on a link of its rate,
torchft's lighthouse in the hub on an unshaped one (ripples/netshape.py). Each peer trains
the bench's task to a loss over its links, its summary records the links' achieved
rates, and no namespace is left.

Skipped where namespaces cannot be made (not root) or the peer is not installed; the
refusal on such a machine is checked everywhere."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ripples.bench.peers import PEERS, missing_package
from ripples.bench.peers.launch import PeerRunConfig, run_peer
from ripples.netshape import unavailable_reason
from tests.integration.helpers import REPO

RATES = (20.0, 5.0)
"""Two hosts' links (Mbit/s each way): a fast one and one a quarter of its rate."""
REASON = unavailable_reason()


def _mine() -> list[str]:
    """This process's shaped clusters' namespaces that still exist."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                         check=False).stdout
    return [line.split()[0] for line in out.splitlines()
            if line.startswith(f"ripples-{os.getpid()}-")]


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"no network namespaces: {REASON}")
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
    assert summary["protocol"] == peer
    assert summary["time_to_target_seconds"] is not None, summary
    assert math.isfinite(summary["final_loss"]) and summary["final_accuracy"] > 0.2
    workers = summary["workers"]
    assert [w["rank"] for w in workers] == [0, 1]
    assert all(w["iterations"] > 0 for w in workers)
    assert (tmp_path / "model.pt").exists()
    network = summary["network"]
    assert network["link_mbit"] == list(RATES)
    for link, rate in zip(network["measured"], RATES, strict=True):
        # Shaped: at most 1.5x the rate (an unshaped link is a thousand times faster).
        # The probe's accuracy is test_netshape.py's; here, beside the suite's load, a
        # 5 Mbit/s link once read 1.4 Mbit/s down, its stream stalled by a loss: the
        # floor only says that the link carried the probe.
        assert 0.1 * rate <= link["up_mbit"] <= 1.5 * rate, network
        assert 0.1 * rate <= link["down_mbit"] <= 1.5 * rate, network
    # Each worker bound and announced its own host's address, not loopback (which, in
    # a namespace of its own, no other worker reaches).
    addresses = json.loads((tmp_path / "worker-config.json").read_text())["addresses"]
    assert len(set(addresses)) == 2 and "127.0.0.1" not in addresses
    if peer.startswith("hivemind"):
        assert f"/ip4/{addresses[0]}/" in (tmp_path / "rendezvous.dht.rank0").read_text()
    # What each step fed into the collectives (they crossed the links): torchft's DDP
    # all-reduces every step, which keeps the replicas equal; hivemind-local counts only
    # past its target batch (16,384 samples), far beyond this run.
    per_step = summary["bytes_per_worker_step"]
    assert per_step >= 0 if peer == "hivemind-local" else per_step > 0, summary
    if peer == "torchft":
        assert summary["consensus_distance_final"] < 1e-6, summary


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0,
                    reason="becoming another user (setpriv) needs root")
def test_shaped_links_are_refused_with_the_reason_where_namespaces_cannot_be_made(
        tmp_path: Path) -> None:
    """No traceback of a half-built cluster: the reason, before the run's folder or any
    process is touched. Run as a user who is not root (nobody), as on a laptop."""
    output = tmp_path / "run"
    output.mkdir()
    (output / "kept").touch()
    code = ("from pathlib import Path\n"
            "from ripples.bench.peers.launch import PeerRunConfig, run_peer\n"
            f"run_peer(PeerRunConfig(peer='torchft', num_workers=2, output=Path({str(output)!r}),"
            f" link_mbit={RATES!r}))\n")
    done = subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                           "--clear-groups", sys.executable, "-c", code],
                          capture_output=True, text=True, cwd="/", timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert done.returncode != 0
    assert "NetworkUnavailable: torchft on shaped links" in done.stderr, done.stderr[-2000:]
    assert "need root" in done.stderr
    assert (output / "kept").exists()
