"""Where the reward comes from, per env (issue 13, part 1), without a model engine.

The experiment (`task.reward`, `task.text_ends_episode`) and the rollout service
(`envs.<env>`) say per env whether the training reward is the env's own terminal reward or a
reward service's. The episodes here run through the real agent loop of a `RolloutWorker`
with a scripted engine (`sinkflex_rl.warm_start.GoldenEngine`: fixed token ids in SmolLM2's Hermes
format, no vLLM) against real servers over gRPC: the bookshop (Python) and clinic
(TypeScript) envs plugged in from outside, and τ²-Bench's reward service.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from sinkflex_rl.config import TrainConfig, load_train_config, service_configs
from rollout_service.config import EnvRoute, RolloutConfig
from sinkflex.api.common.v1 import common_pb2
from sinkflex.config import ConfigError, validate_config
from sinkflex.errors import ServiceError

TR = common_pb2.TerminationReason
ADDRS = {"env": "127.0.0.1:1", "reward": "127.0.0.1:2", "rollout": "127.0.0.1:3", "learner": "127.0.0.1:4"}


# -- config ------------------------------------------------------------------------------
def test_rollout_config_routes_per_env():
    cfg = RolloutConfig(engine={"model": "/m"}, reward_address="r:1",
                        envs={"bookshop": {"reward": "env", "text_ends_episode": True},
                              "other": {"reward": "service", "reward_address": "r:2"}})
    assert cfg.route("bookshop") == EnvRoute(reward="env", text_ends_episode=True)
    assert cfg.route("other").reward_address == "r:2"
    assert cfg.route("retail") == EnvRoute()  # not listed: the reward service, text goes to the user
    assert (EnvRoute().reward, EnvRoute().text_ends_episode) == ("service", False)
    with pytest.raises(ValueError, match="reward_address is set, but reward is 'env'"):
        EnvRoute(reward="env", reward_address="r:3")


def _plugged_experiment(**task) -> dict:
    return {"task": {"env": "bookshop", "train_split": "train", "eval_split": "test", "solo_mode": True,
                     "reward": "env", "text_ends_episode": True, **task},
            "models": {"policy": "/m", "user_simulator": None},
            "services": {"env_address": "127.0.0.1:50061"}}


def test_experiment_routes_its_env(tmp_path):
    cfg = validate_config(_plugged_experiment(), TrainConfig)
    assert cfg.services.env_only() and not cfg.services.external() and not cfg.uses_local_reward_service()
    addrs = {**ADDRS, "env": cfg.services.env_address, "reward": ""}
    out = service_configs(cfg, "/m", addrs, "redis://x", None)
    # a running env server and the env's own reward: neither an env service nor a reward service is launched
    assert set(out) == {"rollout_service", "learner_service"}
    rollout = out["rollout_service"]
    assert rollout.env_address == "127.0.0.1:50061" and rollout.reward_address is None
    assert rollout.route("bookshop") == EnvRoute(reward="env", text_ends_episode=True)

    # anyone's reward service at an address
    cfg = validate_config(_plugged_experiment(reward="service", reward_address="10.0.0.9:7000"), TrainConfig)
    assert not cfg.uses_local_reward_service()
    route = service_configs(cfg, "/m", {**addrs}, "redis://x", None)["rollout_service"].route("bookshop")
    assert (route.reward, route.reward_address) == ("service", "10.0.0.9:7000")

    # a τ²-Bench domain keeps τ²-Bench's reward service by default
    from pathlib import Path

    demo = load_train_config(Path(__file__).resolve().parents[1] / "configs" / "demo.yaml")
    assert demo.task.reward == "service" and demo.uses_local_reward_service()
    out = service_configs(demo, "/m", ADDRS, "redis://x", None)
    assert out["rollout_service"].route(demo.task.env) == EnvRoute() and out["rollout_service"].reward_address == ADDRS["reward"]
    assert {"env_service", "reward_service"} <= set(out)


@pytest.mark.parametrize("patch, message", [
    ({"task": {"reward": "env", "reward_address": "h:1"}}, "task.reward_address is set, but task.reward is 'env'"),
    ({"rollout_service": {"envs": {"bookshop": {"reward": "service"}}}},
     "rollout_service.envs.bookshop.reward is derived from task.reward"),
    ({"task": {"generate": {}, "env": "mock"}}, "task.generate writes tasks for the local env service"),
    ({"env_service": {"domains": ["mock"]}}, "env_service configures the local env service"),
    ({"services": {"reward_address": "h:2"}}, "missing: rollout_address, learner_address"),
])
def test_experiment_misconfigurations_are_named(patch, message):
    from sinkflex.config import merge_dicts

    with pytest.raises(ConfigError) as err:
        validate_config(merge_dicts(_plugged_experiment(), patch), TrainConfig)
    assert message in str(err.value)


# -- episodes through the agent loop -------------------------------------------------------
@pytest.fixture(scope="module")
def reward_address():
    """τ²-Bench's reward service over real gRPC (nothing preloaded: mock loads on first use)."""
    from reward_service.config import RewardServiceConfig
    from reward_service.server import build_server

    server, servicer = build_server(RewardServiceConfig(port=0, metrics_port=None, preload_envs=[]))
    port = server.start()
    servicer.load([])
    server.set_serving()
    yield f"127.0.0.1:{port}"
    server.stop()


