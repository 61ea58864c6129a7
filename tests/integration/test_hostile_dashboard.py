"""Hostile input to the dashboard, each case replayed against a real coordinator
and a real dashboard on loopback: a worker's NaN reaches no viewer, and the sign-in keeps
the token out of its cookie, limits guesses and refuses other sites and host names.
Each case asserts the refusal and that nothing changed (no cookie set, no session made)."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from helpers import running_coordinator
from jsonschema import Draft202012Validator

from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.server import DashboardServer
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

TOKEN = "hostile-dashboard-test-token"  # noqa: S105 (made for the test)
ATTEMPTS = 3


def _strict(text: str | bytes) -> Any:
    """JSON as a browser parses it: NaN and Infinity are errors."""
    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")
    return json.loads(text, parse_constant=refuse)


class Client:
    """Raw HTTP to the dashboard, from a chosen loopback address, with chosen headers."""

    def __init__(self, port: int, source: str = "127.0.0.1") -> None:
        self.port = port
        self.source = source

    def request(self, method: str, path: str, body: str = "", **headers: str
                ) -> tuple[int, dict[str, str], str]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10,
                                          source_address=(self.source, 0))
        try:
            sent = {"Content-Type": "application/x-www-form-urlencoded",
                    **{k.replace("_", "-"): v for k, v in headers.items()}}
            conn.request(method, path, body.encode() if body else None, sent)
            reply = conn.getresponse()
            return (reply.status, {k.lower(): v for k, v in reply.getheaders()},
                    reply.read().decode())
        finally:
            conn.close()

    def sign_in(self, token: str, **headers: str) -> tuple[int, dict[str, str], str]:
        return self.request("POST", "/login", f"token={token}", **headers)


# ---------------------------------------------------------------------------- NaN
def test_a_workers_nan_heartbeat_leaves_every_view_strict_json() -> None:
    with running_coordinator(num_workers=2, task="digits", lease_seconds=600.0) as server:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            wid = stub.Register(pb.RegisterRequest(host="bad-numbers", local_rank=0,
                                                   device="cpu", pid=1), timeout=10).worker_id
            nan, inf = float("nan"), float("inf")
            stub.Heartbeat(pb.HeartbeatRequest(worker_id=wid, progress=pb.Progress(
                iteration=3, loss=nan, compute_seconds=nan, wait_seconds=inf,
                preduce_seconds=-inf, collective_wait_seconds=nan)), timeout=10)
        dash = DashboardServer(DashboardConfig(coordinator=server.address, port=0,
                                               poll_interval_seconds=0.1)).start()
        try:
            client = Client(dash.port)
            # The event stream: its status events parse as strict JSON.
            conn = http.client.HTTPConnection("127.0.0.1", dash.port, timeout=10)
            conn.request("GET", "/api/events")
            stream = conn.getresponse()
            events: list[dict[str, Any]] = []
            while len(events) < 2:
                line = stream.readline().decode()
                assert line, "the event stream ended"
                if line.startswith("data: "):
                    events.append(_strict(line.removeprefix("data: ")))
            conn.close()
            row = next(w for w in events[-1]["workers"] if w["worker_id"] == wid)
            # The coordinator reports a loss that is not finite as none (0), and counts such
            # a duration as 0 (defence in depth; the dashboard's own guard: test_dashboard_view).
            assert row["iteration"] == 3 and row["loss"] == 0.0
            assert (row["compute_seconds"], row["wait_seconds"], row["preduce_seconds"]) == (
                0.0, 0.0, 0.0)
            # The API: strict JSON that matches its own schema.
            _, _, schema_text = client.request("GET", "/openapi.json")
            components = _strict(schema_text)["components"]
            for path, schema in (("/api/status", "Snapshot"), (f"/api/workers/{wid}", "WorkerView"),
                                 ("/api/runs", "RunList")):
                code, _, body = client.request("GET", path)
                assert code == 200, (path, body)
                Draft202012Validator({"$ref": f"#/components/schemas/{schema}",
                                      "components": components}).validate(_strict(body))
        finally:
            dash.stop()


# ---------------------------------------------------------------------------- sign-in
@pytest.fixture
def signed_dashboard(monkeypatch: pytest.MonkeyPatch) -> Iterator[DashboardServer]:
    """A dashboard with a token, 3 sign-in attempts per hour, and a proxy's name allowed."""
    monkeypatch.setenv("RIPPLES_TOKEN", TOKEN)
    with running_coordinator(num_workers=2, task="digits") as server:
        # The dashboard reads the coordinator with the same token; this one has none and
        # takes it anyway: the sign-in is the dashboard's own.
        dash = DashboardServer(DashboardConfig(
            coordinator=server.address, port=0, allowed_hosts="dash.example",
            sign_in_attempts=ATTEMPTS, sign_in_window_seconds=3600)).start()
        try:
            yield dash
        finally:
            dash.stop()


def _sessions(dash: DashboardServer) -> int:
    return len(dash.app.state.sessions)


