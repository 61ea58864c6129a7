"""deploy/slurm/ripples.sbatch runs the coordinator, the agents and the run, in order.

No SLURM cluster here: the script runs under bash with stand-ins for srun, squeue, scancel
and scontrol (one task on this machine per step), once with a stand-in `ripples` that
checks every command line with the real parser and records the order of events (start,
health, drain, stop; the exit code; the token and TLS files; a requeued job's state
directory), once with the real one (a run of two CPU workers, marked slow). `bash -n`
and, where installed, shellcheck check the script and the compose init script.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from compose_files import INIT_SCRIPT
from deploy_tree import DEPLOY

from ripples.cli.main import split_script
from tests.integration.helpers import free_port

SBATCH = DEPLOY / "slurm" / "ripples.sbatch"


SLURM_STANDINS = {
    # One task on this machine whatever the node count; the step's pid kept by its name
    # (exec: the pid the sbatch holds is the command's).
    "srun": r"""#!/usr/bin/env bash
name=step
while [[ $1 == --* ]]; do
    case $1 in --job-name=*) name=${1#--job-name=} ;; esac
    shift
done
echo $$ > "$STANDIN_STEPS/$name"
exec "$@"
""",
    "squeue": r"""#!/usr/bin/env bash
if [[ " $* " == *" --steps "* ]]; then
    for f in "$STANDIN_STEPS"/*; do
        [[ -e $f ]] && echo "$SLURM_JOB_ID.$(basename "$f") $(basename "$f")"
    done
else
    echo "${STANDIN_TIME_LEFT:-1-00:00:00}"
fi
""",
    "scancel": r"""#!/usr/bin/env bash
sig=KILL
for a in "$@"; do case $a in --signal=*) sig=${a#--signal=} ;; *) target=$a ;; esac; done
echo "scancel $sig $target" >> "$STANDIN_SCANCEL_LOG"
kill -s "$sig" "$(cat "$STANDIN_STEPS/${target#*.}")"
""",
    "scontrol": """#!/usr/bin/env bash
echo localhost
""",
}

RIPPLES_STANDIN = '''#!{python}
"""Stand-in for `ripples`: checks its command line with the real parser, records it,
and plays its part: serve and agents until SIGTERM, health SERVING once serve started,
submit waits
STANDIN_SUBMIT_SECONDS and exits STANDIN_SUBMIT_CODE."""
import json, os, signal, sys, time
from ripples.cli.main import build_parser, split_script

argv = sys.argv[1:]
options, script = split_script(argv)


def record(event):
    with open(os.environ["STANDIN_LOG"], "a") as f:
        f.write(json.dumps({{"event": event, "argv": argv, "time": time.time()}}) + "\\n")


def end(event, code):
    record(event)
    sys.exit(code)


try:
    build_parser().parse_args(options)
except SystemExit:
    end("rejected", 2)
if options[:2] == ["coordinator", "health"]:  # SERVING once the coordinator started
    with open(os.environ["STANDIN_LOG"]) as f:
        events = [json.loads(line) for line in f]
    if any(e["event"] == "start" and e["argv"][:2] == ["coordinator", "serve"] for e in events):
        end("serving", 0)
    end("not serving", 1)
record("start")
if options[:2] == ["coordinator", "serve"] or "--agent" in options:
    if "--agent" in options and os.environ.get("STANDIN_AGENT_EXIT"):
        end("exit", int(os.environ["STANDIN_AGENT_EXIT"]))
    signal.signal(signal.SIGTERM, lambda *_: end("term", 0))
    time.sleep(120)
    end("never stopped", 3)
if options[:1] == ["submit"]:
    time.sleep(float(os.environ.get("STANDIN_SUBMIT_SECONDS", "1")))
    sys.exit(int(os.environ.get("STANDIN_SUBMIT_CODE", "0")))
'''


class SbatchRun:
    """One run of deploy/slurm/ripples.sbatch under the stand-ins."""

    def __init__(self, result: subprocess.CompletedProcess[str], tmp_path: Path,
                 job_dir: Path) -> None:
        self.result = result
        self.job_dir = job_dir
        log = tmp_path / "ripples.log"
        self.events = [json.loads(line) for line in log.read_text().splitlines()] if (
            log.exists()) else []
        scancel = tmp_path / "scancel.log"
        self.scancels = scancel.read_text().splitlines() if scancel.exists() else []

    @property
    def output(self) -> str:
        return self.result.stdout + self.result.stderr

    def started(self, *prefix: str) -> list[list[str]]:
        return [e["argv"] for e in self.events
                if e["event"] == "start" and e["argv"][:len(prefix)] == list(prefix)]

    def time_of(self, event: str, *prefix: str) -> float:
        (found,) = [e["time"] for e in self.events
                    if e["event"] == event and e["argv"][:len(prefix)] == list(prefix)]
        return float(found)


def _run_sbatch(tmp_path: Path, args: list[str], *, standin: bool = True,
                env: dict[str, str] | None = None, nodes: int = 2, gpus: int = 4,
                timeout: float = 180) -> SbatchRun:
    bin_dir = tmp_path / "bin"
    steps = tmp_path / "steps"
    bin_dir.mkdir()
    steps.mkdir()
    scripts = dict(SLURM_STANDINS)
    if standin:
        scripts["ripples"] = RIPPLES_STANDIN.format(python=sys.executable)
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    job_id = "4242"
    environ = {k: v for k, v in os.environ.items()
               if not k.startswith(("RIPPLES_", "SLURM"))} | {
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
        "STANDIN_STEPS": str(steps), "STANDIN_LOG": str(tmp_path / "ripples.log"),
        "STANDIN_SCANCEL_LOG": str(tmp_path / "scancel.log"),
        "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": str(nodes),
        "SLURM_JOB_NODELIST": "localhost", "SLURM_SUBMIT_DIR": str(tmp_path),
        "SLURM_GPUS_PER_NODE": str(gpus), "RIPPLES_PORT": str(free_port()),
        "RIPPLES_METRICS_PORT": "0", "RIPPLES_STOP_GRACE": "20"} | (env or {})
    proc = subprocess.Popen(["bash", str(SBATCH), *args], cwd=tmp_path, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=30)
        pytest.fail(f"the sbatch did not end within {timeout}s:\n{stdout}{stderr}")
    finally:
        # Whatever the script left behind (its process group is this test's alone).
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return SbatchRun(result, tmp_path, tmp_path / f"ripples-{job_id}")


def test_sbatch_is_valid_bash() -> None:
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 0, result.stderr
    shellcheck = shutil.which("shellcheck")
    if shellcheck:
        result = subprocess.run([shellcheck, str(SBATCH), str(INIT_SCRIPT)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("code, tls", [(0, False), (1, True)], ids=["finished", "failed-tls"])
def test_sbatch_runs_agents_submits_the_run_and_exits_with_its_code(
        tmp_path: Path, code: int, tls: bool) -> None:
    tls_env = {"RIPPLES_TLS_CERT": "/certs/coord.crt", "RIPPLES_TLS_KEY": "/certs/coord.key",
               "RIPPLES_TLS_CA": "/certs/ca.crt"} if tls else {}
    run = _run_sbatch(tmp_path, ["--protocol", "hop", "--max-restarts", "2", "--",
                                 "python", "train.py", "--lr", "0.1"],
                      env={"STANDIN_SUBMIT_CODE": str(code), **tls_env})
    assert run.result.returncode == code, run.output
    assert not [e for e in run.events if e["event"] == "rejected"], run.events
    token = run.job_dir / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert stat.S_IMODE(run.job_dir.stat().st_mode) == 0o700
    assert re.fullmatch(r"[0-9a-f]{64}\n", token.read_text())

    def options(argv: list[str]) -> dict[str, str]:
        pairs = {}
        for i, arg in enumerate(argv):
            if arg.startswith("--") and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
                pairs[arg[2:]] = argv[i + 1]
        return pairs

    (serve,) = run.started("coordinator", "serve")
    (agents,) = run.started("worker", "run", "--agent")
    (submit,) = run.started("submit", "--wait")
    health = [e["argv"] for e in run.events if e["argv"][:2] == ["coordinator", "health"]]
    assert health, "the coordinator's health is checked before anything uses it"
    serve_options = options(serve)
    # No run options: the coordinator starts with no run; the run is submitted.
    assert set(serve_options) <= {"host", "port", "metrics-port", "advertise-host",
                                  "state-dir", "token-file", "tls-cert", "tls-key"}
    assert serve_options["state-dir"] == str(run.job_dir / "state")
    assert options(agents)["nproc-per-node"] == "4"
    assert options(agents)["output-dir"] == str(run.job_dir / "output")
    run_options, script = split_script(submit)
    submitted = options(run_options)
    assert (submitted["workers"], submitted["workers-per-node"]) == ("8", "4")
    assert submitted["protocol"] == "hop" and submitted["max-restarts"] == "2"
    assert script == ["python", "train.py", "--lr", "0.1"]
    for argv in (serve, agents, submit):
        assert options(argv)["token-file"] == str(token), argv
    for argv in (agents, submit, *health):
        assert options(argv).get("tls-ca") == ("/certs/ca.crt" if tls else None), argv
    assert (serve_options.get("tls-cert"), serve_options.get("tls-key")) == (
        ("/certs/coord.crt", "/certs/coord.key") if tls else (None, None))
    # In order: the coordinator serves (its health check answers), then the agents and
    # the run start; at its end the agents drain (SIGTERM to their step's tasks), then
    # the coordinator stops.
    served = run.time_of("serving", "coordinator", "health")
    assert run.time_of("start", "coordinator", "serve") < served
    assert served < run.time_of("start", "worker") and served < run.time_of("start", "submit")
    assert run.time_of("term", "worker") < run.time_of("term", "coordinator", "serve")
    assert run.scancels == ["scancel TERM 4242.ripples-agents",
                            "scancel TERM 4242.ripples-coordinator"]


def test_sbatch_makes_workers_of_several_ranks_from_the_gpus_of_a_node(
        tmp_path: Path) -> None:
    """RIPPLES_RANKS_PER_WORKER=2 on 2 nodes of 4 GPUs: 4 workers of 2 ranks each, the
    agents' slots unchanged; one that does not divide the GPUs is refused."""
    (tmp_path / "two").mkdir()
    (tmp_path / "three").mkdir()
    run = _run_sbatch(tmp_path / "two", ["--protocol", "ripples-smart", "--", "python",
                                         "train.py"], env={"RIPPLES_RANKS_PER_WORKER": "2"})
    assert run.result.returncode == 0, run.output
    (agents,) = run.started("worker", "run", "--agent")
    assert agents[agents.index("--nproc-per-node") + 1] == "4"
    (submit,) = run.started("submit", "--wait")
    given = {flag: submit[submit.index(flag) + 1]
             for flag in ("--workers", "--workers-per-node", "--ranks-per-worker")}
    assert given == {"--workers": "4", "--workers-per-node": "2", "--ranks-per-worker": "2"}
    refused = _run_sbatch(tmp_path / "three", ["--", "python", "train.py"],
                          env={"RIPPLES_RANKS_PER_WORKER": "3"})
    assert refused.result.returncode == 2, refused.output
    assert "does not divide the 4 worker processes per node" in refused.result.stderr
    assert not refused.events, "nothing may start"


def test_sbatch_ends_the_job_when_the_agents_fail(tmp_path: Path) -> None:
    start = time.monotonic()
    run = _run_sbatch(tmp_path, ["--task", "digits"],
                      env={"STANDIN_AGENT_EXIT": "1", "STANDIN_SUBMIT_SECONDS": "100"})
    assert run.result.returncode == 1, run.output
    assert "the agents' step ended before the run" in run.result.stderr
    assert run.time_of("term", "coordinator", "serve")
    assert time.monotonic() - start < 60


def test_sbatch_bounds_the_run(tmp_path: Path) -> None:
    run = _run_sbatch(tmp_path, ["--task", "digits"],
                      env={"RIPPLES_RUN_TIMEOUT": "3", "STANDIN_SUBMIT_SECONDS": "100",
                           "SLURM_RESTART_COUNT": "1"})
    assert run.result.returncode == 1, run.output
    assert "did not end within 3s" in run.result.stderr
    assert run.time_of("term", "worker") < run.time_of("term", "coordinator", "serve")
    # A requeued job does not resume the first attempt's state beside its new run.
    (serve,) = run.started("coordinator", "serve")
    assert serve[serve.index("--state-dir") + 1] == str(tmp_path / "ripples-4242.1" / "state")


def test_sbatch_wants_all_three_tls_files_or_none(tmp_path: Path) -> None:
    run = _run_sbatch(tmp_path, ["--task", "digits"], env={"RIPPLES_TLS_CA": "/certs/ca.crt"})
    assert run.result.returncode == 2 and "TLS needs" in run.result.stderr
    assert not run.events and not run.job_dir.exists(), "nothing may start"


@pytest.mark.slow
def test_sbatch_runs_a_real_run_on_one_node(tmp_path: Path) -> None:
    """The real `ripples`: coordinator, one agent with two CPU workers, the digits task."""
    run = _run_sbatch(tmp_path, ["--protocol", "ripples-smart", "--task", "digits",
                                 "--iterations", "40"], standin=False, nodes=1, gpus=2)
    assert run.result.returncode == 0, run.output[-5000:]
    assert re.search(r"run \w+ finished", run.result.stdout), run.output[-5000:]
    (run_dir,) = (run.job_dir / "output").iterdir()
    assert sorted(p.name.rsplit("-", 1)[1] for p in run_dir.glob("model-*.pt")) == [
        "0.pt", "1.pt"]
    assert "drained, exiting" in run.result.stderr
