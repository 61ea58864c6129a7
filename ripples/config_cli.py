"""Typed configs on the command line: every option is documented once, on its field.

A config is a keyword-only dataclass whose fields carry attribute docstrings; those
docstrings become the CLI help, so an option is documented in exactly one place.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import textwrap
from collections.abc import Collection
from typing import Any


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


def add_dataclass_arguments(parser: argparse.ArgumentParser | Any, cls: type, *,
                            skip: Collection[str] = frozenset(),
                            rename: dict[str, str] | None = None,
                            option_names: dict[str, str] | None = None,
                            defaults: dict[str, object] | None = None) -> None:
    """Add one --option per field of `cls` (bool fields become flags). A field whose
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
        kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "str": str,
                                                        "bool": bool}.get(str(f.type), str)
        if kind is bool:
            parser.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction,
                                default=default, help=help_text)
        else:
            parser.add_argument(flag, dest=dest, type=kind, default=default,
                                help=f"{help_text} (default: {default})")


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
