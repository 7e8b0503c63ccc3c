"""Rewards say everything the checker saw, and a failed evaluation is never a score.

On real tau2 mock-domain tasks (tau2's own checker, no stand-in): every check tau2 ran is in
the breakdown, including checks outside the task's reward basis (`in_basis: false`); a
trajectory whose `evaluate_simulation` raised is *unscored* -- reward NaN, flagged with the
error (bounded), advantage 0 and out of its group's mean/std in the learner, out of mean@1
in validation, and counted (`unscored`) by the rollout service, the learner and the
controller.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.api.reward.v1 import reward_pb2

CREATE = ("create_task_1", True)  # mock task (solo): basis DB + COMMUNICATE, one golden action (create_task)


@pytest.fixture(scope="module")
def local():
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog

    return LocalRewardClient(TaskCatalog())


def _copy(req: reward_pb2.ScoreRequest) -> reward_pb2.ScoreRequest:
    out = reward_pb2.ScoreRequest()
    out.CopyFrom(req)
    return out


def _broken(req: reward_pb2.ScoreRequest, content: str = '{"task_id": "not_what_the_env_said"}') -> reward_pb2.ScoreRequest:
    """The trajectory with a tool output the environment did not produce: tau2's replay
    (`Environment.set_state`) raises ValueError inside `evaluate_simulation`."""
    out = _copy(req)
    next(m for m in out.messages if m.role == common_pb2.ROLE_TOOL).content = content
    return out


def _details(c: common_pb2.RewardComponent) -> dict:
    return json.loads(c.details_json)


# ----------------------------------------------------------------------------- every check, with its result


def test_checks_outside_the_basis_are_listed_with_their_result(mock_trajectories, local):
    from tau2.evaluator.evaluator import EvaluationType, evaluate_simulation

    from reward_service.scoring import build_simulation

    traj = mock_trajectories[CREATE]
    task = mock_trajectories["tasks"][traj.task_id]
    b = local.score(traj.request)
    peer = evaluate_simulation(build_simulation(traj.task_id, list(traj.messages), traj.termination), task,
                               EvaluationType.ALL, solo_mode=True, domain="mock")
    assert peer.action_checks and "ACTION" not in {k.value for k in peer.reward_breakdown}  # tau2 ran it, off-basis
    comps = {c.type: c for c in b.components}
    assert b.reward == peer.reward == 1.0
    assert list(b.reward_basis) == [common_pb2.REWARD_TYPE_DB, common_pb2.REWARD_TYPE_COMMUNICATE]
    assert {t for t, c in comps.items() if _details(c)["in_basis"]} == {common_pb2.REWARD_TYPE_DB,
                                                                        common_pb2.REWARD_TYPE_COMMUNICATE}
    action = comps[common_pb2.REWARD_TYPE_ACTION]
    assert _details(action)["in_basis"] is False and action.reward == 1.0
    assert _details(action)["action_checks"] == [c.model_dump(mode="json") for c in peer.action_checks]
    assert [c["action_match"] for c in _details(action)["action_checks"]] == [True]


def test_a_failed_check_outside_the_basis_is_reported_but_not_scored():
    """tau2's RewardInfo of a DB-only task whose action check failed: listed with reward 0, reward stays 1."""
    from tau2.data_model.simulation import ActionCheck, DBCheck, RewardInfo
    from tau2.data_model.tasks import Action, RewardType

    from reward_service.scoring import to_breakdown

    info = RewardInfo(reward=1.0, db_check=DBCheck(db_match=True, db_reward=1.0), reward_basis=[RewardType.DB],
                      reward_breakdown={RewardType.DB: 1.0}, communicate_checks=[], env_assertions=[],
                      action_checks=[ActionCheck(action=Action(action_id="a", name="f", arguments={}),
                                                 action_match=False, action_reward=0.0)])
    b = to_breakdown(info)
    assert b.reward == 1.0
    assert [(c.type, c.reward, _details(c)["in_basis"]) for c in b.components] == [
        (common_pb2.REWARD_TYPE_DB, 1.0, True), (common_pb2.REWARD_TYPE_ACTION, 0.0, False)]  # empty lists: no check ran


def test_shaping_gives_no_credit_for_checks_outside_the_basis(mock_trajectories, local):
    from learner_service.config import RewardShapingConfig
    from learner_service.shaping import check_shares, shaped_reward

    b = local.score(mock_trajectories[CREATE].request)
    assert "action" not in check_shares(b)  # the ACTION component is off-basis
    cfg = RewardShapingConfig(alpha=0.5)
    basis_only = common_pb2.RewardBreakdown()
    basis_only.CopyFrom(b)
    del basis_only.components[:]
    basis_only.components.extend(c for c in b.components if _details(c)["in_basis"])
    assert shaped_reward(b.reward, b, cfg) == shaped_reward(b.reward, basis_only, cfg)


