from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GroupState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_STATE_UNSPECIFIED: _ClassVar[GroupState]
    GROUP_STATE_PENDING: _ClassVar[GroupState]
    GROUP_STATE_EXECUTING: _ClassVar[GroupState]
    GROUP_STATE_FINISHED: _ClassVar[GroupState]

class GroupOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_OUTCOME_UNSPECIFIED: _ClassVar[GroupOutcome]
    GROUP_OUTCOME_GROUP: _ClassVar[GroupOutcome]
    GROUP_OUTCOME_STOP: _ClassVar[GroupOutcome]
    GROUP_OUTCOME_CANCELLED: _ClassVar[GroupOutcome]
    GROUP_OUTCOME_NO_GROUP: _ClassVar[GroupOutcome]
    GROUP_OUTCOME_RETRY: _ClassVar[GroupOutcome]

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_STATE_UNSPECIFIED: _ClassVar[WorkerState]
    WORKER_STATE_REGISTERED: _ClassVar[WorkerState]
    WORKER_STATE_COMPUTING: _ClassVar[WorkerState]
    WORKER_STATE_WAITING: _ClassVar[WorkerState]
    WORKER_STATE_REDUCING: _ClassVar[WorkerState]
    WORKER_STATE_LEFT: _ClassVar[WorkerState]
    WORKER_STATE_EXPIRED: _ClassVar[WorkerState]
    WORKER_STATE_FAILED: _ClassVar[WorkerState]

class RunState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RUN_STATE_UNSPECIFIED: _ClassVar[RunState]
    RUN_STATE_QUEUED: _ClassVar[RunState]
    RUN_STATE_RUNNING: _ClassVar[RunState]
    RUN_STATE_FINISHED: _ClassVar[RunState]
    RUN_STATE_FAILED: _ClassVar[RunState]
    RUN_STATE_STOPPED: _ClassVar[RunState]
    RUN_STATE_CANCELLED: _ClassVar[RunState]
GROUP_STATE_UNSPECIFIED: GroupState
GROUP_STATE_PENDING: GroupState
GROUP_STATE_EXECUTING: GroupState
GROUP_STATE_FINISHED: GroupState
GROUP_OUTCOME_UNSPECIFIED: GroupOutcome
GROUP_OUTCOME_GROUP: GroupOutcome
GROUP_OUTCOME_STOP: GroupOutcome
GROUP_OUTCOME_CANCELLED: GroupOutcome
GROUP_OUTCOME_NO_GROUP: GroupOutcome
GROUP_OUTCOME_RETRY: GroupOutcome
WORKER_STATE_UNSPECIFIED: WorkerState
WORKER_STATE_REGISTERED: WorkerState
WORKER_STATE_COMPUTING: WorkerState
WORKER_STATE_WAITING: WorkerState
WORKER_STATE_REDUCING: WorkerState
WORKER_STATE_LEFT: WorkerState
WORKER_STATE_EXPIRED: WorkerState
WORKER_STATE_FAILED: WorkerState
RUN_STATE_UNSPECIFIED: RunState
RUN_STATE_QUEUED: RunState
RUN_STATE_RUNNING: RunState
RUN_STATE_FINISHED: RunState
RUN_STATE_FAILED: RunState
RUN_STATE_STOPPED: RunState
RUN_STATE_CANCELLED: RunState

class ConsensusRequest(_message.Message):
    __slots__ = ("timeout_seconds",)
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    timeout_seconds: float
    def __init__(self, timeout_seconds: _Optional[float] = ...) -> None: ...

