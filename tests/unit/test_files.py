"""ripples.files.write_atomically: a file under its final name is whole, or absent."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import BinaryIO

import pytest

from ripples.files import partial_path, write_atomically


def test_bytes_and_writers_land_whole_in_a_new_directory(tmp_path: Path) -> None:
    path = tmp_path / "new" / "model.pt"
    write_atomically(path, b"first")
    assert path.read_bytes() == b"first"

    def writer(f: BinaryIO) -> None:
        for chunk in (b"sec", b"ond"):
            f.write(chunk)

    write_atomically(path, writer)  # replaces the previous file
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["model.pt"]


def test_a_failing_writer_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "step-3.pt"

    def failing(f: BinaryIO) -> None:
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, failing)
    assert list(tmp_path.iterdir()) == []
    write_atomically(path, b"whole")
    with pytest.raises(OSError, match="disk full"):
        write_atomically(path, failing)
    assert path.read_bytes() == b"whole"  # the previous complete file stays
    assert [p.name for p in tmp_path.iterdir()] == ["step-3.pt"]


def test_a_killed_writer_leaves_only_a_hidden_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "step-3.pt"
    script = ("import os, sys\nfrom pathlib import Path\n"
              "from ripples.files import write_atomically\n"
              "def die(f):\n    f.write(b'half'); f.flush(); os._exit(9)\n"
              "write_atomically(Path(sys.argv[1]), die)\n")
    died = subprocess.run([sys.executable, "-c", script, str(path)], check=False)
    assert died.returncode == 9
    assert not path.exists()
    assert [p.name for p in tmp_path.iterdir()] == [partial_path(path).name]
    assert partial_path(path).name.startswith(".")
    write_atomically(path, b"whole")  # the leftover is overwritten
    assert [p.name for p in tmp_path.iterdir()] == ["step-3.pt"]


def test_the_module_imports_no_torch() -> None:
    code = "import sys, ripples.files; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True).stdout
    assert out.strip() == "False"
