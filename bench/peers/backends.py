"""The peer systems behind `ripples bench --peers`: how each joins its peers, wraps the
model and optimizer, synchronises in its step, and shuts down.

A backend is what the peer worker's loop (worker.py) calls around the Ripples runner's
own loop: `zero_grad()` before the forward pass and `step()` after the backward pass.
Each peer system's knobs come from `PEERS[name].defaults` (the tuning sweep's best,
docs/benchmarks.md) with the run's overrides.

On loopback everything binds and connects to 127.0.0.1. On a shaped network (every
worker a host in a network namespace of its own, ripples/netshape.py) each worker binds,
announces and connects at its own host's address (PeerWorkerConfig.address: torchft's
Manager, replica-group store and checkpoint server, hivemind's DHT), and torchft's
lighthouse listens in the hub, so that every byte between workers crosses their links.
Nothing reaches beyond the machine either way.
"""

from __future__ import annotations

import functools
import math
import os
import socket
import subprocess
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ripples.bench.peers.config import PeerRunFiles, PeerWorkerConfig
from ripples.bench.peers.workloads import PeerWorkload
from ripples.files import write_atomically
from ripples.netshape import HUB_ADDRESS, ShapedCluster, entered

RENDEZVOUS_TIMEOUT_SECONDS = 60.0
"""How long a worker waits for its peer system's first member, or a service, to appear."""


class PeerBackend(ABC):
    """One worker's membership of a peer system."""

    model: nn.Module
    """What the forward pass runs (a wrapper where the system needs one)."""
    optimizer: torch.optim.Optimizer
    """The optimizer whose learning rate a schedule sets."""
    start_step = 0
    """The step a worker starts counting from (a replacement's is its peers')."""
    sent_bytes: int | None = 0
    """Bytes this worker fed into its peer system's collectives so far (the vectors it
    handed to an all-reduce, as a Ripples worker's preduce_bytes; about 2(N-1)/N times
    that goes on the wire). None: this system's are not counted. worker.py logs each
    step's share (progress.py), launch.py sums them into summary.json."""

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    @abstractmethod
    def step(self) -> None:
        """The optimizer step, and this system's synchronisation with its peers."""

    def last_step(self, step: int) -> int:
        """The step to stop after, now that the launcher asked for a stop after `step`.
        Workers of systems whose workers are independent stop at once."""
        return step

    def backward_sync_seconds(self) -> float:
        """Seconds of this step's backward pass spent synchronising (DDP's all-reduce
        runs inside it); counted as synchronisation, not compute."""
        return 0.0

    @abstractmethod
    def model_state(self) -> dict[str, Tensor]:
        """The trained model's state dict (no wrapper's prefixes)."""

    @abstractmethod
    def close(self) -> None:
        """Leave the peer system (worker.py bounds how long this may take)."""


def make_backend(cfg: PeerWorkerConfig, work: PeerWorkload, files: PeerRunFiles) -> PeerBackend:
    if cfg.peer in ("hivemind-local", "hivemind-sync"):
        return HivemindBackend(cfg, work, files, local_updates=cfg.peer == "hivemind-local")
    if cfg.peer in ("torchft", "torchft-diloco"):
        return TorchftBackend(cfg, work)
    raise ValueError(f"no backend for peer {cfg.peer!r}")


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """What the tensors hold, in bytes."""
    return sum(t.numel() * t.element_size() for t in tensors)


