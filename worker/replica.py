"""A worker of several ranks: its process group, its device mesh, and the relay by which
its rank 0 hands the coordinator's decisions to the others.

A worker whose model does not fit one device is G processes (`--ranks-per-worker G`) that
shard it with FSDP2 (`fully_shard(module, mesh=worker.mesh)`). The coordinator sees one
worker: rank 0 registers, heartbeats and asks for groups; ranks 1..G-1 never call the
coordinator. Whatever rank 0 learns that decides a collective (the run's settings, a
group, an eviction, the stop) it broadcasts to its other ranks over a gloo group of the
worker's own, before any of them starts the collective, so that every rank acts on the
same decision in the same order. Rank r of each member then averages its own shard with
rank r of the others (worker/dataplane/shard_mirror.py), on a communicator of its own.

Every message carries its kind and a sequence number: a rank that expects one kind and
receives another fails at once, naming both (the ranks would otherwise pair a decision
with the wrong collective). Every wait is bounded (`RelayTimeouts`).

How the ranks meet: Ripples' launchers give each worker an address of its own
(RIPPLES_REPLICA_ADDRESS, served by its rank 0), so that a worker's ranks form their group
with no other worker's; under torchrun every rank of the launch joins one group over
MASTER_ADDR:MASTER_PORT and the workers' groups are split from it, G consecutive ranks
each. Either way the worker's group is the process's default group when it has none yet.
"""

from __future__ import annotations

import datetime
import hashlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from google.protobuf.message import Message
from torch.distributed.device_mesh import DeviceMesh

from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import replica_pb2 as rpb
from ripples.worker.dataplane.averaged_state import schema_of
from ripples.worker.launch_env import LaunchEnv

logger = logging.getLogger(__name__)

FORM_TIMEOUT_SECONDS = 300.0
"""How long a worker's ranks wait for each other to form their process group."""

KINDS = ("start", "start-reply", "group-reply", "step", "final-reply", "round")
"""What rank 0 relays, by the index the header carries."""
FRAME_BYTES = 512
"""One relayed message's first broadcast: the header and as much of the payload as fits
(a step's verdict, a group reply: one broadcast per message)."""
_HEADER_BYTES = 24  # kind, number, length: three int64


@dataclass(frozen=True)
class RelayTimeouts:
    """How long a rank waits for its rank 0's next message: rank 0 may wait that long
    for a group, its collective and its peers in between (a round of groups)."""

    seconds: float = 1800.0


def worker_schema(replica: Replica, schema: pb.TensorSchema,
                  fingerprint: str) -> tuple[pb.TensorSchema, str]:
    """The schema and model fingerprint of the whole worker, from every rank's (a
    gather: every rank calls it): each rank's tensors named `<name>@shard<r>/<G>`, so
    that the coordinator, which refuses a worker whose schema differs from the others',
    names the first shard that differs (a mesh of another size, another parameter, a
    shard of another shape)."""
    payload = rpb.ReplicaShard(schema=schema, fingerprint=fingerprint).SerializeToString()
    tensors: list[pb.TensorSpec] = []
    prints = hashlib.sha256()
    for rank, data in enumerate(replica.gather(payload)):
        shard = rpb.ReplicaShard.FromString(data)
        for spec in shard.schema.tensors:
            tensors.append(pb.TensorSpec(name=f"{spec.name}@shard{rank}/{replica.size}",
                                         shape=list(spec.shape), dtype=spec.dtype))
        prints.update(f"{shard.fingerprint}\n".encode())
    return schema_of(tensors), prints.hexdigest()


class ReplicaMismatch(RuntimeError):
    """The worker's ranks disagree on what comes next: one of them did something the
    others did not (a defect, or a rank running another script)."""