@pytest.fixture(scope="module")
def make_worker(smollm2_dir, reward_address):
    """worker(env_address, envs) -> a RolloutWorker on a scripted engine, its default reward
    service τ²-Bench's (which knows neither plugged-in env)."""
    from sinkflex_rl.warm_start import GoldenEngine
    from env_service.client import GrpcEnvClient
    from reward_service.client import GrpcRewardClient
    from rollout_service.worker import RolloutWorker

    made = []

    def make(env_address=None, envs=None, env=None):
        config = RolloutConfig(engine={"model": str(smollm2_dir)}, env_address=env_address, reward_address=reward_address,
                               envs=envs or {})
        client = env if env is not None else GrpcEnvClient(env_address, timeout=60, wait_ready=True)
        worker = RolloutWorker(config, env=client, reward=GrpcRewardClient(reward_address, timeout=60),
                               engine=GoldenEngine([], 0))
        made.append(worker)
        return worker

    yield make


def _play(worker, env: str, task_id: str, texts: list[str], solo_mode: bool = True, max_turns: int = 4):
    """One episode of `task_id` whose agent turns are `texts` (then empty replies); returns the trajectory."""
    from sinkflex_rl.warm_start import GoldenEngine
    from rollout_service.engine import Sampling
    from rollout_service.formatting import ChatTemplateFormatter

    fmt = ChatTemplateFormatter(worker.tokenizer)
    turns = [list(worker.tokenizer.encode(t, add_special_tokens=False)) + [fmt.eot_id] for t in texts]
    worker.loop.engine = GoldenEngine(turns, fmt.eot_id)
    group = asyncio.run(worker.loop.run_group(env, task_id, 1, Sampling(max_new_tokens=256), max_turns, 8192,
                                              solo_mode=solo_mode, publish=False))
    return group.trajectories[0]


def _call(name: str, **arguments) -> str:
    from rollout_service.formatting import hermes_call_text

    return hermes_call_text(common_pb2.ToolCall(name=name, arguments_json=json.dumps(arguments)))


def test_bookshop_keeps_its_terminal_reward(make_worker, bookshop_env):
    """bookshop ends an episode only on StepRequest.stop: a plain-text reply sends it, and the
    trajectory's reward is the reward bookshop's checker gave on that step."""
    worker = make_worker(bookshop_env, {"bookshop": {"reward": "env", "text_ends_episode": True}})
    good = _play(worker, "bookshop", "lend-dune", [_call("lend_book", member_id="m1", book_id="b1"), "Here you go, Ada."])
    assert (good.reward, good.termination_reason) == (1.0, TR.TERMINATION_REASON_AGENT_STOP)
    assert good.reward_breakdown.reward == 1.0 and json.loads(good.reward_breakdown.info) == {"db_match": "true"}
    assert len(good.turns) == 2 and good.metrics["env_reward"] == 1.0
    # τ²-Bench's reward service (the worker's default) does not know bookshop: it was never asked

    wrong = _play(worker, "bookshop", "lend-dune", ["Sorry, we are closed."])
    assert (wrong.reward, wrong.termination_reason, len(wrong.turns)) == (0.0, TR.TERMINATION_REASON_AGENT_STOP, 1)

    # τ²-Bench's stop token is sent as StepRequest.stop too, whatever text_ends_episode says
    worker = make_worker(bookshop_env, {"bookshop": {"reward": "env"}})
    stop = _play(worker, "bookshop", "lend-dune", [_call("lend_book", member_id="m1", book_id="b1"), "###STOP###"])
    assert (stop.reward, stop.termination_reason) == (1.0, TR.TERMINATION_REASON_AGENT_STOP)
    # without text_ends_episode a plain-text reply goes to the user: the episode runs out of turns, reward 0
    chat = _play(worker, "bookshop", "lend-dune", [_call("lend_book", member_id="m1", book_id="b1"), "Anything else?"],
                 max_turns=2)
    assert (chat.reward, chat.termination_reason) == (0.0, TR.TERMINATION_REASON_MAX_TURNS)
    assert chat.messages[-1].content == "Please use the tools, then stop."


