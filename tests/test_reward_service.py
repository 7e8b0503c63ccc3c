"""The reward service over real gRPC on loopback, on real tau2 retail trajectories.

The peer check: for every trajectory of the set (golden, one wrong argument, missing
write, agent stop without finishing, transfers, cut by max steps), the service's reward
and per-check breakdown equal what tau2's own `evaluate_simulation` returns for the same
simulation built from the native tau2 messages.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import ServiceError
from tests.fixtures.reward import MOCK_CASES

ROOT = Path(__file__).resolve().parent.parent
TYPE_NAMES = {"DB": common_pb2.REWARD_TYPE_DB, "COMMUNICATE": common_pb2.REWARD_TYPE_COMMUNICATE,
              "ACTION": common_pb2.REWARD_TYPE_ACTION, "ENV_ASSERTION": common_pb2.REWARD_TYPE_ENV_ASSERTION,
              "NL_ASSERTION": common_pb2.REWARD_TYPE_NL_ASSERTION}

PEER_SET = [
    "golden", "wrong_argument", "missing_write", "agent_stop_unfinished",
    "transfer_wrong", "transfer_golden", "max_steps_after_call", "max_steps_after_work",
]


def tau2_reward_info(traj, task):
    """tau2's own evaluation of the trajectory's native messages (the peer)."""
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from reward_service.scoring import build_simulation

    sim = build_simulation(traj.task_id, list(traj.messages), traj.termination)
    req = traj.request
    return evaluate_simulation(sim, task, EvaluationType.ALL, solo_mode=req.solo_mode, domain=req.env)


#: tau2's reward for each trajectory of the set: the set is not trivial.
EXPECTED = {n: (1.0 if n in ("golden", "transfer_golden") else 0.0) for n in PEER_SET}


@pytest.mark.parametrize("name", PEER_SET)
def test_peer_check_equals_tau2_evaluate_simulation(name, retail_trajectories, retail_tasks, reward_client):
    traj = retail_trajectories[name]
    ours = reward_client.score(traj.request)
    peer = tau2_reward_info(traj, retail_tasks[traj.task_id])
    assert ours.reward == peer.reward == EXPECTED[name]
    expected = {TYPE_NAMES[k.value]: v for k, v in (peer.reward_breakdown or {}).items()}
    assert {c.type: c.reward for c in ours.components if json.loads(c.details_json)["in_basis"]} == expected
    assert list(ours.reward_basis) == [TYPE_NAMES[t.value] for t in (peer.reward_basis or [])]
    if peer.reward_basis is None:  # premature: tau2's note, word for word
        assert ours.info == peer.info["note"]
    # And every check record (db_check, communicate_checks, ...) is tau2's.
    from reward_service.scoring import to_breakdown

    assert ours == to_breakdown(peer)


@pytest.mark.parametrize("case", MOCK_CASES, ids=lambda c: f"{c[0]}-{'solo' if c[1] else 'dual'}")
def test_peer_check_mock_env_assertion_action_and_solo(case, mock_trajectories, reward_client):
    """tau2's mock domain covers the other bases (ENV_ASSERTION, ACTION) and solo mode."""
    from reward_service.scoring import to_breakdown

    traj = mock_trajectories[case]
    ours = reward_client.score(traj.request)
    peer = tau2_reward_info(traj, mock_trajectories["tasks"][traj.task_id])
    assert ours == to_breakdown(peer)
    assert ours.reward == peer.reward == 1.0
    assert {c.type for c in ours.components if json.loads(c.details_json)["in_basis"]} == set(ours.reward_basis)


