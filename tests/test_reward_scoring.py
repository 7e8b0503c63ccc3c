"""The reward core in-process (`LocalRewardClient`): untrusted output, determinism, judge, config."""

from __future__ import annotations

import json
import math
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.reward.v1 import reward_pb2
from sinkflex.errors import ServiceError


@pytest.fixture(scope="module")
def local(nl_task):
    from reward_service.client import LocalRewardClient
    from reward_service.scoring import TaskCatalog

    return LocalRewardClient(TaskCatalog(extra={"retail": [nl_task]}))


def _copy(req: reward_pb2.ScoreRequest, **changes) -> reward_pb2.ScoreRequest:
    out = reward_pb2.ScoreRequest()
    out.CopyFrom(req)
    for k, v in changes.items():
        setattr(out, k, v)
    return out


def test_local_and_grpc_clients_agree_and_are_deterministic(retail_trajectories, local, reward_client):
    for name in ("golden", "wrong_argument"):
        req = retail_trajectories[name].request
        first = local.score(req)
        assert local.score(req) == first  # same input, same breakdown (details included)
        assert reward_client.score(req) == first


def test_stop_right_after_an_unexecuted_call_is_scored_on_what_ran(retail_trajectories, local):
    """A stop whose message also makes a tool call ends the episode before the call runs (tau2's
    `Orchestrator.step`); tau2's replay of it raises ("Tool message expected"). The call changed
    nothing, so it is left out and the rest is scored: here the return never happened, DB fails, 0.0."""
    from reward_service.scoring import to_tau2
    from tau2_adapter.termination import without_unexecuted_tool_calls

    req = _copy(retail_trajectories["max_steps_after_call"].request,
                termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP)
    last = req.messages[-1]
    assert last.tool_calls[0].name == "return_delivered_order_items" and not last.content
    b = local.score(req)
    assert b.reward == 0.0 and b.info.startswith("1 trailing tool call(s) never executed")
    comps = {c.type: c for c in b.components}
    assert json.loads(comps[common_pb2.REWARD_TYPE_DB].details_json)["db_check"]["db_match"] is False
    # the stop token in the calling message's content (as a policy writes it): the same score
    stop = _copy(req)
    stop.messages[-1].content = "####STOP####"
    assert local.score(stop) == b
    # what tau2 evaluates: the conversation without the call (a message left empty is dropped)
    messages = to_tau2(req.messages)
    assert without_unexecuted_tool_calls(messages) == (messages[:-1], 1)
    kept, left_out = without_unexecuted_tool_calls(to_tau2(stop.messages))
    assert left_out == 1 and kept[-1].content == "####STOP####" and not kept[-1].tool_calls
    assert len(kept) == len(stop.messages)
    assert stop.messages[-1].tool_calls  # the request is not changed
    # a call left out is still checked: a bad one is refused, as anywhere else
    bad = _copy(stop)
    bad.messages[-1].tool_calls[0].requestor = common_pb2.ROLE_TOOL
    with pytest.raises(ServiceError, match="requestor") as err:
        local.score(bad)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_tool_output_that_the_environment_did_not_produce_is_unscored(retail_trajectories, local):
    req = _copy(retail_trajectories["golden"].request)
    tool = next(m for m in req.messages if m.role == common_pb2.ROLE_TOOL)
    tool.content = '{"user_id": "somebody_else"}'
    b = local.score(req)
    assert math.isnan(b.reward) and "unscored: tau2 could not evaluate the trajectory: ValueError" in b.info
    assert len(b.info) <= 2000


def test_malformed_tool_arguments_from_the_model_are_scored_not_raised(retail_trajectories, retail_tasks, local):
    """A tool call whose arguments are not JSON (model output) is replayed like tau2 would: an error, no crash."""
    from env_service.convert import RAW_ARGUMENTS_KEY
    from tests.fixtures.reward import ConversationBuilder

    b = ConversationBuilder(retail_tasks["19"])
    b.call("get_user_details", {RAW_ARGUMENTS_KEY: '{"user_id": mei_davis'})
    traj = b.finish().build("bad_args", "user_stop")
    assert traj.request.messages[2].tool_calls[0].arguments_json == '{"user_id": mei_davis'
    assert traj.request.messages[3].error
    out = local.score(traj.request)
    assert out.reward == 0.0  # no return was made: the DB check fails
    assert {c.type: c.reward for c in out.components}[common_pb2.REWARD_TYPE_DB] == 0.0


