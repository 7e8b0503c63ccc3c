"""Bad input: every case gets its status code (in-process and over gRPC alike), a message
naming what was wrong, and leaves other sessions untouched."""

import json
import time

import grpc
import pytest

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
from sinkflex.errors import ServiceError

NF, FP, IA, RE = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
                  grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


@pytest.fixture(params=["local", "grpc"])
def client(request, env_local, env_grpc):
    return env_local if request.param == "local" else env_grpc


def _code(fn, code, match: str):
    with pytest.raises(ServiceError) as info:
        fn()
    assert info.value.code == code, info.value
    assert match in info.value.message, info.value.message
    return info.value.message


def _call(name, args, call_id="c1"):
    return common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(id=call_id, name=name, arguments_json=args)])


def _mock(client, **kw):
    return client.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True, **kw))


def test_listing(client):
    envs = {e.name: e for e in client.list_environments()}
    assert set(envs) == {"retail", "airline", "telecom", "mock"}
    assert (envs["retail"].num_tasks, len(client.list_tasks("retail", "train")), len(client.list_tasks("retail", "test"))) == (114, 74, 40)
    assert envs["mock"].supports_solo and envs["telecom"].supports_solo and not envs["retail"].supports_solo
    assert len(client.list_tasks("airline", "test")) == 20 and len(client.list_tasks("telecom", "small")) == 20


def test_not_found(client):
    _code(lambda: client.list_tasks("nope"), NF, "unknown env 'nope'")
    _code(lambda: client.list_tasks("retail", "nope"), NF, "unknown split 'nope'")
    _code(lambda: client.reset(env_pb2.ResetRequest(env="nope")), NF, "unknown env")
    _code(lambda: client.reset(env_pb2.ResetRequest(env="retail", task_id="9999")), NF, "unknown task '9999'")
    _code(lambda: client.reset(env_pb2.ResetRequest(env="retail", split="nope")), NF, "unknown split")
    _code(lambda: client.step(env_pb2.StepRequest(session_id="nope", stop=True)), NF, "unknown session 'nope'")
    _code(lambda: client.step(env_pb2.StepRequest(stop=True)), NF, "empty session_id")
    _code(lambda: client.close("nope"), NF, "unknown session")


def test_invalid_arguments(client):
    _code(lambda: client.reset(env_pb2.ResetRequest(env="retail", task_id="0", solo_mode=True)), IA, "does not support solo mode")
    _code(lambda: client.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", max_steps=-1)), IA, "max_steps")
    r = _mock(client)
    sid = r.session_id
    _code(lambda: client.step(env_pb2.StepRequest(session_id=sid, action=common_pb2.Message(role=common_pb2.ROLE_USER, content="x"))), IA, "ROLE_ASSISTANT")
    _code(lambda: client.step(env_pb2.StepRequest(session_id=sid, action=common_pb2.Message())), IA, "empty action")
    _code(lambda: client.step(env_pb2.StepRequest(session_id=sid, action=_call("get_users", "{}"), stop=True)), IA, "stop=True with tool calls")
    # none of these touched the episode: it still runs and solves the task
    s = client.step(env_pb2.StepRequest(session_id=sid, action=_call("create_task", json.dumps({"user_id": "user_1", "title": "Important Meeting"}))))
    assert not s.terminated and not s.observation[0].error
    s = client.step(env_pb2.StepRequest(session_id=sid, stop=True))
    assert s.terminated and s.reward == 1.0
    client.close(sid)


def test_step_after_termination_and_closed_session(client):
    r = _mock(client)
    s = client.step(env_pb2.StepRequest(session_id=r.session_id, stop=True))
    assert s.terminated and s.termination_reason == common_pb2.TERMINATION_REASON_AGENT_STOP
    _code(lambda: client.step(env_pb2.StepRequest(session_id=r.session_id, stop=True)), FP, "has ended (agent_stop)")
    client.close(r.session_id)
    _code(lambda: client.step(env_pb2.StepRequest(session_id=r.session_id, stop=True)), NF, "was closed")
    _code(lambda: client.close(r.session_id), NF, "was closed")


@pytest.mark.parametrize("name,args,error", [
    ("get_order_details", "{\"order_id\": ", "arguments_not_a_json_object"),  # malformed JSON
    ("get_order_details", "[1, 2]", "arguments_not_a_json_object"),  # not an object
    ("cancel_everything", "{}", "Tool 'cancel_everything' not found"),  # unknown tool
    ("get_order_details", "{\"order_id\": 12345}", "Error"),  # wrong argument type
    ("get_order_details", "{\"id\": \"#W2890441\"}", "unexpected keyword argument 'id'"),  # wrong argument name
])
def test_bad_tool_calls_are_tool_errors_and_the_episode_goes_on(env_grpc, name, args, error):
    r = env_grpc.reset(env_pb2.ResetRequest(env="retail", task_id="19"))
    s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=_call(name, args, "bad-1")))
    assert not s.terminated and not s.truncated
    (tool,) = s.observation
    assert tool.role == common_pb2.ROLE_TOOL and tool.error and tool.tool_call_id == "bad-1"
    assert tool.requestor == common_pb2.ROLE_ASSISTANT
    assert error in tool.content and tool.content.startswith("Error")
    good = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=_call("get_order_details", '{"order_id": "#W2890441"}', "ok-1")))
    assert not good.observation[0].error and json.loads(good.observation[0].content)["order_id"] == "#W2890441"
    assert s.info["num_errors"] == "1"
    env_grpc.close(r.session_id)


