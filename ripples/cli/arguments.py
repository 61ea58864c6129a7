"""Options on the command line: typed configs, and the option groups commands share.

A config is a keyword-only dataclass whose fields carry attribute docstrings; those
docstrings become the CLI help, so an option is documented in exactly one place. The
groups below (the coordinator's address, client and server security) are the flags every
command that talks to a coordinator, or serves one, takes alike.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import logging
import os
import sys
import textwrap
from collections.abc import Collection
from typing import Any

from ripples.run_records import printable


def field_docs(cls: type) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, following in zip(body, body[1:], strict=False):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[node.target.id] = " ".join(following.value.value.split())
    return docs


PORT_HIGH = 65535


def port(text: str) -> int:
    """A --*port option: 0 (any free port) to 65535; anything else is refused while the
    arguments are parsed (a socket would take 99999 modulo 65536, or raise)."""
    return _port(text, 0)


def port_or_off(text: str) -> int:
    """A port option whose -1 turns the endpoint off (a worker's --metrics-port)."""
    return _port(text, -1)


def _port(text: str, low: int) -> int:
    allowed = f"{'-1 (off), ' if low < 0 else ''}0 (any free port) or 1-{PORT_HIGH}"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port, {allowed}; got {text!r}") from None
    if not low <= value <= PORT_HIGH:
        raise argparse.ArgumentTypeError(f"expected a port, {allowed}; got {value}")
    return value


def add_dataclass_arguments(parser: argparse.ArgumentParser | Any, cls: type, *,
                            skip: Collection[str] = frozenset(),
                            rename: dict[str, str] | None = None,
                            option_names: dict[str, str] | None = None,
                            defaults: dict[str, object] | None = None,
                            types: dict[str, Any] | None = None) -> None:
    """Add one --option per field of `cls` (bool fields become flags; an int field named
    `port` or `*_port` takes `port`, unless `types` gives its parser). A field whose
    default is built by a dataclass (options shared by several commands, such as the
    checkpoint options) adds that dataclass's options."""
    docs = field_docs(cls)
    rename = rename or {}
    option_names = option_names or {}
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        if f.name in skip or f.name.startswith("_") or not f.init:
            continue
        nested = _nested_options(f)
        if nested is not None:
            add_dataclass_arguments(parser, nested)
            continue
        # rename: another flag for the field; option_names: another flag and attribute
        # (protocol settings, whose field names may repeat across classes).
        dest = option_names.get(f.name, f.name)
        flag = "--" + rename.get(f.name, dest.replace("_", "-"))
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        help_text = docs.get(f.name, "").replace("%", "%%")  # argparse %-formats help
        kind: Any = f.type if isinstance(f.type, type) else {
            "int": int, "float": float, "str": str, "bool": bool}.get(str(f.type), str)
        if kind is int and (f.name == "port" or f.name.endswith("_port")):
            kind = port
        kind = (types or {}).get(f.name, kind)
        if kind is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=kind, default=default,
                                help=f"{help_text} (default: {default})")


def scalar(text: str) -> int | float | bool | str:
    """A KEY=VALUE option's value as what it reads as: an int, a float, true/false, or
    the text itself."""
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            continue
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    return text


def dataclass_from_args(cls: type, args: argparse.Namespace, *, build: bool = True,
                        **overrides: object) -> Any:
    """Build `cls` from parsed arguments; fields absent from `args` keep their defaults.
    `build=False`: return the keyword arguments instead of the object."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(cls):
        nested = _nested_options(f) if f.init else None
        if nested is not None:
            values[f.name] = dataclass_from_args(nested, args)
        elif f.init and hasattr(args, f.name):
            values[f.name] = getattr(args, f.name)
    values.update(overrides)
    return cls(**values) if build else values


def _nested_options(f: dataclasses.Field[Any]) -> type | None:
    """The dataclass whose options a field groups (its default_factory), if it is one."""
    factory = f.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


# ---------------------------------------------------------------------------- shared options
ENV_COORDINATOR = "RIPPLES_COORDINATOR"


class PrintableFormatter(logging.Formatter):
    """Each log record is one line of printable text: a newline or an escape sequence in
    a message (a host name from a worker's Register, a run's name) is escaped, so no
    client forges a log line or drives the terminal; a traceback keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:  # noqa: N802 (logging's name)
        return printable(super().formatMessage(record))


