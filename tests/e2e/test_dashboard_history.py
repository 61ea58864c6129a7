"""The dashboard of a coordinator service, in a real headless Chromium: it lists the runs
(a finished one, a queued one) and shows a finished run's page from the history after
its workers and their agent are gone."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import REPO

pytestmark = [pytest.mark.browser, pytest.mark.slow]


def test_a_finished_runs_page_renders_from_the_history_after_its_workers_are_gone(
        chromium: tuple[ModuleType, str], tmp_path: Path) -> None:
    sync_api, chromium_path = chromium
    coordinator = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                                 state_dir=str(tmp_path / "state"))).start()
    client = CoordinatorClient(coordinator.address)
    agent = subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "worker", "run", "--agent", "--coordinator",
         coordinator.address, "--host", "node-x", "--nproc-per-node", "2", "--metrics-port",
         "-1", "--output-dir", str(tmp_path / "agent"), "--quiet"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    dashboard = None
    try:
        done = client.submit_run(json.dumps({"num_workers": 2, "task": "digits",
                                             "iterations": 60}), name="history-run")
        deadline = time.monotonic() + 180
        while client.run_status(done.run_id).run.state == pb.RUN_STATE_RUNNING:
            assert time.monotonic() < deadline, "the run did not finish in 180 s"
            time.sleep(0.5)
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(60) == 0
        # Queued behind nothing (no agent now): it becomes the active run and waits.
        waiting = client.submit_run(json.dumps({"num_workers": 2, "task": "digits",
                                                "iterations": 60}), name="waiting-run")
        dashboard = DashboardServer(DashboardConfig(coordinator=coordinator.address,
                                                    port=0)).start()
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium_path, headless=True,
                                        args=["--no-sandbox"])
            try:
                page = browser.new_page()
                page.goto(dashboard.url)
                row = page.wait_for_selector(f"#runs tr[data-run-id='{done.run_id}']")
                assert row is not None and "finished" in row.inner_text()
                assert "history-run" in row.inner_text()
                waiting_row = page.wait_for_selector(
                    f"#runs tr[data-run-id='{waiting.run_id}']")
                assert waiting_row is not None and "running" in waiting_row.inner_text()
                page.click(f"#runs tr[data-run-id='{done.run_id}'] a")
                page.wait_for_url(f"**/runs/{done.run_id}")
                page.wait_for_function(
                    "document.querySelectorAll('#workers tbody tr').length === 2")
                header = page.inner_text("#run-info")
                assert "history-run" in header and "finished" in header, header
                assert "iteration budget reached" in header, header
                assert page.inner_text("#status-badge") == "finished"
                workers = page.inner_text("#workers tbody")
                assert workers.count("node-x") == 2 and "left" in workers, workers
                # The loss chart had points to draw (the history keeps the curve).
                points = page.evaluate(
                    f"fetch('/api/runs/{done.run_id}').then(r => r.json())"
                    ".then(s => s.loss_curve.length)")
                assert points > 0
                assert page.evaluate("fetch('/api/runs/nope').then(r => r.status)") == 404
            finally:
                browser.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
        if dashboard is not None:
            dashboard.stop()
        client.close()
        coordinator.stop()