def test_the_cookie_holds_a_session_id_never_the_token(signed_dashboard: DashboardServer) -> None:
    dash = signed_dashboard
    client = Client(dash.port)
    origin = f"http://127.0.0.1:{dash.port}"
    code, headers, _ = client.sign_in(TOKEN, Origin=origin)
    assert code == 303 and headers["location"] == "/"
    cookie = headers["set-cookie"]
    assert TOKEN not in cookie and cookie.startswith("ripples_session=")
    assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Max-Age=43200" in cookie
    session = cookie.split(";")[0]
    assert client.request("GET", "/api/status", Cookie=session)[0] == 200
    assert client.request("GET", "/api/status", Authorization=f"Bearer {TOKEN}")[0] == 200
    # The token in a cookie (the old scheme, or a forged session) opens nothing.
    for forged in (f"ripples_session={TOKEN}", f"ripples_token={TOKEN}"):
        assert client.request("GET", "/api/status", Cookie=forged)[0] == 401
    # Signing out ends the session: the same cookie no longer opens the page.
    code, headers, _ = client.request("POST", "/logout", Cookie=session, Origin=origin)
    assert code == 303 and 'ripples_session=""' in headers["set-cookie"]
    assert client.request("GET", "/api/status", Cookie=session)[0] == 401
    assert _sessions(dash) == 0


def test_sign_in_guesses_are_limited_per_client_address(
        signed_dashboard: DashboardServer) -> None:
    dash = signed_dashboard
    guesser = Client(dash.port)
    for i in range(ATTEMPTS):  # a rotated X-Forwarded-For does not make a new address
        code, headers, body = guesser.sign_in("a-guess", **{"X-Forwarded-For": f"10.0.0.{i}"})
        assert code == 401 and "Wrong token" in body and "set-cookie" not in headers
    # Past the limit even the right token is refused, with no session made.
    code, headers, body = guesser.sign_in(TOKEN)
    assert code == 429 and "set-cookie" not in headers
    assert 1000 < int(headers["retry-after"]) <= 1200  # one attempt back per 1200 s
    assert "Too many sign-in attempts from 127.0.0.1: try again in" in body
    assert _sessions(dash) == 0
    # The limit is the guesser's: another address signs in.
    code, headers, _ = Client(dash.port, source="127.0.0.2").sign_in(TOKEN)
    assert code == 303 and "ripples_session=" in headers["set-cookie"]


@pytest.mark.parametrize(("headers", "code", "message"), [
    ({"Origin": "http://evil.example"}, 403,
     "cross-site request refused: it comes from 'http://evil.example'"),
    ({"Origin": "null"}, 403, "cross-site request refused: it comes from 'null'"),
    ({"Origin": "http://127.0.0.1:1"}, 403, "not from this dashboard's page"),
    ({"Host": "evil.example:8080", "Origin": "http://evil.example:8080"}, 400,
     "does not serve the host name 'evil.example': if that is how viewers reach it (a proxy, "
     "a DNS name), start it with --allowed-hosts evil.example"),
])
def test_a_sign_in_from_another_site_or_host_name_is_refused(
        signed_dashboard: DashboardServer, headers: dict[str, str], code: int, message: str
) -> None:
    dash = signed_dashboard
    client = Client(dash.port)
    got, reply, body = client.sign_in(TOKEN, **headers)
    assert (got, message in body, "set-cookie" in reply) == (code, True, False), body
    assert _sessions(dash) == 0
    # Refused before it counts: the right attempts are all left.
    for _ in range(ATTEMPTS):
        assert client.sign_in(TOKEN)[0] == 303  # no Origin: a script, not a browser


def test_a_rebound_host_name_reads_nothing(signed_dashboard: DashboardServer) -> None:
    """DNS rebinding: a foreign name pointed at this address gets no data, even with the
    token; the allowed proxy name and an IP address do."""
    client = Client(signed_dashboard.port)
    bearer = f"Bearer {TOKEN}"
    code, _, body = client.request("GET", "/api/status", Host="evil.example",
                                   Authorization=bearer)
    assert code == 400 and "--allowed-hosts evil.example" in body
    for host in ("dash.example", "DASH.example:443", f"127.0.0.1:{signed_dashboard.port}",
                 "[::1]:80", "localhost"):
        assert client.request("GET", "/api/status", Host=host, Authorization=bearer)[0] == 200
    code, headers, _ = client.sign_in(TOKEN, Host="dash.example", Origin="https://dash.example")
    assert code == 303 and "ripples_session=" in headers["set-cookie"]


def test_an_oversized_sign_in_form_is_refused(signed_dashboard: DashboardServer) -> None:
    code, headers, body = Client(signed_dashboard.port).sign_in(TOKEN + "&pad=" + "x" * 10_000)
    assert code == 413 and "over 4096 bytes" in body and "set-cookie" not in headers
    assert _sessions(signed_dashboard) == 0

