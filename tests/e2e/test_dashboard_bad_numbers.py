"""A worker's NaN in a real headless Chromium: a heartbeat whose durations
are NaN and infinite, sent over raw gRPC, must not freeze the page at "connecting": it
shows the run live, the bad numbers as dashes, and no script error."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import grpc
import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.browser, pytest.mark.slow]


@pytest.fixture
def run_with_bad_numbers() -> Iterator[str]:
    coordinator = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=RunSettings.build(
        num_workers=2, task="digits", lease_seconds=600.0))).start()
    dashboard = None
    try:
        with grpc.insecure_channel(f"127.0.0.1:{coordinator.port}") as channel:
            stub = pb_grpc.WorkerStub(channel)
            wid = stub.Register(pb.RegisterRequest(host="bad-numbers", local_rank=0,
                                                   device="cpu", pid=1), timeout=10).worker_id
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=wid, progress=pb.Progress(
                iteration=5, loss=float("nan"), compute_seconds=float("nan"),
                wait_seconds=float("inf"), preduce_seconds=float("-inf"))), timeout=10)
        dashboard = DashboardServer(DashboardConfig(
            coordinator=f"127.0.0.1:{coordinator.port}", port=0)).start()
        yield dashboard.url
    finally:
        if dashboard is not None:
            dashboard.stop()
        coordinator.stop()


def test_a_workers_nan_leaves_the_page_live(chromium: tuple[ModuleType, str],
                                            run_with_bad_numbers: str) -> None:
    sync_api, chromium_path = chromium
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, headless=True,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda err: errors.append(str(err)))
            page.goto(run_with_bad_numbers)
            page.wait_for_function(
                "document.getElementById('status-badge').textContent === 'live'",
                timeout=30_000)
            row = page.wait_for_selector("#workers tbody tr", timeout=30_000)
            assert row is not None
            cells = row.inner_text()
            assert "bad-numbers/0" in cells and "5" in cells
            assert errors == []
        finally:
            browser.close()
