"""Runs the coordinator: the gRPC service plus the data plane's rendezvous store.

`serve(config)` blocks until a signal (the `ripples coordinator serve` entry point);
`CoordinatorServer` runs the same thing on a background thread (embedded `ripples run`,
tests).
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from ripples.coordinator import snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore
from ripples.coordinator.http import build_app
from ripples.coordinator.service import CoordinatorService
from ripples.coordinator.state_store import StateStore
from ripples.http_server import HttpEndpoint, bind
from ripples.loop_thread import LoopThreadService, serve_until_signal
from ripples.rpc import SERVER_OPTIONS
from ripples.security import SERVICE, HttpTokenGate, ServerSecurity
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)



@dataclass(kw_only=True)
class ServerConfig:
    """Where the coordinator listens."""

    host: str = "0.0.0.0"
    """Interface for the gRPC service and the rendezvous store."""
    port: int = 50051
    """gRPC port (0: pick a free one)."""
    store_port: int = 0
    """Rendezvous TCPStore port (0: pick a free one)."""
    metrics_port: int = 0
    """HTTP port for /metrics and Prometheus service discovery at /sd (0: pick a free one;
    `ripples coordinator serve` defaults to 9400)."""
    advertise_host: str = ""
    """Address workers use to reach the store (default: this host's name, or 127.0.0.1
    when listening on loopback)."""
    run: RunSettings = field(default_factory=RunSettings)
    exit_when_done: bool = False
    """serve(): return once the run stopped and every worker left."""
    state_dir: str = ""
    """Keep the run's state here (SQLite); a coordinator started again on the same dir
    resumes the run it holds (its settings win over `run`)."""
    resume_workers: bool = False
    """With a state dir that holds a run: its workers are gone too (a total failure); a
    new set registers and continues their ranks (`ripples run --resume`)."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS and tokens of the gRPC service (ripples/security.py; default: neither)."""


class Health:
    """gRPC health checking (grpc.health.v1): SERVING for the whole server ("") and for
    the coordinator's service while it serves, NOT_SERVING once it stops. Probes
    (Kubernetes' grpc probe, grpc_health_probe) need no token (ripples/security.py)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        from grpc_health.v1 import health, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.services = ("", SERVICE)
        # Server reflection: `grpcurl` lists and calls the API (with the token).
        reflection.enable_server_reflection(
            (SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    async def set_serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.services:
            await self._servicer.set(name, status)


def _advertised(config: ServerConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    return socket.gethostname()


class CoordinatorServer(LoopThreadService):
    """The coordinator on its own event loop thread. Use start() / stop()."""

    thread_name = "coordinator"

    def __init__(self, config: ServerConfig) -> None:
        super().__init__()
        self.config = config
        self.port = 0
        self.store_port = 0
        self.metrics_port = 0
        self.service: CoordinatorService | None = None
        self._store: object | None = None

    async def _main(self) -> None:
        import torch.distributed as dist  # heavy import, only when serving

        cfg = self.config
        state = StateStore(cfg.state_dir) if cfg.state_dir else None
        # The same store port after a restart: the workers reconnect where it was (new
        # workers of a resumed run learn it when they register).
        reuse = state is not None and not cfg.resume_workers
        store_port = cfg.store_port or (state.store_port if reuse else 0)  # type: ignore[union-attr]
        try:
            self._store = dist.TCPStore(cfg.host, store_port, is_master=True,
                                        wait_for_workers=False, use_libuv=True)
        except (RuntimeError, OSError) as err:
            raise OSError(f"cannot open the rendezvous store on {cfg.host}:{store_port}: "
                          f"{err}; pick another --store-port") from err
        self.store_port = self._store.port  # type: ignore[attr-defined]
        core, incarnation, saved = self._core(state)
        if state is not None:
            state.store_port = self.store_port
        self.service = CoordinatorService(core, store_host=_advertised(cfg),
                                          store_port=self.store_port, state=state,
                                          incarnation=incarnation, store=self._store)
        if saved is not None:
            self.service.metrics_targets = {int(k): v for k, v in
                                            saved.get("metrics_targets", {}).items()}
            self.service._note_run_state()
        server = grpc.aio.server(options=SERVER_OPTIONS,
                                 interceptors=cfg.security.interceptors())
        pb_grpc.add_CoordinatorServicer_to_server(self.service, server)
        health = Health(server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        credentials = cfg.security.credentials()
        try:
            self.port = (server.add_secure_port(address, credentials) if credentials
                         else server.add_insecure_port(address))
        except RuntimeError as err:
            raise OSError(f"cannot listen on {address}: {err}; is the port in use?") from err
        metrics_socket = bind(cfg.host, cfg.metrics_port, what="metrics",
                              option="--metrics-port")
        await server.start()
        app = build_app(self.service.metrics.registry, self.service.discovery)
        http = HttpEndpoint(HttpTokenGate(app, (cfg.security.token, cfg.security.read_token)),
                            metrics_socket, what="metrics endpoint")
        self.metrics_port = http.port
        self.service.metrics_address = f"{_advertised(cfg)}:{http.port}"
        await http.start()
        self.service.start_background()
        await health.set_serving(True)
        logger.info("coordinator listening on %s:%d (%s; store %d, metrics %d), protocol %s, "
                    "%d workers", cfg.host, self.port, cfg.security.describe(),
                    self.store_port, self.metrics_port, cfg.run.protocol, cfg.run.num_workers)
        try:
            await self._until_stopped()
        finally:
            await health.set_serving(False)
            await self.service.close()
            await http.stop()
            await server.stop(grace=1.0)

    def _core(self, state: StateStore | None) -> tuple[
            CoordinatorCore, int, dict[str, Any] | None]:
        """A new run's core, or the state dir's run resumed. Returns (core, incarnation,
        the saved state it resumed, if any)."""
        now = time.monotonic()
        if state is None:
            return CoordinatorCore(self.config.run, now=now), 1, None
        incarnation = state.next_incarnation()
        saved = state.load()
        if saved is None:
            return CoordinatorCore(self.config.run, now=now), incarnation, None
        core = snapshot.restore(saved, now, incarnation, wall=time.time(),
                                resume=self.config.resume_workers)
        self.config.run = core.settings
        live = len(core.live())
        logger.warning("resumed run %s from %s (incarnation %d): %d live workers, %.0f "
                       "mean iterations%s", core.settings.run_id, state.path, incarnation,
                       live, core.mean_iterations(),
                       f"; stopped: {core.stop_reason}" if core.stopped else "")
        return core, incarnation, saved

    def run_finished(self) -> bool:
        """True once the run stopped and no worker is still live."""
        svc = self.service
        return svc is not None and svc.core.stopped and not svc.core.live()

    @property
    def address(self) -> str:
        host = _advertised(self.config)
        return f"{host}:{self.port}"

    @property
    def metrics_address(self) -> str:
        return f"{_advertised(self.config)}:{self.metrics_port}"


def serve(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (or, with exit_when_done, until the run is over)."""
    server = CoordinatorServer(config).start()
    print(f"ripples coordinator listening on {server.address} "
          f"(protocol {config.run.protocol}, waiting for {config.run.num_workers} workers); "
          f"metrics and Prometheus discovery on http://{server.metrics_address}/sd",
          flush=True)
    return serve_until_signal(
        server, lambda: config.exit_when_done and server.run_finished())
