"""The TypeScript example env (examples/clinic): a Node process serving EnvService with
@grpc/grpc-js and ts-proto code, checked over real loopback gRPC: `sinkflex-rl env check`,
golden and partial episodes through Gymnasium, the checker's rewards, the splits, health,
reflection, and SIGTERM."""

from __future__ import annotations

import json
import signal

import grpc
import gymnasium as gym
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from typer.testing import CliRunner

import env_service
from sinkflex_rl.cli import app
from env_service.client import GrpcEnvClient
from sinkflex.api.env.v1 import env_pb2
from sinkflex.errors import ServiceError
from tests.fixtures.clinic import start_clinic

# The golden actions of every task (examples/clinic/src/domain.ts), as the agent sends them.
GOLDEN = {
    "cardio-monday": [("book_appointment", {"patient_id": "p1", "slot_id": "s1"})],
    "cancel-derm": [("cancel_appointment", {"patient_id": "p2", "appointment_id": "a1"})],
    "gp-tuesday-afternoon": [("book_appointment", {"patient_id": "p4", "slot_id": "s8"})],
    "move-derm-thursday": [("cancel_appointment", {"patient_id": "p2", "appointment_id": "a1"}),
                           ("book_appointment", {"patient_id": "p2", "slot_id": "s5"})],
    "no-derm-friday": [],
    "two-bookings": [("book_appointment", {"patient_id": "p4", "slot_id": "s3"}),
                     ("book_appointment", {"patient_id": "p4", "slot_id": "s9"})],
    "cancel-someone-else": [],
    "earliest-gp": [("book_appointment", {"patient_id": "p3", "slot_id": "s7"})],
}


@pytest.fixture(scope="module")
def clinic():
    address, proc = start_clinic("--max-sessions", "8")
    yield address
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def _call(name: str, args: dict, call_id: str) -> dict:
    return {"tool_calls": [{"id": call_id, "name": name, "arguments": args}]}


def _play(env, task_id: str, actions, end: dict | None = None):
    """Resets on `task_id`, sends each (tool, args) in its own step, then `end` (the done tool)."""
    obs, info = env.reset(seed=0, options={"task_id": task_id})
    assert info["task_id"] == task_id and obs[0]["role"] == "user"
    for j, (name, args) in enumerate(actions):
        obs, reward, terminated, truncated, _ = env.step(_call(name, args, f"c{j}"))
        assert not obs[0]["error"], obs
        assert (reward, terminated, truncated) == (0.0, False, False)  # no reward before the end
    return env.step(end or _call("done", {}, "end"))


def test_clinic_passes_env_check(clinic):
    result = CliRunner().invoke(app, ["env", "check", clinic, "--timeout", "30", "--max-sessions", "8"])
    assert result.exit_code == 0, result.output
    assert "16/16 checks passed" in result.output
    assert not [line for line in result.output.splitlines() if line.startswith("FAIL")]
    assert "clinic (8 tasks, splits ['train', 'test'])" in result.output
    assert "Received message larger than max (67109911 vs 67108864)" in result.output  # the 64 MiB limit


def test_splits_are_disjoint_and_cover_every_task(clinic):
    with GrpcEnvClient(clinic, timeout=10) as client:
        (info,) = client.list_environments()
        assert (info.name, list(info.splits), info.num_tasks, info.supports_solo) == ("clinic", ["train", "test"], 8, True)
        train, test, every = client.list_tasks("clinic", "train"), client.list_tasks("clinic", "test"), client.list_tasks("clinic")
        assert len(train) == 5 and len(test) == 3 and not set(train) & set(test) and set(train) | set(test) == set(every)
        assert set(every) == set(GOLDEN)
        # no task id: the seed picks one of the split's tasks, the same one for the same seed
        picked = [client.reset(env_pb2.ResetRequest(env="clinic", split="test", seed=s)) for s in (5, 5, 6)]
        assert picked[0].task_id == picked[1].task_id and {p.task_id for p in picked} <= set(test)
        for p in picked:
            client.close(p.session_id)


@pytest.mark.parametrize("task_id", sorted(GOLDEN))
def test_golden_actions_score_one(clinic, task_id):
    env = gym.make(env_service.REMOTE_TAU2_ENV_ID, address=clinic, env="clinic")
    try:
        obs, reward, terminated, truncated, info = _play(env, task_id, GOLDEN[task_id])
        assert (reward, terminated, truncated) == (1.0, True, False)
        assert info["termination_reason"] == "TERMINATION_REASON_AGENT_STOP"
        expected = json.loads(info["expected_changes"])
        assert json.loads(info["achieved_changes"]) == expected and json.loads(info["unexpected_changes"]) == []
        assert len(expected) == len(GOLDEN[task_id])
    finally:
        env.close()


