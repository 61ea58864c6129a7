"""The dashboard of a 1,000-worker run in a real headless Chromium: a real coordinator
with 1,000 workers registered and reporting progress over gRPC, the real dashboard
polling it. Past MAX_WORKER_DETAIL workers the page draws hosts, not workers, lists a
bounded table with a note, and the snapshot stays small."""

from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import grpc
import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.dashboard.view import MAX_WORKER_DETAIL
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

pytestmark = [pytest.mark.browser, pytest.mark.slow]

WORKERS, PER_HOST = 1000, 8
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def big_run() -> Iterator[str]:
    # A lease longer than the test: these workers report once, they do not heartbeat.
    coordinator = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=RunSettings.build(
        protocol="ripples-smart", num_workers=WORKERS, workers_per_node=PER_HOST,
        task="digits", lease_seconds=600.0)))
    coordinator.start()
    address = f"127.0.0.1:{coordinator.port}"
    dashboard = None
    try:
        with grpc.insecure_channel(address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            for r in range(WORKERS):
                reply = stub.Register(pb.RegisterRequest(
                    host=f"node{r // PER_HOST:03d}", local_rank=r % PER_HOST, device="cpu",
                    pid=10_000 + r), timeout=10)
                stub.Heartbeat(pb.HeartbeatRequest(worker_id=reply.worker_id, progress=pb.Progress(
                    iteration=1 + r % 5, loss=2.0 - r / WORKERS)), timeout=10)
        dashboard = DashboardServer(DashboardConfig(coordinator=address, port=0)).start()
        yield dashboard.url
    finally:
        if dashboard is not None:
            dashboard.stop()
        coordinator.stop()


def test_a_thousand_workers_are_drawn_by_host_in_a_bounded_page(
        chromium: tuple[ModuleType, str], big_run: str) -> None:
    sync_api, chromium_path = chromium
    url = big_run
    with urllib.request.urlopen(url + "api/status", timeout=10) as reply:
        body = reply.read()
    snapshot = json.loads(body)
    assert snapshot["workers_total"] == WORKERS and snapshot["topology"]["mode"] == "hosts"
    assert len(body) < 64_000, f"the snapshot of {WORKERS} workers is {len(body):,} bytes"
    with urllib.request.urlopen(url + "api/workers/999", timeout=10) as reply:
        assert json.loads(reply.read())["host"] == "node124"  # not listed, still served
    artifacts = Path(os.environ.get("RIPPLES_TEST_ARTIFACTS", REPO / "test-artifacts"))
    artifacts.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium_path, headless=True,
                                    args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            started = time.monotonic()
            page.goto(url)
            page.wait_for_function(
                "document.querySelectorAll('#topology-svg g.host-node').length === "
                f"{WORKERS // PER_HOST}", timeout=30_000)
            shown_after = time.monotonic() - started
            rows = page.locator("#workers tbody tr")
            assert rows.count() == MAX_WORKER_DETAIL
            assert page.locator("#workers-note").inner_text().startswith(
                f"{MAX_WORKER_DETAIL} of 1,000 workers listed")
            assert f"{WORKERS}/{WORKERS} workers" in page.locator("#run-info").inner_text()
            assert "1,000 workers drawn by host (125 nodes)" in (page.locator(
                "#topology-svg .edges-note").text_content() or "")
            # Each node says how many of its workers are live (its tooltip says more).
            node = page.locator("#topology-svg g.host-node").first
            assert [t.text_content() for t in node.locator("text").all()] == ["node000", "8/8"]
            assert (node.locator("title").text_content() or "").startswith(
                "node000: 8/8 workers live, 0 slow")
            assert page.locator("#topology-svg g.worker").count() == 0
            # Re-rendering a snapshot takes a fraction of the poll interval.
            render_ms = page.evaluate(
                "() => { const t = performance.now(); render(lastSnapshot); "
                "return performance.now() - t; }")
            page.screenshot(path=str(artifacts / "dashboard-1000-workers.png"), full_page=True)
        finally:
            browser.close()
    assert shown_after < 30 and render_ms < 250, (shown_after, render_ms)