def test_too_many_tool_errors_end_the_episode(env_grpc):
    r = _mock(env_grpc)
    for i in range(10):  # tau2's DEFAULT_MAX_ERRORS
        s = env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=_call("nope", "{}", f"e{i}")))
    assert s.terminated and s.termination_reason == common_pb2.TERMINATION_REASON_TOO_MANY_ERRORS
    env_grpc.close(r.session_id)


def test_max_steps_truncates(env_grpc):
    r = env_grpc.reset(env_pb2.ResetRequest(env="mock", task_id="create_task_1", solo_mode=True, max_steps=4))
    # tau2 counts orchestrator steps: the solo agent's first message starts the episode
    # (uncounted), then each tool answer and each later agent message count one.
    out = [env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, action=_call("get_users", "{}"))) for _ in range(3)]
    assert [(s.truncated, s.terminated) for s in out] == [(False, False), (False, False), (True, False)]
    assert out[-1].info["step_count"] == "5"
    assert out[-1].termination_reason == common_pb2.TERMINATION_REASON_MAX_STEPS
    _code(lambda: env_grpc.step(env_pb2.StepRequest(session_id=r.session_id, stop=True)), FP, "max_steps")


def test_oversized_messages_on_both_sides(env_grpc, env_server):
    from env_service.client import GrpcEnvClient
    from sinkflex.serving import DEFAULT_MAX_MESSAGE_BYTES

    other = _mock(env_grpc)  # a session that must survive
    big = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="x" * (DEFAULT_MAX_MESSAGE_BYTES + 10))
    # client side: the channel's own send limit
    _code(lambda: env_grpc.step(env_pb2.StepRequest(session_id=other.session_id, action=big)), RE, "larger than")
    # server side: a client that would send it
    with GrpcEnvClient(env_server, max_message_bytes=2 * DEFAULT_MAX_MESSAGE_BYTES) as loose:
        _code(lambda: loose.step(env_pb2.StepRequest(session_id=other.session_id, action=big)), RE, "SERVER")
    # the server keeps serving; the other session is untouched
    assert len(env_grpc.list_environments()) == 4
    s = env_grpc.step(env_pb2.StepRequest(session_id=other.session_id, action=_call("get_users", "{}")))
    assert s.info["step_count"] == "1" and not s.observation[0].error  # its first action ran once
    env_grpc.close(other.session_id)


def test_session_limit_and_ttl(env_core):
    """A small core over the same domains: max 2 sessions, 0.5 s TTL."""
    from env_service.client import LocalEnvClient
    from env_service.core import EnvCore
    from tests.fixtures.env import scripted_config

    core = EnvCore(scripted_config(max_sessions=2, session_ttl_seconds=0.5), catalog=env_core.catalog)
    c = LocalEnvClient(core=core)
    a, b = _mock(c), _mock(c)
    assert a.session_id != b.session_id
    _code(lambda: _mock(c), RE, "the maximum is 2")
    c.close(a.session_id)
    d = _mock(c)  # a freed slot is usable again
    time.sleep(0.7)
    _code(lambda: c.step(env_pb2.StepRequest(session_id=b.session_id, stop=True)), NF, "expired")
    _code(lambda: c.close(d.session_id), NF, "expired")
    assert core.num_sessions == 0
    e = _mock(c)  # expired sessions free their slots
    assert c.step(env_pb2.StepRequest(session_id=e.session_id, stop=True)).terminated
    core.shutdown()