def test_checker_partial_and_zero_rewards(clinic):
    env = gym.make(env_service.REMOTE_TAU2_ENV_ID, address=clinic, env="clinic")
    try:
        # half of a two-change task: 0.5
        _, reward, terminated, _, info = _play(env, "move-derm-thursday", GOLDEN["move-derm-thursday"][:1])
        assert (reward, terminated) == (0.5, True)
        assert json.loads(info["achieved_changes"]) == ["cancel p2@s4"]
        # the golden change plus another one: 0
        _, reward, _, _, info = _play(env, "cardio-monday", GOLDEN["cardio-monday"] + [
            ("book_appointment", {"patient_id": "p1", "slot_id": "s7"})])
        assert reward == 0.0 and json.loads(info["unexpected_changes"]) == ["book p1@s7"]
        # nothing done on a task with something to do: 0; stopping through StepRequest.stop
        assert _play(env, "two-bookings", [], end={"stop": True})[1:3] == (0.0, True)
        # a stop token in the agent's text ends the episode too (the rollout's path)
        assert _play(env, "no-derm-friday", [], end={"content": "Nothing is free on Friday. ###STOP###"})[1:3] == (1.0, True)
        # the tools refuse what the policy forbids, and the episode goes on
        env.reset(seed=0, options={"task_id": "cancel-someone-else"})
        obs, reward, terminated, _, _ = env.step(_call("cancel_appointment", {"patient_id": "p1", "appointment_id": "a2"}, "x"))
        assert obs[0]["error"] and "not patient p1's" in obs[0]["content"] and (reward, terminated) == (0.0, False)
        obs, *_ = env.step(_call("find_slots", {"specialty": "dermatology"}, "y"))
        assert [s["slot_id"] for s in json.loads(obs[0]["content"])] == ["s5"]  # s4 and s6 are booked
        assert env.step(_call("done", {}, "z"))[1:3] == (1.0, True)
    finally:
        env.close()


def test_budget_truncates_and_codes(clinic):
    with GrpcEnvClient(clinic, timeout=10) as client:
        r = client.reset(env_pb2.ResetRequest(env="clinic", task_id="cardio-monday", max_steps=2))
        text = env_pb2.StepRequest(session_id=r.session_id)
        text.action.content = "Let me look."
        first = client.step(text)
        assert not first.truncated and first.observation[0].content.startswith("Please go ahead")
        second = client.step(text)
        assert (second.truncated, second.terminated, second.reward) == (True, False, 0.0)
        with pytest.raises(ServiceError) as err:
            client.step(text)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "has ended" in err.value.message
        client.close(r.session_id)
        r = client.reset(env_pb2.ResetRequest(env="clinic", task_id="cardio-monday"))
        bad = env_pb2.StepRequest(session_id=r.session_id, stop=True)
        bad.action.tool_calls.add(id="a", name="done", arguments_json="{}")
        with pytest.raises(ServiceError) as err:
            client.step(bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        client.close(r.session_id)
        with pytest.raises(ServiceError) as err:
            client.reset(env_pb2.ResetRequest(env="bookshop"))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "this server serves \"clinic\"" in err.value.message


def test_health_and_reflection(clinic):
    channel = grpc.insecure_channel(clinic)
    try:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "sinkflex.api.env.v1.EnvService"):
            assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        (resp,) = list(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
        names = {s.name for s in resp.list_services_response.service}
        assert "sinkflex.api.env.v1.EnvService" in names and "grpc.health.v1.Health" in names
    finally:
        channel.close()


def test_sigterm_stops_gracefully():
    address, proc = start_clinic()
    with GrpcEnvClient(address, timeout=5) as client:
        assert client.list_environments()[0].name == "clinic"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=10) == 0


@pytest.mark.parametrize("name", ["toString", "__proto__", "constructor", "hasOwnProperty"])
def test_inherited_object_names_are_not_entries(clinic, name):
    """Model output is untrusted: names every JavaScript object inherits are unknown tools, tasks,
    splits, patients and slots (a clear NOT_FOUND or tool error), never INTERNAL or a session."""
    with GrpcEnvClient(clinic, timeout=10) as client:
        for req in (env_pb2.ResetRequest(env="clinic", task_id=name), env_pb2.ResetRequest(env="clinic", split=name)):
            with pytest.raises(ServiceError) as err:
                client.reset(req)
            assert err.value.code == grpc.StatusCode.NOT_FOUND, err.value.message
        with pytest.raises(ServiceError) as err:
            client.list_tasks("clinic", name)
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        r = client.reset(env_pb2.ResetRequest(env="clinic", task_id="cardio-monday"))
        step = env_pb2.StepRequest(session_id=r.session_id)
        step.action.tool_calls.add(id="t", name=name, arguments_json="{}")
        step.action.tool_calls.add(id="b", name="book_appointment",
                                   arguments_json=json.dumps({"patient_id": "p1", "slot_id": name}))
        step.action.tool_calls.add(id="p", name="get_patient", arguments_json=json.dumps({"patient_id": name}))
        out = client.step(step)
        assert [m.tool_call_id for m in out.observation] == ["t", "b", "p"]
        assert all(m.error for m in out.observation), [m.content for m in out.observation]
        assert "unknown tool" in out.observation[0].content and "not found" in out.observation[1].content
        client.close(r.session_id)


def test_error_messages_are_bounded(clinic):
    huge = "x" * 1_000_000
    with GrpcEnvClient(clinic, timeout=10) as client:
        with pytest.raises(ServiceError) as err:
            client.step(env_pb2.StepRequest(session_id=huge))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and len(err.value.message) < 1000
        with pytest.raises(ServiceError) as err:
            client.reset(env_pb2.ResetRequest(env=huge))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and len(err.value.message) < 1000
        r = client.reset(env_pb2.ResetRequest(env="clinic", task_id="cardio-monday"))
        step = env_pb2.StepRequest(session_id=r.session_id)
        step.action.tool_calls.add(id="k", name="get_patient", arguments_json=json.dumps({huge: "1"}))
        out = client.step(step)
        assert out.observation[0].error and len(out.observation[0].content) < 2000
        client.close(r.session_id)
