"""deploy/Dockerfile builds the image the deployments run.

Read as text (no Docker engine here): it installs torch at pyproject.toml's pin from the
PyTorch index, then the package, runs as a non-root user with `ripples` as its entry
point, and copies every package directory of pyproject.toml's package-dir, which
.dockerignore keeps.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import PurePosixPath

from deploy_tree import DEPLOY, REPO


def _torch_pin() -> str:
    with open(REPO / "pyproject.toml", "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    (pin,) = [d.split(";")[0].strip() for d in dependencies if re.match(r"torch\b", d)]
    return pin


def test_dockerfile_installs_the_pinned_torch_then_the_package() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    instructions = [line.strip() for line in text.splitlines()
                    if line.strip() and not line.lstrip().startswith("#")]
    assert instructions[0] == "FROM python:3.11-slim"
    pin = _torch_pin()
    assert pin == "torch==2.13.0"
    torch_runs = [i for i in instructions if i.startswith("RUN") and "torch" in i]
    assert len(torch_runs) == 1 and re.search(rf"\s{re.escape(pin)}(\s|$)", torch_runs[0]), (
        f"the Dockerfile must install {pin}: {torch_runs}")
    assert "--index-url \"${TORCH_INDEX_URL}\"" in torch_runs[0]
    assert "ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in instructions
    assert any(i.startswith("USER ") and i.split()[1] not in ("root", "0")
               for i in instructions), "the image must run as a non-root user"
    assert instructions[-2:] == ['ENTRYPOINT ["ripples"]', 'CMD ["--help"]']


def test_image_copies_every_package_directory() -> None:
    """Each source directory of pyproject's package-dir is copied and not docker-ignored."""
    with open(REPO / "pyproject.toml", "rb") as f:
        package_dirs = tomllib.load(f)["tool"]["setuptools"]["package-dir"].values()
    roots = {PurePosixPath(d).parts[0] for d in package_dirs}
    text = (DEPLOY / "Dockerfile").read_text()
    assert "COPY pyproject.toml README.md ./" in text
    copied = set(re.findall(r"^COPY (\S+) \S+$", text, flags=re.MULTILINE))
    assert roots <= copied, f"not copied into the image: {sorted(roots - copied)}"
    kept = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.startswith("!")}
    assert roots | {"pyproject.toml", "README.md"} <= kept
