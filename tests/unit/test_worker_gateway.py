"""The Worker service's gateway: one handler per RPC of the service's descriptor, each of
the shape the RPC streams in, and none without a CoordinatorService method to call."""

from __future__ import annotations

import pytest

from ripples.coordinator.service import CoordinatorService
from ripples.coordinator.worker_gateway import SERVICE, WorkerGateway
from ripples.v1 import coordinator_pb2_grpc as pb_grpc


def test_every_worker_rpc_has_a_handler_of_its_shape() -> None:
    gateway = WorkerGateway(queue=None)  # type: ignore[arg-type]
    assert set(gateway.handlers) == {m.name for m in SERVICE.methods}
    assert set(gateway.handlers) == {n for n in vars(pb_grpc.WorkerServicer)
                                     if not n.startswith("_")}
    for method in SERVICE.methods:
        handler = gateway.handlers[method.name]
        assert bool(handler.request_streaming) == method.client_streaming
        assert bool(handler.response_streaming) == method.server_streaming
    assert gateway.handlers["Synchronize"].stream_stream is not None


def test_a_worker_rpc_without_a_service_method_fails_at_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(CoordinatorService, "Checkpoint")
    # The generated base class still has it (UNIMPLEMENTED): the run's own one is wanted.
    assert getattr(CoordinatorService, "Checkpoint", None) is not None
    with pytest.raises(TypeError, match="Checkpoint"):
        WorkerGateway(queue=None)  # type: ignore[arg-type]
