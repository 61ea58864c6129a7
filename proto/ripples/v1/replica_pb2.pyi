from ripples.v1 import coordinator_pb2 as _coordinator_pb2
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReplicaStart(_message.Message):
    __slots__ = ("worker_id", "config", "membership", "store_host", "store_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    MEMBERSHIP_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    config: _coordinator_pb2.RunConfig
    membership: _coordinator_pb2.Membership
    store_host: str
    store_port: int
    def __init__(self, worker_id: _Optional[int] = ..., config: _Optional[_Union[_coordinator_pb2.RunConfig, _Mapping]] = ..., membership: _Optional[_Union[_coordinator_pb2.Membership, _Mapping]] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class ReplicaReply(_message.Message):
    __slots__ = ("reply", "interrupted", "detail", "incarnation")
    REPLY_FIELD_NUMBER: _ClassVar[int]
    INTERRUPTED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    reply: _coordinator_pb2.GroupReply
    interrupted: bool
    detail: str
    incarnation: int
    def __init__(self, reply: _Optional[_Union[_coordinator_pb2.GroupReply, _Mapping]] = ..., interrupted: _Optional[bool] = ..., detail: _Optional[str] = ..., incarnation: _Optional[int] = ...) -> None: ...

class ReplicaStep(_message.Message):
    __slots__ = ("completed", "stop_reason", "consensus")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_FIELD_NUMBER: _ClassVar[int]
    completed: int
    stop_reason: str
    consensus: int
    def __init__(self, completed: _Optional[int] = ..., stop_reason: _Optional[str] = ..., consensus: _Optional[int] = ...) -> None: ...

class ReplicaRound(_message.Message):
    __slots__ = ("completed", "steps")
    COMPLETED_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    completed: int
    steps: int
    def __init__(self, completed: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class ReplicaShard(_message.Message):
    __slots__ = ("schema", "fingerprint")
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    schema: _coordinator_pb2.TensorSchema
    fingerprint: str
    def __init__(self, schema: _Optional[_Union[_coordinator_pb2.TensorSchema, _Mapping]] = ..., fingerprint: _Optional[str] = ...) -> None: ...