@pytest.mark.parametrize(
    "reason, name",
    [
        (common_pb2.TERMINATION_REASON_MAX_TURNS, "max_turns"),
        (common_pb2.TERMINATION_REASON_MAX_CONTEXT_TOKENS, "max_context_tokens"),
        (common_pb2.TERMINATION_REASON_INFRASTRUCTURE_ERROR, "infrastructure_error"),
        (common_pb2.TERMINATION_REASON_TOO_MANY_ERRORS, "too_many_errors"),
        (common_pb2.TERMINATION_REASON_AGENT_ERROR, "agent_error"),
    ],
)
def test_premature_termination_reasons_score_zero(reason, name, retail_trajectories, local):
    b = local.score(_copy(retail_trajectories["golden"].request, termination_reason=reason))
    assert b.reward == 0.0
    assert b.info == f"Simulation terminated prematurely. Termination reason: {name}"


def test_system_prompt_is_not_part_of_the_scored_conversation(retail_trajectories, local):
    req = _copy(retail_trajectories["golden"].request)
    req.messages.insert(0, common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content="You are a retail agent. 54.04"))
    assert local.score(req) == local.score(retail_trajectories["golden"].request)


# ----------------------------------------------------------------------------- NL judge


class _JudgeEndpoint:
    """An OpenAI-compatible /v1/chat/completions endpoint on loopback that answers a fixed verdict.

    It stands in for the judge LLM only to check the wiring (model, URL, key, tau2's
    prompt in, the verdict out); the verdict itself is tau2's JSON format.
    """

    def __init__(self) -> None:
        self.requests: list[dict] = []
        self.verdict: str = ""
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                outer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                reply = {
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop",
                                 "message": {"role": "assistant", "content": outer.verdict}}],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_nl_assertions_go_to_the_configured_judge(retail_trajectories, nl_task, local):
    from reward_service.client import LocalRewardClient
    from reward_service.config import JudgeConfig

    endpoint = _JudgeEndpoint()
    try:
        judge = JudgeConfig(model="judge-model", base_url=endpoint.base_url, api_key="sk-test", num_retries=0)
        client = LocalRewardClient(local.catalog, judge=judge)
        req = _copy(retail_trajectories["golden"].request, task_id="19-nl")
        [assertion] = nl_task.evaluation_criteria.nl_assertions

        endpoint.verdict = json.dumps({"results": [
            {"expectedOutcome": assertion, "reasoning": "amounts were given", "metExpectation": True}]})
        b = client.score(req)
        assert b.reward == 1.0
        comps = {c.type: c for c in b.components}
        assert {t for t, c in comps.items() if json.loads(c.details_json)["in_basis"]} == {
            common_pb2.REWARD_TYPE_DB, common_pb2.REWARD_TYPE_COMMUNICATE, common_pb2.REWARD_TYPE_NL_ASSERTION}
        assert not json.loads(comps[common_pb2.REWARD_TYPE_ACTION].details_json)["in_basis"]  # ran, outside the basis
        nl = json.loads(comps[common_pb2.REWARD_TYPE_NL_ASSERTION].details_json)["nl_assertions"]
        assert nl == [{"nl_assertion": assertion, "met": True, "justification": "amounts were given"}]
        sent = endpoint.requests[-1]
        assert sent["path"] == "/v1/chat/completions" and sent["auth"] == "Bearer sk-test"
        assert sent["body"]["model"] == "judge-model" and sent["body"]["temperature"] == 0.0
        assert "expectedOutcomes" in sent["body"]["messages"][1]["content"]  # tau2's judge prompt

        endpoint.verdict = json.dumps({"results": [
            {"expectedOutcome": assertion, "reasoning": "no", "metExpectation": False}]})
        assert client.score(req).reward == 0.0

        endpoint.verdict = "I think it went fine."  # not JSON: the judge failed, not the policy
        with pytest.raises(ServiceError) as err:
            client.score(req)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "NL-assertion judge failed" in err.value.message
        # Tasks without NL_ASSERTION never call the judge.
        n = len(endpoint.requests)
        assert client.score(retail_trajectories["golden"].request).reward == 1.0
        assert len(endpoint.requests) == n
    finally:
        endpoint.close()


# ----------------------------------------------------------------------------- config


def test_config_names_the_bad_field(tmp_path):
    from reward_service.config import JudgeConfig, RewardServiceConfig
    from sinkflex.config import ConfigError, load_config

    path = tmp_path / "reward.yaml"
    path.write_text("port: 50052\njudge:\n  model: m\n  temperature: -1\n")
    with pytest.raises(ConfigError, match=r"judge\.temperature"):
        load_config(path, RewardServiceConfig)
    path.write_text("port: 50052\nbogus: 1\n")
    with pytest.raises(ConfigError, match="bogus"):
        load_config(path, RewardServiceConfig)
    j = JudgeConfig(model="Qwen/Qwen2.5-7B", base_url="http://h:8000/v1")
    assert j.litellm_model() == "openai/Qwen/Qwen2.5-7B"
    assert j.litellm_kwargs()["api_key"] == "EMPTY" and j.litellm_kwargs()["api_base"] == "http://h:8000/v1"