def test_solo_mode_requests_are_checked(retail_trajectories, mock_trajectories, reward_client):
    with pytest.raises(ServiceError, match="does not support tau2's solo mode") as err:
        reward_client.score(_request(retail_trajectories["golden"], solo_mode=True))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    req = _request(mock_trajectories[("create_task_1", True)])
    req.messages.insert(1, common_pb2.Message(role=common_pb2.ROLE_USER, content="hi"))
    with pytest.raises(ServiceError, match="a solo episode has none") as err:
        reward_client.score(req)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_golden_retail_scores_one_with_breakdown(retail_trajectories, retail_tasks, reward_client):
    b = reward_client.score(retail_trajectories["golden"].request)
    assert b.reward == 1.0
    assert list(b.reward_basis) == [common_pb2.REWARD_TYPE_DB, common_pb2.REWARD_TYPE_COMMUNICATE]
    comps = {c.type: c for c in b.components}
    assert comps[common_pb2.REWARD_TYPE_DB].reward == 1.0
    assert json.loads(comps[common_pb2.REWARD_TYPE_DB].details_json)["db_check"] == {"db_match": True, "db_reward": 1.0}
    comm = json.loads(comps[common_pb2.REWARD_TYPE_COMMUNICATE].details_json)["communicate_checks"]
    assert [c["info"] for c in comm] == retail_tasks["19"].evaluation_criteria.communicate_info == ["54.04", "41.64"]
    assert all(c["met"] for c in comm)


def test_one_wrong_argument_on_the_write_scores_zero(retail_trajectories, reward_client):
    b = reward_client.score(retail_trajectories["wrong_argument"].request)
    assert b.reward == 0.0
    comps = {c.type: c for c in b.components}
    assert json.loads(comps[common_pb2.REWARD_TYPE_DB].details_json)["db_check"]["db_match"] is False
    assert comps[common_pb2.REWARD_TYPE_COMMUNICATE].reward == 1.0  # only the DB check failed


def test_max_steps_right_after_an_unanswered_tool_call(retail_trajectories, reward_client):
    req = retail_trajectories["max_steps_after_call"].request
    assert req.messages[-1].tool_calls and req.messages[-1].tool_calls[0].name == "return_delivered_order_items"
    b = reward_client.score(req)
    assert b.reward == 0.0
    assert b.info == "Simulation terminated prematurely. Termination reason: max_steps"


def test_nine_megabyte_trajectory_is_scored(retail_tasks, reward_client):
    from tests.fixtures.reward import build_long_golden

    long = build_long_golden(retail_tasks["19"])
    size = long.request.ByteSize()
    assert 8_500_000 < size < 10_000_000, size
    b = reward_client.score(long.request)
    assert b.reward == 1.0 and len(long.request.messages) > 3000
    # The limits hold on both sides: a 4 MiB client refuses to send it, a 4 MiB server to receive it.
    from reward_service.client import GrpcRewardClient
    from reward_service.config import RewardServiceConfig
    from reward_service.server import build_server

    small = GrpcRewardClient(reward_client.address, max_message_bytes=4 << 20)
    with pytest.raises(ServiceError) as err:
        small.score(long.request)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    small.close()
    server, _ = build_server(RewardServiceConfig(port=0, metrics_port=None, max_message_bytes=4 << 20))
    port = server.start()
    server.set_serving()
    try:
        with GrpcRewardClient(f"127.0.0.1:{port}") as client:
            with pytest.raises(ServiceError) as err:
                client.score(long.request)
            assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop()


def _request(traj, **changes):
    req = reward_pb2.ScoreRequest()
    req.CopyFrom(traj.request)
    for k, v in changes.items():
        setattr(req, k, v)
    return req


