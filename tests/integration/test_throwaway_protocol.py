"""A protocol added as its own files and one registry line trains a real run: a
coordinator and worker processes on gloo, nothing else changed (tests/throwaway_protocol/).

Every process registers it at start-up through a sitecustomize module, which stands for
the protocol's line in protocols/registry.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from helpers import REPO, ripples_cli


@pytest.mark.slow
def test_a_new_protocol_trains_a_run_of_real_processes(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "from tests.throwaway_protocol.spec import register\n\nregister()\n")
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH"))
                           if p)
    out = tmp_path / "run"
    proc = ripples_cli("run", "--workers", "3", "--protocol", "ring-pairs", "--task", "digits",
                       "--iterations", "60", "--output", str(out), "--quiet",
                       env={"PYTHONPATH": path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["protocol"] == "ring-pairs"
    assert summary["stop_reason"].startswith("iteration budget reached")
    assert summary["final_accuracy"] >= 0.8, summary  # 0.94 here; chance is 0.1
    # Every worker averaged: its own pairs P-Reduced (the runtime is the package's own).
    assert all(w["preduce_seconds"] > 0 for w in summary["workers"])
