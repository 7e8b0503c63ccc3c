"""The env service's core: sessions over the served tau2 domains, as plain Python.

`EnvCore` answers the five EnvService calls with protobuf messages and raises
`sinkflex.errors.ServiceError` for bad input; the gRPC servicer (`server.py`) and the
in-process client (`client.LocalEnvClient`) both call it, so both behave the same.

Sessions: each Reset builds a fresh tau2 environment (its own DB) and orchestrator,
under a new random session id. At most `max_sessions` are open (a Reset beyond:
RESOURCE_EXHAUSTED). A session idle longer than `session_ttl_seconds` is freed (checked
on every call and by a reaper thread); calls on it then fail with NOT_FOUND, as on a
closed or unknown session. Calls on one session are serialised by its lock; calls on
different sessions run in parallel.

A Step whose client is gone (cancelled, or its deadline passed) is never lost nor applied
twice: one that has not started when the client goes (e.g. waiting for the session's lock)
is not applied (CANCELLED / DEADLINE_EXCEEDED); one that was being applied completes, and
its response is kept on the session. Resending the same StepRequest then returns that
response (info `replayed: "true"`) without applying it again; any other Step on the session
is FAILED_PRECONDITION until then (the client's trajectory would silently diverge from the
session's), and Close works as always. A client that sets `StepRequest.request_id` may resend
its last Step whatever the server believes was delivered (a cancel that races the answer on
the wire): the same request_id is answered with the kept response, never applied twice.
See docs/reliability.md.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Callable, Optional

from env_service.catalog import Catalog
from env_service.config import EnvServiceConfig
from env_service.session import TERMINATION_TO_PB, TRUNCATION_REASONS, Tau2Session, new_session_id
from sinkflex.api.common.v1 import common_pb2
from sinkflex.api.env.v1 import env_pb2
import grpc

from sinkflex.errors import ServiceError, clip, failed_precondition, invalid_argument, not_found, resource_exhausted

log = logging.getLogger(__name__)

_GONE_MEMORY = 100_000  # how many closed/expired ids are remembered for clearer NOT_FOUND messages


def _replayed(response: env_pb2.StepResponse) -> env_pb2.StepResponse:
    """A copy of a kept Step response, marked info["replayed"] = "true"."""
    out = env_pb2.StepResponse()
    out.CopyFrom(response)
    out.info["replayed"] = "true"
    return out


class EnvCore:
    """Session management and the EnvService calls over tau2 domains.

    Args:
        config: the service configuration.
        catalog: the loaded domains (built from `config.domains` if None; takes seconds).
    """

    def __init__(self, config: EnvServiceConfig, catalog: Catalog | None = None):
        self.config = config
        self.catalog = catalog if catalog is not None else Catalog(config.domains, task_files=config.task_files)
        self._sessions: dict[str, Tau2Session] = {}
        self._reserved = 0  # sessions being built by an in-flight Reset
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> "closed" / "expired"
        self._lock = threading.Lock()
        self._reaper_stop = threading.Event()
        self._reaper: threading.Thread | None = None
        #: Called with the number of open sessions whenever it changes (e.g. a Prometheus gauge).
        self.on_sessions_changed: Callable[[int], None] | None = None

    def _changed(self) -> None:
        if self.on_sessions_changed is not None:
            self.on_sessions_changed(len(self._sessions))

    # -- EnvService ------------------------------------------------------------------------
    def list_environments(self) -> list[env_pb2.EnvironmentInfo]:
        return [
            env_pb2.EnvironmentInfo(
                name=d.name,
                description=d.description,
                splits=list(d.splits),
                num_tasks=len(d.tasks),
                supports_solo=d.supports_solo,
            )
            for d in self.catalog.domains.values()
        ]

    def list_tasks(self, env: str, split: str = "") -> list[env_pb2.TaskInfo]:
        domain = self.catalog.get(env)
        out = []
        for task_id in domain.task_ids(split):
            desc = domain.tasks[task_id].description
            out.append(env_pb2.TaskInfo(task_id=task_id, description=(desc.purpose or "") if desc else ""))
        return out

    def reset(self, request: env_pb2.ResetRequest) -> env_pb2.ResetResponse:
        """Opens a session and returns the first observation.

        Raises (ServiceError): NOT_FOUND unknown env/task/split; INVALID_ARGUMENT negative
        max_steps, solo mode where unsupported or the task has no ticket;
        RESOURCE_EXHAUSTED max_sessions open; UNAVAILABLE the user LLM failed.
        """
        domain = self.catalog.get(request.env)
        if request.task_id:
            task = domain.task(request.task_id)
        else:
            task = domain.task(domain.sample_task_id(request.split, request.seed))
        if request.max_steps < 0:
            raise invalid_argument(f"max_steps must be >= 0 (0: the server default), got {request.max_steps}")
        if request.solo_mode:
            if not domain.supports_solo:
                raise invalid_argument(f"env {domain.name!r} does not support solo mode")
            from tau2.agent.llm_agent import LLMSoloAgent

            if not LLMSoloAgent.check_valid_task(task):
                raise invalid_argument(f"task {task.id!r} of env {domain.name!r} cannot run in solo mode (no ticket or no expected actions)")
        self._sweep()
        with self._lock:
            if len(self._sessions) + self._reserved >= self.config.max_sessions:
                raise resource_exhausted(
                    f"{len(self._sessions) + self._reserved} sessions open, the maximum is {self.config.max_sessions}: Close some first"
                )
            self._reserved += 1
        try:
            session = Tau2Session(
                session_id=new_session_id(),
                domain=domain,
                task=task,
                solo_mode=request.solo_mode,
                max_steps=request.max_steps or self.config.default_max_steps,
                max_errors=self.config.max_errors,
                user_model=self.config.user_model,
                user_llm_args=self.config.user_llm_args(),
                seed=request.seed if request.seed else None,
                reward_on_termination=self.config.reward_on_termination,
            )
            observation = session.reset()
            with self._lock:
                self._sessions[session.session_id] = session
                self._changed()
        finally:
            with self._lock:
                self._reserved -= 1
        info = session.info()
        if request.solo_mode and task.ticket:
            info["ticket"] = task.ticket
        return env_pb2.ResetResponse(
            session_id=session.session_id,
            task_id=task.id,
            observation=observation,
            tools=session.tool_specs(),
            system_prompt=session.system_prompt,
            policy=session.policy,
            info=info,
        )

    def step(self, request: env_pb2.StepRequest,
             client_gone: Optional[Callable[[], Optional[grpc.StatusCode]]] = None,
             applied: Optional[list] = None) -> env_pb2.StepResponse:
        """Applies one agent action.

        `client_gone()` says whether the caller is still waiting: None, or CANCELLED /
        DEADLINE_EXCEEDED (the gRPC servicer passes one; see the module docstring for what
        happens to a Step whose client is gone). `applied`, when given, receives one
        `(session, request bytes, action count)` once the Step has been applied, for
        `keep_undelivered` should the client turn out to be gone after all.

        Raises (ServiceError): NOT_FOUND unknown/closed/expired session; FAILED_PRECONDITION
        the episode has ended, or the previous Step's answer was never delivered and this is
        not its resend; INVALID_ARGUMENT a malformed action (see Tau2Session.step);
        CANCELLED / DEADLINE_EXCEEDED the client went away before the Step started (not applied).
        """
        session = self._get(request.session_id)
        with session.lock:
            session.last_used = time.monotonic()
            gone = client_gone() if client_gone is not None else None
            if gone is not None:
                raise ServiceError(gone, f"session {session.session_id}: the client went away ({gone.name}) "
                                         "before the Step started; it was not applied")
            data = request.SerializeToString(deterministic=True)
            if request.request_id and session.last_step is not None and session.last_step[0] == request.request_id:
                _, kept, response = session.last_step
                if data != kept:
                    raise invalid_argument(f"session {session.session_id}: request_id {clip(request.request_id)} was already "
                                           "applied with a different StepRequest; a resend must be identical")
                session.undelivered = None
                session.last_step_replayed = True  # a late keep_undelivered of its first answer must not block
                return _replayed(response)
            if session.undelivered is not None:
                kept, response = session.undelivered
                if data != kept:
                    raise failed_precondition(
                        f"session {session.session_id}: the previous Step was applied after its client went away "
                        "(cancelled or past its deadline) and its answer was never delivered; resend that same "
                        "StepRequest to get its result, or Close the session")
                session.undelivered = None
                return _replayed(response)
            response = self._apply(session, request)
            # the last applied Step, if it had an id (one without clears it: ids compare with the last Step only)
            session.last_step = (request.request_id, data, response) if request.request_id else None
            session.last_step_replayed = False
            gone = client_gone() if client_gone is not None else None
            if gone is not None:
                session.undelivered = (data, response)
                log.info("session %s: Step applied after the client went away (%s); kept for its resend",
                         session.session_id, gone.name)
            elif applied is not None:
                applied.append((session, data, session.num_actions))
            return response

    def keep_undelivered(self, session: Tau2Session, data: bytes, response: env_pb2.StepResponse, num_actions: int) -> None:
        """Keeps a Step's response for its resend: the transport learnt after the Step that its
        client had gone. A no-op when the session has stepped since (or was closed)."""
        with session.lock:
            if session.last_step_replayed and session.last_step is not None and session.last_step[1] == data:
                return  # its client resent it by request_id and got the answer already (a late cancel callback)
            if session.num_actions == num_actions and session.undelivered is None and not self._is_gone(session):
                session.undelivered = (data, response)
                log.info("session %s: the answer of Step %d was not delivered (client gone); kept for its resend",
                         session.session_id, num_actions)

    def _is_gone(self, session: Tau2Session) -> bool:
        with self._lock:
            return self._sessions.get(session.session_id) is not session

    def _apply(self, session: Tau2Session, request: env_pb2.StepRequest) -> env_pb2.StepResponse:
        observation = session.step(request.action, request.stop)
        session.last_used = time.monotonic()
        reason = session.termination_reason if session.done else None
        return env_pb2.StepResponse(
            observation=observation,
            reward=session.reward if (session.done and session.reward is not None) else 0.0,
            terminated=session.done and reason not in TRUNCATION_REASONS,
            truncated=session.done and reason in TRUNCATION_REASONS,
            termination_reason=TERMINATION_TO_PB[reason] if reason else common_pb2.TERMINATION_REASON_UNSPECIFIED,
            info=session.info(),
        )

    def close(self, session_id: str) -> None:
        """Frees a session. Raises ServiceError NOT_FOUND: unknown, closed or expired."""
        self._get(session_id)
        with self._lock:
            if self._sessions.pop(session_id, None) is not None:
                self._forget(session_id, "closed")
                self._changed()

    # -- sessions --------------------------------------------------------------------------
    @property
    def num_sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def session(self, session_id: str) -> Tau2Session:
        """The live session (for in-process inspection, e.g. its tau2 environment)."""
        return self._get(session_id)

    def _get(self, session_id: str) -> Tau2Session:
        if not session_id:
            raise not_found("empty session_id")
        with self._lock:
            session = self._sessions.get(session_id)
            if session is not None and self._expired(session):
                del self._sessions[session_id]
                self._forget(session_id, "expired")
                self._changed()
                session = None
            if session is None:
                why = self._gone.get(session_id)
                if why == "expired":
                    raise not_found(f"session {session_id} expired (idle longer than {self.config.session_ttl_seconds:g} s)")
                if why == "closed":
                    raise not_found(f"session {session_id} was closed")
                raise not_found(f"unknown session {clip(session_id)}")
            session.last_used = time.monotonic()
            return session

    def _expired(self, session: Tau2Session) -> bool:
        return not session.lock.locked() and time.monotonic() - session.last_used > self.config.session_ttl_seconds

    def _forget(self, session_id: str, why: str) -> None:
        self._gone[session_id] = why
        while len(self._gone) > _GONE_MEMORY:
            self._gone.popitem(last=False)

    def _sweep(self) -> int:
        """Frees expired sessions; returns how many."""
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if self._expired(s)]
            for sid in expired:
                del self._sessions[sid]
                self._forget(sid, "expired")
            if expired:
                self._changed()
        if expired:
            log.info("freed %d expired sessions", len(expired))
        return len(expired)

    def start_reaper(self, interval: float | None = None) -> None:
        """Frees expired sessions every `interval` seconds (default ttl/4, 1..60 s) in a daemon thread."""
        if self._reaper is not None:
            return
        every = interval or min(60.0, max(1.0, self.config.session_ttl_seconds / 4))

        def loop():
            while not self._reaper_stop.wait(every):
                self._sweep()

        self._reaper = threading.Thread(target=loop, name="env-session-reaper", daemon=True)
        self._reaper.start()

    def shutdown(self) -> None:
        """Stops the reaper and frees every session."""
        self._reaper_stop.set()
        with self._lock:
            for sid in list(self._sessions):
                self._forget(sid, "closed")
            self._sessions.clear()