def start_service(peer: str, files: PeerRunFiles, settings: dict[str, Any],
                  network: ShapedCluster | None = None
                  ) -> tuple[subprocess.Popen[bytes] | None, dict[str, str]]:
    """The peer system's own service, if it has one, and how workers reach it: on
    loopback, or on a shaped `network` in its hub (unshaped, as Ripples' coordinator)."""
    if peer not in ("torchft", "torchft-diloco"):
        return None, {}
    host, netns = (HUB_ADDRESS, network.hub) if network else ("127.0.0.1", "")
    port = free_port(host, netns)
    log = (files.directory / "lighthouse.log").open("wb")
    prefix = network.hub_argv() if network else []
    # min_replicas 1: a quorum forms from whoever is there after join_timeout_ms, so a
    # killed replica does not hold the others up (torchft's fault tolerance).
    lighthouse = subprocess.Popen(
        [*prefix, _lighthouse_binary(), "--bind", f"{host}:{port}", "--min_replicas", "1",
         "--join_timeout_ms", str(int(settings["join_timeout_ms"])),
         "--quorum_tick_ms", str(int(settings["quorum_tick_ms"])),
         "--heartbeat_timeout_ms", str(int(settings["heartbeat_timeout_ms"]))],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_SECONDS
    while not _port_open(host, port, netns):
        if lighthouse.poll() is not None:
            raise RuntimeError(f"torchft's lighthouse exited {lighthouse.returncode}: "
                               + (files.directory / "lighthouse.log").read_text()[-2000:])
        if time.monotonic() > deadline:
            lighthouse.kill()
            raise TimeoutError(f"torchft's lighthouse did not listen on {host}:{port} "
                               f"within {RENDEZVOUS_TIMEOUT_SECONDS:.0f} s")
        time.sleep(0.05)
    return lighthouse, {"lighthouse": f"http://{host}:{port}"}


def _lighthouse_binary() -> str:
    """torchft's wheel installs `torchft_lighthouse` next to this interpreter, or, installed
    elsewhere (`pip install --target`, `--user`), in a folder on PATH."""
    import shutil
    import sys

    path = Path(sys.executable).parent / "torchft_lighthouse"
    found = str(path) if path.exists() else shutil.which("torchft_lighthouse")
    if found is None:
        raise RuntimeError(f"torchft's lighthouse is neither at {path} nor on PATH: "
                           "pip install 'ripples[peers]'")
    return found


def _socket(netns: str) -> socket.socket:
    """A TCP socket in network namespace `netns` ("": this process's)."""
    if not netns:
        return socket.socket()
    with entered(netns):
        return socket.socket()


def free_port(host: str = "127.0.0.1", netns: str = "") -> int:
    with _socket(netns) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _port_open(host: str, port: int, netns: str = "") -> bool:
    with _socket(netns) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def _wait_for(path: Path, what: str) -> str:
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_SECONDS
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not appear within {RENDEZVOUS_TIMEOUT_SECONDS:.0f} s "
                               f"({path})")
        time.sleep(0.05)
    return path.read_text()


class _Phases:
    """One line per phase of joining a peer system, with its seconds, on the worker's log
    (where a replacement's time to its first step goes)."""

    def __init__(self, who: str) -> None:
        self.who, self.last = who, time.monotonic()

    def done(self, what: str) -> None:
        now = time.monotonic()
        print(f"{self.who}: {what} in {now - self.last:.2f} s", flush=True)
        self.last = now


def _floating_buffers(model: nn.Module) -> list[Tensor]:
    """BatchNorm's running statistics: Ripples averages them with the parameters."""
    return [b for b in model.buffers() if b.dtype.is_floating_point]


# ----------------------------------------------------------------------------- hivemind
def local_p2p(address: str) -> dict[str, Any]:
    """hivemind's DHT options: listen on `address` (loopback, or the worker's host on a
    shaped network), and reach nothing beyond the run's own peers."""
    return {
        "host_maddrs": [f"/ip4/{address}/tcp/0"],
        "use_ipfs": False,  # never bootstrap from the public IPFS network
        "use_relay": False, "use_auto_relay": False,  # no libp2p circuit relays
        "auto_nat": False, "nat_port_map": False,  # no NAT discovery, no UPnP port mapping
    }


