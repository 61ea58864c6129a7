"""The dashboard's JSON API types: they document the API in its OpenAPI schema, and
responses are validated against them. A number a worker reports may be null: one that is
not finite (NaN, infinite) is served as null (view.to_json)."""

from __future__ import annotations

from pydantic import BaseModel, Field

from ripples.dashboard.view import MAX_COMPLETE_GRAPH_WORKERS, MAX_HOST_NODES, MAX_WORKER_DETAIL


class RunInfo(BaseModel):
    run_id: str
    name: str = Field(description="The run's name in the coordinator service")
    state: str = Field(description="queued, running, finished, failed, stopped or cancelled")
    protocol: str
    task: str
    num_workers: int = Field(description="Workers the run waits for before it starts")
    workers_per_node: int
    group_size: int
    target_loss: float | None
    started: bool
    stopped: bool
    stop_reason: str
    elapsed_seconds: float = Field(description="Since training started")
    mean_loss: float | None = Field(description="Mean of the live workers' training losses")
    time_to_target_seconds: float | None
    groups_formed: int
    groups_executing: int
    groups_pending: int = Field(description="Groups in the pending queue")
    conflicts: int = Field(description="Groups that overlapped an unfinished group")
    pending_waits: int
    groups_cancelled: int
    groups_failed: int
    lease_expirations: int
    metrics_address: str = Field(description="HOST:PORT of the coordinator's /metrics and /sd")


class WorkerView(BaseModel):
    worker_id: int
    host: str
    local_rank: int
    rank: int
    device: str
    state: str = Field(description="registered, computing, waiting, reducing, left, expired "
                                   "or failed")
    iteration: int
    planned_iterations: int
    loss: float | None
    iterations_per_second: float | None = Field(description="Over the last few seconds")
    slow: bool = Field(description="Below half the median speed of the live workers")
    request_count: int = Field(description="Group requests: the slowdown counter c_w")
    compute_seconds: float | None
    wait_seconds: float | None
    preduce_seconds: float | None
    error: str
    metrics_address: str


class HostView(BaseModel):
    host: str
    worker_ids: list[int]


class Edge(BaseModel):
    a: int
    b: int
    weight: float = Field(description="1 for a fixed topology; recency of the last shared "
                                      "group (1 = now, 0 = forgotten) for generated groups")


class HostNode(BaseModel):
    """A node of the aggregated topology: one host, or a run of consecutive hosts."""

    label: str = Field(description="The host's name, or the first and last of the run")
    hosts: int
    workers: int
    live: int
    slow: int = Field(description="Live workers below half the median speed")
    min_iteration: int | None = Field(description="The live worker furthest behind")
    mean_iteration: float
    mean_loss: float | None


class NodeEdge(BaseModel):
    a: int = Field(description="Index into `nodes`")
    b: int
    weight: float = Field(description="The brightest of the worker pairs it stands for")
    pairs: int = Field(description="Worker pairs between the two nodes it stands for")


class TopologyView(BaseModel):
    mode: str = Field(description="`workers`: the snapshot's workers, hosts and edges are "
                                  "drawn; `hosts`: past "
                                  f"{MAX_WORKER_DETAIL} workers, these nodes and edges")
    nodes: list[HostNode] = Field(description=f"At most {MAX_HOST_NODES}")
    edges: list[NodeEdge]


class GroupView(BaseModel):
    group_id: int
    members: list[int]
    initiator: int
    state: str = Field(description="pending, executing or finished")
    age_seconds: float


class LossPoint(BaseModel):
    seconds: float
    loss: float | None


class Snapshot(BaseModel):
    connected: bool = Field(description="False while the coordinator cannot be reached; the "
                                        "rest is then the last known state")
    error: str
    coordinator: str
    updated_at: float = Field(description="Unix time of this snapshot")
    run: RunInfo | None
    workers: list[WorkerView] = Field(description=f"Every worker up to {MAX_WORKER_DETAIL}; "
                                                  "past it that many, the departed, the slow "
                                                  "and the furthest behind first")
    workers_total: int = Field(description="Workers the run status counts (departed "
                               "included; it lists at most 2,000)")
    workers_live: int
    workers_note: str = Field(description="Why `workers` lists fewer than workers_total")
    topology: TopologyView
    hosts: list[HostView] = Field(description="Empty in the `hosts` topology mode")
    edges: list[Edge]
    edges_note: str = Field(description="What the topology drawing leaves out (a complete "
                                        "graph's pairs above "
                                        f"{MAX_COMPLETE_GRAPH_WORKERS} live workers); empty "
                                        "when every edge is drawn")
    active_groups: list[GroupView]
    recent_groups: list[GroupView]
    groups_note: str = Field(description="What the list of groups says while it is empty "
                                         "(the protocol's hint, e.g. that it forms its "
                                         "groups without the coordinator)")
    loss_curve: list[LossPoint]
    worker_loss_curves: dict[str, list[LossPoint]]


class RunRow(BaseModel):
    """One run of the coordinator service's history."""

    run_id: str
    name: str
    state: str = Field(description="queued, running, finished, failed, stopped or cancelled")
    protocol: str
    workers: int
    task: str
    command: list[str]
    submitted_at: float = Field(description="Unix time")
    started_at: float | None
    ended_at: float | None
    stop_reason: str
    model_path: str = Field(description="HOST:PATH of the consensus model (empty: none)")
    queue_position: int | None
    mean_loss: float | None
    mean_iterations: float
    elapsed_seconds: float


class AgentRow(BaseModel):
    """One host agent."""

    agent_id: int
    host: str
    slots: int
    devices: list[str]
    memory_bytes: int
    run_id: str
    processes: int
    seen_seconds_ago: float
    draining: bool


class RunList(BaseModel):
    connected: bool
    error: str
    runs: list[RunRow] = Field(description="Newest first")
    agents: list[AgentRow]
