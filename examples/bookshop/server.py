"""Bookshop: a tiny environment plugged into SinkFlex-RL from outside, over gRPC.

It shows that any server implementing the EnvService contract is a SinkFlex environment.
It imports only the generated contract (`sinkflex.api.*`) plus grpcio and the standard
library -- nothing of env_service or tau2.

The domain: a bookshop with a catalogue and members. The agent serves one request per
episode (the first observation is the customer's message) with four tools; it then stops.
The checker compares the final shop state with the state the task's golden actions
produce (like tau2's DB check): reward 1.0 when they match, else 0.0, given on the
terminating step.

    python examples/bookshop/server.py --port 50061
    sinkflex-rl env check 127.0.0.1:50061
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import signal
import threading
import uuid
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2, env_pb2_grpc

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
ENV_NAME = "bookshop"

# -- the domain -------------------------------------------------------------------------
INITIAL_DB = {
    "books": {
        "b1": {"title": "Dune", "author": "Frank Herbert", "copies": 2},
        "b2": {"title": "Emma", "author": "Jane Austen", "copies": 1},
        "b3": {"title": "Ulysses", "author": "James Joyce", "copies": 0},
        "b4": {"title": "Beloved", "author": "Toni Morrison", "copies": 3},
    },
    "members": {"m1": {"name": "Ada", "loans": []}, "m2": {"name": "Alan", "loans": ["b4"]}},
}


class ToolError(Exception):
    pass


def search_books(db: dict, query: str) -> list:
    """Find books whose title or author contains `query` (case-insensitive)."""
    q = query.lower()
    return [{"book_id": k, **v} for k, v in db["books"].items() if q in v["title"].lower() or q in v["author"].lower()]


def get_member(db: dict, member_id: str) -> dict:
    """A member's name and current loans."""
    if member_id not in db["members"]:
        raise ToolError(f"member {member_id} not found")
    return {"member_id": member_id, **db["members"][member_id]}


def lend_book(db: dict, member_id: str, book_id: str) -> dict:
    """Lend a book to a member (one copy leaves the shelf)."""
    member = db["members"].get(member_id)
    book = db["books"].get(book_id)
    if member is None:
        raise ToolError(f"member {member_id} not found")
    if book is None:
        raise ToolError(f"book {book_id} not found")
    if book["copies"] < 1:
        raise ToolError(f"no copy of {book_id} left")
    book["copies"] -= 1
    member["loans"].append(book_id)
    return {"member_id": member_id, "loans": list(member["loans"])}


def return_book(db: dict, member_id: str, book_id: str) -> dict:
    """A member returns a book they borrowed."""
    member = db["members"].get(member_id)
    if member is None:
        raise ToolError(f"member {member_id} not found")
    if book_id not in member["loans"]:
        raise ToolError(f"member {member_id} has not borrowed {book_id}")
    member["loans"].remove(book_id)
    db["books"][book_id]["copies"] += 1
    return {"member_id": member_id, "loans": list(member["loans"])}


def _schema(**props: str) -> dict:
    return {"type": "object", "properties": {k: {"type": "string", "description": v} for k, v in props.items()},
            "required": list(props), "additionalProperties": False}


TOOLS = {
    "search_books": (search_books, _schema(query="part of a title or an author's name")),
    "get_member": (get_member, _schema(member_id="the member id, e.g. m1")),
    "lend_book": (lend_book, _schema(member_id="the member id", book_id="the book id, e.g. b1")),
    "return_book": (return_book, _schema(member_id="the member id", book_id="the book id")),
}

TASKS = {
    "lend-dune": ("Hi, I'm Ada (member m1). Could I borrow Dune, please?", [("lend_book", {"member_id": "m1", "book_id": "b1"})]),
    "return-beloved": ("Alan here, m2. I'm returning Beloved.", [("return_book", {"member_id": "m2", "book_id": "b4"})]),
    "swap": ("I'm Alan (m2): I return Beloved and would like Emma instead.",
             [("return_book", {"member_id": "m2", "book_id": "b4"}), ("lend_book", {"member_id": "m2", "book_id": "b2"})]),
    "ulysses": ("Ada (m1) wants Ulysses if there is a copy; otherwise nothing to do.", []),
}
SPLITS = {"train": ["lend-dune", "return-beloved"], "test": ["swap", "ulysses"]}
POLICY = "You are a bookshop assistant. Use the tools to serve the customer's request, then stop. Never lend a book without a copy."


def golden_db(task_id: str) -> dict:
    """The checker's reference: the shop state after the task's golden actions."""
    db = copy.deepcopy(INITIAL_DB)
    for name, args in TASKS[task_id][1]:
        TOOLS[name][0](db, **args)
    return db


