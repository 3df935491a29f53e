# Generated gRPC/protobuf stubs of proto/kvlens/v1 (protoc 3.21 + grpc_python_plugin 1.51,
# matching Debian 12's python3-protobuf / python3-grpcio). Regenerate with
# `python3 -m kvlens.regenerate` after changing the .proto files.
