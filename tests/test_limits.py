"""Load shedding and caps over real loopback gRPC: the concurrent-RPC cap and per-method request
limits of every `ServiceServer` (`sinkflex.limits`), the rollout service's Rollout caps and the
reward service's ScoreBatch cap, each answered with a status that names the limit."""

from __future__ import annotations

import threading

import grpc
import pytest

from reward_service.config import RewardServiceConfig
from reward_service.server import build_server as build_reward
from rollout_service.config import RolloutLimits
from rollout_service.server import SERVICE_NAME as ROLLOUT_S
from rollout_service.server import RolloutServicer
from sinkflex.api.reward.v1 import reward_pb2, reward_pb2_grpc
from sinkflex.api.rollout.v1 import rollout_pb2, rollout_pb2_grpc
from sinkflex.serving import ServiceServer, make_channel

pytestmark = pytest.mark.timeout(120)


class _Slow(rollout_pb2_grpc.RolloutServiceServicer):
    def __init__(self):
        self.release = threading.Event()
        self.entered = threading.Semaphore(0)

    def Status(self, request, context):
        self.entered.release()
        self.release.wait(30)
        return rollout_pb2.StatusResponse(model="m")


def test_concurrent_rpcs_above_the_cap_are_refused_naming_it_and_health_still_answers():
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    slow = _Slow()
    server = ServiceServer(port=0, service_names=[ROLLOUT_S], max_concurrent_rpcs=2, grace_seconds=0.0)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(slow, server.server)
    server.start()
    server.set_serving()
    try:
        with make_channel(f"127.0.0.1:{server.port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            futures = [stub.Status.future(rollout_pb2.StatusRequest(), timeout=30) for _ in range(2)]
            for _ in range(2):
                assert slow.entered.acquire(timeout=10)
            with pytest.raises(grpc.RpcError) as err:
                stub.Status(rollout_pb2.StatusRequest(), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "max_concurrent_rpcs 2" in err.value.details()
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            slow.release.set()
            assert all(f.result().model == "m" for f in futures)
            assert stub.Status(rollout_pb2.StatusRequest(), timeout=10).model == "m"  # a slot is free again
    finally:
        slow.release.set()
        server.stop()


def test_a_shed_call_is_retryable_and_succeeds_once_a_slot_is_free():
    """A refusal by load shedding, as the project's clients see it, is `ServiceError.shed` and
    `.retryable` (the predicate of every retry of an idempotent call: the agent's ScoreBatch, the
    driver's polls); the same call sent again with that predicate succeeds once a slot is free."""
    from tenacity import Retrying, retry_if_exception, stop_after_delay, wait_fixed

    from rollout_service.client import GrpcRolloutClient
    from sinkflex.errors import ServiceError

    slow = _Slow()
    server = ServiceServer(port=0, service_names=[ROLLOUT_S], max_concurrent_rpcs=1, grace_seconds=0.0)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(slow, server.server)
    server.start()
    server.set_serving()
    client = GrpcRolloutClient(f"127.0.0.1:{server.port}")
    try:
        held = threading.Thread(target=client.status, kwargs={"timeout": 30})
        held.start()
        assert slow.entered.acquire(timeout=10)  # the one slot is taken
        with pytest.raises(ServiceError) as err:
            client.status(timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.shed and err.value.retryable
        assert not ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "too many open sessions (max 8)").retryable
        threading.Timer(1.0, slow.release.set).start()
        tries = []
        for attempt in Retrying(stop=stop_after_delay(30), wait=wait_fixed(0.2), reraise=True,
                                retry=retry_if_exception(lambda e: isinstance(e, ServiceError) and e.retryable),
                                before_sleep=tries.append):
            with attempt:
                assert client.status(timeout=10).model == "m"
        assert tries  # refused at least once, then answered
        held.join(10)
    finally:
        slow.release.set()
        client.close()
        server.stop()


def test_rollout_caps_and_small_request_limits():
    server = ServiceServer(port=0, service_names=[ROLLOUT_S], grace_seconds=0.0)
    limits = RolloutLimits(max_group_size=8, max_tasks_per_call=3, max_turns=10, max_context_tokens=4096)
    rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(limits=limits), server.server)
    server.start()
    server.set_serving()
    try:
        with make_channel(f"127.0.0.1:{server.port}") as ch:
            stub = rollout_pb2_grpc.RolloutServiceStub(ch)
            base = dict(env="mock", task_ids=["t"], group_size=2)
            for change, needle in [({"group_size": 9}, "max_group_size"), ({"task_ids": ["a", "b", "c", "d"]}, "max_tasks_per_call"),
                                   ({"max_turns": 11}, "max_turns"), ({"max_context_tokens": 5000}, "max_context_tokens"),
                                   ({"max_turns": -1}, "must be >= 0")]:
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Rollout(rollout_pb2.RolloutRequest(**{**base, **change}), timeout=10))
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and needle in err.value.details()
            # within the caps: on to the engine, which is still loading
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Rollout(rollout_pb2.RolloutRequest(**base), timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(grpc.RpcError) as err:  # UpdateWeights: a 64 KiB request limit
                stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(policy_version=1, location="x" * 70_000), timeout=10)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "above this method's limit of 65536 bytes" in err.value.details()
            with pytest.raises(grpc.RpcError) as err:  # under the limit: answered as before
                stub.UpdateWeights(rollout_pb2.UpdateWeightsRequest(policy_version=1, location="/x"), timeout=10)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop()


