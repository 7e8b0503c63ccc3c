"""Training on the two envs plugged in from outside, through the real services: the bookshop
(Python) and the clinic (TypeScript on Node), each scored by its own checker (task.reward: env).

One local launch (`sinkflex_rl.local.launch_local`: the vLLM CPU engine's rollout service and the
torchrun learner as processes, an embedded Redis, gRPC on loopback; no env service and no
reward service, since the env runs already and scores itself) and two controllers on it: one
RL step on bookshop (policy v0 -> v1), then one on the clinic (v1 -> v2), so the slow engine
and learner start once. The env address is a recording proxy in front of both env servers:
it forwards every call unchanged, notes each session's return (the sum of the rewards the
env reported; 0 for an episode the env did not end), and plays one episode of each group of
two with a script (bookshop: the golden lend, reward 1.0; clinic: half of a two-part task,
the checker's partial credit 0.5) so that non-zero rewards are among them. The
trajectories' rewards must be exactly the rewards the envs reported.
"""

from __future__ import annotations

import json
import math
import threading
from collections import Counter
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2, env_pb2_grpc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: (env, task) -> the script's tool calls, played instead of the policy's first turn (then stop)
SCRIPTS = {
    ("bookshop", "lend-dune"): [("lend_book", {"member_id": "m1", "book_id": "b1"})],  # golden: 1.0
    ("clinic", "move-derm-thursday"): [("cancel_appointment", {"patient_id": "p2", "appointment_id": "a1"})],  # half: 0.5
}


class RecordingProxy(env_pb2_grpc.EnvServiceServicer):
    """EnvService in front of one server per env: forwards, records returns, scripts every other session."""

    def __init__(self, backends: dict[str, str]):
        self.channels = {env: grpc.insecure_channel(addr) for env, addr in backends.items()}
        self.stubs = {env: env_pb2_grpc.EnvServiceStub(ch) for env, ch in self.channels.items()}
        self.sessions: dict[str, dict] = {}
        self.resets: Counter = Counter()
        self.lock = threading.Lock()

    def _call(self, context, fn, request):
        try:
            return fn(request, timeout=60)
        except grpc.RpcError as err:
            context.abort(err.code(), err.details())

    def _stub(self, env: str, context):
        if env not in self.stubs:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown env {env!r}")
        return self.stubs[env]

    def ListEnvironments(self, request, context):
        out = env_pb2.ListEnvironmentsResponse()
        for stub in self.stubs.values():
            out.environments.extend(self._call(context, stub.ListEnvironments, request).environments)
        return out

    def ListTasks(self, request, context):
        return self._call(context, self._stub(request.env, context).ListTasks, request)

    def Reset(self, request, context):
        resp = self._call(context, self._stub(request.env, context).Reset, request)
        with self.lock:
            key = (request.env, resp.task_id)
            scripted = key in SCRIPTS and self.resets[key] % 2 == 0
            self.resets[key] += 1
            self.sessions[resp.session_id] = {"env": request.env, "task": resp.task_id, "scripted": scripted,
                                              "reward": 0.0, "ended": False, "steps": 0}
        return resp

    def Step(self, request, context):
        rec = self.sessions.get(request.session_id)
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        stub = self.stubs[rec["env"]]
        if rec["scripted"] and rec["steps"] == 0:
            calls = [common_pb2.ToolCall(id=f"s{i}", name=n, arguments_json=json.dumps(a))
                     for i, (n, a) in enumerate(SCRIPTS[(rec["env"], rec["task"])])]
            first = self._call(context, stub.Step, env_pb2.StepRequest(
                session_id=request.session_id, action=common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=calls)))
            assert not (first.terminated or first.truncated) and first.reward == 0.0
            request = env_pb2.StepRequest(session_id=request.session_id, stop=True,
                                          action=common_pb2.Message(role=common_pb2.ROLE_ASSISTANT))
        resp = self._call(context, stub.Step, request)
        with self.lock:
            rec["steps"] += 1
            rec["reward"] += resp.reward
            rec["ended"] = rec["ended"] or resp.terminated or resp.truncated
        return resp

    def Close(self, request, context):
        rec = self.sessions.get(request.session_id)
        if rec is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {request.session_id!r}")
        return self._call(context, self.stubs[rec["env"]].Close, request)