def test_clinic_keeps_its_partial_reward(make_worker, clinic_env):
    """The TypeScript env's checker gives 0.5 for half of a two-part task; the breakdown is its info."""
    worker = make_worker(clinic_env, {"clinic": {"reward": "env", "text_ends_episode": True}})
    half = _play(worker, "clinic", "move-derm-thursday",
                 [_call("cancel_appointment", patient_id="p2", appointment_id="a1"), "Your appointment is cancelled."])
    assert (half.reward, half.termination_reason) == (0.5, TR.TERMINATION_REASON_AGENT_STOP)
    info = json.loads(half.reward_breakdown.info)
    assert half.reward_breakdown.reward == 0.5 and json.loads(info["achieved_changes"]) == ["cancel p2@s4"]
    full = _play(worker, "clinic", "move-derm-thursday",
                 [_call("cancel_appointment", patient_id="p2", appointment_id="a1"),
                  _call("book_appointment", patient_id="p2", slot_id="s5"), "Moved to Thursday."])
    assert full.reward == 1.0
    done = _play(worker, "clinic", "no-derm-friday", [_call("done")])  # its own `done` tool ends it too
    assert (done.reward, done.termination_reason) == (1.0, TR.TERMINATION_REASON_AGENT_STOP)


def test_env_breakdown_sent_by_the_env_is_kept():
    from rollout_service.agent import env_breakdown
    from google.protobuf import json_format
    from sinkflex.api.env.v1 import env_pb2

    sent = common_pb2.RewardBreakdown(reward=0.25, components=[common_pb2.RewardComponent(type=common_pb2.REWARD_TYPE_DB, reward=0.25)])
    step = env_pb2.StepResponse(reward=0.25, terminated=True, info={"reward_breakdown": json_format.MessageToJson(sent)})
    assert env_breakdown(step, 0.25) == sent
    bad = env_breakdown(env_pb2.StepResponse(reward=1.0, info={"reward_breakdown": "{"}), 1.0)
    assert bad.reward == 1.0 and "not a RewardBreakdown" in bad.info


def test_tau2_domain_is_scored_by_tau2s_checker(make_worker):
    """A τ²-Bench domain routed to the reward service (the default) gets τ²-Bench's checker's reward
    and breakdown; the env scores nothing itself here (reward_on_termination off), so a 1.0 can only
    come from the checker."""
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from tau2_adapter.tasks import domain_tasks, golden_actions

    env = LocalEnvClient(EnvServiceConfig(domains=("mock",), reward_on_termination=False))
    worker = make_worker(env=env)
    task = domain_tasks("mock").tasks["create_task_1"]
    texts = [_call(a["name"], **a["arguments"]) for a in golden_actions(task)] + [_call("done")]
    good = _play(worker, "mock", "create_task_1", texts)
    assert good.metrics["env_reward"] == 0.0 and good.reward == 1.0
    assert {common_pb2.RewardType.Name(c.type) for c in good.reward_breakdown.components} >= {"REWARD_TYPE_DB"}
    assert list(good.reward_breakdown.reward_basis)
    bad = _play(worker, "mock", "create_task_1", [_call("done")])
    assert bad.reward == 0.0 and bad.reward_breakdown.components  # the checker ran: the DB differs


