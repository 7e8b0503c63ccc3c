"""Must show (issue 30, item 1): generated dual-control tasks in τ²-Bench's format, run by
τ²-Bench's environment, user simulator (`UserSimulator` through litellm, here answered by the
scripted user endpoint) and evaluator, through the real env service over gRPC: every golden
dialogue scores 1.0, one wrong argument scores 0.0, the agent's first observation holds none
of the facts it needs, and train/test are disjoint in content.

The generator is `tau2_adapter.generate_dual`; the dialogue driver `env_service.replay.replay_dialogue`.
"""

from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request

import pytest

from env_service.replay import replay_dialogue
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from tau2_adapter.generate import _POOLS, write_task_dir
from tau2_adapter.generate_dual import (
    FAMILIES,
    STOP,
    AgentTurn,
    GoldenAgent,
    ScriptedUserServer,
    facts_of,
    family_of,
    generate_dual_tasks,
    golden_dialogue,
    read_facts,
    summary,
)
from tau2_adapter.tasks import load_task_dir

SEED = 3


@pytest.fixture(scope="module")
def task_set():
    return generate_dual_tasks(train=12, test=8, seed=SEED)


@pytest.fixture(scope="module")
def scripted_user(task_set):
    server = ScriptedUserServer(task_set.tasks.values())
    yield server
    server.close()


@pytest.fixture(scope="module")
def env_dual(task_set, scripted_user, tmp_path_factory):
    """A real gRPC env server: τ²-Bench's mock domain plus the generated tasks, its user
    simulator on the scripted user endpoint."""
    from env_service.client import GrpcEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.server import build_server
    from tau2_adapter.logs import quiet_tau2_logs

    quiet_tau2_logs("WARNING")
    task_dir = write_task_dir(task_set, tmp_path_factory.mktemp("dual"))
    config = EnvServiceConfig(domains=("mock",), task_files={"mock": [str(task_dir)]}, user_model="openai/scripted-user",
                              user_base_url=scripted_user.base_url)
    server, _core = build_server(config, port=0)
    client = GrpcEnvClient(f"127.0.0.1:{server.port}", timeout=60, wait_ready=True)
    yield client
    client.shutdown()
    server.stop()


def test_generation_is_deterministic_and_even(task_set, tmp_path):
    again = generate_dual_tasks(train=12, test=8, seed=SEED)
    dump = lambda ts: [t.model_dump(mode="json") for t in ts.tasks.values()]  # noqa: E731
    assert dump(again) == dump(task_set) and again.splits == task_set.splits
    assert dump(generate_dual_tasks(train=12, test=8, seed=SEED + 1)) != dump(task_set)
    assert summary(task_set) == {"train": {f: 3 for f in FAMILIES}, "test": {f: 2 for f in FAMILIES}}
    loaded = load_task_dir(write_task_dir(task_set, tmp_path / "d"))  # τ²-Bench's layout, read back as Tasks
    assert list(loaded.tasks) == list(task_set.tasks) and loaded.splits == task_set.splits
    for task in task_set.tasks.values():
        assert task.ticket is None  # nothing for the agent's system prompt: the user holds it
        assert task.user_scenario.instructions.domain == "mock"
    with pytest.raises(ValueError, match="unknown families"):
        generate_dual_tasks(1, 1, 0, families=("ask_create", "delete"))
    with pytest.raises(ValueError, match="not a generated dual-control task id"):
        family_of("gen_create_0001")


def test_test_split_is_disjoint_in_content(task_set):
    def content(split):
        users, words, titles = set(), set(), set()
        for tid in task_set.splits[split]:
            data = task_set.tasks[tid].initial_state.initialization_data.agent_data
            users |= set(data["users"])
            for t in data["tasks"].values():
                titles.add(t["title"])
            f = facts_of(task_set.tasks[tid])
            users.add(f.user_id)
            if f.title:
                titles.add(f.title)
        words = {w for t in titles for w in t.split()}
        return users, words, titles

    tr, te = content("train"), content("test")
    assert not tr[0] & te[0] and not tr[1] & te[1] and not tr[2] & te[2]
    assert all(int(u.split("_")[1]) in _POOLS["test"]["users"] for u in te[0])


def test_first_observation_holds_none_of_the_facts(env_dual, task_set):
    """Reset: τ²-Bench's greeting and the user's opening line, and the system prompt (the mock
    policy): no user id, title or task id the golden call needs (confirm_status: only the slip)."""
    for tid, task in task_set.tasks.items():
        reset = env_dual.reset(env_pb2.ResetRequest(env="mock", task_id=tid, solo_mode=False, seed=1))
        env_dual.close(reset.session_id)
        seen = reset.system_prompt + " ".join(m.content for m in reset.observation)
        assert any(m.role == common_pb2.ROLE_USER for m in reset.observation), tid
        f = facts_of(task)
        for fact in (f.user_id, f.title, f.task_id):
            if fact:
                assert fact not in seen, (tid, fact)
        if f.family == "confirm_status":
            assert f.slip_task_id in seen


