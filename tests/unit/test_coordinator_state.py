"""The coordinator's run state survives a restart: a snapshot of a running core, saved to
the state dir's SQLite database and loaded again, rebuilds a core that goes on with the
same run (workers, ranks, counters, loss curve, time accounting, replacements), and hands
out group and comm ids that the earlier incarnation never did."""

from __future__ import annotations

import json

import pytest

from ripples.coordinator import snapshot
from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Outcome, Progress
from ripples.coordinator.registry import WorkerState
from ripples.coordinator.schema import Schema
from ripples.coordinator.state_store import StateStore

MODEL = Schema(tensors=(("param:w", (4,), "float32"),), digest="model")


def _running(protocol: str = "ripples-smart", **kw: object) -> tuple[CoordinatorCore, list[int]]:
    core = CoordinatorCore(RunSettings(protocol=protocol, num_workers=4, iterations=500, **kw),  # type: ignore[arg-type]
                           now=100.0)
    ids = [core.register(f"node{r}", 0, "cpu", 10 + r, 100.0) for r in range(4)]
    for wid in ids:
        core.mark_ready(wid, 500, 101.0, MODEL)
    t = 101.0
    for i in range(1, 30):
        t += 0.25
        for wid in ids:
            decision, deliveries = core.request_group(
                wid, i, t, Progress(iteration=i, loss=2.0 / i, planned_iterations=500,
                                    compute_seconds=0.1 * i))
            for member, d in [(wid, decision), *deliveries.items()]:
                if d is not None and d.group is not None:
                    core.release(member, d.group.group_id, True, "", t)
    return core, ids


def test_a_restored_core_goes_on_with_the_same_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    core, ids = _running()
    core.leave(ids[3], None, "killed", 109.0)
    joiner = core.register("node9", 0, "cpu", 99, 109.5)
    saved = snapshot.take(core, now=110.0)
    store = StateStore(tmp_path)
    store.save(json.loads(json.dumps(saved)))  # what reaches the disk is plain JSON
    store.close()

    store = StateStore(tmp_path)
    loaded = store.load()
    assert loaded is not None
    again = snapshot.restore(loaded, now=5000.0, incarnation=2)

    assert again.settings.run_id == core.settings.run_id
    assert again.elapsed(5000.0) == pytest.approx(core.elapsed(110.0))
    assert again.loss_curve == core.loss_curve and again.loss_curve
    assert again.mean_iterations() == pytest.approx(core.mean_iterations())
    for wid, w in core.workers.items():
        r = again.workers[wid]
        assert (r.rank, r.state, r.request_count, repr(r.progress), r.replaced_by,
                r.healed) == (
            w.rank, w.state if w.state is WorkerState.FAILED else WorkerState.COMPUTING,
            w.request_count, repr(w.progress), w.replaced_by, w.healed)  # repr: NaN losses
        assert r.lease_expires_at == 5000.0 + again.settings.lease_seconds
    assert again.table.num_formed == core.table.num_formed
    # The run goes on: the healed workers form groups, with ids of the new incarnation.
    decision, deliveries = again.request_group(ids[0], 30, 5000.1)
    decision2, _ = again.request_group(ids[1], 30, 5000.1)
    groups = [d.group for d in [decision, decision2, *deliveries.values()]
              if d is not None and d.group is not None]
    pending = again.table.head(ids[0])
    made = groups[0] if groups else pending
    assert made is not None and made.group_id >= 2 << snapshot.ID_SPACE_BITS
    assert made.comm_id >= 2 << snapshot.ID_SPACE_BITS
    # The replacement still heals first.
    assert not again.workers[joiner].healed
    decision, _ = again.request_group(joiner, 0, 5000.2)
    heal = again.table.head(joiner)
    assert heal is not None and heal.heal_donor is not None
    assert decision is None or decision.outcome is Outcome.GROUP


def test_a_stopped_run_stays_stopped_and_a_new_dir_has_no_run(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StateStore(tmp_path / "state")
    assert store.load() is None
    core, _ = _running("ripples-random")
    core.stop("target loss 0.1 reached", 120.0)
    store.save(snapshot.take(core, 120.0))
    again = snapshot.restore(store.load() or {}, now=0.0, incarnation=2)
    assert again.stopped and again.stop_reason == "target loss 0.1 reached"


def test_a_state_dir_that_cannot_be_used_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError, match="cannot use the state dir"):
        StateStore(blocker)


def test_a_snapshot_of_another_format_is_refused() -> None:
    core, _ = _running()
    saved = snapshot.take(core, 110.0)
    saved["format"] = 99
    with pytest.raises(ValueError, match="format 99"):
        snapshot.restore(saved, now=0.0, incarnation=2)


