"""Where the deployment files lie, and what the deploy tests share to read and check them.

Plain values and functions imported by tests/deploy's helper and test modules: the repository
and deploy/ folders, the image's user id, promtool (Debian package prometheus; the tests
that need it skip without it) and a YAML loader.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
RIPPLES_UID = 10001  # the image's user (deploy/Dockerfile)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found: install the Debian package prometheus")


def load_yaml(path: Path) -> dict:
    with open(path) as f:
        return yaml.safe_load(f)