class HivemindBackend(PeerBackend):
    """hivemind.Optimizer over a DHT of the run's workers.

    local_updates=True (hivemind-local): every step a local step; whenever the workers
    together did `target_batch_size` samples (a hivemind "epoch"), the parameters (and
    BatchNorm statistics) are averaged in the background with whoever matched within
    `matchmaking_time`. False (hivemind-sync): gradients accumulate until the workers
    together did one batch each, are averaged, and one optimizer step follows."""

    def __init__(self, cfg: PeerWorkerConfig, work: PeerWorkload, files: PeerRunFiles, *,
                 local_updates: bool) -> None:
        import hivemind
        from hivemind.optim.grad_averager import GradientAverager

        settings = cfg.settings
        self.who = f"hivemind worker {cfg.rank}.{cfg.incarnation}"
        phase = _Phases(self.who)
        mine = files.rendezvous_file(f"dht.rank{cfg.rank}")
        if cfg.rank == 0 and cfg.incarnation == 0:
            self.dht = hivemind.DHT(start=True, **local_p2p(cfg.address))
        else:  # join through the first worker (a replacement of rank 0: through rank 1)
            via = 1 if cfg.rank == 0 else 0
            peers = _wait_for(files.rendezvous_file(f"dht.rank{via}"),
                              f"hivemind worker {via}'s DHT address").split()
            self.dht = hivemind.DHT(start=True, initial_peers=peers, **local_p2p(cfg.address))
        write_atomically(mine, "\n".join(str(a) for a in self.dht.get_visible_maddrs()).encode())
        phase.done("joined the DHT")
        model = work.model
        target = (int(settings["target_batch_size"]) if local_updates
                  else cfg.num_workers * cfg.batch_size)
        matchmaking = float(settings["matchmaking_time"])
        # A request must be able to time out within one matchmaking round; the
        # Optimizer hands averager_opts to its state averager only, so the gradient
        # averager (sync mode) gets them through its factory.
        averager_opts = {"request_timeout": matchmaking / 2}
        gradients = ({} if local_updates else {"grad_averager_factory": functools.partial(
            GradientAverager, **averager_opts)})
        self.hivemind_optimizer = hivemind.Optimizer(
            dht=self.dht, run_id=f"ripples-bench-{os.path.basename(cfg.directory)}",
            params=work.params(model), optimizer=work.make_optimizer,
            batch_size_per_step=cfg.batch_size, target_batch_size=target,
            use_local_updates=local_updates, matchmaking_time=matchmaking,
            averaging_timeout=float(settings["averaging_timeout"]),
            load_state_timeout=RENDEZVOUS_TIMEOUT_SECONDS,
            extra_tensors=_floating_buffers(model), averager_opts=averager_opts,
            shutdown_timeout=5.0, verbose=False, **gradients)
        self.model = model
        self.optimizer = self.hivemind_optimizer.state_averager.optimizer
        # What one averaging round feeds in: the state averager's parameters and extra
        # tensors (BatchNorm statistics; no optimizer statistics are averaged), and in
        # sync mode the gradient averager's accumulated gradients too.
        parameters = [p for p in model.parameters() if p.requires_grad]
        self._state_bytes = tensor_bytes([*parameters, *_floating_buffers(model)])
        self._gradient_bytes = 0 if local_updates else tensor_bytes(parameters)
        phase.done("built hivemind.Optimizer")
        if cfg.incarnation > 0:  # a replacement: the collaboration's state first
            self.hivemind_optimizer.load_state_from_peers()
            phase.done("loaded the state from its peers")

    def zero_grad(self) -> None:
        self.hivemind_optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        optimizer = self.hivemind_optimizer
        epoch, peers = optimizer.local_epoch, optimizer.tracker.global_progress.num_peers
        optimizer.step()
        if optimizer.local_epoch == epoch + 1 and self.sent_bytes is not None:
            # This step ended a hivemind epoch: sync mode averaged the gradients, and the
            # state is averaged when the swarm had another peer (hivemind's own test,
            # average_state_every 1). Nominal: a round that found no group or timed out
            # counts too; an epoch skipped by catching up (load_state_from_peers, the
            # epoch jumps) sent nothing and counts nothing.
            self.sent_bytes += self._gradient_bytes + (self._state_bytes if peers > 1 else 0)

    def model_state(self) -> dict[str, Tensor]:
        return self.model.state_dict()

    def close(self) -> None:
        # How many hivemind epochs (averaging rounds; in sync mode, optimizer steps) this
        # worker's steps became: where its time went (docs/benchmarks.md).
        print(f"{self.who}: ended at hivemind epoch {self.hivemind_optimizer.local_epoch}",
              flush=True)
        self.hivemind_optimizer.shutdown()
        self.dht.shutdown()


