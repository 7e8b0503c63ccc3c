"""Bad input for every RPC of the env and reward services: a seeded campaign on real servers.

A fixed seed generates distinct malformed requests (`generate_cases`) across every RPC of
the env service (ListEnvironments, ListTasks, Reset, Step, Close), the reward service
(Score, ScoreBatch) and the rollout service as it answers while its engine loads (Rollout,
UpdateWeights, Status; the engine path and the learner service need a model and torch, too
heavy to start for this campaign). Families: raw garbage bytes, invalid UTF-8 in each
string field, truncated and wrong-wire-type encodings, huge ids (10 KB - 1 MB), unknown enum
values, tool-call arguments that are deep JSON, 5000-digit integers, lone surrogates,
non-objects, NUL and control characters, out-of-order calls (step after stop, closed
session, double close), malformed conversations for the scorer, concurrent steps on one
session, and cancelled / past-deadline Steps.

`run_campaign` sends them over loopback gRPC to `python -m env_service` (mock domain, solo)
and `python -m reward_service` started as subprocesses, and checks for every case:

- clear: the status is the expected one and never UNKNOWN or INTERNAL; a refusal has a
  non-empty message of at most 1 KiB (`sinkflex.errors.MAX_MESSAGE_BYTES`); a ScoreBatch
  item's error the same; a Step answered OK answers each tool call with its own message;
- nothing applied: after a refused Step its session is exactly as before (the
  `get_users` probe shows the same tasks, step count and error count);
- the server still serves (health SERVING and ListEnvironments answer after each case;
  a process that died or stopped answering counts as a crash and is restarted);
- no cross-session effect: witness sessions opened before the campaign are probed every
  few cases and finished at the end (the golden one still scores 1.0); a golden
  trajectory re-scored every few cases gives the same breakdown bytes.

    .venv/bin/python benchmarks/reliability_inputs.py [--seed 15] [--cases 240]
        [--out docs/reliability.md] [--json docs/reliability.json]

writes the table to docs/reliability.md and `bad_inputs: {tried, clear_status, unclear,
crashes, cross_session_effects}` (plus per-family counts and every unclear case) into
docs/reliability.json, keeping any other keys already there (e.g. `faults`).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from sinkflex.api.common.v1 import common_pb2  # noqa: E402
from sinkflex.api.env.v1 import env_pb2, env_pb2_grpc  # noqa: E402
from sinkflex.api.reward.v1 import reward_pb2, reward_pb2_grpc  # noqa: E402
from sinkflex.api.rollout.v1 import rollout_pb2  # noqa: E402
from sinkflex.errors import MAX_MESSAGE_BYTES  # noqa: E402
from sinkflex.serving import channel_options  # noqa: E402

C = grpc.StatusCode
OK = "OK"
#: Any status but UNKNOWN / INTERNAL (families where several answers are right).
ANY = "ANY_CLEAR"
UNCLEAR_CODES = {C.UNKNOWN, C.INTERNAL}

ENV_S = "/sinkflex.api.env.v1.EnvService/"
REWARD_S = "/sinkflex.api.reward.v1.RewardService/"
ROLLOUT_S = "/sinkflex.api.rollout.v1.RolloutService/"

TASK = "create_task_1"  # mock, solo: create_task(user_1, "Important Meeting"), then stop: reward 1.0
GOLDEN_ARGS = json.dumps({"user_id": "user_1", "title": "Important Meeting"})
BIG_STEPS = 100_000
#: The scripted user simulator's delay (litellm `mock_delay`): a user turn that a client can
#: cancel mid-call. Solo sessions never call it.
USER_DELAY_S = 1.0
SLOW_CANCEL_S = 0.3  # max_steps of the campaign's sessions: probes never exhaust them

REQUEST_TYPES = {
    ENV_S + "ListEnvironments": env_pb2.ListEnvironmentsRequest,
    ENV_S + "ListTasks": env_pb2.ListTasksRequest,
    ENV_S + "Reset": env_pb2.ResetRequest,
    ENV_S + "Step": env_pb2.StepRequest,
    ENV_S + "Close": env_pb2.CloseRequest,
    REWARD_S + "Score": reward_pb2.ScoreRequest,
    REWARD_S + "ScoreBatch": reward_pb2.ScoreBatchRequest,
    ROLLOUT_S + "Rollout": rollout_pb2.RolloutRequest,
    ROLLOUT_S + "UpdateWeights": rollout_pb2.UpdateWeightsRequest,
    ROLLOUT_S + "Status": rollout_pb2.StatusRequest,
}
STREAMING = {ROLLOUT_S + "Rollout"}


# ----------------------------------------------------------------------------- cases


@dataclass
class Ctx:
    """What a case's request may refer to at run time."""

    sid: str = ""  # a fresh target session (Step/Close cases that need one)
    golden: list = field(default_factory=list)  # the golden mock trajectory (wire messages)