def test_a_run_resumed_after_a_total_failure_continues_each_rank_with_new_workers() -> None:
    core, ids = _running()
    core.stop("interrupted by the user", 110.0)
    saved = json.loads(json.dumps(snapshot.take(core, now=110.0)))
    again = snapshot.restore(saved, now=0.0, incarnation=2, resume=True)
    assert not again.stopped and again.started_at is None
    assert all(w.state is WorkerState.EXPIRED for w in again.workers.values())
    new = [again.register(f"node{r}", 0, "cpu", 500 + r, 1.0) for r in range(4)]
    assert again.membership_formed
    for wid in new:
        again.mark_ready(wid, 500, 2.0, MODEL)
    # Each new member continues its rank's iteration count; the clock goes on.
    for old_id, new_id in zip(ids, new, strict=True):
        old, fresh = core.workers[old_id], again.workers[new_id]
        assert fresh.rank == old.rank and fresh.healed and not fresh.replacement
        assert fresh.progress.iteration == old.progress.iteration
    assert again.elapsed(2.0) == pytest.approx(core.elapsed(110.0))
    assert again.mean_iterations() == pytest.approx(core.mean_iterations())
    decision, _ = again.request_group(new[0], 30, 2.5)
    assert decision is None or decision.outcome is Outcome.GROUP


def test_an_undone_registration_hands_its_id_and_new_node_out_again() -> None:
    """A registration the state dir could not store is undone (service.Register): the
    next one gets the same id and node, as if it never happened."""
    from ripples.coordinator.registry import Registry

    registry = Registry(num_workers=3, lease_seconds=5.0, first_worker_id=7)
    registry.register("a", 0, "cpu", 1, 0.0)
    undone = registry.register("b", 0, "cpu", 2, 0.0)
    registry.undo(undone)
    assert list(registry.workers) == [7] and registry.next_worker_id == 8
    again = registry.register("c", 0, "cpu", 3, 0.0)
    assert (again.worker_id, again.node) == (8, 1)


def test_an_undone_registration_gives_its_slot_back_to_the_earlier_holder() -> None:
    from ripples.coordinator.registry import Registry

    registry = Registry(num_workers=2, lease_seconds=5.0)
    first = registry.register("a", 0, "cpu", 1, 0.0)
    first.state = WorkerState.LEFT
    again = registry.register("a", 0, "cpu", 2, 0.0)  # the slot's new holder
    registry.undo(again)
    assert registry._slots[("a", 0)] is first


def test_a_file_topologys_settings_are_encoded_once_for_every_save(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The settings (a file topology's edges with them) never change during a run: every
    snapshot hands the core's one dict, which the store encodes once."""
    edges = [(i, (i + 1) % 64) for i in range(64)]
    core = CoordinatorCore(RunSettings(protocol="ripples-smart", num_workers=64,
                                       iterations=5, topology="file",
                                       topology_edges=edges), now=0.0)
    first, second = snapshot.take(core, 1.0), snapshot.take(core, 2.0)
    assert first["settings"] is second["settings"] is core.settings_options
    store = StateStore(tmp_path)
    store.save(first)
    text = store._last_encoded["settings"][1]
    store.save(second)
    assert store._last_encoded["settings"][1] is text  # not encoded again
    restored = snapshot.restore(store.load() or {}, 3.0, incarnation=1)
    assert restored.settings.topology_edges == core.settings.topology_edges
    store.close()


def test_a_snapshot_captured_on_the_loop_and_made_later_restores_the_same_core(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The saver copies the values on the event loop (snapshot.capture) and makes the rows
    in its thread: what the core does in between is not in that save, and the rows are
    those of the former whole-record copy (dataclasses.asdict)."""
    import dataclasses
    core, ids = _running()
    captured = snapshot.capture(core, now=110.0)
    before = {i: dataclasses.asdict(core.workers[i]) for i in ids}
    core.heartbeat(ids[0], Progress(iteration=777, loss=0.5, samples=1, compute_seconds=1.0),
                   110.5)  # after the capture: not in it
    saved = captured.values()
    for row in saved["workers"]:
        whole = before[row["worker_id"]]
        assert row == {**{k: whole[k] for k in row}, "state": whole["state"].value,
                       "own_base": list(whole["own_base"])}
        assert "round_target" not in row  # a pending request's fields are left out
    store = StateStore(tmp_path)
    store.save(saved)
    again = snapshot.restore(store.load() or {}, now=0.0, incarnation=2)
    store.close()
    assert again.workers[ids[0]].progress.iteration != 777
    assert [dataclasses.asdict(w.progress) for w in again.workers.values()] == [
        before[i]["progress"] for i in ids]
    assert again.registry._nodes == core.registry._nodes
    assert [(w.worker_id, w.rank, w.host) for w in again.workers.values()] == [
        (w.worker_id, w.rank, w.host) for w in core.workers.values()]