def test_unknown_env_fails_before_anything_is_sampled(make_worker, bookshop_env, reward_address):
    """bookshop left on the default route (the reward service) with τ²-Bench's reward service:
    the Rollout request fails before sampling, naming the env and the address; scoring never
    turns the NOT_FOUND into a reward of 0."""
    worker = make_worker(bookshop_env)
    with pytest.raises(ServiceError) as err:
        worker.check_reward("bookshop", ["lend-dune"])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "bookshop" in err.value.message and reward_address in err.value.message
    assert "unknown env" in err.value.message
    with pytest.raises(ServiceError) as err:  # the group's scoring, had it got that far
        _play(worker, "bookshop", "lend-dune", ["###STOP###"])
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and reward_address in err.value.message
    worker.check_reward("mock", ["create_task_1"])  # τ²-Bench knows mock: fine


def test_controller_fails_at_start_naming_env_and_reward_service(bookshop_env, reward_address, tmp_path):
    from sinkflex_rl.clients import Addresses, connect
    from sinkflex_rl.controller import Controller
    from sinkflex_rl.launcher import free_port

    dead = f"127.0.0.1:{free_port()}"  # no rollout service, no learner: the check comes before either is asked
    base = {"run": {"output_dir": str(tmp_path / "run")}, "models": {"user_simulator": None},
            "services": {"env_address": bookshop_env}}
    cfg = validate_config({**base, "task": {"env": "bookshop", "solo_mode": True}}, TrainConfig)  # reward: service
    ctl = Controller(cfg, connect(Addresses(env=bookshop_env, reward=reward_address, rollout=dead, learner=dead)))
    try:
        with pytest.raises(ConfigError) as err:
            ctl.run()
        msg = str(err.value)
        assert f"reward service at {reward_address} does not know env 'bookshop'" in msg and "task.reward: env" in msg
    finally:
        ctl.close()

    # the env's own reward: no reward service is asked (there is none)
    cfg = validate_config({**base, "task": {"env": "bookshop", "solo_mode": True, "reward": "env"}}, TrainConfig)
    ctl = Controller(cfg, connect(Addresses(env=bookshop_env, reward="", rollout=dead, learner=dead)))
    try:
        ctl.check_reward(ctl.train_tasks())
    finally:
        ctl.close()

    # a τ²-Bench domain and its reward service: fine; a reward service that does not answer: named
    cfg = validate_config({**base, "task": {"env": "mock", "solo_mode": True, "task_ids": ["create_task_1"]}}, TrainConfig)
    for reward, ok in ((reward_address, True), (dead, False)):
        ctl = Controller(cfg, connect(Addresses(env=bookshop_env, reward=reward, rollout=dead, learner=dead)))
        try:
            if ok:
                ctl.check_reward(ctl.train_tasks())
            else:
                with pytest.raises(ConfigError, match=f"reward service at {dead}, which did not answer"):
                    ctl.check_reward(ctl.train_tasks())
        finally:
            ctl.close()


def test_bookshop_bad_tool_input_is_a_tool_error_with_a_bounded_message(bookshop_env):
    """Model output is untrusted: JSON nested past the parser's stack and megabyte keys or ids get
    a tool error / NOT_FOUND with a short message; the other call of the action still runs."""
    from env_service.client import GrpcEnvClient
    from sinkflex.api.env.v1 import env_pb2

    huge = "k" * 1_000_000
    with GrpcEnvClient(bookshop_env, timeout=30) as client:
        r = client.reset(env_pb2.ResetRequest(env="bookshop", split="train"))
        step = env_pb2.StepRequest(session_id=r.session_id)
        step.action.tool_calls.add(id="deep", name="get_member", arguments_json="[" * 100_000 + "]" * 100_000)
        step.action.tool_calls.add(id="big", name="get_member", arguments_json=json.dumps({huge: "m1"}))
        out = client.step(step)
        assert [m.tool_call_id for m in out.observation] == ["deep", "big"]
        assert all(m.error for m in out.observation)
        assert "nested too deeply" in out.observation[0].content
        assert len(out.observation[1].content) < 2000
        with pytest.raises(ServiceError) as err:
            client.step(env_pb2.StepRequest(session_id=huge))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and len(err.value.message) < 1000
        client.close(r.session_id)
