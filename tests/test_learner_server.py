"""LearnerService over real loopback gRPC (one test per RPC), the loop on a real Redis buffer,
and UpdateWeights calls reaching a RolloutService endpoint."""

import threading
import time
import uuid
from pathlib import Path

import grpc
import pytest

from learner_service.loop import LearnerRunner
from learner_service.server import SERVICE_NAME, LearnerServicer
from learner_service.trainer import Learner
from sinkflex.api.learner.v1 import learner_pb2, learner_pb2_grpc
from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
from sinkflex.serving import ServiceServer, make_channel, wait_for_serving
from tests.fixtures.learner import TINY_GPT_OSS, learner_config, make_group, one_thread


class RecordingRollout(rollout_pb2_grpc.RolloutServiceServicer):
    """The rollout service's UpdateWeights contract, recording each request (the real engine
    reload is the rollout service's own test); refuses a version that does not increase."""

    def __init__(self):
        self.calls: list[tuple[int, str]] = []

    def UpdateWeights(self, request, context):
        if self.calls and request.policy_version <= self.calls[-1][0]:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "policy_version must increase")
        self.calls.append((request.policy_version, request.location))
        return rollout_pb2.UpdateWeightsResponse(policy_version=request.policy_version, load_seconds=0.01)


@pytest.fixture
def rollout_endpoint():
    rec = RecordingRollout()
    server = ServiceServer(port=0, service_names=["sinkflex.api.rollout.v1.RolloutService"])
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(rec, server.server)
    server.start()
    server.set_serving()
    yield f"127.0.0.1:{server.port}", rec
    server.stop()


def test_learner_service_rpcs(tmp_path, rollout_endpoint):
    address, rec = rollout_endpoint
    buf = TrajectoryBuffer(url=embedded_redis_url(), stream=f"test-learner-srv:{uuid.uuid4().hex[:8]}")
    for i in range(2):
        buf.put(make_group(f"r{i}", [0.0, 1.0, 0.5], seed=40 + i))
    cfg = learner_config(tmp_path, TINY_GPT_OSS, batch=dict(groups_per_step=1), rollout_address=address,
                         buffer=dict(url=buf.url, stream=buf.stream, block_ms=100))
    with one_thread():
        learner = Learner(cfg)
        runner = LearnerRunner(learner, buf)
        server = ServiceServer(port=0, service_names=[SERVICE_NAME])
        learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(runner, checkpoint_timeout_s=60), server.server)
        server.start()
        server.set_serving()
        loop = threading.Thread(target=runner.run, daemon=True)
        loop.start()
        try:
            with make_channel(f"127.0.0.1:{server.port}") as ch:
                wait_for_serving(ch, SERVICE_NAME, timeout=10)
                stub = learner_pb2_grpc.LearnerServiceStub(ch)
                deadline = time.monotonic() + 120
                while stub.Status(learner_pb2.StatusRequest()).step < 2:
                    assert time.monotonic() < deadline and loop.is_alive()
                    time.sleep(0.05)
                st = stub.Status(learner_pb2.StatusRequest())
                assert st.policy_version == 2 and st.groups_trained == 2
                assert "loss" in st.metrics and "clip_fraction" in st.metrics

                ck = stub.Checkpoint(learner_pb2.CheckpointRequest(), timeout=60)
                assert ck.policy_version == 2 and ck.step == 2 and (Path(ck.path) / "state.json").is_file()

                # Version 2 is published right after its checkpoint: poll for it.
                while (pv := stub.PolicyVersion(learner_pb2.PolicyVersionRequest())).policy_version < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                assert pv.policy_version == 2 and (Path(pv.location) / "model.safetensors").is_file()
        finally:
            runner.request_stop()
            loop.join(timeout=60)
            server.stop()
            learner.close()
    assert not loop.is_alive()
    assert [v for v, _ in rec.calls] == [1, 2]
    assert rec.calls[-1][1] == pv.location
    stats = buf.stats()
    assert stats.unconsumed == 0 and stats.trained == 2
    buf.delete()
    buf.close()


def test_policy_version_before_any_publish_is_unavailable(tmp_path):
    with one_thread():
        learner = Learner(learner_config(tmp_path, TINY_GPT_OSS), metrics=False)
    learner.state.published_version = -1
    server = ServiceServer(port=0, service_names=[SERVICE_NAME])
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(LearnerServicer(LearnerRunner(learner)), server.server)
    server.start()
    server.set_serving()
    try:
        with make_channel(f"127.0.0.1:{server.port}") as ch:
            stub = learner_pb2_grpc.LearnerServiceStub(ch)
            with pytest.raises(grpc.RpcError) as err:
                stub.PolicyVersion(learner_pb2.PolicyVersionRequest())
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE and "no policy version" in err.value.details()
            st = stub.Status(learner_pb2.StatusRequest())
            assert st.step == 0 and st.policy_version == 0
    finally:
        server.stop()