# ----------------------------------------------------------------------------- torchft
class TorchftBackend(PeerBackend):
    """torchft: one replica group per worker (world size 1 inside it), a Manager talking
    to the run's lighthouse, gloo between the groups.

    Peer torchft, mode "ddp": torchft.DistributedDataParallel and torchft.Optimizer: every
    step a quorum (started asynchronously at zero_grad), the gradients all-reduced among
    its members, and the step committed only if every member succeeded. mode
    "localsgd-K": torchft.local_sgd.LocalSGD: K local steps, then a quorum and the
    parameters averaged.

    Peer torchft-diloco: torchft.local_sgd.DiLoCo around the task's optimizer (the inner
    one, its state local): `sync_every` (H) local steps, then a synchronous quorum, the
    pseudo-gradients (the anchor, i.e. the parameters at the last synchronisation, minus
    the parameters) averaged in one bucketised all-reduce, and an outer
    SGD(outer_lr, outer_momentum, nesterov) step on the anchor, which every replica then
    trains from; a failed quorum or all-reduce discards the round (back to the anchor).
    The outer step runs in the inner optimizer's post-step hook, so the worker's step loop
    is unchanged. Parameters only: torchft averages no buffers (BatchNorm's statistics
    stay each replica's own).

    Bytes: the Manager counts every tensor it is handed to all-reduce (DDP's gradient
    buckets, 4P per step for P fp32 parameters; DiLoCo's pseudo-gradient bucket, 4P per
    H steps; LocalSGD's parameters, 4P per K steps), except once it has errored
    (torchft's all-reduce is then a no-op)."""

    def __init__(self, cfg: PeerWorkerConfig, work: PeerWorkload) -> None:
        import torch.distributed as dist
        from torchft import DistributedDataParallel, Manager, ProcessGroupGloo
        from torchft import Optimizer as FtOptimizer

        settings = cfg.settings
        diloco = cfg.peer == "torchft-diloco"
        if diloco:
            self.sync_every = int(settings["sync_every"])
            outer_lr, outer_momentum = (float(settings["outer_lr"]),
                                        float(settings["outer_momentum"]))
            if self.sync_every < 1 or not outer_lr > 0 or not 0 <= outer_momentum < 1:
                raise ValueError(f"torchft-diloco needs sync_every >= 1, outer_lr > 0 and "
                                 f"0 <= outer_momentum < 1, got {self.sync_every}, "
                                 f"{outer_lr:g}, {outer_momentum:g}")
        else:
            mode = str(settings["mode"])
            self.sync_every = (int(mode.removeprefix("localsgd-"))
                               if mode.startswith("localsgd-") else 0)
            if mode != "ddp" and self.sync_every < 1:
                raise ValueError(f"torchft mode {mode!r}: write ddp or localsgd-K (K >= 1)")
        model, inner = work.model, work.make_optimizer(work.params(work.model))
        self.plain_model, self.optimizer = model, inner
        # The replica group's store: one process per group, so this process hosts it,
        # on a socket bound to its address (TCPStore's own master binds every address);
        # the other replicas rendezvous there when this one leads a quorum.
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((cfg.address, 0))
        listener.listen(128)
        store_port = listener.getsockname()[1]
        self._listener = listener
        self.store = dist.TCPStore(host_name=cfg.address, port=store_port, is_master=True,
                                   wait_for_workers=False, master_listen_fd=listener.fileno())
        timeout = timedelta(seconds=float(settings["timeout_seconds"]))

        def state_dict() -> dict[str, Any]:
            return {"model": model.state_dict(), "optimizer": inner.state_dict()}

        def load_state_dict(state: dict[str, Any]) -> None:
            model.load_state_dict(state["model"])
            inner.load_state_dict(state["optimizer"])

        backend = self

        class CountingManager(Manager):  # type: ignore[misc]
            """torchft's Manager, counting the bytes handed to its all-reduce."""

            def allreduce(self, tensor: Tensor, *args: Any, **kwargs: Any) -> Any:
                if not self.errored():
                    backend.sent_bytes = (backend.sent_bytes or 0) + tensor_bytes([tensor])
                return super().allreduce(tensor, *args, **kwargs)

        self.manager = CountingManager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=load_state_dict,
            state_dict=state_dict, min_replica_size=1, use_async_quorum=self.sync_every == 0,
            timeout=timeout, quorum_timeout=timedelta(seconds=RENDEZVOUS_TIMEOUT_SECONDS),
            connect_timeout=timeout, rank=0, world_size=1, store_addr=cfg.address,
            store_port=store_port, lighthouse_addr=cfg.rendezvous["lighthouse"],
            replica_id=f"rank{cfg.rank}", hostname=cfg.address,
            checkpoint_transport=(_checkpoint_transport(cfg.address, timeout)
                                  if cfg.addresses else None),
            # DiLoCo: no sync at step 0, as torchft says for replicas seeded alike (they
            # are: the task's seeded model). With it, the first quorum, at the end of the
            # first round, heals every replica but one from that one, discarding their
            # first H steps (measured: replica 1 took replica 0's model and inner state).
            # A replacement still heals (its step is behind).
            init_sync=not diloco)
        self._local_sgd: Any = None
        if diloco:
            from torchft.local_sgd import DiLoCo

            self.model = model
            self.ft_optimizer: torch.optim.Optimizer = inner
            outer = outer_sgd(model.parameters(), outer_lr, outer_momentum)
            # One fragment (the whole model), all-reduced in 32 MiB buckets (one for the
            # bench's models); DiLoCo registers its anchor and outer state with the
            # Manager, so a healing replica gets them with the model.
            self._local_sgd = DiLoCo(self.manager, [model], inner, outer,
                                     sync_every=self.sync_every, use_bucketization=True,
                                     bucket_cap_mb=32)
            self._local_sgd.__enter__()
        elif self.sync_every:
            from torchft.local_sgd import LocalSGD

            self.model = model
            self.ft_optimizer = inner
            self._local_sgd = LocalSGD(self.manager, model, inner, sync_every=self.sync_every)
            self._local_sgd.__enter__()
        else:
            def timed_hook(state: Any, bucket: Any) -> Any:
                """torchft's DDP communication hook (ddp.py's _comm_hook), timed: it waits
                for the step's quorum and all-reduce inside backward (a slower device would
                not make that slower: it is synchronisation, not compute)."""
                began = time.perf_counter()
                try:
                    work = state.allreduce(bucket.buffer())
                    work.wait()
                    inner = getattr(work.get_future(), "_fut", None)
                    if inner is not None:
                        return inner
                    # The manager has errored this step (a peer died): its allreduce is
                    # a no-op and the step will not commit. torchft's own hook asserts
                    # here, which kills the survivors; DDP needs a completed future.
                    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
                    done.set_result(bucket.buffer())
                    return done
                finally:
                    backend._sync_in_backward += time.perf_counter() - began

            # DDP checks a hook's annotations as objects (this module's are strings).
            timed_hook.__annotations__ = {"bucket": dist.GradBucket,
                                          "return": torch.futures.Future[torch.Tensor]}

            class TimedDDP(DistributedDataParallel):  # type: ignore[misc]
                _comm_hook = staticmethod(timed_hook)

            self.model = TimedDDP(self.manager, model)
            self.ft_optimizer = FtOptimizer(self.manager, inner)

    _sync_in_backward = 0.0

    def backward_sync_seconds(self) -> float:
        seconds, self._sync_in_backward = self._sync_in_backward, 0.0
        return seconds

    def zero_grad(self) -> None:
        self.ft_optimizer.zero_grad(set_to_none=True)  # ddp: starts the step's quorum

    def step(self) -> None:
        # ddp: commits; local SGD and DiLoCo: their post-step hook synchronises every K (H)
        self.ft_optimizer.step()

    def last_step(self, step: int) -> int:
        """Replicas stop together, at a step none of them has begun (a replica gone
        mid-step costs the others a timed-out collective): they step in lock-step, so each
        sees the stop file in the same step or the next; two steps on (local SGD and
        DiLoCo: their next synchronisation after that, a multiple of K or H) is then a step
        they all still do."""
        period = max(1, self.sync_every)
        return math.ceil((step + 2) / period) * period

    def model_state(self) -> dict[str, Tensor]:
        return self.plain_model.state_dict()

    def close(self) -> None:
        if self._local_sgd is not None:
            self._local_sgd.__exit__(None, None, None)
        self.manager.shutdown(wait=False)


def _checkpoint_transport(host: str, timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint server (what a healing replica fetches the model from),
    announced at this worker's `host` address: torchft's own announces the machine's
    hostname, which inside a host's namespace names nothing there (or its own loopback)."""
    from torchft.checkpointing import HTTPTransport

    class HostTransport(HTTPTransport):  # type: ignore[misc]
        def address(self) -> str:
            port = self._server.socket.getsockname()[1]
            return f"http://{host}:{port}/checkpoint/"

    return HostTransport(timeout=timeout, num_chunks=0)


def outer_sgd(params: Iterable[torch.nn.Parameter], lr: float,
              momentum: float) -> torch.optim.SGD:
    """DiLoCo's outer optimizer, SGD with Nesterov momentum; at momentum 0 (which torch's
    Nesterov SGD refuses) the plain step it then is, as Ripples' outer step takes it."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0)
