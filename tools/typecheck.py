"""Type-check the `ripples` distribution as it is installed (package names, not folders).

The repository maps folders onto packages (coordinator/ -> ripples.coordinator, worker/ ->
ripples.worker, proto/ripples/v1 -> ripples.v1, ...; see pyproject.toml), which mypy
cannot follow through the editable install: it would treat every cross-package import as
missing and type it Any. This script mirrors the mapping as a tree of symlinks in a
temporary folder and runs mypy on the `ripples` package there, so every import is checked.

    python tools/typecheck.py [extra mypy args]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from layout import REPO, package_dirs


def build_tree(root: Path) -> Path:
    """Symlink every mapped package folder's Python files under root/ripples/..."""
    for package, folder in package_dirs().items():
        target = root.joinpath(*package.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in (REPO / folder).iterdir():
            if source.suffix in (".py", ".pyi"):
                (target / source.name).symlink_to(source)
    return root / "ripples"


def repo_path(line: str) -> str:
    """ripples/worker/tasks/x.py:3: ... -> worker/tasks/x.py:3: ... (the file's real path)."""
    path, sep, rest = line.partition(":")
    if not sep or not path.endswith((".py", ".pyi")):
        return line
    best, real = "", ""
    for package, folder in package_dirs().items():
        prefix = package.replace(".", "/") + "/"
        if path.startswith(prefix) and len(prefix) > len(best):
            best, real = prefix, folder.rstrip("/") + "/"
    return real + path[len(best):] + sep + rest if best else line


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="ripples-typecheck-") as tmp:
        build_tree(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
               "ripples", *sys.argv[1:]]
        proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
        for line in (proc.stdout + proc.stderr).splitlines():
            print(repo_path(line))
        return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