# ----------------------------------------------------------------------------- unscored


def test_evaluation_that_raises_is_unscored_with_the_error(mock_trajectories, local):
    from reward_service.scoring import MAX_REASON_CHARS, UNSCORED_PREFIX, is_unscored

    b = local.score(_broken(mock_trajectories[CREATE].request))
    assert math.isnan(b.reward) and is_unscored(b)
    assert b.info.startswith(UNSCORED_PREFIX + "tau2 could not evaluate the trajectory: ValueError")
    assert not b.components  # no check finished
    assert list(b.reward_basis) == [common_pb2.REWARD_TYPE_DB, common_pb2.REWARD_TYPE_COMMUNICATE]
    huge = local.score(_broken(mock_trajectories[CREATE].request, content='{"x": "' + "y" * 50_000 + '"}'))
    assert is_unscored(huge) and len(huge.info) <= MAX_REASON_CHARS and huge.info.endswith("...[truncated]")


def test_score_batch_failures_are_unscored_never_zero(mock_trajectories, local):
    good = mock_trajectories[CREATE].request
    refused = _copy(good)
    refused.termination_reason = common_pb2.TERMINATION_REASON_UNSPECIFIED  # INVALID_ARGUMENT
    items = local.score_batch([good, _broken(good), refused])
    assert items[0].breakdown.reward == 1.0 and items[0].error == ""
    assert math.isnan(items[1].breakdown.reward) and items[1].error == "" and "unscored" in items[1].breakdown.info
    assert math.isnan(items[2].breakdown.reward) and "termination_reason" in items[2].error


def test_rollout_service_keeps_nan_and_counts_unscored(mock_trajectories, local, smollm2_dir):
    from transformers import AutoTokenizer

    from rollout_service.agent import AgentLoop

    good = mock_trajectories[CREATE].request
    trajs = [common_pb2.Trajectory(env=r.env, task_id=r.task_id, messages=r.messages,
                                   termination_reason=r.termination_reason) for r in (good, _broken(good), good)]
    loop = AgentLoop(engine=None, tokenizer=AutoTokenizer.from_pretrained(smollm2_dir), env=None, reward=local)
    asyncio.run(loop._score(trajs, solo_mode=True))
    assert [t.reward for t in trajs][::2] == [1.0, 1.0] and math.isnan(trajs[1].reward)
    assert [t.metrics["unscored"] for t in trajs] == [0.0, 1.0, 0.0]
    assert trajs[1].reward_breakdown.info.startswith("unscored: ")
    assert loop.totals["unscored"] == 1.0


def test_env_that_says_its_evaluation_raised_gives_an_unscored_episode():
    from rollout_service.agent import env_breakdown

    step = env_pb2.StepResponse(terminated=True, reward=0.0, info={"evaluation_error": "ValueError: replay differs"})
    b = env_breakdown(step, 0.0)
    assert math.isnan(b.reward) and b.info == "unscored: the env's evaluation raised: ValueError: replay differs"
    assert env_breakdown(env_pb2.StepResponse(terminated=True, reward=0.0, info={"a": "b"}), 0.0).reward == 0.0


def test_learner_gives_unscored_advantage_zero_and_leaves_it_out_of_the_group(mock_trajectories, local):
    import torch

    from learner_service.batch import rollouts_from_group

    good = mock_trajectories[CREATE].request
    wrong = _copy(good)
    wrong.termination_reason = common_pb2.TERMINATION_REASON_MAX_TURNS  # tau2's premature rule: 0.0
    rewards = [local.score(r).reward for r in (good, wrong, _broken(good))]
    assert rewards[:2] == [1.0, 0.0] and math.isnan(rewards[2])
    group = common_pb2.TrajectoryGroup(group_id="g", task_id=good.task_id, env="mock", trajectories=[
        common_pb2.Trajectory(trajectory_id=str(i), reward=r, token_ids=[1, 2, 3], logprobs=[0.0, -1.0, -1.0],
                              loss_mask=[0, 1, 1]) for i, r in enumerate(rewards)])
    rollouts, info = rollouts_from_group(group)
    adv = [r.advantage for r in rollouts]
    assert adv[2] == 0.0  # unscored: no gradient
    assert adv[0] == pytest.approx(1.0, abs=1e-4) and adv[1] == pytest.approx(-1.0, abs=1e-4)  # mean/std of {1, 0}
    assert int(torch.isnan(info.rewards_G).sum()) == 1