class Replica:
    """This process's place among its worker's G ranks (`ripples.Worker.mesh`)."""

    def __init__(self, env: LaunchEnv, device: torch.device) -> None:
        if not env.sharded:
            raise ValueError("a worker of one rank has no replica group")
        self.size = env.ranks_per_worker
        self.rank = env.worker_rank
        if device.type == "cuda":  # NCCL's communicators take the current device
            torch.cuda.set_device(device)
        self.group, self._relay = _form_groups(env)
        """The worker's ranks (FSDP2's group: the mesh is over it), and a gloo group over
        them for the relay (never FSDP2's: its collectives keep their order)."""
        self.mesh = DeviceMesh.from_group(self.group, device.type,
                                          mesh_dim_names=("shard",))
        """A one-dimensional mesh over the worker's ranks: fully_shard(module, mesh=...)."""
        self.timeouts = RelayTimeouts()
        self._sending: list[tuple[dist.Work, torch.Tensor, str]] = []
        """Rank 0: its last message's broadcasts, on their way (with their buffers)."""
        self.incarnation = 0
        """Ranks 1..G-1: the coordinator's life rank 0 last heard of (a new one drops the
        communicators of its predecessor's groups)."""
        self._sent = 0
        logger.info("rank %d of a worker of %d ranks", self.rank, self.size)

    @property
    def leads(self) -> bool:
        """Rank 0: the one that talks to the coordinator."""
        return self.rank == 0

    # ------------------------------------------------------------------ messages
    def send(self, kind: str, message: Message) -> None:
        """Rank 0: hand `message` to every other rank of the worker: one broadcast of a
        fixed-size frame (its kind, number, length and the start of the payload), and a
        second one for what does not fit (a run's settings; never a step's verdict)."""
        assert self.leads, "only rank 0 relays"
        payload = message.SerializeToString()
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        frame[:_HEADER_BYTES].view(torch.int64).copy_(
            torch.tensor([KINDS.index(kind), self._sent, len(payload)]))
        inline = min(len(payload), FRAME_BYTES - _HEADER_BYTES)
        if inline:
            frame[_HEADER_BYTES : _HEADER_BYTES + inline] = torch.frombuffer(
                bytearray(payload[:inline]), dtype=torch.uint8)
        self.settle()
        self._sending = [(self._start_broadcast(frame), frame, kind)]
        if len(payload) > inline:
            rest = torch.frombuffer(bytearray(payload[inline:]), dtype=torch.uint8)
            self._sending.append((self._start_broadcast(rest), rest, kind))
        self._sent += 1

    def settle(self) -> None:
        """Rank 0: wait for its last message to reach every rank (it does not wait when
        it sends one: the others receive it when they get there); before it ends, so that
        none is lost with the process."""
        sending, self._sending = self._sending, []
        for work, _, kind in sending:
            self._wait(work, f"{kind} message")

    def receive(self, kind: str, message: Message) -> Message:
        """Ranks 1..G-1: rank 0's next message, which must be of `kind`; parsed into
        `message` (returned)."""
        assert not self.leads, "rank 0 relays; it receives nothing"
        frame = torch.zeros(FRAME_BYTES, dtype=torch.uint8)
        self._broadcast(frame, kind)
        got, seq, length = (int(v) for v in frame[:_HEADER_BYTES].view(torch.int64))
        if got != KINDS.index(kind) or seq != self._sent:
            name = KINDS[got] if 0 <= got < len(KINDS) else f"kind {got}"
            raise ReplicaMismatch(
                f"rank {self.rank} expected rank 0's {kind} message #{self._sent} and "
                f"received its {name} message #{seq}: the worker's ranks no longer act "
                "on the same decisions")
        inline = min(length, FRAME_BYTES - _HEADER_BYTES)
        payload = frame[_HEADER_BYTES : _HEADER_BYTES + inline].numpy().tobytes()
        if length > inline:
            rest = torch.empty(length - inline, dtype=torch.uint8)
            self._broadcast(rest, kind)
            payload += rest.numpy().tobytes()
        message.ParseFromString(payload)
        self._sent += 1
        return message

    def relay(self, kind: str, message: Message | None, empty: Message) -> Message:
        """Rank 0 sends `message` and returns it; the others return what it sent (parsed
        into `empty`)."""
        if self.leads:
            assert message is not None
            self.send(kind, message)
            return message
        return self.receive(kind, empty)

    def gather(self, payload: bytes) -> list[bytes]:
        """Every rank's `payload`, in rank order (on every rank)."""
        self.settle()
        size = torch.tensor([len(payload)], dtype=torch.int64)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        self._wait(self._relay_pg.allgather([sizes], [size]), "gather (sizes)")
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        if payload:
            mine[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        everyone = [torch.zeros(longest, dtype=torch.uint8) for _ in range(self.size)]
        self._wait(self._relay_pg.allgather([everyone], [mine]), "gather")
        return [t[: int(s)].numpy().tobytes() for t, s in zip(everyone, sizes, strict=True)]

    def agree(self, ok: bool, distance: float | None) -> tuple[bool, float | None]:
        """A group's outcome over the worker's ranks: ok only where every rank's shard
        was averaged; the squared distance summed over the shards (None if a rank had
        none)."""
        self.settle()
        values = torch.tensor([0.0 if ok else 1.0,
                               0.0 if distance is None else distance,
                               1.0 if distance is None else 0.0], dtype=torch.float64)
        self._wait(self._relay_pg.allreduce([values]), "agreement")
        failed, total, missing = (float(v) for v in values)
        return failed == 0, None if missing else total

    def barrier(self, what: str) -> None:
        """Every rank of the worker got here (bounded)."""
        self.agree(True, None)
        logger.debug("worker ranks met: %s", what)

    # ------------------------------------------------------------------ plumbing
    @property
    def _relay_pg(self) -> dist.ProcessGroup:
        return self._relay  # type: ignore[return-value]

    def _broadcast(self, tensor: torch.Tensor, kind: str) -> None:
        self._wait(self._start_broadcast(tensor), f"{kind} message")

    def _start_broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self._relay_pg.broadcast([tensor], options)

    def _wait(self, work: dist.Work, what: str) -> None:
        seconds = self.timeouts.seconds
        try:
            done = work.wait(datetime.timedelta(seconds=seconds))
        except RuntimeError as err:
            raise RuntimeError(f"rank {self.rank} of the worker lost its other ranks during "
                               f"a relayed {what} (one of them ended?): {err}") from err
        if not done:
            raise TimeoutError(f"rank {self.rank} of the worker waited {seconds:.0f} s for "
                               f"its ranks' {what}")

def _form_groups(env: LaunchEnv) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """The process group of this worker's ranks (see the module doc) and the gloo group of
    its relay."""
    timeout = datetime.timedelta(seconds=FORM_TIMEOUT_SECONDS)
    g = env.ranks_per_worker
    if dist.is_initialized():
        raise ValueError("torch.distributed is initialized already: call ripples.init() "
                         "before init_process_group (it forms the worker's group, the "
                         "default one)")
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    if env.replica_address:
        host, _, port = env.replica_address.rpartition(":")
        store = dist.TCPStore(host.strip("[]"), int(port), g, is_master=env.worker_rank == 0,
                              timeout=timeout)
        dist.init_process_group(backend, store=store, rank=env.worker_rank, world_size=g,
                                timeout=timeout)
        world = dist.group.WORLD
        assert world is not None
        return world, dist.new_group(backend="gloo", timeout=timeout)
    if os.environ.get("MASTER_PORT") == "0":  # torchrun --master-port 0 passes 0 on
        raise ValueError("MASTER_PORT is 0 (torchrun --master-port 0): the ranks of a worker "
                         "meet at torchrun's MASTER_ADDR:MASTER_PORT, so give a port")
    dist.init_process_group(backend, init_method="env://", rank=env.rank,
                            world_size=env.world_size, timeout=timeout)
    mine: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
    for first in range(0, env.world_size, g):  # every rank makes every group, in order
        ranks = list(range(first, first + g))
        group = dist.new_group(ranks, timeout=timeout)
        relay = dist.new_group(ranks, backend="gloo", timeout=timeout)
        if first <= env.rank < first + g:
            mine = (group, relay)
    assert mine is not None
    return mine


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's state_dict, on the CPU, from its shards (a collective over the
    worker's ranks: every rank calls it; rank 0 gets it, the others an empty dict). It
    loads into the unsharded model (`ripples run`'s model.pt)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                 cpu_offload=True))
    return {name: value for name, value in state.items() if isinstance(value, torch.Tensor)}
