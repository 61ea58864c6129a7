"""The package as pip builds it from the checkout: the build prints no setuptools warning
(every package and its data declared in pyproject.toml), and the wheel holds what an
installed Ripples reads at run time (the dashboard's page, the .proto and its stubs)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from helpers import REPO

SETUPTOOLS_WARNINGS = ("BuildBackendWarning", "SetuptoolsDeprecationWarning",
                       "SetuptoolsWarning", "is absent from the `packages`")
"""How setuptools' warnings read in pip's output."""


def _tracked_files() -> list[str]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout (the build copies the tracked files)")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                            check=True, timeout=60).stdout
    return [name for name in listed.decode().split("\0") if name]


def test_the_wheel_builds_without_warnings_and_holds_the_package_data(tmp_path: Path) -> None:
    source = tmp_path / "source"
    for name in _tracked_files():
        if (REPO / name).is_file():  # a file deleted in the work tree is not built
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--wheel-dir", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    assert not [w for w in SETUPTOOLS_WARNINGS if w in output], output[-4000:]
    (wheel,) = (tmp_path / "dist").glob("ripples-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for data in ("ripples/dashboard/static/index.html", "ripples/dashboard/static/app.js",
                 "ripples/dashboard/static/style.css", "ripples/v1/coordinator.proto",
                 "ripples/v1/coordinator_pb2.pyi", "ripples/cli/main.py"):
        assert data in names, f"{data} is not in {wheel.name}"
