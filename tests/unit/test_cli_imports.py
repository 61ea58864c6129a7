"""The commands that only talk to a coordinator start without torch: their parsers and
clients import none of the heavy parts (the local cluster, the worker runtime, the
simulator load theirs when their command runs)."""

from __future__ import annotations

import subprocess
import sys

import pytest

UNREACHABLE = "127.0.0.1:9"  # the discard port: nothing serves gRPC there


def _heavy_modules_after(code: str) -> list[str]:
    script = (
        "import sys\n"
        f"{code}\n"
        "print(' '.join(sorted(m for m in ('torch', 'numpy', 'scipy', 'matplotlib')"
        " if m in sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


@pytest.mark.parametrize("argv", [
    ["runs"],
    ["status"],
    ["stop", "some-run"],
    ["logs", "some-run"],
    ["submit", "--workers", "2", "--protocol", "adpsgd", "--", "python", "train.py"],
])
def test_a_service_command_runs_without_torch(argv: list[str]) -> None:
    options = ["--coordinator", UNREACHABLE, "--connect-timeout-seconds", "0.2"]
    cut = argv.index("--") if "--" in argv else len(argv)
    line = argv[:cut] + options + argv[cut:]
    code = ("from ripples.cli.main import main\n"
            f"rc = main({line!r})\n"
            "assert rc == 1, rc  # unreachable: the command ran and reported it")
    assert "torch" not in _heavy_modules_after(code)


def test_the_whole_parser_builds_without_torch() -> None:
    heavy = _heavy_modules_after("from ripples.cli.main import build_parser\nbuild_parser()")
    assert "torch" not in heavy and "matplotlib" not in heavy


def test_the_dashboard_app_builds_without_torch() -> None:
    heavy = _heavy_modules_after(
        "from ripples.dashboard.app import create_app\n"
        "from ripples.dashboard.config import DashboardConfig\n"
        f"create_app(DashboardConfig(coordinator='{UNREACHABLE}', port=0))")
    assert "torch" not in heavy
