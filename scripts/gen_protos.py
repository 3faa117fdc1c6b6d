"""Regenerate the committed gRPC stubs in kunserve/v1/ from protos/kunserve/v1/*.proto.

Run `python scripts/gen_protos.py`; tests/unit/test_protos.py fails when the committed stubs drift.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
OUT_PACKAGE = ROOT / "kunserve" / "v1"


def generate(out_root: pathlib.Path) -> list[pathlib.Path]:
    """Generate stubs under out_root/kunserve/v1 and return the written files."""
    from grpc_tools import protoc  # dev dependency, only needed to regenerate

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "kunserve" / "v1").glob("*.proto"))
    include = str(pathlib.Path(protoc.__file__).parent / "_proto")
    args = ["protoc", f"-I{PROTO_ROOT}", f"-I{include}", f"--python_out={out_root}",
            f"--pyi_out={out_root}", f"--grpc_python_out={out_root}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "kunserve" / "v1").glob("*_pb2*.py*"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(pathlib.Path(tmp))
        for old in OUT_PACKAGE.glob("*_pb2*.py*"):
            old.unlink()
        for f in files:
            shutil.copy(f, OUT_PACKAGE / f.name)
    print(f"wrote {len(files)} files to {OUT_PACKAGE.relative_to(ROOT)}", file=sys.stderr)


if __name__ == "__main__":
    main()
