"""`--config FILE.toml` (ripples/cli/config_file.py): each command reads its table, typed as
its flags; flags > environment > file > defaults; errors name the file, the key path and
what is allowed; `ripples config show` prints every option with its source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ripples.cli import main as cli
from ripples.cli.config_file import ConfigError

FILE = """
[coordinator.serve]
port = 29400
workers = 8
protocol = "adpsgd"
final-average = false

[worker.run]
coordinator = "coord.example:29400"
nproc_per_node = 4
"""


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "ripples.toml"
    path.write_text(FILE)
    return path


def _resolve(argv: list[str], monkeypatch: pytest.MonkeyPatch,
             **env: str) -> tuple[object, dict[str, str]]:
    for name in ("RIPPLES_COORDINATOR", "RIPPLES_TLS_CA", "RIPPLES_TOKEN_FILE",
                 "RIPPLES_KEEP_CHECKPOINTS", "RIPPLES_CHECKPOINT_EVERY", "RIPPLES_CHECKPOINT_DIR"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _, args, _, sources = cli._resolve(argv)
    return args, sources


def test_a_commands_table_sets_its_options_typed_as_its_flags(
        config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    args, sources = _resolve(["coordinator", "serve", "--config", str(config)], monkeypatch)
    assert (args.port, args.num_workers, args.protocol) == (29400, 8, "adpsgd")  # type: ignore[attr-defined]
    assert args.final_average is False  # type: ignore[attr-defined]
    assert sources["port"] == f"file {config}"
    args, _ = _resolve(["worker", "run", f"--config={config}"], monkeypatch)
    assert args.nproc_per_node == 4 and args.coordinator == "coord.example:29400"  # type: ignore[attr-defined]


def test_flags_beat_the_environment_which_beats_the_file(
        config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["worker", "run", "--config", str(config)]
    args, sources = _resolve(argv, monkeypatch, RIPPLES_COORDINATOR="env.example:1")
    assert args.coordinator == "env.example:1"  # type: ignore[attr-defined]
    assert sources["coordinator"] == "env RIPPLES_COORDINATOR"
    args, _ = _resolve([*argv, "--coordinator", "flag.example:2"], monkeypatch,
                       RIPPLES_COORDINATOR="env.example:1")
    assert args.coordinator == "flag.example:2"  # type: ignore[attr-defined]
    args, _ = _resolve(["worker", "run"], monkeypatch)
    assert args.nproc_per_node == 1  # type: ignore[attr-defined]  # the default, no file


@pytest.mark.parametrize(("text", "message"), [
    ("[worker.run]\nnproc_per_nod = 4\n",
     r"worker\.run\.nproc_per_nod: unknown option; did you mean 'nproc_per_node'\?"),
    ("[worker.run]\nnproc_per_node = \"four\"\n", r"worker\.run\.nproc_per_node: expected an "
                                                  r"integer, got 'four'"),
    ("[coordinator.serve]\nfinal_average = 1\n", r"expected true or false"),
    ("[coordinator.serve]\nprotocol = \"ripples-smrt\"\n", r"ripples-smrt"),
    ("[worker.runn]\nhost = \"a\"\n", r"worker\.runn: unknown command; did you mean 'run'\?"),
    ("[worker]\nrun = 3\n", r"worker\.run must be a table"),
    ("[worker.run\n", r"is not valid TOML"),
])
def test_a_bad_file_names_the_key_and_what_is_allowed(
        text: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    command = ["coordinator", "serve"] if "coordinator" in text else ["worker", "run"]
    with pytest.raises((ConfigError, ValueError), match=message):
        _resolve([*command, "--config", str(path)], monkeypatch)
        # An unknown protocol passes the file's check (a string) and fails in RunSettings.
        from ripples.coordinator.config import RunSettings
        RunSettings.build(protocol="ripples-smrt")


def test_the_cli_exits_2_on_a_bad_file_and_on_a_missing_one(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[worker.run]\nport = 1\n")
    assert cli.main(["worker", "run", "--config", str(path)]) == 2
    assert "worker.run.port: unknown option" in capsys.readouterr().err
    assert cli.main(["worker", "run", "--config", str(tmp_path / "absent.toml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err


def test_config_show_prints_each_option_with_its_source(
        config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("RIPPLES_TLS_CA", "/etc/ripples/ca.crt")
    monkeypatch.delenv("RIPPLES_COORDINATOR", raising=False)
    assert cli.main(["config", "show", "--json", "worker", "run", "--config", str(config),
                     "--host", "node7"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["host"] == {"value": "node7", "source": "flag"}
    assert shown["tls_ca"] == {"value": "/etc/ripples/ca.crt", "source": "env RIPPLES_TLS_CA"}
    assert shown["nproc_per_node"] == {"value": 4, "source": f"file {config}"}
    assert shown["local_rank"] == {"value": 0, "source": "default"}
    assert cli.main(["config", "show", "worker", "run", "--config", str(config)]) == 0
    text = capsys.readouterr().out
    assert "nproc_per_node" in text and f"# file {config}" in text
    assert cli.main(["config", "show"]) == 2


@pytest.mark.parametrize("command", [["coordinator", "serve"], ["worker", "run"],
                                     ["dashboard", "serve"]])
def test_the_example_file_configures_each_command(
        command: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "ripples.toml"
    args, sources = _resolve([*command, "--config", str(example)], monkeypatch)
    assert sources and all(s == f"file {example}" for s in sources.values())
    if command[0] == "coordinator":
        assert args.num_workers == 8 and args.port == 29400  # type: ignore[attr-defined]


def test_environment_values_are_parsed_as_flag_text(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a launcher hands its workers (RIPPLES_KEEP_CHECKPOINTS=3, a string).
    args, sources = _resolve(["worker", "run"], monkeypatch, RIPPLES_KEEP_CHECKPOINTS="3",
                             RIPPLES_CHECKPOINT_EVERY="90s")
    assert args.keep_checkpoints == 3 and args.checkpoint_every == "90s"  # type: ignore[attr-defined]
    assert sources["keep_checkpoints"] == "env RIPPLES_KEEP_CHECKPOINTS"
    with pytest.raises(ConfigError, match="RIPPLES_KEEP_CHECKPOINTS: expected an integer, "
                                          "got 'three'"):
        _resolve(["worker", "run"], monkeypatch, RIPPLES_KEEP_CHECKPOINTS="three")