def test_user_llm_failure_is_unavailable(env_core):
    from env_service.client import LocalEnvClient
    from env_service.config import EnvServiceConfig
    from env_service.core import EnvCore

    config = EnvServiceConfig(user_base_url="http://127.0.0.1:9/v1", user_llm_extra_args={"max_retries": 0})  # nothing listens
    c = LocalEnvClient(core=EnvCore(config, catalog=env_core.catalog))
    _code(lambda: c.reset(env_pb2.ResetRequest(env="retail", task_id="0")), grpc.StatusCode.UNAVAILABLE, "user simulator failed")
    assert c.core.num_sessions == 0


def test_health_not_serving_until_loaded(env_core, env_config):
    """The server answers health NOT_SERVING and UNAVAILABLE until its core is set."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from env_service.server import SERVICE_NAME, EnvServicer
    from sinkflex.api.env.v1 import env_pb2_grpc
    from sinkflex.serving import ServiceServer, make_channel

    server = ServiceServer(port=0, service_names=[SERVICE_NAME])
    servicer = EnvServicer()
    env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server.server)
    port = server.start()
    try:
        channel = make_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            env_pb2_grpc.EnvServiceStub(channel).ListEnvironments(env_pb2.ListEnvironmentsRequest())
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        servicer.set_core(env_core)
        server.set_serving()
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == health_pb2.HealthCheckResponse.SERVING
        assert len(env_pb2_grpc.EnvServiceStub(channel).ListEnvironments(env_pb2.ListEnvironmentsRequest()).environments) == 4
        channel.close()
    finally:
        server.stop()


def test_a_step_resent_with_its_request_id_is_never_applied_twice(client):
    """StepRequest.request_id: the resend of a Step whose answer the client lost (however the
    server saw the delivery) gets the kept response, marked replayed; the same id with another
    action is INVALID_ARGUMENT; the session is as after one application."""
    r = _mock(client)
    create = env_pb2.StepRequest(session_id=r.session_id, request_id="0",
                                 action=_call("create_task", json.dumps({"user_id": "user_1", "title": "Once"})))
    first = client.step(create)
    again = client.step(create)
    assert again.info["replayed"] == "true" and "replayed" not in first.info
    assert [m.content for m in again.observation] == [m.content for m in first.observation]
    other = env_pb2.StepRequest(session_id=r.session_id, request_id="0",
                                action=_call("create_task", json.dumps({"user_id": "user_1", "title": "Twice"})))
    _code(lambda: client.step(other), IA, "request_id '0' was already applied with a different StepRequest")
    users = client.step(env_pb2.StepRequest(session_id=r.session_id, request_id="1",
                                            action=_call("get_users", "{}", call_id="c2")))
    assert "replayed" not in users.info and json.loads(users.observation[0].content)[0]["tasks"] == ["task_1", "task_2"]  # applied once
    plain = env_pb2.StepRequest(session_id=r.session_id, action=_call("get_users", "{}", call_id="c3"))
    assert "replayed" not in client.step(plain).info and "replayed" not in client.step(plain).info  # no id: no deduplication
    client.close(r.session_id)


def test_a_late_cancel_callback_after_a_replay_does_not_block_the_next_turn(env_local):
    """The order Step applied → the client sees CANCELLED and resends it by request_id (replayed)
    → only then the server's call-done callback learns the first answer was lost
    (`keep_undelivered`): the next turn must go on. And ids compare with the last Step only."""
    core = env_local.core
    sid = _mock(env_local).session_id

    def create(title, rid):
        return env_pb2.StepRequest(session_id=sid, request_id=rid,
                                   action=_call("create_task", json.dumps({"user_id": "user_1", "title": title})))

    applied: list = []
    first = core.step(create("A", "1"), applied=applied)
    assert core.step(create("A", "1")).info["replayed"] == "true"
    session, data, n = applied[0]
    core.keep_undelivered(session, data, first, n)  # late: the resend already got the answer
    assert "replayed" not in core.step(create("B", "2")).info
    core.step(env_pb2.StepRequest(session_id=sid, action=_call("get_users", "{}", call_id="c9")))  # no id
    assert "replayed" not in core.step(create("B", "2")).info  # not the last Step any more: applied again
    users = core.step(env_pb2.StepRequest(session_id=sid, action=_call("get_users", "{}", call_id="c10")))
    assert json.loads(users.observation[0].content)[0]["tasks"] == ["task_1", "task_2", "task_3", "task_4"]
    env_local.close(sid)
