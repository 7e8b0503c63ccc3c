"""`sinkflex-rl env check` catches what breaks the contract: the bookshop example env with
one fault injected at a time, served over real loopback gRPC, fails exactly the checks
that cover that fault (and the unbroken bookshop passes every check)."""

from __future__ import annotations

import importlib.util
import uuid
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from env_service.conformance import run_checks

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1024 * 1024  # a small message-size limit on both sides keeps the oversized check fast

TERMINAL = "Terminal reward: 0 before the end, finite at termination, the same on a replay"
BUDGET = "max_steps: truncated with MAX_STEPS within the budget (3), then FAILED_PRECONDITION"
CONCURRENT = "Concurrent sessions are isolated"
NOT_FOUND = "NOT_FOUND: unknown env, split, task, session"
CLOSE = "Close, then NOT_FOUND"
LIMITS = "RESOURCE_EXHAUSTED: Reset beyond max_sessions (4), a slot again after Close"


def _bookshop():
    spec = importlib.util.spec_from_file_location(f"bookshop_{uuid.uuid4().hex}", ROOT / "examples" / "bookshop" / "server.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _faulty(fault: str):
    """The bookshop servicer with `fault` injected."""
    mod = _bookshop()
    base = mod.BookshopServicer

    if fault == "none":
        return base(max_sessions=4)
    if fault == "reward_before_end":
        class Servicer(base):
            def Step(self, request, context):
                resp = super().Step(request, context)
                if not (resp.terminated or resp.truncated):
                    resp.reward = 0.25
                return resp
    elif fault == "reward_differs_on_replay":
        class Servicer(base):
            ended = 0

            def Step(self, request, context):
                resp = super().Step(request, context)
                if resp.terminated:
                    with self.lock:
                        resp.reward, Servicer.ended = float(Servicer.ended % 2), Servicer.ended + 1
                return resp
    elif fault == "budget_terminates":
        class Servicer(base):
            def Step(self, request, context):
                resp = super().Step(request, context)
                if resp.truncated:
                    resp.truncated, resp.terminated = False, True
                return resp
    elif fault == "ignores_max_steps":
        class Servicer(base):
            def Reset(self, request, context):
                request.max_steps = 0
                return super().Reset(request, context)
    elif fault == "shared_step_counter":
        class Shared(mod.Session):  # every session reads and writes one step counter
            count = 0
            steps = property(lambda self: Shared.count, lambda self, v: setattr(Shared, "count", v))

        mod.Session = Shared
        Servicer = base
    elif fault == "internal_for_unknown_session":
        class Servicer(base):
            def _session(self, sid, context):
                with self.lock:
                    if sid not in self.sessions:
                        context.abort(grpc.StatusCode.INTERNAL, "KeyError")
                return super()._session(sid, context)
    elif fault == "no_session_limit":
        class Servicer(base):
            pass
        return Servicer(max_sessions=10**6)
    else:
        raise ValueError(fault)
    return Servicer(max_sessions=4)


def _serve(servicer):
    opts = [("grpc.max_send_message_length", LIMIT), ("grpc.max_receive_message_length", LIMIT)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=opts)
    mod = _bookshop()
    mod.env_pb2_grpc.add_EnvServiceServicer_to_server(servicer, server)
    h = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(h, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    h.set("", health_pb2.HealthCheckResponse.SERVING)
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("fault, failed, says", [
    ("none", set(), ""),
    ("reward_before_end", {TERMINAL, BUDGET, CONCURRENT}, "reward 0.25 on step 1, before the episode ended"),
    ("reward_differs_on_replay", {TERMINAL, CONCURRENT}, "the same episode got reward 0, then 1"),
    ("budget_terminates", {BUDGET, CONCURRENT}, "truncated=False terminated=True (Gymnasium: a spent budget truncates)"),
    ("ignores_max_steps", {BUDGET, CONCURRENT}, "after 3 steps of a 3-step budget: truncated=False terminated=False"),
    ("shared_step_counter", {CONCURRENT}, "; alone: after 3"),
    ("internal_for_unknown_session", {NOT_FOUND, CLOSE}, "expected NOT_FOUND, got INTERNAL: KeyError"),
    ("no_session_limit", {LIMITS}, "expected RESOURCE_EXHAUSTED, the call succeeded"),
])
def test_env_check_catches_the_fault(fault, failed, says):
    server, address = _serve(_faulty(fault))
    try:
        results = run_checks(address, timeout=10, ready_timeout=5, max_message_bytes=LIMIT, max_sessions=4)
    finally:
        server.stop(0)
    assert len(results) == 16
    assert {r.name for r in results if not r.passed} == failed, [(r.name, r.detail) for r in results if not r.passed]
    if says:
        assert any(says in r.detail for r in results if not r.passed), [r.detail for r in results if not r.passed]
