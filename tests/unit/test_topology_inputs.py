"""Hostile topology input: a run's topology arrives as edges, never as a path
the coordinator would open; a bad edge list is refused naming the line or the pair and
quoting no more than a short excerpt of it; sizes are bounded before anything is built.
(tests/integration/test_hostile_topology.py replays the cases against a real coordinator
and the real CLI.)"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ripples.coordinator.config import MAX_WORKERS, TOPOLOGY_FILE_REFUSED, RunSettings
from ripples.coordinator.topology import (
    MAX_TOPOLOGY_EDGES,
    MAX_TOPOLOGY_FILE_BYTES,
    checked_edges,
    read_edge_list,
)

SECRET = "s3cret-token-0123456789abcdef"


def _environment_values() -> list[str]:
    """This process's environment as /proc shows it: what a leak would echo."""
    raw = Path("/proc/self/environ").read_bytes().decode(errors="replace")
    values = [entry.partition("=")[2] for entry in raw.split("\0")]
    return [v for v in values if len(v) >= 6]  # "1" is in "line 1" whatever the file


def test_a_run_that_names_a_topology_file_is_refused_without_opening_it(
        tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text(SECRET + "\n")
    for path in ("/proc/self/environ", str(secret)):
        with pytest.raises(ValueError) as refused:
            RunSettings.build(protocol="a2cid2", num_workers=4, topology="file",
                              topology_file=path)
        assert str(refused.value) == TOPOLOGY_FILE_REFUSED
    # A record stored by an older version says topology_file = "": it still builds.
    older = RunSettings.build(protocol="a2cid2", num_workers=4, topology_file="")
    assert older.topology_edges == []


def test_a_file_that_is_no_edge_list_is_never_echoed(tmp_path: Path) -> None:
    """Read through the CLI's reader, a token file or /proc/self/environ gives an error
    that names the file and the line, and quotes none of it; a line of numbers (an edge
    list's typo) is quoted, short."""
    secret = tmp_path / "token"
    secret.write_text(SECRET + "\n")
    with pytest.raises(ValueError, match="line 1: expected two ranks 'i j', got something "
                       r"else \(not quoted\)") as refused:
        read_edge_list(str(secret))
    assert SECRET not in str(refused.value)
    with pytest.raises(ValueError, match="line 1: expected two ranks") as refused:
        read_edge_list("/proc/self/environ")
    leaked = [v for v in _environment_values() if v in str(refused.value)]
    assert not leaked
    typo = tmp_path / "edges.txt"
    typo.write_text("0 1\n1 2 3\n")
    with pytest.raises(ValueError, match="line 2: expected two ranks 'i j', got '1 2 3'"):
        read_edge_list(str(typo))


def test_what_is_not_a_small_regular_file_is_refused_at_once(tmp_path: Path) -> None:
    """A FIFO with no writer (its read would wait for ever), a directory, a device and a
    file over the size bound are each refused, saying what to give instead."""
    fifo = tmp_path / "edges.fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path, Path("/dev/zero")):
        with pytest.raises(ValueError, match="not a regular file: give a regular file"):
            read_edge_list(str(path))
    big = tmp_path / "big.txt"
    with big.open("wb") as f:
        f.truncate(MAX_TOPOLOGY_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(ValueError, match=f"is over {MAX_TOPOLOGY_FILE_BYTES:,} bytes"):
        read_edge_list(str(big))


def test_bad_edges_over_the_wire_are_refused_naming_the_pair() -> None:
    for edges, expected in [
        ("0 1", r"must be a list of \[i, j\] rank pairs, got str"),
        ([[0, 1], [1, "2"]], r"topology_edges\[1\]: expected a pair of ranks \[i, j\], "
                             r"got \[1, '2'\]"),
        ([[0, 1], [1, 2, 3]], r"topology_edges\[1\]: expected a pair"),
        ([[0, True]], r"topology_edges\[0\]: expected a pair"),
        ([[0, 1.0]], r"topology_edges\[0\]: expected a pair"),
        ([[0, 4]], r"topology_edges\[0\]: \[0, 4\] names a rank outside 0..3"),
        ([[-1, 2]], r"names a rank outside 0..3"),
    ]:
        with pytest.raises(ValueError, match=expected):
            RunSettings.build(protocol="a2cid2", num_workers=4, topology="file",
                              topology_edges=edges)
    # Whatever its size or nesting, a bad entry is quoted short.
    nested: list[object] = [0]
    for _ in range(10_000):
        nested = [nested]
    with pytest.raises(ValueError) as refused:
        checked_edges([["x" * 100_000, 1], nested], 4)
    assert len(str(refused.value)) < 200
    with pytest.raises(ValueError) as refused:
        checked_edges([[0, 1], nested], 4)
    assert len(str(refused.value)) < 200
    with pytest.raises(ValueError, match="topology_edges are given: set topology to 'file'"):
        RunSettings.build(protocol="a2cid2", num_workers=4, topology_edges=[[0, 1]])


def test_sizes_are_bounded_before_any_graph_is_built() -> None:
    """Two million workers (a ring of them took 12 s to build) and more edges than the
    bound are refused by their count, before a graph is built."""
    with pytest.raises(ValueError, match=f"num_workers must be at most {MAX_WORKERS}, "
                       "got 2000000"):
        RunSettings.build(protocol="a2cid2", num_workers=2_000_000, topology="ring")
    too_many = [[0, 1]] * (MAX_TOPOLOGY_EDGES + 1)
    with pytest.raises(ValueError, match=f"lists {MAX_TOPOLOGY_EDGES + 1} edges; at most "
                       f"{MAX_TOPOLOGY_EDGES}"):
        RunSettings.build(protocol="a2cid2", num_workers=4, topology="file",
                          topology_edges=too_many)
