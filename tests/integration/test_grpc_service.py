"""The coordinator's gRPC service, exercised through real clients on loopback."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from helpers import running_coordinator

from ripples.coordinator.core import Deliveries
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorCallError, CoordinatorClient


def _register(client: CoordinatorClient, n: int, host: str = "node0") -> list[int]:
    return [client.register(host, i, "cpu", 1000 + i).worker_id for i in range(n)]


def _wait_for_status(client: CoordinatorClient, done: Callable[[pb.RunStatus], bool],
                     timeout_seconds: float = 5.0) -> pb.RunStatus:
    deadline = time.monotonic() + timeout_seconds
    while not done(status := client.run_status()):
        assert time.monotonic() < deadline, f"status never got there: {status}"
        time.sleep(0.02)
    return status


def _start_all(
    client: CoordinatorClient, ids: list[int], planned: int = 100,
    schemas: list[pb.TensorSchema | None] | None = None,
) -> list[pb.Membership]:
    """Every worker learns the membership, then declares itself ready; returns the
    memberships once training started."""
    def start(index: int) -> pb.Membership:
        membership = client.await_members(ids[index], 10.0)
        client.await_start(ids[index], planned, 10.0, schemas[index] if schemas else None)
        return membership

    with ThreadPoolExecutor(len(ids)) as pool:
        return list(pool.map(start, range(len(ids))))


def test_register_heartbeat_leave_and_status() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-smart") as server:
        client = CoordinatorClient(server.address)
        reg = client.register("node0", 0, "cpu", 42)
        assert reg.config.protocol == "ripples-smart"
        assert reg.store_port > 0
        client.heartbeat(reg.worker_id, pb.Progress(iteration=0))
        status = client.run_status()
        assert [w.state for w in status.workers] == [pb.WORKER_STATE_REGISTERED]
        assert not status.started
        client.leave(reg.worker_id, pb.Progress())
        assert client.run_status().workers[0].state == pb.WORKER_STATE_LEFT
        client.close()


@pytest.mark.parametrize(
    ("call", "code"),
    [
        (lambda c: c.heartbeat(999, pb.Progress()), grpc.StatusCode.NOT_FOUND),
        (lambda c: c.register("", 0, "cpu", 1), grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.checkpoint(999, 0), grpc.StatusCode.NOT_FOUND),
    ],
)
def test_bad_requests_get_status_codes(call, code) -> None:  # type: ignore[no-untyped-def]
    with running_coordinator(num_workers=2) as server:
        client = CoordinatorClient(server.address)
        with pytest.raises(CoordinatorCallError) as err:
            call(client)
        assert err.value.code == code
        client.close()


def test_duplicate_and_excess_registrations_are_refused() -> None:
    with running_coordinator(num_workers=2) as server:
        client = CoordinatorClient(server.address)
        client.register("node0", 0, "cpu", 1)
        with pytest.raises(CoordinatorCallError, match="already registered") as err:
            client.register("node0", 0, "cpu", 2)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        client.register("node0", 1, "cpu", 3)
        with pytest.raises(CoordinatorCallError, match="already has its 2 workers"):
            client.register("node1", 0, "cpu", 4)
        client.close()


def test_await_start_times_out_with_a_message() -> None:
    with running_coordinator(num_workers=3) as server:
        client = CoordinatorClient(server.address)
        wid = client.register("node0", 0, "cpu", 1).worker_id
        with pytest.raises(CoordinatorCallError, match="1 of 3 workers registered") as err:
            client.await_start(wid, 10, 0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(CoordinatorCallError, match="1 of 3 workers registered") as err:
            client.await_members(wid, 0.5)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        client.close()


def test_await_members_gives_ranks_once_all_registered_then_ready_starts_the_run() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-smart", group_size=2) as server:
        client = CoordinatorClient(server.address)
        first = client.register("node1", 0, "cpu", 1).worker_id
        with pytest.raises(CoordinatorCallError, match="1 of 2 workers registered") as err:
            client.await_members(first, 0.3)
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        second = client.register("node0", 0, "cpu", 2).worker_id
        membership = client.await_members(first, 5.0)
        assert membership.num_workers == 2 and membership.rank == 1  # node0 sorts first
        assert not client.run_status().started  # ranks are final, the clock not yet
        starts = _start_all(client, [first, second])
        assert [m.rank for m in starts] == [1, 0]
        assert client.run_status().started
        client.close()


def _tensor_schema(*shapes: tuple[int, ...]) -> pb.TensorSchema:
    tensors = [pb.TensorSpec(name=f"param:{i}", shape=list(shape), dtype="float32")
               for i, shape in enumerate(shapes)]
    return pb.TensorSchema(tensors=tensors, digest=repr(shapes))


def test_a_worker_with_other_tensors_is_refused_and_the_others_learn_why() -> None:
    with running_coordinator(num_workers=2) as server:
        client = CoordinatorClient(server.address)
        a, b = _register(client, 2)
        client.await_members(a, 5.0)
        done: list[BaseException] = []

        def first_ready() -> None:
            try:
                client.await_start(a, 10, 10.0, _tensor_schema((4, 2), (4,)))
            except CoordinatorCallError as err:
                done.append(err)

        waiter = threading.Thread(target=first_ready)
        waiter.start()
        _wait_for_status(client, lambda s: any(w.worker_id == a for w in s.workers))
        time.sleep(0.2)  # a is ready and waits
        with pytest.raises(CoordinatorCallError, match=r"tensor 0 is 'param:0' float32 \[4, 3\]"
                           ) as err:
            client.await_start(b, 10, 10.0, _tensor_schema((4, 3), (4,)))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        client.leave(b, pb.Progress(), str(err.value))  # the refused worker fails
        waiter.join(10.0)
        assert done and "before training started" in str(done[0])
        assert done[0].code == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        client.close()


def test_check_schema_compares_the_full_tensors_after_the_first_step() -> None:
    with running_coordinator(num_workers=2) as server:
        client = CoordinatorClient(server.address)
        ids = _register(client, 2)
        _start_all(client, ids, schemas=[_tensor_schema((4,))] * 2)
        client.check_schema(ids[0], _tensor_schema((4,), (4,)))
        with pytest.raises(CoordinatorCallError, match="lacks 1 tensor") as err:
            client.check_schema(ids[1], _tensor_schema((4,)))
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        client.close()


def test_group_reaches_all_members_at_once_and_release_frees_them() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-smart", group_size=2) as server:
        client = CoordinatorClient(server.address)
        a, b = _register(client, 2)
        starts = _start_all(client, [a, b])
        assert sorted(s.rank for s in starts) == [0, 1]
        sa, sb = client.open_group_stream(a), client.open_group_stream(b)
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(sa.request, 1, 5.0)
            time.sleep(0.2)
            assert not fa.done(), "a group is delivered only once every member asked"
            fb = pool.submit(sb.request, 1, 5.0)
            ra, rb = fa.result(), fb.result()
        assert ra.outcome == rb.outcome == pb.GROUP_OUTCOME_GROUP
        assert ra.group.group_id == rb.group.group_id
        assert list(ra.group.members) == [a, b]
        assert ra.group.create_comm
        status = client.run_status()
        assert status.num_groups_executing == 1
        assert {w.state for w in status.workers} == {pb.WORKER_STATE_REDUCING}
        sa.release(ra.group.group_id, ok=True)
        sb.release(rb.group.group_id, ok=True)  # one-way: the status shows it shortly
        status = _wait_for_status(client, lambda st: st.num_groups_executing == 0)
        assert status.num_groups_formed == 1
        assert {w.state for w in status.workers} == {pb.WORKER_STATE_COMPUTING}
        sa.close()
        sb.close()
        client.close()


def test_wait_runs_out_with_retry_then_peer_arrives() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-smart", group_size=2) as server:
        client = CoordinatorClient(server.address)
        a, b = _register(client, 2)
        _start_all(client, [a, b])
        sa, sb = client.open_group_stream(a), client.open_group_stream(b)
        reply = sa.request(1, 0.3)
        assert reply.outcome == pb.GROUP_OUTCOME_RETRY
        assert f"[{b}]" in reply.detail  # says whom the group waits for
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(sa.request, 1, 5.0)
            rb = sb.request(1, 5.0)
            assert fa.result().group.group_id == rb.group.group_id
        sa.close()
        sb.close()
        client.close()


def test_lease_expiry_cancels_the_group_and_tells_the_waiting_member() -> None:
    with running_coordinator(num_workers=3, protocol="ripples-smart", group_size=3,
                             lease_seconds=1.5, heartbeat_interval_seconds=0.2) as server:
        client = CoordinatorClient(server.address)
        ids = _register(client, 3)
        _start_all(client, ids)
        alive = threading.Event()

        def keep_alive(wid: int) -> None:
            while not alive.is_set():
                client.heartbeat(wid, pb.Progress(iteration=1))
                time.sleep(0.2)

        threads = [threading.Thread(target=keep_alive, args=(w,)) for w in ids[:2]]
        for t in threads:
            t.start()
        try:
            t0 = time.monotonic()
            stream = client.open_group_stream(ids[0])
            reply = stream.request(1, 8.0)  # ids[2] never comes: its lease runs out
            stream.close()
            assert reply.outcome == pb.GROUP_OUTCOME_CANCELLED
            assert f"rank 2 (worker {ids[2]}) expired" in reply.detail
            assert time.monotonic() - t0 < 5.0
        finally:
            alive.set()
            for t in threads:
                t.join()
        status = client.run_status()
        dead = next(w for w in status.workers if w.worker_id == ids[2])
        assert dead.state == pb.WORKER_STATE_EXPIRED
        assert status.num_lease_expirations == 1
        assert status.num_groups_cancelled >= 1
        with pytest.raises(CoordinatorCallError) as err:
            client.heartbeat(ids[2], pb.Progress())
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        client.close()


def test_the_lease_reaper_survives_errors_and_still_expires_silent_workers(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    with running_coordinator(num_workers=3, lease_seconds=0.5,
                             heartbeat_interval_seconds=0.1) as server:
        assert server.service is not None
        core = server.service.core
        expire_leases = core.expire_leases
        injected: list[float] = []

        def failing_twice(now: float) -> Deliveries:
            if len(injected) < 2:
                injected.append(now)
                raise RuntimeError("injected reaper failure")
            return expire_leases(now)

        monkeypatch.setattr(core, "expire_leases", failing_twice)
        client = CoordinatorClient(server.address)
        _register(client, 2)  # and never heard of again
        status = _wait_for_status(client, lambda s: [w.state for w in s.workers]
                                  == [pb.WORKER_STATE_EXPIRED] * 2, timeout_seconds=30)
        client.close()
        assert len(injected) == 2 and status.num_lease_expirations == 2
        with urllib.request.urlopen(f"http://{server.metrics_address}/metrics") as reply:
            metrics = reply.read().decode()
        assert 'ripples_coordinator_background_errors_total{task="lease-reaper"} 2.0' in metrics
        assert "background task lease-reaper failed" in caplog.text
        assert "RuntimeError: injected reaper failure" in caplog.text  # the traceback


def test_stop_run_releases_waiting_workers() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-random", group_size=2) as server:
        client = CoordinatorClient(server.address)
        a, b = _register(client, 2)
        _start_all(client, [a, b])
        sa, sb = client.open_group_stream(a), client.open_group_stream(b)
        with ThreadPoolExecutor(1) as pool:
            fa = pool.submit(sa.request, 1, 5.0)
            time.sleep(0.2)
            client.stop_run("test says stop")
            assert fa.result().outcome == pb.GROUP_OUTCOME_STOP
        assert sb.request(1, 1.0).outcome == pb.GROUP_OUTCOME_STOP
        sa.close()
        sb.close()
        status = client.run_status()
        assert status.stopped and status.stop_reason == "test says stop"
        client.close()


def test_static_schedule_parameters_and_lockstep_stop() -> None:
    with running_coordinator(num_workers=4, protocol="ripples-static",
                             workers_per_node=2, checkpoint_interval=4) as server:
        client = CoordinatorClient(server.address)
        ids = _register(client, 2, "node1") + _register(client, 2, "node0")
        _start_all(client, ids, planned=1000)
        params = client.static_schedule(ids[0])
        assert (params.num_nodes, params.workers_per_node) == (2, 2)
        assert params.rank == 2  # node1 sorts after node0; local rank 0
        for wid in ids:
            assert client.checkpoint(wid, 0).stop_at_iteration == 0
        client.checkpoint(ids[0], 4)
        client.stop_run("enough")
        stops = {client.checkpoint(w, 4).stop_at_iteration for w in ids}
        assert stops == {8}  # the largest grant given: 4 + interval
        stream = client.open_group_stream(ids[0])
        with pytest.raises(CoordinatorCallError) as err:
            stream.request(1, 1.0)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        stream.close()
        client.close()


def test_static_protocol_rejects_uneven_nodes() -> None:
    with running_coordinator(num_workers=3, protocol="ripples-static",
                             workers_per_node=2) as server:
        client = CoordinatorClient(server.address)
        ids = _register(client, 2, "node0") + _register(client, 1, "node1")
        with pytest.raises(CoordinatorCallError, match="exactly 2 workers on every host"):
            _start_all(client, ids)
        client.close()


def test_a_stream_serves_one_worker_and_breaks_for_good_on_a_refusal() -> None:
    with running_coordinator(num_workers=2, protocol="ripples-smart", group_size=2) as server:
        client = CoordinatorClient(server.address)
        a, b = _register(client, 2)
        _start_all(client, [a, b])
        stream = client.open_group_stream(a)
        assert stream.request(1, 0.2).outcome == pb.GROUP_OUTCOME_RETRY
        stream.worker_id = b  # a buggy client: the next message names another worker
        with pytest.raises(CoordinatorCallError, match="belongs to worker") as err:
            stream.request(1, 0.2)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(CoordinatorCallError, match="belongs to worker"):
            stream.release(1, ok=True)  # the stream stays broken
        stream.close()
        unknown = client.open_group_stream(999)
        with pytest.raises(CoordinatorCallError) as err:
            unknown.request(1, 0.2)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        unknown.close()
        client.close()
