"""Policy versions through the real services: bounded in asynchronous mode, and where a weight
update lands in the engine.

The driver's `Controller` trains against real services over loopback gRPC: an env service
(τ²-Bench's mock domain, solo mode), a reward service (τ²-Bench's checker), the rollout
service on the test session's ONE vLLM engine (tests/fixtures/rollout.py), the learner as
its own process (`python -m learner_service`, SmolLM2, publishing every version to the
engine with UpdateWeights) and a real (embedded) Redis stream between them.

- max_staleness 0 (exactly on-policy: every turn of RL step s sampled by the version before it,
  staleness 0) is checked through `sinkflex-rl train` itself, across a resume and a killed
  service, in tests/test_train_e2e.py.
- max_staleness 1 with a learner slowed on purpose (learner.step_delay_s): the rollouts of a
  step run while the learner trains the previous one (staleness 1 happens), no group older
  than 1 version is trained, and a stale group put into the stream mid-run is dropped and
  counted, never trained; every group is consumed once (trained or dropped), none twice.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from sinkflex.api.common.v1 import common_pb2

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

TASKS = ["create_task_1", "update_task_1"]


@pytest.fixture(scope="module")
def mock_services():
    """(env address, reward address): the env and reward services on τ²-Bench's mock domain."""
    from env_service.config import EnvServiceConfig
    from env_service.server import build_server as build_env
    from reward_service.config import RewardServiceConfig
    from reward_service.server import build_server as build_reward

    env, _ = build_env(EnvServiceConfig(domains=("mock",), reward_on_termination=False), port=0)
    reward, servicer = build_reward(RewardServiceConfig(port=0, metrics_port=None))
    port = reward.start()
    servicer.load(["mock"])
    reward.set_serving()
    yield f"127.0.0.1:{env.port}", f"127.0.0.1:{port}"
    reward.stop()
    env.stop()


@pytest.fixture(autouse=True)
def _free_disk(tmp_path):
    """Checkpoints and policy versions of SmolLM2 take ~2 GB per test: gone once it is over."""
    import shutil

    yield
    for name in ("checkpoints", "policy"):
        shutil.rmtree(tmp_path / "run" / "learner" / name, ignore_errors=True)


@pytest.fixture
def engine_v0(rollout_engine, smollm2_dir):
    """The session engine serving the original SmolLM2 weights as policy version 0 (what a
    fresh learner starts from); the original weights again afterwards, for later tests."""
    if rollout_engine.policy_version != 0:  # an earlier test loaded other versions
        rollout_engine.run(rollout_engine.update_weights(rollout_engine.policy_version + 1, smollm2_dir))
        rollout_engine.policy_version = 0  # the same weights, renumbered for this learner's count
    yield rollout_engine
    rollout_engine.run(rollout_engine.update_weights(rollout_engine.policy_version + 1, smollm2_dir))


