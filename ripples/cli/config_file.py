"""`--config FILE.toml` on every command, and where each option's value came from.

A file holds one table per command; its keys are the command's long options without
the leading dashes (`nproc_per_node` or `nproc-per-node`):

    [coordinator.serve]
    port = 29400
    workers = 8
    protocol = "ripples-smart"
    state_dir = "/var/lib/ripples"
    token_file = "/etc/ripples/run.token"

    [worker.run]
    coordinator = "coord.example:29400"
    nproc_per_node = 4
    tls_ca = "/etc/ripples/ca.crt"

One file may configure every command: each reads its own table and checks the others'
names only. Precedence, highest first: flags, the environment (the RIPPLES_* variable an
option names: `ENVIRONMENT`), the file, the defaults. `ripples config show COMMAND ...`
prints the effective value of every option of a command line and where it came from.
Errors name the file, the key path and what is allowed; nothing runs after one.
"""

from __future__ import annotations

import argparse
import difflib
import os
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ripples.files import read_regular_file

MAX_CONFIG_BYTES = 1 << 20
"""A config file holds a few tables of options: anything larger is the wrong file."""
ENVIRONMENT: dict[str, str] = {  # option key -> variable
    "coordinator": "RIPPLES_COORDINATOR",
    "token_file": "RIPPLES_TOKEN_FILE",
    "tls_ca": "RIPPLES_TLS_CA",
    "tls_client_cert": "RIPPLES_TLS_CLIENT_CERT",
    "tls_client_key": "RIPPLES_TLS_CLIENT_KEY",
    "checkpoint_dir": "RIPPLES_CHECKPOINT_DIR",
    "checkpoint_every": "RIPPLES_CHECKPOINT_EVERY",
    "keep_checkpoints": "RIPPLES_KEEP_CHECKPOINTS",
}
"""Option (dest) -> the environment variable that sets it when no flag does."""

_NOT_CONFIGURABLE = {"help", "config"}


class ConfigError(ValueError):
    """A configuration file (or variable) that cannot be used; the message says why."""


@dataclass(frozen=True)
class Setting:
    """An option's effective value and where it came from."""

    value: Any
    source: str
    """"flag", "env VAR", "file PATH", or "default"."""


def leaf_parsers(parser: argparse.ArgumentParser,
                 path: tuple[str, ...] = ()) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every command's parser by its path (("worker", "run"), ...)."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return {path: parser}
    for name, child in subs[0].choices.items():
        found.update(leaf_parsers(child, (*path, name)))
    return found


def command_path(argv: Sequence[str], leaves: Mapping[tuple[str, ...], Any]) -> tuple[str, ...]:
    """The command an argument list names (its leading words), or () if none."""
    for length in (2, 1):
        path = tuple(argv[:length])
        if path in leaves:
            return path
    return ()


def config_option(argv: Sequence[str]) -> str:
    """The value of `--config` in an argument list ("" without one)."""
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return ""


def _options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """A command's options by key: the first long flag without its dashes, with
    underscores (`--workers` -> workers, `--nproc-per-node` -> nproc_per_node)."""
    options = {}
    for a in parser._actions:
        if not a.option_strings or a.dest in _NOT_CONFIGURABLE or isinstance(
                a, argparse._SubParsersAction):
            continue
        flag = next((o for o in a.option_strings if o.startswith("--")), a.option_strings[0])
        options[flag.lstrip("-").replace("-", "_")] = a
    return options


def load(path: str, leaves: Mapping[tuple[str, ...], argparse.ArgumentParser]
         ) -> dict[tuple[str, ...], dict[str, Any]]:
    """The file's tables by command path, every key checked against its command's options
    (unknown tables and keys are errors, with the closest names)."""
    try:
        raw = read_regular_file(path, MAX_CONFIG_BYTES, what="config file")
    except ValueError as err:  # unreadable, not a regular file, or far too large
        raise ConfigError(str(err)) from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}): give "
                          "a TOML file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML: {err}") from None
    tables: dict[tuple[str, ...], dict[str, Any]] = {}
    _collect(data, (), leaves, path, tables)
    for command, table in tables.items():
        options = _options(leaves[command])
        for key in table:
            if key.replace("-", "_") not in options:
                raise ConfigError(_unknown(path, (*command, key), sorted(options)))
    return tables