@dataclass
class Case:
    """One bad input.

    `build(ctx)` returns the request: a protobuf message or raw bytes. `expect` is the
    expected status name (or ANY). `target`: the case needs a fresh session (`ctx.sid`);
    "ended"/"closed": one that has ended / was closed first. `check_ok(response)` says what an
    OK answer must hold (None when any OK answer does)."""

    family: str
    method: str
    name: str
    build: Callable[[Ctx], Any]
    expect: str
    target: str = ""
    check_ok: Callable[[Any], str | None] | None = None
    special: str = ""  # "concurrent", "cancel", "deadline": run by their own code

    @property
    def key(self) -> str:
        return f"{self.method}|{self.name}"


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(field_no: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (string, bytes or message)."""
    return _varint((field_no << 3) | 2) + _varint(len(payload)) + payload


def _call(name: str, args: str, call_id: str = "c1", requestor: int = 0) -> common_pb2.ToolCall:
    return common_pb2.ToolCall(id=call_id, name=name, arguments_json=args, requestor=requestor)


def _action(*calls, role=common_pb2.ROLE_ASSISTANT, content=None) -> common_pb2.Message:
    m = common_pb2.Message(role=role, tool_calls=list(calls))
    if content is not None:
        m.content = content
    return m


def _tool_errors_answer_calls(resp) -> str | None:
    """An OK Step to a bad tool call: one tool message per call, answering its id, an error."""
    tools = [m for m in resp.observation if m.role == common_pb2.ROLE_TOOL]
    if not tools:
        return "no tool message answers the call"
    if tools[0].tool_call_id != "c1":
        return f"the tool message answers {tools[0].tool_call_id[:40]!r}, not 'c1'"
    if not tools[0].error:
        return "the tool message is not an error"
    if resp.terminated or resp.truncated:
        return "the episode ended on one bad tool call"
    return None


def _score_zero_or_clear(resp) -> str | None:
    """A reward in [0, 1], or unscored: NaN with the reason (tau2's evaluation raised, reward_service.scoring)."""
    r = resp.breakdown.reward
    if math.isnan(r):
        return None if resp.breakdown.info.startswith("unscored: ") else "reward NaN without an 'unscored: ' reason"
    return None if 0.0 <= r <= 1.0 else f"reward {r} outside [0, 1]"


def _batch_items_clear(resp) -> str | None:
    for i, item in enumerate(resp.items):
        if item.error_code:
            code = _code_of(item.error_code)
            if code in UNCLEAR_CODES:
                return f"items[{i}]: {code.name}: {item.error[:200]}"
            if not item.error or len(item.error.encode()) > MAX_MESSAGE_BYTES:
                return f"items[{i}]: error message empty or over {MAX_MESSAGE_BYTES} bytes ({len(item.error.encode())})"
    return None


def _code_of(value: int) -> grpc.StatusCode:
    for c in grpc.StatusCode:
        if c.value[0] == value:
            return c
    return C.UNKNOWN


def _huge(rng: random.Random, n: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyz0123456789-_é漢🙂"
    unit = "".join(rng.choice(alphabet) for _ in range(97))
    return (unit * (n // len(unit) + 1))[:n]


def _score_request(golden, **changes) -> reward_pb2.ScoreRequest:
    req = reward_pb2.ScoreRequest(env="mock", task_id=TASK, messages=golden,
                                  termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP, solo_mode=True)
    for k, v in changes.items():
        if k == "messages":
            del req.messages[:]
            req.messages.extend(v)
        else:
            setattr(req, k, v)
    return req


def _golden_with_args(golden, args: str):
    """The golden trajectory with its tool call's arguments replaced."""
    out = [common_pb2.Message.FromString(m.SerializeToString()) for m in golden]
    for m in out:
        for c in m.tool_calls:
            c.arguments_json = args
    return out


def _bad_args(rng: random.Random) -> list[tuple[str, str]]:
    """(name, arguments_json) of tool-call arguments that are not usable JSON objects."""
    out = []
    for depth in (65, 200, 999, 1500, 10_000, 100_000):
        out.append((f"deep array {depth}", "[" * depth + "]" * depth))
        out.append((f"deep object {depth}", '{"user_id": ' + '{"a": ' * depth + "1" + "}" * depth + "}"))
    out.append(("unclosed deep 50000", "[" * 50_000))
    for digits in (4301, 5000, 20_000):
        out.append((f"int of {digits} digits", '{"user_id": "user_1", "title": ' + "7" * digits + "}"))
        out.append((f"negative int of {digits} digits", '{"title": -' + "9" * digits + "}"))
    out.append(("float 1e999999", '{"user_id": "user_1", "title": 1e999999}'))
    out.append(("NaN literal", '{"user_id": "user_1", "title": NaN}'))
    for sur in ("\\ud800", "\\udfff", "\\ud83d", "\\udc00\\ud800"):
        out.append((f"lone surrogate {sur} in a key", '{"' + sur + '": 1}'))
        out.append((f"lone surrogate {sur} in a value", '{"user_id": "user_1", "title": "' + sur + '"}'))
    out.append(("lone surrogate in a nested key", '{"user_id": "user_1", "title": "t", "description": {"\\ud800x": [1]}}'))
    for text in ("[]", "null", "42", '"a string"', "", "{", "{not json", '{"user_id": }', "\u0000", '{"a":1}{"b":2}'):
        out.append((f"not an object: {text[:12]!r}", text))
    out.append(("NUL in a value", '{"user_id": "user_\\u0000", "title": "x"}'))
    out.append(("control chars in a key", '{"\\u0001\\u001f": "x"}'))
    out.append(("1 MB string value for an unknown user", '{"user_id": "user_404", "title": "' + "x" * 1_000_000 + '"}'))
    out.append(("10000 keys", "{" + ",".join(f'"k{i}": {i}' for i in range(10_000)) + "}"))
    noise = "".join(rng.choice('{}[]":,0123456789abc\\ ') for _ in range(300))
    out.append(("random JSON-ish noise", noise))
    return out


def generate_cases(seed: int = 15, n: int = 240) -> list[Case]:
    """At least `n` distinct cases (more when the fixed families alone exceed `n`), seeded."""
    rng = random.Random(seed)
    cases: list[Case] = []
    env_methods = ["ListEnvironments", "ListTasks", "Reset", "Step", "Close"]
    reward_methods = ["Score", "ScoreBatch"]
    IA, NF, FP = "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION"

    # -- garbage bytes, every RPC -------------------------------------------------------
    garbage = [b"\xff", b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 11,
               b"\x07", b"\x0f\x00", b"\x0a\x05ab"]
    for method in [ENV_S + m for m in env_methods] + [REWARD_S + m for m in reward_methods]:
        for g in garbage:
            cases.append(Case("garbage bytes", method, f"bytes {g[:12].hex()}", lambda c, g=g: g, IA))
        for k in range(3):
            blob = bytes(rng.randrange(256) for _ in range(rng.randrange(8, 400)))
            if blob[0] & 7 in (0, 1, 5):  # make sure it is not a valid encoding by chance
                blob = b"\x0f" + blob
            cases.append(Case("garbage bytes", method, f"random bytes #{k} {hashlib.sha1(blob).hexdigest()[:8]}",
                              lambda c, b=blob: b, IA))
    for method in (ROLLOUT_S + "Rollout", ROLLOUT_S + "UpdateWeights", ROLLOUT_S + "Status"):
        for g in garbage[:4]:
            cases.append(Case("garbage bytes", method, f"bytes {g[:12].hex()}", lambda c, g=g: g, IA))

    # -- invalid UTF-8 in every string field --------------------------------------------
    bad_utf8 = [b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xc0\xaf", b"\xe2\x82", b"\xf8\x88\x80\x80\x80",
                b"ok\xfe\xfeok"]
    fields: list[tuple[str, str, Callable[[bytes], bytes]]] = [
        (ENV_S + "ListTasks", "env", lambda b: _ld(1, b)),
        (ENV_S + "ListTasks", "split", lambda b: _ld(1, b"mock") + _ld(2, b)),
        (ENV_S + "Reset", "env", lambda b: _ld(1, b)),
        (ENV_S + "Reset", "task_id", lambda b: _ld(1, b"mock") + _ld(2, b)),
        (ENV_S + "Reset", "split", lambda b: _ld(1, b"mock") + _ld(3, b)),
        (ENV_S + "Step", "session_id", lambda b: _ld(1, b)),
        (ENV_S + "Step", "action.content", lambda b: _ld(1, b"s") + _ld(2, _varint(8) + _varint(3) + _ld(2, b))),
        (ENV_S + "Step", "action.tool_calls[0].arguments_json",
         lambda b: _ld(1, b"s") + _ld(2, _ld(3, _ld(2, b"get_users") + _ld(3, b)))),
        (ENV_S + "Close", "session_id", lambda b: _ld(1, b)),
        (REWARD_S + "Score", "env", lambda b: _ld(1, b)),
        (REWARD_S + "Score", "task_id", lambda b: _ld(1, b"mock") + _ld(2, b)),
        (REWARD_S + "Score", "messages[0].content", lambda b: _ld(1, b"mock") + _ld(3, _ld(2, b))),
        (REWARD_S + "ScoreBatch", "items[0].env", lambda b: _ld(1, _ld(1, b))),
        (REWARD_S + "ScoreBatch", "items[1].task_id", lambda b: _ld(1, _ld(1, b"mock")) + _ld(1, _ld(2, b))),
        (ROLLOUT_S + "Rollout", "env", lambda b: _ld(1, b)),
        (ROLLOUT_S + "Rollout", "task_ids[0]", lambda b: _ld(2, b)),
    ]
    for method, fname, enc in fields:
        for b in rng.sample(bad_utf8, 3):
            cases.append(Case("invalid UTF-8", method, f"{fname} = {b.hex()}", lambda c, e=enc, b=b: e(b), IA))

    # -- truncated encodings and wrong wire types (decode or not: any clear answer) ------
    step = env_pb2.StepRequest(session_id="0" * 32, action=_action(_call("create_task", GOLDEN_ARGS)))
    score = reward_pb2.ScoreRequest(env="mock", task_id=TASK, messages=[_action(_call("get_users", "{}"))],
                                    termination_reason=1)
    for method, msg in ((ENV_S + "Step", step), (REWARD_S + "Score", score),
                        (REWARD_S + "ScoreBatch", reward_pb2.ScoreBatchRequest(items=[score])),
                        (ENV_S + "Reset", env_pb2.ResetRequest(env="mock", task_id=TASK, solo_mode=True, max_steps=3))):
        data = msg.SerializeToString()
        for cut in sorted(rng.sample(range(1, len(data)), 4)):
            cases.append(Case("truncated encoding", method, f"first {cut} of {len(data)} bytes",
                              lambda c, d=data[:cut]: d, ANY))
    wrong = [(ENV_S + "Step", "session_id as varint", _varint(8) + _varint(12345)),
             (ENV_S + "Step", "stop as a string", _ld(3, b"yes")),
             (ENV_S + "Reset", "max_steps as a string", _ld(1, b"mock") + _ld(6, b"10")),
             (ENV_S + "Reset", "seed as fixed64", _ld(1, b"mock") + _varint((4 << 3) | 1) + b"\x01" * 8),
             (REWARD_S + "Score", "termination_reason as a string", _ld(1, b"mock") + _ld(4, b"agent_stop")),
             (ENV_S + "ListTasks", "field 999 unknown", _varint((999 << 3) | 0) + _varint(1)),
             (ENV_S + "Close", "group wire type", _varint((1 << 3) | 3) + _varint((1 << 3) | 4))]
    for method, name, data in wrong:
        cases.append(Case("wrong wire type", method, name, lambda c, d=data: d, ANY))

    # -- huge ids (echo must be clipped) -------------------------------------------------
    for size in (10_000, 100_000, 1_000_000):
        h = _huge(rng, size)
        small = NF if size <= 64 * 1024 else "RESOURCE_EXHAUSTED"  # ListTasks, Close: a 64 KiB request limit (sinkflex.limits)
        cases += [
            Case("huge id", ENV_S + "ListTasks", f"env of {size} chars", lambda c, h=h: env_pb2.ListTasksRequest(env=h), small),
            Case("huge id", ENV_S + "ListTasks", f"split of {size} chars",
                 lambda c, h=h: env_pb2.ListTasksRequest(env="mock", split=h), small),
            Case("huge id", ENV_S + "Reset", f"env of {size} chars", lambda c, h=h: env_pb2.ResetRequest(env=h), NF),
            Case("huge id", ENV_S + "Reset", f"task_id of {size} chars",
                 lambda c, h=h: env_pb2.ResetRequest(env="mock", task_id=h, solo_mode=True), NF),
            Case("huge id", ENV_S + "Reset", f"split of {size} chars",
                 lambda c, h=h: env_pb2.ResetRequest(env="mock", split=h, solo_mode=True), NF),
            Case("huge id", ENV_S + "Step", f"session_id of {size} chars",
                 lambda c, h=h: env_pb2.StepRequest(session_id=h, stop=True), NF),
            Case("huge id", ENV_S + "Close", f"session_id of {size} chars", lambda c, h=h: env_pb2.CloseRequest(session_id=h), small),
            Case("huge id", REWARD_S + "Score", f"env of {size} chars",
                 lambda c, h=h: _score_request(c.golden, env=h), NF),
            Case("huge id", REWARD_S + "Score", f"task_id of {size} chars",
                 lambda c, h=h: _score_request(c.golden, task_id=h), NF),
            Case("huge id", REWARD_S + "ScoreBatch", f"items[0].task_id of {size} chars",
                 lambda c, h=h: reward_pb2.ScoreBatchRequest(items=[_score_request(c.golden, task_id=h)]), OK,
                 check_ok=_batch_items_clear),
        ]
    for size in (10_000, 1_000_000):
        h = _huge(rng, size)
        cases.append(Case("huge id", REWARD_S + "Score", f"tool_call_id of {size} chars answering nothing",
                          lambda c, h=h: _score_request(c.golden, messages=[common_pb2.Message(role=common_pb2.ROLE_TOOL,
                                                                                                tool_call_id=h, content="x")]), IA))
        cases.append(Case("huge id", ENV_S + "Step", f"tool call id of {size} chars", target="fresh",
                          build=lambda c, h=h: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("get_users", "{}", call_id=h))),
                          expect=OK))
        cases.append(Case("huge id", ENV_S + "Step", f"tool name of {size} chars", target="fresh",
                          build=lambda c, h=h: env_pb2.StepRequest(session_id=c.sid, action=_action(_call(h, "{}"))),
                          expect=OK, check_ok=_tool_errors_answer_calls))
    odd_ids = ["\u0000", "a\u0000b", "🙂" * 5, "\u202e" + "0" * 31, "../../etc/passwd", "' OR 1=1 --", " ", "\n", "%s%n", "０" * 32]
    for s in odd_ids:
        cases.append(Case("odd id", ENV_S + "Step", f"session_id {s!r}", lambda c, s=s: env_pb2.StepRequest(session_id=s, stop=True), NF))
        cases.append(Case("odd id", ENV_S + "Close", f"session_id {s!r}", lambda c, s=s: env_pb2.CloseRequest(session_id=s), NF))
    for s in odd_ids[:4]:
        cases.append(Case("odd id", ENV_S + "Reset", f"env {s!r}", lambda c, s=s: env_pb2.ResetRequest(env=s), NF))
        cases.append(Case("odd id", REWARD_S + "Score", f"task_id {s!r}", lambda c, s=s: _score_request(c.golden, task_id=s), NF))

    # -- unknown enum values ------------------------------------------------------------
    for v in (5, 99, -1, 2**31 - 1, -(2**31)):
        cases.append(Case("unknown enum", ENV_S + "Step", f"action.role = {v}", target="fresh",
                          build=lambda c, v=v: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS), role=v)),
                          expect=IA))
        cases.append(Case("unknown enum", ENV_S + "Step", f"tool_calls[1].requestor = {v}", target="fresh",
                          build=lambda c, v=v: env_pb2.StepRequest(session_id=c.sid, action=_action(
                              _call("create_task", GOLDEN_ARGS), _call("get_users", "{}", "c2", requestor=v))),
                          expect=IA))
        t = 10 if v == 5 else v  # 5 is AGENT_ERROR; 10 is the first unknown termination reason
        cases.append(Case("unknown enum", REWARD_S + "Score", f"termination_reason = {t}",
                          lambda c, t=t: _score_request(c.golden, termination_reason=t), IA))
        cases.append(Case("unknown enum", REWARD_S + "Score", f"messages[0].role = {v}",
                          lambda c, v=v: _score_request(c.golden, messages=[common_pb2.Message(role=v, content="hi")]), IA))
        cases.append(Case("unknown enum", REWARD_S + "ScoreBatch", f"items[0] tool message requestor = {v}",
                          lambda c, v=v: reward_pb2.ScoreBatchRequest(items=[_score_request(c.golden, messages=[
                              _action(_call("get_users", "{}")),
                              common_pb2.Message(role=common_pb2.ROLE_TOOL, tool_call_id="c1", content="[]", requestor=v)])]),
                          OK, check_ok=_batch_items_clear))
    for v in (common_pb2.ROLE_TOOL, common_pb2.ROLE_SYSTEM, common_pb2.ROLE_USER):
        cases.append(Case("wrong role", ENV_S + "Step", f"action.role = {common_pb2.Role.Name(v)}", target="fresh",
                          build=lambda c, v=v: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS), role=v)),
                          expect=IA))
        cases.append(Case("wrong role", ENV_S + "Step", f"tool_calls[1].requestor = {common_pb2.Role.Name(v)}", target="fresh",
                          build=lambda c, v=v: env_pb2.StepRequest(session_id=c.sid, action=_action(
                              _call("create_task", GOLDEN_ARGS), _call("get_users", "{}", "c2", requestor=v))),
                          expect=IA))

    # -- tool-call arguments: a tool error, the episode goes on; the scorer scores them --
    for name, args in _bad_args(rng):
        cases.append(Case("tool arguments", ENV_S + "Step", name, target="fresh",
                          build=lambda c, a=args: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", a))),
                          expect=OK, check_ok=_tool_errors_answer_calls))
    for name, args in rng.sample(_bad_args(rng), 16):
        cases.append(Case("tool arguments", REWARD_S + "Score", name,
                          lambda c, a=args: _score_request(_golden_with_args(c.golden, a)), OK, check_ok=_score_zero_or_clear))
        cases.append(Case("tool arguments", REWARD_S + "ScoreBatch", name,
                          lambda c, a=args: reward_pb2.ScoreBatchRequest(items=[_score_request(_golden_with_args(c.golden, a)),
                                                                                 _score_request(c.golden)]),
                          OK, check_ok=_batch_items_clear))

    # -- malformed actions and out-of-order calls ----------------------------------------
    cases += [
        Case("malformed action", ENV_S + "Step", "empty action without stop", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=common_pb2.Message()), expect=IA),
        Case("malformed action", ENV_S + "Step", "stop with tool calls", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS)), stop=True), expect=IA),
        Case("malformed action", ENV_S + "Step", "a valid call then an empty-named one", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS), _call("", "{}", "c2"))),
             expect=IA),
        Case("malformed action", ENV_S + "Step", "1000 tool calls to an unknown tool", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(*[_call("nope", "{}", "c1")] * 1000)),
             expect=ANY),
        Case("malformed action", ENV_S + "Step", "content of 5 MB", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(content="y" * 5_000_000)), expect=OK),
        Case("malformed action", ENV_S + "Reset", "max_steps -1", lambda c: env_pb2.ResetRequest(env="mock", task_id=TASK, max_steps=-1), IA),
        Case("malformed action", ENV_S + "Reset", "max_steps -2^31",
             lambda c: env_pb2.ResetRequest(env="mock", task_id=TASK, max_steps=-(2**31)), IA),
        Case("malformed action", ENV_S + "Reset", "empty env", lambda c: env_pb2.ResetRequest(), NF),
        Case("malformed action", ENV_S + "ListTasks", "empty env", lambda c: env_pb2.ListTasksRequest(), NF),
        Case("malformed action", ENV_S + "Step", "empty session id", lambda c: env_pb2.StepRequest(stop=True), NF),
        Case("malformed action", ENV_S + "Close", "empty session id", lambda c: env_pb2.CloseRequest(), NF),
        Case("out of order", ENV_S + "Step", "step after the episode ended", target="ended",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("get_users", "{}"))), expect=FP),
        Case("out of order", ENV_S + "Step", "stop after the episode ended", target="ended",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, stop=True), expect=FP),
        Case("out of order", ENV_S + "Step", "step on a closed session", target="closed",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, stop=True), expect=NF),
        Case("out of order", ENV_S + "Close", "close twice", target="closed",
             build=lambda c: env_pb2.CloseRequest(session_id=c.sid), expect=NF),
        Case("out of order", ENV_S + "Close", "close an ended session", target="ended",
             build=lambda c: env_pb2.CloseRequest(session_id=c.sid), expect=OK),
        Case("concurrency", ENV_S + "Step", "8 steps at once on one session", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("get_users", "{}"))),
             expect=OK, special="concurrent"),
        Case("cancellation", ENV_S + "Step", "a Step cancelled by the client", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS)),
                                                 request_id="1"),
             expect=ANY, special="cancel"),
        Case("cancellation", ENV_S + "Step", "a Step whose deadline passes (1 ms)", target="fresh",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(_call("create_task", GOLDEN_ARGS)),
                                                 request_id="1"),
             expect=ANY, special="deadline"),
        Case("cancellation", ENV_S + "Step", f"cancelled {SLOW_CANCEL_S} s into a {USER_DELAY_S} s user turn", target="user",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(content="Hello! How can I help you today?")),
             expect="CANCELLED", special="slow-cancel"),
        Case("cancellation", ENV_S + "Step", f"deadline of {SLOW_CANCEL_S} s passes during a {USER_DELAY_S} s user turn",
             target="user",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(content="Hello! What do you need?")),
             expect="DEADLINE_EXCEEDED", special="slow-deadline"),
        Case("cancellation", ENV_S + "Step", "a different Step after one whose answer was lost", target="user",
             build=lambda c: env_pb2.StepRequest(session_id=c.sid, action=_action(content="Hello there.")),
             expect="FAILED_PRECONDITION", special="slow-diverge"),
    ]
    # -- malformed conversations for the scorer -----------------------------------------
    T = common_pb2.ROLE_TOOL
    conv = {
        "empty env": lambda g: _score_request(g, env=""),
        "empty task_id": lambda g: _score_request(g, task_id=""),
        "termination unspecified": lambda g: _score_request(g, termination_reason=0),
        "tool message answering nothing": lambda g: _score_request(g, messages=[common_pb2.Message(role=T, tool_call_id="x", content="x")]),
        "tool answer out of order": lambda g: _score_request(g, messages=[
            _action(_call("get_users", "{}", "a"), _call("get_users", "{}", "b")),
            common_pb2.Message(role=T, tool_call_id="b", content="[]")]),
        "tool message making tool calls": lambda g: _score_request(g, messages=[
            _action(_call("get_users", "{}")), common_pb2.Message(role=T, tool_call_id="c1", tool_calls=[_call("x", "{}")])]),
        "system message with tool calls": lambda g: _score_request(g, messages=[
            common_pb2.Message(role=common_pb2.ROLE_SYSTEM, tool_calls=[_call("get_users", "{}")])]),
        "empty tool name": lambda g: _score_request(g, messages=[_action(_call("", "{}"))]),
        "a turn while calls are pending": lambda g: _score_request(g, messages=[
            _action(_call("get_users", "{}")), _action(content="hello")]),
        "user message in solo mode": lambda g: _score_request(g, messages=[common_pb2.Message(role=common_pb2.ROLE_USER, content="hi")]),
        "solo mode on retail": lambda g: _score_request(g, env="retail", task_id="0"),
        "tool requestor ROLE_SYSTEM": lambda g: _score_request(g, messages=[
            _action(_call("get_users", "{}")), common_pb2.Message(role=T, tool_call_id="c1", content="[]",
                                                                    requestor=common_pb2.ROLE_SYSTEM)]),
        "call requestor ROLE_TOOL": lambda g: _score_request(g, messages=[_action(_call("get_users", "{}", requestor=T))]),
    }
    expect = {"solo mode on retail": IA}
    for name, fn in conv.items():
        code = expect.get(name, IA)
        cases.append(Case("bad conversation", REWARD_S + "Score", name, lambda c, f=fn: f(c.golden), code))
        cases.append(Case("bad conversation", REWARD_S + "ScoreBatch", name,
                          lambda c, f=fn: reward_pb2.ScoreBatchRequest(items=[f(c.golden), _score_request(c.golden)]), OK,
                          check_ok=_batch_items_clear))
    cases.append(Case("bad conversation", REWARD_S + "ScoreBatch", "200 items of unknown tasks",
                      lambda c: reward_pb2.ScoreBatchRequest(items=[_score_request(c.golden, task_id=f"nope-{i}") for i in range(200)]),
                      OK, check_ok=_batch_items_clear))
    cases.append(Case("bad conversation", REWARD_S + "ScoreBatch", "1000 items (above max_batch_items 256)",
                      lambda c: reward_pb2.ScoreBatchRequest(items=[_score_request(c.golden, task_id=f"nope-{i}") for i in range(1000)]),
                      "INVALID_ARGUMENT"))
    cases.append(Case("bad conversation", REWARD_S + "ScoreBatch", "empty batch", lambda c: reward_pb2.ScoreBatchRequest(), OK))
    # -- the rollout service while its engine loads: every valid request UNAVAILABLE -----
    for method, req in ((ROLLOUT_S + "Rollout", rollout_pb2.RolloutRequest(env="\u0000" * 10_000)),
                        (ROLLOUT_S + "UpdateWeights", rollout_pb2.UpdateWeightsRequest(policy_version=-5)),
                        (ROLLOUT_S + "Status", rollout_pb2.StatusRequest())):
        cases.append(Case("loading service", method, "a request before the engine is loaded", lambda c, r=req: r, "UNAVAILABLE"))

    # -- seeded variations until there are n: random garbage on random RPCs --------------
    methods = [ENV_S + m for m in env_methods] + [REWARD_S + m for m in reward_methods]
    k = 0
    while len({c.key for c in cases}) < n:
        method = rng.choice(methods)
        blob = b"\x0f" + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 2000)))
        cases.append(Case("garbage bytes", method, f"seeded bytes #{k} {hashlib.sha1(blob).hexdigest()[:8]}", lambda c, b=blob: b, "INVALID_ARGUMENT"))
        k += 1
    seen, out = set(), []
    for c in cases:
        if c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def sample_cases(cases: list[Case], n: int, seed: int = 15) -> list[Case]:
    """`n` cases covering every (family, method) pair first, then a seeded draw of the rest."""
    rng = random.Random(seed)
    firsts, rest = {}, []
    for c in cases:
        if (c.family, c.method) not in firsts:
            firsts[(c.family, c.method)] = c
        else:
            rest.append(c)
    chosen = list(firsts.values())
    chosen += rng.sample(rest, max(0, min(len(rest), n - len(chosen))))
    return chosen


