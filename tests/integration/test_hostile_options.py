"""Hostile and clumsy run options, names and ports: each case is replayed
against a real coordinator on loopback (and the real `ripples` CLI where the case is a
command line), and each asserts the clear refusal AND that nothing changed: the run list
is as it was and the service still answers."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ripples.cli.config_file import ConfigError
from ripples.cli.main import _resolve as resolve_command_line
from ripples.cli.main import main as ripples_main
from ripples.cli.run import run_settings
from ripples.coordinator import snapshot
from ripples.coordinator.history import ENDED, RunHistory
from ripples.coordinator.server import CoordinatorServer, ServerConfig
from ripples.coordinator.state_store import StateStore
from ripples.rpc import CoordinatorCallError
from ripples.v1 import coordinator_pb2 as pb
from ripples.worker.client import CoordinatorClient
from tests.integration.helpers import REPO, wait_for

BASE: dict[str, object] = {"num_workers": 2, "task": "digits", "iterations": 50}


def _options(**changes: object) -> str:
    return json.dumps({**BASE, **changes})


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CoordinatorServer]:
    state = tmp_path_factory.mktemp("hostile") / "state"
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(state))).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def client(service: CoordinatorServer) -> Iterator[CoordinatorClient]:
    c = CoordinatorClient(service.address)
    try:
        yield c
    finally:
        c.close()


def _listing(client: CoordinatorClient) -> list[tuple[str, int, str]]:
    return [(r.run_id, r.state, r.stop_reason) for r in client.list_runs().runs]


# ---------------------------------------------------------------------------- item 1
@pytest.mark.parametrize("options, name, expected", [
    (_options(seed=-1), "", "seed must be at least 0"),
    (_options(iterations=2**70), "", "iterations must be at most"),
    (_options(batch_size="32"), "", "batch_size must be an integer"),
    (_options(num_workers=10**10), "", "num_workers must be at most 100000"),
    (_options(num_workers=True), "", "num_workers must be an integer"),
    (_options(group_size=2.5), "", "group_size must be an integer"),
    (_options(group_size=10**6), "", "group_size must be at most"),
    (_options(lease_seconds=1e300), "", "lease_seconds must be at most 604800"),
    (_options(hop_mode="standard\n"), "", "hop_mode must not hold control characters"),
    (_options().replace('"iterations": 50', '"epochs": NaN'), "", "NaN"),
    (_options().replace('"iterations": 50', '"lease_seconds": Infinity'), "", "Infinity"),
    ("[" * 100_000 + "]" * 100_000, "", "nests too deep"),
    (_options(), "x" * 300_000, "name: at most 200 characters"),
    (_options(), "run\n2026-01-01 INFO forged \x1b[31m", "holds control characters"),
])
def test_a_bad_submission_is_refused_naming_the_option_and_stores_nothing(
        client: CoordinatorClient, options: str, name: str, expected: str) -> None:
    before = _listing(client)
    with pytest.raises(CoordinatorCallError, match=expected.replace("(", r"\(")) as refused:
        client.submit_run(options, name=name)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert _listing(client) == before  # nothing stored, and the list still answers
    client.run_status("")  # so does the status


@pytest.mark.parametrize("flags, expected", [
    (["--seed", "-1"], "seed must be at least 0, got -1"),
    (["--epochs", "nan"], "epochs must be a finite number"),
    (["--lease-seconds", "inf"], "lease_seconds must be a finite number"),
    (["--workers", "10000000000"], "num_workers must be at most 100000"),
])
def test_the_cli_refuses_the_same_options_before_it_calls(
        client: CoordinatorClient, service: CoordinatorServer, flags: list[str],
        expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    before = _listing(client)
    assert ripples_main(["submit", "--task", "digits", "--coordinator", service.address,
                         *flags]) == 2
    err = capsys.readouterr().err
    assert f"ripples submit: error: {expected}" in err and err.count("\n") == 1
    assert _listing(client) == before


def test_a_run_accepted_after_the_refusals_is_listed_and_stoppable(
        client: CoordinatorClient) -> None:
    info = client.submit_run(_options(seed=2**32 - 1), name="fine")
    assert info.run_id in [r.run_id for r in client.list_runs().runs]
    client.stop_run("test over", info.run_id)
    wait_for(lambda: client.run_status(info.run_id).run.state in (
        pb.RUN_STATE_STOPPED, pb.RUN_STATE_CANCELLED), "the run to end")


# ---------------------------------------------------------------------------- smaller
def test_stop_with_an_empty_run_name_is_refused_and_the_active_run_goes_on(
        client: CoordinatorClient, service: CoordinatorServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    info = client.submit_run(_options(), name="keep-me")
    wait_for(lambda: client.run_status("keep-me").run.state == pb.RUN_STATE_RUNNING,
             "the run to be active")
    with pytest.raises(SystemExit) as exited:
        ripples_main(["stop", "", "--coordinator", service.address])
    assert exited.value.code == 2
    assert "give the run's id" in capsys.readouterr().err
    assert client.run_status(info.run_id).run.state == pb.RUN_STATE_RUNNING
    client.stop_run("test over", info.run_id)


@pytest.mark.parametrize("line, expected", [
    (["coordinator", "serve", "--port", "99999"], "argument --port: expected a port"),
    (["coordinator", "serve", "--metrics-port", "70000"], "argument --metrics-port"),
    (["coordinator", "serve", "--store-port", "-1"], "argument --store-port"),
    (["dashboard", "serve", "--coordinator", "127.0.0.1:1", "--port", "65536"],
     "argument --port"),
    (["worker", "run", "--coordinator", "127.0.0.1:1", "--metrics-port", "70000"],
     "-1 (off), 0 (any free port) or 1-65535; got 70000"),
    (["run", "--dashboard-port", "1e3"], "argument --dashboard-port"),
])
def test_a_port_out_of_range_is_refused_while_parsing(
        line: list[str], expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        ripples_main(line)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert expected in err and "Traceback" not in err


def test_a_config_file_of_random_bytes_is_a_one_line_error_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "random.toml"
    path.write_bytes(bytes(range(128, 256)) * 4)
    assert ripples_main(["runs", "--config", str(path), "--coordinator", "127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "not UTF-8" in err
    (tmp_path / "port.toml").write_text("[coordinator.serve]\nmetrics_port = 70000\n")
    assert ripples_main(["coordinator", "serve", "--config",
                         str(tmp_path / "port.toml")]) == 2
    err = capsys.readouterr().err
    assert "coordinator.serve.metrics_port: expected a port" in err
    assert err.count("\n") == 1


def test_control_characters_in_host_and_run_names_reach_no_log_line_or_terminal_raw(
        tmp_path: Path) -> None:
    """A run stored with a raw name (as an older version did) and a worker registering
    with a host name that holds a newline and an escape sequence: the coordinator's log,
    `ripples runs` and `ripples status` show them escaped, one line each."""
    state = tmp_path / "state"
    history = RunHistory(state)
    forged = "run\n2026-01-01 00:00:00 ERROR forged line \x1b[2J"
    history.add(pb.RunInfo(run_id="old1", name=forged, state=pb.RUN_STATE_QUEUED,
                           submitted_at=time.time(), protocol="allreduce", num_workers=2,
                           task="digits"),
                {**BASE, "protocol": "allreduce", "run_id": "old1"})
    history.close()
    coordinator = subprocess.Popen(
        [sys.executable, "-m", "ripples.cli", "coordinator", "serve", "--host", "127.0.0.1",
         "--port", "0", "--metrics-port", "0", "--state-dir", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert coordinator.stdout is not None
        line = coordinator.stdout.readline()  # "ripples coordinator listening on HOST:PORT"
        address = line.split("listening on ")[1].split()[0]
        client = CoordinatorClient(address)
        try:
            client.wait_until_reachable(60)
            client.register("evil\nhost\x1b[31m", 0, "cpu", 1)
            shown = [subprocess.run(
                [sys.executable, "-m", "ripples.cli", command, "--coordinator", address],
                capture_output=True, text=True, timeout=120, cwd=REPO)
                for command in ("runs", "status")]
            client.stop_run("test over", "old1")
        finally:
            client.close()
    finally:
        coordinator.terminate()
        _, log = coordinator.communicate(timeout=60)
    for done in shown:
        assert done.returncode == 0, done.stderr
        assert "\x1b" not in done.stdout and "\\x1b" in done.stdout
    assert "run\\n2026-01-01" in shown[0].stdout
    assert "evil\\nhost\\x1b[31m/0" in shown[1].stdout
    assert "\x1b" not in log and "host evil\\nhost\\x1b[31m" in log
    assert not [line for line in log.splitlines() if line.startswith("host")]


# ---------------------------------------------------------------------------- stored records
def test_a_bad_stored_record_fails_alone_and_the_service_goes_on(tmp_path: Path) -> None:
    """Records planted in a real state dir as an older version (or a hand edit) left
    them: the active run's options no longer validate, a queued run's row cannot be
    decoded. A coordinator started on it fails the active run with the reason, lists
    the damaged row as such, starts the next queued run, and stops it on request."""
    state = tmp_path / "state"
    history = RunHistory(state)
    now = time.time()
    for run_id, run_state, options in [
            ("bad-seed", pb.RUN_STATE_RUNNING, {**BASE, "seed": -1}),
            ("torn", pb.RUN_STATE_QUEUED, BASE),
            ("next", pb.RUN_STATE_QUEUED, BASE)]:
        history.add(pb.RunInfo(run_id=run_id, name=run_id, state=run_state,
                               submitted_at=now, protocol="ripples-smart", num_workers=2,
                               task="digits"), {**options, "run_id": run_id})
    history.close()
    # The active run's saved state, as the older version left it: its settings hold the
    # seed that no longer validates (a run without its state is refused: test_hostile_state).
    saved = StateStore(state / "runs" / "bad-seed")
    saved.save({"format": snapshot.FORMAT, "settings": {**BASE, "seed": -1},
                "workers": []})
    saved.close()
    with sqlite3.connect(state / "history.db") as db:
        db.execute("UPDATE runs SET info = ? WHERE run_id = 'torn'", (b"\xff\xff\xff",))
    db.close()
    server = CoordinatorServer(ServerConfig(host="127.0.0.1", port=0, run=None,
                                            state_dir=str(state))).start()
    client = CoordinatorClient(server.address)
    try:
        runs = {r.run_id: r for r in client.list_runs().runs}
        assert runs["bad-seed"].state == pb.RUN_STATE_FAILED
        assert "could not resume: seed must be at least 0" in runs["bad-seed"].stop_reason
        assert runs["torn"].state == pb.RUN_STATE_FAILED
        assert "damaged record" in runs["torn"].stop_reason
        assert runs["next"].state == pb.RUN_STATE_RUNNING  # the queue went on
        assert "seed must be" in client.run_status("bad-seed").run.stop_reason
        assert client.run_status("").run.run_id == "next"
        client.stop_run("test over", "next")
        wait_for(lambda: client.run_status("next").run.state == pb.RUN_STATE_STOPPED,
                 "the next run to stop")
    finally:
        client.close()
        server.stop()


# ---------------------------------------------------------------------------- fuzz
def _fuzzed_names() -> list[str]:
    """Every run option, as SubmitRun takes it, but those that reach out of the
    coordinator (root dials a coordinator, topology_file names a file) or name the run."""
    from ripples.coordinator.config import RunSettings

    return sorted(set(RunSettings().options()) - {"root", "topology_file", "run_id"})


FUZZED_VALUES = st.one_of(
    st.integers(-2, 12), st.integers(-(2**70), 2**70), st.booleans(), st.none(),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from(["", "7", "ring", "x"]),
    st.text(max_size=12))
FUZZED_CHANGES = st.dictionaries(st.sampled_from(_fuzzed_names()), FUZZED_VALUES, max_size=3)
FUZZ = settings(max_examples=20, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture])


def _refused_or_listed_and_stoppable(client: CoordinatorClient, options_json: str) -> None:
    """SubmitRun: refused naming what is wrong with nothing stored, or listed and then
    stopped (or cancelled, or ended already by a failed start, saying why)."""
    before = _listing(client)
    try:
        info = client.submit_run(options_json)
    except CoordinatorCallError as err:
        assert err.code == grpc.StatusCode.INVALID_ARGUMENT and "bad run: " in str(err)
        assert _listing(client) == before
        event("refused by SubmitRun")
        return
    event("accepted")
    assert info.run_id in [r.run_id for r in client.list_runs().runs]
    try:
        client.stop_run("fuzzed run stopped", info.run_id)
    except CoordinatorCallError as err:
        assert "has ended already" in str(err)
    wait_for(lambda: client.run_status(info.run_id).run.state in ENDED, "the run to end")


@FUZZ
@given(changes=FUZZED_CHANGES)
def test_fuzzed_options_over_rpc(client: CoordinatorClient,
                                 changes: dict[str, object]) -> None:
    _refused_or_listed_and_stoppable(client, json.dumps({**BASE, **changes}))


@functools.cache
def _submit_actions() -> dict[str, argparse.Action]:
    from ripples.cli.config_file import leaf_parsers
    from ripples.cli.main import build_parser

    return {a.dest: a for a in leaf_parsers(build_parser())[("submit",)]._actions}


def _flag_words(changes: dict[str, object]) -> list[str]:
    """`ripples submit`'s flags that set `changes` (a bool flag takes its value's truth)."""
    actions = _submit_actions()
    words = []
    for name, value in changes.items():
        action = actions[name]
        flag = next(o for o in action.option_strings if o.startswith("--"))
        if isinstance(action, argparse.BooleanOptionalAction):
            words.append(flag if value else f"--no-{flag[2:]}")
        else:
            words.append(f"{flag}={value}")
    return words


def _through_the_cli(client: CoordinatorClient, service: CoordinatorServer, line: list[str],
                     capsys: pytest.CaptureFixture[str]) -> None:
    """`ripples submit LINE` as the CLI reads it (flags, file, environment): refused with
    a message, or its options are accepted by the coordinator too (one schema)."""
    capsys.readouterr()
    try:
        _, args, _, _ = resolve_command_line(["submit", *line, "--coordinator", service.address])
        settings_ = run_settings(args, [])
    except SystemExit as exited:  # argparse: a value of the wrong type, "usage: ..." said
        assert exited.code == 2 and "error: argument" in capsys.readouterr().err
        event("refused by the command line")
        return
    except (ConfigError, ValueError) as err:
        assert str(err)
        event("refused by the command line")
        return
    before = len(client.list_runs().runs)
    _refused_or_listed_and_stoppable(client, json.dumps(settings_.options()))
    assert len(client.list_runs().runs) == before + 1, "the CLI accepted what SubmitRun refused"


@FUZZ
@given(changes=FUZZED_CHANGES.map(lambda c: {k: v for k, v in c.items() if v is not None}))
def test_fuzzed_options_as_flags(client: CoordinatorClient, service: CoordinatorServer,
                                 capsys: pytest.CaptureFixture[str],
                                 changes: dict[str, object]) -> None:
    _through_the_cli(client, service, ["--task=digits", "--iterations=50", "--workers=2",
                                       *_flag_words(changes)], capsys)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    return repr(value)


@FUZZ
@given(changes=FUZZED_CHANGES.map(lambda c: {k: v for k, v in c.items() if v is not None}))
def test_fuzzed_options_in_a_config_file(client: CoordinatorClient, service: CoordinatorServer,
                                         capsys: pytest.CaptureFixture[str],
                                         tmp_path_factory: pytest.TempPathFactory,
                                         changes: dict[str, object]) -> None:
    words = _flag_words(changes)  # the file's keys are the flags' names
    keys = [w.split("=")[0].lstrip("-").removeprefix("no-").replace("-", "_") for w in words]
    path = tmp_path_factory.mktemp("toml") / "run.toml"
    path.write_text("[submit]\ntask = \"digits\"\niterations = 50\nworkers = 2\n" + "".join(
        f"{key} = {_toml_value(value)}\n" for key, value in zip(keys, changes.values(),
                                                                 strict=True)
        if key not in ("task", "iterations", "workers")), encoding="utf-8")
    _through_the_cli(client, service, ["--config", str(path)], capsys)


@settings(FUZZ, max_examples=10)
@given(every=st.one_of(st.text(max_size=12), st.integers(-5, 10**20).map(str)),
       keep=st.one_of(st.text(max_size=12), st.integers(-5, 10**20).map(str)))
def test_fuzzed_checkpoint_options_in_the_environment(every: str, keep: str) -> None:
    """The run's options have no variables; the options that do (a run's checkpoints)
    are refused with a message naming the variable, or accepted and valid."""
    from ripples.cli.config_file import apply, leaf_parsers
    from ripples.cli.main import build_parser
    from ripples.worker.launch_env import CheckpointOptions

    parser = build_parser()
    leaves = leaf_parsers(parser)
    try:
        apply(leaves[("run",)], ("run",), [], "", leaves, environ={
            "RIPPLES_CHECKPOINT_EVERY": every, "RIPPLES_KEEP_CHECKPOINTS": keep})
        CheckpointOptions(**{
            k: v for k, v in vars(parser.parse_args(["run"])).items()
            if k in ("checkpoint_dir", "checkpoint_every", "keep_checkpoints")}).validate()
    except (ConfigError, ValueError) as err:
        assert "RIPPLES_CHECKPOINT_EVERY" in str(err) or "RIPPLES_KEEP_CHECKPOINTS" in str(err)
