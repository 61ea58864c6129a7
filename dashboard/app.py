"""The dashboard: a FastAPI app that reads the coordinator over gRPC.

    GET /                   the live page (server-rendered HTML + vendored vanilla JS)
    GET /runs/{run_id}      one run's page: live, or from the history once it ended
    GET /api/status         the active run's current snapshot (see Snapshot)
    GET /api/runs           every run of the coordinator service, and its host agents
    GET /api/runs/{run_id}  one run's snapshot
    GET /api/workers/{id}   one worker
    GET /api/loss           the mean training-loss curve, optionally since a time
    GET /api/events         server-sent events: one `status` event per new snapshot
    GET /healthz            200 while serving (the coordinator may be down)
    GET /docs, /openapi.json
    GET, POST /login        the sign-in form, when the dashboard has a token (sign_in.py)
    POST /logout            sign out

Every response and event is encoded by view.to_json: strict JSON, a number that is not
finite served as null.

One poller per app asks the coordinator for its run status every `poll_interval_seconds`
(however many pages are open, the coordinator sees one reader). When the coordinator
cannot be reached the snapshot keeps the last known state with connected=false, and the
poller keeps trying: the page shows "disconnected" and recovers when it returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from typing import Annotated, Any
from urllib.parse import parse_qs

import grpc
from fastapi import FastAPI, HTTPException, Path, Query, Request
from fastapi.responses import (
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    RedirectResponse,
    Response,
    StreamingResponse,
)
from fastapi.staticfiles import StaticFiles

from ripples.client_security import ClientSecurity, tls_mismatch
from ripples.dashboard.config import DashboardConfig
from ripples.dashboard.models import LossPoint, RunList, Snapshot, WorkerView
from ripples.dashboard.sign_in import (
    SESSION_COOKIE,
    AttemptLimiter,
    RequestGuard,
    Sessions,
    retry_after,
    served_over_https,
)
from ripples.dashboard.view import RunView, disconnected, to_json
from ripples.guarded import guarded_loop
from ripples.http_server import HEAD_TIMEOUT_SECONDS
from ripples.http_tokens import HttpTokenGate, cookie_value, token_matches
from ripples.rpc import aio_channel, describe_rpc_error, tls_suspected
from ripples.run_records import agent_summary, summary
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


class StatusPoller:
    """Polls the coordinator; holds the latest snapshot and wakes SSE streams on change."""

    def __init__(self, config: DashboardConfig, security: ClientSecurity) -> None:
        self.config = config
        self.security = security
        self.view = RunView()
        self.snapshot: dict[str, Any] = disconnected(
            f"coordinator at {config.coordinator} not asked yet", None)
        self.version = 0
        self.runs: dict[str, Any] = {"connected": False, "error": "not asked yet", "runs": [],
                                     "agents": []}
        """The coordinator service's runs and agents, as last seen (/api/runs)."""
        self._changed = asyncio.Condition()
        self._channel: grpc.aio.Channel | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._channel = aio_channel(self.config.coordinator, self.security)
        await self.poll_once()
        # Guarded: an unexpected error in one poll (not an RPC error, which poll_once
        # turns into "disconnected") must not freeze the page on its last snapshot.
        self._task = asyncio.get_running_loop().create_task(guarded_loop(
            "dashboard-poller", self.poll_once, self.config.poll_interval_seconds))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        if self._channel is not None:
            await self._channel.close()

    @property
    def stub(self) -> pb_grpc.RunsStub:
        """The coordinator's Runs service (the dashboard reads runs only)."""
        assert self._channel is not None, "start() first"
        return pb_grpc.RunsStub(self._channel)

    async def poll_once(self) -> None:
        stub = self.stub
        try:
            status = await stub.GetRunStatus(pb.RunStatusRequest(),
                                             timeout=self.config.rpc_timeout_seconds)
            listing = await stub.ListRuns(pb.ListRunsRequest(),
                                          timeout=self.config.rpc_timeout_seconds)
            self.runs = {"connected": True, "error": "",
                         "runs": [summary(r) for r in listing.runs],
                         "agents": [agent_summary(a) for a in listing.agents]}
            snapshot = self.view.update(status, time.monotonic())
        except grpc.RpcError as err:
            was_connected = self.snapshot.get("connected")
            # TLS on one side only, or a certificate check that fails: say so, not
            # "unreachable" (a blocking probe: off the loop).
            mismatch = (await asyncio.to_thread(tls_mismatch, self.config.coordinator,
                                                self.security)
                        if tls_suspected(err.details()) else "")  # type: ignore[attr-defined]
            snapshot = disconnected(mismatch or describe_rpc_error(err, self.config.coordinator),
                                    self.snapshot if self.snapshot.get("run") else None)
            if was_connected:
                logger.warning("%s", snapshot["error"])
            self.runs = {**self.runs, "connected": False, "error": snapshot["error"]}
        snapshot["coordinator"] = self.config.coordinator
        snapshot["updated_at"] = time.time()
        async with self._changed:
            self.snapshot = snapshot
            self.version += 1
            self._changed.notify_all()

    async def wait_newer(self, version: int, timeout_seconds: float) -> bool:
        """Wait until a snapshot newer than `version` exists; False on timeout."""
        async with self._changed:
            try:
                await asyncio.wait_for(
                    self._changed.wait_for(lambda: self.version > version), timeout_seconds)
            except TimeoutError:
                return False
        return True