# ----------------------------------------------------------------------------- servers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A service started as `python -m MODULE ...` on a free loopback port, log to a file."""

    def __init__(self, module: str, args: list[str], log_dir: Path):
        self.module, self.args, self.log_dir = module, args, log_dir
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.port = _free_port()
        self.log_path = self.log_dir / f"{self.module}.{self.starts}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, LITELLM_LOCAL_MODEL_COST_MAP="True", PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", self.module, "--port", str(self.port), *self.args],
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.starts += 1
        self.channel = grpc.insecure_channel(self.address, options=channel_options())
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited ({self.proc.returncode}); see {self.log_path}")
            if self.serving(timeout=1.0):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.module} not SERVING within 180 s; see {self.log_path}")

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serving(self, timeout: float = 5.0) -> bool:
        try:
            r = health_pb2_grpc.HealthStub(self.channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return r.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def rss_mb(self) -> float:
        try:
            import psutil

            return psutil.Process(self.proc.pid).memory_info().rss / 2**20
        except Exception:  # noqa: BLE001
            return float("nan")

    def tracebacks(self) -> int:
        return sum(Path(self.log_dir / f"{self.module}.{i}.log").read_text(errors="replace").count("Traceback")
                   for i in range(self.starts))

    def stop(self) -> None:
        self.channel.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()


class LoadingRollout:
    """The rollout service's real servicer and server before its engine is set (what it
    answers while vLLM loads), in this process on a loopback port."""

    def __init__(self):
        from rollout_service.server import RolloutServicer
        from sinkflex.api.rollout.v1 import rollout_pb2_grpc
        from sinkflex.serving import ServiceServer

        self.server = ServiceServer(port=0, service_names=["sinkflex.api.rollout.v1.RolloutService"])
        rollout_pb2_grpc.add_RolloutServiceServicer_to_server(RolloutServicer(), self.server.server)
        self.port = self.server.start()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.port}", options=channel_options())

    def stop(self) -> None:
        self.channel.close()
        self.server.stop()


