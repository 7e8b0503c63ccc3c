"""Gymnasium: gym.make of the registered SinkFlex env (in-process) and RemoteTau2Env (gRPC)."""

import json

import gymnasium as gym

import env_service
from env_service.replay import golden_task


def _golden_actions(env, task_id):
    task = golden_task(env, task_id)
    return [{"tool_calls": [{"id": f"g{i}", "name": a.name, "arguments": a.arguments}]}
            for i, a in enumerate(task.evaluation_criteria.actions)], task


def test_gym_make_in_process_mock_solo(env_config):
    config = env_config.model_copy(update={"domains": ("mock",)})  # its own core: load one domain only
    env = gym.make(env_service.TAU2_ENV_ID, env="mock", task_id="create_task_1", solo_mode=True, config=config)
    obs, info = env.reset(seed=0)
    assert obs == [] and info["task_id"] == "create_task_1"
    assert "create_task" in [t["function"]["name"] for t in info["tools"]]
    assert "<ticket>" in info["system_prompt"] and env.observation_space.contains(obs)
    actions, _ = _golden_actions("mock", "create_task_1")
    obs, reward, terminated, truncated, info = env.step(actions[0])
    assert obs[0]["role"] == "tool" and obs[0]["tool_call_id"] == "g0" and not obs[0]["error"]
    assert json.loads(obs[0]["content"])["title"] == "Important Meeting"
    assert (reward, terminated, truncated) == (0.0, False, False)
    obs, reward, terminated, truncated, info = env.step({"stop": True})
    assert (reward, terminated, truncated) == (1.0, True, False)
    assert info["termination_reason"] == "TERMINATION_REASON_AGENT_STOP"
    assert json.loads(info["reward_info"])["reward_breakdown"] == {"DB": 1.0, "COMMUNICATE": 1.0}
    env.close()


def test_remote_env_retail_dual_control(env_server):
    env = gym.make(env_service.REMOTE_TAU2_ENV_ID, address=env_server, env="retail", split="train")
    obs, info = env.reset(seed=7, options={"task_id": "19"})
    assert [m["role"] for m in obs] == ["assistant", "user"]  # tau2's greeting, then the (scripted) user
    assert info["task_id"] == "19" and "<policy>" in info["system_prompt"]
    actions, task = _golden_actions("retail", "19")
    for a in actions:
        assert env.action_space.contains(a)
        obs, reward, terminated, truncated, info = env.step(a)
        assert obs[0]["role"] == "tool" and not obs[0]["error"] and not terminated
    obs, reward, terminated, truncated, info = env.step({"content": "; ".join(task.evaluation_criteria.communicate_info), "stop": True})
    assert (reward, terminated) == (1.0, True)
    # a content reply goes to the user simulator, whose answer is the observation
    obs, info = env.reset(seed=7)
    assert info["task_id"] in env.unwrapped.client.list_tasks("retail", "train")  # sampled from the split
    obs, reward, terminated, truncated, info = env.step({"content": "What is your name and zip code?"})
    assert [m["role"] for m in obs] == ["user"] and obs[0]["content"]
    env.close()