class Stack:
    """The rollout service (on the shared engine), the learner process and a controller config."""

    def __init__(self, tmp: Path, smollm2_dir: Path, engine, env_address: str, reward_address: str,
                 max_staleness: int, steps: int, step_delay_s: float = 0.0):
        from sinkflex_rl.config import TrainConfig, weight_updates
        from sinkflex_rl.launcher import LocalLauncher, ManagedProcess, free_port, python_module
        from learner_service.config import LearnerConfig
        from rollout_service.config import RolloutConfig
        from rollout_service.server import build_server
        from rollout_service.worker import RolloutWorker
        from sinkflex.buffer import TrajectoryBuffer, embedded_redis_url
        from sinkflex.config import validate_config

        self.run_dir = tmp / "run"
        self.redis_url = embedded_redis_url()
        self.buffer = TrajectoryBuffer(self.redis_url, stream=f"test:versions:{uuid.uuid4().hex[:8]}")
        rollout_cfg = RolloutConfig(engine={"model": str(smollm2_dir)}, env_address=env_address, reward_address=reward_address,
                                    redis_url=self.redis_url, weight_updates=weight_updates(max_staleness))
        self.worker = RolloutWorker(rollout_cfg, buffer=self.buffer, engine=engine)
        self.rollout_server, _ = build_server(rollout_cfg, port=0, worker=self.worker, grace_seconds=5.0)
        self.rollout_address = f"127.0.0.1:{self.rollout_server.port}"
        self.cfg = validate_config({
            "run": {"name": "versions", "output_dir": str(self.run_dir), "steps": steps, "seed": 0, "step_timeout_s": 600},
            "task": {"env": "mock", "train_split": "base", "eval_split": "base", "tasks_per_step": 1, "task_ids": TASKS,
                     "solo_mode": True},
            "rollout": {"group_size": 2, "temperature": 1.0, "max_new_tokens": 24, "max_turns": 2, "max_context_tokens": 4096,
                        "max_staleness": max_staleness},
            "validation": {"every_steps": 0},
            "models": {"policy": str(smollm2_dir), "user_simulator": None},
        }, TrainConfig)
        self.launcher = LocalLauncher(self.run_dir)
        try:
            learner_cfg = LearnerConfig.model_validate({
                "run_dir": str(self.run_dir / "learner"), "model": {"path": str(smollm2_dir), "gradient_checkpointing": False},
                "optim": {"lr": 1.0e-5, "total_steps": steps}, "batch": {"groups_per_step": 1, "micro_batch_size": 2},
                "buffer": {"url": self.redis_url, "stream": self.buffer.stream, "block_ms": 200},
                "rollout_address": self.rollout_address, "max_staleness": max_staleness, "step_delay_s": step_delay_s,
                "keep_checkpoints": 1, "keep_policies": 1, "tensorboard": False,
            })
            path = tmp / "learner.yaml"
            path.write_text(yaml.safe_dump(learner_cfg.model_dump(mode="json")))
            port = free_port()
            self.learner_address = f"127.0.0.1:{port}"
            self.launcher.start(ManagedProcess(
                "learner", python_module("learner_service", "--config", str(path), "--port", str(port), "--metrics-port", "-1"),
                health="grpc:sinkflex.api.learner.v1.LearnerService", address=self.learner_address,
                env={"OMP_NUM_THREADS": "1"}, stop_grace_s=300), ready_timeout=600)
        except BaseException:
            self.close()
            raise
        from sinkflex_rl.clients import Addresses

        self.addresses = Addresses(env=env_address, reward=reward_address, rollout=self.rollout_address,
                                   learner=self.learner_address)

    def train(self) -> int:
        from sinkflex_rl.clients import connect
        from sinkflex_rl.controller import Controller

        controller = Controller(self.cfg, connect(self.addresses), alive_check=self.launcher.check_alive)
        try:
            return controller.run()
        finally:
            controller.close()

    def stream(self) -> list[common_pb2.TrajectoryGroup]:
        """Every group the stream received, in order (acknowledged history included)."""
        out = []
        for _id, fields in self.buffer._redis.xrange(self.buffer.stream):
            g = common_pb2.TrajectoryGroup()
            g.ParseFromString(fields[b"data"])
            out.append(g)
        return out

    def records(self, path: Path, kind: str) -> list[dict]:
        return [r for r in map(json.loads, path.read_text().splitlines()) if r["kind"] == kind]

    def close(self) -> None:
        self.launcher.stop_all()  # SIGTERM: the learner checkpoints and acknowledges, then exits
        self.rollout_server.stop()
        self.buffer.delete()
        self.buffer.close()


def test_a_weight_update_waits_for_a_pinned_span_and_lands_between_generations_otherwise(engine_v0, smollm2_dir,
                                                                                        rollout_tokenizer):
    """The engine's two landing rules (a Rollout request is pinned in synchronous mode; in
    asynchronous mode only validation requests are): inside a pinned span an update waits
    for the span's end, every generation of the span is sampled by the version it began with;
    outside one the update lands between two generations."""
    import asyncio

    from rollout_service.engine import Sampling

    engine = engine_v0
    ids = list(rollout_tokenizer.apply_chat_template([{"role": "user", "content": "Name a colour."}],
                                                     add_generation_prompt=True, tokenize=True, return_dict=False))
    greedy = Sampling(temperature=0.0, max_new_tokens=8)

    async def pinned(v: int) -> tuple[list[int], bool]:
        async with engine.pinned() as version:
            assert version == v
            first = await engine.generate(ids, greedy)
            update = asyncio.ensure_future(engine.update_weights(v + 1, smollm2_dir))
            await asyncio.sleep(1.0)  # the update is waiting for this span
            second = await engine.generate(ids, greedy)
            waited = not update.done()
        await update
        return [first.policy_version, second.policy_version], waited

    async def unpinned(v: int) -> list[int]:
        first = await engine.generate(ids, greedy)
        update = asyncio.ensure_future(engine.update_weights(v + 1, smollm2_dir))
        await asyncio.sleep(0)  # the update starts: the next generation waits for it
        second = await engine.generate(ids, greedy)
        await update
        return [first.policy_version, second.policy_version]

    v = engine.policy_version
    versions, waited = engine.run(pinned(v), timeout=300)
    assert versions == [v, v] and waited and engine.policy_version == v + 1
    assert engine.run(unpinned(v + 1), timeout=300) == [v + 1, v + 2]