# ----------------------------------------------------------------------------- running


@dataclass
class Outcome:
    case: Case
    code: str
    message: str
    problems: list[str]
    crash: bool = False


def _raw_call(channel: grpc.Channel, method: str, payload, timeout: float = 120.0):
    """Sends `payload` (bytes as they are, or a message serialized) and returns the response bytes."""
    data = payload if isinstance(payload, bytes) else payload.SerializeToString()
    if method in STREAMING:
        call = channel.unary_stream(method, request_serializer=None, response_deserializer=None)
        return list(call(data, timeout=timeout))
    call = channel.unary_unary(method, request_serializer=None, response_deserializer=None)
    return call(data, timeout=timeout)


RESPONSE_TYPES = {
    ENV_S + "Step": env_pb2.StepResponse,
    REWARD_S + "Score": reward_pb2.ScoreResponse,
    REWARD_S + "ScoreBatch": reward_pb2.ScoreBatchResponse,
}


class Campaign:
    def __init__(self, log_dir: Path, with_rollout: bool = True):
        self.log_dir = log_dir
        config = log_dir / "env.yaml"
        config.write_text(json.dumps({"domains": ["mock"], "user_model": "openai/scripted-user", "user_base_url": None,
                                      "user_llm_extra_args": {"mock_response": "I need a task for my meeting.",
                                                              "mock_delay": USER_DELAY_S}}))
        self.env = Proc("env_service", ["--config", str(config), "--metrics-port", "-1", "--log-level", "WARNING"], log_dir)
        self.reward = Proc("reward_service", ["--no-metrics"], log_dir)
        self.rollout = LoadingRollout() if with_rollout else None
        self.crashes = 0
        self.cross: list[str] = []
        self._setup()

    # -- sessions --------------------------------------------------------------------------
    @property
    def env_stub(self):
        return env_pb2_grpc.EnvServiceStub(self.env.channel)

    @property
    def reward_stub(self):
        return reward_pb2_grpc.RewardServiceStub(self.reward.channel)

    def reset(self) -> str:
        r = self.env_stub.Reset(env_pb2.ResetRequest(env="mock", task_id=TASK, solo_mode=True, max_steps=BIG_STEPS), timeout=60)
        return r.session_id

    def probe(self, sid: str) -> tuple[str, int, int]:
        """(what get_users shows, step_count, num_errors) of a session, after one read-only step."""
        r = self.env_stub.Step(env_pb2.StepRequest(session_id=sid, action=_action(_call("get_users", "{}", "probe"))), timeout=60)
        return r.observation[0].content, int(r.info["step_count"]), int(r.info["num_errors"])

    def _setup(self) -> None:
        # the golden trajectory (env-played), its score, and a fresh session's probe
        sid = self.reset()
        golden_action = _action(_call("create_task", GOLDEN_ARGS))
        s1 = self.env_stub.Step(env_pb2.StepRequest(session_id=sid, action=golden_action), timeout=60)
        s2 = self.env_stub.Step(env_pb2.StepRequest(session_id=sid, stop=True), timeout=60)
        assert s2.terminated and s2.reward == 1.0, s2
        self.golden = [golden_action, *s1.observation, common_pb2.Message(role=common_pb2.ROLE_ASSISTANT, content="###STOP###")]
        self.env_stub.Close(env_pb2.CloseRequest(session_id=sid), timeout=60)
        self.golden_score = self.reward_stub.Score(_score_request(self.golden), timeout=120).SerializeToString()
        assert reward_pb2.ScoreResponse.FromString(self.golden_score).breakdown.reward == 1.0
        fresh = self.reset()
        self.fresh_probe = self.probe(fresh)  # (content, step_count, num_errors) of a fresh session's first probe
        self.env_stub.Close(env_pb2.CloseRequest(session_id=fresh), timeout=60)
        # witnesses: one fresh, one with the golden task created; probed along the way
        self.witnesses: dict[str, dict] = {}
        for name, steps in (("fresh", []), ("created", [golden_action])):
            wid = self.reset()
            for a in steps:
                self.env_stub.Step(env_pb2.StepRequest(session_id=wid, action=a), timeout=60)
            content, count, errors = self.probe(wid)
            self.witnesses[name] = {"sid": wid, "content": content, "count": count, "errors": errors}

    def check_witnesses(self, final: bool = False) -> None:
        for name, w in self.witnesses.items():
            try:
                content, count, errors = self.probe(w["sid"])
            except grpc.RpcError as err:
                self.cross.append(f"witness {name}: probe failed: {err.code().name}: {err.details()[:200]}")
                continue
            if content != w["content"] or count != w["count"] + 2 or errors != w["errors"]:
                self.cross.append(f"witness {name}: state changed (step_count {w['count']} -> {count}, errors {w['errors']} -> {errors})")
            w["count"] = count
        got = self.reward_stub.Score(_score_request(self.golden), timeout=120).SerializeToString()
        if got != self.golden_score:
            self.cross.append("the golden trajectory's score changed")
        if final:
            w = self.witnesses["created"]
            r = self.env_stub.Step(env_pb2.StepRequest(session_id=w["sid"], stop=True), timeout=60)
            if r.reward != 1.0:
                self.cross.append(f"witness 'created' scores {r.reward}, not 1.0, at the end")
            w = self.witnesses["fresh"]
            self.env_stub.Step(env_pb2.StepRequest(session_id=w["sid"], action=_action(_call("create_task", GOLDEN_ARGS))), timeout=60)
            r = self.env_stub.Step(env_pb2.StepRequest(session_id=w["sid"], stop=True), timeout=60)
            if r.reward != 1.0:
                self.cross.append(f"witness 'fresh' scores {r.reward}, not 1.0, at the end")

    # -- one case --------------------------------------------------------------------------
    def channel_for(self, method: str) -> grpc.Channel:
        if method.startswith(ENV_S):
            return self.env.channel
        if method.startswith(REWARD_S):
            return self.reward.channel
        return self.rollout.channel

    def run_case(self, case: Case) -> Outcome:
        ctx = Ctx(golden=self.golden)
        if case.target == "user":  # a dual-control session: the scripted, slow user answers text
            ctx.sid = self.env_stub.Reset(env_pb2.ResetRequest(env="mock", task_id=TASK, max_steps=BIG_STEPS), timeout=60).session_id
        elif case.target:
            ctx.sid = self.reset()
            if case.target == "ended":
                self.env_stub.Step(env_pb2.StepRequest(session_id=ctx.sid, stop=True), timeout=60)
            elif case.target == "closed":
                self.env_stub.Close(env_pb2.CloseRequest(session_id=ctx.sid), timeout=60)
        payload = case.build(ctx)
        problems: list[str] = []
        if case.special:
            code, message, resp = self._special(case, ctx, payload, problems)
        else:
            code, message, resp = self._send(case.method, payload)
        # the answer
        if code in {"UNKNOWN", "INTERNAL"}:
            problems.append(f"unclear status {code}")
        if case.expect not in (ANY, code) and not (case.expect == ANY and code in {"UNKNOWN", "INTERNAL"}):
            problems.append(f"expected {case.expect}, got {code}")
        client_side = case.special in ("cancel", "deadline", "slow-cancel", "slow-deadline")
        if code != OK and not (client_side and code in {"CANCELLED", "DEADLINE_EXCEEDED"}):
            if not message.strip():
                problems.append("empty message")
            if len(message.encode()) > MAX_MESSAGE_BYTES:
                problems.append(f"message of {len(message.encode())} bytes (> {MAX_MESSAGE_BYTES})")
        if code == OK and case.check_ok is not None and resp is not None:
            why = case.check_ok(RESPONSE_TYPES[case.method].FromString(resp))
            if why:
                problems.append(why)
        # a refused Step left its session as it was
        if case.target == "fresh" and code != OK and not case.special:
            try:
                if self.probe(ctx.sid) != self.fresh_probe:
                    problems.append("the refused call changed its session")
            except grpc.RpcError as err:
                problems.append(f"the session no longer answers after the refusal: {err.code().name}")
        # still serving
        crash = False
        for proc in (self.env, self.reward):
            if proc.proc.poll() is not None or not proc.serving():
                crash = True
                problems.append(f"{proc.module} died or stopped answering")
                proc.stop()
                proc.start()
                self._setup()
        if ctx.sid and not crash:
            try:
                self.env_stub.Close(env_pb2.CloseRequest(session_id=ctx.sid), timeout=60)
            except grpc.RpcError:
                pass
        return Outcome(case, code, message, problems, crash)

    def _send(self, method: str, payload) -> tuple[str, str, Any]:
        try:
            resp = _raw_call(self.channel_for(method), method, payload)
            return OK, "", resp
        except grpc.RpcError as err:
            return err.code().name, err.details() or "", None

    def _special(self, case: Case, ctx: Ctx, payload, problems: list[str]) -> tuple[str, str, Any]:
        if case.special == "concurrent":
            results: list = []
            threads = [threading.Thread(target=lambda: results.append(self._send(case.method, payload))) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            bad = [r for r in results if r[0] != OK]
            content, count, errors = self.probe(ctx.sid)
            if count != self.fresh_probe[1] + 2 * 8 or errors != 0 or content != self.fresh_probe[0]:
                problems.append(f"8 concurrent steps left step_count {count} (expected {self.fresh_probe[1] + 16}), errors {errors}")
            return (bad[0][:2] + (None,)) if bad else (OK, "", None)
        if case.special.startswith("slow-"):
            return self._slow(case, ctx, payload, problems)
        # cancelled / past its deadline: the client does not see the answer; then the step is
        # either not applied or its result is retrievable (docs/reliability.md)
        stub = self.env_stub
        if case.special == "cancel":
            fut = stub.Step.future(payload, timeout=60)
            fut.cancel()
            try:
                fut.result()
                code, message = OK, ""
            except grpc.FutureCancelledError:
                code, message = "CANCELLED", ""
            except grpc.RpcError as err:
                code, message = err.code().name, err.details() or ""
        else:
            try:
                stub.Step(payload, timeout=0.001)
                code, message = OK, ""
            except grpc.RpcError as err:
                code, message = err.code().name, err.details() or ""
        time.sleep(0.3)  # let the server finish whatever it started
        if code != OK:
            why = self._after_lost_step(ctx.sid, payload)
            if why:
                problems.append(why)
        return code, message, None

    def _slow(self, case: Case, ctx: Ctx, payload, problems: list[str]) -> tuple[str, str, Any]:
        """A Step the client gives up on while the user simulator is still answering: the
        server finishes it and keeps its answer; the resend gets it (info replayed), and any
        other Step before that is FAILED_PRECONDITION."""
        stub = self.env_stub
        if case.special == "slow-deadline":
            try:
                stub.Step(payload, timeout=SLOW_CANCEL_S)
                return OK, "", None
            except grpc.RpcError as err:
                code, message = err.code().name, err.details() or ""
        else:
            fut = stub.Step.future(payload, timeout=60)
            time.sleep(SLOW_CANCEL_S)
            fut.cancel()
            code, message = "CANCELLED", ""
        time.sleep(USER_DELAY_S + 0.7)  # the server finishes the Step
        if case.special == "slow-diverge":
            try:
                stub.Step(env_pb2.StepRequest(session_id=ctx.sid, action=_action(content="Something else.")), timeout=60)
                code, message = OK, ""
                problems.append("a different Step was applied after a lost one")
            except grpc.RpcError as err:
                code, message = err.code().name, err.details() or ""
        try:
            again = stub.Step(payload, timeout=60)
        except grpc.RpcError as err:
            problems.append(f"resending the lost Step: {err.code().name}: {(err.details() or '')[:200]}")
            return code, message, None
        if again.info.get("replayed") != "true" or not any(m.role == common_pb2.ROLE_USER for m in again.observation):
            problems.append("the resend did not return the lost Step's kept answer (the user's reply)")
        try:  # and the episode goes on from there
            stub.Step(env_pb2.StepRequest(session_id=ctx.sid, action=_action(_call("get_users", "{}"))), timeout=60)
        except grpc.RpcError as err:
            problems.append(f"the session does not go on after the resend: {err.code().name}")
        return code, message, None

    def _after_lost_step(self, sid: str, payload) -> str | None:
        """After a Step whose answer the client never got: resending it must either apply it
        (it did not happen) or return its kept result (it happened), never apply it twice."""
        try:
            again = self.env_stub.Step(payload, timeout=60)
        except grpc.RpcError as err:
            return f"resending the lost Step: {err.code().name}: {(err.details() or '')[:200]}"
        content, count, errors = self.probe(sid)
        tasks = content.count("task_")
        if tasks != 2:  # user_1 starts with task_1; exactly one create_task applied -> 2
            return f"after a lost Step and its resend the session holds {tasks} tasks of user_1 (expected 2: applied once)"
        if again.observation and again.observation[0].error:
            return "the resent Step failed as a tool call"
        return None

    def stop(self) -> None:
        for w in self.witnesses.values():
            try:
                self.env_stub.Close(env_pb2.CloseRequest(session_id=w["sid"]), timeout=10)
            except grpc.RpcError:
                pass
        self.env.stop()
        self.reward.stop()
        if self.rollout is not None:
            self.rollout.stop()


def run_campaign(cases: list[Case], log_dir: Path | None = None, check_every: int = 20,
                 progress: Callable[[str], None] | None = None) -> dict:
    """Runs `cases` against fresh servers; returns the figures (see the module docstring)."""
    tmp = None
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="sinkflex-reliability-")
        log_dir = Path(tmp.name)
    t0 = time.monotonic()
    campaign = Campaign(log_dir, with_rollout=any(c.method.startswith(ROLLOUT_S) for c in cases))
    rss0 = {"env": campaign.env.rss_mb(), "reward": campaign.reward.rss_mb()}
    outcomes: list[Outcome] = []
    try:
        for i, case in enumerate(cases):
            outcomes.append(campaign.run_case(case))
            if progress and outcomes[-1].problems:
                progress(f"UNCLEAR {case.family} {case.key}: {outcomes[-1].code}: {outcomes[-1].problems}")
            if (i + 1) % check_every == 0:
                campaign.check_witnesses()
        campaign.check_witnesses(final=True)
        rss1 = {"env": campaign.env.rss_mb(), "reward": campaign.reward.rss_mb()}
        tracebacks = {"env": campaign.env.tracebacks(), "reward": campaign.reward.tracebacks()}
    finally:
        campaign.stop()
        if tmp is not None:
            tmp.cleanup()
    families: dict[str, dict] = {}
    for o in outcomes:
        f = families.setdefault(o.case.family, {"tried": 0, "clear_status": 0, "methods": set(), "codes": {}})
        f["tried"] += 1
        f["clear_status"] += not o.problems
        f["methods"].add(o.case.method.rsplit("/", 1)[1])
        f["codes"][o.code] = f["codes"].get(o.code, 0) + 1
    for f in families.values():
        f["methods"] = sorted(f["methods"])
    methods = sorted({o.case.method.lstrip("/") for o in outcomes})
    return {
        "bad_inputs": {
            "tried": len(outcomes),
            "clear_status": sum(not o.problems for o in outcomes),
            "unclear": sum(bool(o.problems) for o in outcomes),
            "crashes": sum(o.crash for o in outcomes),
            "cross_session_effects": len(campaign.cross),
        },
        "families": families,
        "methods": methods,
        "unclear_cases": [{"family": o.case.family, "rpc": o.case.method.lstrip("/"), "case": o.case.name,
                           "status": o.code, "message": o.message[:300], "problems": o.problems}
                          for o in outcomes if o.problems],
        "cross_session": campaign.cross,
        "server_log_tracebacks": tracebacks,
        "rss_mb": {"before": rss0, "after": rss1},
        "seconds": round(time.monotonic() - t0, 1),
    }


