"""The README's "Running a real cluster" block, run as it is written: openssl makes the
certificates, a coordinator service with TLS and a token, two host agents, two submitted
runs back to back, `ripples runs / status / logs`, and the agents drained."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from tests.integration.helpers import REPO

pytestmark = pytest.mark.slow


def _block() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## Running a real cluster"):]
    found = re.search(r"```bash\n(.*?)```", section, re.S)
    assert found is not None, "the README lost its cluster block"
    return found.group(1)


def test_the_readmes_cluster_block_runs_as_written(tmp_path: Path) -> None:
    if shutil.which("openssl") is None:
        pytest.skip("needs openssl (Debian package openssl) to make the certificates")
    (tmp_path / "examples").symlink_to(REPO / "examples")
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("RIPPLES_COORDINATOR", None)
    # If a line fails, the background processes end with the block (the README's own
    # last line ends them when all went well).
    script = ("set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"
              + _block())
    process = subprocess.Popen(["bash", "-c", script], cwd=tmp_path, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        pytest.fail(f"the README's block did not end in 420 s:\n{output[-4000:]}")
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, output[-4000:]
    assert re.search(r"run \w+ finished", output), output[-4000:]  # the second run's wait
    assert "run " in output and "(first): finished" in output, output[-4000:]
    runs = output[output.index("RUN "):]
    assert "first" in runs and "second" in runs and "node-a" in runs and "node-b" in runs
    assert "epoch 0: loss" in output  # rank 0's own output, through the logs
    assert "drained" in output
