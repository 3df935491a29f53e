"""Regenerates kvlens/v1/*_pb2*.py from proto/kvlens/v1 with protoc and Debian's
grpc_python_plugin (package protobuf-compiler-grpc). grpc_tools is not used: Debian 12's
python3-grpc-tools (1.14) is far older than its python3-grpcio (1.51).

--check: regenerates into a temporary folder instead and exits 1, naming the files, when
the committed stubs differ from what the protos give (a proto edited without running this).
"""
import filecmp
import pathlib
import shutil
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent        # clients/python/kvlens
PROTO_ROOT = HERE.parents[2] / "proto"                 # the repository's proto/


def regenerate(out_dir: pathlib.Path = HERE.parent) -> None:
    protoc = shutil.which("protoc")
    plugin = shutil.which("grpc_python_plugin")
    if not protoc or not plugin:
        raise RuntimeError("protoc and grpc_python_plugin are needed "
                           "(apt-get install protobuf-compiler protobuf-compiler-grpc)")
    protos = sorted(str(p) for p in (PROTO_ROOT / "kvlens" / "v1").glob("*.proto"))
    subprocess.run([protoc, f"--proto_path={PROTO_ROOT}", f"--python_out={out_dir}",
                    f"--grpc_out={out_dir}", f"--plugin=protoc-gen-grpc={plugin}", *protos],
                   check=True)


def stale() -> list:
    """The committed stubs (kvlens/v1/…) that differ from freshly generated ones, or are
    missing."""
    with tempfile.TemporaryDirectory() as tmp:
        regenerate(pathlib.Path(tmp))
        fresh = sorted(pathlib.Path(tmp).rglob("*.py"))
        if not fresh:
            raise RuntimeError("protoc wrote no stubs")
        return [str(f.relative_to(tmp)) for f in fresh
                if not (HERE.parent / f.relative_to(tmp)).exists()
                or not filecmp.cmp(f, HERE.parent / f.relative_to(tmp), shallow=False)]


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        differ = stale()
        if differ:
            print("stale, run clients/python/kvlens/regenerate.py: " + ", ".join(differ))
            sys.exit(1)
        print("stubs match the protos")
    else:
        regenerate()
        print("regenerated", file=sys.stderr)