@pytest.fixture()
def proxy(bookshop_env, clinic_env):
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    servicer = RecordingProxy({"bookshop": bookshop_env, "clinic": clinic_env})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    hs = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(hs, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    for name in ("", "sinkflex.api.env.v1.EnvService"):
        hs.set(name, health_pb2.HealthCheckResponse.SERVING)
    servicer.address = f"127.0.0.1:{port}"
    yield servicer
    server.stop(2).wait()
    for ch in servicer.channels.values():
        ch.close()


def _experiment(run_dir: Path, policy: Path, env_address: str, env: str, task: str, steps: int) -> dict:
    return {
        "run": {"name": "plugged", "output_dir": str(run_dir), "steps": steps, "seed": 0, "step_timeout_s": 600},
        "task": {"env": env, "train_split": "train", "eval_split": "test", "tasks_per_step": 1, "task_ids": [task],
                 "solo_mode": True, "reward": "env", "text_ends_episode": True},
        "rollout": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 24, "max_turns": 2, "max_context_tokens": 2048},
        "validation": {"every_steps": 0},
        "models": {"policy": str(policy), "user_simulator": None},
        "services": {"env_address": env_address},
        "local": {"ready_timeout_s": 600, "learner_stop_grace_s": 120},
        # the rollout service is launched once for both envs: the other env's route (task.env's is derived from task)
        "rollout_service": {"engine": {"kv_cache_gib": 0.5, "max_model_len": 2048},
                            "envs": {e: {"reward": "env", "text_ends_episode": True} for e in ("bookshop", "clinic") if e != env}},
        "learner_service": {"optim": {"lr": 1.0e-5, "total_steps": 2}, "batch": {"micro_batch_size": 1},
                    "model": {"gradient_checkpointing": False}, "checkpoint_every": 2},  # one checkpoint, at the end
    }


def test_train_on_both_plugged_envs_with_their_own_rewards(tmp_path, smollm2_dir, proxy, monkeypatch):
    from sinkflex_rl.config import TrainConfig
    from sinkflex_rl.clients import connect
    from sinkflex_rl.controller import Controller
    from sinkflex_rl.launcher import LocalLauncher
    from sinkflex_rl.local import launch_local
    from sinkflex.config import validate_config

    monkeypatch.delenv("REDIS_URL", raising=False)  # the run's embedded Redis
    run_dir = tmp_path / "run"
    bookshop = validate_config(_experiment(run_dir, smollm2_dir, proxy.address, "bookshop", "lend-dune", 1), TrainConfig)
    clinic = validate_config(_experiment(run_dir, smollm2_dir, proxy.address, "clinic", "move-derm-thursday", 2), TrainConfig)
    with LocalLauncher(run_dir) as launcher:
        addresses = launch_local(bookshop, launcher)
        assert addresses.reward == "" and addresses.env == proxy.address
        assert {p.name for p in launcher.processes} == {"rollout", "learner"}  # no env, reward or user-sim service
        for cfg in (bookshop, clinic):
            controller = Controller(cfg, connect(addresses), alive_check=launcher.check_alive)
            try:
                controller.run()
            finally:
                controller.close()

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["loss"]) for r in train)
    assert (run_dir / "learner" / "policy" / "v2" / "config.json").is_file()
    rollout_cfg = (run_dir / "configs" / "rollout_service.yaml").read_text()
    assert "reward: env" in rollout_cfg and not (run_dir / "configs" / "env_service.yaml").exists()

    for step, env, partial in ((1, "bookshop", 1.0), (2, "clinic", 0.5)):
        rewards = sorted(r["reward"] for r in records if r["kind"] == "trajectory" and r["step"] == step)
        sessions = [s for s in proxy.sessions.values() if s["env"] == env]
        reported = sorted(s["reward"] for s in sessions)
        assert len(rewards) == len(sessions) == 2, (env, rewards, sessions)
        assert rewards == reported, f"{env}: trajectory rewards {rewards} != rewards the env reported {reported}"
        scripted = [s for s in sessions if s["scripted"]]
        assert len(scripted) == 1 and scripted[0]["ended"] and scripted[0]["reward"] == partial
        assert partial in rewards  # a non-zero reward reached the learner unchanged