def test_validation_leaves_unscored_trials_out_of_mean_at_1_and_counts_them():
    from sinkflex_rl.controller import scored_trials, validation_scores

    def group(task, rewards):
        return common_pb2.TrajectoryGroup(task_id=task, trajectories=[common_pb2.Trajectory(reward=r) for r in rewards])

    groups = [group("a", [1.0, math.nan]), group("b", [0.0, 0.0]), group("c", [math.nan, math.nan])]
    rewards, unscored = scored_trials(groups)
    assert rewards == {"a": [1.0], "b": [0.0, 0.0]} and unscored == {"a": 1, "c": 2}
    scores = validation_scores(rewards, trials=2)
    assert scores["mean_at_1"] == 0.5  # (1.0 + 0.0) / 2 tasks; an unscored trial is not a 0 (that would be 0.25)
    assert scores["scored_tasks"] == 2.0
    assert scores["pass_hat_1"] == 0.5 and scores["pass_hat_2"] == 0.0  # pass^2 only over "b" (2 scored trials)
    assert math.isnan(validation_scores({}, trials=1)["mean_at_1"])


def test_env_session_whose_own_evaluation_raises_says_so(monkeypatch):
    """An env that scores its own episodes (reward_on_termination): when tau2's evaluation raises
    there, the terminal step's info carries `evaluation_error` (the wire reward stays 0.0) and the
    rollout service turns the episode into an unscored one."""
    import tau2.evaluator.evaluator as tau2_evaluator

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from rollout_service.agent import env_breakdown

    def raises(**kwargs):
        raise ValueError("Tool message expected. Got None.")

    monkeypatch.setattr(tau2_evaluator, "evaluate_simulation", raises)
    env = LocalEnvClient(EnvServiceConfig(domains=("mock",), reward_on_termination=True))
    sid = env.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True)).session_id
    step = env.step(env_pb2.StepRequest(session_id=sid, stop=True, action=common_pb2.Message(
        role=common_pb2.ROLE_ASSISTANT, content="###STOP###")))
    assert step.terminated and step.reward == 0.0
    assert step.info["evaluation_error"] == "ValueError: Tool message expected. Got None."
    b = env_breakdown(step, step.reward)
    assert math.isnan(b.reward) and b.info.startswith("unscored: the env's evaluation raised: ValueError")


def test_a_stop_that_also_calls_a_tool_is_scored_on_what_ran_by_env_and_reward_service(local):
    """A policy's message with the stop token and a tool call (bin/demo-dual's policy wrote
    "####STOP####" with create_task): tau2 ends the episode before the call runs, and its replay of
    the trajectory raises. Both the env's own evaluation and the reward service leave the unexecuted
    call out: the task was not done, 0.0, not an unscored (advantage 0) trajectory."""
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig

    env = LocalEnvClient(EnvServiceConfig(domains=("mock",), reward_on_termination=True))
    reset = env.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True))
    action = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="####STOP####", tool_calls=[common_pb2.ToolCall(
        id="c0", name="create_task", arguments_json=json.dumps({"user_id": "user_1", "title": "Important Meeting"}),
        requestor=common_pb2.ROLE_ASSISTANT)])
    step = env.step(env_pb2.StepRequest(session_id=reset.session_id, action=action))
    assert step.terminated and step.termination_reason == common_pb2.TERMINATION_REASON_AGENT_STOP
    assert not step.observation and step.reward == 0.0 and "evaluation_error" not in step.info
    b = local.score(reward_pb2.ScoreRequest(env="mock", task_id="create_task_1", solo_mode=True,
                                            messages=[*reset.observation, action], termination_reason=step.termination_reason))
    assert b.reward == 0.0 and b.info.startswith("1 trailing tool call(s) never executed")
    # the same call, executed, then the stop: the task is done
    reset = env.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True))
    action.content = ""
    done = env.step(env_pb2.StepRequest(session_id=reset.session_id, action=action))
    stop = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="###STOP###")
    last = env.step(env_pb2.StepRequest(session_id=reset.session_id, action=stop, stop=True))
    assert last.reward == 1.0
    b = local.score(reward_pb2.ScoreRequest(env="mock", task_id="create_task_1", solo_mode=True, termination_reason=last.termination_reason,
                                            messages=[*reset.observation, action, *done.observation, stop, *last.observation]))
    assert b.reward == 1.0
