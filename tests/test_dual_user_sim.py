"""The user-simulator warm start trains on exactly the prompts τ²-Bench's `UserSimulator` sends
(its system prompt with the scenario, the conversation with roles flipped) for every user line
of a golden dialogue, with the loss mask on the golden line alone (issue 30, item 2)."""

from __future__ import annotations

import pytest

from tau2_adapter.generate import write_task_dir
from tau2_adapter.generate_dual import FAMILIES, GoldenAgent, ScriptedUserServer, family_of, generate_dual_tasks, golden_user_turns


@pytest.fixture(scope="module")
def dual_tasks():
    return generate_dual_tasks(train=4, test=0, seed=5)


def test_warm_start_prompts_are_what_tau2s_user_simulator_sends(dual_tasks, tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.replay import replay_dialogue
    from sinkflex_rl.user_sim_warm_start import user_sim_examples, user_sim_messages
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs("WARNING")
    tasks = list(dual_tasks.tasks.values())
    sent: list[list[dict]] = []
    server = ScriptedUserServer(tasks)
    reply = server.reply
    server.reply = lambda messages: (sent.append(messages), reply(messages))[1]  # record what τ²-Bench sends
    try:
        env = LocalEnvClient(EnvServiceConfig(domains=("mock",), task_files={"mock": [str(write_task_dir(dual_tasks, tmp_path))]},
                                              user_model="openai/scripted-user", user_base_url=server.base_url))
        tok = AutoTokenizer.from_pretrained(smollm2_dir)
        groups = user_sim_examples(tasks, tok, paraphrase=False)
        assert {family_of(t.id) for t in tasks} == set(FAMILIES)
        for task, group in zip(tasks, groups):
            sent.clear()
            assert replay_dialogue(env, "mock", task, GoldenAgent(family_of(task.id))).reward == 1.0
            lines = golden_user_turns(task)
            assert len(sent) == len(lines) == len(group.trajectories)
            for k, (request, traj) in enumerate(zip(sent, group.trajectories)):
                request = [{"role": m["role"], "content": m["content"]} for m in request]
                agent_texts = [m["content"] for m in request if m["role"] == "user"]
                assert request == user_sim_messages(task, agent_texts, lines[:k])
                prompt = tok.apply_chat_template(request, add_generation_prompt=True, tokenize=True, return_dict=False)
                n = len(prompt)
                assert list(traj.token_ids[:n]) == list(prompt) and not any(traj.loss_mask[:n])
                assert all(traj.loss_mask[n:]) and tok.decode(traj.token_ids[n:-1]) == lines[k]
    finally:
        server.close()


def test_paraphrased_questions_keep_the_golden_lines(dual_tasks, smollm2_dir):
    from transformers import AutoTokenizer

    from sinkflex_rl.user_sim_warm_start import user_sim_examples

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    tasks = list(dual_tasks.tasks.values())
    a, b = user_sim_examples(tasks, tok, seed=1), user_sim_examples(tasks, tok, seed=1)
    assert a == b  # seeded
    for task, group in zip(tasks, a):
        assert [tok.decode([t for t, m in zip(x.token_ids, x.loss_mask) if m][:-1]) for x in group.trajectories] == \
            golden_user_turns(task)


def test_agent_demonstrations_of_dual_tasks_are_golden_dialogues_with_the_users_turns(dual_tasks, tmp_path, smollm2_dir):
    """The agent's warm start on dual tasks (`build_demonstrations(..., dialogues=...)`): the golden
    dialogue played through the env service with its user simulator (here the scripted user),
    rendered by the rollout loop; τ²-Bench scores each 1.0; the user's lines are in the token
    stream, outside the loss mask; the agent's questions and calls are inside it."""
    from transformers import AutoTokenizer

    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog
    from sinkflex_rl.warm_start import build_demonstrations
    from tau2_adapter.generate_dual import ASK_CREATE, golden_agent_turns
    from tau2_adapter.logs import quiet_tau2_logs
    from tau2_adapter.tasks import golden_actions

    quiet_tau2_logs("WARNING")
    task_dir = str(write_task_dir(dual_tasks, tmp_path))
    server = ScriptedUserServer(dual_tasks.tasks.values())
    try:
        env = LocalEnvClient(EnvServiceConfig(domains=("mock",), task_files={"mock": [task_dir]},
                                              user_model="openai/scripted-user", user_base_url=server.base_url))
        tok = AutoTokenizer.from_pretrained(smollm2_dir)
        tasks = dual_tasks.tasks
        demos = build_demonstrations(env, LocalRewardClient(TaskCatalog(task_files={"mock": [task_dir]})), tok, "mock",
                                     {i: golden_actions(t) for i, t in tasks.items()}, solo_mode=False, max_turns=5,
                                     max_context_tokens=4096, dialogues={i: golden_agent_turns(t) for i, t in tasks.items()})
    finally:
        server.close()
    assert not demos.dropped and len(demos.groups) == len(tasks)
    for g in demos.groups:
        traj = g.trajectories[0]
        assert traj.reward == 1.0 and traj.metrics["user_turns"] == len(golden_user_turns(tasks[g.task_id]))
        trained = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if m])
        masked_out = tok.decode([t for t, m in zip(traj.token_ids, traj.loss_mask) if not m])
        for line in golden_user_turns(tasks[g.task_id]):
            assert line in masked_out and line not in trained
        if family_of(g.task_id) in ("ask_create", "create_relay"):
            assert ASK_CREATE in trained and '"name": "create_task"' in trained