# ----------------------------------------------------------------------------- report


#: What the same campaign gave on the code before the fixes of issue 15 (commit 5fd3678): run
#: there with this file copied in; 223 unclear were INTERNAL "Exception deserializing
#: request!" (garbage, invalid UTF-8, truncated: 146), RESOURCE_EXHAUSTED "Stream removed" for
#: huge ids (29), UNKNOWN for deep JSON / huge ints / surrogates / enums (34), ScoreBatch items
#: INTERNAL (9), a lone-surrogate key applied although refused (4), and 1 cancelled Step applied twice.
BEFORE = ("375 tried, 152 clear, 223 unclear, 0 crashes, 0 cross-session effects, with 114 tracebacks "
          "in the env server's log and 50 in the reward server's")


#: The sections of docs/reliability.md this generator writes, in their order.
_GENERATED = ("Bad input", "Poison entries", "Authorisation")


def _replace_sections(md_path: Path, sections: dict[str, str]) -> None:
    """Writes each `## <title>` section of `sections` into `md_path` in place of the one there (a new one
    goes after the last of them, or first), keeping every other section (faults, security, ...)."""
    old = md_path.read_text() if md_path.exists() else "# Reliability\n"
    marker = "\n## "
    head, *parts = old.split(marker)
    named = [(p.split("\n", 1)[0].strip(), p) for p in parts]
    out, done = [], set()
    for title, body in named:
        if title in sections:
            out.append(sections[title].strip("\n").removeprefix("## "))
            done.add(title)
        else:
            out.append(body.rstrip("\n"))
    pos = 0  # new sections go after the generated ones already there (bad input, poison, authorisation)
    for i, (title, _) in enumerate(named):
        if title in sections or title in _GENERATED:
            pos = i + 1
    for title, text in sections.items():
        if title not in done:
            out.insert(pos, text.strip("\n").removeprefix("## "))
            pos += 1
    md_path.write_text(head.rstrip("\n") + "".join("\n\n## " + p.rstrip("\n") + "\n" for p in out).replace("\n\n\n", "\n\n"))


