"""The floors of the house (tools/layers.py): no import goes up a floor, and no modules
import each other in a circle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import layers  # noqa: E402  (tools/ is a folder of scripts, not a package)


def test_the_repository_keeps_its_floors() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "tools" / "layers.py"), "--quiet"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == ""


def test_every_module_is_on_a_floor_and_the_plumbing_is_the_ground() -> None:
    known = layers.modules()
    floors = {m: layers.floor_of(m) for m in known}
    assert floors["ripples.rpc"] == 0 and floors["ripples.v1.coordinator_pb2"] == 0
    assert floors["ripples"] == len(layers.FLOORS) - 1, "the public face is on the roof"
    assert floors["ripples.cli.main"] == len(layers.FLOORS) - 1
    assert floors["ripples.coordinator.core"] > floors["ripples.rpc"]


def test_a_circle_of_imports_is_found() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert layers.cycles(graph) == [["a", "b", "c"]]
    assert layers.cycles({"a": {"b"}, "b": set()}) == []


def test_imports_are_read_as_python_resolves_them(tmp_path: Path) -> None:
    module = tmp_path / "mod.py"
    module.write_text(
        "from typing import TYPE_CHECKING\n"
        "from ripples import rpc\n"
        "if TYPE_CHECKING:\n"
        "    from ripples.coordinator.core import CoordinatorCore\n"
        "def later():\n"
        "    from ripples.cli import main\n")
    known = layers.modules()
    found = layers.imports("ripples.worker.mod", module, known)
    assert ("ripples.rpc", 2, False) in found
    assert ("ripples.coordinator.core", 4, True) in found
    assert ("ripples.cli.main", 6, False) in found
