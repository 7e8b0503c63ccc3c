"""Bad input on every RPC of the env and reward services (and the rollout service while its
engine loads), over real loopback gRPC to `python -m env_service` / `python -m reward_service`:
the short version of `benchmarks/reliability_inputs.py` (docs/reliability.md). Every family
and RPC of the seeded generator, fewer cases; each must get its clear status (never UNKNOWN or
INTERNAL, a message of at most 1 KiB), leave a refused session as it was, keep the servers
serving and leave the witness sessions untouched. Plus the cases of issue 15 one by one."""

from __future__ import annotations

import json

import grpc
import pytest

from benchmarks.reliability_inputs import generate_cases, run_campaign, sample_cases
from sinkflex.errors import MAX_MESSAGE_BYTES, ServiceError, bound_message, clip
from tau2_adapter.convert import RAW_ARGUMENTS_KEY, parse_arguments

pytestmark = pytest.mark.timeout(300)


def test_generator_is_seeded_distinct_and_covers_every_rpc():
    a, b = generate_cases(15, 240), generate_cases(15, 240)
    assert [c.key for c in a] == [c.key for c in b]
    assert len({c.key for c in a}) == len(a) >= 240
    rpcs = {c.method.rsplit("/", 2)[-2].rsplit(".", 1)[-1] + "/" + c.method.rsplit("/", 1)[-1] for c in a}
    assert rpcs == {"EnvService/ListEnvironments", "EnvService/ListTasks", "EnvService/Reset", "EnvService/Step",
                    "EnvService/Close", "RewardService/Score", "RewardService/ScoreBatch", "RolloutService/Rollout",
                    "RolloutService/UpdateWeights", "RolloutService/Status"}
    assert {c.family for c in a} >= {"garbage bytes", "invalid UTF-8", "huge id", "unknown enum", "tool arguments",
                                     "out of order", "concurrency", "cancellation", "bad conversation"}


def test_short_campaign_every_answer_clear(tmp_path):
    # every special case, the immediate client-side cancel of a millisecond Step included: its
    # StepRequest carries a request_id, so its resend is answered with the kept result even when
    # the answer was already on the wire as the client cancelled (docs/reliability.md)
    every = generate_cases(15, 240)
    cases = sample_cases([c for c in every if not c.special], 100, seed=15)
    cases += [c for c in every if c.special]
    result = run_campaign(cases, tmp_path)
    b = result["bad_inputs"]
    assert b["tried"] == len(cases) >= 100
    assert b["unclear"] == 0, json.dumps(result["unclear_cases"], indent=1)[:4000]
    assert b["clear_status"] == b["tried"]
    assert b["crashes"] == 0 and b["cross_session_effects"] == 0, result["cross_session"]
    assert result["server_log_tracebacks"] == {"env": 0, "reward": 0}
    assert len(result["methods"]) == 10
    assert {c.special for c in cases} >= {"concurrent", "slow-cancel", "slow-deadline", "slow-diverge"}


def test_bounded_messages_and_clipped_quotes():
    msg = ServiceError(grpc.StatusCode.NOT_FOUND, "unknown session " + "é" * 100_000).message
    assert len(msg.encode()) <= MAX_MESSAGE_BYTES and msg.endswith("bytes]")
    assert bound_message("a\ud800b") == "a\\ud800b"  # encodable: a lone surrogate is escaped
    q = clip("x" * 20_000)
    assert q.startswith("'xxx") and q.endswith("(20000 chars)") and len(q) < 200


@pytest.mark.parametrize("text", [
    "[" * 100_000, '{"a": ' + "[" * 65 + "]" * 65 + "}", '{"a": ' + "7" * 5000 + "}", '{"\\ud800": 1}',
    '{"a": {"b": "\\udfff"}}', "[]", "{not json",
])
def test_unusable_arguments_are_raw(text):
    assert parse_arguments(text) == {RAW_ARGUMENTS_KEY: text}


def test_usable_arguments_parse():
    assert parse_arguments('{"a": ' + "[" * 60 + "]" * 60 + ', "b": "\\u00e9 🙂", "c": ' + "7" * 4000 + "}")["b"] == "é 🙂"
