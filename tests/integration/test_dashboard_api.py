"""The dashboard's JSON API against a real coordinator: OpenAPI schema, bad input,
server-sent events, and a coordinator that goes away and comes back."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from helpers import running_coordinator, start_worker
from jsonschema import Draft202012Validator

from ripples.coordinator.config import RunSettings
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer


def _request(url: str, method: str = "GET") -> tuple[int, Any]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read() or b"null")


def _validator(base: str, schema_name: str) -> Draft202012Validator:
    _, doc = _request(base + "openapi.json")
    return Draft202012Validator({"$ref": f"#/components/schemas/{schema_name}",
                                 "components": doc["components"]})


def _wait_for(predicate: Any, base: str, what: str, timeout_seconds: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_seconds
    while True:
        _, snapshot = _request(base + "api/status")
        if predicate(snapshot):
            return snapshot  # type: ignore[no-any-return]
        assert time.monotonic() < deadline, f"timed out waiting for {what}: {snapshot}"
        time.sleep(0.1)


@pytest.fixture
def dashboard_of_idle_run() -> Iterator[str]:
    with running_coordinator(num_workers=2, task="digits") as server:
        dash = DashboardServer(DashboardConfig(coordinator=server.address, port=0,
                                               poll_interval_seconds=0.1)).start()
        try:
            yield dash.url
        finally:
            dash.stop()


def test_status_matches_its_openapi_schema(dashboard_of_idle_run: str) -> None:
    base = dashboard_of_idle_run
    code, snapshot = _request(base + "api/status")
    assert code == 200
    _validator(base, "Snapshot").validate(snapshot)
    assert snapshot["connected"] is True
    assert snapshot["run"]["started"] is False and snapshot["workers"] == []
    with urllib.request.urlopen(base, timeout=5) as page:
        html = page.read().decode()
    assert "/static/app.js" in html and "cdn" not in html.lower()
    with urllib.request.urlopen(base + "static/app.js", timeout=5) as script:
        assert b"EventSource" in script.read()


@pytest.mark.parametrize(("path", "method", "code", "message"), [
    ("api/workers/abc", "GET", 422, "valid integer"),
    ("api/workers/-1", "GET", 422, "greater than or equal to 0"),
    ("api/workers/7", "GET", 404, "no worker 7 in this run"),
    ("api/loss?since=-1", "GET", 422, "greater than or equal to 0"),
    ("api/loss?since=soon", "GET", 422, "valid number"),
    ("api/loss?max_points=1", "GET", 422, "greater than or equal to 2"),
    ("api/loss?max_points=100000", "GET", 422, "less than or equal to 10000"),
    ("api/status", "POST", 405, "Method Not Allowed"),
    ("api/nothing-here", "GET", 404, "Not Found"),
])
def test_bad_requests_get_a_4xx_with_a_clear_message(dashboard_of_idle_run: str, path: str,
                                                     method: str, code: int, message: str
                                                     ) -> None:
    base = dashboard_of_idle_run
    got, body = _request(base + path, method)
    assert got == code
    assert message in json.dumps(body)
    if code == 422:  # FastAPI's documented validation-error shape
        _validator(base, "HTTPValidationError").validate(body)


@pytest.mark.slow
def test_live_run_through_the_api_and_its_event_stream() -> None:
    with running_coordinator(protocol="ripples-smart", num_workers=3, group_size=2,
                             task="digits", iterations=1_000_000) as server:
        procs = [start_worker(server.address, "--host", "nodeA", "--local-rank", str(i),
                              "--metrics-port", "-1") for i in range(3)]
        dash = DashboardServer(DashboardConfig(coordinator=server.address, port=0,
                                               poll_interval_seconds=0.1)).start()
        base = dash.url
        try:
            snapshot = _wait_for(lambda s: len(s["workers"]) == 3 and s["run"]["groups_formed"]
                                 > 20 and len(s["loss_curve"]) > 5, base, "a running run")
            _validator(base, "Snapshot").validate(snapshot)
            assert {w["host"] for w in snapshot["workers"]} == {"nodeA"}
            assert [h["host"] for h in snapshot["hosts"]] == ["nodeA"]
            assert sorted(snapshot["hosts"][0]["worker_ids"]) == sorted(
                w["worker_id"] for w in snapshot["workers"])
            assert snapshot["edges"] and all(0 <= e["weight"] <= 1 for e in snapshot["edges"])
            assert snapshot["recent_groups"]
            wid = snapshot["workers"][1]["worker_id"]
            code, worker = _request(base + f"api/workers/{wid}")
            assert code == 200 and worker["worker_id"] == wid
            _validator(base, "WorkerView").validate(worker)
            code, curve = _request(base + "api/loss?max_points=3")
            assert code == 200 and len(curve) == 3
            _, full = _request(base + "api/loss")
            assert curve[0] == full[0] and curve[-1]["seconds"] <= full[-1]["seconds"]
            _, later = _request(base + f"api/loss?since={full[-1]['seconds']}")
            assert all(p["seconds"] >= full[-1]["seconds"] for p in later)
            events = _read_events(base + "api/events", count=3, timeout_seconds=10)
            assert len(events) == 3
            assert all(e["connected"] for e in events)
            assert events[-1]["updated_at"] > events[0]["updated_at"]
        finally:
            dash.stop()
            from ripples.worker.client import CoordinatorClient

            client = CoordinatorClient(server.address)
            client.stop_run("test over")
            client.close()
            for p in procs:
                p.wait(timeout=30)


def _read_events(url: str, count: int, timeout_seconds: float) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_seconds
    with urllib.request.urlopen(url, timeout=timeout_seconds) as stream:
        assert stream.headers["Content-Type"].startswith("text/event-stream")
        kind = ""
        while len(events) < count and time.monotonic() < deadline:
            line = stream.readline().decode().rstrip("\n")
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: ") and kind == "status":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def test_a_coordinator_that_goes_away_shows_disconnected_and_recovers() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    def coordinator() -> CoordinatorServer:
        return CoordinatorServer(ServerConfig(host="127.0.0.1", port=port,
                                              run=RunSettings(num_workers=2))).start()

    first = coordinator()
    dash = DashboardServer(DashboardConfig(coordinator=f"127.0.0.1:{port}", port=0,
                                           poll_interval_seconds=0.1,
                                           rpc_timeout_seconds=0.5)).start()
    base = dash.url
    try:
        before = _wait_for(lambda s: s["connected"], base, "the first connection")
        first.stop()
        down = _wait_for(lambda s: not s["connected"], base, "the disconnection", 15)
        assert f"coordinator at 127.0.0.1:{port} is unreachable" in down["error"]
        assert down["run"]["run_id"] == before["run"]["run_id"]  # the last known state stays
        second = coordinator()
        try:
            back = _wait_for(lambda s: s["connected"], base, "the reconnection", 15)
            assert back["run"]["run_id"] != before["run"]["run_id"]
            assert back["error"] == ""
        finally:
            second.stop()
    finally:
        dash.stop()
        first.stop()
