"""Elastic membership in the pure coordinator core: a worker that registers while a member
of a running ripples-random/smart or adpsgd run is gone takes that member's rank, heals
from a live donor in a heal group, and only then joins the policy's groups; lock-step and
other fixed-membership protocols refuse it with a reason."""

from __future__ import annotations

import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, CoordinatorError, Outcome, Progress
from ripples.coordinator.schema import Schema

MODEL = Schema(tensors=(("param:w", (4,), "float32"),), digest="model")
TRAINING = Schema(tensors=(("param:w", (4,), "float32"),
                           ("state:w.momentum_buffer", (4,), "float32")), digest="training")


def _started(protocol: str = "ripples-smart", n: int = 4, **kw: object) -> tuple[
        CoordinatorCore, list[int]]:
    core = CoordinatorCore(RunSettings(protocol=protocol, num_workers=n, iterations=100,
                                       **kw), now=0.0)  # type: ignore[arg-type]
    ids = [core.register(f"node{r}", 0, "cpu", 100 + r, 0.0) for r in range(n)]
    for wid in ids:
        core.mark_ready(wid, 100, 0.0, MODEL)
    assert core.started_at is not None
    return core, ids


def _progress(iteration: int) -> Progress:
    return Progress(iteration=iteration, loss=1.0, planned_iterations=100)


def test_a_full_elastic_run_asks_a_replacement_to_wait_for_a_vacancy() -> None:
    core, _ = _started()
    with pytest.raises(CoordinatorError) as err:
        core.register("node9", 0, "cpu", 1, 1.0)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert "once a member has left or its lease expired" in str(err.value)


@pytest.mark.parametrize("protocol", ["allreduce", "ripples-static", "hop"])
def test_fixed_membership_protocols_refuse_a_replacement_saying_why(protocol: str) -> None:
    core, ids = _started(protocol, n=2, workers_per_node=1)
    with pytest.raises(CoordinatorError) as err:
        core.register("node9", 0, "cpu", 1, 1.0)
    assert err.value.code == "FAILED_PRECONDITION"
    assert "membership is fixed" in str(err.value)


def test_a_replacement_takes_the_rank_iterations_and_budget_of_the_member_it_replaces() -> None:
    core, ids = _started()
    for wid in ids:
        core.heartbeat(wid, _progress(30), 1.0)
    core.leave(ids[2], _progress(37), "killed", 2.0)
    new = core.register("node7", 0, "cpu", 999, 3.0)
    joiner, gone = core.workers[new], core.workers[ids[2]]
    assert (joiner.rank, joiner.replacement, joiner.healed) == (gone.rank, True, False)
    assert joiner.progress.iteration == 37 and gone.replaced_by == new
    # Its predecessor's iterations are counted once, through the replacement.
    assert core.mean_iterations() == pytest.approx((30 * 3 + 37) / 4)
    assert core.mark_ready(new, 100, 3.0, MODEL)  # the run runs: no waiting for peers
    # A second joiner finds no vacancy until another member goes.
    with pytest.raises(CoordinatorError):
        core.register("node8", 0, "cpu", 1000, 3.0)


def test_the_replacement_heals_from_a_donor_before_any_policy_groups_it() -> None:
    core, ids = _started()
    core.leave(ids[1], None, "killed", 1.0)
    new = core.register("node7", 0, "cpu", 999, 2.0)
    core.mark_ready(new, 100, 2.0, MODEL)
    # The survivors' own optimizer state joined their buffers: a different schema, which
    # a heal (parameters and buffers only) does not mind.
    survivors = [ids[0], ids[2], ids[3]]
    for wid in survivors:
        core.check_schema(wid, TRAINING)
    decision, _ = core.request_group(new, 0, 2.0)
    assert decision is None  # waits for its donor
    heal = core.table.head(new)
    assert heal is not None and heal.heal_donor in survivors
    assert set(heal.members) == {new, heal.heal_donor}
    # Other survivors' groups never include the unhealed joiner.
    others = [w for w in survivors if w != heal.heal_donor]
    for i in range(20):
        for wid in others:
            core.request_group(wid, i + 1, 3.0 + i)
            head = core.table.head(wid)
            if head is not None:
                assert new not in head.members or head is heal
    # The donor meets the heal group at its next request; both get it.
    decision, deliveries = core.request_group(heal.heal_donor, 1, 30.0)
    assert decision is not None and decision.outcome is Outcome.GROUP
    assert decision.group is heal and deliveries[new].group is heal
    core.release(heal.heal_donor, heal.group_id, True, "", 31.0)
    assert not core.workers[new].healed
    core.release(new, heal.group_id, True, "", 31.0)
    assert core.workers[new].healed
    # Healed, after its first step its schema matches, and it joins the policy's groups.
    core.check_schema(new, TRAINING)
    grouped = False
    for i in range(40):
        for wid in [*survivors, new]:
            decision, deliveries = core.request_group(wid, 10 + i, 40.0 + i)
            for d in [decision, *deliveries.values()]:
                if d is not None and d.group is not None:
                    grouped |= new in d.group.members and d.group.heal_donor is None
            for member, d in [(wid, decision), *deliveries.items()]:
                if d is not None and d.group is not None:
                    core.release(member, d.group.group_id, True, "", 40.0 + i)
    assert grouped


