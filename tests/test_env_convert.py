"""env_service.convert: wire <-> tau2 messages, exact round trips."""

import json

import pytest

from env_service import convert
from sinkflex.api.common.v1 import common_pb2

from tau2.data_model.message import AssistantMessage, MultiToolMessage, SystemMessage, ToolCall, ToolMessage, UserMessage


def _all_kinds():
    return [
        SystemMessage(role="system", content="policy"),
        AssistantMessage(role="assistant", content="Hi! How can I help you today?"),
        UserMessage(role="user", content="my phone has no signal"),
        UserMessage(role="user", tool_calls=[ToolCall(id="u1", name="toggle_airplane_mode", arguments={}, requestor="user")]),
        ToolMessage(id="u1", role="tool", content="Airplane mode off", requestor="user"),
        AssistantMessage(role="assistant", tool_calls=[
            ToolCall(id="a1", name="get_order_details", arguments={"order_id": "#W1", "nested": {"x": [1, 2.5, None]}}),
            ToolCall(id="a2", name="get_user_details", arguments={"user_id": "ünï"}),
        ]),
        ToolMessage(id="a1", role="tool", content='{"status": "delivered"}', requestor="assistant"),
        ToolMessage(id="a2", role="tool", content="Error: user not found", requestor="assistant", error=True),
        AssistantMessage(role="assistant", content=""),  # empty string is not "no content"
    ]


def test_round_trip_every_kind():
    msgs = _all_kinds()
    wire = convert.from_tau2_messages(msgs)
    assert [m.role for m in wire] == [1, 3, 2, 2, 4, 3, 4, 4, 3]
    back = convert.to_tau2_messages(wire)
    assert back == msgs
    assert [type(m) for m in back] == [type(m) for m in msgs]
    # the fields tau2's __eq__ does not compare are kept too
    assert back[4].requestor == "user" and back[7].error is True
    assert back[8].content == "" and back[1].tool_calls is None


def test_wire_fields():
    wire = convert.from_tau2_messages(_all_kinds())
    assert not wire[3].HasField("content")
    assert wire[3].tool_calls[0].requestor == common_pb2.ROLE_USER
    assert wire[5].tool_calls[0].requestor == common_pb2.ROLE_ASSISTANT
    assert json.loads(wire[5].tool_calls[0].arguments_json) == {"order_id": "#W1", "nested": {"x": [1, 2.5, None]}}
    assert (wire[6].tool_call_id, wire[6].requestor, wire[6].error) == ("a1", common_pb2.ROLE_ASSISTANT, False)
    assert wire[7].error is True


def test_multitool_message_expands():
    t1 = ToolMessage(id="1", role="tool", content="a")
    t2 = ToolMessage(id="2", role="tool", content="b", error=True)
    wire = convert.from_tau2_messages([MultiToolMessage(role="tool", tool_messages=[t1, t2])])
    assert [(m.tool_call_id, m.content, m.error) for m in wire] == [("1", "a", False), ("2", "b", True)]
    with pytest.raises(ValueError, match="MultiToolMessage"):
        convert.from_tau2_message(MultiToolMessage(role="tool", tool_messages=[t1]))


@pytest.mark.parametrize("raw", ["{not json", "", "[1, 2]", "42", '"s"'])
def test_arguments_that_are_not_an_object_survive(raw):
    m = common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[common_pb2.ToolCall(id="c", name="t", arguments_json=raw)])
    tau2 = convert.to_tau2_message(m)
    assert tau2.tool_calls[0].arguments == {convert.RAW_ARGUMENTS_KEY: raw}
    assert convert.from_tau2_message(tau2).tool_calls[0].arguments_json == raw


def test_defaults_and_bad_roles():
    # unset requestors default to the message's role (tool calls) / assistant (tool answers)
    u = convert.to_tau2_message(common_pb2.Message(role=common_pb2.ROLE_USER, tool_calls=[common_pb2.ToolCall(name="x", arguments_json="{}")]))
    assert u.tool_calls[0].requestor == "user"
    t = convert.to_tau2_message(common_pb2.Message(role=common_pb2.ROLE_TOOL, tool_call_id="x", content="ok"))
    assert t.requestor == "assistant" and t.id == "x"
    with pytest.raises(ValueError, match="ROLE_UNSPECIFIED"):
        convert.to_tau2_message(common_pb2.Message(content="who am I"))
    with pytest.raises(ValueError, match="requestor"):
        convert.to_tau2_message(common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, tool_calls=[
            common_pb2.ToolCall(name="x", arguments_json="{}", requestor=common_pb2.ROLE_TOOL)]))
    assert len(convert.to_tau2_messages([common_pb2.Message(role=common_pb2.ROLE_SYSTEM, content="s")], include_system=False)) == 0
