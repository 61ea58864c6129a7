"""The repository's package layout: which folder holds which `ripples` package.

pyproject.toml maps folders onto packages (coordinator/ -> ripples.coordinator, worker/ ->
ripples.worker, proto/ripples/v1 -> ripples.v1, ...). Tools that read the code by its
import names (the type check, the floor check) start here.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def package_dirs() -> dict[str, str]:
    """Package name -> its folder, relative to the repository."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    dirs: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return dirs


def modules() -> dict[str, Path]:
    """Every module of the distribution (generated stubs included) -> its file."""
    found: dict[str, Path] = {}
    for package, folder in package_dirs().items():
        for path in sorted((REPO / folder).glob("*.py")):
            found[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return found