def test_a_failed_heal_is_made_again_with_another_donor_and_joiners_spread() -> None:
    core, ids = _started(n=5)
    core.leave(ids[0], None, "killed", 1.0)
    core.leave(ids[1], None, "killed", 1.0)
    a = core.register("node8", 0, "cpu", 998, 2.0)
    b = core.register("node9", 0, "cpu", 999, 2.0)
    assert {core.workers[a].rank, core.workers[b].rank} == {0, 1}
    core.request_group(a, 0, 2.0)
    core.request_group(b, 0, 2.0)
    donor_a = core.table.head(a).heal_donor  # type: ignore[union-attr]
    donor_b = core.table.head(b).heal_donor  # type: ignore[union-attr]
    assert donor_a != donor_b  # each donor serves one joiner
    # a's donor dies: a's heal group is cancelled, and a gets a new one from someone else.
    deliveries = core.leave(donor_a, None, "killed", 3.0)
    assert deliveries[a].outcome is Outcome.CANCELLED
    core.request_group(a, 0, 4.0)
    again = core.table.head(a)
    assert again is not None and again.heal_donor not in (None, donor_a)


def test_a_replacement_takes_its_predecessors_neighbours_on_a_ring() -> None:
    core, ids = _started("ripples-random", n=4, topology="ring")
    before = set(core.neighbours_of(ids[2]))
    core.leave(ids[2], None, "killed", 1.0)
    new = core.register("node7", 0, "cpu", 999, 2.0)
    assert set(core.neighbours_of(new)) == before
    assert new in core.neighbours_of(ids[1]) and ids[2] not in core.neighbours_of(ids[1])


def test_the_run_goes_on_down_to_its_minimum_number_of_workers() -> None:
    core, ids = _started(n=4, min_workers=3)
    core.leave(ids[0], None, "killed", 1.0)
    assert not core.stopped  # three remain: a replacement may still join
    core.leave(ids[1], None, "killed", 2.0)
    assert core.stopped and "fewer than 3 workers remain" in core.stop_reason


def test_min_workers_must_fit_the_run() -> None:
    with pytest.raises(ValueError, match="min_workers must be between 1 and num_workers"):
        RunSettings(num_workers=3, min_workers=4)


def test_an_adpsgd_replacement_heals_from_a_donor_that_only_listens() -> None:
    core, ids = _started("adpsgd", n=3)
    core.leave(ids[2], None, "killed", 1.0)
    # The survivors owe no averaging now: they listen for partners.
    for wid in ids[:2]:
        decision, _ = core.request_group(wid, 5, 1.5, listen=True)
        assert decision is None
    new = core.register("node7", 0, "cpu", 999, 2.0)
    core.mark_ready(new, 100, 2.0, MODEL)
    decision, deliveries = core.request_group(new, 0, 2.0)
    assert decision is not None and decision.outcome is Outcome.GROUP
    heal = decision.group
    assert heal is not None and heal.heal_donor in ids[:2]
    assert deliveries[heal.heal_donor].group is heal  # the listening donor got it at once
    core.release(heal.heal_donor, heal.group_id, True, "", 2.5)
    core.release(new, heal.group_id, True, "", 2.5)
    assert core.workers[new].healed