_LOGIN_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Ripples dashboard: sign in</title>
<link rel="stylesheet" href="/static/style.css"></head>
<body><main><h1>Ripples dashboard</h1>
<p>This dashboard asks for the run's token (or its read-only token).</p>{message}
<form method="post" action="/login"><label>Token <input name="token" type="password"
autocomplete="current-password" required autofocus></label> <button>Sign in</button></form>
</main></body></html>
"""
MAX_FORM_BYTES = 4096
"""The sign-in form's body at most (a token is a few dozen characters)."""


class StrictJSONResponse(JSONResponse):
    """Every JSON response of the dashboard, encoded by view.to_json (no NaN)."""

    def render(self, content: Any) -> bytes:
        return to_json(content).encode()


async def _form_token(request: Request) -> str | None:
    """The token field of the sign-in form; None when the body is over MAX_FORM_BYTES or
    not whole within HEAD_TIMEOUT_SECONDS (a body sent a byte at a time would otherwise
    hold one of the endpoint's few connections for as long as its sender likes)."""
    body = b""
    try:
        async with asyncio.timeout(HEAD_TIMEOUT_SECONDS):
            async for chunk in request.stream():
                body += chunk
                if len(body) > MAX_FORM_BYTES:
                    return None
    except TimeoutError:
        return None
    return parse_qs(body.decode("utf-8", "replace")).get("token", [""])[0].strip()


def _login_page(message: str, status_code: int, headers: dict[str, str] | None = None
                ) -> HTMLResponse:
    return HTMLResponse(_LOGIN_PAGE.format(message=f"<p role=alert>{message}</p>"),
                        status_code=status_code, headers=headers)