def _collect(data: Mapping[str, Any], prefix: tuple[str, ...],
             leaves: Mapping[tuple[str, ...], Any], path: str,
             tables: dict[tuple[str, ...], dict[str, Any]]) -> None:
    if prefix in leaves:
        tables[prefix] = dict(data)
        return
    names = sorted({leaf[len(prefix)] for leaf in leaves
                    if leaf[:len(prefix)] == prefix and len(leaf) > len(prefix)})
    for key, value in data.items():
        where = (*prefix, key)
        if key not in names:
            raise ConfigError(_unknown(path, where, names, what="command"))
        if not isinstance(value, dict):
            raise ConfigError(f"config file {path}: {'.'.join(where)} must be a table "
                              f"([{'.'.join(where)}]) of that command's options")
        _collect(value, where, leaves, path, tables)


def _unknown(path: str, where: tuple[str, ...], known: list[str], what: str = "option") -> str:
    close = difflib.get_close_matches(where[-1].replace("-", "_"), known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(known) if len(known) <= 12 else ", ".join(known[:12]) + ", ..."
    return (f"config file {path}: {'.'.join(where)}: unknown {what}{hint} (known: {listed})")


def convert(action: argparse.Action, value: Any, where: str) -> Any:
    """A file's value for `action`, typed as its flag would be; ConfigError naming
    `where` and what is allowed."""
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{where}: expected {expected}, got {value!r}")

    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction
                  | argparse._StoreFalseAction):
        if not isinstance(value, bool):
            raise fail("true or false")
        return value
    if isinstance(action, argparse._AppendAction):
        if not isinstance(value, list):
            raise fail("a list")
        return [convert_one(action, v, where, fail) for v in value]
    return convert_one(action, value, where, fail)


def convert_one(action: argparse.Action, value: Any, where: str, fail: Any) -> Any:
    kind = action.type
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail("an integer")
    elif kind is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise fail("a number")
        value = float(value)
    elif kind in (None, str):
        if not isinstance(value, str):
            raise fail("a string")
    elif callable(kind):
        try:
            value = kind(value if isinstance(value, str) else str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError) as err:
            raise ConfigError(f"{where}: {err}") from None
    return _chosen(action, value, where)


def convert_text(action: argparse.Action, text: str, where: str) -> Any:
    """An environment variable's text for `action`, parsed as its flag's text would be."""
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction
                  | argparse._StoreFalseAction):
        lowered = text.strip().lower()
        if lowered not in ("1", "true", "yes", "0", "false", "no"):
            raise ConfigError(f"{where}: expected true or false, got {text!r}")
        return lowered in ("1", "true", "yes")
    kind = action.type if callable(action.type) else str
    try:
        value = kind(text)
    except argparse.ArgumentTypeError as err:  # its message says what is allowed
        raise ConfigError(f"{where}: {err}") from None
    except (TypeError, ValueError):
        names: dict[object, str] = {int: "an integer", float: "a number"}
        name = names.get(kind, "a valid value")
        raise ConfigError(f"{where}: expected {name}, got {text!r}") from None
    return _chosen(action, value, where)


def _chosen(action: argparse.Action, value: Any, where: str) -> Any:
    """`value`, if it is one of the action's choices (when it has some)."""
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}: {value!r} is not one of "
                          f"{', '.join(map(str, action.choices))}")
    return value


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The options (dests) a command line sets with a flag."""
    given = set()
    for action in _options(parser).values():
        for arg in argv:
            if arg in action.option_strings or any(
                    arg.startswith(f"{s}=") for s in action.option_strings if s.startswith("--")):
                given.add(action.dest)
    return given


def apply(parser: argparse.ArgumentParser, command: tuple[str, ...], argv: Sequence[str],
          config_path: str, leaves: Mapping[tuple[str, ...], argparse.ArgumentParser],
          environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set `parser`'s defaults from the file's table for `command`, then from the
    environment; returns each set option's source ("env VAR", "file PATH")."""
    env = os.environ if environ is None else environ
    options = _options(parser)
    sources: dict[str, str] = {}
    defaults: dict[str, Any] = {}
    if config_path:
        table = load(config_path, leaves).get(command, {})
        for key, value in table.items():
            action = options[key.replace("-", "_")]
            where = f"config file {config_path}: {'.'.join((*command, key))}"
            defaults[action.dest] = convert(action, value, where)
            sources[action.dest] = f"file {config_path}"
    for key, variable in ENVIRONMENT.items():
        if key in options and env.get(variable):
            action = options[key]
            where = f"environment variable {variable}"
            defaults[action.dest] = convert_text(action, env[variable], where)
            sources[action.dest] = f"env {variable}"
    parser.set_defaults(**defaults)
    return sources


def effective(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str],
              sources: Mapping[str, str]) -> dict[str, Setting]:
    """Every option of a parsed command line with its value and source."""
    flagged = flags_given(parser, argv)
    return {key: Setting(getattr(args, a.dest, None),
                         "flag" if a.dest in flagged else sources.get(a.dest, "default"))
            for key, a in sorted(_options(parser).items())}