def setup_logging(verbose: bool, who: str = "") -> None:
    """The one logging set-up of a command (its processes log to stderr; a record
    repeated in a loop is summed up, not written each time: ripples/log_repeats.py).

    Where the process's logging is set up already (a command run in-process by a test or
    another program), it is left as it is: no handler or filter of its own is touched."""
    from ripples import log_repeats

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(PrintableFormatter(
        f"%(asctime)s {printable(who)}%(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        handlers=[handler])
    if handler in logging.getLogger().handlers:  # basicConfig took it: ours to filter
        log_repeats.install([handler])


def add_coordinator_option(parser: argparse.ArgumentParser) -> None:
    """--coordinator HOST:PORT, checked before the command runs (needs_coordinator)."""
    parser.add_argument("--coordinator", default=os.environ.get(ENV_COORDINATOR, ""),
                        help=f"HOST:PORT of the coordinator (default: ${ENV_COORDINATOR})")
    parser.set_defaults(needs_coordinator=True)


def check_coordinator(address: str) -> None:
    """ValueError unless the coordinator address (option or environment) is HOST:PORT."""
    from ripples.rpc import parse_target

    if not address:
        raise ValueError(f"give --coordinator HOST:PORT or set {ENV_COORDINATOR}")
    parse_target(address)


def add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    """How a command reaches a coordinator that has TLS or a token (docs/security.md);
    the processes it starts inherit them (as RIPPLES_* variables)."""
    from ripples.security import (
        ENV_TLS_CA,
        ENV_TLS_CLIENT_CERT,
        ENV_TLS_CLIENT_KEY,
        ENV_TOKEN,
        ENV_TOKEN_FILE,
    )

    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--token-file", default="", metavar="FILE",
                       help=f"the run's token (default: the file ${ENV_TOKEN_FILE} names, "
                            f"else ${ENV_TOKEN})")
    group.add_argument("--tls-ca", default="", metavar="FILE",
                       help="connect with TLS, checking the coordinator's certificate "
                            f"against this CA (PEM; default: ${ENV_TLS_CA})")
    group.add_argument("--tls-client-cert", default="", metavar="FILE",
                       help="mutual TLS: this client's certificate (PEM; default: "
                            f"${ENV_TLS_CLIENT_CERT})")
    group.add_argument("--tls-client-key", default="", metavar="FILE",
                       help=f"mutual TLS: its key (PEM; default: ${ENV_TLS_CLIENT_KEY})")


def add_server_security_arguments(parser: argparse.ArgumentParser) -> None:
    from ripples.security import ENV_TOKEN, ENV_TOKEN_FILE

    group = parser.add_argument_group("security (docs/security.md)")
    group.add_argument("--token-file", default="", metavar="FILE",
                       help="require this token on every call (default: the file "
                            f"${ENV_TOKEN_FILE} names, else ${ENV_TOKEN}; neither: no token)")
    group.add_argument("--read-token-file", default="", metavar="FILE",
                       help="also accept this read-only token, for the run's status and "
                            "consensus model only (dashboards)")
    group.add_argument("--tls-cert", default="", metavar="FILE",
                       help="serve gRPC over TLS with this certificate chain (PEM)")
    group.add_argument("--tls-key", default="", metavar="FILE", help="its private key (PEM)")
    group.add_argument("--tls-client-ca", default="", metavar="FILE",
                       help="mutual TLS: clients must show a certificate signed by this CA")


def export_client_security(args: argparse.Namespace) -> None:
    """Export a command's client security flags to the environment (for the clients it
    makes and the processes it starts) and check them; ValueError saying what is wrong."""
    from ripples.client_security import ClientSecurity, export_client_flags

    export_client_flags(args.token_file, args.tls_ca, args.tls_client_cert,
                        args.tls_client_key)
    ClientSecurity.from_env()
