"""Must show: golden replays through the env service over real gRPC, scored by tau2's evaluator.

Retail task 19 (a return of delivered items, reward basis DB + COMMUNICATE) is replayed
from its `evaluation_criteria.actions`; the session's final DB must equal the DB tau2's
evaluator builds from the golden actions, and the reward must be 1.0. One wrong
argument on the write action gives 0.0.
"""

import pytest

from env_service.replay import golden_task, replay_golden, score
from sinkflex.api.common.v1 import common_pb2

RETAIL_TASK = "19"


def _gold_db_hash(env: str, task) -> str:
    """The agent DB hash after the golden actions, built as tau2's EnvironmentEvaluator does."""
    from tau2.registry import registry

    gold = registry.get_env_constructor(env)()
    init = task.initial_state
    gold.set_state(init.initialization_data if init else None, init.initialization_actions if init else None, [])
    for a in task.evaluation_criteria.actions:
        gold.make_tool_call(tool_name=a.name, requestor=a.requestor, **a.arguments)
    return gold.get_db_hash()


def test_retail_golden_replay_gives_expected_db_and_reward_1(env_grpc, env_core):
    task = golden_task("retail", RETAIL_TASK)
    result = replay_golden(env_grpc, "retail", RETAIL_TASK, close=False)
    try:
        live_env = env_core.session(result.session_id).orchestrator.environment
        assert live_env.get_db_hash() == _gold_db_hash("retail", task)
    finally:
        env_grpc.close(result.session_id)
    assert result.termination_reason == "agent_stop"
    assert result.reward == 1.0
    assert result.breakdown == {"DB": 1.0, "COMMUNICATE": 1.0}
    assert result.server_reward == 1.0  # the server's own tau2 evaluation agrees
    # the trajectory is tau2's: greeting, the scripted user's first turn, then action/answer pairs
    roles = [m.role for m in result.messages]
    assert roles[:2] == [common_pb2.ROLE_ASSISTANT, common_pb2.ROLE_USER]
    calls = [m for m in result.messages if m.tool_calls]
    answers = [m for m in result.messages if m.role == common_pb2.ROLE_TOOL]
    assert [c.tool_calls[0].id for c in calls] == [a.tool_call_id for a in answers]
    assert len(calls) == len(task.evaluation_criteria.actions)
    assert not any(a.error for a in answers)


def test_retail_replay_with_one_wrong_argument_gives_0(env_grpc):
    """The write (return_delivered_order_items) returns another item of the same delivered
    order: the call succeeds, the DB differs from the golden one, the reward is 0.0."""
    task = golden_task("retail", RETAIL_TASK)
    write = next(i for i, a in enumerate(task.evaluation_criteria.actions) if a.name == "return_delivered_order_items")
    assert task.evaluation_criteria.actions[write].arguments["item_ids"] == ["2366567022"]

    def wrong_item(i, name, args):
        return {**args, "item_ids": ["2751999929"]} if i == write else args  # also in order #W2890441

    result = replay_golden(env_grpc, "retail", RETAIL_TASK, edit=wrong_item)
    write_answer = [m for m in result.messages if m.role == common_pb2.ROLE_TOOL][write]
    assert not write_answer.error and "2751999929" in write_answer.content
    assert result.termination_reason == "agent_stop"
    assert result.reward == 0.0
    assert result.breakdown == {"DB": 0.0, "COMMUNICATE": 1.0}
    assert result.server_reward == 0.0


def test_mock_solo_episode_runs_to_termination(env_grpc):
    result = replay_golden(env_grpc, "mock", "create_task_1", solo_mode=True)
    assert result.termination_reason == "agent_stop"
    assert result.reward == 1.0 and result.server_reward == 1.0
    assert result.messages[0].role == common_pb2.ROLE_ASSISTANT  # solo: the agent acts first, no user
    assert not any(m.role == common_pb2.ROLE_USER for m in result.messages)


def test_telecom_solo_golden_replay_uses_user_tools(env_grpc):
    task_id = env_grpc.list_tasks("telecom", "small")[0]
    task = golden_task("telecom", task_id)
    assert any(a.requestor == "user" for a in task.evaluation_criteria.actions)  # dual control
    result = replay_golden(env_grpc, "telecom", task_id, solo_mode=True)
    assert result.reward == 1.0 and result.server_reward == 1.0


def test_solo_agent_text_is_an_agent_error(env_grpc):
    """tau2's solo rule: an agent message to the (absent) user ends the episode with AGENT_ERROR."""
    from sinkflex.api.env.v1 import env_pb2

    r = env_grpc.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True))
    s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=common_pb2.Message(content="Hello?")))
    assert s.terminated and s.termination_reason == common_pb2.TERMINATION_REASON_AGENT_ERROR
    assert s.reward == 0.0
    env_grpc.close(r.session_id)


def test_trajectory_with_tool_errors_is_scored_by_tau2(env_grpc):
    """Malformed JSON / unknown tool / wrong types stay in the trajectory; tau2's evaluator replays them."""
    from sinkflex.api.env.v1 import env_pb2

    task = golden_task("retail", RETAIL_TASK)
    r = env_grpc.reset(env_pb2.ResetRequest(env="retail", task_id=RETAIL_TASK))
    msgs = list(r.observation)
    bad = [("get_order_details", "{oops"), ("no_such_tool", "{}"), ("get_order_details", '{"order_id": 12345}')]
    for i, (name, args) in enumerate(bad):
        a = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(id=f"b{i}", name=name, arguments_json=args)])
        s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=a))
        assert not s.terminated and len(s.observation) == 1 and s.observation[0].error
        msgs += [a, *s.observation]
    for i, act in enumerate(task.evaluation_criteria.actions):
        import json

        a = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(id=f"g{i}", name=act.name, arguments_json=json.dumps(act.arguments))])
        s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=a))
        msgs += [a, *s.observation]
    info = "; ".join(task.evaluation_criteria.communicate_info)
    s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=common_pb2.Message(content=info), stop=True))
    msgs.append(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content=info + " ###STOP###"))
    assert s.terminated and s.reward == 1.0
    assert score("retail", task, msgs, "agent_stop").reward == pytest.approx(1.0)
    env_grpc.close(r.session_id)
