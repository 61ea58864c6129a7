"""Runs the coordinator: its gRPC services plus the data plane's rendezvous store.

One gRPC server carries the three ripples.v1 services (proto/ripples/v1/coordinator.proto):
Worker (coordinator/worker_gateway.py: every call goes to the active run's
coordinator/service.py), Runs (coordinator/runs.py) and Agents (coordinator/agents.py),
over one run queue (coordinator/run_queue.py); beside them gRPC health checking and
server reflection, and an HTTP endpoint for /metrics and Prometheus discovery.

`serve(config)` blocks until a signal (the `ripples coordinator serve` entry point);
`CoordinatorServer` runs the same thing on a background thread (embedded `ripples run`,
tests).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import dataclass, field

import grpc

from ripples import events
from ripples.coordinator.agents import AgentsService
from ripples.coordinator.config import RunSettings
from ripples.coordinator.history import RunHistory
from ripples.coordinator.http import build_app
from ripples.coordinator.logs import RunLogs
from ripples.coordinator.run_queue import RunQueue
from ripples.coordinator.runs import RunsService
from ripples.coordinator.service import CoordinatorService
from ripples.coordinator.state_dir import StateDirLock, check_active_run, check_history
from ripples.coordinator.worker_gateway import WorkerGateway
from ripples.http_server import HttpEndpoint, bind
from ripples.http_tokens import HttpTokenGate
from ripples.loop_thread import LoopThreadService, serve_until_signal
from ripples.netshape import entered
from ripples.rpc import SERVER_OPTIONS
from ripples.security import SERVICES
from ripples.server_security import ServerSecurity
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
    run: RunSettings | None = field(default_factory=RunSettings)
    """A run to submit at the start (the one-run form), unless the state dir holds runs
    already; None: start with no run (`ripples submit` adds them)."""
    exit_when_done: bool = False
    """serve(): return once every run submitted has ended and its workers left."""
    state_dir: str = ""
    """Keep the runs here (SQLite: history.db, runs/<id>/); a coordinator started again
    on the same dir resumes the active run (its saved settings win over `run`) and the
    queue."""
    resume_workers: bool = False
    """With a state dir that holds a run: its workers are gone too (a total failure); a
    new set registers and continues their ranks (`ripples run --resume`)."""
    security: ServerSecurity = field(default_factory=ServerSecurity)
    """TLS and tokens of the gRPC service (ripples/server_security.py; default: neither)."""
    netns: str = ""
    """Serve workers that live in this network namespace (a name `ip netns` lists, e.g. a
    shaped cluster's hub, ripples/netshape.py): the gRPC service and the rendezvous store
    listen on `host` inside it, and the gRPC service and the metrics endpoint also on
    127.0.0.1 in this process's own namespace, for local tools (`local_address`)."""


class Health:
    """gRPC health checking (grpc.health.v1): SERVING for the whole server ("") and for
    each of the coordinator's services while it serves, NOT_SERVING once it stops.
    Probes (Kubernetes' grpc probe, grpc_health_probe) need no token
    (ripples/server_security.py)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        from grpc_health.v1 import health, health_pb2_grpc
        from grpc_reflection.v1alpha import reflection

        self._servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
        self.services = ("", *SERVICES)
        # Server reflection: `grpcurl` lists and calls the API (with the token).
        reflection.enable_server_reflection(
            (*SERVICES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)

    async def set_serving(self, serving: bool) -> None:
        from grpc_health.v1 import health_pb2

        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in self.services:
            await self._servicer.set(name, status)


def _advertised(config: ServerConfig) -> str:
    if config.advertise_host:
        return config.advertise_host
    if config.netns:  # an address inside the namespace: no name resolves to it
        return config.host
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
        self.local_port = 0
        """With `netns`: the gRPC port on 127.0.0.1 in this process's namespace."""
        self.store_port = 0
        self.metrics_port = 0
        self.queue: RunQueue | None = None
        self._store: object | None = None
        self._lock: StateDirLock | None = None

    async def _main(self) -> None:
        cfg = self.config
        if cfg.state_dir:  # one coordinator per dir (coordinator/state_dir.py)
            self._lock = StateDirLock(cfg.state_dir).acquire()
        try:
            if cfg.state_dir:  # never a silent start from zero on a dir that lost its store
                check_history(cfg.state_dir)
            await self._serve()
        finally:
            if self._lock is not None:
                self._lock.release()
                self._lock = None

    async def _serve(self) -> None:
        """Serve (under the state dir's lock, if there is one) until stopped."""
        import torch.distributed as dist  # heavy import, only when serving

        cfg = self.config
        if cfg.netns and not os.path.exists(f"/run/netns/{cfg.netns}"):
            raise OSError(f"no network namespace {cfg.netns!r} (`ip netns list` shows "
                          "those there are)")
        history = RunHistory(cfg.state_dir or None)
        if cfg.state_dir:  # before anything is written: a refusal leaves the dir as it was
            try:
                check_active_run(history, cfg.state_dir)
            except ValueError:
                history.close()
                raise
        incarnation = history.meta("incarnation") + 1
        history.set_meta("incarnation", incarnation)
        # The same store port after a restart: the workers reconnect where it was (new
        # workers of a resumed run learn it when they register).
        reuse = bool(cfg.state_dir) and not cfg.resume_workers
        store_port = cfg.store_port or (history.meta("store_port") if reuse else 0)
        # Sockets opened in the workers' namespace stay there (ripples/netshape.py).
        def in_workers_net() -> contextlib.AbstractContextManager[None]:
            return entered(cfg.netns) if cfg.netns else contextlib.nullcontext()

        try:
            with in_workers_net():
                self._store = dist.TCPStore(cfg.host, store_port, is_master=True,
                                            wait_for_workers=False, use_libuv=True)
        except (RuntimeError, OSError) as err:
            history.close()
            raise OSError(f"cannot open the rendezvous store on {cfg.host}:{store_port}: "
                          f"{err}; pick another --store-port") from err
        self.store_port = self._store.port  # type: ignore[attr-defined]
        history.set_meta("store_port", self.store_port)
        queue = self.queue = RunQueue(
            history, state_dir=cfg.state_dir, store=self._store, store_host=_advertised(cfg),
            store_port=self.store_port, incarnation=incarnation,
            resume_workers=cfg.resume_workers)
        logs = RunLogs(queue)
        agents = AgentsService(queue, logs)
        server = grpc.aio.server(options=SERVER_OPTIONS,
                                 interceptors=cfg.security.interceptors())
        WorkerGateway(queue).add_to_server(server)
        pb_grpc.add_RunsServicer_to_server(RunsService(queue, agents, logs), server)
        pb_grpc.add_AgentsServicer_to_server(agents, server)
        health = Health(server)
        address = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        credentials = cfg.security.credentials()
        def listen(address: str) -> int:
            try:
                return (server.add_secure_port(address, credentials) if credentials
                        else server.add_insecure_port(address))
            except RuntimeError as err:
                raise OSError(f"cannot listen on {address}: {err}; is the port in use?"
                              ) from err

        with in_workers_net():
            self.port = listen(address)
        self.local_port = listen("127.0.0.1:0") if cfg.netns else self.port
        metrics_socket = bind("127.0.0.1" if cfg.netns else cfg.host, cfg.metrics_port,
                              what="metrics", option="--metrics-port")
        await server.start()
        app = build_app(lambda: queue.active.service.metrics.registry if queue.active else None,
                        queue.discovery)
        http = HttpEndpoint(HttpTokenGate(app, (cfg.security.token, cfg.security.read_token)),
                            metrics_socket, what="metrics endpoint")
        self.metrics_port = http.port
        if self._lock is not None:  # a second coordinator's refusal names this one
            self._lock.note_address(self.address)
        queue.metrics_address = self.metrics_address
        await http.start()
        try:
            await queue.start(cfg.run)
        except BaseException:  # e.g. the active run's state is lost: refused, torn down
            await http.stop()
            await server.stop(grace=None)
            queue.release()
            raise
        agents.start()
        if queue.active is not None:  # the settings of the run it serves (resumed: saved)
            cfg.run = queue.active.service.core.settings
        await health.set_serving(True)
        logger.info("coordinator listening on %s:%d (%s; store %d, metrics %d)%s",
                    cfg.host, self.port, cfg.security.describe(), self.store_port,
                    self.metrics_port, f", run {queue.active.info.run_id}" if queue.active
                    else ", no run yet")
        events.emit(events.COORDINATOR_LISTENING, address=self.address,
                    metrics_address=self.metrics_address,
                    run_id=queue.active.info.run_id if queue.active else "")
        try:
            await self._until_stopped()
        finally:
            await health.set_serving(False)
            agents.close()
            await queue.close()
            await http.stop()
            await server.stop(grace=1.0)
            queue.release()
            self._store = None  # its port is free for the next start (the last reference)

    @property
    def service(self) -> CoordinatorService | None:
        """The active run's service (or the last run's once it ended)."""
        return self.queue.last_service if self.queue is not None else None

    def run_finished(self) -> bool:
        """True once every run submitted so far has ended (stopped, workers gone)."""
        return self.queue is not None and self.queue.finished()

    @property
    def address(self) -> str:
        host = _advertised(self.config)
        return f"{host}:{self.port}"

    @property
    def local_address(self) -> str:
        """Where a tool on this machine reaches the service: `address`, or with `netns`
        its port on 127.0.0.1 in this process's namespace."""
        return f"127.0.0.1:{self.local_port}" if self.config.netns else self.address

    @property
    def metrics_address(self) -> str:
        host = "127.0.0.1" if self.config.netns else _advertised(self.config)
        return f"{host}:{self.metrics_port}"


def serve(config: ServerConfig) -> int:
    """Serve until SIGINT/SIGTERM (or, with exit_when_done, until the runs ended)."""
    server = CoordinatorServer(config).start()
    run = config.run
    what = (f"protocol {run.protocol}, waiting for {run.num_workers} workers" if run
            else "no run yet: `ripples submit` adds one")
    local = (f" in network namespace {config.netns}, and on {server.local_address} here"
             if config.netns else "")
    print(f"ripples coordinator listening on {server.address}{local} ({what}); metrics and "
          f"Prometheus discovery on http://{server.metrics_address}/sd", flush=True)
    return serve_until_signal(
        server, lambda: config.exit_when_done and server.run_finished())