def test_a_run_grows_to_max_workers_with_joiners_that_heal_first() -> None:
    """Scale-up: a worker that registers while every rank is held takes the next rank (up
    to max_workers), starts at the live median iteration, heals, and counts in the mean."""
    core, ids = _started(n=3, max_workers=4)
    for wid, it in zip(ids, (30, 40, 50), strict=True):
        core.heartbeat(wid, _progress(it), 1.0)
    new = core.register("node9", 0, "cpu", 900, 2.0)
    joiner = core.workers[new]
    assert (joiner.rank, joiner.replacement, joiner.healed) == (3, True, False)
    assert joiner.progress.iteration == 40 and core.registry.size == 4
    assert core.mean_iterations() == pytest.approx((30 + 40 + 50 + 40) / 4)
    assert new in core.neighbours_of(ids[0])
    assert core.mark_ready(new, 100, 2.0, MODEL)
    decision, _ = core.request_group(new, 40, 3.0)  # its first group heals it
    assert decision is None or decision.group is None or decision.group.heal
    with pytest.raises(CoordinatorError) as err:  # max_workers reached
        core.register("node10", 0, "cpu", 901, 4.0)
    assert err.value.code == "RESOURCE_EXHAUSTED" and "max_workers 4" in str(err.value)


def test_a_ring_is_rebuilt_for_a_joiner_and_max_workers_is_checked() -> None:
    core, ids = _started("ripples-random", n=4, topology="ring", max_workers=5)
    new = core.register("node9", 0, "cpu", 900, 1.0)
    assert len(core.neighbours_of(new)) == 2  # a ring of 5: two neighbours each
    assert sum(new in core.neighbours_of(w) for w in ids) == 2
    with pytest.raises(ValueError, match="max_workers must be 0 or at least"):
        RunSettings(num_workers=3, max_workers=2)
    with pytest.raises(ValueError, match="takes no workers beyond num_workers"):
        RunSettings(protocol="hop", num_workers=3, max_workers=4)


def test_an_a2cid2_replacement_heals_from_a_donor_waiting_for_a_partner() -> None:
    """A2CiD2 pairs first in first out: a donor that waits in the queue for a partner
    takes the heal group instead, and a donor that arrives later meets it before any new
    pairing."""
    core, ids = _started("a2cid2", n=3)
    assert core.request_group(ids[0], 5, 1.0)[0] is None  # waits in the queue: no partner
    core.leave(ids[2], None, "killed", 2.0)
    new = core.register("node7", 0, "cpu", 999, 3.0)
    assert core.mark_ready(new, 100, 3.0, MODEL)
    decision, deliveries = core.request_group(new, 0, 4.0)
    assert decision is not None and decision.group is not None
    assert decision.group.heal_donor == ids[0] and set(decision.group.members) == {ids[0], new}
    assert deliveries[ids[0]].group is decision.group  # the waiting donor got it too
    core.release(ids[0], decision.group.group_id, True, "", 4.5)
    core.release(new, decision.group.group_id, True, "", 4.5)
    assert core.workers[new].healed
    # A second joiner's heal group waits in the other survivor's buffer: it meets it at
    # its next request, not a new pair.
    core.leave(ids[0], None, "killed", 5.0)
    other = core.register("node8", 0, "cpu", 1000, 6.0)
    assert core.mark_ready(other, 100, 6.0, MODEL)
    assert core.request_group(other, 0, 6.5)[0] is None
    decision, _ = core.request_group(ids[1], 9, 7.0)
    assert decision is not None and decision.group is not None
    assert decision.group.heal_donor == ids[1] and other in decision.group.members



def test_scale_up_waits_while_a_member_is_late_with_its_heartbeat() -> None:
    """A supervisor's replacement for a worker that just died must take its rank, not a
    new one: while a member is late (half a lease without a heartbeat), a joiner waits."""
    core, ids = _started(n=3, max_workers=4)
    for wid in ids[:2]:
        core.heartbeat(wid, None, 6.0)  # ids[2] last renewed at 0: 6 s > half a lease
    with pytest.raises(CoordinatorError) as err:
        core.register("node9", 0, "cpu", 900, 6.0)
    assert err.value.code == "RESOURCE_EXHAUSTED" and "late with its heartbeat" in str(err.value)
    core.expire_leases(10.5)
    new = core.register("node9", 0, "cpu", 900, 11.0)
    assert core.workers[new].rank == core.workers[ids[2]].rank  # it replaces, not grows


def test_a_joiner_the_graph_cannot_take_may_register_again_once_a_rank_frees() -> None:
    """A refused scale-up is undone whole: the same host and local rank can join later
    (as a replacement) instead of being taken for a worker that is still there."""
    core, ids = _started("ripples-random", n=4, topology="double-ring", max_workers=5)
    with pytest.raises(CoordinatorError, match="cannot grow to 5 workers"):
        core.register("node9", 0, "cpu", 200, 1.0)
    core.leave(ids[1], None, "", 2.0)
    joiner = core.register("node9", 0, "cpu", 201, 3.0)
    assert core.workers[joiner].rank == core.workers[ids[1]].rank
