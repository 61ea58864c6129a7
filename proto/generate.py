"""Regenerate (or check) the Python stubs of proto/ripples/v1/*.proto.

Usage:
    python proto/generate.py          # rewrite proto/ripples/v1/*_pb2*.py(i)
    python proto/generate.py --check  # exit 1 if the committed stubs drift from the .proto

The stubs import as ``ripples.v1`` (the proto package), never as a top-level ``proto``.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "ripples" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")
    return [out_dir / "ripples" / "v1" / f"{p.stem}{s}" for p in protos for s in GENERATED_SUFFIXES]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if committed stubs drift")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        drifted = []
        for path in generated:
            target = PACKAGE_DIR / path.name
            if args.check:
                if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                    drifted.append(target)
            else:
                target.write_bytes(path.read_bytes())
        # Stubs of a .proto that is gone (a service moved to another file) drift too.
        names = {path.name for path in generated}
        for stale in sorted(PACKAGE_DIR.iterdir()):
            if stale.name.endswith(GENERATED_SUFFIXES) and stale.name not in names:
                if args.check:
                    drifted.append(stale)
                else:
                    stale.unlink()
    if drifted:
        names = ", ".join(str(p.relative_to(PROTO_ROOT.parent)) for p in drifted)
        print(f"generated stubs drift from the .proto: {names}; run python proto/generate.py",
              file=sys.stderr)
        return 1
    if args.check:
        print("proto stubs are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
