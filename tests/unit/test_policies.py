"""Unit tests of the group table and the group generation policies, on the paper's examples."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ripples.coordinator.comm_directory import CommDirectory
from ripples.coordinator.config import RunSettings
from ripples.coordinator.groups import GroupState, GroupTable
from ripples.coordinator.policies import ClusterView, RandomPolicy, SmartPolicy


def _view(live: range | list[int], *, idle: set[int] | None = None,
          counts: dict[int, int] | None = None, workers_per_node: int = 4,
          neighbours: dict[int, list[int]] | None = None,
          own_seconds: dict[int, float] | None = None) -> ClusterView:
    live = list(live)
    return ClusterView(
        live=tuple(live),
        idle=frozenset(live if idle is None else idle),
        request_counts={w: (counts or {}).get(w, 0) for w in live},
        node_of={w: w // workers_per_node for w in live},
        neighbours=neighbours,
        own_seconds=own_seconds or {},
    )


def test_figure_8_overlapping_groups_are_serialised_and_released_per_member() -> None:
    table = GroupTable()
    first = table.add([0, 4, 5], initiator=0, now=0.0)  # W0's request (3, 4)
    second = table.add([4, 5, 7], initiator=7, now=0.1)  # W7's request: conflicts (6)
    assert first.state is GroupState.EXECUTING and second.state is GroupState.PENDING
    assert table.num_conflicts == 1 and table.num_pending == 1
    assert table.arrive(7) is None  # W7 waits: its head is the pending group
    assert table.arrive(0) is None and table.arrive(4) is None
    assert table.arrive(5) is first and first.delivered  # all of 0, 4, 5 asked: P-Reduce (7)
    assert table.release(0, first.group_id) == []  # acknowledgements release locks (8)
    assert table.release(4, first.group_id) == []
    assert second.state is GroupState.PENDING  # W5 still holds its lock
    assert table.arrive(4) is None
    assert table.release(5, first.group_id) == []  # 5 has not asked for the second yet
    assert second.state is GroupState.EXECUTING and table.get(first.group_id) is None
    assert table.arrive(5) is second
    table.check_invariants()


def test_groups_must_hold_their_initiator_and_two_members() -> None:
    table = GroupTable()
    with pytest.raises(ValueError, match="initiator"):
        table.add([1, 2], initiator=0, now=0.0)
    with pytest.raises(ValueError, match="at least two"):
        table.add([3], initiator=3, now=0.0)


def test_a_group_cannot_be_released_before_it_executes() -> None:
    table = GroupTable()
    group = table.add([0, 1], initiator=0, now=0.0)
    with pytest.raises(ValueError, match="before it executed"):
        table.release(0, group.group_id)
    assert table.release(0, 999) == []  # an unknown (cancelled) group: a no-op


def test_figure_11_global_division_gives_the_second_requester_a_conflict_free_group() -> None:
    policy = SmartPolicy(group_size=2)
    groups = policy.generate(0, _view(range(4)), random.Random(0))
    assert len(groups) == 2 and 0 in groups[0]
    assert sorted(w for g in groups for w in g) == [0, 1, 2, 3]  # a partition: no conflict
    table = GroupTable()
    for g in groups:
        table.add(g, initiator=0 if 0 in g else g[0], now=0.0)
    assert table.num_conflicts == 0 and table.num_executing == 2
    w3_group = table.head(3)  # W3 asks later: served from its buffer, no new division
    assert w3_group is not None and 3 in w3_group.members and 0 not in w3_group.members


def test_global_division_uses_only_idle_workers_and_balances_sizes() -> None:
    policy = SmartPolicy(group_size=3)
    view = _view(range(8), idle={0, 1, 2, 3, 4})
    for seed in range(20):
        groups = policy.generate(0, view, random.Random(seed))
        members = [w for g in groups for w in g]
        assert set(members) == {0, 1, 2, 3, 4} and len(members) == 5
        assert sorted(len(g) for g in groups) == [2, 3]  # 5 idle, size 3: a pair and a triple
        assert 0 in groups[0]


def test_four_idle_workers_with_group_size_three_give_two_pairs() -> None:
    groups = SmartPolicy(group_size=3).generate(0, _view(range(4)), random.Random(1))
    assert sorted(len(g) for g in groups) == [2, 2]


def test_lone_idle_initiator_joins_busy_filter_passing_workers() -> None:
    view = _view(range(6), idle={2}, counts={w: 10 for w in range(6)})
    groups = SmartPolicy(group_size=3).generate(2, view, random.Random(0))
    assert len(groups) == 1 and 2 in groups[0] and len(groups[0]) == 3


def test_slowdown_filter_keeps_slow_workers_out_of_fast_divisions() -> None:
    counts = {0: 20, 1: 19, 2: 18, 3: 5}  # worker 3 is slow: c_0 - c_3 = 15 >= C_thres
    policy = SmartPolicy(group_size=2, c_thres=5)
    view = _view(range(4), counts=counts)
    for seed in range(20):
        groups = policy.generate(0, view, random.Random(seed))
        assert all(3 not in g for g in groups)
    assert not policy.passes_filter(0, 3, view) and policy.passes_filter(0, 2, view)
    # A slow initiator may take fast workers: they have empty buffers, nobody waits long.
    groups = policy.generate(3, view, random.Random(0))
    assert 3 in groups[0] and sorted(w for g in groups for w in g) == [0, 1, 2, 3]


def test_once_speeds_are_known_they_decide_who_joins_a_division() -> None:
    # Worker 0 is the straggler (10x); worker 1 is fast but lags in requests because it
    # once waited for 0. By counters alone 0 would pass 1's filter (c_1 - c_0 < 5) and 1
    # would fail everyone else's: both would stay trapped together.
    counts = {0: 10, 1: 12, 2: 40, 3: 41, 4: 39, 5: 40}
    own = {0: 3.0, 1: 0.31, 2: 0.3, 3: 0.29, 4: 0.3, 5: 0.32}
    policy = SmartPolicy(group_size=2, c_thres=5)
    view = _view(range(6), counts=counts, own_seconds=own)
    assert not policy.passes_filter(1, 0, view)  # the straggler stays out of 1's division
    assert policy.passes_filter(2, 1, view)  # 1 is fast again for everyone
    for seed in range(20):
        for initiator in range(1, 6):
            groups = policy.generate(initiator, view, random.Random(seed))
            assert initiator in groups[0] and all(0 not in g for g in groups)
    # The straggler still averages when it asks; 2x the median is not a straggler.
    assert 0 in policy.generate(0, view, random.Random(0))[0]
    assert policy.passes_filter(2, 1, _view(range(6), counts=counts, own_seconds={**own, 1: 0.6}))
    # A worker of unknown speed (its first iterations) passes by the paper's counters,
    # as everyone did before any speed was known: at the start of a run the speeds come
    # in one report at a time, and refusing the unmeasured left the first measured
    # workers without idle peers.
    del own[3]
    assert policy.passes_filter(2, 3, _view(range(6), counts=counts, own_seconds=own))
    # The counters rule itself: a worker of unknown speed whose counter lags the
    # initiator's by c_thres does not pass.
    late = {**counts, 3: 1}
    assert not policy.passes_filter(2, 3, _view(range(6), counts=late, own_seconds=own))


def test_speeds_coming_in_one_by_one_leave_the_measured_workers_their_peers() -> None:
    # The start of a run: one worker's speed is known, the others' not yet. Its request
    # divides the idle workers as before, rather than group it with busy ones.
    counts = dict.fromkeys(range(12), 2)
    view = _view(range(12), counts=counts, own_seconds={0: 0.2})
    groups = SmartPolicy(group_size=3).generate(0, view, random.Random(0))
    assert sorted(w for g in groups for w in g) == list(range(12)) and len(groups) == 4


def test_no_eligible_peer_yields_no_group() -> None:
    view = _view(range(3), counts={0: 50, 1: 1, 2: 1})
    assert SmartPolicy(group_size=2, c_thres=5).generate(0, view, random.Random(0)) == []
    assert RandomPolicy(group_size=3).generate(0, _view([0]), random.Random(0)) == []


def test_figure_12_inter_intra_inserts_an_inter_then_an_intra_group_per_worker() -> None:
    # Two nodes of four workers; group size 3 lets each node's three non-heads form a group.
    policy = SmartPolicy(group_size=3, inter_intra=True)
    view = _view(range(8), workers_per_node=4)
    groups = policy.generate(0, view, random.Random(3))
    table = GroupTable()
    for g in groups:
        table.add(g, initiator=0 if 0 in g else g[0], now=0.0)
    node = {w: w // 4 for w in range(8)}
    crossing = [g for g in groups if len({node[w] for w in g}) > 1]
    assert len(crossing) == 1 and 0 in crossing[0]  # heads only; W0 heads its node
    for w in range(8):
        buffer = [table.get(gid) for gid in table.buffer(w)]
        assert len(buffer) == 2, f"worker {w}: {buffer}"
        inter, intra = buffer
        assert intra is not None and intra.members == tuple(range(node[w] * 4, node[w] * 4 + 4))
        assert inter is not None and inter.group_id < intra.group_id


def test_random_policy_draws_from_neighbours_and_is_seeded() -> None:
    ring = {w: [(w - 1) % 6, (w + 1) % 6] for w in range(6)}
    policy = RandomPolicy(group_size=3)
    for seed in range(10):
        (group,) = policy.generate(2, _view(range(6), neighbours=ring), random.Random(seed))
        assert set(group) == {1, 2, 3}
    draws = [policy.generate(0, _view(range(9)), random.Random(7)) for _ in range(2)]
    assert draws[0] == draws[1] and len(draws[0][0]) == 3 and 0 in draws[0][0]


@given(n=st.integers(2, 40), size=st.integers(2, 6), seed=st.integers(0, 10**6),
       num_idle=st.integers(1, 40))
def test_global_division_is_a_partition_of_idle_filter_passing_workers(
    n: int, size: int, seed: int, num_idle: int
) -> None:
    rng = random.Random(seed)
    idle = set(rng.sample(range(n), min(num_idle, n))) | {0}
    counts = {w: rng.randint(0, 12) for w in range(n)}
    policy = SmartPolicy(group_size=size, c_thres=4)
    view = _view(range(n), idle=idle, counts=counts)
    groups = policy.generate(0, view, random.Random(seed))
    members = [w for g in groups for w in g]
    assert len(members) == len(set(members)), "a division must not conflict with itself"
    assert all(2 <= len(g) <= size and list(g) == sorted(g) for g in groups)
    if groups:
        assert 0 in groups[0]
    eligible = {w for w in range(n) if w == 0 or counts[0] - counts[w] < 4}
    eligible_idle = eligible & idle
    if len(eligible_idle) > 1:
        assert set(members) <= eligible_idle
        # at most one left over (when it would be alone in a group)
        assert len(eligible_idle) - len(members) <= 1
    elif len(eligible) > 1:  # the initiator alone is idle: it joins busy eligible workers
        assert len(groups) == 1 and set(members) <= eligible
    else:
        assert groups == []


def test_policies_reject_bad_sizes() -> None:
    with pytest.raises(ValueError, match="group_size"):
        RandomPolicy(group_size=1)
    with pytest.raises(ValueError, match="c_thres"):
        SmartPolicy(c_thres=0)


def test_comm_directory_never_reuses_ids_and_evicts_least_recent_unused() -> None:
    comms = CommDirectory(max_comms_per_worker=2)
    a, created = comms.acquire((0, 1), set())
    assert created and comms.acquire((0, 1), set()) == (a, False)
    b, _ = comms.acquire((0, 2), set())
    c, _ = comms.acquire((0, 3), in_use={b})  # worker 0 over budget: evict a (least recent)
    assert comms.take_evictions(0) == [a] and comms.take_evictions(1) == [a]
    assert comms.take_evictions(0) == []  # delivered once
    again, created = comms.acquire((0, 1), {b, c})
    assert created and again not in (a, b, c)  # a fresh id, never the evicted one
    assert comms.cached_by(0) == {b, c, again}  # all in use: the bound waits for them
    comms.retire_worker(2)  # worker 2 left: every comm containing it is retired
    assert comms.cached_by(0) == {c, again} and comms.take_evictions(0) == [b]


def test_a_shard_names_its_root_as_host_port_and_runs_a_group_protocol() -> None:
    shard = RunSettings.build(protocol="ripples-smart", root="10.0.0.1:7000", inter_period=3)
    assert (shard.root, shard.inter_period) == ("10.0.0.1:7000", 3)
    config = shard.to_proto()
    assert (config.root, config.inter_period) == ("10.0.0.1:7000", 3)
    assert RunSettings.build(**shard.options()).root == "10.0.0.1:7000"  # the options travel
    with pytest.raises(ValueError, match="root must be the root coordinator's HOST:PORT"):
        RunSettings.build(root="10.0.0.1")
    with pytest.raises(ValueError, match="inter_period must be at least 1"):
        RunSettings.build(root="10.0.0.1:7000", inter_period=0)
    for protocol in ("adpsgd", "allreduce", "lpp-sgd"):
        with pytest.raises(ValueError, match=f"needs protocol ripples-random or ripples-smart, "
                                             f"not {protocol}"):
            RunSettings.build(protocol=protocol, root="10.0.0.1:7000", iterations=10)