def _run(env, task, edit=None):
    return replay_dialogue(env, "mock", task, GoldenAgent(family_of(task.id)), edit=edit)


def test_golden_dialogues_score_one(env_dual, task_set, scripted_user):
    before = scripted_user.requests
    for tid, task in task_set.tasks.items():
        r = _run(env_dual, task)
        assert r.reward == 1.0, (tid, r.termination_reason, r.breakdown)
        assert r.termination_reason == "agent_stop"
        expected = {"DB": 1.0, "ACTION": 1.0} | ({"COMMUNICATE": 1.0} if family_of(tid) == "create_relay" else {})
        assert r.breakdown == expected
        # the dialogue is the canonical one, turn for turn
        said = [(("user", m.content) if m.role == common_pb2.ROLE_USER else
                 ("agent", AgentTurn(tool=m.tool_calls[0].name, arguments=json.loads(m.tool_calls[0].arguments_json))
                  if m.tool_calls else AgentTurn(content=m.content)))
                for m in r.messages if m.role in (common_pb2.ROLE_USER, common_pb2.ROLE_ASSISTANT)][1:]  # after the greeting
        assert said == golden_dialogue(task), tid
    assert scripted_user.requests - before >= 2 * len(task_set)  # every episode had user-simulator turns


def _wrong_edits(task):
    """(name, edit) pairs: each changes one argument of the golden dialogue."""
    f = facts_of(task)
    data = task.initial_state.initialization_data.agent_data
    other_task = next(t for t in data["tasks"] if t != f.task_id)
    edits = []

    def call_arg(key, value):
        return lambda t: dataclasses.replace(t, arguments={**t.arguments, key: value}) if t.tool else t

    if f.family in ("ask_create", "create_relay"):
        edits += [("user_id", call_arg("user_id", "user_1")), ("title", call_arg("title", f.title + " Notes"))]
        if f.family == "create_relay":
            edits.append(("relayed id", lambda t: dataclasses.replace(t, content=t.content.replace(
                f.new_task_id, "task_99")) if t.content and STOP in t.content else t))
    else:
        edits += [("task_id", call_arg("task_id", f.slip_task_id or other_task)),
                  ("status", call_arg("status", "pending" if f.status == "completed" else "completed"))]
    return edits


def test_one_wrong_argument_scores_zero(env_dual, task_set):
    for family in FAMILIES:
        task = next(t for i, t in task_set.tasks.items() if family_of(i) == family)
        for name, edit in _wrong_edits(task):
            r = _run(env_dual, task, edit)
            assert r.reward == 0.0, (task.id, name, r.breakdown)


def test_acting_before_confirming_scores_zero(env_dual, task_set):
    """confirm_status: an agent that makes the change the user first asked for, without reading it
    back, changes the slip's task (DB and ACTION fail)."""
    task = next(t for i, t in task_set.tasks.items() if family_of(i) == "confirm_status")
    f = facts_of(task)

    class Hasty:
        def __init__(self):
            self.turns = iter([AgentTurn(tool="update_task_status", arguments={"task_id": f.slip_task_id, "status": f.status}),
                               AgentTurn(content=f"Done. {STOP}")])

        def next_turn(self, user_text, tool_answer=None):
            return next(self.turns)

    r = replay_dialogue(env_dual, "mock", task, Hasty())
    assert r.reward == 0.0 and r.breakdown["DB"] == 0.0 and r.breakdown["ACTION"] == 0.0


def test_golden_agent_reads_only_what_the_user_says():
    assert read_facts("My user id is user_44 and the title is 'Vendor Forecast'.", "ask_create") == \
        {"user_id": "user_44", "title": "Vendor Forecast"}
    assert read_facts("Sure, user_44. It should be titled Vendor Forecast", "create_relay") == \
        {"user_id": "user_44", "title": "Vendor Forecast"}
    assert read_facts("Sorry, my mistake: I mean task_9, not task_4. Set it to Completed.", "confirm_status") == \
        {"task_id": "task_9", "status": "completed"}
    agent = GoldenAgent("ask_status", max_questions=2)
    assert agent.next_turn("Hello there.").content and agent.next_turn("I am not sure.").content
    last = agent.next_turn("I forgot.")
    assert last.stop and not agent.acted  # gives up without acting


def test_scripted_user_refuses_an_unknown_scenario(scripted_user):
    body = json.dumps({"model": "x", "messages": [{"role": "system", "content": "<scenario>other</scenario>"}]}).encode()
    request = urllib.request.Request(f"{scripted_user.base_url}/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(request, timeout=10)
    assert err.value.code == 400
