"""Fixtures of the end-to-end tests."""

from __future__ import annotations

import os
import shutil
from types import ModuleType

import pytest


@pytest.fixture
def chromium() -> tuple[ModuleType, str]:
    """Playwright's sync API and the system Chromium (Playwright never downloads one here)."""
    path = "/usr/bin/chromium" if os.path.exists("/usr/bin/chromium") else shutil.which("chromium")
    if path is None:
        pytest.skip("needs a headless Chromium: install the Debian package `chromium`")
    sync_api = pytest.importorskip(
        "playwright.sync_api",
        reason="needs the Python package `playwright` (pip install -e '.[dev]')")
    return sync_api, path
