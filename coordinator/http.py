"""The coordinator's HTTP side: Prometheus metrics and service discovery.

    GET /metrics    the coordinator's own metrics (text exposition format)
    GET /sd         Prometheus HTTP service discovery: the coordinator and every live
                    worker's metrics endpoint, so a scrape config needs one address
    GET /healthz    200 while serving

Served by uvicorn on the coordinator's own event loop (the only place the core is
touched), so a scrape reads the core without locks.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

# One target group per worker: Prometheus copies `labels` onto every series it scrapes
# from the group's targets. `role` separates coordinator and worker endpoints; the
# __meta_ labels are there for relabelling and vanish after it.
SdTargets = list[dict[str, object]]


def build_app(registry: Callable[[], CollectorRegistry | None],
              discovery: Callable[[], SdTargets]) -> Starlette:
    """`registry()`: the active run's metrics (None: no run is active, nothing to show)."""

    async def metrics(_: Request) -> Response:
        current = registry()
        body = generate_latest(current) if current is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def sd(_: Request) -> Response:
        return JSONResponse(discovery())

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok\n")

    return Starlette(routes=[
        Route("/metrics", metrics, methods=["GET"]),
        Route("/sd", sd, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ])
