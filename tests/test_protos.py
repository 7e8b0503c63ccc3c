"""The contracts: generated stubs match the .proto files, and the protos pass `buf lint`."""

import shutil
import subprocess
import sys
from pathlib import Path

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
