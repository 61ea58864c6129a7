"""The ripples.v1.Worker service of a coordinator: every call goes to the active run.

The coordinator serves one run at a time (coordinator/run_queue.py), and a worker's
RPCs (Register, Heartbeat, the group stream, ...) address that run. The gateway serves
the whole Worker service with one handler per RPC, made from the service's descriptor:
each looks up the active run and calls its `CoordinatorService` method of the same name
with the request (or the request stream) and the call's context, unchanged; the method
answers, streams or aborts the call itself. An RPC added to the service needs a method
on CoordinatorService and nothing here (a missing one fails at the server's start).

When no run is active:
- a request that names its run (Register's run_id: a worker joining) is refused with
  FAILED_PRECONDITION, as it is when it names another run than the active one (a worker
  an agent started for a run that has ended, or not begun);
- every other call names a worker id (or opens a group stream) and gets NOT_FOUND, as a
  worker unknown to the active run does: its run ended, so it leaves at once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import MethodDescriptor
from google.protobuf.message_factory import GetMessageClass

from ripples.coordinator.history import state_name
from ripples.coordinator.run_queue import RunQueue
from ripples.coordinator.service import CoordinatorService
from ripples.v1 import coordinator_pb2 as pb
from ripples.v1 import coordinator_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Worker"]
"""The service the gateway serves, ripples.v1.Worker."""

_HANDLER_SHAPES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}
"""The handler maker for (client streaming, server streaming)."""


class WorkerGateway:
    """The Worker service's handlers, each reaching the active run's service."""

    def __init__(self, queue: RunQueue) -> None:
        # The generated base class has every RPC (answering UNIMPLEMENTED): the run's
        # service must define each one itself.
        missing = [m.name for m in SERVICE.methods
                   if getattr(CoordinatorService, m.name, None)
                   in (None, getattr(pb_grpc.WorkerServicer, m.name, None))]
        if missing:
            raise TypeError(f"CoordinatorService lacks the {SERVICE.full_name} RPCs "
                            f"{', '.join(missing)}")
        self.queue = queue
        self.handlers = {m.name: self._handler(m) for m in SERVICE.methods}
        """The method handlers by RPC name."""

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Serve the Worker service on `server` (as a generated add_*_to_server does)."""
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE.full_name, self.handlers),))
        server.add_registered_method_handlers(SERVICE.full_name, self.handlers)

    def _handler(self, method: MethodDescriptor) -> grpc.RpcMethodHandler:
        name = method.name
        names_run = (not method.client_streaming
                     and "run_id" in method.input_type.fields_by_name)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            service = await self._service(request if names_run else None, context)
            result = getattr(service, name)(request, context)
            if inspect.isasyncgen(result):  # a streaming reply as a generator
                async for reply in result:
                    await context.write(reply)
                return None
            return await result  # a reply, or None: the method wrote its stream itself

        make = _HANDLER_SHAPES[(method.client_streaming, method.server_streaming)]
        return make(handle,
                    request_deserializer=GetMessageClass(method.input_type).FromString,
                    response_serializer=GetMessageClass(method.output_type).SerializeToString)

    async def _service(self, joining: Any, context: grpc.aio.ServicerContext
                       ) -> CoordinatorService:
        """The active run's service (`joining`: the request of a call that names its run,
        else None); the call is aborted when there is none, or the run named is not it."""
        active = self.queue.active
        if active is None:
            code = (grpc.StatusCode.FAILED_PRECONDITION if joining is not None
                    else grpc.StatusCode.NOT_FOUND)
            await context.abort(code, self.queue.inactive_reason())
        assert active is not None
        run_id = joining.run_id if joining is not None else ""
        if run_id and run_id != active.info.run_id:
            known = self.queue.history.get(run_id)
            why = f"it is {state_name(known.state)}" if known is not None else "no such run"
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, (
                f"this worker was started for run {run_id}, and {why}; the active "
                f"run is {active.info.run_id}"))
        return active.service
