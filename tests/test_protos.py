"""The contracts: generated stubs match the .proto files, and the protos pass `buf lint`."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_fresh():
    proc = subprocess.run([sys.executable, "scripts/gen_protos.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_buf_lint_clean():
    buf = shutil.which("buf") or str(Path(sys.executable).parent / "buf")
    proc = subprocess.run([buf, "lint"], cwd=ROOT / "protos", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_stubs_import_as_one_package():
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex.api.env.v1 import env_pb2_grpc
    from sinkflex.api.learner.v1 import learner_pb2_grpc
    from sinkflex.api.reward.v1 import reward_pb2_grpc
    from sinkflex.api.rollout.v1 import rollout_pb2_grpc

    traj = common_pb2.Trajectory(token_ids=[1, 2, 3], logprobs=[0.0, -0.5, -0.25], loss_mask=[0, 1, 1])
    back = common_pb2.Trajectory.FromString(traj.SerializeToString())
    assert list(back.token_ids) == [1, 2, 3] and list(back.loss_mask) == [0, 1, 1]
    assert back.logprobs[1] == -0.5
    for stub in (env_pb2_grpc.EnvServiceStub, reward_pb2_grpc.RewardServiceStub, rollout_pb2_grpc.RolloutServiceStub, learner_pb2_grpc.LearnerServiceStub):
        assert callable(stub)


# -- code generation for other languages (protos/buf.gen.yaml, scripts/buf_generate.py) ----------
def _buf_generate():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import buf_generate
    finally:
        sys.path.pop(0)
    return buf_generate


def _descriptor(pb2: Path):
    """The FileDescriptorProto a generated *_pb2.py registers, without json_name (buf's
    compiler fills it in, protoc leaves it to the runtime: the same contract either way)."""
    import ast
    import re

    from google.protobuf import descriptor_pb2

    literal = re.search(r"AddSerializedFile\((b'.*?')\)\n", pb2.read_text(), re.S).group(1)
    fd = descriptor_pb2.FileDescriptorProto.FromString(ast.literal_eval(literal))

    def strip(msgs):
        for m in msgs:
            for f in m.field:
                f.ClearField("json_name")
            strip(m.nested_type)

    strip(fd.message_type)
    return fd


def test_buf_gen_template_covers_python_ts_go():
    gen = _buf_generate()
    import yaml

    langs = [gen.language(p) for p in yaml.safe_load(gen.TEMPLATE.read_text())["plugins"]]
    assert set(langs) == {"python", "ts", "go"}
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        pkg = proto.parent.relative_to(ROOT / "protos")
        assert f'option go_package = "github.com/sinkflex/sinkflex-rl/gen/go/{pkg}' in proto.read_text(), proto


def test_typescript_env_code_is_fresh():
    """examples/clinic/src/gen is what buf + the pinned ts-proto generate now (into a temp dir)."""
    from tests.fixtures.clinic import build_clinic

    build_clinic()  # npm ci (ts-proto) and a tsc build: the generated code also compiles
    proc = subprocess.run([sys.executable, "scripts/buf_generate.py", "--check"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    gen = _buf_generate()
    assert gen.stale_ts() == []
    env_ts = (ROOT / "examples/clinic/src/gen/sinkflex/api/env/v1/env.ts").read_text()
    assert 'path: "/sinkflex.api.env.v1.EnvService/Step" as const' in env_ts and "protoc-gen-ts_proto  v2.18.0" in env_ts


def test_buf_generates_python_equal_to_the_committed_stubs(tmp_path):
    gen = _buf_generate()
    out = gen.generate(["python"], tmp_path)["python"]
    committed = ROOT / "sinkflex" / "api"
    for proto in sorted((ROOT / "protos").rglob("*.proto")):
        rel = proto.relative_to(ROOT / "protos").with_suffix("")
        for suffix in ("_pb2_grpc.py", "_pb2.pyi"):  # the same bytes as scripts/gen_protos.py writes
            assert (out / f"{rel}{suffix}").read_bytes() == (ROOT / f"{rel}{suffix}").read_bytes(), f"{rel}{suffix}"
        assert _descriptor(out / f"{rel}_pb2.py") == _descriptor(ROOT / f"{rel}_pb2.py"), rel
    assert committed.is_dir()


def test_buf_generates_go(tmp_path):
    gen = _buf_generate()
    why = gen.missing("go")
    if why:
        pytest.skip(f"Go cannot build on this machine: {why}")
    out = gen.generate(["go"], tmp_path)["go"]
    env_go = (out / "sinkflex/api/env/v1/env.pb.go").read_text()
    assert "package envv1" in env_go
    assert "EnvServiceServer" in (out / "sinkflex/api/env/v1/env_grpc.pb.go").read_text()
