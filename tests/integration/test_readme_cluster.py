"""The README's "Running a real cluster" block, run as it is written: openssl makes the
certificates, a coordinator service with TLS and a token, two host agents, two submitted
runs back to back, `ripples runs / status / logs`, and the agents drained."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from tests.integration.helpers import REPO, doc_block, run_block

pytestmark = pytest.mark.slow


def test_the_readmes_cluster_block_runs_as_written(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (Debian package openssl) to make the certificates")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    code, output = run_block(doc_block("README.md", "## Running a real cluster"), tmp_path,
                             timeout=420)
    assert code == 0, output[-4000:]
    assert re.search(r"run \w+ finished", output), output[-4000:]  # the second run's wait
    assert "run " in output and "(first): finished" in output, output[-4000:]
    runs = output[output.index("RUN "):]
    assert "first" in runs and "second" in runs and "node-a" in runs and "node-b" in runs
    assert "epoch 0: loss" in output  # rank 0's own output, through the logs
    assert "drained" in output
