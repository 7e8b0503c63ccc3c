"""The whole training controller in one process: no subprocess, no vLLM, no network.

`sinkflex_rl.controller.Controller` runs its real loop (task schedule, the rollout producer thread,
version waits, train / trajectory / val records, validation files with pass^k and the
per-purpose breakdown) against clients from `sinkflex_rl.clients.connect`:

- env: the real `EnvCore` on τ²-Bench's mock domain with a generated task set (splits train and
  test, four task families: `tau2_adapter.generate`), solo mode, through `LocalEnvClient`;
- reward: the real reward core (`TaskCatalog`, τ²-Bench's checker on the same tasks) through
  `LocalRewardClient`;
- rollout: `ScriptedRollout`, a `RolloutClient` whose policy plays episodes through the env
  client — at policy version v, sample j of a group plays the task's golden actions
  (`evaluation_criteria.actions`) when j <= v, else stops at once — scored by the reward client,
  so every reward is τ²-Bench's own (1.0 golden; 0.0 with no action: DB or ACTION unmet);
- learner: the real `LearnerServicer` through `LocalLearnerClient`, over `FakeRunner`, a stand-in
  for the learner's *control surface only*: the published groups of a step make one "step" that
  advances the policy version, publishes it and pushes it to the rollout client (UpdateWeights),
  as `learner_service.loop` does. Its loss is a placeholder: the GRPO math, checkpoints and
  publishing are covered by test_grpo_loss, test_learner_step, test_golden_losses and, through
  real processes, test_train_versions and test_train_e2e.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.api.rollout.v1 import rollout_pb2
from sinkflex.errors import invalid_argument

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """4 train + 4 test generated mock tasks (one per family in each split)."""
    from tau2_adapter.generate import generate_mock_tasks, write_task_dir

    return str(write_task_dir(generate_mock_tasks(train=4, test=4, seed=0), tmp_path_factory.mktemp("tasks")))


@pytest.fixture(scope="module")
def task_set(task_dir):
    from tau2_adapter.tasks import domain_tasks

    return domain_tasks("mock", [task_dir])


@pytest.fixture(scope="module")
def env_core(task_dir):
    from env_service.config import EnvServiceConfig
    from env_service.core import EnvCore

    return EnvCore(EnvServiceConfig(domains=("mock",), reward_on_termination=False, task_files={"mock": [task_dir]}))


@pytest.fixture(scope="module")
def catalog(task_dir):
    from reward_service.scoring import TaskCatalog

    return TaskCatalog(task_files={"mock": [task_dir]})


class ScriptedRollout:
    """A `RolloutClient` whose policy is scripted (module docstring); weight updates land between
    requests (each request is pinned to the version served when it starts, as the rollout
    service's `between_requests`). Published groups go to `sink` (the Redis stream's place)."""

    def __init__(self, env, reward, tasks):
        self.env, self.reward, self.tasks = env, reward, tasks
        self.sink = None  # FakeRunner.put
        self.tampered_sample: int | None = None  # this sample of every published group at v0 is unscored (`episode`)
        self.policy_version = 0
        self.requests: list[tuple[int, bool, tuple[str, ...]]] = []  # (version, publish, task ids)
        self.updates: list[tuple[int, str]] = []
        self._uptime0 = time.monotonic()
        self._busy = 0.0

    def episode(self, env_name: str, task_id: str, golden: bool, version: int, solo_mode: bool,
                tamper: bool = False) -> common_pb2.Trajectory:
        """A golden (the task's actions, then stop) or a stop-only episode; `tamper`: the golden one's
        first tool answer is replaced by one the environment did not give (τ²-Bench's replay then
        raises: the reward service returns it unscored, reward NaN)."""
        from env_service.session import STOP_TOKEN

        task = self.tasks[task_id]
        reset = self.env.reset(env_pb2.ResetRequest(env=env_name, task_id=task_id, solo_mode=solo_mode, seed=1))
        messages = list(reset.observation)
        actions = task.evaluation_criteria.actions if golden else []
        for i, a in enumerate(actions):
            msg = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(
                id=f"call-{i}", name=a.name, arguments_json=json.dumps(dict(a.arguments)), requestor=common_pb2.ROLE_ASSISTANT)])
            step = self.env.step(env_pb2.StepRequest(session_id=reset.session_id, action=msg))
            if tamper and i == 0:
                step.observation[0].content = '{"id": "not what the environment answered"}'
            messages += [msg, *step.observation]
        final = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT)
        step = self.env.step(env_pb2.StepRequest(session_id=reset.session_id, action=final, stop=True))
        final.content = STOP_TOKEN  # as τ²-Bench records the agent's stop
        messages += [final, *step.observation]
        termination = step.termination_reason
        self.env.close(reset.session_id)
        breakdown = self.reward.score(reward_pb2.ScoreRequest(env=env_name, task_id=task_id, messages=messages,
                                                              termination_reason=termination, solo_mode=solo_mode))
        turns = len(actions) + 1
        return common_pb2.Trajectory(
            task_id=task_id, env=env_name, policy_version=version, token_ids=list(range(3 * turns)),
            messages=messages, reward=breakdown.reward, reward_breakdown=breakdown,
            termination_reason=termination,
            turns=[common_pb2.TurnInfo(policy_version=version, num_generated=3) for _ in range(turns)])

    def rollout(self, request, timeout=None):
        if not request.task_ids or request.group_size < 1:
            raise invalid_argument("no task ids or group_size < 1")
        version = self.policy_version  # pinned for the whole request
        self.requests.append((version, request.publish, tuple(request.task_ids)))
        for n, task_id in enumerate(request.task_ids):
            t0 = time.monotonic()
            group = common_pb2.TrajectoryGroup(group_id=f"g{len(self.requests)}-{n}", task_id=task_id, env=request.env)
            for j in range(request.group_size):
                tamper = request.publish and version == 0 and j == self.tampered_sample
                traj = self.episode(request.env, task_id, golden=j <= version, version=version, solo_mode=request.solo_mode,
                                    tamper=tamper)
                traj.trajectory_id = f"{group.group_id}-{j}"
                group.trajectories.append(traj)
            self._busy += time.monotonic() - t0
            if request.publish:
                self.sink(group)
            yield group

    def update_weights(self, policy_version, location, timeout=None):
        self.updates.append((policy_version, str(location)))
        self.policy_version = policy_version
        return rollout_pb2.UpdateWeightsResponse(policy_version=policy_version, load_seconds=0.0)

    def status(self, timeout=None):
        resp = rollout_pb2.StatusResponse(model="scripted", policy_version=self.policy_version)
        resp.metrics["engine_busy_seconds"] = self._busy
        resp.metrics["engine_uptime_seconds"] = time.monotonic() - self._uptime0
        return resp


class FakeRunner:
    """What `LearnerServicer` reads of a `LearnerRunner` (`learner.state`, `learner.last_metrics`),
    advanced like the learner loop: every `groups_per_step` published groups are one step → policy
    version + 1 → published (PolicyVersion names it) → UpdateWeights to the rollout client."""

    def __init__(self, rollout: ScriptedRollout, groups_per_step: int, run_dir):
        self.rollout, self.groups_per_step, self.run_dir = rollout, groups_per_step, run_dir
        self.learner = SimpleNamespace(
            state=SimpleNamespace(step=0, policy_version=0, groups_trained=0, published_version=-1, published_location=""),
            last_metrics={})
        self.pending: list[common_pb2.TrajectoryGroup] = []
        self.trained: list[tuple[int, list[str]]] = []  # (version, group ids)
        self._lock = threading.Lock()

    def put(self, group: common_pb2.TrajectoryGroup) -> None:
        with self._lock:
            self.pending.append(group)
            if len(self.pending) < self.groups_per_step:
                return
            groups, self.pending = self.pending, []
            s = self.learner.state
            rewards = [t.reward for g in groups for t in g.trajectories]
            staleness = [s.policy_version - t.policy_version for g in groups for t in g.trajectories]
            s.step += 1
            s.policy_version += 1
            s.groups_trained += len(groups)
            self.trained.append((s.policy_version, [g.group_id for g in groups]))
            self.learner.last_metrics = {
                "policy_version": s.policy_version, "loss": 0.5 / s.policy_version, "kl": math.nan,  # not finite: left out
                "reward_mean": sum(rewards) / len(rewards), "staleness_mean": sum(staleness) / len(staleness),
                "staleness_max": max(staleness)}
            s.published_version, s.published_location = s.policy_version, str(self.run_dir / "policy" / f"v{s.policy_version}")
        self.rollout.update_weights(s.published_version, s.published_location)


def _controller(tmp_path, env_core, catalog, task_set, steps: int, max_staleness: int = 0, task_dir: str | None = None,
                base_trials: int | None = None, base_num_tasks: int | None = None, **sections):
    from sinkflex_rl.clients import connect
    from sinkflex_rl.config import TrainConfig
    from sinkflex_rl.controller import Controller
    from env_service.client import LocalEnvClient
    from learner_service.server import LearnerServicer
    from reward_service.client import LocalRewardClient
    from sinkflex.config import validate_config

    cfg = validate_config({
        "run": {"name": "inprocess", "output_dir": str(tmp_path / "run"), "steps": steps, "seed": 0, "step_timeout_s": 60},
        "task": {"env": "mock", "train_split": "train", "eval_split": "test", "tasks_per_step": 2, "order": "stratified",
                 "solo_mode": True, "task_files": [task_dir] if task_dir else []},
        "rollout": {"group_size": 2, "max_staleness": max_staleness},
        "validation": {"every_steps": steps, "num_tasks": 0, "trials": 2, "base_trials": base_trials,
                       "base_num_tasks": base_num_tasks},
        "models": {"user_simulator": None},
    } | sections, TrainConfig)
    rollout = ScriptedRollout(LocalEnvClient(core=env_core), LocalRewardClient(catalog), task_set.tasks)
    runner = FakeRunner(rollout, cfg.task.tasks_per_step, tmp_path / "run" / "learner")
    rollout.sink = runner.put
    clients = connect(env=env_core, reward=catalog, rollout=rollout, learner=LearnerServicer(runner))
    return Controller(cfg, clients), rollout, runner


def _records(run_dir, kind):
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


def test_connect_picks_in_process_clients(env_core, catalog, task_set):
    from sinkflex_rl.clients import Addresses, connect
    from env_service.client import LocalEnvClient
    from learner_service.client import GrpcLearnerClient, LocalLearnerClient
    from learner_service.server import LearnerServicer
    from reward_service.client import LocalRewardClient
    from rollout_service.client import GrpcRolloutClient
    from sinkflex.errors import ServiceError

    runner = FakeRunner(None, 1, None)
    clients = connect(Addresses(env="", reward="", rollout="127.0.0.1:1", learner="127.0.0.1:1"), env=env_core,
                      reward=catalog, learner=LearnerServicer(runner))
    assert isinstance(clients.env, LocalEnvClient) and isinstance(clients.reward, LocalRewardClient)
    assert isinstance(clients.rollout, GrpcRolloutClient) and isinstance(clients.learner, LocalLearnerClient)
    infos = clients.env.task_infos("mock", "test")
    assert [t.task_id for t in infos] == task_set.splits["test"]
    assert [t.description for t in infos] == [task_set.tasks[t].description.purpose for t in task_set.splits["test"]]
    # the servicer's UNAVAILABLE (nothing published yet) as a ServiceError, in-process as over gRPC
    with pytest.raises(ServiceError) as err:
        clients.learner.policy_version()
    assert err.value.retryable and "no policy version published yet" in err.value.message
    assert clients.learner.status().policy_version == 0
    clients.close()
    grpc_clients = connect(Addresses(env="127.0.0.1:1", reward="", rollout="127.0.0.1:1", learner="127.0.0.1:1"))
    assert grpc_clients.reward is None and isinstance(grpc_clients.learner, GrpcLearnerClient)
    with pytest.raises(ServiceError) as err:  # nothing listens: UNAVAILABLE, retryable
        grpc_clients.learner.status(timeout=5)
    assert err.value.retryable
    grpc_clients.close()
    with pytest.raises(ValueError, match="learner"):
        connect(env=env_core, rollout="127.0.0.1:1")
    with pytest.raises(TypeError, match="rollout is int"):
        connect(env=env_core, rollout=3, learner="127.0.0.1:1")


def test_controller_loop_in_process(tmp_path, env_core, catalog, task_set, task_dir):
    from sinkflex_rl.controller import Controller, paired_difference, read_validations

    t0 = time.monotonic()
    steps = 3
    ctl, rollout, runner = _controller(tmp_path, env_core, catalog, task_set, steps, task_dir=task_dir)
    try:
        assert ctl.published_version() == -1  # the learner's UNAVAILABLE (nothing published): retried, not raised
        assert ctl.run() == steps
        pool = ctl.train_tasks()
    finally:
        ctl.close()
    run_dir = tmp_path / "run"
    train_ids, test_ids = task_set.splits["train"], task_set.splits["test"]
    assert sorted(pool) == sorted(train_ids)
    purpose = {t: task_set.tasks[t].description.purpose for t in train_ids + test_ids}
    # stratified: the two tasks of every step are of different purposes (families)
    assert all(len({purpose[t] for t in ctl.step_tasks(s, pool)}) == 2 for s in range(steps))

    # requests: validation of v0, one request per step pinned at the version it waited for, validation of v3
    assert rollout.requests == [(0, False, tuple(test_ids)), *[(s, True, tuple(ctl.step_tasks(s, pool))) for s in range(steps)],
                                (steps, False, tuple(test_ids))]
    assert [v for v, _ in runner.trained] == [1, 2, 3] and runner.learner.state.groups_trained == 2 * steps
    assert [v for v, _ in rollout.updates] == [1, 2, 3] and rollout.updates[-1][1].endswith("policy/v3")

    # train records: τ²-Bench's rewards (v0: one golden sample of two per group; later: both golden)
    train = _records(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3]
    assert [r["reward_mean"] for r in train] == [0.5, 1.0, 1.0]
    assert [r["reward_std"] for r in train] == [0.5, 0.0, 0.0]
    assert [r["groups_trained"] for r in train] == [2, 4, 6] and [r["groups"] for r in train] == [2, 2, 2]
    assert [r["policy_version"] for r in train] == [1, 2, 3]  # the learner's metrics of that version
    assert [r["loss"] for r in train] == [0.5, 0.25, 0.5 / 3] and all("kl" not in r for r in train)  # NaN: not sent
    assert all(r["staleness_max"] == 0 and r["max_staleness"] == 0 and r["infrastructure_errors"] == 0 for r in train)
    assert all(0.0 <= r["engine_idle_fraction"] <= 1.0 and r["rollout_s"] > 0 for r in train)
    trajs = _records(run_dir, "trajectory")
    assert len(trajs) == steps * 2 * 2
    assert [(r["step"], r["policy_version"], r["reward"]) for r in trajs[:4]] == [(1, 0, 1.0), (1, 0, 0.0)] * 2
    assert [r["policy_version"] for r in trajs] == [0] * 4 + [1] * 4 + [2] * 4
    assert all(r["turns"] == 1 for r in trajs if r["reward"] == 0.0)  # the stop alone

    # validations: base (v0) and after the last step (v3), 4 test tasks x 2 trials
    val = _records(run_dir, "val")
    assert [(r["step"], r["policy_version"], r["tasks"], r["trials"]) for r in val] == [(0, 0, 4, 2), (3, 3, 4, 2)]
    assert [(r["mean_at_1"], r["pass_hat_1"], r["pass_hat_2"]) for r in val] == [(0.5, 0.5, 0.0), (1.0, 1.0, 1.0)]
    assert (val[1]["ci_low"], val[1]["ci_high"]) == (1.0, 1.0)
    vals = read_validations(run_dir)
    assert [(v["after"], v["sampled_policy_versions"]) for v in vals] == [("base", [0]), ("step 3", [3])]
    assert vals[0]["per_task"] == {t: [1.0, 0.0] for t in test_ids}
    assert vals[1]["per_task"] == {t: [1.0, 1.0] for t in test_ids}
    assert vals[0]["per_purpose"] == {purpose[t]: {"tasks": 1, "mean_at_1": 0.5, "ci_low": 0.5, "ci_high": 0.5}
                                      for t in sorted(test_ids, key=purpose.get)}
    assert [r["rl_step"] for r in val] == [0, 3]
    # each validation's trajectories as τ²-Bench's results file: its own loader and metrics read it
    from tau2.data_model.simulation import Results
    from tau2.metrics.agent_metrics import compute_metrics

    for v in vals:
        results = Results.load(Path(v["tau2_results"]))
        assert Path(v["tau2_results"]).parent == run_dir / "validation" / "tau2"
        assert sorted((x.task_id, x.trial) for x in results.simulations) == sorted((t, i) for t in test_ids for i in (0, 1))
        assert {t.id for t in results.tasks} == set(test_ids) and results.info.environment_info.domain_name == "mock"
        theirs = compute_metrics(results)
        assert (theirs.avg_reward, theirs.pass_hat_ks) == (v["mean_at_1"], {1: v["pass_hat_1"], 2: v["pass_hat_2"]})
        golden = next(x for x in results.simulations if x.reward_info.reward == 1.0)
        assert golden.reward_info.reward_basis and golden.reward_info.db_check.db_match
        assert any(m.role == "assistant" and m.tool_calls for m in golden.messages)
    # `tau2 view` opens it: load, the metrics page, the list, the first simulation, no note, exit
    view = subprocess.run([sys.executable, "-c", "from tau2.cli import main; main()", "view", "--file", vals[1]["tau2_results"]],
                          input="1\n1\n2\n3\n1\n\n5\n", capture_output=True, text=True, timeout=120, check=False)
    assert view.returncode == 0, view.stdout[-2000:] + view.stderr[-2000:]
    assert "Loaded 8 simulations from step_3.json" in view.stdout and "Average Reward: 1.0000" in view.stdout
    assert "Reward: ✅ 1.0000 (ACTION: 1.0, DB: 1.0)" in view.stdout
    diff = paired_difference(vals[1], vals[0])
    assert (diff["difference"], diff["ci_low"], diff["ci_high"], diff["tasks"]) == (0.5, 0.5, 0.5, 4)
    assert any((run_dir / "tb").iterdir())

    # a re-run resumes at the learner's version: nothing left to train, no rollout asked for
    again = Controller(ctl.cfg, ctl.clients)
    try:
        assert again.run() == steps
    finally:
        again.close()
    assert len(rollout.requests) == steps + 2 and len(_records(run_dir, "train")) == steps
    # the last validation lost (a service died while it ran: the recovery re-enters run()): run again, only it
    (run_dir / "validation" / f"step_{steps}.json").unlink()
    again = Controller(ctl.cfg, ctl.clients)
    try:
        assert again.run() == steps
    finally:
        again.close()
    assert rollout.requests[steps + 2:] == [(steps, False, tuple(test_ids))]
    assert [v["after"] for v in read_validations(run_dir)] == ["base", f"step {steps}"]
    assert len(_records(run_dir, "train")) == steps
    assert time.monotonic() - t0 < 40


def test_controller_async_k1_in_process(tmp_path, env_core, catalog, task_set):
    """max_staleness 1: the producer runs up to one step ahead (step s's request waits for version
    s - 1 only); every trajectory is at most one version behind the learner that trains it."""
    from sinkflex_rl.controller import read_validations

    steps = 4
    ctl, rollout, runner = _controller(tmp_path, env_core, catalog, task_set, steps, max_staleness=1)
    try:
        assert ctl.run() == steps
    finally:
        ctl.close()
    run_dir = tmp_path / "run"
    train = _records(run_dir, "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["max_staleness"] == 1 for r in train)
    assert [r["groups_trained"] for r in train] == [2, 4, 6, 8]
    pinned = [v for v, publish, _ in rollout.requests if publish]
    assert len(pinned) == steps and all(max(0, s - 1) <= v <= s for s, v in enumerate(pinned))
    assert [v for v, _ in runner.trained] == [1, 2, 3, 4]
    assert max(r["staleness_max"] for r in train if "staleness_max" in r) <= 1
    assert [(v["after"], v["policy_version"], v["mean_at_1"]) for v in read_validations(run_dir)] == \
        [("base", 0, 0.5), ("step 4", 4, 1.0)]


def test_learner_clients_agree_in_process_and_over_grpc():
    """The same servicer through `LocalLearnerClient` and, served on loopback, `GrpcLearnerClient`:
    the same answers and the same ServiceError (UNAVAILABLE before anything is published)."""
    from learner_service.client import GrpcLearnerClient, LocalLearnerClient
    from learner_service.server import SERVICE_NAME, LearnerServicer
    from sinkflex.api.learner.v1 import learner_pb2_grpc
    from sinkflex.errors import ServiceError
    from sinkflex.serving import ServiceServer

    sink = ScriptedRollout(None, None, {})
    runner = FakeRunner(sink, groups_per_step=1, run_dir=Path("/r"))
    servicer = LearnerServicer(runner)
    server = ServiceServer(port=0, service_names=[SERVICE_NAME])
    learner_pb2_grpc.add_LearnerServiceServicer_to_server(servicer, server.server)
    server.start()
    server.set_serving()
    try:
        with GrpcLearnerClient(f"127.0.0.1:{server.port}", timeout=10, wait_ready=True) as remote:
            local = LocalLearnerClient(servicer)
            errors = []
            for client in (local, remote):
                with pytest.raises(ServiceError) as err:
                    client.policy_version()
                errors.append((err.value.code, err.value.message, err.value.retryable))
            assert errors[0] == errors[1] and errors[0][2]
            runner.put(common_pb2.TrajectoryGroup(group_id="g", trajectories=[common_pb2.Trajectory(reward=1.0)]))
            assert local.policy_version() == remote.policy_version()
            assert (remote.policy_version().policy_version, remote.policy_version().location) == (1, "/r/policy/v1")
            assert local.status() == remote.status() and remote.status().groups_trained == 1
            assert sink.updates == [(1, "/r/policy/v1")]  # the push to the rollout client
    finally:
        server.stop()


def test_train_records_the_driver_missed_are_recovered_from_the_learners():
    """A run stopped after the learner published version v0 + s but before the driver recorded
    step s (a dead vLLM engine: the version is never served) resumes past s: the driver writes
    step s's record from the learner's own (its last one), marked recovered, so there is one
    train record per policy version."""
    from sinkflex_rl.controller import recovered_train_records

    driver = [{"kind": "train", "step": 1, "loss": 0.1}, {"kind": "val", "step": 1}]
    learner = [{"kind": "warm_start", "step": 1, "loss": 0.7},
               {"kind": "train", "step": 1, "time": 1.0, "policy_version": 2.0, "loss": 0.1},
               {"kind": "train", "step": 2, "time": 2.0, "policy_version": 3.0, "loss": 0.5},
               {"kind": "train", "step": 2, "time": 3.0, "policy_version": 3.0, "loss": 0.2}]  # re-done after a crash
    assert recovered_train_records(driver, learner, v0=1, done_steps=2) == [(2, {"policy_version": 3.0, "loss": 0.2,
                                                                                 "recovered": 1})]
    assert recovered_train_records(driver, learner, v0=1, done_steps=1) == []
    assert recovered_train_records(driver, [], v0=0, done_steps=3) == [(2, {"recovered": 1}), (3, {"recovered": 1})]


@pytest.mark.parametrize("order", ["shuffled", "stratified"])
def test_rl_takes_the_tasks_the_warm_start_did_not_demonstrate_first(tmp_path, env_core, catalog, task_set, order):
    """task.warm_start_tasks_last: the 2 train tasks (of 4) the warm start demonstrates are the ones
    `write_demonstrations_for` builds (the first 2 of the seeded shuffle) and come last in the RL
    order, so RL step 1 (2 tasks a step) samples the 2 it was not fine-tuned on; off, RL step 1
    is the warm start's tasks. Stratified: each part covers both of its families' tasks in turn."""
    import random

    from sinkflex_rl.config import warm_start_task_ids

    train_ids = task_set.splits["train"]
    shuffled = list(train_ids)
    random.Random(0).shuffle(shuffled)
    orders = {}
    for last in (True, False):
        ctl, _, _ = _controller(tmp_path, env_core, catalog, task_set, 2, task={
            "env": "mock", "train_split": "train", "eval_split": "test", "tasks_per_step": 2, "order": order,
            "solo_mode": True, "warm_start_tasks_last": last}, warm_start={"enabled": True, "tasks": 2})
        try:
            demonstrated = warm_start_task_ids(ctl.cfg, train_ids)
            orders[last] = ctl.train_tasks()
        finally:
            ctl.close()
        assert demonstrated == shuffled[:2]
    assert sorted(orders[True]) == sorted(orders[False]) == sorted(train_ids)
    assert set(orders[True][:2]) == set(shuffled[2:]) and set(orders[True][2:]) == set(demonstrated)
    assert set(orders[False][:2]) == set(demonstrated)  # without it RL step 1 repeats the warm start's tasks
    if order == "shuffled":
        assert orders[True] == shuffled[2:] + shuffled[:2] and orders[False] == shuffled
    cfg_off = ctl.cfg.model_copy(update={"warm_start": ctl.cfg.warm_start.model_copy(update={"enabled": False})})
    assert warm_start_task_ids(cfg_off, train_ids) == []
    cfg_all = ctl.cfg.model_copy(update={"warm_start": ctl.cfg.warm_start.model_copy(update={"tasks": 0})})
    assert warm_start_task_ids(cfg_all, train_ids) == shuffled  # 0: every train task


def test_base_validation_takes_base_trials_samples_of_base_num_tasks(tmp_path, env_core, catalog, task_set, task_dir):
    """validation.base_trials / base_num_tasks: the base model is validated with 1 sample of the
    first 3 tasks, the last step with `trials` (2) of all 4; the paired difference compares per-task
    means over the 3 tasks both validated."""
    from sinkflex_rl.controller import paired_difference, read_validations

    ctl, rollout, _ = _controller(tmp_path, env_core, catalog, task_set, 1, task_dir=task_dir, base_trials=1,
                                  base_num_tasks=3)
    try:
        assert ctl.run() == 1
    finally:
        ctl.close()
    test_ids = task_set.splits["test"]
    val = _records(tmp_path / "run", "val")
    assert [(r["policy_version"], r["tasks"], r["trials"]) for r in val] == [(0, 3, 1), (1, 4, 2)]
    assert "pass_hat_2" not in val[0] and val[1]["pass_hat_2"] == 1.0
    base, last = read_validations(tmp_path / "run")
    assert base["per_task"] == {t: [1.0] for t in test_ids[:3]}
    assert last["per_task"] == {t: [1.0, 1.0] for t in test_ids}
    assert paired_difference(last, base) == {"after": "step 1", "before": "base", "difference": 0.0,
                                             "ci_low": 0.0, "ci_high": 0.0, "tasks": 3}


def test_an_unscored_training_trajectory_is_recorded_and_the_run_goes_on(tmp_path, env_core, catalog, task_set, caplog):
    """A training trajectory τ²-Bench cannot evaluate (here a tool answer the environment did not
    give: its replay raises) comes back unscored (reward NaN); the driver records it as a number
    (`unscored` 1.0), logs why, and trains on."""
    ctl, rollout, runner = _controller(tmp_path, env_core, catalog, task_set, 1)
    rollout.tampered_sample = 0
    try:
        with caplog.at_level("WARNING", logger="sinkflex_rl.controller"):
            assert ctl.run() == 1
    finally:
        ctl.close()
    trajs = _records(tmp_path / "run", "trajectory")
    assert [r["unscored"] for r in trajs] == [1.0, 0.0] * 2
    assert all(math.isnan(r["reward"]) for r in trajs[::2]) and [r["reward"] for r in trajs[1::2]] == [0.0, 0.0]
    (train,) = _records(tmp_path / "run", "train")
    assert train["unscored"] == 2.0 and train["reward_mean"] == 0.0 and runner.learner.state.groups_trained == 2
    logged = [r.getMessage() for r in caplog.records if "unscored" in r.getMessage()]
    assert len(logged) == 2 and all("tau2 could not evaluate the trajectory" in m for m in logged)
