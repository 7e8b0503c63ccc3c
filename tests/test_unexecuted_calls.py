"""`tau2_adapter.termination.without_unexecuted_tool_calls` on tau2's own messages: the one rule
the env service's evaluation and the reward service follow for a stop that also made tool calls."""

from __future__ import annotations

from tau2.data_model.message import AssistantMessage, ToolCall, ToolMessage, UserMessage

from tau2_adapter.termination import without_unexecuted_tool_calls


def _call(i: int, requestor: str = "assistant") -> ToolCall:
    return ToolCall(id=f"c{i}", name="get_users", arguments={}, requestor=requestor)


def _answer(i: int, requestor: str = "assistant") -> ToolMessage:
    return ToolMessage(id=f"c{i}", role="tool", content="[]", requestor=requestor)


def test_nothing_unanswered_is_kept_as_it_is():
    msgs = [UserMessage(role="user", content="hi"), AssistantMessage(role="assistant", tool_calls=[_call(0)]),
            _answer(0), AssistantMessage(role="assistant", content="###STOP###")]
    out, left_out = without_unexecuted_tool_calls(msgs)
    assert left_out == 0 and out == msgs and out is not msgs
    assert without_unexecuted_tool_calls([]) == ([], 0)


def test_an_agent_stop_with_calls_keeps_its_text_and_the_answered_calls():
    stop = AssistantMessage(role="assistant", content="###STOP###", tool_calls=[_call(0), _call(1), _call(2)])
    msgs = [UserMessage(role="user", content="hi"), stop, _answer(0)]
    out, left_out = without_unexecuted_tool_calls(msgs)
    assert left_out == 2
    assert out[1].content == "###STOP###" and [c.id for c in out[1].tool_calls] == ["c0"]
    assert out[2] is msgs[2] and len(out) == 3
    assert len(stop.tool_calls) == 3  # the input message is not changed


def test_a_user_stop_that_calls_a_tool_is_left_without_the_call():
    """tau2's Orchestrator checks the user's stop before its tool calls run too (dual control)."""
    msgs = [AssistantMessage(role="assistant", content="Please toggle airplane mode."),
            UserMessage(role="user", content="###STOP###", tool_calls=[_call(0, "user")])]
    out, left_out = without_unexecuted_tool_calls(msgs)
    assert left_out == 1 and out[1].content == "###STOP###" and out[1].tool_calls is None
    # only calls, no text: the message goes (tau2 refuses an empty message)
    bare = [msgs[0], UserMessage(role="user", tool_calls=[_call(0, "user")])]
    assert without_unexecuted_tool_calls(bare) == ([msgs[0]], 1)