# -- sessions ---------------------------------------------------------------------------
class Session:
    def __init__(self, task_id: str, max_steps: int):
        self.task_id = task_id
        self.db = copy.deepcopy(INITIAL_DB)
        self.steps = 0
        self.max_steps = max_steps
        self.done = False
        self.lock = threading.Lock()

    def call(self, call: common_pb2.ToolCall) -> common_pb2.Message:
        out = common_pb2.Message(role=common_pb2.ROLE_TOOL, tool_call_id=call.id, requestor=common_pb2.ROLE_ASSISTANT)
        try:
            if call.name not in TOOLS:
                raise ToolError(f"unknown tool {_clip(call.name)!r}; tools: {', '.join(TOOLS)}")
            try:
                args = json.loads(call.arguments_json or "{}")
            except json.JSONDecodeError as err:
                raise ToolError(f"arguments are not valid JSON: {err}") from None
            except RecursionError:  # untrusted model output: nesting deeper than the parser's stack
                raise ToolError("arguments are nested too deeply to parse") from None
            if not isinstance(args, dict):
                raise ToolError("arguments must be a JSON object")
            schema = TOOLS[call.name][1]
            missing = [k for k in schema["required"] if k not in args]
            extra = [k for k in args if k not in schema["properties"]]
            bad = [k for k, v in args.items() if not isinstance(v, str)]
            if missing or extra or bad:
                raise ToolError(f"bad arguments for {call.name}: missing {missing}, unexpected "
                                f"{[_clip(k, 60) for k in extra[:10]]}, not strings {[_clip(k, 60) for k in bad[:10]]}")
            out.content = json.dumps(TOOLS[call.name][0](self.db, **args))
        except ToolError as err:
            out.content = f"Error: {err}"
            out.error = True
        return out


def _clip(value: str, limit: int = 200) -> str:
    """`value` cut to `limit` characters for an error message (gRPC sends it in a header; input is untrusted)."""
    return value if len(value) <= limit else f"{value[:limit]}… ({len(value)} chars)"


class BookshopServicer(env_pb2_grpc.EnvServiceServicer):
    def __init__(self, max_sessions: int = 256):
        self.sessions: dict[str, Session] = {}
        self.max_sessions = max_sessions
        self.lock = threading.Lock()

    def ListEnvironments(self, request, context):
        return env_pb2.ListEnvironmentsResponse(environments=[env_pb2.EnvironmentInfo(
            name=ENV_NAME, description="A tiny bookshop: lend and return books.", splits=list(SPLITS),
            num_tasks=len(TASKS), supports_solo=True)])

    def ListTasks(self, request, context):
        if request.env != ENV_NAME:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown env {_clip(request.env)!r}; this server serves {ENV_NAME!r}")
        if request.split and request.split not in SPLITS:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown split {_clip(request.split)!r}; splits: {', '.join(SPLITS)}")
        ids = SPLITS[request.split] if request.split else list(TASKS)
        return env_pb2.ListTasksResponse(tasks=[env_pb2.TaskInfo(task_id=i, description=TASKS[i][0]) for i in ids])

    def Reset(self, request, context):
        if request.env != ENV_NAME:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown env {_clip(request.env)!r}; this server serves {ENV_NAME!r}")
        task_id = request.task_id
        if not task_id:
            if request.split and request.split not in SPLITS:
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown split {_clip(request.split)!r}")
            task_id = random.Random(request.seed).choice(SPLITS[request.split] if request.split else list(TASKS))
        if task_id not in TASKS:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown task {_clip(task_id)!r} in env {ENV_NAME!r}")
        with self.lock:
            if len(self.sessions) >= self.max_sessions:
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.max_sessions} sessions open: Close some first")
            sid = uuid.uuid4().hex
            self.sessions[sid] = Session(task_id, request.max_steps or 30)
        tools = [common_pb2.ToolSpec(name=n, description=fn.__doc__ or "", parameters_json_schema=json.dumps(s))
                 for n, (fn, s) in TOOLS.items()]
        first = common_pb2.Message(role=common_pb2.ROLE_USER, content=TASKS[task_id][0])
        return env_pb2.ResetResponse(session_id=sid, task_id=task_id, observation=[first], tools=tools,
                                     system_prompt=POLICY, policy=POLICY)

    def _session(self, sid: str, context) -> Session:
        with self.lock:
            s = self.sessions.get(sid)
        if s is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown or closed session {_clip(sid)!r}")
        return s

    def Step(self, request, context):
        s = self._session(request.session_id, context)
        with s.lock:
            if s.done:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"session {_clip(request.session_id)} has ended; Reset a new one")
            s.steps += 1
            if request.stop:
                s.done = True
                reward = 1.0 if s.db == golden_db(s.task_id) else 0.0
                return env_pb2.StepResponse(reward=reward, terminated=True,
                                            termination_reason=common_pb2.TERMINATION_REASON_AGENT_STOP,
                                            info={"db_match": str(reward == 1.0).lower()})
            if request.action.tool_calls:
                obs = [s.call(c) for c in request.action.tool_calls]
            else:
                obs = [common_pb2.Message(role=common_pb2.ROLE_USER, content="Please use the tools, then stop.")]
            if s.steps >= s.max_steps:
                s.done = True
                return env_pb2.StepResponse(observation=obs, truncated=True,
                                            termination_reason=common_pb2.TERMINATION_REASON_MAX_STEPS)
            return env_pb2.StepResponse(observation=obs)

    def Close(self, request, context):
        with self.lock:
            if self.sessions.pop(request.session_id, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"unknown or closed session {_clip(request.session_id)!r}")
        return env_pb2.CloseResponse()


def serve(host: str, port: int) -> None:
    opts = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=opts)
    env_pb2_grpc.add_EnvServiceServicer_to_server(BookshopServicer(), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    name = env_pb2.DESCRIPTOR.services_by_name["EnvService"].full_name
    reflection.enable_server_reflection([name, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    for service in ("", name):
        health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    print(f"bookshop env serving on {host}:{bound}", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop(5).wait()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="The bookshop example environment (EnvService over gRPC).")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=50061)
    a = p.parse_args()
    serve(a.host, a.port)