def test_score_batch_above_its_cap_is_refused_naming_it():
    server, _ = build_reward(RewardServiceConfig(port=0, metrics_port=None, preload_envs=[], grace_seconds=0.0,
                                                 max_batch_items=3))
    server.start()
    server.set_serving()
    try:
        with make_channel(f"127.0.0.1:{server.port}") as ch:
            stub = reward_pb2_grpc.RewardServiceStub(ch)
            req = reward_pb2.ScoreBatchRequest(items=[reward_pb2.ScoreRequest(env="mock", task_id="x")] * 4)
            with pytest.raises(grpc.RpcError) as err:
                stub.ScoreBatch(req, timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_batch_items" in err.value.details()
            ok = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=[reward_pb2.ScoreRequest(env="mock", task_id="x")]),
                                 timeout=60)
            assert len(ok.items) == 1 and ok.items[0].error
    finally:
        server.stop()


def test_the_drivers_reward_check_splits_its_tasks_under_the_servers_cap(monkeypatch):
    """`unknown_tasks` (the driver's check before training: the demo's 256 train + 64 test tasks)
    sends batches of at most CHECK_BATCH_ITEMS; with a server cap below the task count it still
    answers, naming every unknown task (a single batch of 320 was refused: INVALID_ARGUMENT)."""
    import reward_service.client as reward_client
    from reward_service.client import GrpcRewardClient, unknown_tasks

    server, _ = build_reward(RewardServiceConfig(port=0, metrics_port=None, preload_envs=["mock"], grace_seconds=0.0,
                                                 max_batch_items=3))
    assert reward_client.CHECK_BATCH_ITEMS <= RewardServiceConfig().max_batch_items  # the shipped sizes fit
    server.start()
    server.set_serving()
    monkeypatch.setattr(reward_client, "CHECK_BATCH_ITEMS", 3)
    try:
        with GrpcRewardClient(f"127.0.0.1:{server.port}") as client:
            ids = ["create_task_1", "nope_1", "update_task_1", "nope_2", "impossible_task_1", "nope_3", "nope_4"]
            unknown = unknown_tasks(client, "mock", ids, solo_mode=True)
            assert [t for t, _ in unknown] == ["nope_1", "nope_2", "nope_3", "nope_4"]
    finally:
        server.stop()


def test_episodes_wait_out_an_env_server_that_sheds_load(rollout_tokenizer):
    """16 episodes at once against a real env server that admits one RPC at a time: the calls it
    refuses as busy are sent again (`rollout_service.episode._env_call`), and every episode ends
    as the same episode run alone does — none is an infrastructure error."""
    import asyncio

    from env_service.client import GrpcEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.server import build_server
    from rollout_service.engine import Sampling
    from rollout_service.episode import EpisodeSpec, EpisodeStatus, run_episode
    from rollout_service.formatting import ChatTemplateFormatter, hermes_call_text
    from sinkflex.api.common.v1 import common_pb2
    from sinkflex_rl.warm_start import GoldenEngine

    tok = rollout_tokenizer
    server, _ = build_server(EnvServiceConfig(domains=("mock",), max_workers=2), port=0)
    assert server.limits.max_concurrent_rpcs == 1
    client = GrpcEnvClient(f"127.0.0.1:{server.port}", timeout=60)
    call = hermes_call_text(common_pb2.ToolCall(name="get_users", arguments_json="{}"))
    reply = list(tok.encode(call, add_special_tokens=False))
    spec = EpisodeSpec(env="mock", task_id="create_task_1", sampling=Sampling(max_new_tokens=64), max_turns=4,
                       max_context_tokens=8192, solo_mode=True)

    async def episodes(n: int):
        fmt = ChatTemplateFormatter(tok)
        return await asyncio.gather(*(run_episode(GoldenEngine([reply + [fmt.eot_id]] * 4, fmt.eot_id), client,
                                                  ChatTemplateFormatter(tok), spec) for _ in range(n)))

    try:
        (alone,) = asyncio.run(episodes(1))
        assert alone.status == EpisodeStatus.MAX_TURNS and len(alone.turns) == 4  # 4 get_users calls, 4 Steps
        assert alone.messages[-1].role == common_pb2.ROLE_TOOL and alone.messages[-1].content  # the 4th call's result
        refused = 0
        for _ in range(5):  # the threads race for the one slot: refusals are near-certain, made certain here
            before = server.limits.refused
            together = asyncio.run(episodes(16))
            refused += server.limits.refused - before
            assert [(e.status, len(e.turns), e.messages[-1].content) for e in together] == \
                [(alone.status, len(alone.turns), alone.messages[-1].content)] * 16
            if refused:
                break
        assert refused > 0
    finally:
        client.shutdown()
        server.stop()
