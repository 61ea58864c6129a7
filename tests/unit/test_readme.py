"""The README's promises that code can check: the DDP migration diff is the examples'."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _code(path: Path) -> list[str]:
    """The lines after the module docstring (the docstrings say different things)."""
    text = path.read_text()
    docstring = ast.parse(text).body[0]
    return text.splitlines()[docstring.end_lineno:]


def test_the_migration_diff_is_the_diff_of_the_two_examples() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Migrating from DDP"):]
    shown = re.search(r"```diff\n(.*?)```", section, re.S)
    assert shown is not None, "the README lost its migration diff"
    ddp, ripples = REPO / "examples" / "ddp_digits.py", REPO / "examples" / "ripples_digits.py"
    actual = difflib.unified_diff(_code(ddp), _code(ripples), "examples/ddp_digits.py",
                                  "examples/ripples_digits.py", n=1, lineterm="")
    assert shown.group(1) == "\n".join(actual) + "\n", (
        "the examples changed: regenerate the README's diff (this test's unified_diff)")