class ConsensusChunk(_message.Message):
    __slots__ = ("info", "model", "data")
    INFO_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    info: ConsensusInfo
    model: PublishedModel
    data: bytes
    def __init__(self, info: _Optional[_Union[ConsensusInfo, _Mapping]] = ..., model: _Optional[_Union[PublishedModel, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ConsensusInfo(_message.Message):
    __slots__ = ("consensus_id", "workers", "seconds")
    CONSENSUS_ID_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    consensus_id: int
    workers: _containers.RepeatedScalarFieldContainer[int]
    seconds: float
    def __init__(self, consensus_id: _Optional[int] = ..., workers: _Optional[_Iterable[int]] = ..., seconds: _Optional[float] = ...) -> None: ...

class PublishedModel(_message.Message):
    __slots__ = ("worker", "size_bytes")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker: int
    size_bytes: int
    def __init__(self, worker: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class RunConfig(_message.Message):
    __slots__ = ("run_id", "protocol", "task", "num_workers", "workers_per_node", "iterations", "epochs", "target_loss", "seed", "collective_timeout_seconds", "heartbeat_interval_seconds", "lease_seconds", "checkpoint_interval", "batch_size", "learning_rate", "average_optimizer_state", "topology", "group_generator", "gossip", "hop", "lpp", "coordinator_outage_seconds", "final_average", "outage_local_steps", "root", "inter_period", "local_steps", "outer_optimizer", "outer_lr", "outer_momentum", "outer_compression")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    EPOCHS_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOSS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    AVERAGE_OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_FIELD_NUMBER: _ClassVar[int]
    GROUP_GENERATOR_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    HOP_FIELD_NUMBER: _ClassVar[int]
    LPP_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_OUTAGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FINAL_AVERAGE_FIELD_NUMBER: _ClassVar[int]
    OUTAGE_LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    INTER_PERIOD_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    OUTER_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OUTER_LR_FIELD_NUMBER: _ClassVar[int]
    OUTER_MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    OUTER_COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    protocol: str
    task: str
    num_workers: int
    workers_per_node: int
    iterations: int
    epochs: float
    target_loss: float
    seed: int
    collective_timeout_seconds: float
    heartbeat_interval_seconds: float
    lease_seconds: float
    checkpoint_interval: int
    batch_size: int
    learning_rate: float
    average_optimizer_state: bool
    topology: str
    group_generator: GroupGeneratorSettings
    gossip: GossipSettings
    hop: HopSettings
    lpp: LppSettings
    coordinator_outage_seconds: float
    final_average: bool
    outage_local_steps: int
    root: str
    inter_period: int
    local_steps: int
    outer_optimizer: str
    outer_lr: float
    outer_momentum: float
    outer_compression: str
    def __init__(self, run_id: _Optional[str] = ..., protocol: _Optional[str] = ..., task: _Optional[str] = ..., num_workers: _Optional[int] = ..., workers_per_node: _Optional[int] = ..., iterations: _Optional[int] = ..., epochs: _Optional[float] = ..., target_loss: _Optional[float] = ..., seed: _Optional[int] = ..., collective_timeout_seconds: _Optional[float] = ..., heartbeat_interval_seconds: _Optional[float] = ..., lease_seconds: _Optional[float] = ..., checkpoint_interval: _Optional[int] = ..., batch_size: _Optional[int] = ..., learning_rate: _Optional[float] = ..., average_optimizer_state: _Optional[bool] = ..., topology: _Optional[str] = ..., group_generator: _Optional[_Union[GroupGeneratorSettings, _Mapping]] = ..., gossip: _Optional[_Union[GossipSettings, _Mapping]] = ..., hop: _Optional[_Union[HopSettings, _Mapping]] = ..., lpp: _Optional[_Union[LppSettings, _Mapping]] = ..., coordinator_outage_seconds: _Optional[float] = ..., final_average: _Optional[bool] = ..., outage_local_steps: _Optional[int] = ..., root: _Optional[str] = ..., inter_period: _Optional[int] = ..., local_steps: _Optional[int] = ..., outer_optimizer: _Optional[str] = ..., outer_lr: _Optional[float] = ..., outer_momentum: _Optional[float] = ..., outer_compression: _Optional[str] = ...) -> None: ...

class GroupGeneratorSettings(_message.Message):
    __slots__ = ("group_size", "c_thres", "inter_intra", "overlap", "sync_share")
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    C_THRES_FIELD_NUMBER: _ClassVar[int]
    INTER_INTRA_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_FIELD_NUMBER: _ClassVar[int]
    SYNC_SHARE_FIELD_NUMBER: _ClassVar[int]
    group_size: int
    c_thres: int
    inter_intra: bool
    overlap: bool
    sync_share: float
    def __init__(self, group_size: _Optional[int] = ..., c_thres: _Optional[int] = ..., inter_intra: _Optional[bool] = ..., overlap: _Optional[bool] = ..., sync_share: _Optional[float] = ...) -> None: ...

class GossipSettings(_message.Message):
    __slots__ = ("rate_com", "momentum", "adpsgd_mode")
    RATE_COM_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    ADPSGD_MODE_FIELD_NUMBER: _ClassVar[int]
    rate_com: float
    momentum: bool
    adpsgd_mode: str
    def __init__(self, rate_com: _Optional[float] = ..., momentum: _Optional[bool] = ..., adpsgd_mode: _Optional[str] = ...) -> None: ...

class HopSettings(_message.Message):
    __slots__ = ("mode", "max_ig", "backup_workers", "staleness", "max_jump", "skip_threshold")
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_IG_FIELD_NUMBER: _ClassVar[int]
    BACKUP_WORKERS_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MAX_JUMP_FIELD_NUMBER: _ClassVar[int]
    SKIP_THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    mode: str
    max_ig: int
    backup_workers: int
    staleness: int
    max_jump: int
    skip_threshold: int
    def __init__(self, mode: _Optional[str] = ..., max_ig: _Optional[int] = ..., backup_workers: _Optional[int] = ..., staleness: _Optional[int] = ..., max_jump: _Optional[int] = ..., skip_threshold: _Optional[int] = ...) -> None: ...

class LppSettings(_message.Message):
    __slots__ = ("updaters", "averaging", "sync_period", "full_fraction")
    UPDATERS_FIELD_NUMBER: _ClassVar[int]
    AVERAGING_FIELD_NUMBER: _ClassVar[int]
    SYNC_PERIOD_FIELD_NUMBER: _ClassVar[int]
    FULL_FRACTION_FIELD_NUMBER: _ClassVar[int]
    updaters: int
    averaging: str
    sync_period: int
    full_fraction: float
    def __init__(self, updaters: _Optional[int] = ..., averaging: _Optional[str] = ..., sync_period: _Optional[int] = ..., full_fraction: _Optional[float] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("host", "local_rank", "device", "pid", "metrics_port", "metrics_host", "run_id")
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_HOST_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    host: str
    local_rank: int
    device: str
    pid: int
    metrics_port: int
    metrics_host: str
    run_id: str
    def __init__(self, host: _Optional[str] = ..., local_rank: _Optional[int] = ..., device: _Optional[str] = ..., pid: _Optional[int] = ..., metrics_port: _Optional[int] = ..., metrics_host: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("worker_id", "config", "store_host", "store_port")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    config: RunConfig
    store_host: str
    store_port: int
    def __init__(self, worker_id: _Optional[int] = ..., config: _Optional[_Union[RunConfig, _Mapping]] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ...) -> None: ...

class Progress(_message.Message):
    __slots__ = ("iteration", "loss", "samples", "compute_seconds", "wait_seconds", "preduce_seconds", "planned_iterations", "checkpoint_step", "collective_wait_seconds", "preduce_bytes", "collective")
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_STEP_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PREDUCE_BYTES_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_FIELD_NUMBER: _ClassVar[int]
    iteration: int
    loss: float
    samples: int
    compute_seconds: float
    wait_seconds: float
    preduce_seconds: float
    planned_iterations: int
    checkpoint_step: int
    collective_wait_seconds: float
    preduce_bytes: int
    collective: str
    def __init__(self, iteration: _Optional[int] = ..., loss: _Optional[float] = ..., samples: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., wait_seconds: _Optional[float] = ..., preduce_seconds: _Optional[float] = ..., planned_iterations: _Optional[int] = ..., checkpoint_step: _Optional[int] = ..., collective_wait_seconds: _Optional[float] = ..., preduce_bytes: _Optional[int] = ..., collective: _Optional[str] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "progress")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    progress: Progress
    def __init__(self, worker_id: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("stop", "stop_reason", "mean_iterations", "incarnation", "restart", "restart_reason", "consensus_id", "members_lost")
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RESTART_FIELD_NUMBER: _ClassVar[int]
    RESTART_REASON_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_LOST_FIELD_NUMBER: _ClassVar[int]
    stop: bool
    stop_reason: str
    mean_iterations: float
    incarnation: int
    restart: bool
    restart_reason: str
    consensus_id: int
    members_lost: bool
    def __init__(self, stop: _Optional[bool] = ..., stop_reason: _Optional[str] = ..., mean_iterations: _Optional[float] = ..., incarnation: _Optional[int] = ..., restart: _Optional[bool] = ..., restart_reason: _Optional[str] = ..., consensus_id: _Optional[int] = ..., members_lost: _Optional[bool] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("worker_id", "progress", "error", "reason", "done")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    progress: Progress
    error: str
    reason: str
    done: bool
    def __init__(self, worker_id: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., error: _Optional[str] = ..., reason: _Optional[str] = ..., done: _Optional[bool] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ("restart", "restart_reason")
    RESTART_FIELD_NUMBER: _ClassVar[int]
    RESTART_REASON_FIELD_NUMBER: _ClassVar[int]
    restart: bool
    restart_reason: str
    def __init__(self, restart: _Optional[bool] = ..., restart_reason: _Optional[str] = ...) -> None: ...

class AwaitMembersRequest(_message.Message):
    __slots__ = ("worker_id", "timeout_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    timeout_seconds: float
    def __init__(self, worker_id: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class TensorSchema(_message.Message):
    __slots__ = ("tensors", "digest")
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    digest: str
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., digest: _Optional[str] = ...) -> None: ...

class AwaitStartRequest(_message.Message):
    __slots__ = ("worker_id", "timeout_seconds", "planned_iterations", "schema", "model_fingerprint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PLANNED_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    timeout_seconds: float
    planned_iterations: int
    schema: TensorSchema
    model_fingerprint: str
    def __init__(self, worker_id: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., planned_iterations: _Optional[int] = ..., schema: _Optional[_Union[TensorSchema, _Mapping]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class AwaitStartReply(_message.Message):
    __slots__ = ("elapsed_seconds", "differing_ranks")
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DIFFERING_RANKS_FIELD_NUMBER: _ClassVar[int]
    elapsed_seconds: float
    differing_ranks: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, elapsed_seconds: _Optional[float] = ..., differing_ranks: _Optional[_Iterable[int]] = ...) -> None: ...

class CheckSchemaRequest(_message.Message):
    __slots__ = ("worker_id", "schema")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    schema: TensorSchema
    def __init__(self, worker_id: _Optional[int] = ..., schema: _Optional[_Union[TensorSchema, _Mapping]] = ...) -> None: ...

class CheckSchemaReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Membership(_message.Message):
    __slots__ = ("num_workers", "ranks", "rank", "num_nodes", "neighbours", "spectral_gap", "gossip", "replacement", "start_iteration", "generation")
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    SPECTRAL_GAP_FIELD_NUMBER: _ClassVar[int]
    GOSSIP_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    START_ITERATION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    num_workers: int
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerRank]
    rank: int
    num_nodes: int
    neighbours: _containers.RepeatedScalarFieldContainer[int]
    spectral_gap: float
    gossip: GossipConstants
    replacement: bool
    start_iteration: int
    generation: int
    def __init__(self, num_workers: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[WorkerRank, _Mapping]]] = ..., rank: _Optional[int] = ..., num_nodes: _Optional[int] = ..., neighbours: _Optional[_Iterable[int]] = ..., spectral_gap: _Optional[float] = ..., gossip: _Optional[_Union[GossipConstants, _Mapping]] = ..., replacement: _Optional[bool] = ..., start_iteration: _Optional[int] = ..., generation: _Optional[int] = ...) -> None: ...

class GossipConstants(_message.Message):
    __slots__ = ("chi_1", "chi_2", "eta", "alpha_tilde", "passive")
    CHI_1_FIELD_NUMBER: _ClassVar[int]
    CHI_2_FIELD_NUMBER: _ClassVar[int]
    ETA_FIELD_NUMBER: _ClassVar[int]
    ALPHA_TILDE_FIELD_NUMBER: _ClassVar[int]
    PASSIVE_FIELD_NUMBER: _ClassVar[int]
    chi_1: float
    chi_2: float
    eta: float
    alpha_tilde: float
    passive: bool
    def __init__(self, chi_1: _Optional[float] = ..., chi_2: _Optional[float] = ..., eta: _Optional[float] = ..., alpha_tilde: _Optional[float] = ..., passive: _Optional[bool] = ...) -> None: ...

class WorkerRank(_message.Message):
    __slots__ = ("worker_id", "rank", "node")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    rank: int
    node: int
    def __init__(self, worker_id: _Optional[int] = ..., rank: _Optional[int] = ..., node: _Optional[int] = ...) -> None: ...

class Group(_message.Message):
    __slots__ = ("group_id", "members", "initiator", "comm_id", "create_comm", "state", "age_seconds", "heal", "heal_donor")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    INITIATOR_FIELD_NUMBER: _ClassVar[int]
    COMM_ID_FIELD_NUMBER: _ClassVar[int]
    CREATE_COMM_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    HEAL_FIELD_NUMBER: _ClassVar[int]
    HEAL_DONOR_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    members: _containers.RepeatedScalarFieldContainer[int]
    initiator: int
    comm_id: int
    create_comm: bool
    state: GroupState
    age_seconds: float
    heal: bool
    heal_donor: int
    def __init__(self, group_id: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., initiator: _Optional[int] = ..., comm_id: _Optional[int] = ..., create_comm: _Optional[bool] = ..., state: _Optional[_Union[GroupState, str]] = ..., age_seconds: _Optional[float] = ..., heal: _Optional[bool] = ..., heal_donor: _Optional[int] = ...) -> None: ...

class GroupRequest(_message.Message):
    __slots__ = ("worker_id", "iteration", "timeout_seconds", "progress", "listen")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    LISTEN_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    iteration: int
    timeout_seconds: float
    progress: Progress
    listen: bool
    def __init__(self, worker_id: _Optional[int] = ..., iteration: _Optional[int] = ..., timeout_seconds: _Optional[float] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., listen: _Optional[bool] = ...) -> None: ...

class GroupReply(_message.Message):
    __slots__ = ("outcome", "group", "more", "evict_comm_ids", "detail")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    GROUP_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    EVICT_COMM_IDS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    outcome: GroupOutcome
    group: Group
    more: bool
    evict_comm_ids: _containers.RepeatedScalarFieldContainer[int]
    detail: str
    def __init__(self, outcome: _Optional[_Union[GroupOutcome, str]] = ..., group: _Optional[_Union[Group, _Mapping]] = ..., more: _Optional[bool] = ..., evict_comm_ids: _Optional[_Iterable[int]] = ..., detail: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("worker_id", "group_id", "ok", "error", "preduce_seconds", "squared_distance")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    PREDUCE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SQUARED_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    group_id: int
    ok: bool
    error: str
    preduce_seconds: float
    squared_distance: float
    def __init__(self, worker_id: _Optional[int] = ..., group_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., preduce_seconds: _Optional[float] = ..., squared_distance: _Optional[float] = ...) -> None: ...

class SyncMessage(_message.Message):
    __slots__ = ("request", "release")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    request: GroupRequest
    release: ReleaseRequest
    def __init__(self, request: _Optional[_Union[GroupRequest, _Mapping]] = ..., release: _Optional[_Union[ReleaseRequest, _Mapping]] = ...) -> None: ...

class StaticScheduleRequest(_message.Message):
    __slots__ = ("worker_id",)
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    def __init__(self, worker_id: _Optional[int] = ...) -> None: ...

class StaticScheduleReply(_message.Message):
    __slots__ = ("num_nodes", "workers_per_node", "rank", "run_id", "ranks")
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    num_nodes: int
    workers_per_node: int
    rank: int
    run_id: str
    ranks: _containers.RepeatedCompositeFieldContainer[WorkerRank]
    def __init__(self, num_nodes: _Optional[int] = ..., workers_per_node: _Optional[int] = ..., rank: _Optional[int] = ..., run_id: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[WorkerRank, _Mapping]]] = ...) -> None: ...

class CheckpointRequest(_message.Message):
    __slots__ = ("worker_id", "iteration", "progress", "optimizer_state_ready")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_STATE_READY_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    iteration: int
    progress: Progress
    optimizer_state_ready: bool
    def __init__(self, worker_id: _Optional[int] = ..., iteration: _Optional[int] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., optimizer_state_ready: _Optional[bool] = ...) -> None: ...

class CheckpointReply(_message.Message):
    __slots__ = ("stop_at_iteration", "stop_reason", "adopt_state_after_iteration", "consensus_id", "consensus_at_iteration")
    STOP_AT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    ADOPT_STATE_AFTER_ITERATION_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_ID_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_AT_ITERATION_FIELD_NUMBER: _ClassVar[int]
    stop_at_iteration: int
    stop_reason: str
    adopt_state_after_iteration: int
    consensus_id: int
    consensus_at_iteration: int
    def __init__(self, stop_at_iteration: _Optional[int] = ..., stop_reason: _Optional[str] = ..., adopt_state_after_iteration: _Optional[int] = ..., consensus_id: _Optional[int] = ..., consensus_at_iteration: _Optional[int] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("worker_id", "host", "local_rank", "device", "rank", "state", "iteration", "request_count", "loss", "progress", "error", "metrics_address")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ITERATION_FIELD_NUMBER: _ClassVar[int]
    REQUEST_COUNT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    host: str
    local_rank: int
    device: str
    rank: int
    state: WorkerState
    iteration: int
    request_count: int
    loss: float
    progress: Progress
    error: str
    metrics_address: str
    def __init__(self, worker_id: _Optional[int] = ..., host: _Optional[str] = ..., local_rank: _Optional[int] = ..., device: _Optional[str] = ..., rank: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., iteration: _Optional[int] = ..., request_count: _Optional[int] = ..., loss: _Optional[float] = ..., progress: _Optional[_Union[Progress, _Mapping]] = ..., error: _Optional[str] = ..., metrics_address: _Optional[str] = ...) -> None: ...

class LossPoint(_message.Message):
    __slots__ = ("seconds", "loss", "mean_iterations")
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    seconds: float
    loss: float
    mean_iterations: float
    def __init__(self, seconds: _Optional[float] = ..., loss: _Optional[float] = ..., mean_iterations: _Optional[float] = ...) -> None: ...

class RunStatusRequest(_message.Message):
    __slots__ = ("run_id", "all_workers")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    ALL_WORKERS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    all_workers: bool
    def __init__(self, run_id: _Optional[str] = ..., all_workers: _Optional[bool] = ...) -> None: ...

class RunStatus(_message.Message):
    __slots__ = ("config", "workers", "elapsed_seconds", "started", "stopped", "stop_reason", "num_groups_formed", "num_groups_executing", "num_groups_pending", "num_conflicts", "num_pending_waits", "pending_wait_seconds", "num_groups_cancelled", "num_groups_failed", "mean_loss", "time_to_target_seconds", "loss_curve", "recent_groups", "num_lease_expirations", "iterations_to_target", "active_groups", "metrics_address", "topology_edges", "spectral_gap", "consensus_distance", "edges_always_used", "topology_complete", "num_restarts", "restarting", "run", "num_topology_edges", "num_worker_rows", "mean_iterations", "num_live_workers")
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FORMED_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_EXECUTING_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_PENDING_FIELD_NUMBER: _ClassVar[int]
    NUM_CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_WAITS_FIELD_NUMBER: _ClassVar[int]
    PENDING_WAIT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    NUM_GROUPS_FAILED_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_TARGET_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOSS_CURVE_FIELD_NUMBER: _ClassVar[int]
    RECENT_GROUPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASE_EXPIRATIONS_FIELD_NUMBER: _ClassVar[int]
    ITERATIONS_TO_TARGET_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_GROUPS_FIELD_NUMBER: _ClassVar[int]
    METRICS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_EDGES_FIELD_NUMBER: _ClassVar[int]
    SPECTRAL_GAP_FIELD_NUMBER: _ClassVar[int]
    CONSENSUS_DISTANCE_FIELD_NUMBER: _ClassVar[int]
    EDGES_ALWAYS_USED_FIELD_NUMBER: _ClassVar[int]
    TOPOLOGY_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    RESTARTING_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    NUM_TOPOLOGY_EDGES_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKER_ROWS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_LIVE_WORKERS_FIELD_NUMBER: _ClassVar[int]
    config: RunConfig
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    elapsed_seconds: float
    started: bool
    stopped: bool
    stop_reason: str
    num_groups_formed: int
    num_groups_executing: int
    num_groups_pending: int
    num_conflicts: int
    num_pending_waits: int
    pending_wait_seconds: float
    num_groups_cancelled: int
    num_groups_failed: int
    mean_loss: float
    time_to_target_seconds: float
    loss_curve: _containers.RepeatedCompositeFieldContainer[LossPoint]
    recent_groups: _containers.RepeatedCompositeFieldContainer[Group]
    num_lease_expirations: int
    iterations_to_target: float
    active_groups: _containers.RepeatedCompositeFieldContainer[Group]
    metrics_address: str
    topology_edges: _containers.RepeatedCompositeFieldContainer[TopologyEdge]
    spectral_gap: float
    consensus_distance: float
    edges_always_used: bool
    topology_complete: bool
    num_restarts: int
    restarting: str
    run: RunInfo
    num_topology_edges: int
    num_worker_rows: int
    mean_iterations: float
    num_live_workers: int
    def __init__(self, config: _Optional[_Union[RunConfig, _Mapping]] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., elapsed_seconds: _Optional[float] = ..., started: _Optional[bool] = ..., stopped: _Optional[bool] = ..., stop_reason: _Optional[str] = ..., num_groups_formed: _Optional[int] = ..., num_groups_executing: _Optional[int] = ..., num_groups_pending: _Optional[int] = ..., num_conflicts: _Optional[int] = ..., num_pending_waits: _Optional[int] = ..., pending_wait_seconds: _Optional[float] = ..., num_groups_cancelled: _Optional[int] = ..., num_groups_failed: _Optional[int] = ..., mean_loss: _Optional[float] = ..., time_to_target_seconds: _Optional[float] = ..., loss_curve: _Optional[_Iterable[_Union[LossPoint, _Mapping]]] = ..., recent_groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., num_lease_expirations: _Optional[int] = ..., iterations_to_target: _Optional[float] = ..., active_groups: _Optional[_Iterable[_Union[Group, _Mapping]]] = ..., metrics_address: _Optional[str] = ..., topology_edges: _Optional[_Iterable[_Union[TopologyEdge, _Mapping]]] = ..., spectral_gap: _Optional[float] = ..., consensus_distance: _Optional[float] = ..., edges_always_used: _Optional[bool] = ..., topology_complete: _Optional[bool] = ..., num_restarts: _Optional[int] = ..., restarting: _Optional[str] = ..., run: _Optional[_Union[RunInfo, _Mapping]] = ..., num_topology_edges: _Optional[int] = ..., num_worker_rows: _Optional[int] = ..., mean_iterations: _Optional[float] = ..., num_live_workers: _Optional[int] = ...) -> None: ...

class TopologyEdge(_message.Message):
    __slots__ = ("a", "b")
    A_FIELD_NUMBER: _ClassVar[int]
    B_FIELD_NUMBER: _ClassVar[int]
    a: int
    b: int
    def __init__(self, a: _Optional[int] = ..., b: _Optional[int] = ...) -> None: ...

class StopRunRequest(_message.Message):
    __slots__ = ("reason", "run_id")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    reason: str
    run_id: str
    def __init__(self, reason: _Optional[str] = ..., run_id: _Optional[str] = ...) -> None: ...

class StopRunReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class FinalGroupRequest(_message.Message):
    __slots__ = ("worker_id", "timeout_seconds")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    timeout_seconds: float
    def __init__(self, worker_id: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class RunInfo(_message.Message):
    __slots__ = ("run_id", "name", "state", "submitted_at", "started_at", "ended_at", "stop_reason", "protocol", "num_workers", "task", "command", "workdir", "model_path", "queue_position", "mean_loss", "mean_iterations", "elapsed_seconds", "ranks_per_worker")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    SUBMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    ENDED_AT_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    MEAN_LOSS_FIELD_NUMBER: _ClassVar[int]
    MEAN_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    state: RunState
    submitted_at: float
    started_at: float
    ended_at: float
    stop_reason: str
    protocol: str
    num_workers: int
    task: str
    command: _containers.RepeatedScalarFieldContainer[str]
    workdir: str
    model_path: str
    queue_position: int
    mean_loss: float
    mean_iterations: float
    elapsed_seconds: float
    ranks_per_worker: int
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[RunState, str]] = ..., submitted_at: _Optional[float] = ..., started_at: _Optional[float] = ..., ended_at: _Optional[float] = ..., stop_reason: _Optional[str] = ..., protocol: _Optional[str] = ..., num_workers: _Optional[int] = ..., task: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., workdir: _Optional[str] = ..., model_path: _Optional[str] = ..., queue_position: _Optional[int] = ..., mean_loss: _Optional[float] = ..., mean_iterations: _Optional[float] = ..., elapsed_seconds: _Optional[float] = ..., ranks_per_worker: _Optional[int] = ...) -> None: ...

class SubmitRunRequest(_message.Message):
    __slots__ = ("options_json", "name", "command", "workdir", "ranks_per_worker")
    OPTIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    WORKDIR_FIELD_NUMBER: _ClassVar[int]
    RANKS_PER_WORKER_FIELD_NUMBER: _ClassVar[int]
    options_json: str
    name: str
    command: _containers.RepeatedScalarFieldContainer[str]
    workdir: str
    ranks_per_worker: int
    def __init__(self, options_json: _Optional[str] = ..., name: _Optional[str] = ..., command: _Optional[_Iterable[str]] = ..., workdir: _Optional[str] = ..., ranks_per_worker: _Optional[int] = ...) -> None: ...

class ListRunsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_id", "host", "slots", "devices", "memory_bytes", "run_id", "processes", "seen_seconds_ago", "draining")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    SEEN_SECONDS_AGO_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    host: str
    slots: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    memory_bytes: int
    run_id: str
    processes: int
    seen_seconds_ago: float
    draining: bool
    def __init__(self, agent_id: _Optional[int] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., memory_bytes: _Optional[int] = ..., run_id: _Optional[str] = ..., processes: _Optional[int] = ..., seen_seconds_ago: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class RunList(_message.Message):
    __slots__ = ("runs", "agents")
    RUNS_FIELD_NUMBER: _ClassVar[int]
    AGENTS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[RunInfo]
    agents: _containers.RepeatedCompositeFieldContainer[AgentInfo]
    def __init__(self, runs: _Optional[_Iterable[_Union[RunInfo, _Mapping]]] = ..., agents: _Optional[_Iterable[_Union[AgentInfo, _Mapping]]] = ...) -> None: ...

class ProcessReport(_message.Message):
    __slots__ = ("local_rank", "running", "exit_code", "restarts", "model_path", "replica_rank")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_RANK_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    running: bool
    exit_code: int
    restarts: int
    model_path: str
    replica_rank: int
    def __init__(self, local_rank: _Optional[int] = ..., running: _Optional[bool] = ..., exit_code: _Optional[int] = ..., restarts: _Optional[int] = ..., model_path: _Optional[str] = ..., replica_rank: _Optional[int] = ...) -> None: ...

class AgentPollRequest(_message.Message):
    __slots__ = ("agent_id", "host", "slots", "devices", "memory_bytes", "run_id", "processes", "timeout_seconds", "draining")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    host: str
    slots: int
    devices: _containers.RepeatedScalarFieldContainer[str]
    memory_bytes: int
    run_id: str
    processes: _containers.RepeatedCompositeFieldContainer[ProcessReport]
    timeout_seconds: float
    draining: bool
    def __init__(self, agent_id: _Optional[int] = ..., host: _Optional[str] = ..., slots: _Optional[int] = ..., devices: _Optional[_Iterable[str]] = ..., memory_bytes: _Optional[int] = ..., run_id: _Optional[str] = ..., processes: _Optional[_Iterable[_Union[ProcessReport, _Mapping]]] = ..., timeout_seconds: _Optional[float] = ..., draining: _Optional[bool] = ...) -> None: ...

class AgentReply(_message.Message):
    __slots__ = ("agent_id", "run", "num_processes", "first_local_rank", "max_restarts")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_FIELD_NUMBER: _ClassVar[int]
    NUM_PROCESSES_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    MAX_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    agent_id: int
    run: RunInfo
    num_processes: int
    first_local_rank: int
    max_restarts: int
    def __init__(self, agent_id: _Optional[int] = ..., run: _Optional[_Union[RunInfo, _Mapping]] = ..., num_processes: _Optional[int] = ..., first_local_rank: _Optional[int] = ..., max_restarts: _Optional[int] = ...) -> None: ...

class LogBatch(_message.Message):
    __slots__ = ("run_id", "worker", "lines")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    LINES_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker: str
    lines: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, run_id: _Optional[str] = ..., worker: _Optional[str] = ..., lines: _Optional[_Iterable[str]] = ...) -> None: ...

class PushLogsReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLogsRequest(_message.Message):
    __slots__ = ("run_id", "worker", "follow", "tail")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    FOLLOW_FIELD_NUMBER: _ClassVar[int]
    TAIL_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    worker: str
    follow: bool
    tail: int
    def __init__(self, run_id: _Optional[str] = ..., worker: _Optional[str] = ..., follow: _Optional[bool] = ..., tail: _Optional[int] = ...) -> None: ...