def write_report(result: dict, seed: int, md_path: Path, json_path: Path, command: str) -> None:
    b = dict(result["bad_inputs"])
    loaded = result.get("loaded")
    if loaded:  # the rollout service with its engine loaded and the learner service count in the same figures
        b["tried"] += loaded["tried"]
        b["clear_status"] += loaded["clear_status"]
        b["unclear"] += loaded["unclear"]
        b["crashes"] += loaded["crashes"]
        b["state_changed"] = loaded["state_changed"]
    b["commit"] = result.get("commit", "")
    data = json.loads(json_path.read_text()) if json_path.exists() else {}
    data["bad_inputs"] = b
    data["bad_inputs_detail"] = {k: result[k] for k in ("families", "methods", "unclear_cases", "cross_session",
                                                       "server_log_tracebacks", "rss_mb", "seconds")}
    data["bad_inputs_detail"]["seed"] = seed
    data["bad_inputs_detail"]["command"] = command
    if loaded:
        data["bad_inputs_detail"]["loaded_services"] = loaded
    json_path.write_text(json.dumps(data, indent=2, sort_keys=True, default=sorted) + "\n")

    rows = "\n".join(
        f"| {name} | {', '.join(f['methods'])} | {f['tried']} | {f['clear_status']} | "
        f"{', '.join(f'{k} {v}' for k, v in sorted(f['codes'].items()))} |"
        for name, f in sorted(result["families"].items()))
    unclear = "\n".join(f"- `{u['rpc']}` {u['case']}: {u['status']} — {'; '.join(u['problems'])}"
                        for u in result["unclear_cases"]) or "none"
    cross = "\n".join(f"- {c}" for c in result["cross_session"]) or "none"
    rss, tb = result["rss_mb"], result["server_log_tracebacks"]
    loaded_md = ""
    if loaded:
        lrows = "\n".join(
            f"| {name} | {', '.join(f['methods'])} | {f['tried']} | {f['clear_status']} | "
            f"{', '.join(f'{k} {v}' for k, v in sorted(f['codes'].items()))} |"
            for name, f in sorted(loaded["families"].items()))
        lunclear = "\n".join(f"- `{u['service']}.{u['rpc']}` {u['family']}: {u['status']} — {'; '.join(u['problems'])}"
                             for u in loaded["unclear_cases"]) or "none"
        loaded_md = f"""
### The rollout service with its engine loaded, and the learner service

In the same run ({loaded['seconds']:.0f} s, counted in the table above): the rollout service's
own server (`rollout_service.server.build_server`) around a `RolloutWorker` with its vLLM
engine loaded (SmolLM2, CPU; the mock domain in-process, the embedded Redis buffer;
`policy_root` set, TLS off as the embedded default runs) and the learner service (tiny CPU
learner, its loop running, one checkpoint written before the cases). Every case must get the
expected status (never UNKNOWN or INTERNAL, a message of at most 1 KiB), both services must
still answer SERVING and the engine be alive after each, and nothing may change: engine policy
version, groups in the buffer, the learner's checkpoints and step (before
`{loaded['state_before']}`, after `{loaded['state_after']}`: {'unchanged' if not loaded['state_changed'] else 'CHANGED'}).
A Checkpoint with nothing new since the last is a no-op (the same folder, nothing written).

| family | RPCs | tried | clear | statuses |
| --- | --- | --- | --- | --- |
{lrows}

Unclear cases: {lunclear}
"""
    md = f"""## Bad input

Produced by `{command}` at commit {result.get('commit', '?')} (seed {seed}, {result['seconds']:.0f} s; the same figures are in
[reliability.json](reliability.json) under `bad_inputs`, with every family's status codes
and every unclear case under `bad_inputs_detail`). The generator is
[`benchmarks/reliability_inputs.py`](../benchmarks/reliability_inputs.py); a short version
of it (every family and RPC, fewer cases) runs in the suite
(`tests/test_reliability_inputs.py`).

| tried | clear status | unclear | crashes | cross-session effects |
| --- | --- | --- | --- | --- |
| {b['tried']} | {b['clear_status']} | {b['unclear']} | {b['crashes']} | {b['cross_session_effects']} |

The servers: `python -m env_service --domains mock` and `python -m reward_service`, each its
own process on loopback, the rollout service's own server and servicer in the state it
answers from while its engine loads{{loaded_where}}. RPCs hit: {', '.join(f'`{m}`' for m in result['methods'])}.

A case is **clear** when its status is the expected one and never UNKNOWN or INTERNAL; a
refusal (and a ScoreBatch item's error) carries a non-empty message of at most 1 KiB; an
OK Step to a bad tool call answers the call with a tool error and the episode goes on;
after a refused Step its session is exactly as before (a read-only `get_users` probe shows
the same tasks, step count and error count as a fresh session). After every case both
servers must still answer health SERVING (a **crash** otherwise, and the server is
restarted). **Cross-session effects**: two witness sessions opened before the campaign
(one fresh, one with the golden task created) are probed every 20 cases and at the end,
then finished (each must still score 1.0), and a golden trajectory is re-scored every 20
cases (same breakdown bytes).

| family | RPCs | tried | clear | statuses |
| --- | --- | --- | --- | --- |
{rows}

Unclear cases:
{unclear}

Cross-session effects:
{cross}

Server logs: {tb['env']} tracebacks (env), {tb['reward']} (reward) over the whole campaign.
Resident memory: env {rss['before']['env']:.0f} → {rss['after']['env']:.0f} MiB, reward
{rss['before']['reward']:.0f} → {rss['after']['reward']:.0f} MiB.
{loaded_md}
### What each bad input gets

| input | answer |
| --- | --- |
| bytes that are not the method's message (garbage, truncated mid-field, invalid UTF-8 in a string field), every RPC of every server built on `sinkflex.serving.ServiceServer` | INVALID_ARGUMENT `the request is not a valid <type> (<n> bytes): DecodeError: ... Wire format was corrupt` / `String field had bad UTF-8`; the servicer never runs, no traceback in the log |
| an id, env, split or task of any size | NOT_FOUND naming it clipped to 120 characters and its length (every status message ≤ 1 KiB, `sinkflex.errors`) |
| a request above its method's limit (UpdateWeights, the rollout and learner Status, Checkpoint, PolicyVersion, the env's ListEnvironments, ListTasks, Close: 64 KiB; Rollout: 1 MiB) | RESOURCE_EXHAUSTED `<method>: the request is <n> bytes, above this method's limit of <m> bytes`, before it is parsed (`sinkflex.limits`) |
| a Rollout above a cap (group size, tasks, turns, context, sampling) or a ScoreBatch of more than 256 items | INVALID_ARGUMENT naming the value and the cap (`rollout_service.limits.*`, `reward_service.max_batch_items`), nothing sampled or scored |
| more calls at once than the server's `max_concurrent_rpcs` | RESOURCE_EXHAUSTED `server busy: N RPCs already in progress (max_concurrent_rpcs N); retry with backoff` |
| an UpdateWeights outside the policy root or for a version never published | PERMISSION_DENIED / INVALID_ARGUMENT, the engine untouched ("Security" below) |
| an unknown enum value (`action.role` 99, a requestor of -1, a termination reason of 2^31-1) | INVALID_ARGUMENT `... got unknown role value 99`; nothing applied |
| tool-call arguments nested deeper than 64, an integer of more than 4300 digits, a lone surrogate in a key or string, anything not a JSON object | a tool error answering the call (the raw-arguments form of `tau2_adapter.convert`), the episode goes on; the scorer replays the same |
| a Step that fails | the session exactly as before the call: actions are checked whole before any tool call runs; should tau2 itself raise mid-step, the episode ends (AGENT_ERROR) and the client gets INTERNAL saying so, never a silently half-applied step |

Before these fixes (commit 5fd3678) the same campaign gave {BEFORE}.

### Cancelled and timed-out Steps

Decision: **the result is retrievable** (`env_service/core.py`, `EnvCore.step`).

- A Step whose client is already gone when it would start (cancelled, or its deadline
  passed while it waited for the session's lock behind another Step) is **not applied**:
  CANCELLED / DEADLINE_EXCEEDED.
- A Step that was running when its client went away (e.g. during a slow user-simulator
  turn) runs to completion and its response is **kept** on the session. The client resends
  the identical StepRequest and gets that response, with `info["replayed"] = "true"`,
  without the action being applied again. Any other Step on that session is
  FAILED_PRECONDITION ("the previous Step was applied after its client went away ...
  resend that same StepRequest ... or Close the session") until then, so the client's
  trajectory cannot silently diverge from the session's. Close works as always.
- The campaign checks it with a scripted user that takes 1 s to answer: cancelled after
  0.3 s, a 0.3 s deadline, and a different Step after the lost one (FAILED_PRECONDITION,
  then the resend still gets the kept answer and the episode goes on).
- The server notices that the answer was lost from gRPC's own view of the call
  (`context.is_active()` and, when the call ends, grpc-python's internal "cancelled" state,
  `env_service/server.py`). A client that cancels a millisecond Step at the very instant
  its answer is already on the wire can see CANCELLED while the server counts the answer
  as delivered (the campaign's "a Step cancelled by the client" hit that race in about 6 of
  15 tries). So `StepRequest.request_id` (optional, chosen by the client, unique within the
  session) makes a resend safe whatever the server believes: a Step with the request_id of
  the session's last applied Step is answered with that Step's kept response (info
  `replayed`), never applied again; the same id with a different request is
  INVALID_ARGUMENT. The rollout service sends the turn number as request_id; the campaign's
  two client-side cases carry one, and `tests/test_reliability_inputs.py` runs them all.
"""
    md = md.replace("{BEFORE}", BEFORE).replace("{loaded_where}", (
        ", and (below) the rollout service with its engine loaded and the learner service" if loaded else
        " (this run: without the loaded engine and the learner service, `--no-engine`)"))
    _replace_sections(md_path, {"Bad input": md})


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


