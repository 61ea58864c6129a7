"""The protocol seam: nothing outside protocols/ runs a protocol by its name, and a new
protocol (tests/throwaway_protocol/: its own files and one registry line) runs in the
coordinator's core, the simulator and the dashboard without a change anywhere else."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from ripples.coordinator.config import RunSettings
from ripples.coordinator.core import CoordinatorCore, Outcome
from ripples.dashboard.view import RunView
from ripples.protocols.registry import PROTOCOLS, get_protocol
from ripples.sim.config import SimConfig, sim_protocols
from ripples.sim.engine import simulate
from ripples.v1 import coordinator_pb2 as pb
from tests.throwaway_protocol.spec import RING_PAIRS

REPO = Path(__file__).resolve().parents[2]
NAME_BLIND = [*sorted((REPO / "coordinator").glob("*.py")), *sorted((REPO / "sim").glob("*.py")),
              *sorted((REPO / "dashboard").glob("*.py")),
              *sorted((REPO / "dashboard" / "static").glob("*.js")),
              *sorted((REPO / "ripples").glob("*.py"))]
"""The code that must run every protocol alike: the coordinator, the simulator, the
dashboard and the shared plumbing."""
COLLECTIVE_WORDS = {"allreduce"}
"""Protocol names that are also the name of a collective (comm.allreduce_sum_)."""


def _names() -> tuple[set[str], set[str]]:
    """(every protocol's name, the names' identifier forms)."""
    words = set(PROTOCOLS)
    identifiers = {n.replace("-", "_") for n in PROTOCOLS} - COLLECTIVE_WORDS
    return words, identifiers


def _offences(path: Path, words: set[str], identifiers: set[str]) -> list[str]:
    text = path.read_text()
    found: list[str] = []
    if path.suffix == ".js":
        for word in words:
            for m in re.finditer(rf"[\"'`]{re.escape(word)}[\"'`]", text):
                found.append(f"{path}:{text[:m.start()].count(chr(10)) + 1}: {m.group()}")
        return found
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and (
                node.value in words):
            found.append(f"{path}:{node.lineno}: the string {node.value!r}")
        name = (node.id if isinstance(node, ast.Name) else node.attr
                if isinstance(node, ast.Attribute) else node.name
                if isinstance(node, ast.FunctionDef | ast.ClassDef) else "")
        parts = name.lower().split("_")
        for ident in identifiers:
            n = len(ident.split("_"))
            if any("_".join(parts[i:i + n]) == ident for i in range(len(parts))):
                found.append(f"{path}:{getattr(node, 'lineno', 0)}: the name {name!r}")
    return found


def test_no_protocol_is_named_outside_the_protocols() -> None:
    words, identifiers = _names()
    offences = [o for path in NAME_BLIND for o in _offences(path, words, identifiers)]
    assert offences == [], "\n".join(offences)


def test_the_name_check_finds_a_dispatch_on_a_name(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def pair(role):\n    if role.label == 'adpsgd':\n        return 1\n"
                   "def a2cid2_constants():\n    pass\n")
    words, identifiers = _names()
    assert len(_offences(bad, words, identifiers)) == 2


@pytest.fixture
def ring_pairs(monkeypatch: pytest.MonkeyPatch) -> None:
    """The throwaway protocol's one registry line."""
    monkeypatch.setitem(PROTOCOLS, RING_PAIRS.name, RING_PAIRS)


@pytest.mark.usefixtures("ring_pairs")
def test_a_new_protocol_forms_its_own_groups_in_the_coordinator() -> None:
    settings = RunSettings.build(protocol="ring-pairs", num_workers=4, iterations=100)
    assert settings.spec is RING_PAIRS
    core = CoordinatorCore(settings, now=0.0)
    ids = [core.register("node0", r, "cpu", 100 + r, 0.0) for r in range(4)]
    for wid in ids:
        core.mark_ready(wid, 100, 0.0)
    decision, _ = core.request_group(ids[1], 1, 0.1)  # waits for its partner, ids[2]
    assert decision is None
    decision, others = core.request_group(ids[2], 1, 0.2)
    assert decision is not None and decision.outcome is Outcome.GROUP
    assert decision.group is not None and set(decision.group.members) == {ids[1], ids[2]}
    assert others[ids[1]].group is decision.group
    # Every request makes its own pair: ids[2]'s made (ids[2], ids[3]); ids[3]'s makes
    # (ids[3], ids[0]), the last with the first.
    core.request_group(ids[3], 1, 0.3)
    pairs = {frozenset(g.members) for g in core.table.unfinished()}
    assert {ids[2], ids[3]} in pairs and {ids[3], ids[0]} in pairs


@pytest.mark.usefixtures("ring_pairs")
def test_a_new_protocol_runs_in_the_simulator_and_shows_its_hint_on_the_dashboard() -> None:
    assert "ring-pairs" in sim_protocols()
    result = simulate(SimConfig(protocol="ring-pairs", workers=8, iterations=20))
    assert result.stop_reason.startswith("iteration budget reached"), result.stop_reason
    assert result.groups > 0 and result.mean_group_size == 2.0
    status = pb.RunStatus(config=pb.RunConfig(run_id="r", protocol="ring-pairs",
                                              num_workers=2),
                          workers=[pb.WorkerStatus(worker_id=w, host="node0", rank=w)
                                   for w in range(2)], started=True)
    assert RunView().update(status, now=1.0)["groups_note"] == RING_PAIRS.groups_note


def test_unknown_protocols_are_refused_naming_the_registered_ones() -> None:
    with pytest.raises(ValueError, match="choose one of allreduce, ripples-random"):
        get_protocol("ring-pairs")
    assert get_protocol("ripples-smart").role.forms_groups
