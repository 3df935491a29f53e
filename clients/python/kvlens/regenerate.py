"""Regenerates kvlens/v1/*_pb2*.py from proto/kvlens/v1 with protoc and Debian's
grpc_python_plugin (package protobuf-compiler-grpc). grpc_tools is not used: Debian 12's
python3-grpc-tools (1.14) is far older than its python3-grpcio (1.51)."""
import pathlib
import shutil
import subprocess
import sys

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


if __name__ == "__main__":
    regenerate()
    print("regenerated", file=sys.stderr)