def _versions(traj: common_pb2.Trajectory) -> list[int]:
    return [t.policy_version for t in traj.turns]


def test_async_k1_never_trains_a_group_older_than_k(tmp_path, smollm2_dir, engine_v0, mock_services):
    from rollout_service.client import GrpcRolloutClient
    from sinkflex.api.rollout.v1 import rollout_pb2

    steps = 3
    t0 = time.monotonic()
    stack = Stack(tmp_path, smollm2_dir, engine_v0, *mock_services, max_staleness=1, steps=steps, step_delay_s=15.0)
    try:
        # a real group sampled by version 0 (publish=false: not in the stream); put into the stream
        # once the learner is at version 2, it is 2 versions old: it must be dropped, never trained
        with GrpcRolloutClient(stack.rollout_address, timeout=600) as client:
            (old,) = client.rollout(rollout_pb2.RolloutRequest(
                env="mock", task_ids=[TASKS[0]], group_size=2, max_turns=2, publish=False, solo_mode=True,
                sampling=common_pb2.SamplingParams(temperature=1.0, max_new_tokens=24, seed=5)))
        assert {v for t in old.trajectories for v in _versions(t)} == {0}
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(version=stack.train()), daemon=True)
        runner.start()
        from sinkflex_rl.clients import connect
        from sinkflex_rl.controller import Controller

        probe = Controller(stack.cfg, connect(stack.addresses))
        try:
            while probe.published_version() < 2:
                assert runner.is_alive(), "training ended before version 2"
                time.sleep(0.2)
        finally:
            probe.close()
        stack.buffer.put(old)
        runner.join(timeout=1200)
        assert result.get("version") == steps, result
        deadline = time.monotonic() + 120  # the learner reads the stale group even after the last step
        while stack.buffer.stats().unconsumed:
            assert time.monotonic() < deadline
            time.sleep(0.5)
        groups = stack.stream()
        stats = stack.buffer.stats()
        trained = stack.buffer.trained(g.group_id for g in groups)
    finally:
        stack.close()
    print(f"async: {time.monotonic() - t0:.0f} s", file=sys.stderr)

    learner = stack.records(stack.run_dir / "learner" / "metrics.jsonl", "train")
    assert [r["policy_version"] for r in learner] == list(range(1, steps + 1))
    for r in learner:  # never older than k = 1
        assert 0.0 <= r["staleness_mean"] <= r["staleness_max"] <= 1.0, r
    # the rollouts of step 2 ran while the learner trained step 1 (slowed): staleness 1 happened
    assert max(r["staleness_max"] for r in learner) == 1.0
    assert all(0.0 <= r["learner_idle_fraction"] <= 1.0 for r in learner[1:])
    # the stale group was dropped and counted once (in the learner's last checkpoint: it may
    # have been read after the last step), never trained
    state = json.loads(max((stack.run_dir / "learner" / "checkpoints").glob("step_*/state.json")).read_text())
    assert state["groups_dropped_stale"] == 1 and state["groups_trained"] == steps
    assert old.group_id not in state["trained_group_ids"] and old.group_id not in trained

    # every group in the stream consumed once: the step groups trained, once each; the old one dropped
    assert len(groups) == steps + 1 and old.group_id in {g.group_id for g in groups}
    assert trained == {g.group_id for g in groups} - {old.group_id}
    assert len(state["trained_group_ids"]) == len(set(state["trained_group_ids"])) == steps
    assert stats.unconsumed == 0 and stats.pending == 0 and stats.trained == steps

    # per trajectory: its version is its oldest turn's; step s's group (trained at version s - 1,
    # one Rollout request at a time) was sampled by version s - 2 or later
    step_groups = [g for g in groups if g.group_id != old.group_id]
    for s, g in enumerate(step_groups, start=1):
        for t in g.trajectories:
            assert t.turns and t.policy_version == min(_versions(t))
            assert (s - 1) - t.policy_version <= 1, (s, _versions(t))
    train = stack.records(stack.run_dir / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert all(0.0 <= r["engine_idle_fraction"] <= 1.0 and r["max_staleness"] == 1 for r in train)