def create_app(config: DashboardConfig) -> FastAPI:
    # The token it reaches the coordinator with (may be a read-only one) is also the one a
    # viewer must show: a bearer header, or once on the login form for a session cookie.
    security = ClientSecurity.from_env()
    token = security.token
    poller = StatusPoller(config, security)
    sessions = Sessions(config.session_hours * 3600)
    attempts = AttemptLimiter(config.sign_in_attempts, config.sign_in_window_seconds)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await poller.start()
        try:
            yield
        finally:
            await poller.stop()

    app = FastAPI(title="Ripples dashboard", version="1",
                  description="Live view of a Ripples training run, read from its coordinator "
                              f"({config.coordinator}).", lifespan=lifespan,
                  default_response_class=StrictJSONResponse)
    app.state.poller = poller
    app.state.sessions = sessions
    app.add_middleware(HttpTokenGate, tokens=(token,), login_page=True,
                       open_prefixes=("/static/", "/logout"),
                       session=lambda cookies: sessions.valid(cookie_value(cookies,
                                                                           SESSION_COOKIE)))
    # Outermost: a foreign Host or Origin is refused before anything else looks at it.
    app.add_middleware(RequestGuard, allowed_hosts=config.host_names, listen_host=config.host)
    static = resources.files("ripples.dashboard").joinpath("static")
    app.mount("/static", StaticFiles(directory=str(static)), name="static")
    index_html = static.joinpath("index.html").read_text()  # read once, not per request

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> str:
        return index_html

    @app.get("/login", response_class=HTMLResponse, include_in_schema=False)
    async def login_form() -> Response:
        if not token:
            return RedirectResponse("/", status_code=303)
        return HTMLResponse(_LOGIN_PAGE.format(message=""))

    @app.post("/login", include_in_schema=False)
    async def login(request: Request) -> Response:
        if not token:
            return RedirectResponse("/", status_code=303)
        address = request.client.host if request.client else ""
        wait = attempts.take(address)
        if wait:
            return _login_page(f"Too many sign-in attempts from {address}: try again in "
                               f"{retry_after(wait)} s.", 429,
                               {"Retry-After": retry_after(wait)})
        given = await _form_token(request)
        if given is None:
            return _login_page(f"The sign-in form is over {MAX_FORM_BYTES} bytes, or was "
                               f"not sent within {HEAD_TIMEOUT_SECONDS:.0f} s.", 413)
        if not token_matches((token,), given):
            return _login_page("Wrong token.", 401)
        done = RedirectResponse("/", status_code=303)
        done.set_cookie(SESSION_COOKIE, sessions.open(), max_age=int(sessions.lifetime_seconds),
                        httponly=True, samesite="strict", secure=served_over_https(request))
        return done

    @app.post("/logout", include_in_schema=False)
    async def logout(request: Request) -> Response:
        sessions.close(cookie_value(request.headers.get("cookie", ""), SESSION_COOKIE))
        done = RedirectResponse("/login" if token else "/", status_code=303)
        done.delete_cookie(SESSION_COOKIE, httponly=True, samesite="strict",
                           secure=served_over_https(request))
        return done

    @app.get("/healthz", response_class=PlainTextResponse, include_in_schema=False)
    async def healthz() -> str:
        return "ok\n"

    @app.get("/runs/{run_id}", response_class=HTMLResponse, include_in_schema=False)
    async def run_page(run_id: str) -> str:
        return index_html  # the script reads the run id from the address

    @app.get("/api/status", response_model=Snapshot, summary="The active run as last seen")
    async def status() -> dict[str, Any]:
        return poller.snapshot

    @app.get("/api/runs", response_model=RunList,
             summary="Every run of the coordinator service (newest first) and its agents")
    async def runs() -> dict[str, Any]:
        return poller.runs

    @app.get("/api/runs/{run_id}", response_model=Snapshot,
             summary="One run: live while it runs, from the history once it ended",
             responses={404: {"description": "No such run"}})
    async def run(run_id: Annotated[str, Path(min_length=1, max_length=64)]
                  ) -> dict[str, Any]:
        try:
            found = await poller.stub.GetRunStatus(pb.RunStatusRequest(run_id=run_id),
                                                   timeout=config.rpc_timeout_seconds)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                raise HTTPException(404, err.details()) from None  # type: ignore[attr-defined]
            return disconnected(describe_rpc_error(err, config.coordinator), None) | {
                "coordinator": config.coordinator, "updated_at": time.time()}
        snapshot = RunView().update(found, time.monotonic())
        return {**snapshot, "coordinator": config.coordinator, "updated_at": time.time()}

    @app.get("/api/workers/{worker_id}", response_model=WorkerView, summary="One worker",
             responses={404: {"description": "No such worker in this run"}})
    async def worker(worker_id: Annotated[int, Path(ge=0, description="Worker id")]
                     ) -> dict[str, Any]:
        rows = poller.view.rows  # the last status's, kept while disconnected
        if worker_id in rows:
            return rows[worker_id]
        ids = sorted(rows)
        known = (", ".join(map(str, ids)) if len(ids) <= 16
                 else f"{len(ids):,} workers, ids {ids[0]} to {ids[-1]}") or "none yet"
        raise HTTPException(404, f"no worker {worker_id} in this run (known: {known})")

    @app.get("/api/loss", response_model=list[LossPoint], summary="Mean training loss curve")
    async def loss(
        since: Annotated[float, Query(ge=0, description="Only points after this many "
                                                         "seconds of training")] = 0.0,
        max_points: Annotated[int, Query(ge=2, le=10_000, description="Thin the curve to "
                                                                       "at most this many")] = 500,
    ) -> list[dict[str, Any]]:
        points = [p for p in poller.snapshot.get("loss_curve", []) if p["seconds"] >= since]
        if len(points) > max_points:
            step = len(points) / max_points
            points = [points[int(i * step)] for i in range(max_points - 1)] + [points[-1]]
        return points

    @app.get("/api/events", summary="Server-sent events: a `status` event per new snapshot",
             response_class=StreamingResponse,
             responses={200: {"content": {"text/event-stream": {}}}})
    async def events(request: Request) -> StreamingResponse:
        async def stream() -> AsyncIterator[str]:
            version = -1
            yield "retry: 2000\n\n"  # the browser reconnects after 2 s if the dashboard restarts
            while not await request.is_disconnected():
                if poller.version > version:
                    version = poller.version
                    data = to_json(poller.snapshot)
                    yield f"event: status\nid: {version}\ndata: {data}\n\n"
                elif not await poller.wait_newer(version, 15.0):
                    yield ": keepalive\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache",
                                          "X-Accel-Buffering": "no"})

    return app
