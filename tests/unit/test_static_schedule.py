"""Unit tests of the rule-based static schedule and the ``ripples schedule`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from itertools import product

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ripples.static_schedule import PERIOD, schedule, static_group_of, static_groups

SIZES = list(product(range(1, 13), range(1, 9)))  # (num_nodes, workers_per_node)

nodes_st = st.integers(min_value=1, max_value=40)
workers_st = st.integers(min_value=1, max_value=16)
iteration_st = st.integers(min_value=0, max_value=10_000)


def _find(parent: list[int], item: int) -> int:
    while parent[item] != item:
        parent[item] = parent[parent[item]]
        item = parent[item]
    return item


def _num_components(num_ranks: int, groups: list[tuple[int, ...]]) -> int:
    parent = list(range(num_ranks))
    for group in groups:
        for rank in group[1:]:
            parent[_find(parent, rank)] = _find(parent, group[0])
    return len({_find(parent, rank) for rank in range(num_ranks)})


@pytest.mark.parametrize(("num_nodes", "workers_per_node"), SIZES)
def test_rows_are_conflict_free_well_formed_and_agree(
    num_nodes: int, workers_per_node: int
) -> None:
    num_ranks = num_nodes * workers_per_node
    for iteration in range(12):
        groups = static_groups(iteration, num_nodes, workers_per_node)
        members = [rank for group in groups for rank in group]
        assert len(members) == len(set(members)), f"conflict in row {iteration}: {groups}"
        assert all(0 <= rank < num_ranks for rank in members)
        assert all(len(group) >= 2 and list(group) == sorted(group) for group in groups)
        assert groups == sorted(groups, key=lambda group: group[0])
        by_rank = {rank: group for group in groups for rank in group}
        for rank in range(num_ranks):
            assert static_group_of(iteration, rank, num_nodes, workers_per_node) == by_rank.get(
                rank
            ), f"rank {rank}, iteration {iteration}"


@pytest.mark.parametrize(("num_nodes", "workers_per_node"), SIZES)
def test_one_period_connects_all_workers(num_nodes: int, workers_per_node: int) -> None:
    period_groups = [
        group
        for iteration in range(PERIOD)
        for group in static_groups(iteration, num_nodes, workers_per_node)
    ]
    assert _num_components(num_nodes * workers_per_node, period_groups) == 1


@given(nodes_st, workers_st, iteration_st)
def test_schedule_is_periodic(num_nodes: int, workers_per_node: int, iteration: int) -> None:
    assert static_groups(iteration, num_nodes, workers_per_node) == static_groups(
        iteration % PERIOD, num_nodes, workers_per_node
    )


@given(nodes_st, workers_st, iteration_st, st.data())
def test_group_of_is_consistent_among_members(
    num_nodes: int, workers_per_node: int, iteration: int, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(min_value=0, max_value=num_nodes * workers_per_node - 1))
    group = static_group_of(iteration, rank, num_nodes, workers_per_node)
    if group is not None:
        assert rank in group and len(group) >= 2
        for member in group:
            assert static_group_of(iteration, member, num_nodes, workers_per_node) == group
        assert group in static_groups(iteration, num_nodes, workers_per_node)


def test_matches_figure_9_and_10_for_four_nodes_of_four() -> None:
    intra = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9, 10, 11), (12, 13, 14, 15)]
    assert static_groups(0, 4, 4) == [(0, 4, 8, 12), (2, 3), (6, 7), (10, 11), (14, 15)]
    assert static_groups(1, 4, 4) == intra
    assert static_groups(2, 4, 4) == [(0, 3), (1, 9), (4, 7), (5, 13), (8, 11), (12, 15)]
    assert static_groups(3, 4, 4) == intra


def test_schedule_lists_iterations_from_zero() -> None:
    rows = schedule(2, 4, 6)
    assert len(rows) == 6
    assert rows[0] == [[0, 4], [2, 3], [6, 7]]
    assert rows[2] == [[0, 3], [1, 5], [4, 7]]
    assert rows[4] == rows[0]
    assert schedule(2, 4, 0) == []


def test_edge_sizes() -> None:
    assert all(static_groups(i, 1, 1) == [] for i in range(PERIOD))
    assert static_groups(2, 3, 1) == [(0, 1)]  # K == 1: LW0 pairs across; node 2 sits out
    assert static_groups(2, 2, 2) == [(1, 3)]  # K == 2: LW0 has no free partner
    assert static_groups(2, 1, 3) == [(0, 2)]  # K == 3: LW2 is LW(K-1), pairs with LW0
    assert static_groups(2, 1, 6) == [(0, 5), (3, 4)]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: static_groups(-1, 2, 2), "iteration"),
        (lambda: static_groups(0, 0, 2), "num_nodes"),
        (lambda: static_groups(0, 2, 0), "workers_per_node"),
        (lambda: static_group_of(-1, 0, 2, 2), "iteration"),
        (lambda: static_group_of(0, 4, 2, 2), "rank"),
        (lambda: static_group_of(0, -1, 2, 2), "rank"),
        (lambda: static_group_of(0, 0, 0, 2), "num_nodes"),
        (lambda: schedule(2, 2, -1), "iterations"),
        (lambda: schedule(2, 0, 4), "workers_per_node"),
    ],
)
def test_bad_arguments_raise(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


def _cli(*flags: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "ripples.cli.schedule", *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=False)


def test_cli_json_matches_schedule() -> None:
    result = _cli("--nodes", "2", "--workers-per-node", "4", "--iterations", "4", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == schedule(2, 4, 4)


def test_cli_table_marks_groups_and_skips() -> None:
    result = _cli("--nodes", "4", "--workers-per-node", "4", "--iterations", "4")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split() == ["Iteration"] + [f"W{rank}" for rank in range(16)]
    assert lines[3].split() == ["2"] + "G1 G2 - G1 G3 G4 - G3 G5 G2 - G5 G6 G4 - G6".split()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--nodes", "0", "--workers-per-node", "4", "--iterations", "4"), "--nodes"),
        (("--nodes", "2", "--workers-per-node", "0", "--iterations", "4"), "--workers-per-node"),
        (("--nodes", "2", "--workers-per-node", "4", "--iterations", "0"), "--iterations"),
        (("--nodes", "two", "--workers-per-node", "4", "--iterations", "4"), "--nodes"),
        (("--workers-per-node", "4", "--iterations", "4"), "--nodes"),
    ],
)
def test_cli_rejects_bad_arguments(flags: tuple[str, ...], message: str) -> None:
    result = _cli(*flags)
    assert result.returncode == 2
    assert message in result.stderr
    assert result.stdout == ""