@pytest.mark.parametrize(
    "change, code, words",
    [
        ({"env": "nosuchenv"}, grpc.StatusCode.NOT_FOUND, "unknown env 'nosuchenv'"),
        ({"task_id": "9999"}, grpc.StatusCode.NOT_FOUND, "unknown task '9999'"),
        ({"env": ""}, grpc.StatusCode.INVALID_ARGUMENT, "env is empty"),
        ({"task_id": ""}, grpc.StatusCode.INVALID_ARGUMENT, "task_id is empty"),
        ({"termination_reason": 0}, grpc.StatusCode.INVALID_ARGUMENT, "termination_reason"),
        ("orphan_tool", grpc.StatusCode.INVALID_ARGUMENT, "answers no pending tool call"),
        ("wrong_id", grpc.StatusCode.INVALID_ARGUMENT, "the next pending tool call is 'call_0'"),
        ("unspecified_role", grpc.StatusCode.INVALID_ARGUMENT, "not a valid role"),
        ("turn_while_pending", grpc.StatusCode.INVALID_ARGUMENT, "unanswered"),
    ],
)
def test_malformed_requests(change, code, words, retail_trajectories, reward_client):
    golden = retail_trajectories["golden"]
    if isinstance(change, dict):
        req = _request(golden, **change)
    else:
        req = _request(golden)
        if change == "orphan_tool":
            req.messages.insert(1, common_pb2.Message(role=common_pb2.ROLE_TOOL, tool_call_id="x", content="{}"))
        elif change == "wrong_id":
            tool_idx = next(i for i, m in enumerate(req.messages) if m.role == common_pb2.ROLE_TOOL)
            req.messages[tool_idx].tool_call_id = "call_7"
        elif change == "unspecified_role":
            req.messages[1].role = common_pb2.ROLE_UNSPECIFIED
        elif change == "turn_while_pending":
            call_idx = next(i for i, m in enumerate(req.messages) if m.tool_calls)
            req.messages.insert(call_idx + 1, common_pb2.Message(role=common_pb2.ROLE_USER, content="hello?"))
    with pytest.raises(ServiceError) as err:
        reward_client.score(req)
    assert err.value.code == code
    assert words in err.value.message


def test_score_batch_with_one_bad_item(retail_trajectories, reward_client):
    good = retail_trajectories["golden"].request
    wrong = retail_trajectories["wrong_argument"].request
    bad = _request(retail_trajectories["golden"], task_id="nope")
    items = reward_client.score_batch([good, bad, wrong])
    assert len(items) == 3
    assert items[0].breakdown.reward == 1.0 and items[0].error == "" and items[0].error_code == 0
    assert math.isnan(items[1].breakdown.reward) and "unknown task 'nope'" in items[1].error  # unscored, not 0
    assert items[1].error_code == grpc.StatusCode.NOT_FOUND.value[0]
    assert items[1].breakdown.info == items[1].error
    assert items[2].breakdown.reward == 0.0 and items[2].error == ""
    assert items[2].breakdown == reward_client.score(wrong)


def test_nl_assertion_task_without_judge_is_refused(retail_trajectories, reward_client):
    req = _request(retail_trajectories["golden"], task_id="19-nl")
    with pytest.raises(ServiceError) as err:
        reward_client.score(req)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no NL-assertion judge" in err.value.message
    [item] = reward_client.score_batch([req])
    assert item.error_code == grpc.StatusCode.FAILED_PRECONDITION.value[0] and "NL_ASSERTION" in item.error


def test_health_and_reflection(reward_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    from reward_service.server import SERVICE_NAME

    channel = grpc.insecure_channel(reward_server)
    status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert "sinkflex.api.reward.v1.RewardService" in services and "grpc.health.v1.Health" in services
    channel.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_reward_service_serves_and_stops_on_sigterm(retail_trajectories):
    """The entry point: SERVING once loaded, scores the golden trajectory, counts it in /metrics, exits 0 on SIGTERM."""
    from reward_service.client import GrpcRewardClient
    from sinkflex.serving import make_channel, wait_for_serving

    port, metrics_port = _free_port(), _free_port()
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "reward_service", "--host", "127.0.0.1", "--port", str(port),
         "--metrics-port", str(metrics_port)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        channel = make_channel(f"127.0.0.1:{port}")
        wait_for_serving(channel, "sinkflex.api.reward.v1.RewardService", timeout=120)
        channel.close()
        with GrpcRewardClient(f"127.0.0.1:{port}") as client:
            assert client.score(retail_trajectories["golden"].request).reward == 1.0
        import urllib.request

        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
        assert 'grpc_method="Score"' in metrics and 'sinkflex_service="reward"' in metrics
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
        assert "stopping gracefully" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
