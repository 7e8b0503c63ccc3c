"""A protoc plugin (for `buf generate`) that runs grpcio-tools' built-in generators.

buf runs plugins as separate programs, but grpcio-tools ships the Python generators inside
its bundled protoc only. This plugin reads buf's CodeGeneratorRequest, hands the files to
that protoc (`--descriptor_set_in`), and answers with what it wrote. The plugin option
names the generator: `python` (messages, *_pb2.py), `pyi` (type stubs, *_pb2.pyi) or
`grpc_python` (services, *_pb2_grpc.py). In protos/buf.gen.yaml:

    - local: ["../.venv/bin/python", "../scripts/protoc_gen_grpc_tools.py"]
      opt: grpc_python
      out: ../build/gen/python
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2

GENERATORS = ("python", "pyi", "grpc_python")


def main() -> int:
    request = plugin_pb2.CodeGeneratorRequest.FromString(sys.stdin.buffer.read())
    response = plugin_pb2.CodeGeneratorResponse(
        supported_features=plugin_pb2.CodeGeneratorResponse.FEATURE_PROTO3_OPTIONAL)
    generator, _, options = request.parameter.partition(":")
    if generator not in GENERATORS:
        response.error = f"option must name a generator ({', '.join(GENERATORS)}), got {request.parameter!r}"
        sys.stdout.buffer.write(response.SerializeToString())
        return 0
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        descriptors = Path(tmp) / "in.binpb"
        descriptors.write_bytes(descriptor_pb2.FileDescriptorSet(file=request.proto_file).SerializeToString())
        out = Path(tmp) / "out"
        out.mkdir()
        flag = f"--{generator}_out={options + ':' if options else ''}{out}"
        if protoc.main(["protoc", f"--descriptor_set_in={descriptors}", flag, *request.file_to_generate]) != 0:
            response.error = f"grpcio-tools protoc failed ({generator}) on {list(request.file_to_generate)}"
        else:
            for path in sorted(p for p in out.rglob("*") if p.is_file()):
                response.file.add(name=str(path.relative_to(out)), content=path.read_text())
    sys.stdout.buffer.write(response.SerializeToString())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