SECTIONS = ("bad_inputs", "poison", "authz")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=15)
    p.add_argument("--cases", type=int, default=240, help="at least this many distinct cases")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "reliability.md")
    p.add_argument("--json", type=Path, default=ROOT / "docs" / "reliability.json")
    p.add_argument("--log-dir", type=Path, help="keep the servers' logs here")
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"which to run and write, comma-separated ({', '.join(SECTIONS)})")
    p.add_argument("--no-engine", action="store_true", help="bad_inputs without the loaded rollout engine and learner")
    a = p.parse_args()
    sections = [x.strip() for x in a.sections.split(",") if x.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if a.log_dir:
        a.log_dir.mkdir(parents=True, exist_ok=True)
    commit = _commit()
    from benchmarks import reliability_security as sec

    work = Path(tempfile.mkdtemp(prefix="sinkflex-reliability-"))
    authz_result = None
    if "bad_inputs" in sections:
        cases = generate_cases(a.seed, a.cases)
        print(f"{len(cases)} distinct cases (seed {a.seed})", flush=True)
        result = run_campaign(cases, a.log_dir, progress=lambda s: print(s, flush=True))
        result["commit"] = commit
        if not a.no_engine:
            from sinkflex.models import prepare_model

            result["loaded"] = sec.run_loaded(lambda s: print(s, flush=True), prepare_model("smollm2"), work / "loaded",
                                              authz="authz" in sections)
            authz_result = result["loaded"].pop("authz_result")
        command = (f".venv/bin/python benchmarks/reliability_inputs.py --seed {a.seed} --cases {a.cases} --sections bad_inputs"
                   + (" --no-engine" if a.no_engine else ""))
        write_report(result, a.seed, a.out, a.json, command)
        print(json.dumps(result["bad_inputs"]), json.dumps({k: result.get("loaded", {}).get(k) for k in
                                                            ("tried", "clear_status", "unclear", "state_changed")}), flush=True)
    if "poison" in sections:
        r = sec.run_poison(work / "poison")
        r["poison"]["commit"] = commit
        sec.write_poison(r, a.out, a.json, ".venv/bin/python benchmarks/reliability_inputs.py --sections poison")
        print(json.dumps(r["poison"]), flush=True)
    if "authz" in sections:
        r = authz_result if "bad_inputs" in sections and not a.no_engine else sec.run_authz_standalone(work / "authz")
        r["authz"]["commit"] = commit
        sec.write_authz(r, a.out, a.json, ".venv/bin/python benchmarks/reliability_inputs.py --sections authz")
        print(json.dumps(r["authz"]), flush=True)


if __name__ == "__main__":
    main()
